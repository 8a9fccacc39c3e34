"""`metanode serve --workers 2` on a real server: reads and writes through both workers,
read-your-writes across them, the same feed from either, a SIGKILLed worker replaced, and a
clean shutdown (workers.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.feed import FrameParser
from tests.helpers.server import Server

DEADLINE_S = 60.0
A, B, C = (cids.midhash_bytes(f"workers {n}".encode()) for n in "ABC")


OPENED: list[httpx.Client] = []  # closed after each test


pytestmark = pytest.mark.both_backends


@pytest.fixture
def server(tmp_path: Path, storage: str) -> Iterator[Server]:
    srv = Server(tmp_path / "data", workers=2, env={"METANODE_STORAGE": storage}).start()
    yield srv
    while OPENED:
        OPENED.pop().close()
    srv.stop()
    srv.print_log()


def pinned(srv: Server) -> httpx.Client:
    """A client on one keep-alive connection, so on one worker."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    client = httpx.Client(base_url=srv.url, headers=srv.headers, limits=limits, timeout=30)
    OPENED.append(client)
    return client


def worker_of(client: httpx.Client) -> str:
    return client.get("/api/meta/" + A).headers["x-metanode-worker"]


def one_per_worker(srv: Server) -> dict[str, httpx.Client]:
    """A pinned client on each worker (connections land where the kernel puts them: open new
    ones until both workers have one)."""
    found: dict[str, httpx.Client] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(found) < 2:
        assert time.monotonic() < deadline, f"only reached {sorted(found)}"
        client = pinned(srv)
        found.setdefault(worker_of(client), client)
    assert sorted(found) == ["owner", "reader-1"]
    return found


def register(client: httpx.Client, signer: Signer) -> None:
    body = {"uid": signer.uid, "name": "test", "weight": 1, "may_link": True}
    assert client.post("/api/signers", json=body).status_code == 200


def title_of(client: httpx.Client, cid: str) -> str | None:
    response = client.get(f"/api/meta/{cid}")
    return response.json()["metadata"].get("title") if response.status_code == 200 else None


def children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def role_pids(srv: Server) -> dict[str, int]:
    """The live worker processes of the supervisor, by role (a killed one not yet reaped has
    no command line any more)."""
    assert srv.proc is not None
    out = {}
    for pid in children(srv.proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--worker" in argv:
            out[argv[argv.index(b"--worker") + 1].decode().split(":")[0]] = pid
    return out


def test_writes_through_either_worker_are_read_at_once_from_both(server: Server) -> None:
    clients = one_per_worker(server)
    owner, reader = clients["owner"], clients["reader-1"]
    signer = Signer()
    register(reader, signer)  # forwarded to the owner
    assert [s["uid"] for s in owner.get("/api/signers").json()["signers"]].count(signer.uid) == 1
    for writer, cid, title in ((reader, A, "via the reader"), (owner, B, "via the owner")):
        response = writer.post("/api/claims", json={"claims": [signer.claim(cid, "title", title)]})
        assert response.status_code == 200, response.text
        assert response.json()["accepted"] == 1
        # Answered only once the cache holds it: both workers read it at once.
        assert title_of(owner, cid) == title_of(reader, cid) == title
    viewer = reader.get(f"/api/meta/{A}", params={"as": signer.uid})
    assert viewer.json()["metadata"]["title"] == "via the reader"
    claims = reader.get(f"/api/meta/{A}/claims").json()["claims"]
    assert [c["value"] for c in claims] == ["via the reader"]
    chunked = reader.post(  # a body of unknown length goes over chunked, as it came
        "/api/claims",
        content=iter([b'{"claims": [', json.dumps(signer.claim(C, "title", "c")).encode(), b"]}"]),
        headers={"Content-Type": "application/json"},
    )
    assert (chunked.status_code, chunked.json()["accepted"]) == (200, 1), chunked.text
    assert title_of(owner, C) == "c"
    expecting = reader.post(  # the reader answers the 100-continue; the owner never sees it
        "/api/claims",
        json={"claims": [signer.claim(C, "year", "1999")]},
        headers={"Expect": "100-continue"},
    )
    assert expecting.status_code == 200, expecting.text
    head = reader.head("/health")  # handed over: the head only, the connection still usable
    assert (head.status_code, head.content) == (200, b"")
    assert reader.get("/health").json()["cache_ready"] is True
    bad = reader.post("/api/claims", json={"claims": [{"cid": A}]})
    assert (bad.status_code, bad.json()["error"]) == (400, "invalid_batch")
    refused = httpx.post(f"{server.url}/api/claims", json={"claims": []}, timeout=30)
    assert (refused.status_code, refused.json()["error"]) == (401, "unauthorized")


def events(client: httpx.Client, count: int) -> list[tuple[str | None, dict[str, Any]]]:
    """The first `count` events of `/api/events` on this client's worker, from the start of
    the feed."""
    got: list[tuple[str | None, dict[str, Any]]] = []
    parser = FrameParser()
    since = f"{client.get('/health').json()['epoch']}-0"
    with client.stream("GET", "/api/events", params={"since": since}) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            got += [(f.id, f.data) for f in parser.feed(chunk) if f.event == "set"]
            if len(got) >= count:
                return got[:count]
    raise AssertionError(f"the stream ended after {got}")


def test_the_feed_is_the_same_on_every_worker(server: Server) -> None:
    clients = one_per_worker(server)
    signer = Signer()
    register(clients["owner"], signer)
    batch = [signer.claim(cid, "title", f"title of {cid}") for cid in (A, B, C)]
    assert clients["reader-1"].post("/api/claims", json={"claims": batch}).status_code == 200
    seen = {name: events(client, 6) for name, client in clients.items()}  # a title, a cids/ each
    assert seen["owner"] == seen["reader-1"]
    titles = {data["value"] for _, data in seen["owner"] if data["key"] == "title"}
    assert titles == {f"title of {c}" for c in (A, B, C)}


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def serves(server: Server, claim: dict[str, Any]) -> bool:
    """Whether a new connection takes a write and reads what was written before."""
    try:
        client = pinned(server)
        posted = client.post("/api/claims", json={"claims": [claim]})
        return posted.status_code == 200 and title_of(client, A) == "a"
    except httpx.TransportError:
        return False


def test_a_killed_worker_is_replaced_and_nothing_acknowledged_is_lost(server: Server) -> None:
    signer = Signer()
    first = pinned(server)
    register(first, signer)
    assert first.post("/api/claims", json={"claims": [signer.claim(A, "title", "a")]}).is_success
    for ts, role in enumerate(("reader", "owner"), NOW_MS + 1):
        killed = role_pids(server)[role]
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: role_pids(server).get(role) not in (None, killed), f"a new {role}")  # noqa: B023
        claim = signer.claim(B, "title", f"after the {role}", ts)
        wait_for(lambda: serves(server, claim), f"serving again after the {role}")  # noqa: B023
    assert (server.meta(B) or {})["metadata"]["title"] == "after the owner"


def test_shutdown_stops_every_worker_cleanly(server: Server) -> None:
    pids = role_pids(server)
    assert sorted(pids) == ["owner", "reader"]
    assert server.stop(signal.SIGTERM) == 0
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert not (server.data_dir / "owner.sock").exists()
    assert "Finished server process" in server.log_text()
