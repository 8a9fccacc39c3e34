"""A full state after a `gap` is safe to be cut off in, on every stream (docs/compat.md, SPEC §5).

The two kinds of SSE client met in the wild: MetaMesh's own client, which adopts the gap's
`resumeFrom` as its cursor as soon as it sees the gap, and an EventSource-like one, which keeps the
last `id:` it saw. Each reads a stream that starts with a gap (a cursor of another epoch, a pruned
one, one from the future), is cut off after k events, anywhere in the full state, while the node
changes, then reconnects with its own cursor and reads until it is caught up: what it holds must
be the node's state, with nothing lost, on `/api/events` and both MetaMesh streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metanode import cache, compat, merge, sse
from metanode import cid as cids
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.feed import Frame, FrameParser
from tests.helpers.settings import settings_for

WAIT_S = 60.0
N = 30  # records, and local files
STREAMS = ("events", "meta", "files")


def midhash(tag: str, i: int) -> str:
    return cids.midhash_bytes(f"resume {tag} {i}".encode())


@dataclass
class Box:
    """The node, and what the test changes on it: titles by one signer, local files by path."""

    node: Node
    signer: Signer = field(default_factory=Signer)
    ts: int = NOW_MS
    # Left out of the repr: hypothesis writes the repr of every example's arguments, and these
    # files pile up across the examples (the same node serves them all); past 30 kB of repr it
    # warns, which this suite turns into a failure.
    files: dict[str, merge.LocalFile] = field(default_factory=dict, repr=False)
    made: int = 0  # files made so far (each new one gets new content)

    async def title(self, i: int, value: str | None) -> None:
        """Sets (or, with None, retracts) the title of the i-th CID (maybe a new record)."""
        self.ts += 1
        answer = await self.node.ingest_wire(
            [self.signer.claim(midhash("rec", i), "title", value, self.ts)]
        )
        assert answer.status == 200, answer

    async def new_file(self) -> None:
        self.made += 1
        content = midhash("file", self.made)
        await self.node.ensure_groups([content])
        await self.local([merge.LocalFile(f"/elsewhere/f{self.made:03}", content, self.made, 1)])

    async def local(self, written: list[merge.LocalFile], removed: tuple[str, ...] = ()) -> None:
        await self.node.apply_local(written, list(removed))
        for path in removed:
            del self.files[path]
        self.files.update((f.path, f) for f in written)

    async def change(self, op: str, pick: int) -> None:
        """One change to the node: `title`/`retract` on a record, `add`/`delete`/`rename`/
        `change` of a local file (`pick` chooses which)."""
        paths = sorted(self.files)
        path = paths[pick % len(paths)]
        old = self.files[path]
        if op == "title":
            await self.title(pick % (N + 5), f"changed {self.ts}")
        elif op == "retract":
            await self.title(pick % N, None)
        elif op == "add":
            await self.new_file()
        elif op == "delete" and len(paths) > 1:
            await self.local([], (path,))
        elif op == "rename":
            moved = merge.LocalFile(path + "-moved", old.midhash, old.size, 1)
            await self.local([moved], (path,))
        else:
            await self.local([merge.LocalFile(path, old.midhash, old.size + 1, old.mtime_ns + 1)])


@pytest.fixture
async def box(tmp_path: Path) -> AsyncIterator[Box]:
    """A node with N records and N local files, whose tables keep only their newest 4 events
    (so `<epoch>-1` is a pruned cursor on both)."""
    node = Node(settings_for(tmp_path / "data"))
    await node.start()
    try:
        await node.applier.wait_for(0, WAIT_S)
        made = Box(node)
        await node.add_signer(made.signer.uid, "test", 1, False)
        for i in range(N):
            await made.title(i, f"title {i}")
            await made.new_file()
        await node.cache.writer.run(cache.prune_feed_txn, 4, 0)
        yield made
    finally:
        await node.stop()


def open_stream(node: Node, stream: str, cursor: str) -> AsyncGenerator[bytes, None]:
    if stream == "events":
        subscribed = node.subscribe(cursor, False, sse.Filter())
        assert isinstance(subscribed, AsyncGenerator)
        return subscribed
    kind: type[compat._Follow[Any]] = compat.MetaFollow if stream == "meta" else compat.FilesFollow
    return kind(node, sse.parse_cursor(cursor)).stream()


def head(node: Node, stream: str) -> str:
    """The id of the newest event of the stream's table: a client holding it is caught up."""
    state = node.applier.state
    return sse.event_id(state.epoch, state.file_feed_seq if stream == "files" else state.feed_seq)


def server_state(node: Node, stream: str) -> dict[Any, Any]:
    """What a client of the stream should hold: (rid, key) → value for `/api/events`; the keys
    (no value travels: MetaMesh clients GET it) for the meta stream; path → (midhash, size)."""
    conn = node.cache.conn
    if stream == "events":
        return {(r, k): v for r, k, v in conn.execute("SELECT rid, key, value FROM records")}
    if stream == "meta":
        return {f"file:{r}/{k}": None for r, k in conn.execute("SELECT rid, key FROM records")}
    roots = compat.Roots.of(node.named_roots())
    return {
        roots.relative(p): (m, str(z))
        for p, m, z in conn.execute("SELECT path, midhash, size FROM local_file")
    }


