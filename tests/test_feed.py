"""The change feed (SPEC §5), without a server: the SSE wire form byte for byte, cursors, filters,
the CLI's frame parser, the 503 path, and subscriptions driven in-process against a started node.

Streaming over HTTP is tested against a real uvicorn server in `test_feed_server.py` (the
in-process ASGI transport buffers a streamed body until it ends). Here the async generator of
`Node.subscribe(...).stream()` is iterated directly; every event it yields is encoded and parsed
back, so the checks see exactly the frames a client would. The client-side helpers
(`FrameParser`, `Replica`, `fast_claims`) live in `tests/helpers/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import random
import sqlite3
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sse_starlette import ServerSentEvent

from metanode import cache, feed, sse
from metanode import rid as rids
from metanode.api import error_response
from metanode.errors import CacheNotReady, InvalidCursor, InvalidRid, StorageError
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer, fast_claims, register
from tests.helpers.feed import (
    Frame,
    FrameParser,
    Replica,
    assert_agrees,
    cid_n,
    gap_frame,
    new_cid_claims,
    reached,
)

RID = rids.encode(0x0190_0000_0000_7000_8000_0000_0000_0001)
OTHER_RID = rids.encode(0x0190_0000_0000_7000_8000_0000_0000_0002)


def records(conn: sqlite3.Connection, where: Any = None) -> dict[tuple[str, str], str]:
    """The cache's current records as {(rid, key): value}, optionally only those `where` admits."""
    rows = conn.execute("SELECT rid, key, value FROM records").fetchall()
    return {(r, k): v for r, k, v in rows if where is None or where(r, k)}


# -- the wire form, byte for byte ------------------------------------------------------------


@pytest.mark.parametrize(
    ("built", "expected"),
    [
        (
            sse.change(5, 7, "R", "set", "k", "v"),
            b'id: 5-7\nevent: set\ndata: {"rid":"R","key":"k","value":"v"}\n\n',
        ),
        (
            sse.change(5, 8, "R", "del", "k", None),
            b'id: 5-8\nevent: del\ndata: {"rid":"R","key":"k"}\n\n',
        ),
        (
            sse.change(5, 8, "R", "del", "k", "ignored"),  # a del never carries a value
            b'id: 5-8\nevent: del\ndata: {"rid":"R","key":"k"}\n\n',
        ),
        (
            sse.change(1796083954188, 123456789, RID, "set", "title", "Amélie ☃ 🎬 字"),
            f'id: 1796083954188-123456789\nevent: set\ndata: {{"rid":"{RID}","key":"title",'
            f'"value":"Amélie ☃ 🎬 字"}}\n\n'.encode(),
        ),
        (
            sse.change(2, 3, "R", "set", "plot", "line one\nline two\r\nthree\rfour\tend"),
            b'id: 2-3\nevent: set\ndata: {"rid":"R","key":"plot",'
            b'"value":"line one\\nline two\\r\\nthree\\rfour\\tend"}\n\n',
        ),
        (
            sse.change(2, 4, "R", "set", "q", 'say "hi" \\ \x00\x1f'),
            b'id: 2-4\nevent: set\ndata: {"rid":"R","key":"q","value":"say \\"hi\\" \\\\ '
            b'\\u0000\\u001f"}\n\n',
        ),
        (
            # not SSE's line ends, but `str.splitlines`' (httpx's `iter_lines`): escaped
            sse.change(2, 5, "R", "set", "ls", "a\u2028b\u2029c\x85d"),
            b'id: 2-5\nevent: set\ndata: {"rid":"R","key":"ls",'
            b'"value":"a\\u2028b\\u2029c\\u0085d"}\n\n',
        ),
        (
            sse.change(2, 6, "R", "set", "empty", ""),
            b'id: 2-6\nevent: set\ndata: {"rid":"R","key":"empty","value":""}\n\n',
        ),
        (
            sse.event("gap", {"requested": "0-0", "reason": "unknown_epoch"}),
            b'event: gap\ndata: {"requested":"0-0","reason":"unknown_epoch"}\n\n',
        ),
        (
            sse.event("gap", {"requested": None, "reason": "too_old"}),
            b'event: gap\ndata: {"requested":null,"reason":"too_old"}\n\n',
        ),
        (sse.event("synced", {"id": "9-0"}), b'event: synced\ndata: {"id":"9-0"}\n\n'),
        (
            sse.event("set", {"rid": "R", "key": "k", "value": "v"}),  # a snapshot row: no id
            b'event: set\ndata: {"rid":"R","key":"k","value":"v"}\n\n',
        ),
        (sse.keep_alive(), b": keep-alive\n\n"),
    ],
)
def test_encoding_is_byte_exact(built: ServerSentEvent | bytes, expected: bytes) -> None:
    assert (built if isinstance(built, bytes) else built.encode()) == expected


