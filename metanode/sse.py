"""The change feed's wire form, pure: event framing, cursors and filters (SPEC §5).

Framing is sse-starlette's `ServerSentEvent.encode` with `\\n` line ends; every event's data is
one line of compact JSON (JSON escapes newlines inside strings, so no value can break a frame),
with U+0085, U+2028 and U+2029 escaped too (`jsonl.escape_breaks`): SSE ends a line at CR and
LF only, but a reader built on `str.splitlines` (httpx's `iter_lines`) ends one there as well,
and a file name holding one (`line\\u2028sep.mkv`) was cut in two there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sse_starlette import ServerSentEvent

from metanode import jsonl
from metanode import rid as rids
from metanode.errors import InvalidCursor, shown

SEP = "\n"
KEEP_ALIVE = "keep-alive"
_CURSOR = re.compile(r"([0-9]{1,19})-([0-9]{1,19})(?:\.([0-9]{1,19}))?")


# Compact JSON, made once: `json.dumps` with options builds an encoder every call.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _encode(data: dict[str, Any]) -> str:
    """An event's data: one line of compact JSON, whichever line ends its reader honours."""
    return jsonl.escape_breaks(_JSON.encode(data))


def event(kind: str, data: dict[str, Any], event_id: str | None = None) -> ServerSentEvent:
    """One feed event: `set`, `del`, `gap` or `synced`, data as compact JSON."""
    return ServerSentEvent(data=_encode(data), event=kind, id=event_id, sep=SEP)


def keep_alive() -> ServerSentEvent:
    """The comment sent after a silence, so proxies and clients know the stream is alive."""
    return ServerSentEvent(comment=KEEP_ALIVE, sep=SEP)


def change(epoch: int, seq: int, rid: str, op: str, key: str, value: str | None) -> bytes:
    """A feed row as its frame: `set` carries the value, `del` does not.

    The bytes `event(op, data, event_id(epoch, seq)).encode()` gives, written out: every
    event of the feed is framed once, for all its subscribers, and the `ServerSentEvent` and
    its `encode` were half of the 5.4 µs that took (≈ 2.5 µs now; benchmarks.md, "Session 24").
    Its data is one line of compact JSON, which escapes every line end, so there is nothing to
    split (tests/test_feed.py compares the two on arbitrary rows)."""
    data: dict[str, Any] = {"rid": rid, "key": key}
    if op == "set":
        data["value"] = value
    lines = (f"id: {event_id(epoch, seq)}", f"event: {op}", f"data: {_encode(data)}", "", "")
    return SEP.join(lines).encode()


def event_id(epoch: int, seq: int) -> str:
    return f"{epoch}-{seq}"


def state_id(epoch: int, seq: int, seen: int) -> str:
    """A position inside the full state of seq `seq`: its first `seen` events were received."""
    return f"{epoch}-{seq}.{seen}"


@dataclass(frozen=True)
class Cursor:
    """A resume point: the id of the last event a client saw. `state` is set for an id from
    inside a full state (`state_id`): how many of that state's events the client has."""

    epoch: int
    seq: int
    text: str
    state: int | None = None

    @classmethod
    def at(cls, epoch: int, seq: int) -> Cursor:
        """The cursor of a stream's own position (what a `gap` it meets there names)."""
        return cls(epoch, seq, event_id(epoch, seq))


def parse_cursor(text: str | None) -> Cursor | None:
    """`<epoch>-<seq>` or `<epoch>-<seq>.<seen>` from `Last-Event-ID` or `?since=`; None if
    absent, else `invalid_cursor`."""
    if text is None or text == "":
        return None
    match = _CURSOR.fullmatch(text.strip())
    if match is None:
        raise InvalidCursor(f"cursor {shown(text)} is not <epoch>-<seq> or <epoch>-<seq>.<n>")
    seen = None if match.group(3) is None else int(match.group(3))
    return Cursor(int(match.group(1)), int(match.group(2)), text.strip(), seen)


UNKNOWN_EPOCH = "unknown_epoch"  # another epoch: a rebuilt cache, another node's, `0-0`
FUTURE = "future"  # beyond the newest event
TOO_OLD = "too_old"  # the next event was pruned (retention)
STATE_CHANGED = "state_changed"  # a cursor inside a full state that has changed since


def resume_gap(cursor: Cursor, epoch: int, head: int, oldest: int | None) -> str | None:
    """SPEC §5's resume rule, for every stream: why the client cannot continue from `cursor`
    on a table of epoch `epoch` whose newest seq is `head` and oldest stored one `oldest`
    (None: empty, so nothing up to `head` is left), or None if it can. An ordinary cursor
    continues with the events after it, if every one is stored. A cursor inside a full state
    continues with the rest of that state, if it is still the state at `head`: a state is
    numbered by the seq it reflects, so the same seq means the same events in the same order
    (unchanged since, whatever the log's retention)."""
    if cursor.epoch != epoch:
        return UNKNOWN_EPOCH
    if cursor.seq > head:
        return FUTURE
    if cursor.state is not None:
        return None if cursor.seq == head else STATE_CHANGED
    if cursor.seq < (head + 1 if oldest is None else oldest) - 1:
        return TOO_OLD
    return None


def gap(requested: str | None, reason: str, resume_from: str) -> ServerSentEvent:
    """The `gap` event, for every stream: where the client asked to resume, why it cannot, and
    `resumeFrom`, the start of the full state that follows. It is also the event's id, so a
    client resumes inside that state (from its start, or from the last state event it saw)
    whether it adopts `resumeFrom` or tracks ids: never after a state it did not get whole."""
    data = {"reason": reason, "requested": requested, "resumeFrom": resume_from}
    return event("gap", data, resume_from)


@dataclass(frozen=True)
class Filter:
    """`?rid=`, `?prefix=` and `?exclude=` (each repeatable): an event passes if it matches
    both kinds of the first two and no `exclude` prefix (the web page's Live leaves out the
    `cids/…` links it does not show rather than receive them: 60 of the 302 events, 26 % of the
    bytes, of 20 new files with the built-in plugins; one of two of a claim on a new CID)."""

    rids: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, rid_values: Iterable[str], prefixes: Iterable[str], excluded: Iterable[str] = ()
    ) -> Filter:
        return cls(frozenset(rids.parse(r) for r in rid_values), tuple(prefixes), tuple(excluded))

    @property
    def everything(self) -> bool:
        """No filter at all: every event passes."""
        return not self.rids and not self.prefixes and not self.excluded

    def matches(self, rid: str, key: str) -> bool:
        if self.rids and rid not in self.rids:
            return False
        if self.excluded and key.startswith(self.excluded):
            return False
        return not self.prefixes or key.startswith(self.prefixes)
