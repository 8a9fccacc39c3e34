"""The change feed over HTTP against a real `metanode serve` (uvicorn) process (SPEC §5).

The in-process ASGI transport buffers a streamed body until it ends, so every stream here is a
raw TCP socket speaking HTTP/1.1 to a server subprocess: the chunked body is de-framed and parsed
by `FrameParser`, and `Replica` checks the ordering rules frame by frame (tests/helpers/feed.py).
Nothing here asserts how long anything took; every wait is bounded and says what it waited for.

Servers are killed (not stopped) at the end of a test: the streams still open then never make
the node handle a disconnect after the test's checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from metanode import db, sse
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.feed import (
    WAIT_S,
    Frame,
    FrameParser,
    Replica,
    Stream,
    assert_agrees,
    cid_n,
    close_open_streams,
    gap_frame,
    new_cid_claims,
    reached,
)
from tests.helpers.server import Server
from tests.helpers.settings import reading

pytestmark = pytest.mark.both_backends

STALL_S = 10.0  # the bound on a wait where events flow all the time: a silence this long is a wedge


# -- plumbing ---------------------------------------------------------------------------------


def http(server: Server, timeout: float = WAIT_S) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=server.headers, timeout=timeout)


def post(client: httpx.Client, batch: list[dict[str, Any]]) -> None:
    response = client.post("/api/claims", json={"claims": batch})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["accepted"] == len(batch) and body["applied"] is True, body


def post_all(server: Server, batch: list[dict[str, Any]], size: int = 1_000) -> None:
    with http(server) as client:
        for i in range(0, len(batch), size):
            post(client, batch[i : i + size])


def epoch(server: Server) -> int:
    health = httpx.get(f"{server.url}/health", timeout=WAIT_S).json()
    assert health["cache_ready"], health
    return int(health["epoch"])


def head(server: Server) -> str:
    """The id of the newest event, from the cache's state (a stream would mean a hang-up)."""
    with open_cache(server) as conn:
        state = dict(conn.execute("SELECT name, value FROM state").fetchall())
    return cursor(state["epoch"], state["feed_seq"])


def cursor(ep: int, seq: int) -> str:
    return sse.event_id(ep, seq)


@contextlib.contextmanager
def open_cache(server: Server) -> Iterator[db.Connection]:
    with reading(server.data_dir, "cache", server.storage) as conn:
        yield conn


def records(
    server: Server, where: Callable[[str, str], bool] | None = None
) -> dict[tuple[str, str], str]:
    with open_cache(server) as conn:
        rows = conn.execute("SELECT rid, key, value FROM records").fetchall()
    return {(r, k): v for r, k, v in rows if where is None or where(r, k)}


def cache_value(server: Server, sql: str) -> Any:
    with open_cache(server) as conn:
        return conn.execute(sql).fetchone()[0]


def wait_until(what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.05)


Launch = Callable[..., Server]


@pytest.fixture
def launch(tmp_path: Path, storage: str) -> Iterator[Launch]:
    """Start servers on `tmp_path/data` (env as given), the stores on `storage`; any still
    running at the end are killed."""
    started: list[Server] = []

    def start(env: dict[str, str] | None = None) -> Server:
        srv = Server(tmp_path / "data", env={"METANODE_STORAGE": storage, **(env or {})})
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:  # killed before the streams close: no disconnect to handle
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(timeout=WAIT_S)
    close_open_streams()


@pytest.fixture
def server(launch: Launch) -> Server:
    """A running server on a fresh data directory (default settings)."""
    return launch()


@pytest.fixture(scope="module")
def bulk() -> tuple[Signer, list[dict[str, Any]]]:
    """25,000 claims on new CIDs (50,000 events), signed once for every test that needs them."""
    signer = Signer()
    return signer, new_cid_claims(signer, "bulk", 25_000)


# -- live delivery, framing on the wire, headers ----------------------------------------------