@given(
    epoch=st.integers(0, 2**63 - 1),
    seq=st.integers(0, 2**63 - 1),
    rid=st.text(),
    op=st.sampled_from(["set", "del"]),
    key=st.text(),
    value=st.text(),
)
def test_a_change_is_framed_as_sse_starlette_frames_its_event(
    epoch: int, seq: int, rid: str, op: str, key: str, value: str
) -> None:
    """`sse.change` writes the frame out; it must be byte for byte what `ServerSentEvent`
    makes of the same event, whatever the text (line ends, NUL, lone surrogates excepted:
    neither can encode those)."""
    data = {"rid": rid, "key": key, **({"value": value} if op == "set" else {})}
    try:
        expected = sse.event(op, data, sse.event_id(epoch, seq)).encode()
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            sse.change(epoch, seq, rid, op, key, value)
        return
    frame = sse.change(epoch, seq, rid, op, key, value)
    assert frame == expected
    # one line a field, whichever line ends the reader honours
    assert frame.decode().splitlines() == frame.decode().split("\n")[:-1]


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "",
        "multi\nline\n\n",
        "\r\n\r",
        "ü 漢字 🎉",
        "a\u2028b",
        ":colon",
        "data: fake\n\nevent: del",
        "x" * 70_000,
    ],
)
def test_any_value_is_one_data_line_and_round_trips(value: str) -> None:
    encoded = sse.change(3, 4, RID, "set", "k", value)
    lines = encoded.split(b"\n")
    assert lines[-2:] == [b"", b""] and b"\r" not in encoded
    assert [line.split(b":", 1)[0] for line in lines[:-2]] == [b"id", b"event", b"data"]
    assert FrameParser().feed(encoded) == [
        Frame("set", "3-4", {"rid": RID, "key": "k", "value": value})
    ]


def test_event_data_is_compact_json_with_unescaped_unicode() -> None:
    encoded = sse.event("set", {"rid": "R", "key": "ключ", "value": "значение"}).encode()
    assert encoded == 'event: set\ndata: {"rid":"R","key":"ключ","value":"значение"}\n\n'.encode()
    assert sse.event_id(17, 0) == "17-0"
    with pytest.raises(ValueError):
        sse.event("set", {"value": float("nan")})


# -- cursors and filters --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5-7", sse.Cursor(5, 7, "5-7")),
        ("0-0", sse.Cursor(0, 0, "0-0")),
        (" 1796083954188-42 ", sse.Cursor(1796083954188, 42, "1796083954188-42")),
        (
            "9223372036854775807-9999999999999999999",
            sse.Cursor(
                9223372036854775807, 9999999999999999999, "9223372036854775807-9999999999999999999"
            ),
        ),
        ("007-010", sse.Cursor(7, 10, "007-010")),
        (None, None),
        ("", None),
    ],
)
def test_parse_cursor(text: str | None, expected: sse.Cursor | None) -> None:
    assert sse.parse_cursor(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "5",
        "5-",
        "-7",
        "5--7",
        "5-7-9",
        "a-1",
        "1-b",
        "-1-2",
        "1.0-2",
        "+1-2",
        "1 - 2",
        "1_0-2",
        "12345678901234567890-1",
        "1-12345678901234567890",
        " ",
        "5-7\n8",
        "0x1-2",
    ],
)
def test_parse_cursor_rejects(text: str) -> None:
    with pytest.raises(InvalidCursor) as caught:
        sse.parse_cursor(text)
    assert caught.value.status == 400 and caught.value.slug == "invalid_cursor"


@pytest.mark.parametrize("text", ["١-٢", "１-２", "5-७"])
def test_parse_cursor_rejects_non_ascii_digits(text: str) -> None:
    """Regression: `\\d` without re.ASCII took any Unicode digit (`?since=١-٢` was 1-2)."""
    with pytest.raises(InvalidCursor):
        sse.parse_cursor(text)


def test_filter_matches() -> None:
    everything = sse.Filter.of([], [])
    assert everything.matches(RID, "title") and everything.matches(OTHER_RID, "")
    by_rid = sse.Filter.of([RID.lower()], [])  # rids are normalised
    assert by_rid.rids == frozenset({RID})
    assert by_rid.matches(RID, "anything") and not by_rid.matches(OTHER_RID, "anything")
    by_prefix = sse.Filter.of([], ["cids/", "ti"])
    assert by_prefix.matches(RID, "title") and by_prefix.matches(OTHER_RID, "cids/bafy")
    assert not by_prefix.matches(RID, "year") and not by_prefix.matches(RID, "t")
    both = sse.Filter.of([RID, OTHER_RID], ["year"])
    assert both.matches(OTHER_RID, "year") and both.matches(RID, "years")
    assert not both.matches(RID, "title")
    assert not both.matches(rids.encode(0x0190_0000_0000_7000_8000_0000_0000_0003), "year")
    assert sse.Filter.of([], [""]).matches(RID, "x")  # the empty prefix admits every key
    shown = sse.Filter.of([], [], ["cids/"])  # the web page's Live
    assert not shown.everything and shown.matches(RID, "title") and shown.matches(RID, "cids")
    assert not shown.matches(RID, "cids/bafy")
    titles = sse.Filter.of([RID], ["ti", "ci"], ["cids/", "tix"])  # excluded wins over prefix
    assert titles.matches(RID, "title") and titles.matches(RID, "cidsx")
    assert not titles.matches(RID, "cids/x") and not titles.matches(RID, "tix")


@pytest.mark.parametrize("bad", ["", "not a rid", "00000000000000000000000000"])
def test_filter_rejects_bad_rids(bad: str) -> None:
    with pytest.raises(InvalidRid):
        sse.Filter.of([bad], [])


# -- the CLI's frame parser -----------------------------------------------------------------


def cli_frame_lines(lines: list[str]) -> list[str]:
    """`metanode events`' parse of text lines, as the `<id or -> <event> <data>` it prints.

    The parser lives in `metanode.client` (yielding events) or, before that module, in
    `metanode.cli` (yielding the printed lines); either is normalised to the printed form.
    """
    where = "metanode.client" if importlib.util.find_spec("metanode.client") else "metanode.cli"
    out = []
    for item in importlib.import_module(where).parse_frames(iter(lines)):
        if isinstance(item, str):
            out.append(item)
        else:
            data = json.dumps(item.data, ensure_ascii=False, separators=(",", ":"))
            out.append(f"{item.id or '-'} {item.kind} {data}")
    return out


