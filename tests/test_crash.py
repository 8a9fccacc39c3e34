"""Crashes: an acknowledged claim survives SIGKILL, and a crash between the truth commit and the
cache apply is repaired on restart by re-applying (SPEC §3: "behind, never wrong")."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cache, db, truth
from metanode import cid as cids
from metanode import claims as claims_mod
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.load import kill_under_load
from tests.helpers.server import Server, metanode_check, wait_caught_up
from tests.helpers.settings import reading, settings_for

Launch = Callable[..., Server]


@pytest.fixture
def launch(storage: str) -> Iterator[Launch]:
    """Start servers on demand, their stores on `storage`; whatever is still running at the
    end is stopped."""
    started: list[Server] = []

    def start(data_dir: Path, env: dict[str, str] | None = None) -> Server:
        # The watcher gets an empty folder of its own, not ./media of the working directory.
        isolated = {
            "METANODE_WATCH_ROOTS": str(data_dir.parent / "media"),
            "METANODE_STORAGE": storage,
        }
        srv = Server(data_dir, env={**isolated, **(env or {})})
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        if srv.proc is not None:
            srv.stop(signal.SIGKILL)


def stored_claims(conn: db.Connection, uid: str) -> set[tuple[str, str, str | None]]:
    return set(conn.execute("SELECT cid, key, value FROM claims WHERE uid = ?", (uid,)))


@pytest.mark.both_backends
def test_sigkill_mid_ingest_loses_no_acknowledged_claim(
    tmp_path: Path, launch: Launch, storage: str
) -> None:
    data = tmp_path / "data"
    first = launch(data)
    signer = Signer()
    first.register(signer.uid, "crash")

    def make_batch(worker: int, n: int) -> list[dict[str, Any]]:
        return [
            signer.claim(
                cids.midhash_bytes(f"crash-{worker}-{n}-{i}".encode()),
                "title",
                f"title {worker}-{n}-{i}",
            )
            for i in range(50)
        ]

    killed = kill_under_load(first, make_batch, posters=4, enough=10, deadline_s=30)
    acknowledged, in_doubt = killed.acknowledged, killed.in_doubt

    # A batch that got no answer is atomic: all of it was committed, or none of it.
    with reading(data, "truth", storage) as conn:
        stored = stored_claims(conn, signer.uid)
    for batch in in_doubt:
        present = [(c["cid"], c["key"], c["value"]) in stored for c in batch]
        assert all(present) or not any(present), f"{sum(present)} of {len(batch)} claims stored"

    second = launch(data)
    health = wait_caught_up(second.url)
    assert health["status"] == "ok", health
    with httpx.Client(base_url=second.url, timeout=10) as http:
        for batch in acknowledged:
            for claim in batch:
                listed = http.get(f"/api/meta/{claim['cid']}/claims", params={"uid": signer.uid})
                assert listed.status_code == 200, listed.text
                assert listed.json()["claims"] == [claim]
                doc = http.get(f"/api/meta/{claim['cid']}")
                assert doc.status_code == 200, doc.text
                assert doc.json()["metadata"]["title"] == claim["value"]
    metanode_check(data, storage)


CID = cids.midhash_bytes(b"crash window")


@contextlib.contextmanager
def cache_write_lock(data_dir: Path, storage: str) -> Iterator[None]:
    """Hold the cache's write lock from a connection of our own (`BEGIN IMMEDIATE`: SQLite's
    lock of cache.db, or the cache's advisory lock on PostgreSQL): the server still commits
    to the truth, but its applier cannot commit to the cache until we let go. Its `BEGIN
    IMMEDIATE` waits out the busy timeout (`db.BUSY_TIMEOUT_MS`, PostgreSQL's `lock_timeout`),
    fails `storage_locked` and is retried, and never gets through while the block runs."""
    conn = db.connect(db.target(data_dir, storage, "cache"))
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
    finally:
        conn.close()  # rolls back: we wrote nothing


@pytest.mark.both_backends
def test_crash_between_truth_commit_and_cache_apply(
    tmp_path: Path, launch: Launch, storage: str
) -> None:
    data = tmp_path / "data"
    # The cache is locked, so every POST waits `apply_wait_s` and answers 202 `applied: false`.
    first = launch(data, {"METANODE_APPLY_WAIT_S": "0.2", "METANODE_WATCH_ENABLED": "false"})
    signer = Signer()
    first.register(signer.uid, "crash")
    before = wait_caught_up(first.url)
    batches = [
        [
            signer.claim(
                cids.midhash_bytes(f"crash window {n}-{i}".encode()), "title", f"Survivor {n}-{i}"
            )
            for i in range(20)
        ]
        for n in range(3)
    ]
    batches[0][0] = claim = signer.claim(CID, "title", "Survivor")

    with cache_write_lock(data, storage):
        with httpx.Client(base_url=first.url, headers=first.headers, timeout=30) as http:
            for batch in batches:
                response = http.post("/api/claims", json={"claims": batch})
                assert response.status_code == 202, response.text
                assert response.json()["applied"] is False
                assert response.json()["accepted"] == len(batch)
            lagging = http.get("/health").json()
        assert lagging["apply_lag"] > 0, lagging
        assert first.proc is not None
        killed = first.proc.pid
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # while the apply still waits

    with (
        reading(data, "truth", storage) as truth_conn,
        reading(data, "cache", storage) as cache_conn,
    ):
        stored = stored_claims(truth_conn, signer.uid)
        assert all((c["cid"], c["key"], c["value"]) in stored for b in batches for c in b)
        truth_seq = truth_conn.execute("SELECT max(seq) FROM changes").fetchone()[0]
        state = dict(cache_conn.execute("SELECT name, value FROM state"))
        assert state["applied_seq"] == before["applied_seq"] < truth_seq
        assert state["epoch"] == before["epoch"]
        for batch in batches:
            for c in batch:
                assert (
                    cache_conn.execute(
                        "SELECT rid FROM cid_index WHERE cid = ?", (c["cid"],)
                    ).fetchone()
                    is None
                )

    healthy = launch(data)
    health = wait_caught_up(healthy.url)
    assert health["status"] == "ok", health
    assert health["applied_seq"] >= truth_seq
    assert health["epoch"] == state["epoch"], "repaired by a rebuild, not by re-applying"
    # the restart says what happened and what it caught up (it said nothing)
    restart = healthy.log_text().split("metanode serving", 1)[1]
    assert f"(pid {killed}) did not stop cleanly" in restart, restart
    assert f"the cache is {truth_seq - state['applied_seq']} truth change(s) behind" in restart
    with httpx.Client(base_url=healthy.url, timeout=10) as http:
        for batch in batches:
            for c in batch:
                doc = http.get(f"/api/meta/{c['cid']}")
                assert doc.status_code == 200, doc.text
                assert doc.json()["metadata"]["title"] == c["value"]
        listed = http.get(f"/api/meta/{CID}/claims").json()
    assert listed["claims"] == [claim]
    metanode_check(data, storage)


def health_until(server: Server, done: Callable[[dict[str, Any]], bool], timeout: float) -> None:
    """Poll `server`'s /health until `done(body)`, or fail saying what it last said."""
    deadline, body = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        body = httpx.get(f"{server.url}/health", timeout=5).json()
        if done(body):
            return
        time.sleep(0.01)
    raise AssertionError(f"/health never got there within {timeout} s: {body}")


@pytest.mark.both_backends
def test_sigkill_mid_replan_goes_on_after_the_restart(
    tmp_path: Path, launch: Launch, storage: str
) -> None:
    """A signer's replan keeps its progress in the cache's state, a step a transaction: a
    server killed while one is under way finishes it after its restart, from the last step
    that committed, and the cache is then what a rebuild gives (`metanode check`)."""
    data = tmp_path / "data"
    first = launch(data, {"METANODE_APPLY_WAIT_S": "0.2", "METANODE_WATCH_ENABLED": "false"})
    spammer = Signer()
    first.register(spammer.uid, "spammer")
    records = 80 * cache.REPLAN_CHUNK  # 80 steps: the replan outlasts the polls below
    cid_of = [cids.midhash_bytes(f"replan {n}".encode()) for n in range(records)]
    wires = fast_claims(spammer, [(cid, "title", "spam", NOW_MS) for cid in cid_of])
    with httpx.Client(base_url=first.url, headers=first.headers, timeout=60) as http:
        for start in range(0, records, 500):
            posted = http.post("/api/claims", json={"claims": wires[start : start + 500]})
            # 202 on a busy machine: stored, its apply not done within the 0.2 s waited
            assert posted.status_code in (200, 202), posted.text
        health_until(first, lambda body: body["apply_lag"] == 0, 120)  # every title shown
        blocked = http.post(f"/api/signers/{spammer.uid}/block")  # answered after 0.2 s
        assert blocked.status_code == 200, blocked.text
    health_until(first, lambda body: body["replans"] == 1, 60)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    with reading(data, "cache", storage) as conn:
        state = dict(conn.execute("SELECT name, value FROM state"))
        titled = conn.execute("SELECT count(*) FROM records WHERE key = 'title'").fetchone()[0]
    assert state[f"replan:{spammer.uid}"] > 0, state  # killed mid-replan, a step committed
    assert 0 < titled < records

    second = launch(data, {"METANODE_WATCH_ENABLED": "false"})
    health_until(second, lambda body: body["replans"] == 0 and body["apply_lag"] == 0, 120)
    with httpx.Client(base_url=second.url, timeout=10) as http:
        for cid in (cid_of[0], cid_of[-1]):
            assert "title" not in http.get(f"/api/meta/{cid}").json()["metadata"]
    second.stop()
    metanode_check(data, storage)


async def test_stop_with_an_apply_queued_uses_no_closed_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Node(
        settings_for(
            tmp_path / "data", apply_poll_s=3600.0, watch_enabled=False, plugins_enabled=False
        )
    )
    await node.start()
    assert await node.applier.wait_for(0, 10)
    failures: list[BaseException] = []
    real_apply = cache.apply_txn

    def apply_spy(conn: db.Connection, source: Any, *rest: Any) -> Any:
        # Records a failure instead of raising it: nobody awaits this job any more (the applier
        # task is cancelled), and an unretrieved exception would only be logged at some later
        # garbage collection, possibly on another thread.
        try:
            return real_apply(conn, source, *rest)
        except Exception as exc:
            failures.append(exc)
            return None

    monkeypatch.setattr(cache, "apply_txn", apply_spy)
    queued = threading.Event()
    real_submit = node.cache.writer.submit

    def submit_spy(fn: Any, *args: Any) -> Any:
        if fn is apply_spy:
            queued.set()
        return real_submit(fn, *args)

    monkeypatch.setattr(node.cache.writer, "submit", submit_spy)
    closing = threading.Event()
    real_close = node.cache.writer.close

    def close_spy() -> None:
        closing.set()  # node.stop has got as far as closing the cache writer
        real_close()

    monkeypatch.setattr(node.cache.writer, "close", close_spy)
    applier_stopping = threading.Event()
    real_stop = node.applier.stop

    async def stop_spy() -> None:
        applier_stopping.set()  # node.stop asks the applier to finish, the apply still queued
        await real_stop()

    monkeypatch.setattr(node.applier, "stop", stop_spy)
    gate = threading.Event()
    node.cache.writer.submit(lambda conn: gate.wait(120))  # hold the cache writer
    stopping: asyncio.Task[None] | None = None
    try:
        signer = Signer()
        await node.truth.writer.run(truth.add_signer_txn, signer.uid, "s", 1, False, NOW_MS)
        batch = [claims_mod.validate(signer.claim(CID, "title", "x"), NOW_MS)]
        await node.truth.writer.run(truth.ingest_txn, batch, node.minter, node.policy, NOW_MS)
        node.applier.wake()
        await wait_until(queued, "the applier never queued an apply")
        stopping = asyncio.create_task(node.stop())
        await wait_until(applier_stopping, "node.stop never stopped the applier", 60)
        assert not closing.is_set()  # the queued apply still holds the cache open
        gate.set()  # the apply runs now, during the stop
        await wait_until(closing, "node.stop never closed the cache writer", 60)
    finally:
        gate.set()
        await (stopping if stopping is not None else node.stop())
    assert not failures, f"an apply ran on a closed connection: {failures!r}"


async def wait_until(event: threading.Event, failure: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not event.is_set():
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.01)


def cache_state(data: Path) -> dict[str, int]:
    with reading(data, "cache") as conn:
        return dict(conn.execute("SELECT name, value FROM state"))


@pytest.mark.skipif(db.boot_id() is None, reason="no boot id here: every cache commit is fsync'd")
def test_a_restart_of_the_machine_while_serving_rebuilds_the_cache(
    tmp_path: Path, launch: Launch
) -> None:
    """The cache commits without an fsync (`cache_fsync` off): a crash of metanode loses none
    of those commits (the operating system holds them), one of the machine may. So the server
    marks cache.db with the boot it commits under, clears the mark when it stops cleanly, and
    a server that finds another boot's mark rebuilds the cache under a new feed epoch. A
    SIGKILL under the same boot, or a clean stop, keeps the epoch. The reboot is written here
    as it leaves the mark (`cache.RELAXED_BOOT`): the one part of a power loss a test can
    make."""
    data = tmp_path / "data"
    boot = db.boot_id()
    signer = Signer()
    first = launch(data, {"METANODE_WATCH_ENABLED": "false"})
    first.register(signer.uid, "reboot")
    claim = signer.claim(cids.midhash_bytes(b"reboot"), "title", "Still here")
    with httpx.Client(base_url=first.url, headers=first.headers, timeout=30) as http:
        assert http.post("/api/claims", json={"claims": [claim]}).json()["applied"] is True
    epoch = wait_caught_up(first.url)["epoch"]
    assert cache_state(data)[cache.RELAXED_BOOT] == boot
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL

    def restarted(sig: int) -> dict[str, Any]:
        server = launch(data, {"METANODE_WATCH_ENABLED": "false"})
        health = wait_caught_up(server.url)
        doc = httpx.get(f"{server.url}/api/meta/{claim['cid']}", timeout=10)
        assert doc.json()["metadata"]["title"] == "Still here", doc.text
        server.stop(sig)
        return health

    assert restarted(signal.SIGTERM)["epoch"] == epoch  # killed under this boot: kept
    assert cache_state(data)[cache.RELAXED_BOOT] == 0  # ...and stopped cleanly
    assert restarted(signal.SIGKILL)["epoch"] == epoch  # a clean stop before it: kept

    with contextlib.closing(db.connect(data / "cache.db")) as conn:  # the machine restarts
        conn.execute("UPDATE state SET value = ? WHERE name = ?", (boot + 1, cache.RELAXED_BOOT))
    rebuilt = restarted(signal.SIGTERM)
    assert rebuilt["epoch"] > epoch, rebuilt
    assert cache.LOST not in cache_state(data)
    metanode_check(data, "sqlite")