def test_live_delivery_headers_and_exact_bytes(server: Server) -> None:
    signer = Signer()
    server.register(signer.uid, "feed")
    post_all(server, new_cid_claims(signer, "before", 2))  # events 1–4: not for a live stream
    ep = epoch(server)
    stream = Stream(server)
    assert stream.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert stream.headers["cache-control"] == "no-cache"
    assert stream.headers["x-accel-buffering"] == "no"
    assert "content-length" not in stream.headers
    value = 'Amélie "line one\nline two" ☃\u2028🎬'
    post_all(server, fast_claims(signer, [(cid_n("before", 0), "title", value, NOW_MS + 1)]))
    rid = records_rid(server, cid_n("before", 0))
    expected = (
        "id: "
        + cursor(ep, 5)
        + '\nevent: set\ndata: {"rid":"'
        + rid
        + '","key":"title","value":'
        # readable UTF-8, but U+2028 escaped: `str.splitlines` readers end a line there
        + json.dumps(value, ensure_ascii=False).replace("\u2028", "\\u2028")
        + "}\n\n"
    )
    got = b""
    while len(got) < len(expected.encode()):
        got += stream.body()
    assert got == expected.encode()
    post_all(server, new_cid_claims(signer, "after", 1))
    frames = stream.take(2)
    assert [(f.id, f.event, f.data["key"]) for f in frames] == [
        (cursor(ep, 6), "set", f"cids/{cid_n('after', 0)}"),
        (cursor(ep, 7), "set", "title"),
    ]
    stream.close()


def records_rid(server: Server, cid: str) -> str:
    with open_cache(server) as conn:
        row = conn.execute("SELECT rid FROM cid_index WHERE cid = ?", (cid,)).fetchone()
    assert row is not None, f"{cid} is in no record"
    return str(row[0])


# -- resume ---------------------------------------------------------------------------------


def test_resume_after_random_disconnects_loses_and_repeats_nothing(server: Server) -> None:
    """10,000 events ingested while a client drops the connection at random byte offsets and
    resumes with `Last-Event-ID` = the last id it received."""
    signer = Signer()
    server.register(signer.uid, "feed")
    n = 2_500
    phases = [
        new_cid_claims(signer, "r", n),  # 5,000 events
        fast_claims(
            signer, [(cid_n("r", i), "year", str(1900 + i % 100), NOW_MS) for i in range(n)]
        ),  # 2,500
        fast_claims(
            signer, [(cid_n("r", i), "title", f"retitled {i}", NOW_MS + 1) for i in range(n)]
        ),
    ]  # 2,500
    total = 2 * n + n + n
    failures: list[BaseException] = []

    def ingest() -> None:
        try:
            with http(server, STALL_S) as client:
                for batch in phases:
                    for i in range(0, len(batch), 250):
                        post(client, batch[i : i + 250])
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    ep = epoch(server)
    replica = Replica(cursor(ep, 0), gaps_allowed=False)
    rng = random.Random(4)
    producer = threading.Thread(target=ingest)
    producer.start()
    connections = 0
    try:
        while replica.position < total:
            assert not failures, failures
            connections += 1
            assert connections < 10_000, "no progress"
            stream = Stream(server, last_event_id=replica.last_id, timeout=STALL_S)
            budget = rng.choice([0, 1, 17, 200, 5_000, 20_000, 60_000, 200_000])
            parser = FrameParser()  # this connection's frames; a cut frame is dropped
            try:
                while budget > 0 and replica.position < total:
                    data = stream.body()[:budget]
                    budget -= len(data)
                    replica.apply_all(parser.feed(data))
            finally:
                stream.close()
    finally:
        producer.join(timeout=STALL_S * 4)
    assert not failures, failures
    assert connections > 10, f"only {connections} connections: the test cut too little"
    assert replica.seqs == list(range(1, total + 1))  # dense, in order, no duplicate
    assert head(server) == cursor(ep, total)
    assert replica.state == records(server)


def test_disconnects_while_events_flow_disturb_neither_ingest_nor_other_subscribers(
    server: Server,
) -> None:
    """Regression: on HEAD 8a77073, Applier.wait_feed's `async with cond` around
    `asyncio.wait_for(cond.wait_for(...))` let a cancelled subscriber release the condition's
    lock while another task held it (Python 3.11 runs the inner wait as its own task, and
    anyio cancels a disconnected stream repeatedly): other streams died with 'cannot wait on
    un-acquired lock', or the lock stayed held and ingest, every stream and SIGTERM hung."""
    signer = Signer()
    server.register(signer.uid, "feed")
    ep = epoch(server)
    stayers = [Stream(server, last_event_id=cursor(ep, 0), timeout=STALL_S) for _ in range(5)]
    posted: list[int] = []
    failures: list[BaseException] = []
    done = threading.Event()

    def ingest() -> None:
        try:
            with http(server, STALL_S) as client:
                while not done.is_set() or len(posted) < 5:
                    post(client, new_cid_claims(signer, "churn", 5, start=5 * len(posted)))
                    posted.append(5)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    producer = threading.Thread(target=ingest)
    producer.start()
    try:
        for _ in range(30):  # 600 subscribers come and go while claims are ingested
            churn = [Stream(server, timeout=STALL_S) for _ in range(20)]
            time.sleep(0.02)
            for stream in churn:
                stream.close()
    finally:
        done.set()
        producer.join(timeout=STALL_S * 3)
    assert not failures, f"ingest failed while subscribers came and went: {failures!r}"
    total = 2 * sum(posted)
    for stream in stayers:
        replica = stream.until(lambda r: r.position >= total, Replica(cursor(ep, 0)))
        assert replica.state == records(server)
        stream.close()


