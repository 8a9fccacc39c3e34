"""Client-side feed helpers (SPEC §5): the SSE frame parser, the replica that checks the ordering
rules frame by frame, claims that make feed events, and `Stream`, an SSE GET on a raw socket.

The in-process ASGI transport buffers a streamed body until it ends, so streaming over HTTP is
read from a real server subprocess with `Stream`: the chunked body is de-framed and parsed by
`FrameParser`, and `Replica` checks what arrives.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from metanode import cid as cids
from metanode import sse
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.server import Server

WAIT_S = 30.0  # the bound on any single wait for the server


# -- frames and replicas ------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One dispatched SSE frame: an event (with data) or a comment-only frame (a keep-alive)."""

    event: str | None = None
    id: str | None = None
    data: Any = None
    comment: str | None = None

    @property
    def seq(self) -> int:
        """The seq of this event's `id:` (`<epoch>-<seq>`)."""
        assert self.id is not None, f"{self} has no id"
        return int(self.id.rsplit("-", 1)[1])


class FrameParser:
    """An incremental SSE parser: bytes in, frames out. Lines end at LF only (the server's `sep`);
    a CR anywhere would be a framing error here, which is what the byte-exact tests pin down."""

    def __init__(self) -> None:
        self._buffer = b""
        self._fields: dict[str, str] = {}
        self._comment: str | None = None

    def feed(self, chunk: bytes) -> list[Frame]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        frames = []
        for raw in lines:
            line = raw.decode("utf-8")
            assert "\r" not in line, f"CR inside an SSE line: {line!r}"
            if line == "":
                if "data" in self._fields:
                    frames.append(
                        Frame(
                            self._fields.get("event"),
                            self._fields.get("id"),
                            json.loads(self._fields["data"]),
                            self._comment,
                        )
                    )
                elif self._comment is not None:
                    frames.append(Frame(comment=self._comment))
                self._fields, self._comment = {}, None
            elif line.startswith(":"):
                self._comment = line[1:].lstrip(" ")
            else:
                name, _, value = line.partition(":")
                assert name not in self._fields, f"field {name!r} twice in one frame: {line!r}"
                self._fields[name] = value[1:] if value.startswith(" ") else value
        return frames