def test_parse_frames() -> None:
    wire = (
        ": keep-alive\n\n"
        'id: 5-7\nevent: set\ndata: {"rid":"R","key":"k","value":"v ☃"}\n\n'
        'event: gap\ndata: {"requested":"0-0","reason":"unknown_epoch"}\n\n'
        'event: set\ndata: {"rid":"R","key":"k","value":"snap"}\n\n'
        'event: synced\ndata: {"id":"5-7"}\n\n'
        "id:5-8\nevent:del\ndata:{}\n\n"  # no space after the colon: still a value
        'data: "no event name"\n\n'
        "id: 5-9\nevent: ignored-without-data\n\n"
        "retry: 10\n: comment\n\n"
    )
    assert cli_frame_lines(wire.split("\n")) == [
        '5-7 set {"rid":"R","key":"k","value":"v ☃"}',
        '- gap {"requested":"0-0","reason":"unknown_epoch"}',
        '- set {"rid":"R","key":"k","value":"snap"}',
        '- synced {"id":"5-7"}',
        "5-8 del {}",
        '- message "no event name"',
    ]
    assert cli_frame_lines(['data: {"unterminated":1}']) == []


# -- errors before the stream starts --------------------------------------------------------


def test_cache_not_ready_renders_503_with_retry_after() -> None:
    response = error_response(CacheNotReady("building"))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(bytes(response.body)) == {
        "error": "cache_not_ready",
        "message": "building",
        "retryable": True,
    }


async def test_events_answers_503_while_the_cache_is_not_ready(
    client: httpx.AsyncClient, node: Node
) -> None:
    node.applier.ready = False
    try:
        for query in ("", "?snapshot=1", "?since=1-1"):
            response = await client.get(f"/api/events{query}")
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"] == "cache_not_ready"
            assert response.json()["retryable"] is True
    finally:
        node.applier.ready = True