# -- gap + snapshot -------------------------------------------------------------------------


def test_unusable_cursors_get_gap_then_snapshot_then_live(server: Server) -> None:
    signer = Signer()
    server.register(signer.uid, "feed")
    post_all(server, new_cid_claims(signer, "g", 4))  # events 1–8
    ep = epoch(server)
    cases = [
        ("0-0", "unknown_epoch", "header"),
        ("1-1", "unknown_epoch", "since"),
        (cursor(ep + 1, 8), "unknown_epoch", "header"),
        (cursor(ep, 8 + 1_000), "future", "since"),
        (cursor(ep, 9), "future", "header"),
    ]
    streams = []
    for text, reason, how in cases:
        stream = (
            Stream(server, last_event_id=text)
            if how == "header"
            else Stream(server, [("since", text)])
        )
        assert stream.next() == gap_frame(text, reason, cursor(ep, 8))
        replica = Replica()
        replica.apply(gap_frame(text, reason, cursor(ep, 8)))
        stream.until(lambda r: bool(r.synced), replica)
        assert replica.synced == [cursor(ep, 8)]
        assert replica.state == records(server) and len(replica.state) == 8
        streams.append((stream, replica))
    # the header wins over ?since=; a usable cursor replays; ?snapshot=1 alone snapshots
    both = Stream(server, [("since", cursor(ep, 2))], last_event_id="0-0")
    assert both.next().event == "gap"
    both.close()
    replay = Stream(server, [("snapshot", "1")], last_event_id=cursor(ep, 5))
    replayed = replay.until(lambda r: bool(r.synced), Replica(cursor(ep, 5), gaps_allowed=False))
    assert replayed.seqs == [6, 7, 8] and replayed.synced == [cursor(ep, 8)]
    streams.append((replay, replayed))
    fresh = Stream(server, [("snapshot", "1")])
    snapped = fresh.until(lambda r: bool(r.synced), Replica(gaps_allowed=False))
    assert snapped.snapshot_sizes == [8] and snapped.state == records(server)
    streams.append((fresh, snapped))
    post_all(server, fast_claims(signer, [(cid_n("g", 0), "title", None, NOW_MS + 1)]))
    for stream, replica in streams:
        stream.until(lambda r: r.position == 9, replica)
    for _, replica in streams:
        assert replica.history[-1] == Frame(
            "del", cursor(ep, 9), {"rid": records_rid(server, cid_n("g", 0)), "key": "title"}
        )
        if replica.snapshot_sizes:
            assert replica.state == records(server)
        assert_agrees(replica, records(server))


# -- merges and filters ---------------------------------------------------------------------


