"""A small synchronous client for external plugins and scripts: sign, post, read, follow.

    from metanode.client import Client
    from metanode import keys

    node = Client("http://127.0.0.1:9000", token=open("data/api-token").read().strip(),
                  key=keys.load("myplugin.key"))
    for event in node.events(prefix=["filePath"]):
        if event.kind == "set":
            for cid in node.meta_by_rid(event.data["rid"])["cids"]:
                ...
            node.post([node.sign(cid, "myKey", "value")])

`events` reconnects by itself and resumes after the last event it delivered, so a script that
follows the feed never misses or repeats one (after a `gap` it receives a fresh snapshot).
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import httpx
import nacl.signing

from metanode import claims
from metanode.clock import now_ms
from metanode.errors import AnswerTimedOut, InvalidRequest, NotMetanode, Unreachable, shown


class ClientError(Exception):
    """The node refused a request: `slug` and `body` are its error envelope.

    Not being able to ask at all raises `errors.Unreachable`; an answer that is not a metanode's
    (another server on that port, a proxy's error page) raises `errors.NotMetanode`.
    """

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{status} {body.get('error')}: {body.get('message')}")
        self.status = status
        self.slug = str(body.get("error"))
        self.body = body


@dataclass(frozen=True)
class Event:
    """One feed event: `kind` is set, del, gap or synced; `id` is None for snapshot events."""

    id: str | None
    kind: str
    data: dict[str, Any]


_LINE_END = re.compile(r"\r\n|\r|\n")


def sse_lines(chunks: Iterable[str]) -> Iterator[str]:
    """Complete lines of an event stream. Only CR, LF and CRLF end a line in SSE:
    `str.splitlines` (and httpx's `iter_lines`) would also break values at U+2028, U+2029 and
    U+0085."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        held = "\r" if buffer.endswith("\r") else ""  # maybe the first half of a CRLF
        parts = _LINE_END.split(buffer[: len(buffer) - len(held)])
        buffer = parts.pop() + held
        yield from parts
    yield from _LINE_END.split(buffer)[:-1]


def parse_frames(lines: Iterable[str]) -> Iterator[Event]:
    """SSE frames from lines; several `data:` lines join with LF; comments are skipped."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield Event(
                    fields.get("id"), fields.get("event", "message"), json.loads("\n".join(data))
                )
            fields, data = {}, []
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            else:
                fields[name] = value


def _reason(exc: httpx.TransportError) -> str:
    """A transport failure in a few words: `Connection refused`, not `[Errno 111] ...`."""
    text = re.sub(r"^\[Errno -?\d+\]\s*", "", str(exc)).strip()
    return text or type(exc).__name__


def node_address(url: str) -> str:
    """`url` if it can name a node (http or https, a host, a port in range, nothing else: no
    spaces, no credentials, no query), else `InvalidRequest` saying why. The one rule for the
    CLI's `--url`, this client and a peer's address (`POST /api/peers`), so a typo is refused
    where it is typed rather than failing, later, as a node that does not answer."""
    try:
        parts = urllib.parse.urlsplit(url)  # raises ValueError for a bracket left open
    except ValueError as exc:
        raise InvalidRequest(
            f"{shown(url)} is not a node's address (http://host:port): {exc}"
        ) from None
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    why = (
        "it is not http:// or https://"
        if parts.scheme not in ("http", "https") or not parts.hostname
        else "it holds spaces or characters beyond ASCII"
        if not url.isascii() or not url.isprintable() or " " in url
        else "its port is not 1 to 65535"
        if not port_ok
        else "it carries a user or password (a token goes in its own option)"
        if parts.username is not None or parts.password is not None
        else "it has a query or fragment"
        if parts.query or parts.fragment
        else None
    )
    if why:
        raise InvalidRequest(f"{url!r} is not a node's address (http://host:port): {why}")
    return url


class Client:
    """Talks to one node; `key` is needed only to sign. A `url` that is no http(s) address
    raises `InvalidRequest` here, rather than every request failing as if no node answered."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:9000",
        token: str | None = None,
        key: nacl.signing.SigningKey | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.url = node_address(url).rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._key = key

    @property
    def uid(self) -> str:
        if self._key is None:
            raise ValueError("this client has no signing key")
        return claims.uid_of(bytes(self._key.verify_key))

    def reconnecting(self) -> None:
        """Called by `events` before each reconnection; nothing here. A subclass may point the
        client at another address first (the command line asks the data directory again where
        its node listens: one started, or started again on another port, is followed)."""

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _not_metanode(self, response: httpx.Response) -> NotMetanode:
        kind = response.headers.get("content-type") or "no content type"
        return NotMetanode(
            f"{self.url} answered {response.status_code} with {kind}, which is not "
            "a metanode's answer: is the address right?"
        )

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request, answered with JSON. No answer at all raises `Unreachable`; an answer
        that is not JSON raises `NotMetanode`; the node's refusals are left to the caller."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.ReadTimeout:
            # it answered the connection: a node that works longer than the client waits (a
            # `peers sync` of a large box) was called one that does not answer at all
            raise AnswerTimedOut(
                f"the node at {self.url} took longer than {self._http.timeout.read:g} s to "
                f"answer {method} {path}: it may still be doing it (see its log or /health)"
            ) from None
        except httpx.TransportError as exc:
            raise Unreachable(f"no node answers at {self.url}: {_reason(exc)}") from None
        if not response.headers.get("content-type", "").startswith("application/json"):
            raise self._not_metanode(response)
        return response

    def answer(self, response: httpx.Response) -> Any:
        """The body of a good answer; a refusal raises `ClientError` with its envelope."""
        try:
            body = response.json()
        except ValueError:
            raise self._not_metanode(response) from None
        if response.status_code >= 400:
            if not (isinstance(body, dict) and isinstance(body.get("error"), str)):
                raise self._not_metanode(response)
            raise ClientError(response.status_code, body)
        return body

    def sign(self, cid: str, key: str, value: str | None, ts: int | None = None) -> dict[str, Any]:
        """A signed wire claim (ts defaults to now)."""
        if self._key is None:
            raise ValueError("this client has no signing key")
        when = now_ms() if ts is None else ts
        return claims.sign(self._key, cid, key, value, when).wire()

    def post(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """POST /api/claims; returns the verdicts, raises `ClientError` on a rejected batch."""
        result: dict[str, Any] = self.answer(
            self.request("POST", "/api/claims", json={"claims": batch})
        )
        return result

    def meta(self, cid: str, viewer: str | None = None) -> dict[str, Any] | None:
        """The merged document of any CID, or None if the node knows no such CID."""
        params = {"as": viewer} if viewer else {}
        response = self.request("GET", f"/api/meta/{cid}", params=params)
        if response.status_code == 404 and response.json().get("error") == "unknown_cid":
            return None
        result: dict[str, Any] = self.answer(response)
        return result

    def meta_by_rid(self, rid: str) -> dict[str, Any]:
        """The document of a record named in a feed event."""
        result: dict[str, Any] = self.answer(self.request("GET", f"/api/metadata/{rid}"))
        return result

    def _check_stream(self, response: httpx.Response) -> None:
        """Raise unless this is the node's event stream: its refusal, or `NotMetanode`."""
        if response.status_code != 200:
            response.read()
            self.answer(response)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            raise self._not_metanode(response)

    def events(
        self,
        since: str | None = None,
        snapshot: bool = False,
        prefix: Iterable[str] = (),
        rid: Iterable[str] = (),
        retry_s: float = 1.0,
        on_wait: Callable[[str], None] | None = None,
    ) -> Iterator[Event]:
        """Follow GET /api/events forever, reconnecting after the last id delivered.

        While the node cannot be reached (or says to retry), `on_wait(reason)` is called once
        per outage, so a person following the feed knows it is waiting, not stuck; an answer
        that is no metanode's, or a refusal that retrying cannot mend, is raised.
        """
        params: list[tuple[str, str | int | float | bool | None]] = [
            *(("prefix", p) for p in prefix),
            *(("rid", r) for r in rid),
        ]
        if snapshot and since is None:
            params.append(("snapshot", "1"))
        last = since
        waiting = False
        while True:
            headers = {"Last-Event-ID": last} if last else {}
            reason = ""
            try:
                with self._http.stream(
                    "GET",
                    "/api/events",
                    params=params,
                    headers=headers,
                    timeout=httpx.Timeout(10, read=None),
                ) as response:
                    self._check_stream(response)
                    waiting = False
                    for event in parse_frames(sse_lines(response.iter_text())):
                        if event.id is not None:
                            last = event.id
                        elif event.kind == "synced":
                            last = str(event.data["id"])
                        yield event
            except httpx.TransportError as exc:
                reason = _reason(exc)
            except ClientError as exc:
                if not exc.body.get("retryable"):
                    raise
                reason = f"{exc.slug}: {exc.body.get('message')}"
            if reason and not waiting and on_wait is not None:
                on_wait(reason)
            waiting = waiting or bool(reason)
            time.sleep(retry_s)
            self.reconnecting()
