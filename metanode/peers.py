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
import errno
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from metanode import jsonl, logs, reconcile
from metanode.clock import Clock
from metanode.errors import (
    InvalidJson,
    MetanodeError,
    PeerAnswerCut,
    PeerAnswerTooLarge,
    PeerCannotReconcile,
    PeerCursorRefused,
    PeerFailed,
    PeerIsSelf,
    UnknownPeer,
    shown,
)
from metanode.truth import ID_BYTES, PeerRow

log = logging.getLogger(__name__)
FETCH_CHUNK = 1000  # identities asked for per reconciliation fetch (a POST /api/claims batch)
# Most bytes of one answer a follower reads: a log page or a fetch beyond it is asked again in
# smaller pieces, anything else is a failure. An honest reconciliation answer is under 8 MB
# (`reconcile.REQUEST_RANGES` ranges of at most 16 entries); a page of 1,000 claims is ≈ 0.4 MB,
# and only claims with large values (64 KiB each, up to 6 bytes of JSON a byte) make it more.
ANSWER_BYTES = 16 * 1024 * 1024
PARSE_ON_LOOP_BYTES = 1024 * 1024  # a larger answer is parsed on a thread
# Most JSON objects and arrays one answer may hold, counted as `{` and `[` before it is parsed:
# 16 MiB of `[{},{},…]` is 5.6 million empty objects, ≈ 400 MB once parsed. An honest answer
# holds a few tens of thousands (a reconciliation reply: 16,384 entries of two); brackets in
# values count too, so a page whose values hold many is asked again smaller, down to one claim,
# which cannot hold this many (`max_value_bytes` is far less).
ANSWER_CONTAINERS = 100_000
# answers in a row that may be cut (`PeerAnswerCut`) while a reconciliation asks again in halves
# what was cut, rather than failing (and beginning again from its first round): a link that
# breaks connections keeps what came through, a dead peer is a failure after this many more
SPLITS_IN_A_ROW = 3
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
    # this box's clock reading (ms) from which the first of the claims refused as
    # `ts_in_future` is no longer too far ahead (None: there were none)
    valid_from: int | None = None
    # why the page's first refused claim was refused ("": none was), for `last_rejected`
    first_refusal: str = ""


@dataclass
class Asking:
    """How much a follower asks of its peer in one request: claims of a log page or a fetch,
    or ranges of a reconciliation request. Halved when an answer did not come whole (too large,
    too slow, cut halfway: over a 5 KB/s link a page of 1,000 claims, ≈ 270 KB, took longer
    than `peer_timeout_s`, was given up and asked again whole, for ever, nothing stored);
    doubled back, up to `most`, after a full answer (as much as was asked for) that came within
    a quarter of the timeout, so that the doubled one is expected within half of it. Doubled
    after any answer, every other request over a slow link was one given up; and after a small
    one (a reconciliation's first round, a poll finding 3 new claims), each halving was undone
    before the large request it was for: a link cut at 60 KB never carried a second round."""

    most: int
    now: int = 0  # 0: `most`

    def __post_init__(self) -> None:
        self.now = self.now or self.most

    def shrink(self) -> bool:
        """Halve; False if it is one already (nothing smaller can be asked)."""
        if self.now == 1:
            return False
        self.now //= 2
        return True

    def took(self, seconds: float, timeout_s: float, asked: int) -> None:
        """An answer to a request for `asked` came whole in `seconds`: ask more next time if
        it was a full one and came well in time."""
        if asked >= self.now and seconds < timeout_s / 4:
            self.now = min(self.most, self.now * 2)


class Host(Protocol):
    """What a follower needs of the node."""

    def peer(self, name: str) -> PeerRow | None: ...

    async def apply_peer_page(
        self, name: str, items: list[object], cursor: str | None, names: Mapping[str, str]
    ) -> PageCounts: ...

    async def own_items(self) -> reconcile.Items: ...

    def claim_count(self) -> int: ...

    @property
    def instance(self) -> str: ...

    @property
    def clock(self) -> Clock: ...


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