def test_merge_arrives_as_del_for_the_loser_and_set_for_the_survivor(server: Server) -> None:
    linker = Signer()
    server.register(linker.uid, "feed", may_link=True)
    a, b = cid_n("merge", 1), cid_n("merge", 2)
    post_all(server, fast_claims(linker, [(a, "title", "old group", NOW_MS)]))
    post_all(
        server,
        fast_claims(linker, [(b, "title", "new group", NOW_MS + 1), (b, "genre", "sf", NOW_MS)]),
    )
    older, newer = records_rid(server, a), records_rid(server, b)
    assert older < newer
    ep = epoch(server)
    mark = int(head(server).rsplit("-", 1)[1])
    live = Stream(server)
    only_loser = Stream(server, [("rid", newer.lower())])
    post_all(server, fast_claims(linker, [(b, f"cids/{a}", "true", NOW_MS)]))
    last = int(head(server).rsplit("-", 1)[1])
    replica = live.until(lambda r: r.position == last, Replica(cursor(ep, mark)))
    events = [(f.event, f.data["rid"], f.data["key"], f.data.get("value")) for f in replica.history]
    dels = [e for e in events if e[0] == "del"]
    assert events[: len(dels)] == dels, "every del comes before the survivor's sets"
    assert sorted(dels) == sorted(("del", newer, k, None) for k in ("title", "genre", f"cids/{b}"))
    assert sorted(events[len(dels) :]) == sorted(
        [
            ("set", older, f"cids/{b}", "true"),
            ("set", older, "genre", "sf"),
            ("set", older, "title", "new group"),
        ]
    )
    assert_agrees(replica, records(server))
    assert not any(rid == newer for rid, _ in records(server))
    loser = only_loser.until(
        lambda r: len(r.seqs) == len(dels), Replica(cursor(ep, mark), dense=False)
    )
    assert [f.event for f in loser.history] == ["del"] * len(dels)
    # a consumer re-resolves by CID: both CIDs now name the survivor
    assert records_rid(server, a) == records_rid(server, b) == older
    live.close()
    only_loser.close()


def test_filters_on_replay_snapshot_and_live(server: Server) -> None:
    signer = Signer()
    server.register(signer.uid, "feed")
    post_all(
        server,
        fast_claims(
            signer,
            [
                (cid_n("f", i), key, f"{key} {i}", NOW_MS)
                for i in range(3)
                for key in ("title", "year")
            ],
        ),
    )
    rid0, rid1 = records_rid(server, cid_n("f", 0)), records_rid(server, cid_n("f", 1))
    ep = epoch(server)
    cases: list[tuple[list[str], list[str], list[str]]] = [
        ([rid0.lower()], [], []),
        ([], ["ti"], []),
        ([rid0, rid1], ["year", "cids/"], []),
        ([], [], ["cids/"]),  # the web page's Live
        ([rid0, rid1], ["ti", "ye"], ["ti"]),  # `exclude` wins over `prefix`
    ]
    followers = []
    for rid_values, prefixes, excluded in cases:
        where = sse.Filter.of(rid_values, prefixes, excluded).matches
        params = [
            *(("rid", r) for r in rid_values),
            *(("prefix", p) for p in prefixes),
            *(("exclude", p) for p in excluded),
        ]
        replay = Stream(server, [*params, ("since", cursor(ep, 0))])
        replayed = replay.until(
            lambda r: bool(r.synced), Replica(cursor(ep, 0), dense=False, gaps_allowed=False)
        )
        assert replayed.state == records(server, where) and replayed.state
        snap = Stream(server, [*params, ("snapshot", "1")])
        snapped = snap.until(lambda r: bool(r.synced), Replica(dense=False, gaps_allowed=False))
        assert snapped.state == records(server, where)
        gap = Stream(server, params, last_event_id="0-0")  # snapshot after a gap is filtered too
        gapped = gap.until(lambda r: bool(r.synced), Replica(dense=False))
        assert gapped.gaps and gapped.state == records(server, where)
        live = Stream(server, params)
        followers += [
            (where, s, r)
            for s, r in (
                (replay, replayed),
                (snap, snapped),
                (gap, gapped),
                (live, Replica(dense=False)),
            )
        ]
    mark = int(head(server).rsplit("-", 1)[1])
    post_all(
        server,
        fast_claims(
            signer,
            [
                (cid_n("f", 0), "title", "new 0", NOW_MS + 1),
                (cid_n("f", 1), "year", None, NOW_MS + 1),
                (cid_n("f", 2), "title", "new 2", NOW_MS + 1),
                (cid_n("f", 1), "plot", "p", NOW_MS),
            ],
        ),
    )
    # last, one event every filter admits, so a reader knows it has seen everything before it
    post_all(
        server,
        fast_claims(
            signer,
            [
                (cid_n("f", 0), "title", "end", NOW_MS + 2),
                (cid_n("f", 1), "year", "end", NOW_MS + 2),
            ],
        ),
    )
    with open_cache(server) as conn:
        changed = conn.execute(
            "SELECT seq, rid, key FROM feed WHERE seq > ? ORDER BY seq", (mark,)
        ).fetchall()
    for where, stream, replica in followers:
        expected = [seq for seq, rid, key in changed if where(rid, key)]
        start = len(replica.seqs)
        stream.until(reached(expected[-1]), replica)
        assert replica.seqs[start:] == expected
        assert_agrees(replica, records(server, where))


