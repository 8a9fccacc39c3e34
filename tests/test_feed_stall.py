"""A change-feed consumer that stops reading (`feed_stall_s`, server.BoundedHttpTools): it is
cut once its stream's buffers stay full that long, counted in /metrics, and it resumes from its
last id with nothing lost. A real server and a raw socket that reads nothing; every wait is on
a condition (the node's own metrics), never a timer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import sse
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.feed import WAIT_S, Dechunker, FrameParser, Replica, Stream, cid_n, reached
from tests.helpers.server import Server
from tests.helpers.settings import reading
from tests.helpers.wait import poll

VALUE = "v" * 60_000  # near `max_value_bytes`: a few batches fill any socket's buffers
BATCH = 50  # claims a POST: ≈ 3 MB, under `max_batch_bytes`


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """A server whose `feed_stall_s` is the test's parameter (1 s unless told)."""
    stall_s = getattr(request, "param", "1")
    srv = Server(tmp_path / "data", env={"METANODE_FEED_STALL_S": stall_s}).start()
    try:
        yield srv
    finally:
        srv.stop()


def metric(server: Server, name: str) -> float:
    """One unlabelled sample of /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=WAIT_S).text
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split(" ")[1])
    raise AssertionError(f"{name} not in /metrics")


def big_claims(signer: Signer, batch: int) -> list[dict[str, Any]]:
    """`BATCH` claims of `VALUE`-sized values on new CIDs (2 events apiece)."""
    items = [(cid_n(f"stall {batch}", i), "title", f"{i} {VALUE}", NOW_MS) for i in range(BATCH)]
    return fast_claims(signer, items)


def post(server: Server, claims: list[dict[str, Any]]) -> None:
    response = httpx.post(
        f"{server.url}/api/claims", headers=server.headers, json={"claims": claims}, timeout=WAIT_S
    )
    assert response.status_code == 200, response.text


def feed_head(server: Server) -> str:
    """The id of the newest event, from the cache's own state."""
    with reading(server.data_dir, "cache", server.storage) as conn:
        state = dict(conn.execute("SELECT name, value FROM state").fetchall())
    return sse.event_id(state["epoch"], state["feed_seq"])


def drain(stuck: Stream) -> bytes:
    """Everything the cut connection still holds for its client, to its end (a reset may end
    it: the server dropped what the client's socket had not received)."""
    body, dechunk = stuck._early, Dechunker()
    while True:
        try:
            data = stuck.sock.recv(1 << 16)
        except ConnectionResetError:
            return body
        if not data:
            return body
        body += dechunk.feed(data)


def test_a_consumer_that_stops_reading_is_cut_and_resumes_gaplessly(server: Server) -> None:
    signer = Signer()
    server.register(signer.uid, "stall")
    stuck = Stream(server, rcvbuf=4096)  # live from here; it never reads again
    batches = 0

    def cut() -> bool | None:
        """Another batch of events, until the node has cut the stuck stream."""
        nonlocal batches
        if metric(server, "metanode_feed_cut_stalled_total") >= 1:
            return True
        if metric(server, "metanode_feed_stalled") == 0:
            post(server, big_claims(signer, batches))
            batches += 1
        return None

    poll(cut, "the node to cut the consumer that stopped reading")
    assert metric(server, "metanode_feed_cut_stalled_total") == 1
    assert metric(server, "metanode_feed_stalled") == 0
    poll(lambda: metric(server, "metanode_feed_subscribers") == 0 or None, "the stream closed")
    assert any("cut the change feed of 127.0.0.1:" in m for m in server.log_messages())

    # What the client did receive ends at its last whole frame; it resumes from that id.
    replica = Replica(gaps_allowed=False)
    replica.apply_all(FrameParser().feed(drain(stuck)))
    assert replica.last_id is not None, "the stuck client received no whole event"
    got_before = len(replica.seqs)
    post(server, big_claims(signer, batches))  # and events flow on while it is away
    end = feed_head(server)
    resumed = Stream(server, last_event_id=replica.last_id)
    resumed.until(reached(int(end.rsplit("-", 1)[1])), replica)
    synced = resumed.next()
    replica.apply(synced)
    assert synced.event == "synced"
    first = replica.seqs[0]
    assert replica.seqs == list(range(first, first + len(replica.seqs)))  # nothing lost or doubled
    assert replica.last_id == end
    assert got_before < len(replica.seqs)
    assert metric(server, "metanode_feed_cut_stalled_total") == 1  # the reader is not cut
    resumed.close()


@pytest.mark.parametrize("server", ["3600"], indirect=True)
def test_a_consumer_that_stops_reading_is_counted_stalled_and_behind_until_it_reads(
    server: Server,
) -> None:
    signer = Signer()
    server.register(signer.uid, "stall")
    stuck = Stream(server, rcvbuf=4096)
    batches = 0

    def stalled() -> bool | None:
        nonlocal batches
        if metric(server, "metanode_feed_stalled") == 1:
            return True
        post(server, big_claims(signer, batches))
        batches += 1
        return None

    poll(stalled, "the node to see the consumer's buffers full")
    post(server, big_claims(signer, batches))  # 100 events it cannot be sent
    assert metric(server, "metanode_feed_behind_events") >= 2 * BATCH
    assert metric(server, "metanode_feed_subscribers") == 1
    end = int(feed_head(server).rsplit("-", 1)[1])
    replica = stuck.until(reached(end), Replica(gaps_allowed=False))  # it reads again
    assert replica.seqs == list(range(replica.seqs[0], end + 1))
    poll(lambda: metric(server, "metanode_feed_stalled") == 0 or None, "the stall to clear")
    assert metric(server, "metanode_feed_behind_events") == 0
    assert metric(server, "metanode_feed_cut_stalled_total") == 0
