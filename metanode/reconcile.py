"""Range-based set reconciliation over claim identities, in the style of negentropy. Pure.

Two boxes that already share most claims find the few they do not share without sending the
rest (docs/peers.md, "Reconciliation"). Each side holds its identities sorted (`Items`). The
initiator sends the fingerprint of a range (at first the whole space); the responder compares
it with its own fingerprint of the same range: equal, the range is done; different, it answers
with its identities in the range if it holds few (`IdList`), else with the fingerprints of a few
sub-ranges that split its part of the range evenly (`Fingerprint`s). The initiator compares each
sub-range with its own and sends back those that differ; an `IdList` tells it, by a local set
difference, what it lacks (`need`) and what the responder lacks (`have`). Each round shrinks the
responder's share of every open range by `branches`, so it ends after about log_b(n / leaf)
rounds, and what travels grows with the number of differences, not with the size of the sets.

The responder keeps no state between rounds (each message names its ranges), so it can be a
stateless HTTP route. A fingerprint is SHA-256 over the sum (mod 2^128) of a range's ids and
its count: a range's sum is a difference of prefix sums, so any range costs two bisections.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from metanode.errors import InvalidRequest, TooLarge, shown

FP_BYTES = 16
LEAF = 16  # a range holding at most this many of the responder's ids is answered with them
BRANCHES = 16  # a larger one is split into this many sub-ranges
# The ranges a follower asks about in one request: a longer round goes in several (`chunks`),
# each answered in ≈ 0.1 s of the responder's thread and under 2 MB.
REQUEST_RANGES = 1024
# Most ranges one request may ask about. The responder's work and its answer grow with them (at
# most `BRANCHES` entries a range), so a bound keeps one request, a peer token's too, from
# holding a thread for many seconds and sending 100 MB (100,000 ranges took 19 s and answered
# 114 MB). It stays well above `REQUEST_RANGES`: a follower of a version before `chunks` sends
# a round whole (≈ 3,200 ranges when each box lacks 3,000 of the other's 50,000 claims), and
# it backs off and asks again for ever at a refusal that is no 404 or 405.
MAX_RANGES = 16_384
MAX_REPLY = REQUEST_RANGES * BRANCHES  # most entries a reply to one of our requests may hold
# What an initiator goes on with. An honest reconciliation ends within log16(n / 16) + 1 rounds
# (17 for 2^64 ids); each range a round asks about holds a difference, and each id it is told
# of is one the responder holds. A responder that splits every range for ever (the message
# growing 16-fold a round: 750 MB in 30 s in a review) or names ids without end is given up
# on past these; reading its log is then as bounded as it is for any peer.
MAX_ROUNDS = 32
MAX_MESSAGE = 131_072  # ranges of one round (≈ 40 MB); an honest one: that many differences
MAX_NEED = 1_000_000  # ids the initiator lacks; more, and reading the log costs less anyway
_SUM_MOD = 1 << 128


@dataclass(frozen=True)
class Range:
    """The ids `lower <= id < upper` (`upper` None: no end), compared as bytes."""

    lower: bytes
    upper: bytes | None


WHOLE = Range(b"", None)


@dataclass(frozen=True)
class Fingerprint:
    range: Range
    fp: bytes
    count: int


@dataclass(frozen=True)
class IdList:
    range: Range
    ids: tuple[bytes, ...]


Entry = Fingerprint | IdList


class Items:
    """A sorted set of ids (all of one length) with prefix sums over their integer values."""

    def __init__(self, ids: Iterable[bytes]) -> None:
        self.ids = sorted(set(ids))
        self._sums = list(accumulate(map(int.from_bytes, self.ids), initial=0))

    def __len__(self) -> int:
        return len(self.ids)

    def span(self, where: Range) -> tuple[int, int]:
        """The index slice of the ids inside `where`."""
        start = bisect_left(self.ids, where.lower)
        end = len(self.ids) if where.upper is None else bisect_left(self.ids, where.upper)
        return start, max(start, end)

    def fingerprint(self, where: Range) -> Fingerprint:
        start, end = self.span(where)
        return self.fingerprint_span(where, start, end)

    def fingerprint_span(self, where: Range, start: int, end: int) -> Fingerprint:
        total = (self._sums[end] - self._sums[start]) % _SUM_MOD
        count = end - start
        digest = hashlib.sha256(total.to_bytes(16, "big") + count.to_bytes(8, "big")).digest()
        return Fingerprint(where, digest[:FP_BYTES], count)

    def split(self, where: Range, start: int, end: int, branches: int) -> list[Fingerprint]:
        """Fingerprints of `branches` sub-ranges of `where` holding its ids evenly; each inner
        bound is the shortest prefix of a sub-range's first id above the id before it."""
        size = -(-(end - start) // branches)
        cuts = list(range(start + size, end, size))
        separators = [self._separator(cut) for cut in cuts]
        lowers: list[bytes] = [where.lower, *separators]
        uppers: list[bytes | None] = [*separators, where.upper]
        edges = [start, *cuts, end]
        return [
            self.fingerprint_span(Range(lowers[n], uppers[n]), edges[n], edges[n + 1])
            for n in range(len(edges) - 1)
        ]

    def _separator(self, index: int) -> bytes:
        before, first = self.ids[index - 1], self.ids[index]
        common = next(n for n, (a, b) in enumerate(zip(before, first, strict=False)) if a != b)
        return first[: common + 1]


def respond(
    items: Items, message: Sequence[Fingerprint], leaf: int = LEAF, branches: int = BRANCHES
) -> list[Entry]:
    """The responder's answer to the initiator's fingerprints: nothing for a range that agrees,
    its ids for a differing range it holds at most `leaf` of, else that range split."""
    reply: list[Entry] = []
    for theirs in message:
        start, end = items.span(theirs.range)
        mine = items.fingerprint_span(theirs.range, start, end)
        if (mine.fp, mine.count) == (theirs.fp, theirs.count):
            continue
        if end - start <= leaf:
            reply.append(IdList(theirs.range, tuple(items.ids[start:end])))
        else:
            reply.extend(items.split(theirs.range, start, end, max(2, branches)))
    return reply


@dataclass
class Session:
    """The initiator's side: what it learnt so far and what travelled."""

    items: Items
    need: set[bytes] = field(default_factory=set)  # the responder has them, the initiator not
    have: set[bytes] = field(default_factory=set)  # the initiator has them, the responder not
    rounds: int = 0
    fingerprints_sent: int = 0
    fingerprints_received: int = 0
    ids_received: int = 0

    def start(self) -> list[Fingerprint]:
        """The opening message: the fingerprint of everything."""
        return self._sent([self.items.fingerprint(WHOLE)])

    def step(self, reply: Sequence[Entry]) -> list[Fingerprint]:
        """Take the responder's reply; the next message (empty: reconciled)."""
        return self.end_round(self.absorb(reply))

    def end_round(self, message: list[Fingerprint]) -> list[Fingerprint]:
        """The next message, made of what `absorb` gave for each part of a round's reply."""
        self.rounds += 1
        return self._sent(message)

    def absorb(self, reply: Sequence[Entry]) -> list[Fingerprint]:
        """Take part of a round's reply (the responder answers each range on its own, so the
        parts can be taken one by one, none kept); the ranges of the next message it gives."""
        message: list[Fingerprint] = []
        for entry in reply:
            if isinstance(entry, IdList):
                self.ids_received += len(entry.ids)
                start, end = self.items.span(entry.range)
                mine = set(self.items.ids[start:end])
                theirs = set(entry.ids)
                self.need |= theirs - mine
                self.have |= mine - theirs
                continue
            self.fingerprints_received += 1
            own = self.items.fingerprint(entry.range)
            if (own.fp, own.count) != (entry.fp, entry.count):
                message.append(own)
        return message

    def _sent(self, message: list[Fingerprint]) -> list[Fingerprint]:
        self.fingerprints_sent += len(message)
        return message


def run(mine: Items, answer: Callable[[list[Fingerprint]], Sequence[Entry]]) -> Session:
    """Reconcile `mine` against a responder reached through `answer`, each round in requests
    of at most `REQUEST_RANGES` ranges (in memory: the tests and the benchmark; over HTTP,
    `peers.py` drives a `Session` the same way)."""
    session = Session(mine)
    message = session.start()
    while message:
        message = session.step([entry for part in chunks(message) for entry in answer(list(part))])
    return session


# -- the wire form (JSON, ids and fingerprints in unpadded base64url) ----------------------------


def encode_id(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _decode_bytes(text: object, what: str, size: int | None = None) -> bytes:
    if not isinstance(text, str) or not text.isascii() or len(text) > 64:
        raise InvalidRequest(f"{what} must be a short unpadded base64url string")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{what} is not base64url: {shown(text)}") from None
    if encode_id(raw) != text or (size is not None and len(raw) != size):
        raise InvalidRequest(f"{what} is not {size or 'a'}-byte unpadded base64url: {shown(text)}")
    return raw


def decode_id(text: object, size: int) -> bytes:
    return _decode_bytes(text, "an id", size)


def answer(items: Items, message: Sequence[Fingerprint]) -> list[dict[str, Any]]:
    """The responder's reply to `message` as JSON values: the whole of a request's work."""
    return encode(respond(items, message))


def _range_json(where: Range) -> dict[str, Any]:
    upper = None if where.upper is None else encode_id(where.upper)
    return {"lower": encode_id(where.lower), "upper": upper}


def encode(message: Sequence[Entry]) -> list[dict[str, Any]]:
    """A message as JSON values."""
    out: list[dict[str, Any]] = []
    for entry in message:
        if isinstance(entry, IdList):
            out.append({**_range_json(entry.range), "ids": [encode_id(i) for i in entry.ids]})
        else:
            body = {**_range_json(entry.range), "fp": encode_id(entry.fp), "count": entry.count}
            out.append(body)
    return out


def chunks(
    message: Sequence[Fingerprint], step: int = REQUEST_RANGES
) -> list[Sequence[Fingerprint]]:
    """A round's message as requests of at most `step` ranges each: the responder answers each
    range on its own, so the replies to the pieces, joined, are the reply to the whole (a
    follower over a slow link asks fewer at once, `peers.Asking`)."""
    return [message[n : n + step] for n in range(0, len(message), step)]


def _entries(value: object, most: int) -> list[dict[str, Any]]:
    """The entries of a message, refused (`TooLarge`, before any is decoded) beyond `most`."""
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise InvalidRequest("ranges must be an array of objects")
    if len(value) > most:
        raise TooLarge(f"{len(value)} ranges; at most {most} per request")
    return value


def _range(entry: dict[str, Any]) -> Range:
    upper = entry.get("upper")
    where = Range(
        _decode_bytes(entry.get("lower"), "lower"),
        None if upper is None else _decode_bytes(upper, "upper"),
    )
    if where.upper is not None and where.upper <= where.lower:
        raise InvalidRequest("a range's upper bound must be above its lower bound")
    return where


def _fingerprint(entry: dict[str, Any]) -> Fingerprint:
    if set(entry) != {"lower", "upper", "fp", "count"}:
        raise InvalidRequest("a fingerprint range has exactly lower, upper, fp and count")
    count = entry["count"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidRequest("count must be a non-negative integer")
    return Fingerprint(_range(entry), _decode_bytes(entry["fp"], "fp", FP_BYTES), count)


def decode_fingerprints(value: object) -> list[Fingerprint]:
    """The initiator's message (fingerprints only), or 400 `invalid_request` (413 `too_large`
    for more than `MAX_RANGES`)."""
    return [_fingerprint(entry) for entry in _entries(value, MAX_RANGES)]


def decode_reply(value: object, id_bytes: int) -> list[Entry]:
    """The responder's reply, or `InvalidRequest` (a peer answering nonsense)."""
    reply: list[Entry] = []
    for entry in _entries(value, MAX_REPLY):
        if "ids" not in entry:
            reply.append(_fingerprint(entry))
            continue
        ids = entry["ids"]
        if set(entry) != {"lower", "upper", "ids"} or not isinstance(ids, list):
            raise InvalidRequest("an id range has exactly lower, upper and ids (an array)")
        if len(ids) > LEAF:  # the initiator keeps every id it is sent: bounded like the rest
            raise InvalidRequest(f"an id range holds {len(ids)} ids; a responder sends {LEAF}")
        reply.append(IdList(_range(entry), tuple(decode_id(i, id_bytes) for i in ids)))
    return reply