# -- slow subscribers, many subscribers -----------------------------------------------------


@pytest.mark.parametrize("pruned", [True, False], ids=["retention-1000", "no-pruning"])
def test_a_stalled_subscriber_blocks_nothing_and_loses_nothing(
    launch: Launch, bulk: tuple[Signer, list[dict[str, Any]]], pruned: bool
) -> None:
    """A subscriber that stops reading (small receive buffer, no reads) while 50,000 events
    flow: ingest completes, a reading subscriber keeps up meanwhile (without pruning; with it,
    a reader in this busy test process may lag past 1,000 events itself), and when the stalled
    one reads again it gets every event in order, or (past retention) gap then snapshot."""
    env = (
        {"METANODE_FEED_RETENTION_EVENTS": "1000", "METANODE_FEED_PRUNE_S": "0.2"} if pruned else {}
    )
    server = launch(env)
    signer, batch = bulk
    server.register(signer.uid, "feed")
    total = 2 * len(batch)
    ep = epoch(server)
    stalled = Stream(server, last_event_id=cursor(ep, 0), rcvbuf=4096)
    assert stalled.next() == Frame("synced", cursor(ep, 0), {"id": cursor(ep, 0)})
    reader_replica = Replica(cursor(ep, 0), gaps_allowed=False)
    reader_errors: list[BaseException] = []

    def read_along() -> None:
        stream = Stream(server, last_event_id=cursor(ep, 0))
        try:
            stream.until(lambda r: r.position >= total, reader_replica)
        except BaseException as exc:  # reported by the main thread
            reader_errors.append(exc)
        finally:
            stream.close()

    reader = threading.Thread(target=read_along)
    if not pruned:
        reader.start()
    post_all(server, batch)  # every post must answer 200, all accepted and applied
    assert head(server) == cursor(ep, total)
    want = records(server)
    if not pruned:
        reader.join(timeout=120)
        assert not reader.is_alive(), "the reading subscriber did not reach the head"
        assert not reader_errors, reader_errors
        assert reader_replica.state == want
    if pruned:
        wait_until(
            "retention to prune the feed to 1,000 events",
            lambda: cache_value(server, "SELECT count(*) FROM feed") <= 1_000,
        )
    replica = Replica(cursor(ep, 0), gaps_allowed=pruned)
    stalled.until(lambda r: r.position >= total and not r.in_snapshot, replica)
    stalled.close()
    if pruned:
        # kernel buffers take a few MB before the server blocks, so the first gap may come
        # while ingest still runs, and the snapshot after it may be stale by the time it is
        # read: then a second gap and snapshot follow. Each gap names where the stream was.
        assert replica.gaps, "the gap path was not exercised"
        assert all(gap["reason"] == "too_old" for gap in replica.gaps)
        first_gap = int(replica.gaps[0]["requested"].rsplit("-", 1)[1])
        assert replica.seqs[:first_gap] == list(range(1, first_gap + 1))  # in order up to it
        assert first_gap < total - 1_000
        assert replica.snapshot_sizes[-1] == total
    else:
        assert replica.seqs == list(range(1, total + 1)) and not replica.gaps
    assert replica.state == want


def open_files(server: Server) -> list[str]:
    """What the server process has open (`socket:[…]`, paths), from /proc."""
    assert server.proc is not None
    where = f"/proc/{server.proc.pid}/fd"
    out = []
    for fd in os.listdir(where):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            out.append(os.readlink(f"{where}/{fd}"))
    return out


def sockets(server: Server) -> int:
    return sum(name.startswith("socket:") for name in open_files(server))


def settled(count: Callable[[], int]) -> int:
    """`count()` once it reads the same three times in a row (a client's closed keep-alive
    connection may still be open on the server's side for a moment)."""
    seen = [count()]
    deadline = time.monotonic() + WAIT_S
    while len(seen) < 3 or len(set(seen[-3:])) > 1:
        assert time.monotonic() < deadline, f"never settled: {seen[-10:]}"
        time.sleep(0.1)
        seen.append(count())
    return seen[-1]


def cache_files(server: Server) -> int:
    return sum("cache.db" in name for name in open_files(server))


def feed_subscribers(server: Server) -> float | None:
    """The `metanode_feed_subscribers` gauge of /metrics, if the node has it."""
    response = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=WAIT_S)
    for line in response.text.splitlines() if response.status_code == 200 else ():
        if line.startswith("metanode_feed_subscribers "):
            return float(line.split()[1])
    return None