@pytest.mark.parametrize(
    ("query", "headers", "slug"),
    [
        ("?since=yesterday", {}, "invalid_cursor"),
        ("", {"Last-Event-ID": "5"}, "invalid_cursor"),
        ("?since=1-1", {"Last-Event-ID": "bad"}, "invalid_cursor"),  # the header wins over since=
        ("?rid=nope", {}, "invalid_rid"),
    ],
)
async def test_events_rejects_bad_requests(
    client: httpx.AsyncClient, query: str, headers: dict[str, str], slug: str
) -> None:
    response = await client.get(f"/api/events{query}", headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == slug and response.json()["retryable"] is False


async def test_events_needs_the_token(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/events", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and response.json()["error"] == "unauthorized"


# -- subscriptions in-process ---------------------------------------------------------------


class Reader:
    """Pulls frames from one subscription's stream, each pull bounded by a timeout."""

    def __init__(self, stream: AsyncIterator[bytes], timeout: float = 10.0) -> None:
        self._stream = stream
        self._parser = FrameParser()
        self._pending: list[Frame] = []
        self.timeout = timeout

    async def next(self) -> Frame:
        while not self._pending:
            try:
                async with asyncio.timeout(self.timeout):  # not wait_for: it may swallow a
                    chunk = await anext(self._stream)  # cancel on 3.11, and loop forever
            except TimeoutError:
                raise AssertionError(f"no event within {self.timeout} s") from None
            assert chunk.endswith(b"\n\n"), f"a chunk ends inside a frame: {chunk[-80:]!r}"
            self._pending = self._parser.feed(chunk)
        return self._pending.pop(0)

    async def take(self, n: int) -> list[Frame]:
        return [await self.next() for _ in range(n)]

    async def until(self, done: Any, replica: Replica, limit: int = 1_000_000) -> None:
        """Apply frames to `replica` until `done(replica)`."""
        for _ in range(limit):
            if done(replica):
                return
            replica.apply(await self.next())
        raise AssertionError(f"{limit} frames and still not done")

    async def close(self) -> None:
        await self._stream.aclose()  # type: ignore[attr-defined]


@dataclass
class Feed:
    node: Node
    client: httpx.AsyncClient
    signer: Signer = field(default_factory=Signer)

    @property
    def epoch(self) -> int:
        return self.node.applier.state.epoch

    @property
    def head(self) -> int:
        return self.node.applier.state.feed_seq

    def cursor(self, seq: int) -> str:
        return sse.event_id(self.epoch, seq)

    def reader(
        self,
        cursor: str | None = None,
        snapshot: bool = False,
        rid: Iterable[str] = (),
        prefix: Iterable[str] = (),
        keep_alive_s: float | None = None,
    ) -> Reader:
        where = sse.Filter.of(rid, prefix)
        if keep_alive_s is None:
            subscribed: Any = self.node.subscribe(cursor, snapshot, where)
            # a Subscription, or (wrapped for counting) its stream itself
            return Reader(subscribed.stream() if hasattr(subscribed, "stream") else subscribed)
        source = replace(self.node.meta_feed(), keep_alive_s=keep_alive_s)
        framing = feed.RecordFraming(self.node.cache, where)
        subscription = feed.Subscription(source, framing, sse.parse_cursor(cursor), snapshot)
        return Reader(subscription.stream())

    async def post(self, batch: list[dict[str, Any]]) -> None:
        for i in range(0, len(batch), 500):
            response = await self.client.post("/api/claims", json={"claims": batch[i : i + 500]})
            assert response.status_code == 200, response.text
            assert response.json()["accepted"] == len(batch[i : i + 500]), response.text

    def records(self, where: Any = None) -> dict[tuple[str, str], str]:
        return records(self.node.cache.conn, where)

    def rid(self, cid: str) -> str:
        found = cache.lookup(self.node.cache.conn, cid)
        assert found is not None, f"{cid} is in no record"
        return found


@pytest.fixture
async def fd(node: Node, client: httpx.AsyncClient) -> Feed:
    out = Feed(node, client)
    await register(client, out.signer, may_link=True)
    return out


async def test_live_only_without_a_cursor(fd: Feed) -> None:
    await fd.post(new_cid_claims(fd.signer, "old", 3))
    reader = fd.reader()
    await fd.post(new_cid_claims(fd.signer, "new", 2))
    frames = await reader.take(4)
    assert [f.id for f in frames] == [fd.cursor(s) for s in (7, 8, 9, 10)]
    assert [(f.event, f.data["key"], f.data["value"]) for f in frames] == [
        ("set", f"cids/{cid_n('new', 0)}", "true"),
        ("set", "title", "new 0"),
        ("set", f"cids/{cid_n('new', 1)}", "true"),
        ("set", "title", "new 1"),
    ]
    assert frames[0].data["rid"] == frames[1].data["rid"] == fd.rid(cid_n("new", 0))
    await reader.close()


async def test_snapshot_then_synced_then_live(fd: Feed) -> None:
    empty = fd.reader(snapshot=True)
    assert await empty.take(1) == [Frame("synced", fd.cursor(0), {"id": fd.cursor(0)})]
    await fd.post(new_cid_claims(fd.signer, "a", 3))
    replica = Replica()
    reader = fd.reader(snapshot=True)
    await reader.until(lambda r: bool(r.synced), replica)
    assert replica.synced == [fd.cursor(6)] and replica.state == fd.records()
    assert len(replica.state) == 6 and not replica.seqs
    await fd.post(
        fd_update := fast_claims(fd.signer, [(cid_n("a", 1), "title", "changed", NOW_MS + 1)])
    )
    assert fd_update
    await reader.until(lambda r: r.position == 7, replica)
    assert replica.state == fd.records() and replica.seqs == [7]
    # the stream that started on an empty store follows the same events
    catch_up = Replica(fd.cursor(0))
    await empty.until(lambda r: r.position == 7, catch_up)
    assert catch_up.state == fd.records()
    await reader.close()
    await empty.close()


async def test_replay_after_a_cursor_then_live(fd: Feed) -> None:
    await fd.post(new_cid_claims(fd.signer, "r", 5))
    replica = Replica(fd.cursor(4))
    reader = fd.reader(fd.cursor(4))
    await reader.until(lambda r: bool(r.synced), replica)
    assert replica.seqs == [5, 6, 7, 8, 9, 10] and replica.synced == [fd.cursor(10)]
    assert not replica.gaps
    await fd.post(fast_claims(fd.signer, [(cid_n("r", 0), "title", None, NOW_MS + 1)]))
    frame = await reader.next()
    assert frame == Frame("del", fd.cursor(11), {"rid": fd.rid(cid_n("r", 0)), "key": "title"})
    # at the head: nothing to replay, straight to synced
    at_head = fd.reader(fd.cursor(11))
    assert await at_head.take(1) == [Frame("synced", fd.cursor(11), {"id": fd.cursor(11)})]
    await reader.close()
    await at_head.close()


@pytest.mark.parametrize(
    ("cursor", "reason"),
    [
        ("0-0", "unknown_epoch"),
        ("1-1", "unknown_epoch"),
        ("{epoch_plus}-3", "unknown_epoch"),
        ("{epoch}-7", "future"),
        ("{epoch}-1007", "future"),
    ],
)
async def test_unusable_cursors_get_gap_snapshot_synced_live(
    fd: Feed, cursor: str, reason: str
) -> None:
    await fd.post(new_cid_claims(fd.signer, "g", 3))
    cursor = cursor.format(epoch=fd.epoch, epoch_plus=fd.epoch + 1)
    replica = Replica()
    reader = fd.reader(cursor)
    first = await reader.next()
    assert first == gap_frame(cursor, reason, fd.cursor(6))
    replica.apply(first)
    await reader.until(lambda r: bool(r.synced), replica)
    assert replica.synced == [fd.cursor(6)] and replica.state == fd.records()
    await fd.post(new_cid_claims(fd.signer, "g", 1, start=3))
    await reader.until(lambda r: r.position == 8, replica)
    assert replica.seqs == [7, 8] and replica.state == fd.records()
    await reader.close()


async def test_retention_too_old_cursor_and_lagging_subscriber(fd: Feed) -> None:
    """Pruning while a subscriber lags: it gets what it already fetched, then gap + snapshot."""
    await fd.post(new_cid_claims(fd.signer, "p", 1_500))  # 3,000 events
    assert fd.head == 3_000
    lagging = fd.reader(fd.cursor(0))
    replica = Replica(fd.cursor(0))
    replica.apply_all(await lagging.take(10))
    deleted = await fd.node.cache.writer.run(cache.prune_feed_txn, 1_000, 0)
    assert deleted == 2_000
    # cursors: 2,000 still has every later event (2,001…); 1,999 lost one
    assert (await fd.reader(fd.cursor(1_999)).next()) == gap_frame(
        fd.cursor(1_999), "too_old", fd.cursor(3_000)
    )
    replay = Replica(fd.cursor(2_000), gaps_allowed=False)
    await fd.reader(fd.cursor(2_000)).until(lambda r: bool(r.synced), replay)
    assert replay.seqs == list(range(2_001, 3_001))
    # the lagging one: the rest of the page it had read, then the gap, then the snapshot
    await lagging.until(lambda r: bool(r.synced), replica)
    assert replica.seqs == list(range(1, feed.PAGE + 1))
    assert replica.gaps == [{"requested": fd.cursor(feed.PAGE), "reason": "too_old"}]
    assert replica.synced == [fd.cursor(3_000)] and replica.state == fd.records()
    await fd.post(new_cid_claims(fd.signer, "p", 1, start=1_500))
    await lagging.until(lambda r: r.position == 3_002, replica)
    assert replica.state == fd.records()


async def test_everything_pruned_by_age_keeps_the_counter(fd: Feed) -> None:
    await fd.post(new_cid_claims(fd.signer, "age", 2))
    assert await fd.node.cache.writer.run(cache.prune_feed_txn, 1_000_000, 2**62) == 4
    assert fd.node.cache.conn.execute("SELECT count(*) FROM feed").fetchone()[0] == 0
    assert (await fd.reader(fd.cursor(3)).next()).data["reason"] == "too_old"
    at_head = fd.reader(fd.cursor(4))
    assert await at_head.take(1) == [Frame("synced", fd.cursor(4), {"id": fd.cursor(4)})]
    await fd.post(new_cid_claims(fd.signer, "age", 1, start=2))
    assert [f.id for f in await at_head.take(2)] == [fd.cursor(5), fd.cursor(6)]


async def test_filters_apply_to_replay_snapshot_and_live(fd: Feed) -> None:
    batch = fast_claims(
        fd.signer,
        [
            (cid_n("f", i), key, f"{key} {i}", NOW_MS)
            for i in range(3)
            for key in ("title", "year", "genre")
        ],
    )
    await fd.post(batch)
    rid0, rid1, rid2 = (fd.rid(cid_n("f", i)) for i in range(3))
    cases: list[tuple[set[str], tuple[str, ...]]] = [
        ({rid0}, ()),
        (set(), ("ti", "ye")),
        ({rid1, rid2}, ("genre",)),
        (set(), ("cids/",)),
        ({rid0}, ("nothing",)),
    ]
    subs = []
    for rid_set, prefixes in cases:
        where = sse.Filter.of(rid_set, prefixes).matches
        replay = Replica(fd.cursor(0), dense=False, gaps_allowed=False)
        replay_reader = fd.reader(fd.cursor(0), rid=[r.lower() for r in rid_set], prefix=prefixes)
        await replay_reader.until(lambda r: bool(r.synced), replay)
        assert replay.state == fd.records(where), (rid_set, prefixes)
        assert replay.synced == [fd.cursor(fd.head)]
        assert replay.seqs == [seq for seq, rid, key in feed_rows(fd, 0) if where(rid, key)]
        snap = Replica(dense=False, gaps_allowed=False)
        snap_reader = fd.reader(snapshot=True, rid=rid_set, prefix=prefixes)
        await snap_reader.until(lambda r: bool(r.synced), snap)
        assert snap.state == fd.records(where), (rid_set, prefixes)
        live = Replica(fd.cursor(fd.head), dense=False, gaps_allowed=False)
        live_reader = fd.reader(rid=rid_set, prefix=prefixes)
        subs.append((where, [(replay, replay_reader), (snap, snap_reader), (live, live_reader)]))
    mark = fd.head
    await fd.post(
        fast_claims(
            fd.signer,
            [
                (cid_n("f", 0), "title", "new title 0", NOW_MS + 1),
                (cid_n("f", 1), "year", None, NOW_MS + 1),
                (cid_n("f", 2), "genre", "new genre 2", NOW_MS + 1),
                (cid_n("f", 2), "plot", "plot 2", NOW_MS + 1),
            ],
        )
    )
    # last, an event each filter admits, so every reader can tell it has seen all before it
    await fd.post(
        fast_claims(
            fd.signer,
            [
                (cid_n("f", 0), "title", "end", NOW_MS + 2),
                (cid_n("f", 2), "genre", "end", NOW_MS + 2),
                (cid_n("f", 0), "nothingness", "end", NOW_MS),
                (cid_n("f", 9), "x", "end", NOW_MS),
            ],
        )
    )
    changed = feed_rows(fd, mark)
    for where, readers in subs:
        expected = [seq for seq, rid, key in changed if where(rid, key)]
        assert expected, "the last batch has an event for every filter"
        for replica, reader in readers:
            start = len(replica.seqs)
            await reader.until(reached(expected[-1]), replica)
            assert replica.seqs[start:] == expected
            if replica.snapshot_sizes:
                assert replica.state == fd.records(where)
            assert_agrees(replica, fd.records(where))
            await reader.close()


def feed_rows(fd: Feed, after: int) -> list[tuple[int, str, str]]:
    return [
        (seq, rid, key)
        for seq, rid, key in fd.node.cache.conn.execute(
            "SELECT seq, rid, key FROM feed WHERE seq > ? ORDER BY seq", (after,)
        )
    ]


async def test_merge_is_del_for_the_loser_and_set_for_the_survivor(fd: Feed) -> None:
    a, b = cid_n("m", 1), cid_n("m", 2)
    await fd.post(fast_claims(fd.signer, [(a, "title", "old group", NOW_MS)]))
    await fd.post(
        fast_claims(fd.signer, [(b, "title", "new group", NOW_MS + 1), (b, "genre", "sf", NOW_MS)])
    )
    older, newer = fd.rid(a), fd.rid(b)
    assert older < newer
    replica = Replica(fd.cursor(fd.head))
    reader = fd.reader(fd.cursor(fd.head))
    await reader.until(lambda r: bool(r.synced), replica)
    mark = len(replica.seqs)
    await fd.post(fast_claims(fd.signer, [(b, f"cids/{a}", "true", NOW_MS)]))
    await reader.until(lambda r: r.position == fd.head, replica)
    events = [
        (f.event, f.data["rid"], f.data["key"], f.data.get("value")) for f in replica.history[mark:]
    ]
    assert events == sorted(events, key=lambda e: e[1] != newer)  # every del first
    assert {e for e in events if e[1] == newer} == {
        ("del", newer, k, None) for k in ("title", "genre", f"cids/{b}")
    }
    assert {e for e in events if e[1] == older} == {
        ("set", older, "title", "new group"),
        ("set", older, "genre", "sf"),
        ("set", older, f"cids/{b}", "true"),
    }
    assert_agrees(replica, fd.records())
    assert not any(rid == newer for rid, _ in fd.records())
    await reader.close()


async def test_keep_alive_when_idle(fd: Feed) -> None:
    reader = fd.reader(fd.cursor(0), keep_alive_s=0.05)
    assert (await reader.next()).event == "synced"
    assert await reader.take(2) == [Frame(comment="keep-alive")] * 2
    await fd.post(new_cid_claims(fd.signer, "k", 1))
    frames = [f for f in await reader.take(4) if f.event is not None][:2]
    assert [f.id for f in frames] == [fd.cursor(1), fd.cursor(2)]
    await reader.close()


async def test_keep_alive_reaches_a_filtered_subscriber_while_other_events_flow(fd: Feed) -> None:
    """Regression: the keep-alive was sent only when the whole feed had been quiet, so a
    subscriber whose filter admitted none of a steady flow of events heard nothing, ever."""
    keep_alive_s = 0.2
    reader = fd.reader(prefix=["no such key/"], keep_alive_s=keep_alive_s)
    heard: list[Frame] = []

    async def listen() -> None:
        while True:
            heard.append(await reader.next())

    listener = asyncio.create_task(listen())
    loop = asyncio.get_running_loop()
    deadline, n = loop.time() + 30, 0  # a bound on a failure, far past 5 keep-alive periods
    # events every few ms (none admitted by the filter) until the subscriber hears a keep-alive
    while Frame(comment="keep-alive") not in heard and loop.time() < deadline:
        await fd.post(new_cid_claims(fd.signer, "busy", 1, start=n))
        n += 1
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    assert fd.head == 2 * n
    assert Frame(comment="keep-alive") in heard, (
        f"{n} posts over 30 s, no keep-alive to a filtered subscriber"
    )


async def test_snapshot_and_live_tail_are_exact_while_ingesting(fd: Feed) -> None:
    """Subscribers that join mid-ingest (snapshot, replay or gap) end equal to the records."""
    batches = [new_cid_claims(fd.signer, f"c{b}", 100) for b in range(12)]
    updates = [
        fast_claims(
            fd.signer, [(cid_n(f"c{b}", i), "title", f"v{b}", NOW_MS + 1) for i in range(0, 100, 3)]
        )
        for b in range(6)
    ]
    joined: list[tuple[Replica, Reader]] = []

    async def ingest() -> None:
        for n, batch in enumerate(batches + updates):
            await fd.post(batch)
            if n % 3 == 1:
                joined.append((Replica(), fd.reader(snapshot=True)))
                joined.append((Replica(), fd.reader("0-0")))
                middle = fd.cursor(fd.head // 2)
                joined.append((Replica(middle, gaps_allowed=False), fd.reader(middle)))
            await asyncio.sleep(0)

    target = 2 * sum(map(len, batches)) + sum(map(len, updates))

    async def follow(replica: Replica, reader: Reader) -> None:
        await reader.until(lambda r: bool(r.synced) and r.position >= target, replica)

    producer = asyncio.create_task(ingest())
    # readers start reading while the producer is still posting
    followers: list[asyncio.Task[None]] = []
    while not producer.done() or len(followers) < len(joined):
        while len(followers) < len(joined):
            followers.append(asyncio.create_task(follow(*joined[len(followers)])))
        await asyncio.sleep(0.01)
    await producer
    assert fd.head == target
    await asyncio.gather(*followers)
    assert len(joined) == 18
    want = fd.records()
    for replica, reader in joined:
        assert replica.position == fd.head
        if replica.snapshot_sizes:  # started from a snapshot: it holds every record
            assert replica.state == want
        else:  # replayed from mid-way: every event since, and those agree with the records
            assert replica.seqs == list(range(replica.seqs[0], fd.head + 1))
            assert_agrees(replica, want)
        await reader.close()


async def test_rebuild_while_a_subscriber_drains_never_mislabels_events(fd: Feed) -> None:
    """Regression: `_drain` checked the epoch only when a page came back empty, so after a
    rebuild (feed restarted at seq 1) a lagging subscriber got the new epoch's rows under the
    old epoch's ids."""
    await fd.post(new_cid_claims(fd.signer, "e", 400))  # 800 events in the old epoch
    old_epoch = fd.epoch
    old_feed = {
        seq: (rid, op, key, value)
        for seq, rid, op, key, value in fd.node.cache.conn.execute(
            "SELECT seq, rid, op, key, value FROM feed"
        )
    }
    replica = Replica(fd.cursor(0))
    lagging = fd.reader(fd.cursor(0))
    replica.apply_all(await lagging.take(10))  # it has fetched its first page (1…PAGE)
    await fd.node.cache.build(fd.node.truth)  # what `metanode rebuild-cache` does, here live
    await fd.post(new_cid_claims(fd.signer, "e", 350, start=400))  # 700 events, new epoch
    assert fd.epoch != old_epoch and fd.head == 700
    await lagging.until(lambda r: r.epoch == fd.epoch and r.position == 700, replica, limit=5_000)
    old_events = [f for f in replica.history if f.id and f.id.startswith(f"{old_epoch}-")]
    mislabelled = [
        f
        for f in old_events
        if old_feed[f.seq] != (f.data["rid"], f.event, f.data["key"], f.data.get("value"))
    ]
    assert not mislabelled, (
        f"{len(mislabelled)} events not in the old epoch, e.g. "
        f"{mislabelled[0]} (the old epoch's {mislabelled[0].id} was {old_feed[mislabelled[0].seq]})"
    )
    assert [f.seq for f in old_events] == list(range(1, feed.PAGE + 1))
    assert replica.gaps == [
        {"requested": sse.event_id(old_epoch, feed.PAGE), "reason": "unknown_epoch"}
    ]
    assert replica.state == fd.records()
    await lagging.close()


async def test_rebuild_while_a_subscriber_waits_gives_gap_unknown_epoch(fd: Feed) -> None:
    await fd.post(new_cid_claims(fd.signer, "w", 3))
    old = fd.cursor(fd.head)
    reader = fd.reader()
    await fd.node.cache.build(fd.node.truth)
    fd.node.applier.wake()
    replica = Replica(old)
    first = await reader.next()
    # the subscriber may notice the rebuilt cache before the applier publishes it
    rebuilt = cache.read_state(fd.node.cache.conn).epoch
    assert first == gap_frame(old, "unknown_epoch", sse.event_id(rebuilt, 0))
    replica.apply(first)
    await reader.until(lambda r: bool(r.synced), replica)
    assert replica.synced == [sse.event_id(rebuilt, 0)]
    assert replica.epoch == rebuilt and old.split("-")[0] != str(rebuilt)
    assert replica.state == fd.records() and len(replica.state) == 6
    await reader.close()


# -- the shared reader (feed.Hub) -----------------------------------------------------------


def table_frames(fd: Feed, after: int, upto: int) -> bytes:
    """The frames of the feed rows in (after, upto], straight from the table."""
    rows = fd.node.cache.conn.execute(
        "SELECT seq, rid, op, key, value FROM feed WHERE seq > ? AND seq <= ? ORDER BY seq",
        (after, upto),
    ).fetchall()
    assert [row[0] for row in rows] == list(range(after + 1, upto + 1)), "not dense"
    return b"".join(sse.change(fd.epoch, *row) for row in rows)


@pytest.mark.parametrize("seed", range(4))
async def test_hub_answers_agree_with_the_table_whatever_the_order(fd: Feed, seed: int) -> None:
    """Positions asked in a random order, through pruning and a memory bound small enough to
    evict pages: every answer is exactly the table's rows after the position up to the end of
    its page, `too_old` exactly when the next event was pruned, None exactly at the head."""
    await fd.post(new_cid_claims(fd.signer, "hub", 1_300))  # 2,600 events: pages 0-5
    hub = feed.Hub(fd.node.cache, lambda: fd.node.applier.state, cache_bytes=60_000)
    rng = random.Random(seed)
    positions = list(range(fd.head + 1))
    for phase in ("whole", "pruned", "grown"):
        if phase == "pruned":
            await fd.node.cache.writer.run(cache.prune_feed_txn, 1_234, 0)
        if phase == "grown":
            await fd.post(new_cid_claims(fd.signer, "hub", 60, start=1_300))
            positions = list(range(fd.head + 1))
        oldest = fd.node.cache.conn.execute("SELECT min(seq) FROM feed").fetchone()[0]
        for position in [*rng.sample(positions, 300), fd.head, fd.head - 1, oldest - 1]:
            got = hub.after(fd.epoch, position)
            if position >= fd.head:
                assert got is None, (phase, position)
            elif position + 1 < oldest:
                assert got == "too_old", (phase, position, oldest)
            else:
                assert isinstance(got, feed.Slice), (phase, position, got)
                end = min(fd.head, (position // feed.PAGE + 1) * feed.PAGE)
                assert got.last == end
                assert got.frames(sse.Filter()) == table_frames(fd, position, end)
        assert hub.after(fd.epoch - 1, 0) == "unknown_epoch"


def test_a_page_counts_what_it_holds() -> None:
    """The hub's memory bound is of what its pages hold: rows, frames and joined chunks. Counted
    over the frames alone, the pages kept held about five times the bound (measured: 20 pages of
    short titles, 5.0 MB traced against 0.96 MB counted)."""
    tracemalloc.start()
    try:
        rows = [
            cache.FeedRow(n, f"01J{n:023d}", "set", "title", f"title {n}", NOW_MS)
            for n in range(1, feed.PAGE + 1)
        ]
        page = feed.Page(0, 1, 1, rows)
        page.frames(feed.change_frame)
        page.joined(feed.change_frame, 0, feed.PAGE)
        page.joined(feed.change_frame, 10, feed.PAGE)  # another subscriber's: replaces the first
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.8 * held <= page.size <= 1.5 * held, (page.size, held)


async def test_hub_frames_filtered_slices_from_the_same_rows(fd: Feed) -> None:
    await fd.post(new_cid_claims(fd.signer, "flt", 30))  # cids/… and title per record
    got = fd.node.feed_hub.after(fd.epoch, 10)
    assert isinstance(got, feed.Slice) and got.last == 60
    only_titles = FrameParser().feed(got.frames(sse.Filter.of([], ["title"])))
    assert [f.seq for f in only_titles] == list(range(12, 61, 2))
    assert {f.data["key"] for f in only_titles} == {"title"}
    assert got.frames(sse.Filter.of([], ["nothing/"])) == b""


async def test_many_subscribers_share_one_read_per_page(fd: Feed) -> None:
    """40 subscribers at the head: one batch of new events costs one feed read, not 40."""
    await fd.post(new_cid_claims(fd.signer, "share", 5))
    readers = [fd.reader() for _ in range(40)]
    replicas = [Replica(fd.cursor(fd.head)) for _ in readers]
    waiting = [asyncio.create_task(r.next()) for r in readers]
    for _ in range(1_000):  # each task runs its stream up to its wait for the feed in one step
        if fd.node.subscribers == len(readers):
            break
        await asyncio.sleep(0.01)
    assert fd.node.subscribers == len(readers), "not every subscriber is waiting"
    statements: list[str] = []
    fd.node.cache.conn.set_trace_callback(statements.append)
    try:
        await fd.post(new_cid_claims(fd.signer, "share", 100, start=5))  # 200 events
        for reader, replica, first in zip(readers, replicas, waiting, strict=True):
            replica.apply(await first)
            await reader.until(reached(fd.head), replica)
    finally:
        fd.node.cache.conn.set_trace_callback(None)
    assert all(r.seqs == list(range(11, fd.head + 1)) for r in replicas)
    feed_reads = [s for s in statements if "FROM feed WHERE seq >" in s]
    assert 1 <= len(feed_reads) <= 2, feed_reads  # 2 if the applier published twice
    for reader in readers:
        await reader.close()


def open_cache_files() -> int:
    """Descriptors this process has open on a cache.db file."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(name.endswith("cache.db") for name in names)


async def test_a_snapshot_closed_while_a_page_is_being_fetched(fd: Feed) -> None:
    """A client that leaves mid-snapshot cancels the stream while a page may be being fetched
    on a worker thread: the cancelled fetch must end before the stream's cleanup closes the
    connection (closing it under the fetch raised, and left the file open); the file is freed."""
    await fd.post(new_cid_claims(fd.signer, "snap", 2_000))  # 4,000 record rows
    before = open_cache_files()
    for _ in range(40):
        snapshot = await feed.Snapshot.open(fd.node.cache, sse.Filter())
        fetching = asyncio.create_task(snapshot.page())
        await asyncio.sleep(0)  # the fetch is handed to the worker thread
        fetching.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # as the stream's `finally` runs
            await fetching
        await snapshot.close()
    assert open_cache_files() <= before + 1  # SQLite may keep one closed descriptor for reuse


def checkpoint_held_back(node: Node) -> bool:
    """Whether a read transaction on cache.db holds back a full checkpoint of its WAL (asked on a
    connection of the test's own, which does not wait for readers)."""
    conn = sqlite3.connect(node.cache.path, timeout=0)
    try:
        busy: int = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        return busy == 1
    finally:
        conn.close()


async def test_a_snapshot_left_mid_page_releases_its_read_transaction(fd: Feed) -> None:
    """A client that leaves while a page is being fetched: once the stream's `close()` returns,
    the snapshot's read transaction is over (the WAL written since can be checkpointed whole),
    not at some later garbage collection."""
    await fd.post(new_cid_claims(fd.signer, "held", 2_000))  # 4,000 record rows
    snapshot = await feed.Snapshot.open(fd.node.cache, sse.Filter())
    await fd.post(new_cid_claims(fd.signer, "later", 10))  # WAL frames past the snapshot
    assert await fd.node.applier.wait_for(fd.node.truth.max_seq(), 30)
    await fd.node.cache.drained()  # no write of the cache's own is under way
    assert checkpoint_held_back(fd.node)
    fetching = asyncio.create_task(snapshot.page())
    await asyncio.sleep(0)  # the fetch is queued on the connection's thread
    fetching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await fetching
    await snapshot.close()
    assert not checkpoint_held_back(fd.node)


async def test_a_cancelled_page_fetch_leaves_the_reading_usable(fd: Feed) -> None:
    """The fetch a cancelled caller abandoned still runs to its end before the next call on the
    same connection: the next page is the one after it, in order, and nothing fails."""
    await fd.post(new_cid_claims(fd.signer, "page", 1_000))  # 2,000 record rows
    every = sorted(fd.records().items())
    reading = await fd.node.cache.records_reading((), 500)
    try:
        fetching = asyncio.create_task(reading.rows())
        await asyncio.sleep(0)  # the fetch is queued on the connection's thread
        fetching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fetching
        rest = []
        while rows := await reading.rows():
            rest.extend(((rid, key), value) for rid, key, value in rows)
    finally:
        await reading.close()
    assert rest == every[500:]


async def test_a_reading_that_cannot_open_is_a_typed_storage_error(tmp_path: Path) -> None:
    """The aiosqlite reads map storage failures to `StorageError` like every other store read:
    a cache.db that is not there (read-only open: SQLITE_CANTOPEN)."""
    threads = set(threading.enumerate())
    with pytest.raises(StorageError) as raised:
        await cache.Reading.open(tmp_path / "cache.db", cache.records_in_order(), 10)
    assert raised.value.retryable and "cache.db" in raised.value.message
    # aiosqlite stops a connection that failed to open on its thread, a moment later, and then
    # calls back into the event loop: a server's loop is still there; this test's must wait
    deadline = time.monotonic() + 30
    while set(threading.enumerate()) - threads:
        assert time.monotonic() < deadline, "aiosqlite's thread never stopped"
        await asyncio.sleep(0.01)