class Replica:
    """What a feed consumer rebuilds, checking SPEC §5's ordering rules frame by frame.

    Live events must carry ids of the current epoch, strictly increasing (and with `dense`,
    consecutive); a `gap` (its id its `resumeFrom`, the snapshot's start) must be followed by
    `set`s with ids inside the snapshot (`<epoch>-<seq>.<n>`, n counting from 1) and a `synced`
    whose id is where the live tail resumes; `synced` after a replay names the position reached.
    """

    def __init__(
        self, cursor: str | None = None, *, dense: bool = True, gaps_allowed: bool = True
    ) -> None:
        self.epoch: int | None = None
        self.position = 0
        if cursor is not None:
            epoch, seq = cursor.rsplit("-", 1)
            self.epoch, self.position = int(epoch), int(seq)
        self.dense = dense
        self.gaps_allowed = gaps_allowed
        self.state: dict[tuple[str, str], str] = {}
        self.seqs: list[int] = []
        self.history: list[Frame] = []  # the live events, in order
        self.gaps: list[dict[str, Any]] = []
        self.synced: list[str] = []
        self._snapshot: dict[tuple[str, str], str] | None = None
        self.snapshot_sizes: list[int] = []

    @property
    def last_id(self) -> str | None:
        return None if self.epoch is None else sse.event_id(self.epoch, self.position)

    @property
    def in_snapshot(self) -> bool:
        return self._snapshot is not None

    def apply_all(self, frames: Iterable[Frame]) -> None:
        for frame in frames:
            self.apply(frame)

    def apply(self, frame: Frame) -> None:
        if frame.event is None:
            assert frame.comment == "keep-alive", f"unexpected comment frame {frame}"
            assert self._snapshot is None, "keep-alive inside a snapshot"
        elif frame.event == "gap":
            assert self.gaps_allowed, f"unexpected gap {frame.data}"
            assert self._snapshot is None, f"gap inside a snapshot: {frame.data}"
            assert set(frame.data) == {"requested", "reason", "resumeFrom"}, frame
            assert frame.id == frame.data["resumeFrom"] and is_state_id(frame.id, 0), frame
            if frame.data["reason"] == "too_old" and self.last_id is not None:
                assert frame.data["requested"] == self.last_id, f"{frame} at {self.last_id}"
            self.gaps.append({k: frame.data[k] for k in ("requested", "reason")})
            self._snapshot = {}
        elif frame.event == "synced":
            assert set(frame.data) == {"id"}, frame
            # it carries its position as its id too: the end of a snapshot (of ?snapshot=1
            # too), and of a replay, which a filter may have passed little of (a client that
            # kept its last event's id fell behind, to a needless gap once that was pruned)
            assert frame.id == frame.data["id"], frame
            epoch_text, seq_text = frame.data["id"].rsplit("-", 1)
            epoch, seq = int(epoch_text), int(seq_text)
            self.synced.append(frame.data["id"])
            if self._snapshot is not None:  # end of a snapshot: the live tail starts here
                self.state, self._snapshot = self._snapshot, None
                self.snapshot_sizes.append(len(self.state))
                self.epoch, self.position = epoch, seq
            elif self.epoch is None:  # ?snapshot=1 on a fresh stream counts as a snapshot too
                self.epoch, self.position = epoch, seq
            else:  # end of a replay
                assert epoch == self.epoch, f"synced {frame.data} in epoch {self.epoch}"
                if self.dense:
                    assert seq == self.position, f"synced {frame.data} at {self.last_id}"
                else:
                    assert seq >= self.position, f"synced {frame.data} behind {self.last_id}"
                    self.position = seq
        elif frame.event in ("set", "del"):
            data = frame.data
            expected = {"rid", "key", "value"} if frame.event == "set" else {"rid", "key"}
            assert set(data) == expected, frame
            where = (data["rid"], data["key"])
            if is_state_id(frame.id):  # a snapshot row
                assert frame.event == "set", f"del inside a snapshot: {frame}"
                if self._snapshot is None:  # the snapshot of ?snapshot=1 (no gap before it)
                    assert self.epoch is None and not self.seqs, f"snapshot row live: {frame}"
                    self._snapshot = {}
                assert is_state_id(frame.id, len(self._snapshot) + 1), f"{frame} out of order"
                assert where not in self._snapshot, f"{where} twice in one snapshot"
                self._snapshot[where] = data["value"]
                return
            assert self._snapshot is None, f"live event {frame.id} inside a snapshot"
            assert frame.id is not None, f"a live event without an id: {frame}"
            epoch_text, seq_text = frame.id.rsplit("-", 1)
            epoch, seq = int(epoch_text), int(seq_text)
            if self.epoch is None:
                self.epoch = epoch
                self.position = seq - 1 if self.dense else self.position
            assert epoch == self.epoch, f"event {frame.id} in epoch {self.epoch}"
            if self.dense:
                assert seq == self.position + 1, f"event {frame.id} after {self.last_id}"
            else:
                assert seq > self.position, f"event {frame.id} after {self.last_id}"
            self.position = seq
            self.seqs.append(seq)
            self.history.append(frame)
            if frame.event == "set":
                self.state[where] = data["value"]
            else:
                self.state.pop(where, None)
        else:
            raise AssertionError(f"unknown event {frame}")


def gap_frame(requested: str | None, reason: str, at: str) -> Frame:
    """The `gap` before the full state at cursor `at` (`<epoch>-<seq>`): its id and `resumeFrom`
    are that state's start."""
    start = f"{at}.0"
    return Frame("gap", start, {"requested": requested, "reason": reason, "resumeFrom": start})


def is_state_id(text: str | None, seen: int | None = None) -> bool:
    """Whether `text` is an id from inside a full state (`<epoch>-<seq>.<n>`), n `seen` if given."""
    if text is None or "." not in text:
        return False
    return seen is None or text.rsplit(".", 1)[1] == str(seen)


def reached(seq: int) -> Callable[[Replica], bool]:
    """`until` condition: the replica's position is at `seq` or past it."""
    return lambda replica: replica.position >= seq


def assert_agrees(replica: Replica, want: dict[tuple[str, str], str]) -> None:
    """Every (rid, key) the replica learnt of holds the value the records hold (or is gone)."""
    wrong = {k: (v, want.get(k)) for k, v in replica.state.items() if want.get(k) != v}
    assert not wrong, f"replica vs records: {wrong}"


def cid_n(tag: str, n: int) -> str:
    return cids.midhash_bytes(f"feed {tag} {n}".encode())