STEADY_BACKOFFS = 10  # a link is steady once it worked this many longest back-offs in a row


def unreachable(exc: BaseException) -> str:
    """Why a connection to a peer could not be made, and what to look at: the cause httpx
    wraps (`ConnectError('All connection attempts failed')` was all the log, /health and
    `peers list` said of a peer that was off, of a mistyped name and of a firewall alike)."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OSError | TimeoutError):
        cause = cause.__cause__ or cause.__context__
    while isinstance(cause, OSError) and (deeper := cause.__cause__ or cause.__context__):
        cause = deeper  # anyio's `All connection attempts failed` holds the last attempt's
    if isinstance(cause, ConnectionRefusedError):
        return (
            "connection refused: nothing listens there (is metanode running on that box, on "
            "that port?)"
        )
    if isinstance(cause, socket.gaierror):
        return (
            f"its name is not found ({cause.strerror}: a typo in the address, or a name this "
            "box's DNS does not know)"
        )
    if isinstance(cause, TimeoutError) or isinstance(exc, httpx.ConnectTimeout):
        return "no answer to the connection (the box off or asleep, or a firewall dropping it)"
    if isinstance(cause, OSError) and cause.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return f"{cause.strerror} (the box off, or not on a network this box can reach)"
    return repr(exc)


class LinkLog:
    """What the log says of one peer's link. A failure and the recovery after it are a line
    each; a link that fails again within `steady_s` of recovering is unsteady: one line says
    so, then its failures and recoveries are counted, summed up in a line at most every
    `steady_s` while it lasts, and a last line once it has worked `steady_s` without one.
    Before, a link cut every few seconds (Wi-Fi, a modem) wrote two lines per cut, 45 a minute
    (each cut's error differs, `received 798 bytes`, so no two repeated: 65,000 lines a day),
    burying everything else; `peers list` and /health say the newest error meanwhile."""

    def __init__(self, name: str, steady_s: float) -> None:
        self.name = name
        self.steady_s = steady_s
        self.down = False  # it failed since it last worked
        self.said = ""  # the failure last logged while down ("": none)
        self.recovered_at: float | None = None  # when it last worked again after a failure
        self.failed_at = 0.0  # the newest failure
        self.unsteady_since: float | None = None  # None: steady
        self.summed_at = 0.0  # when the unsteady link was last summed up
        self.failures = 0  # since then
        self.recoveries = 0

    def failed(self, said: str) -> None:
        now = time.monotonic()
        was_down, self.down, self.failed_at = self.down, True, now
        if self.unsteady_since is not None:
            self.failures += 1
            if now - self.summed_at >= self.steady_s:
                self._sum_up(now, f"the newest: {said}")
        elif not was_down and self.recovered_at and now - self.recovered_at < self.steady_s:
            self.unsteady_since = self.summed_at = now
            self.failures, self.recoveries = 1, 0
            log.warning(
                "peer %s: the link fails again and again (again %.0f s after it answered): %s; "
                "its failures are summed up here every %.0f s until it has worked that long "
                "(the newest in `metanode peers list` and /health)",
                self.name,
                now - self.recovered_at,
                said,
                self.steady_s,
            )
        elif said != self.said:  # a peer down for a week: one line, not one a minute
            log.warning("peer %s: %s (tried again with back-off)", self.name, said)
            self.said = said

    def worked(self) -> None:
        """A pull worked: after a failure it answers again, and an unsteady link that has
        worked `steady_s` since its last failure is steady again."""
        now = time.monotonic()
        if self.unsteady_since is not None and now - self.failed_at >= self.steady_s:
            self._sum_up(now, f"steady again: it has worked {self.steady_s:.0f} s", logging.INFO)
            self.unsteady_since = self.recovered_at = None  # a next failure is a first one
        if not self.down:
            return
        self.down, self.said, self.recovered_at = False, "", now
        if self.unsteady_since is not None:
            self.recoveries += 1
        else:
            log.info("peer %s answers again", self.name)

    def _sum_up(self, now: float, state: str, level: int = logging.WARNING) -> None:
        log.log(
            level,
            "peer %s: unsteady link: %d failed pull(s) and %d recover(ies) in the last %.0f s; %s",
            self.name,
            self.failures,
            self.recoveries,
            now - self.summed_at,
            state,
        )
        self.summed_at, self.failures, self.recoveries = now, 0, 0


class Follower:
    """One peer's pull loop, and its status (`peers list`)."""

    def __init__(self, row: PeerRow, host: Host, config: PullConfig, first_sync: bool) -> None:
        self.name = row.name
        self.cursor = row.cursor
        self.host = host
        self.config = config
        self.first_sync = first_sync
        self.last_error = ""
        self.link = LinkLog(row.name, STEADY_BACKOFFS * config.max_backoff_s)
        self.last_rejected = ""  # why the last page with refused claims refused its first one
        self.instance = ""  # the instance id its peer last answered with ("": none yet)
        self.last_sync: SyncReport | None = None
        self.behind_since: float | None = time.monotonic()  # None: caught up
        self.asked_at = time.monotonic()  # when the pull (or sync) now under way began
        self.page = Asking(config.page)  # claims of a log page or a fetch
        self.ranges = Asking(reconcile.REQUEST_RANGES)  # ranges of a reconciliation request
        self.cuts = 0  # answers cut in a row (`SPLITS_IN_A_ROW`)
        # when to reconcile for claims refused as dated too far ahead: a reading of the node's
        # clock, which is what they are ahead of (None: never)
        self.resync_at: int | None = None
        self.http = httpx.AsyncClient(
            base_url=row.url.rstrip("/"),
            headers={"Authorization": f"Bearer {row.token}"},
            timeout=config.timeout_s,
        )
        self.tried = asyncio.Event()  # the first pull (or reconciliation) answered or failed
        self.task: asyncio.Task[None] | None = None

    def failing(self) -> str:
        """Why this follower does not keep up ("": it does): its last error, or how its task
        ended unexpectedly (an exception no one expected ended it silently: no error, a lag
        growing for ever, /health ok)."""
        task = self.task
        if task is not None and task.done() and not task.cancelled() and task.exception():
            return f"its follower stopped: {task.exception()!r}"
        return self.last_error

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
            self.asked_at, self.cuts = time.monotonic(), 0  # each try splits cuts anew
            try:
                if reconciling:
                    await self.sync(set_cursor=True)
                    reconciling, more = False, True
                elif self._resync_due():
                    await self.sync()
                    more = True
                else:
                    had_cursor = bool(self.cursor)
                    more = await self.pull_once()
                    refused = refused and not had_cursor  # a cursor of its log was taken
            except UnknownPeer:
                return  # removed meanwhile
            except PeerIsSelf as exc:  # nothing to follow: retried, it was for ever
                self._failed(exc)
                return
            except PeerCannotReconcile as exc:  # not a failure: the log does the same work
                if reconciling:  # the first sync: the cursor is the log's start
                    log.info("peer %s: %s; reading its log from the start", self.name, exc.message)
                else:  # a reconciliation for claims once dated ahead: `peers sync` tries again
                    said = "peer %s: %s; claims refused earlier stay lacking"
                    log.warning(said, self.name, exc.message)
                reconciling = False
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
                await asyncio.sleep(self.config.poll_s)

    async def _back_off(self, exc: MetanodeError, delay: float) -> float:
        """Say the failure, wait `delay`, and give the next, longer delay."""
        self._failed(exc)
        await asyncio.sleep(delay)
        return min(delay * 2, self.config.max_backoff_s)

    def _failed(self, exc: MetanodeError) -> None:
        """A failed pull: said in `last_error`, and the follower counts as behind from when
        the first failed pull began (a peer that stopped answering is not one it has kept up
        with; counted from the failure, `lag_s` read `peer_timeout_s` less than it was)."""
        said = f"{exc.slug}: {exc.message}"
        self.link.failed(said)
        self.last_error = said
        self.behind_since = self.behind_since or self.asked_at
        self.tried.set()

    async def _call(
        self, method: str, path: str, asking: Asking, **kwargs: Any
    ) -> tuple[Any, int, int, float]:
        """(the peer's JSON answer, bytes sent, bytes received, seconds it took); `PeerFailed`
        for a refusal, an answer over `ANSWER_BYTES` (`PeerAnswerTooLarge`), something that is
        not JSON (`PeerCannotReconcile`: it has no `RECONCILE`), or no whole answer within
        `timeout_s` (the whole answer, not each read: a peer dripping a byte a second held its
        follower for ever) or a connection broken halfway (`PeerAnswerCut`, and `asking` is
        halved: a request's size, not its answer's, is what a follower chooses); the caller
        knows whether the answer was a full one, for `asking.took`."""
        started = time.monotonic()
        try:
            body, sent, got = await self._exchange(method, path, **kwargs)
        except PeerAnswerCut:
            asking.shrink()
            self.cuts += 1
            raise
        self.cuts = 0
        return body, sent, got, time.monotonic() - started

    def _split_after(self, exc: PeerAnswerCut, size: int) -> None:
        """Re-raise `exc` unless a reconciliation's request of `size` it cut is to be asked
        again in halves (said in `last_error` meanwhile): not one of a single item, and not
        after `SPLITS_IN_A_ROW` cuts in a row."""
        if size == 1 or self.cuts > SPLITS_IN_A_ROW:
            raise exc
        self._failed(exc)

    async def _exchange(self, method: str, path: str, **kwargs: Any) -> tuple[Any, int, int]:
        """One request and its whole answer (`_call`)."""
        try:
            async with (
                asyncio.timeout(self.config.timeout_s),
                self.http.stream(method, path, **kwargs) as response,
            ):
                sent = len(response.request.content)
                if response.headers.get(SELF_HEADER) == self.host.instance:  # not for ever
                    raise PeerIsSelf(
                        f"{self.http.base_url} is this box itself (its instance id is ours)"
                    )
                self.instance = response.headers.get(SELF_HEADER, self.instance)
                if path == RECONCILE and response.status_code in (404, 405):
                    raise PeerCannotReconcile(f"{path} answered {response.status_code}")
                content = await _read_capped(response, path)
        except TimeoutError:
            raise PeerAnswerCut(
                f"{self.http.base_url} did not answer within {self.config.timeout_s:g} s "
                "(peer_timeout_s)"
            ) from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing asked, nothing cut
            raise PeerFailed(f"{self.http.base_url} did not answer: {unreachable(exc)}") from None
        except httpx.HTTPError as exc:  # a read or write broken or timed out
            raise PeerAnswerCut(f"{self.http.base_url} did not answer: {exc!r}") from None
        body = await _json_of(content, response, path, str(self.http.base_url))
        if response.status_code != 200:
            slug = body.get("error") if isinstance(body, dict) else None
            said = f"{path} answered {response.status_code} {slug}"
            if slug == "invalid_cursor":
                raise PeerCursorRefused(said)
            raise PeerFailed(said + _HINTS.get(response.status_code, ""))
        return body, sent, len(content)

    async def pull_once(self) -> bool:
        """Pull and store one page after the cursor; whether the peer said there is more. A
        page over `ANSWER_BYTES` is asked again at once at half the size (claims with large
        values); one that did not come whole is a failure, asked again at half the size after
        the back-off (`Asking`)."""
        while True:
            limit = self.page.now
            params = {"limit": str(limit)}
            if self.cursor:
                params["after"] = self.cursor
            try:
                body, _, _, took = await self._call(
                    "GET", "/api/claims/log", self.page, params=params
                )
                break
            except PeerAnswerTooLarge:
                if not self.page.shrink():
                    raise
        items, cursor, more = _log_page(body, limit, self.cursor)
        self.page.took(took, self.config.timeout_s, len(items))
        names = signer_names(body)
        self._took(await self.host.apply_peer_page(self.name, items, cursor, names))
        self.cursor = cursor
        self.link.worked()
        self.last_error = ""
        if more:
            self.behind_since = self.behind_since or self.asked_at
        else:
            self.behind_since = None
        return more

    def _took(self, counts: PageCounts) -> None:
        """Note when claims refused as dated too far ahead (`ts_in_future`: the peer's clock,
        or its signer's, runs ahead of ours) become valid: the log has been read past them, so
        only a reconciliation then fetches them (`_resync_due`). The first refusal's reason is
        kept for `peers list` (`rejected` alone never said why)."""
        if counts.first_refusal:
            self.last_rejected = counts.first_refusal
        if (due := counts.valid_from) is not None:
            self.resync_at = min(self.resync_at or due, due)  # the rest are noted then again

    def _resync_due(self) -> bool:
        """Whether claims refused as dated ahead are valid now. Asked of the node's clock, not
        a timer: a box that booted at 1970 refused every claim of its peers as 56 years
        ahead, and a timer set so never rang once network time set the clock."""
        return self.resync_at is not None and self.host.clock() >= self.resync_at

    async def sync(self, set_cursor: bool = False) -> SyncReport:
        """Reconcile with the peer and fetch the claims this box lacks. With `set_cursor` (the
        first sync) the last fetch also moves the cursor to where the peer's log stood when
        reconciliation began: every claim stored before that point was in the sets compared.
        A reconciliation due for claims refused as dated ahead is done by this one (claims
        still ahead are noted again); if this one fails, it stays due, unless the peer cannot
        reconcile at all (due again at once, it was asked again at once, for ever)."""
        pending, self.resync_at = self.resync_at, None
        try:
            return await self._sync(set_cursor)
        except PeerCannotReconcile:
            raise
        except BaseException:
            if pending is not None:
                self.resync_at = min(pending, self.resync_at or pending)
            raise

    async def _sync(self, set_cursor: bool) -> SyncReport:
        report = SyncReport()
        started = time.perf_counter()
        session = reconcile.Session(await self.host.own_items())
        message = session.start()
        head: str | None = None
        while message:
            following: list[reconcile.Fingerprint] = []
            for part in reconcile.chunks(message, self.ranges.now):
                for said, reply in await self._ask(part, report):
                    head = head or said
                    following += session.absorb(reply)
                    _within_bounds(session, following)
            message = session.end_round(following)
        needed = sorted(session.need)
        while True:  # in pieces of a page's size: a fetch of n claims is a page of n claims
            size = min(FETCH_CHUNK, self.page.now)
            chunk, needed = needed[:size], needed[size:]
            cursor = head if set_cursor and not needed else None
            report.fetched += await self._fetch(chunk, cursor, report)
            if not needed:
                break
        if set_cursor and head is not None:
            self.cursor = head
        for name in ("rounds", "fingerprints_sent", "fingerprints_received", "ids_received"):
            setattr(report, name, getattr(session, name))
        report.have = len(session.have)
        report.seconds = round(time.perf_counter() - started, 3)
        self.last_sync = report
        return report

    async def _ask(
        self, part: Sequence[reconcile.Fingerprint], report: SyncReport
    ) -> list[tuple[str, list[reconcile.Entry]]]:
        """The peer's (head, reply) to a request about the ranges `part`: one, or, if its
        answer was cut, those to its halves (`_split_after`; the responder answers each range
        on its own). One cut began the reconciliation again from its first round: a link that
        broke connections at 60 KB never let one of 2,000 claims finish."""
        try:
            body, sent, got, took = await self._call(
                "POST", RECONCILE, self.ranges, json={"ranges": reconcile.encode(part)}
            )
        except PeerAnswerCut as exc:
            self._split_after(exc, len(part))
            half = len(part) // 2
            return await self._ask(part[:half], report) + await self._ask(part[half:], report)
        self.ranges.took(took, self.config.timeout_s, len(part))
        report.bytes_sent += sent
        report.bytes_received += got
        if not isinstance(body, dict) or not isinstance(body.get("head"), str):
            raise PeerFailed("the reconciliation answer has no head cursor")
        try:
            reply = reconcile.decode_reply(body.get("ranges"), ID_BYTES)
        except MetanodeError as exc:
            raise PeerFailed(f"the reconciliation answer is malformed: {exc.message}") from None
        return [(body["head"], reply)]

    async def _fetch(self, ids: Sequence[bytes], cursor: str | None, report: SyncReport) -> int:
        """Ask the peer for the claims with these identities and store them (with `cursor`);
        an answer over `ANSWER_BYTES`, or cut (`_split_after`), is asked again in two halves."""
        items: list[object] = []
        names: dict[str, str] = {}
        if ids:
            try:
                body, sent, got, took = await self._call(
                    "POST",
                    RECONCILE,
                    self.page,
                    json={"fetch": [reconcile.encode_id(i) for i in ids]},
                )
                self.page.took(took, self.config.timeout_s, len(ids))
            except (PeerAnswerTooLarge, PeerAnswerCut) as exc:
                if isinstance(exc, PeerAnswerCut):
                    self._split_after(exc, len(ids))
                elif len(ids) == 1:
                    raise
                half = len(ids) // 2
                first = await self._fetch(ids[:half], None, report)
                return first + await self._fetch(ids[half:], cursor, report)
            report.bytes_sent += sent
            report.bytes_received += got
            if not isinstance(body, dict) or not isinstance(body.get("claims"), list):
                raise PeerFailed("the fetch answer has no claims array")
            items, names = body["claims"], signer_names(body)
            if len(items) > len(ids):
                raise PeerFailed(f"the fetch answer holds {len(items)} claims; {len(ids)} asked")
        if items or cursor is not None:
            self._took(await self.host.apply_peer_page(self.name, items, cursor, names))
        return len(items)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.http.aclose()


MAX_SIGNER_NAME = 64  # characters of a name a peer gives its signer; a longer one is not taken


def signer_names(body: dict[str, Any]) -> dict[str, str]:
    """What the peer calls its answer's signers (`signers`: uid → name), the names that can be
    shown (1 to `MAX_SIGNER_NAME` printable characters) and nothing else: a peer of an older
    version sends none, and a hostile one may send anything."""
    given = body.get("signers")
    if not isinstance(given, dict):
        return {}
    return {
        uid: name
        for uid, name in given.items()
        if isinstance(name, str) and 1 <= len(name) <= MAX_SIGNER_NAME and name.isprintable()
    }


async def _read_capped(response: httpx.Response, path: str) -> bytes:
    """The answer's body, or `PeerAnswerTooLarge` as soon as it is known to be over
    `ANSWER_BYTES` (by its declared length, else while it streams): a peer answering gigabytes
    was read whole into memory, again at each retry (6 GB of RSS in a review); or, read, if it
    holds more than `ANSWER_CONTAINERS` objects and arrays to parse."""
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > ANSWER_BYTES:
        raise PeerAnswerTooLarge(f"{path} answered {declared} bytes; at most {ANSWER_BYTES} read")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > ANSWER_BYTES:
            raise PeerAnswerTooLarge(f"{path} answered over {ANSWER_BYTES} bytes; read no more")
    containers = body.count(b"{") + body.count(b"[")
    if containers > ANSWER_CONTAINERS:
        raise PeerAnswerTooLarge(
            f"{path} answered {containers} JSON objects and arrays; at most "
            f"{ANSWER_CONTAINERS} parsed"
        )
    return bytes(body)


async def _json_of(content: bytes, response: httpx.Response, path: str, base: str) -> Any:
    """The answer as JSON (a large one parsed on a thread: the loop serves meanwhile), or
    `PeerFailed` saying what answered instead (a redirect names where it points)."""
    try:
        if len(content) > PARSE_ON_LOOP_BYTES:
            return await asyncio.to_thread(jsonl.loads, content, f"{path}'s answer")
        return jsonl.loads(content, f"{path}'s answer")
    except InvalidJson:
        status = response.status_code
        if response.has_redirect_location:
            raise PeerFailed(
                f"{path} answered {status}, a redirect to {shown(response.headers['location'])}: a "
                "peer's address is where its node answers (give `peers add` that one)"
            ) from None
        raise PeerFailed(
            f"{path} answered {status}, not JSON: no metanode answers at {base}"
        ) from None


def _within_bounds(session: reconcile.Session, following: list[reconcile.Fingerprint]) -> None:
    """`PeerCannotReconcile` (its log is read instead) once a reconciliation goes past what an
    honest one needs (`reconcile.MAX_ROUNDS`, `MAX_MESSAGE`, `MAX_NEED`)."""
    if session.rounds >= reconcile.MAX_ROUNDS:
        raise PeerCannotReconcile(f"the reconciliation did not end in {session.rounds} rounds")
    if len(following) > reconcile.MAX_MESSAGE:
        raise PeerCannotReconcile(f"a round would ask about over {reconcile.MAX_MESSAGE} ranges")
    if len(session.need) > reconcile.MAX_NEED:
        raise PeerCannotReconcile(f"this box lacks over {reconcile.MAX_NEED} of its claims")


def _log_page(body: object, limit: int, after: str) -> tuple[list[object], str, bool]:
    """(claims, next, more) of a claim-log page asked with `limit` and `after`, or
    `PeerFailed`: also for more claims than asked for, and for "more" with a cursor that did
    not move (asked again at once, such a page was pulled for ever, as fast as it came)."""
    if (
        not isinstance(body, dict)
        or not isinstance(body.get("claims"), list)
        or not isinstance(body.get("next"), str)
        or not isinstance(body.get("more"), bool)
    ):
        raise PeerFailed('the log page is not {"claims": [...], "next": cursor, "more": bool}')
    claims, cursor, more = body["claims"], body["next"], body["more"]
    if len(claims) > limit:
        raise PeerFailed(f"the log page holds {len(claims)} claims; {limit} were asked for")
    if more and cursor == after:
        raise PeerFailed("the log page says there is more, but its next cursor is the one asked")
    return claims, cursor, more


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
        follower.task.add_done_callback(logs.said_if_failed)  # and `Follower.failing`
        self.followers[row.name] = follower

    async def probe(self, url: str, token: str, timeout_s: float) -> str | None:
        """The instance id `url` answers with (its claim log's `SELF_HEADER`): `peers add`
        refuses this very box, or a box followed already under another address, before anything
        is stored, so a known peer's row is never replaced by one that cannot be followed. Only
        the head is read (a peer answering gigabytes was read whole), all of it within
        `timeout_s` (one dripping a byte at a time held `peers add` for ever; httpx's own
        timeout is no shorter: its 5 s default gave up first). None: no answer within
        `timeout_s`; "": an answer without one, or an address that fails otherwise (the
        follower says why)."""
        try:
            async with (
                asyncio.timeout(timeout_s),
                httpx.AsyncClient(
                    headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
                ) as http,
                http.stream("GET", f"{url.rstrip('/')}/api/claims/log", params={"limit": 1}) as got,
            ):
                return str(got.headers.get(SELF_HEADER, ""))
        except (TimeoutError, httpx.TimeoutException):
            return None
        except (httpx.HTTPError, httpx.InvalidURL):
            return ""

    def following(self, instance: str, but: str) -> str | None:
        """The name of a peer other than `but` whose answers came from box `instance`."""
        return next(
            (name for name, f in self.followers.items() if name != but and f.instance == instance),
            None,
        )

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
            "last_error": follower.failing() if follower else "",
            "last_sync": follower.last_sync.as_json() if follower and follower.last_sync else None,
            "accepted": row.accepted,
            "duplicate": row.duplicate,
            "stale": row.stale,
            "rejected": row.rejected,
            "last_rejected": follower.last_rejected if follower else "",
            "page": follower.page.now if follower else None,
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