def subscriber_wave(server: Server, signer: Signer, wave: int) -> None:
    """60 subscribers of five kinds (24 of them with a snapshot); 1,000 events flow while they
    are connected; half read to the end, the others hang up wherever they are."""
    ep = epoch(server)
    head_seq = int(head(server).rsplit("-", 1)[1])
    kinds: list[tuple[list[tuple[str, str]], str | None, Callable[[], Replica]]] = [
        ([], None, lambda: Replica(cursor(ep, head_seq))),  # live
        ([], cursor(ep, 0), lambda: Replica(cursor(ep, 0))),  # replay from the start
        ([("snapshot", "1")], None, lambda: Replica()),  # a snapshot of every record
        ([], "0-0", lambda: Replica()),  # gap + snapshot
        ([("prefix", "title")], cursor(ep, 1_000), lambda: Replica(cursor(ep, 1_000), dense=False)),
    ]
    idle_sockets = settled(lambda: sockets(server))
    streams = [
        (Stream(server, params, last_event_id=last), make())
        for _ in range(12)
        for params, last, make in kinds
    ]
    wait_until("60 subscribers to be connected", lambda: sockets(server) >= idle_sockets + 60)
    if feed_subscribers(server) is not None:
        wait_until("the gauge to count 60 subscribers", lambda: feed_subscribers(server) == 60)
    post_all(server, new_cid_claims(signer, f"wave{wave}", 500))  # 1,000 more events
    total = head_seq + 1_000
    want = records(server)
    title = sse.Filter.of([], ["title"]).matches
    for n, (stream, replica) in enumerate(streams):
        if n % 2:  # half are read to the end, one after the other
            stream.until(lambda r: r.position >= total and not r.in_snapshot, replica)
            assert_agrees(replica, want)
            if replica.snapshot_sizes or replica.seqs[:1] == [1]:  # it saw everything
                assert replica.state == want
            if not replica.dense:
                assert replica.state and all(title(*k) for k in replica.state)
        else:  # the others will hang up wherever they are: mid-replay, mid-snapshot, idle
            replica.apply_all(stream.take(n % 7))
    for stream, _ in streams:
        stream.close()
    wait_until(
        f"the server to close every subscriber's socket (open: {sockets(server)}, "
        f"before: {idle_sockets})",
        lambda: sockets(server) <= idle_sockets,
    )
    if feed_subscribers(server) is not None:
        wait_until("the gauge to count no subscriber", lambda: feed_subscribers(server) == 0)


def test_many_subscribers_and_disconnects_free_resources(server: Server) -> None:
    signer = Signer()
    server.register(signer.uid, "feed")
    post_all(server, new_cid_claims(signer, "many", 1_000))  # 2,000 events, 1,000 records
    idle_cache_files = cache_files(server)
    for wave in range(3):
        subscriber_wave(server, signer, wave)
    # SQLite's unix VFS keeps the descriptor of a closed connection open while other connections
    # of the process hold locks on the file (in WAL mode they always do) and reuses it for the
    # next open; so closed snapshots may leave up to one wave's worth (24) behind, but a leak
    # would leave one or three per snapshot: 72 or more after three waves.
    assert cache_files(server) <= idle_cache_files + 24 + 2, open_files(server)
    # and it still serves: a new subscriber gets a new event
    at = head(server)
    again = Stream(server, last_event_id=at)
    assert again.next().event == "synced"
    post_all(server, new_cid_claims(signer, "many", 1, start=1_500))
    ep, seq = at.rsplit("-", 1)
    assert again.next().id == cursor(int(ep), int(seq) + 1)
    again.close()


# -- retention, restarts and rebuilds -------------------------------------------------------


def first_frame(server: Server, last_event_id: str) -> Frame:
    stream = Stream(server, last_event_id=last_event_id)
    try:
        return stream.next()
    finally:
        stream.close()