@dataclass
class Client:
    """A consumer of one stream: it keeps a cursor by its kind's rule and applies every event.

    On a `gap` it drops what it holds: the full state that follows replaces it.
    """

    adopts_resume_from: bool
    cursor: str
    state: dict[Any, Any] = field(default_factory=dict)

    def apply(self, frame: Frame) -> None:
        if frame.id is not None:
            self.cursor = frame.id  # what EventSource does (and MetaMesh's client for events)
        data = frame.data
        if frame.event == "gap":
            if self.adopts_resume_from:
                self.cursor = data["resumeFrom"]
            self.state.clear()
        elif frame.event == "reset":
            self.state.clear()
        elif frame.event in ("set", "del") and "rid" in data:  # /api/events
            if frame.event == "set":
                self.state[data["rid"], data["key"]] = data["value"]
            else:
                self.state.pop((data["rid"], data["key"]), None)
        elif frame.event == "set":  # the meta stream
            self.state[data["key"]] = None
        elif frame.event == "del":
            self.state.pop(data["key"], None)
        elif frame.event in ("add", "change", "rename", "delete"):
            if frame.event in ("rename", "delete"):
                self.state.pop(data["oldPath" if frame.event == "rename" else "path"], None)
            if frame.event != "delete":
                self.state[data["path"]] = (data["midhash256"], data["size"])
        else:
            assert frame.event == "synced", frame

    async def read(self, node: Node, stream: str, limit: int | None) -> int:
        """Connect with the cursor; apply events until caught up, or until `limit` of them
        (then cut the connection: the rest of the chunk is lost in transit). How many it
        applied."""
        applied = 0
        source = open_stream(node, stream, self.cursor)
        parser = FrameParser()
        try:
            while (limit is None or applied < limit) and self.cursor != head(node, stream):
                chunk = await asyncio.wait_for(anext(source), WAIT_S)
                for frame in parser.feed(chunk):
                    if frame.event is None or (limit is not None and applied >= limit):
                        continue  # a keep-alive; or past the cut
                    self.apply(frame)
                    applied += 1
        finally:
            await source.aclose()
        return applied


CHANGES = st.lists(
    st.tuples(
        st.sampled_from(["title", "retract", "add", "delete", "rename", "change"]),
        st.integers(0, 10_000),
    ),
    max_size=3,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # the node keeps changing across examples; each compares with the node as it is then
@given(
    stream=st.sampled_from(STREAMS),
    gap=st.sampled_from(["unknown_epoch", "future", "too_old"]),
    adopts=st.booleans(),
    cut=st.integers(0, 2 * N + 4) | st.sampled_from([0, 1, 2]),
    changes=CHANGES,
    later=CHANGES,
)
async def test_a_client_cut_off_anywhere_in_a_full_state_resumes_with_nothing_lost(
    box: Box,
    stream: str,
    gap: str,
    adopts: bool,
    cut: int,
    changes: list[tuple[str, int]],
    later: list[tuple[str, int]],
) -> None:
    node = box.node
    epoch, seq = head(node, stream).split("-")
    # far enough ahead that the changes below never bring the head up to it: with a cut of 0
    # the client first connects after them, and a head that had reached a nearer "future"
    # cursor would take it for caught up
    future = f"{epoch}-{int(seq) + 10**6}"
    cursor = {"unknown_epoch": "0-0", "future": future, "too_old": f"{epoch}-1"}
    client = Client(adopts, cursor[gap])
    await client.read(node, stream, cut)  # the gap, and the first cut - 1 events of the state
    for op, pick in changes:  # while it is away
        await box.change(op, pick)
    await client.read(node, stream, None)  # back with its cursor, until caught up
    assert client.state == server_state(node, stream)
    for op, pick in later:  # and it follows what comes next
        await box.change(op, pick)
    await client.read(node, stream, None)
    assert client.state == server_state(node, stream)


async def test_the_first_connection_really_gaps_and_the_cut_lands_inside_the_state(
    box: Box,
) -> None:
    """The property's setting does what it says: each kind of cursor gets a gap, and a client
    cut off a few events into the state holds a cursor inside it, which resumes the rest."""
    node = box.node
    epoch = node.applier.state.epoch
    for stream in STREAMS:
        for cursor in ("0-0", f"{epoch}-1", f"{epoch}-{10**6}"):
            for adopts in (False, True):
                client = Client(adopts, cursor)
                assert await client.read(node, stream, 4) == 4
                assert client.cursor.endswith(".3"), client.cursor  # 3 state events received
                resumed = Client(adopts, client.cursor, dict(client.state))
                first = await resumed.read(node, stream, 1)
                assert first == 1 and resumed.cursor.endswith(".4"), resumed.cursor
                await resumed.read(node, stream, None)
                assert resumed.state == server_state(node, stream)