def new_cid_claims(
    signer: Signer, tag: str, count: int, start: int = 0, key: str = "title"
) -> list[dict[str, Any]]:
    """`count` claims each on a new CID: 2 feed events apiece (`cids/<cid>`, then `key`)."""
    return fast_claims(
        signer, [(cid_n(tag, i), key, f"{tag} {i}", NOW_MS) for i in range(start, start + count)]
    )


# -- streams over HTTP ---------------------------------------------------------------------


class Dechunker:
    """The body of a `Transfer-Encoding: chunked` response, incrementally."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # bytes of the current chunk still to come, then its CRLF
        self.ended = False

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out = bytearray()
        while not self.ended:
            if self._left > 0:
                take = self._buffer[: self._left]
                out += take
                self._buffer = self._buffer[len(take) :]
                self._left -= len(take)
                if self._left:
                    break
                self._left = -2
            if self._left == -2:  # the CRLF after a chunk's data
                if len(self._buffer) < 2:
                    break
                assert self._buffer[:2] == b"\r\n", self._buffer[:20]
                self._buffer, self._left = self._buffer[2:], 0
            line, sep, rest = self._buffer.partition(b"\r\n")
            if not sep:
                break
            size = int(line.split(b";")[0], 16)
            self._buffer = rest
            if size == 0:
                self.ended = True
            self._left = size
        return bytes(out)


OPEN_STREAMS: list[Stream] = []


def close_open_streams() -> None:
    """Close every `Stream` opened so far (the `close_streams` fixture calls it after a test)."""
    while OPEN_STREAMS:
        OPEN_STREAMS.pop().close()


class Stream:
    """One SSE GET (`/api/events` unless `path` says otherwise) on a raw socket: status and
    headers, then SSE frames; `raw` keeps every body byte received."""

    def __init__(
        self,
        server: Server,
        params: list[tuple[str, str]] | None = None,
        last_event_id: str | None = None,
        rcvbuf: int | None = None,
        timeout: float = WAIT_S,
        path: str = "/api/events",
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        OPEN_STREAMS.append(self)
        if rcvbuf is not None:  # before connect, so the window is small from the start
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.timeout = timeout
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", server.port))
        query = f"?{urlencode(params)}" if params else ""
        lines = [
            f"GET {path}{query} HTTP/1.1",
            "Host: 127.0.0.1",
            f"Authorization: Bearer {server.token}",
            "Accept: text/event-stream",
        ]
        if last_event_id is not None:
            lines.append(f"Last-Event-ID: {last_event_id}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self._dechunk = Dechunker()
        self.parser = FrameParser()
        self.raw = b""
        self._pending: list[Frame] = []
        head = b""
        while b"\r\n\r\n" not in head:
            head += self._recv()
        head, _, rest = head.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {
            k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)
        }
        assert self.status == 200, f"{status_line}: {rest!r}"
        assert self.headers.get("transfer-encoding") == "chunked", self.headers
        self._early = self._dechunk.feed(rest)

    def _recv(self) -> bytes:
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            raise AssertionError(f"the server sent nothing for {self.timeout} s") from None
        assert data, "the server closed the stream"
        return data

    def body(self) -> bytes:
        """The next de-chunked body bytes (blocking, bounded)."""
        if self._early:
            data, self._early = self._early, b""
            return data
        while True:
            data = self._dechunk.feed(self._recv())
            assert not self._dechunk.ended, "the server ended the stream"
            if data:
                return data

    def next(self) -> Frame:
        while not self._pending:
            data = self.body()
            self.raw += data
            self._pending = self.parser.feed(data)
        return self._pending.pop(0)

    def take(self, n: int) -> list[Frame]:
        return [self.next() for _ in range(n)]

    def events(self, n: int) -> list[Frame]:
        """The next n events, skipping keep-alive comments."""
        out: list[Frame] = []
        while len(out) < n:
            frame = self.next()
            if frame.event is not None:
                out.append(frame)
        return out

    def change_seqs(self, n: int) -> list[int]:
        """The seqs of the next n change events (`set`, `del`), failing at a `gap` among them:
        a feed that went on across an outage, not one that began again."""
        seqs: list[int] = []
        while len(seqs) < n:
            frame = self.next()
            assert frame.event != "gap", frame
            if frame.event in ("set", "del"):
                seqs.append(frame.seq)
        return seqs

    def until(
        self, done: Callable[[Replica], bool], replica: Replica, limit: int = 10_000_000
    ) -> Replica:
        for _ in range(limit):
            if done(replica):
                return replica
            replica.apply(self.next())
        raise AssertionError(f"{limit} frames and still not done")

    def close(self) -> None:
        self.sock.close()