def test_retention_survives_restarts_and_seqs_are_never_reused(launch: Launch) -> None:
    server = launch({"METANODE_FEED_RETENTION_EVENTS": "1000", "METANODE_FEED_PRUNE_S": "0.2"})
    signer = Signer()
    server.register(signer.uid, "feed")
    post_all(server, new_cid_claims(signer, "keep", 1_500))  # events 1–3,000
    ep = epoch(server)
    wait_until(
        "retention to keep the newest 1,000 events",
        lambda: cache_value(server, "SELECT min(seq) FROM feed") == 2_001,
    )
    too_old = gap_frame(cursor(ep, 1_999), "too_old", cursor(ep, 3_000))
    assert first_frame(server, cursor(ep, 1_999)) == too_old
    server.stop(grace=10.0)

    server = launch()  # default retention (100,000): what was pruned stays pruned
    assert epoch(server) == ep
    assert first_frame(server, cursor(ep, 1_999)) == too_old
    stream = Stream(server, last_event_id=cursor(ep, 2_000))
    replica = stream.until(lambda r: bool(r.synced), Replica(cursor(ep, 2_000), gaps_allowed=False))
    assert replica.seqs == list(range(2_001, 3_001)) and replica.synced == [cursor(ep, 3_000)]
    post_all(server, new_cid_claims(signer, "keep", 1, start=1_500))
    stream.until(lambda r: r.position == 3_002, replica)
    assert replica.seqs[-2:] == [3_001, 3_002]  # the counter went on from the old head
    stream.close()
    server.stop(grace=10.0)

    # retention by age (about 0.9 s here): the feed empties, the counter still goes on
    server = launch({"METANODE_FEED_RETENTION_DAYS": "0.00001", "METANODE_FEED_PRUNE_S": "0.2"})
    wait_until(
        "retention by age to empty the feed",
        lambda: cache_value(server, "SELECT count(*) FROM feed") == 0,
    )
    assert first_frame(server, cursor(ep, 3_001)) == gap_frame(
        cursor(ep, 3_001), "too_old", cursor(ep, 3_002)
    )
    at_head = Stream(server, last_event_id=cursor(ep, 3_002))
    assert at_head.next() == Frame("synced", cursor(ep, 3_002), {"id": cursor(ep, 3_002)})
    post_all(server, new_cid_claims(signer, "keep", 1, start=1_501))
    assert [f.id for f in at_head.take(2)] == [cursor(ep, 3_003), cursor(ep, 3_004)]
    at_head.close()


def test_rebuild_cache_starts_a_new_epoch(launch: Launch) -> None:
    server = launch()
    signer = Signer()
    server.register(signer.uid, "feed")
    post_all(server, new_cid_claims(signer, "rebuild", 5))  # events 1–10
    old_epoch = epoch(server)
    old = cursor(old_epoch, 10)
    before = records(server)
    server.stop(grace=10.0)
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "rebuild-cache", "--data-dir", str(server.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "METANODE_STORAGE": server.storage},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    server = launch()
    new_epoch = epoch(server)
    assert new_epoch > old_epoch
    stream = Stream(server, last_event_id=old)
    gap = stream.next()
    assert gap == gap_frame(old, "unknown_epoch", cursor(new_epoch, 0))
    replica = Replica()
    replica.apply(gap)
    stream.until(lambda r: bool(r.synced), replica)
    assert replica.synced == [cursor(new_epoch, 0)] and replica.state == before
    assert first_frame(server, cursor(new_epoch, 0)) == Frame(
        "synced", cursor(new_epoch, 0), {"id": cursor(new_epoch, 0)}
    )
    post_all(server, new_cid_claims(signer, "rebuild", 1, start=5))
    stream.until(lambda r: r.position == 2, replica)
    assert [f.id for f in replica.history] == [cursor(new_epoch, 1), cursor(new_epoch, 2)]
    assert replica.state == records(server)
    stream.close()


# -- keep-alive and the CLI -----------------------------------------------------------------


def test_keep_alive_comments_when_idle(launch: Launch) -> None:
    server = launch({"METANODE_FEED_KEEP_ALIVE_S": "0.3"})
    signer = Signer()
    server.register(signer.uid, "feed")
    ep = epoch(server)
    stream = Stream(server, last_event_id=cursor(ep, 0))
    assert stream.next().event == "synced"
    raw = b""
    while raw.count(b": keep-alive\n\n") < 2:
        raw += stream.body()
    assert raw == b": keep-alive\n\n" * raw.count(b": keep-alive\n\n")
    post_all(server, new_cid_claims(signer, "ka", 1))
    frames = [f for f in stream.take(5) if f.event is not None][:2]
    assert [f.id for f in frames] == [cursor(ep, 1), cursor(ep, 2)]
    stream.close()


