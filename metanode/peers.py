"""Following peers: one task per peer pulls its claim log, and the reconciliation that lets two
boxes sharing most claims find the rest cheaply (docs/peers.md).

A `Follower` pulls pages of `GET /api/claims/log` after its cursor and hands each to the
node (`Host.apply_peer_page`), which verifies every claim exactly as `POST /api/claims` does and
stores the valid ones together with the page's cursor in one truth transaction; so the cursor
in the truth always names exactly the claims stored, whatever crashes when. Caught up, it polls
every `peer_poll_s`; on an error it waits, doubling from `peer_retry_s` up to
`peer_max_backoff_s`. Each follower is its own task with its own connection: a peer that is
slow, down or hostile only ever delays itself.

`Responder` answers `POST /api/claims/reconcile` for the peers of this box: the sorted identities
of every stored claim (`reconcile.Items`), built off the loop and kept until the log moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from metanode import jsonl, reconcile
from metanode.errors import (
    InvalidJson,
    MetanodeError,
    PeerCannotReconcile,
    PeerCursorRefused,
    PeerFailed,
    PeerIsSelf,
    UnknownPeer,
)
from metanode.truth import ID_BYTES, PeerRow

log = logging.getLogger(__name__)
FETCH_CHUNK = 1000  # identities asked for per reconciliation fetch (a POST /api/claims batch)
RECONCILE = "/api/claims/reconcile"  # a peer without it (404, 405) is an older version
# the answering data directory's instance id, on the claim log's and reconciliation's answers:
# a follower that finds its own there was added at this box's own address
SELF_HEADER = "X-Metanode-Instance"
# what a refusal of the peer's means for whoever reads `last_error`: what to do about it
_HINTS = {
    401: "; the other box does not know the token (revoked, or mistyped): make a new one there "
    "(`metanode peers token create --name N`) and give it here with `metanode peers add URL "
    "--token T --name <this peer's name>`",
}


@dataclass(frozen=True)
class PullConfig:
    page: int  # claims per log page
    poll_s: float
    retry_s: float
    max_backoff_s: float
    timeout_s: float


@dataclass(frozen=True)
class PageCounts:
    accepted: int
    duplicate: int
    stale: int
    rejected: int


class Host(Protocol):
    """What a follower needs of the node."""

    def peer(self, name: str) -> PeerRow | None: ...

    async def apply_peer_page(
        self, name: str, items: list[object], cursor: str | None
    ) -> PageCounts: ...

    async def own_items(self) -> reconcile.Items: ...

    def claim_count(self) -> int: ...

    @property
    def instance(self) -> str: ...


@dataclass
class SyncReport:
    """What one reconciliation with a peer did and sent (`metanode peers sync`)."""

    rounds: int = 0
    fingerprints_sent: int = 0
    fingerprints_received: int = 0
    ids_received: int = 0
    fetched: int = 0  # claims asked for and received
    have: int = 0  # claims this box holds that the peer does not
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def as_json(self) -> dict[str, float]:
        return dict(vars(self))


class Follower:
    """One peer's pull loop, and its status (`peers list`)."""

    def __init__(self, row: PeerRow, host: Host, config: PullConfig, first_sync: bool) -> None:
        self.name = row.name
        self.cursor = row.cursor
        self.host = host
        self.config = config
        self.first_sync = first_sync
        self.last_error = ""
        self.is_self = False  # its peer's answers were this box's own: it stopped
        self.last_sync: SyncReport | None = None
        self.behind_since: float | None = time.monotonic()  # None: caught up
        self.http = httpx.AsyncClient(
            base_url=row.url.rstrip("/"),
            headers={"Authorization": f"Bearer {row.token}"},
            timeout=config.timeout_s,
        )
        self._wake = asyncio.Event()
        self.tried = asyncio.Event()  # the first pull (or reconciliation) answered or failed
        self.task: asyncio.Task[None] | None = None

    def lag_s(self) -> float:
        """Seconds since this follower last had every claim the peer had shown it (0: now)."""
        return 0.0 if self.behind_since is None else time.monotonic() - self.behind_since

    async def run(self) -> None:
        """Reconcile first if asked, then pull pages for ever; errors back off, never end it.

        The first sync (`peers add` on a box that already holds claims) reconciles, then
        follows the log from where the peer's log stood when reconciliation began; it is tried
        again, like a page, while the peer is down or refuses. Only a peer that cannot
        reconcile (`PeerCannotReconcile`) has its log read from the start instead, which does
        the same work at the cost of every claim the box already holds."""
        reconciling = self.first_sync
        delay = self.config.retry_s
        refused = False  # a cursor was refused, and none was taken since
        while True:
            try:
                if reconciling:
                    await self.sync(set_cursor=True)
                    reconciling, more = False, True
                else:
                    had_cursor = bool(self.cursor)
                    more = await self.pull_once()
                    refused = refused and not had_cursor  # a cursor of its log was taken
            except UnknownPeer:
                return  # removed meanwhile
            except PeerIsSelf as exc:  # nothing to follow: retried, it was for ever
                self.is_self = True
                self._failed(exc)
                return
            except PeerCannotReconcile:  # not a failure: the log does the same work
                reconciling = False
                log.info("peer %s cannot reconcile; reading its log from the start", self.name)
                continue
            except PeerCursorRefused as exc:  # a rewound log: its seqs would be given again
                if not refused:  # once: a cursor refused again is a failure, backed off
                    refused, reconciling, self.cursor = True, True, ""  # "": the start
                    log.warning(
                        "peer %s refused this box's cursor into its log (restored from a "
                        "backup?): reconciling with it again",
                        self.name,
                    )
                    continue
                delay = await self._back_off(exc, delay)
                continue
            except MetanodeError as exc:
                delay = await self._back_off(exc, delay)
                continue
            self.tried.set()
            delay = self.config.retry_s
            if not more:
                await self._pause(self.config.poll_s)

    async def _back_off(self, exc: MetanodeError, delay: float) -> float:
        """Say the failure, wait `delay` (or until poked), and give the next, longer delay."""
        self._failed(exc)
        await self._pause(delay)
        return min(delay * 2, self.config.max_backoff_s)

    def _failed(self, exc: MetanodeError) -> None:
        """A failed pull: said in `last_error`, and the follower counts as behind from the
        first failure on (a peer that stopped answering is not one it has kept up with)."""
        self.last_error = f"{exc.slug}: {exc.message}"
        self.behind_since = self.behind_since or time.monotonic()
        self.tried.set()
        log.warning("peer %s: %s", self.name, self.last_error)

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less if `poke` is called (a sync, a changed peer)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    def poke(self) -> None:
        self._wake.set()

    async def _call(self, method: str, path: str, **kwargs: Any) -> tuple[Any, int, int]:
        """(the peer's JSON answer, bytes sent, bytes received); `PeerFailed` for no answer, a
        refusal, or something that is not JSON (`PeerCannotReconcile`: it has no `RECONCILE`)."""
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise PeerFailed(f"{self.http.base_url} did not answer: {exc!r}") from None
        sent = len(response.request.content)
        if response.headers.get(SELF_HEADER) == self.host.instance:  # never polled for ever
            raise PeerIsSelf(f"{self.http.base_url} is this box itself (its instance id is ours)")
        if path == RECONCILE and response.status_code in (404, 405):
            raise PeerCannotReconcile(f"{path} answered {response.status_code}")
        try:
            body = jsonl.loads(response.content, f"{path}'s answer")
        except InvalidJson:
            raise PeerFailed(
                f"{path} answered {response.status_code}, not JSON: no metanode answers at "
                f"{self.http.base_url}"
            ) from None
        if response.status_code != 200:
            slug = body.get("error") if isinstance(body, dict) else None
            said = f"{path} answered {response.status_code} {slug}"
            if slug == "invalid_cursor":
                raise PeerCursorRefused(said)
            raise PeerFailed(said + _HINTS.get(response.status_code, ""))
        return body, sent, len(response.content)

    async def pull_once(self) -> bool:
        """Pull and store one page after the cursor; whether the peer said there is more."""
        params = {"limit": str(self.config.page)}
        if self.cursor:
            params["after"] = self.cursor
        body, _, _ = await self._call("GET", "/api/claims/log", params=params)
        items, cursor, more = _log_page(body)
        await self.host.apply_peer_page(self.name, items, cursor)
        self.cursor = cursor
        self.last_error = ""
        if more:
            self.behind_since = self.behind_since or time.monotonic()
        else:
            self.behind_since = None
        return more

    async def sync(self, set_cursor: bool = False) -> SyncReport:
        """Reconcile with the peer and fetch the claims this box lacks. With `set_cursor` (the
        first sync) the last fetch also moves the cursor to where the peer's log stood when
        reconciliation began: every claim stored before that point was in the sets compared."""
        report = SyncReport()
        started = time.perf_counter()
        session = reconcile.Session(await self.host.own_items())
        message = session.start()
        head: str | None = None
        while message:
            reply: list[reconcile.Entry] = []
            for part in reconcile.chunks(message):  # each of at most REQUEST_RANGES ranges
                body, sent, got = await self._call(
                    "POST", RECONCILE, json={"ranges": reconcile.encode(part)}
                )
                report.bytes_sent += sent
                report.bytes_received += got
                if not isinstance(body, dict) or not isinstance(body.get("head"), str):
                    raise PeerFailed("the reconciliation answer has no head cursor")
                head = head or body["head"]
                try:
                    reply += reconcile.decode_reply(body.get("ranges"), ID_BYTES)
                except MetanodeError as exc:
                    raise PeerFailed(
                        f"the reconciliation answer is malformed: {exc.message}"
                    ) from None
            message = session.step(reply)
        needed = sorted(session.need)
        chunks = [needed[n : n + FETCH_CHUNK] for n in range(0, len(needed), FETCH_CHUNK)] or [[]]
        for number, chunk in enumerate(chunks, 1):
            cursor = head if set_cursor and number == len(chunks) else None
            report.fetched += await self._fetch(chunk, cursor, report)
        if set_cursor and head is not None:
            self.cursor = head
        for name in ("rounds", "fingerprints_sent", "fingerprints_received", "ids_received"):
            setattr(report, name, getattr(session, name))
        report.have = len(session.have)
        report.seconds = round(time.perf_counter() - started, 3)
        self.last_sync = report
        return report

    async def _fetch(self, ids: Sequence[bytes], cursor: str | None, report: SyncReport) -> int:
        """Ask the peer for the claims with these identities and store them (with `cursor`)."""
        items: list[object] = []
        if ids:
            body, sent, got = await self._call(
                "POST",
                RECONCILE,
                json={"fetch": [reconcile.encode_id(i) for i in ids]},
            )
            report.bytes_sent += sent
            report.bytes_received += got
            if not isinstance(body, dict) or not isinstance(body.get("claims"), list):
                raise PeerFailed("the fetch answer has no claims array")
            items = body["claims"]
        if items or cursor is not None:
            await self.host.apply_peer_page(self.name, items, cursor)
        return len(items)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.http.aclose()


