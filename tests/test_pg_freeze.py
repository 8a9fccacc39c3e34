"""A frozen PostgreSQL (SIGSTOP: connections open, nothing answered) costs a request one bound,
never the whole node: once one connection of the process finds the server silent, every other
one is refused at once (`pg.Server`) until a probe finds it answering again.

Real servers only: a cluster of the test's own (`own_cluster`), frozen and thawed with
SIGSTOP/SIGCONT, and a real `metanode serve` (uvicorn). Every freeze has a safety timer that
thaws the server after `DEADLINE_S`: a regression fails the test, it never hangs it. Nothing
here measures time; the figures are in docs/benchmarks.md ("A frozen PostgreSQL").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from metanode import pg
from metanode.errors import StorageUnavailable
from tests.helpers.claims import Signer
from tests.helpers.feed import Stream, new_cid_claims
from tests.helpers.postgres import Cluster
from tests.helpers.server import Server, wait_caught_up
from tests.helpers.wait import DEADLINE_S, poll


@contextlib.contextmanager
def frozen(cluster: Cluster) -> Iterator[None]:
    """The cluster stopped (SIGSTOP) for the block, thawed after it or after `DEADLINE_S`."""
    cluster.freeze()
    safety = threading.Timer(DEADLINE_S, cluster.thaw)
    safety.start()
    try:
        yield
    finally:
        safety.cancel()
        cluster.thaw()


def refused(response: httpx.Response) -> bool:
    """Whether `response` is the retryable 503 a silent server gets, with its Retry-After."""
    return (
        response.status_code == 503
        and response.json()["error"] == "storage_unavailable"
        and response.headers.get("retry-after") == "1"
    )


def test_a_frozen_server_costs_each_request_one_bound_and_loses_nothing(
    tmp_path: Path, own_cluster: Cluster
) -> None:
    """A read, /health and a POST sent at once to a node whose PostgreSQL was just frozen each
    answer a 503 `storage_unavailable` with a Retry-After (they used to come one after the
    other, each loop connection finding the freeze on its own: 5.6, 11.5 and 16.8 s); the
    requests after them are refused before anything is sent ("nothing is sent"), while an SSE
    feed stays open, its keep-alives going. Thawed (SIGCONT), the node recovers by itself:
    every claim acknowledged before the freeze is there, the one refused during it is stored
    when sent again, and the feed carries it."""
    env = {
        "METANODE_STORAGE": own_cluster.database(),
        "METANODE_PG_STALL_S": "0.5",
        "METANODE_PG_CONNECT_TIMEOUT_S": "2",
        "METANODE_FEED_KEEP_ALIVE_S": "0.5",
    }
    server = Server(tmp_path / "data", env=env).start()
    try:
        signer = Signer()
        server.register(signer.uid, "freeze")
        client = httpx.Client(base_url=server.url, headers=server.headers, timeout=DEADLINE_S)
        before = new_cid_claims(signer, "before", 5)
        assert client.post("/api/claims", json={"claims": before}).status_code == 200
        epoch = wait_caught_up(server.url)["epoch"]
        stream = Stream(server, last_event_id=f"{epoch}-10")  # after the 10 events of `before`
        during = new_cid_claims(signer, "during", 1)
        read = f"/api/meta/{before[0]['cid']}"
        with frozen(own_cluster), ThreadPoolExecutor(3) as pool:
            first = [
                pool.submit(client.get, read),
                pool.submit(client.get, "/health"),
                pool.submit(client.post, "/api/claims", json={"claims": during}),
            ]
            answers = [f.result() for f in first]  # `timeout` bounds a hang
            assert all(refused(r) for r in answers), [r.text for r in answers]
            again = client.get(read)
            assert refused(again) and "nothing is sent" in again.json()["message"], again.text
            assert refused(client.get("/health"))
            frame = stream.next()  # the feed is open and answering while the server is frozen
            while frame.comment != "keep-alive":
                assert frame.event not in ("gap", "set", "del"), frame
                frame = stream.next()

        def stored() -> bool | None:
            return client.post("/api/claims", json={"claims": during}).status_code == 200 or None

        poll(stored, "the claim stored once the server answers again")
        for claim in before + during:
            doc = client.get(f"/api/meta/{claim['cid']}")
            assert doc.status_code == 200 and doc.json()["metadata"]["title"] == claim["value"]
        # the claim stored after the thaw: 2 events, the feed going on without a gap
        assert stream.change_seqs(2) == [11, 12]
        ok = poll(lambda: client.get("/health").json()["status"] == "ok" or None, "health ok")
        assert ok  # the writers' probes clear `degraded`
        stream.close()
        client.close()
    finally:
        server.stop(9)
    assert "Exception in ASGI application" not in server.log_text()


def test_a_pooled_read_is_cut_off_when_the_server_stops_answering_mid_stream(
    own_cluster: Cluster,
) -> None:
    """A read of its own (the pool's: export, `check`, plugins) had no bound at all: a page of
    its stream asked of a frozen server waited for as long as it was frozen. Now the page is
    given up once the server does not answer a new connection either (`storage_unavailable`),
    the next read of the pool is refused at once, and the pool lends working connections
    again once the server answers."""
    target = pg.Target(own_cluster.database(), "public", stall_s=0.2, connect_timeout_s=2)
    pool = pg.Pool(target)
    try:
        conn = pool.connection()
        try:
            conn.execute("BEGIN")
            rows = iter(conn.execute(f"SELECT g FROM generate_series(1, {10 * pg.STREAM_ROWS}) g"))
            assert next(rows) == (1,)
            with frozen(own_cluster):
                with pytest.raises(Exception) as cut:
                    for _ in rows:  # the next page is a round trip to the frozen server
                        pass
                assert isinstance(pg.storage_error(cut.value) or cut.value, StorageUnavailable)
                with pytest.raises(StorageUnavailable, match="nothing is sent to it"):
                    pool.connection()
        finally:
            conn.close()

        def works() -> bool:
            with contextlib.suppress(StorageUnavailable):
                reader = pool.connection()
                try:
                    return bool(reader.execute("SELECT 3").fetchone()[0] == 3)
                finally:
                    reader.close()
            return False

        poll(works, "the pool lends a working connection once the server answers")
    finally:
        pool.close()