class Cli:
    """`metanode events` as a subprocess; its stdout lines read on a thread, waits bounded."""

    def __init__(self, server: Server, *args: str) -> None:
        env = {**os.environ, "METANODE_TOKEN": server.token}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metanode", "events", "--url", server.url, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, out: IO[bytes]) -> None:
        for raw in iter(out.readline, b""):  # split at LF only, as the program wrote them
            self.lines.put(raw.decode("utf-8").removesuffix("\n"))
        self.lines.put(None)

    def line(self) -> str:
        try:
            text = self.lines.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"`metanode events` printed nothing for {WAIT_S} s") from None
        if text is None:
            self.proc.wait(timeout=WAIT_S)
            assert self.proc.stderr is not None
            raise AssertionError(
                f"`metanode events` exited {self.proc.returncode}: "
                f"{self.proc.stderr.read().decode()[-2000:]}"
            )
        return text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=WAIT_S)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def parse_line(line: str) -> tuple[str, str, Any]:
    ident, kind, data = line.split(" ", 2)
    return ident, kind, json.loads(data)


def idle_for_keep_alives(server: Server, at: str, count: int = 2) -> None:
    """Wait while the feed is idle until a subscriber that joined after the CLI's got `count`
    keep-alives: the CLI's older subscription has been sent keep-alives by then too."""
    stream = Stream(server, last_event_id=at)
    try:
        assert stream.next().event == "synced"
        assert stream.take(count) == [Frame(comment="keep-alive")] * count
    finally:
        stream.close()


def test_events_cli_prints_the_feed(launch: Launch) -> None:
    server = launch({"METANODE_FEED_KEEP_ALIVE_S": "0.3"})  # keep-alives are not printed
    signer = Signer()
    server.register(signer.uid, "feed")
    post_all(server, new_cid_claims(signer, "cli", 3))  # events 1–6
    ep = epoch(server)
    want = records(server)
    snapshot = Cli(server, "--snapshot")
    try:
        lines = [parse_line(snapshot.line()) for _ in range(7)]
        assert {(d["rid"], d["key"]): d["value"] for _, _, d in lines[:6]} == want
        # each snapshot row's id is a position inside the snapshot; `synced` its end
        assert [(ident, kind) for ident, kind, _ in lines[:6]] == [
            (f"{cursor(ep, 6)}.{n}", "set") for n in range(1, 7)
        ]
        assert lines[6] == (cursor(ep, 6), "synced", {"id": cursor(ep, 6)})
        idle_for_keep_alives(server, cursor(ep, 6))  # which the CLI must not print
        post_all(server, fast_claims(signer, [(cid_n("cli", 0), "title", "new ☃", NOW_MS + 1)]))
        rid = records_rid(server, cid_n("cli", 0))
        assert snapshot.line() == (
            f'{cursor(ep, 7)} set {{"rid":"{rid}","key":"title","value":"new ☃"}}'
        )
    finally:
        snapshot.stop()
    since = Cli(server, "--since", cursor(ep, 0), "--prefix", "title")
    try:
        got = [parse_line(since.line()) for _ in range(5)]
    finally:
        since.stop()
    assert [(i, k, d["key"]) for i, k, d in got[:4]] == [
        (cursor(ep, seq), "set", "title") for seq in (2, 4, 6, 7)
    ]
    assert got[3][2]["value"] == "new ☃"
    assert got[4] == (cursor(ep, 7), "synced", {"id": cursor(ep, 7)})


def test_events_cli_prints_values_with_unicode_line_separators(launch: Launch) -> None:
    """Regression: `metanode events` split frames with httpx `iter_lines()` (str.splitlines:
    breaks at U+2028, U+2029, U+0085), while SSE ends lines only at CR/LF; a value holding
    U+2028, sent raw by the server, came out truncated into invalid JSON."""
    server = launch()
    signer = Signer()
    server.register(signer.uid, "feed")
    value = "one\u2028two\u2029three\x85four"
    post_all(server, fast_claims(signer, [(cid_n("u2028", 0), "title", value, NOW_MS)]))
    ep = epoch(server)
    rid = records_rid(server, cid_n("u2028", 0))
    cli = Cli(server, "--since", cursor(ep, 0), "--prefix", "title")
    try:
        first = cli.line()
    finally:
        cli.stop()
    assert first == f"{cursor(ep, 2)} set " + json.dumps(
        {"rid": rid, "key": "title", "value": value}, ensure_ascii=False, separators=(",", ":")
    )