def _log_page(body: object) -> tuple[list[object], str, bool]:
    """(claims, next, more) of a claim-log page, or `PeerFailed`."""
    if (
        not isinstance(body, dict)
        or not isinstance(body.get("claims"), list)
        or not isinstance(body.get("next"), str)
        or not isinstance(body.get("more"), bool)
    ):
        raise PeerFailed('the log page is not {"claims": [...], "next": cursor, "more": bool}')
    return body["claims"], body["next"], body["more"]


class Peers:
    """Every follower of a running node, by peer name."""

    def __init__(self, host: Host, config: PullConfig) -> None:
        self.host = host
        self.config = config
        self.followers: dict[str, Follower] = {}

    def follow(self, row: PeerRow, first_sync: bool = False) -> None:
        """Start following `row` (a running follower of that name is replaced)."""
        old = self.followers.pop(row.name, None)
        if old is not None:
            asyncio.get_running_loop().create_task(old.close())
        follower = Follower(row, self.host, self.config, first_sync)
        # a context of its own: not the request id of the request that added the peer
        follower.task = asyncio.create_task(
            follower.run(), name=f"peer:{row.name}", context=contextvars.Context()
        )
        self.followers[row.name] = follower

    async def is_this_box(self, url: str, token: str, timeout_s: float) -> bool:
        """Whether `url` answers as this very box (its claim log carries our `SELF_HEADER`):
        `peers add` refuses it before anything is stored, so a known peer's row is never
        replaced by one that cannot be followed. No answer is no: the follower says why."""
        try:
            async with httpx.AsyncClient(
                headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
            ) as http:
                answer = await http.get(f"{url.rstrip('/')}/api/claims/log", params={"limit": 1})
        except (httpx.HTTPError, httpx.InvalidURL):
            return False
        return bool(answer.headers.get(SELF_HEADER) == self.host.instance)

    async def forget(self, name: str) -> None:
        follower = self.followers.pop(name, None)
        if follower is not None:
            await follower.close()

    async def first_try(self, name: str, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, until `name`'s follower has tried its peer once, so that
        `peers add` can say at once that a peer does not answer (a typo, a wrong token)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.follower(name).tried.wait(), timeout_s)

    def follower(self, name: str) -> Follower:
        found = self.followers.get(name)
        if found is None:
            raise UnknownPeer(f"no peer is named {name!r}")
        return found

    def status(self, row: PeerRow) -> dict[str, Any]:
        """`row` as `GET /api/peers` lists it (the token left out)."""
        follower = self.followers.get(row.name)
        return {
            "name": row.name,
            "url": row.url,
            "weight": row.weight,
            "cursor": row.cursor,
            "lag_s": round(follower.lag_s(), 3) if follower else None,
            "last_error": follower.last_error if follower else "",
            "last_sync": follower.last_sync.as_json() if follower and follower.last_sync else None,
            "accepted": row.accepted,
            "duplicate": row.duplicate,
            "stale": row.stale,
            "rejected": row.rejected,
            "added_at": row.added_at,
        }

    async def stop(self) -> None:
        await asyncio.gather(*(f.close() for f in self.followers.values()))
        self.followers.clear()


class Responder:
    """This box's side of reconciliation: its claims' identities, rebuilt when the log moves."""

    def __init__(
        self, head: Callable[[], str], read: Callable[[], tuple[str, list[bytes]]]
    ) -> None:
        self._head = head  # the log's end cursor (a cheap read)
        self._read = read  # (end cursor, every identity): a long read, run on a thread
        self._items: tuple[str, reconcile.Items] | None = None
        self._lock = asyncio.Lock()

    async def items(self) -> tuple[str, reconcile.Items]:
        """(the log's end cursor, the identities as of it), built at most once per log state."""
        async with self._lock:
            if self._items is None or self._items[0] != self._head():
                self._items = await asyncio.to_thread(self._build)
            return self._items

    def _build(self) -> tuple[str, reconcile.Items]:
        head, ids = self._read()
        return head, reconcile.Items(ids)
