"""Group commit (issue 18): concurrent requests' batches share one truth transaction, and still
no request is answered before its own claims are durable and applied; a batch that fails in the
transaction fails alone; a SIGKILL inside a group or between its COMMIT and the answers leaves
the truth all-or-nothing per group."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metanode import cid as cids
from metanode import claims, db, truth
from metanode import rid as rids
from metanode.errors import MetanodeError, NotCommitted
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer, post, register
from tests.helpers.load import kill_under_load
from tests.helpers.server import Server, metanode_check, wait_caught_up
from tests.helpers.settings import reading

DEADLINE_S = 60.0


@pytest.fixture(autouse=True)
def whole_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer gathers a group for `DEADLINE_S`, not `db.GROUP_DEADLINE_S` (5 ms): these
    tests assert which queued jobs share a transaction, and on a loaded machine preparing 8
    of them (each claim's verify) outlasted 5 ms and split the group (1 run in 10 at load
    17). A group still takes only what is queued, so the longer bound never makes one wait."""
    monkeypatch.setattr(db, "GROUP_DEADLINE_S", DEADLINE_S)


def claim_for(signer: Signer, tag: str) -> dict[str, Any]:
    return signer.claim(cids.midhash_bytes(tag.encode()), "title", f"title {tag}")


def titles(conn: db.Connection) -> set[str]:
    return {row[0] for row in conn.execute("SELECT value FROM claims WHERE key = 'title'")}


@pytest.mark.both_backends
async def test_concurrent_posters_read_their_writes_and_every_claim_is_stored(
    node: Node, client: httpx.AsyncClient
) -> None:
    signer = Signer()
    await register(client, signer)

    async def poster(worker: int) -> list[dict[str, Any]]:
        sent = []
        for n in range(8):
            claim = claim_for(signer, f"poster {worker}-{n}")
            response = await post(client, claim)
            assert response.status_code == 200, response.text
            assert response.json()["accepted"] == 1
            doc = await client.get(f"/api/meta/{claim['cid']}")  # read-your-writes, at once
            assert doc.status_code == 200, doc.text
            assert doc.json()["metadata"]["title"] == claim["value"]
            sent.append(claim)
        return sent

    sent = [c for part in await asyncio.gather(*(poster(w) for w in range(16))) for c in part]
    assert {c["value"] for c in sent} <= titles(node.truth.conn)
    for claim in sent:
        rid = node.cache.lookup(claim["cid"])
        assert rid is not None and node.cache.record_value(rid, "title") == claim["value"]


async def wait_queued(node: Node, jobs: int) -> None:
    """Until `jobs` transactions wait in the truth writer's queue (a condition, not a sleep)."""
    deadline = time.monotonic() + DEADLINE_S
    while node.truth.writer.queued() < jobs:
        assert time.monotonic() < deadline, f"{node.truth.writer.queued()} of {jobs} queued"
        await asyncio.sleep(0.01)


@pytest.mark.both_backends
async def test_queued_batches_commit_as_one_group_and_a_failing_one_fails_alone(
    node: Node, client: httpx.AsyncClient
) -> None:
    """Small batches go to the truth writer as they are (validated there, as their group is
    gathered, `TruthStore.ingest_wire`): one whose signature fails and one whose signer may not
    write (403, decided in the transaction) each fail alone; the rest share one transaction."""
    signer, stranger = Signer(), Signer()  # the stranger is not registered: 403 in the txn
    await register(client, signer)
    gate = threading.Event()
    held = node.truth.writer.submit(lambda conn: gate.wait(DEADLINE_S))  # the writer is busy
    good = [claim_for(signer, f"grouped {n}") for n in range(6)]
    bad = claim_for(stranger, "refused")
    tampered = {**claim_for(signer, "tampered"), "value": "not what was signed"}
    sent = [*good[:3], bad, tampered, *good[3:]]
    posts = [asyncio.create_task(post(client, c)) for c in sent]
    before = node.truth.writer.groups
    try:
        await wait_queued(node, len(posts))  # the tampered one too: not validated yet
    finally:
        gate.set()
    answers = await asyncio.gather(*posts)
    assert held.result() is True
    assert node.truth.writer.groups == before + 1, "the batches shared one transaction"
    statuses = [a.status_code for a in answers]
    assert statuses == [200, 200, 200, 403, 400, 200, 200, 200], [a.text for a in answers]
    assert answers[3].json()["error"] == answers[4].json()["error"] == "invalid_batch"
    assert [i["error"] for i in answers[4].json()["items"]] == ["bad_signature"]
    stored = titles(node.truth.conn)
    assert {c["value"] for c in good} <= stored
    assert not {bad["value"], tampered["value"]} & stored
    for claim in good:
        doc = await client.get(f"/api/meta/{claim['cid']}")
        assert doc.json()["metadata"]["title"] == claim["value"]
    assert (await client.get(f"/api/meta/{bad['cid']}")).status_code == 404
    assert (await client.get(f"/api/meta/{tampered['cid']}")).status_code == 404


# A process that queues three ingest batches behind a held writer, so the three are one group,
# and dies by SIGKILL at `WHERE`: inside the group's transaction after the first batch
# ("between"), or after its COMMIT, before any batch is answered ("answer").
CRASHER = textwrap.dedent(
    """
    import os, signal, sys, threading
    from pathlib import Path
    import nacl.signing
    from metanode import claims, db, rid, truth
    from metanode import cid as cids

    (storage, where), now = sys.argv[1:3], int(sys.argv[3])
    path = db.target(Path(sys.argv[4]), storage, "truth")
    key = nacl.signing.SigningKey.generate()
    uid = claims.uid_of(bytes(key.verify_key))

    def die(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def batch(tag: str) -> list[claims.Claim]:
        return [claims.sign(key, cids.midhash_bytes(f"{tag} {i}".encode()), "title",
                            f"{where} {tag} {i}", now) for i in range(5)]

    store = truth.TruthStore(path).open()
    store.add_signer_sync(uid, "crasher", 1, False)
    gate = threading.Event()
    store.writer.submit(lambda conn: gate.wait(60))
    group = truth.INGEST_GROUP
    minter, policy = rid.Minter(), truth.Policy()
    first = store.writer.submit_grouped(group, 5, truth.ingest_txn, batch("a"), minter, policy, now)
    if where == "between":
        store.writer.submit_grouped(group, 1, lambda conn: die())
    last = store.writer.submit_grouped(group, 5, truth.ingest_txn, batch("b"), minter, policy, now)
    if where == "answer":
        first.add_done_callback(die)  # runs on the writer thread right after the COMMIT
    gate.set()
    last.result(timeout=60)
    print("not killed")
    """
)


def crash_in_a_group(data_dir: Path, storage: str, where: str) -> None:
    """Run `CRASHER` on the truth of `data_dir` (its stores on `storage`)."""
    done = subprocess.run(
        [sys.executable, "-c", CRASHER, storage, where, str(NOW_MS), str(data_dir)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


@pytest.mark.both_backends
def test_sigkill_between_two_batches_of_one_group_commits_none_of_it(
    tmp_path: Path, storage: str
) -> None:
    crash_in_a_group(tmp_path, storage, "between")
    with reading(tmp_path, "truth", storage) as conn:
        assert not [v for v in titles(conn) if v.startswith("between")]
        assert conn.execute("SELECT count(*) FROM changes WHERE kind = 'claim'").fetchone()[0] == 0
        if storage == "sqlite":
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.both_backends
def test_sigkill_between_a_groups_commit_and_its_answers_keeps_all_of_it(
    tmp_path: Path, storage: str
) -> None:
    crash_in_a_group(tmp_path, storage, "answer")
    with reading(tmp_path, "truth", storage) as conn:
        stored = titles(conn)
    assert {f"answer {tag} {i}" for tag in "ab" for i in range(5)} <= stored


@pytest.mark.both_backends
@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_under_grouped_load_on_a_server_loses_no_acknowledged_claim(
    tmp_path: Path, storage: str, workers: int
) -> None:
    """Sixteen posters of one claim each, so the server groups them; SIGKILL once enough are
    acknowledged. Every acknowledged claim is in the truth and, after a restart, in the cache;
    the server then checks clean (`metanode check`). With 2 workers, the posters' connections
    land on both, and the reader's claims reach the owner's groups by the hand-off."""
    data = tmp_path / "data"
    env = {"METANODE_WATCH_ROOTS": str(tmp_path / "media"), "METANODE_STORAGE": storage}
    first = Server(data, env=env, workers=workers).start()
    signer = Signer()
    try:
        first.register(signer.uid, "load")
        acknowledged = hammer(first, signer)
    finally:
        if first.proc is not None:
            first.stop(signal.SIGKILL)
    with reading(data, "truth", storage) as conn:
        assert {c["value"] for c in acknowledged} <= titles(conn)
    second = Server(data, env=env).start()
    try:
        assert wait_caught_up(second.url)["status"] == "ok"
        with httpx.Client(base_url=second.url, timeout=10) as http:
            for claim in acknowledged:
                doc = http.get(f"/api/meta/{claim['cid']}")
                assert doc.status_code == 200, doc.text
                assert doc.json()["metadata"]["title"] == claim["value"]
    finally:
        second.stop()
    metanode_check(data, storage)


def hammer(srv: Server, signer: Signer) -> list[dict[str, Any]]:
    """Post single claims from 16 threads until 200 are acknowledged, then SIGKILL the server;
    the acknowledged claims."""
    killed = kill_under_load(
        srv,
        lambda worker, n: [claim_for(signer, f"load {worker}-{n}")],
        posters=16,
        enough=200,
        deadline_s=DEADLINE_S,
    )
    return [claim for batch in killed.acknowledged for claim in batch]


async def test_the_apply_reads_back_nothing_an_ingest_of_new_records_wrote(
    node: Node, client: httpx.AsyncClient
) -> None:
    """New records: the ingest hands the applier its outbox rows and the groups it minted, so
    the cache's apply reads neither the outbox nor a claim nor a group back from truth.db
    (every statement on the apply's truth connection is traced); after a restart the outbox is
    read again (`test_crash.py`)."""
    signer = Signer()
    await register(client, signer)
    statements: list[str] = []
    node.truth.apply_connection().set_trace_callback(statements.append)
    try:
        response = await post(client, *(claim_for(signer, f"new {n}") for n in range(5)))
    finally:
        node.truth.apply_connection().set_trace_callback(None)
    assert response.status_code == 200 and response.json()["applied"], response.text
    applies = snapshots(statements)  # an apply woken earlier, with nothing to do, reads the
    # outbox and finds it empty; the apply of the five claims reads the signers only
    assert any("signers" in " ".join(block) for block in applies), applies
    for block in applies:
        assert not any("claims" in s or "cid_group" in s for s in block), block
        assert not ("signers" in " ".join(block) and any("changes" in s for s in block)), block


def snapshots(statements: list[str]) -> list[list[str]]:
    """Traced statements cut into read transactions (BEGIN … COMMIT)."""
    blocks: list[list[str]] = []
    for statement in statements:
        if statement == "BEGIN":
            blocks.append([])
        elif statement != "COMMIT" and blocks:
            blocks[-1].append(statement)
    return blocks


# -- the combiner: a group's batches in one pass (truth.ingest_many_txn) -----------------------

POOL_SIGNERS = [Signer(), Signer(), Signer()]  # the last is never registered: its batches fail
POOL_CIDS = [cids.midhash_bytes(f"pool {n}".encode()) for n in range(4)]


def pool_claim(signer: int, cid: int, key: int, value: int, ts: int) -> claims.Claim:
    """A valid claim from a small pool, so batches collide: same (uid, cid, key), older and
    newer timestamps, retractions (value None) and links between the pool's CIDs."""
    keys = ["title", "year", f"cids/{POOL_CIDS[(cid + 1) % len(POOL_CIDS)]}"]
    wire = POOL_SIGNERS[signer].claim(
        POOL_CIDS[cid], keys[key], [None, "a", "b"][value], NOW_MS - ts
    )
    return claims.validate(wire, NOW_MS)


batches_strategy = st.lists(
    st.lists(
        st.builds(
            pool_claim,
            st.integers(0, 2),
            st.integers(0, 3),
            st.integers(0, 2),
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        min_size=1,
        max_size=4,
    ),
    min_size=2,
    max_size=6,
)


def truth_state(store: truth.TruthStore) -> tuple[Any, ...]:
    """What a truth holds, rid spellings aside: its claims, its groups as sets of CIDs, and
    its outbox with each rid replaced by the group of CIDs it names."""
    conn = store.writer.conn
    stored = sorted(conn.execute("SELECT uid, cid, key, value, ts, log_seq FROM claims"))
    members: dict[str, frozenset[str]] = {}
    for rid, cid in conn.execute("SELECT rid, cid FROM cid_group"):
        members[rid] = members.get(rid, frozenset()) | {cid}
    outbox = [
        (kind, members.get(rid) if rid else None, cid, key, uid)
        for kind, rid, cid, key, uid in conn.execute(
            "SELECT kind, rid, cid, key, uid FROM changes ORDER BY seq"
        )
    ]
    return stored, sorted(map(sorted, members.values())), outbox


def ingest_all(path: Path, batches: list[list[claims.Claim]], together: bool) -> tuple[Any, ...]:
    """Ingest `batches` into a fresh truth at `path`: queued as one group behind a held writer
    (`together`: the combiner), or one transaction each; (each batch's verdicts or error
    slug, the truth's state)."""
    with truth.TruthStore(path, lambda: NOW_MS) as store:
        for signer in POOL_SIGNERS[:2]:
            store.add_signer_sync(signer.uid, "pool", 1, True)
        minter, policy = rids.Minter(), truth.Policy()
        gate = threading.Event()
        if together:
            store.writer.submit(lambda conn: gate.wait(DEADLINE_S))
        futures = []
        for batch in batches:
            args = (truth.INGEST_GROUP, len(batch), truth.ingest_txn, batch, minter, policy)
            futures.append(store.writer.submit_grouped(*args, NOW_MS))
            if not together:
                futures[-1].exception(timeout=DEADLINE_S)  # each its own transaction
        groups = store.writer.groups
        gate.set()
        answers = []
        for future in futures:
            error = future.exception(timeout=DEADLINE_S)
            answers.append(error.slug if isinstance(error, MetanodeError) else future.result())
        if together:
            assert store.writer.groups == groups + 1, "the batches shared one transaction"
        verdicts = [a if isinstance(a, str) else a.verdicts for a in answers]
        return verdicts, truth_state(store)


@settings(max_examples=40, deadline=None)
@given(batches_strategy)
def test_a_groups_batches_in_one_pass_store_what_one_transaction_each_would(
    batches: list[list[claims.Claim]],
) -> None:
    """Property: the combined pass gives every batch the verdicts (or the policy error) and
    leaves the truth (claims, claim-log order, groups, outbox) exactly as running the batches
    one after the other does."""
    with tempfile.TemporaryDirectory() as tmp:
        alone = ingest_all(Path(tmp) / "alone.db", batches, together=False)
        together = ingest_all(Path(tmp) / "together.db", batches, together=True)
    assert together == alone


def test_a_combiner_that_raises_falls_back_to_one_savepoint_a_job(tmp_path: Path) -> None:
    """If the combined call fails (a bug, a constraint), its jobs run one by one under their
    own savepoints: the job that fails alone fails alone, the others commit, in one group."""

    def insert(conn: sqlite3.Connection, value: int) -> int:
        conn.execute("INSERT INTO t (v) VALUES (?)", (value,))  # a CHECK refuses negatives
        return value

    def combine(conn: sqlite3.Connection, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
        for (value,) in jobs:
            insert(conn, value)
        return [(True, value) for (value,) in jobs]

    path = tmp_path / "t.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (v INTEGER CHECK (v >= 0))")
    writer = db.Writer(path, "test", {insert: combine})
    try:
        gate = threading.Event()
        writer.submit(lambda conn: gate.wait(DEADLINE_S))
        futures = [writer.submit_grouped("g", 1, insert, v) for v in (1, 2, -3, 4)]
        gate.set()
        assert [f.exception(timeout=DEADLINE_S) is None for f in futures] == [1, 1, 0, 1]
        assert isinstance(futures[2].exception(), sqlite3.IntegrityError)
        assert writer.groups == 1
    finally:
        writer.close()
    with sqlite3.connect(path) as conn:
        assert sorted(v for (v,) in conn.execute("SELECT v FROM t")) == [1, 2, 4]


def insert_twice(conn: db.Connection, value: int) -> int:
    """Insert `value + 100`, then `value`: a negative one is refused after the first insert, so
    a job that fails has written something that must be undone."""
    conn.execute("INSERT INTO t (v) VALUES (?)", (abs(value) + 100,))
    conn.execute("INSERT INTO t (v) VALUES (?)", (value,))  # the CHECK refuses negatives
    return value


def combine_twice(conn: db.Connection, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
    return [(True, insert_twice(conn, value)) for (value,) in jobs]


def checked_writer(path: Path) -> tuple[db.Writer, list[str]]:
    """A writer of a table that refuses negatives, combining `insert_twice` jobs, and the
    statements its connection runs."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (v INTEGER CHECK (v >= 0))")
    writer = db.Writer(path, "test", {insert_twice: combine_twice})
    statements: list[str] = []
    writer.run_sync(lambda conn: conn.set_trace_callback(statements.append))
    return writer, statements


def run_group(writer: db.Writer, jobs: Sequence[tuple[Any, int]]) -> list[bool]:
    """`jobs` ((function, value) each) queued behind a held writer, so they are one group:
    whether each committed."""
    gate = threading.Event()
    writer.submit(lambda conn: gate.wait(DEADLINE_S))
    futures = [writer.submit_grouped("g", 1, fn, value) for fn, value in jobs]
    gate.set()
    return [f.exception(timeout=DEADLINE_S) is None for f in futures]


def stored_values(path: Path) -> list[int]:
    with sqlite3.connect(path) as conn:
        return sorted(v for (v,) in conn.execute("SELECT v FROM t"))


def test_a_groups_first_work_takes_no_savepoint_and_later_runs_do(tmp_path: Path) -> None:
    """What runs first in a group's transaction needs no savepoint (a rollback of the whole
    transaction undoes exactly it); a later run of another function takes one."""
    path = tmp_path / "t.db"
    writer, statements = checked_writer(path)
    try:
        assert run_group(writer, [(insert_twice, 1), (insert_twice, 2)]) == [True, True]
        assert not [s for s in statements if "SAVEPOINT" in s], statements
        statements.clear()
        assert run_group(writer, [(insert_twice, 3), (insert_value, 4)]) == [True, True]
        assert [s for s in statements if "SAVEPOINT" in s] == ["SAVEPOINT job"], statements
    finally:
        writer.close()
    assert stored_values(path) == [1, 2, 3, 4, 101, 102, 103]


@pytest.mark.parametrize("combined", [True, False], ids=["combined", "alone"])
def test_a_groups_first_job_that_fails_is_undone_alone(tmp_path: Path, combined: bool) -> None:
    """The first job fails after writing a row: the transaction is rolled back and begun
    again, so that row is gone, and the jobs after it still commit in the same group; run
    combined, the combined call fails first and each job runs again alone."""
    path = tmp_path / "t.db"
    writer, _ = checked_writer(path)
    try:
        jobs = [(insert_twice, -1), (insert_twice if combined else insert_value, 2)]
        assert run_group(writer, jobs) == [False, True]
        assert writer.groups == 1
        assert run_group(writer, [(insert_twice, -5)]) == [False]
        assert run_group(writer, [(insert_value, 6)]) == [True], "the writer still writes"
    finally:
        writer.close()
    assert stored_values(path) == ([2, 6, 102] if combined else [2, 6])


def until(condition: Any, what: str) -> None:
    """Poll `condition()` until it holds (a generous deadline, never a bare sleep)."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def counting_writer(path: Path) -> db.Writer:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (v INTEGER)")
    return db.Writer(path, "test")


def insert_value(conn: sqlite3.Connection, value: int) -> int:
    conn.execute("INSERT INTO t (v) VALUES (?)", (value,))
    return value


def held_group(writer: db.Writer, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """`jobs` ((prepare, value) each) queued behind a held writer, so they are one group;
    their futures, once the group has run."""
    gate = threading.Event()
    writer.submit(lambda conn: gate.wait(DEADLINE_S))
    futures = [writer.submit_grouped("g", 1, insert_value, v, prepare=p) for p, v in jobs]
    gate.set()
    for future in futures:
        future.exception(timeout=DEADLINE_S)
    return futures


def test_a_group_smaller_than_of_late_waits_for_the_next_small_batch(tmp_path: Path) -> None:
    """Under `serve --workers 2` a reader's requests reach the writer just after the owner's
    own: there a group of small batches smaller than the largest of the last `RECENT_S` waits
    for the next batch (`straggler_s`, here longer than the test), so they share one
    transaction. A lone batch with no larger group of late, and a group of `STRAGGLER_UNITS`
    claims or more, wait for nobody (here they would hang until the deadline)."""
    writer = counting_writer(tmp_path / "t.db")
    writer.straggler_s = DEADLINE_S  # as `Store.expect_stragglers` sets it, longer
    try:
        alone = writer.submit_grouped("g", 1, insert_value, 1)
        assert alone.result(timeout=DEADLINE_S / 2) == 1
        # The largest group of late: 2, so the two below are a whole group and wait for no
        # third (with 3 they waited out the deadline, and their results arrived just in time).
        held_group(writer, [(None, 2), (None, 3)])
        groups = writer.groups
        first = writer.submit_grouped("g", 1, insert_value, 5)
        until(lambda: writer.queued() == 0, "the writer took the first batch")
        second = writer.submit_grouped("g", 1, insert_value, 6)
        assert [first.result(DEADLINE_S), second.result(DEADLINE_S)] == [5, 6]
        assert writer.groups == groups + 1, "the two shared one transaction"
        large = writer.submit_grouped("g", db.STRAGGLER_UNITS, insert_value, 7)
        assert large.result(timeout=DEADLINE_S / 2) == 7
    finally:
        writer.close()


def test_a_jobs_prepare_runs_on_the_writer_thread_before_its_group_begins(tmp_path: Path) -> None:
    """`prepare` runs where the transaction will (the writer's thread), before the group's
    BEGIN (no lock held), and the transaction function gets the arguments it returned."""
    writer = counting_writer(tmp_path / "t.db")
    seen: list[tuple[str, bool]] = []

    def doubled(value: int) -> tuple[int]:
        seen.append((threading.current_thread().name, writer.conn.in_transaction))
        return (value * 2,)

    try:
        futures = held_group(writer, [(doubled, 1), (None, 5), (doubled, 3)])
        assert [f.result() for f in futures] == [2, 5, 6]
        assert seen == [("test-writer", False)] * 2
        assert (writer.groups, writer.grouped) == (1, 3)
    finally:
        writer.close()
    with sqlite3.connect(tmp_path / "t.db") as conn:
        assert sorted(v for (v,) in conn.execute("SELECT v FROM t")) == [2, 5, 6]


def test_a_job_whose_prepare_raises_fails_alone(tmp_path: Path) -> None:
    """A job refused in its `prepare` (a batch that does not validate) fails with what it
    raised and never reaches the transaction; the rest of its group commits together."""

    def refused(value: int) -> tuple[int]:
        raise ValueError(f"{value} refused")

    writer = counting_writer(tmp_path / "t.db")
    try:
        futures = held_group(writer, [(None, 1), (refused, 2), (None, 3)])
        assert str(futures[1].exception()) == "2 refused"
        assert (futures[0].result(), futures[2].result()) == (1, 3)
        assert (writer.groups, writer.grouped) == (1, 2)
    finally:
        writer.close()
    with sqlite3.connect(tmp_path / "t.db") as conn:
        assert sorted(v for (v,) in conn.execute("SELECT v FROM t")) == [1, 3]


# -- work begun before a COMMIT (db.Writer.before_commit, the cache's apply ahead) -------------


def ahead_of_commit(writer: db.Writer) -> tuple[list[Any], list[concurrent.futures.Future[Any]]]:
    """Set `writer`'s `before_commit` to begin work on each group's outcomes in another
    thread: what the hook saw (its thread, whether the transaction was still open, the rows
    another connection could read then), and the futures of that work, which waits on the
    gate and then reads the rows again."""
    seen: list[Any] = []
    work: list[concurrent.futures.Future[Any]] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def stored() -> list[int]:
        with sqlite3.connect(writer.path) as conn:
            return sorted(v for (v,) in conn.execute("SELECT v FROM t"))

    def after(gate: db.Gate) -> list[int]:
        gate.wait()
        return stored()

    def hook(outcomes: Sequence[db.Outcome]) -> db.Gate:
        seen.append((threading.current_thread().name, writer.conn.in_transaction, stored()))
        gate = db.Gate()
        work.append(pool.submit(after, gate))
        return gate

    writer.before_commit = hook
    return seen, work


def test_work_begun_before_a_commit_reads_only_once_it_has_committed(tmp_path: Path) -> None:
    """The hook gets a group's outcomes on the writer's thread with its transaction still
    open (nothing of it readable elsewhere yet); `Gate.wait` returns only after the COMMIT,
    when another connection reads all of the group."""
    writer = counting_writer(tmp_path / "t.db")
    try:
        seen, work = ahead_of_commit(writer)
        held_group(writer, [(None, 1), (None, 2)])
        assert seen == [("test-writer", True, [])]
        assert work[0].result(DEADLINE_S) == [1, 2]
    finally:
        writer.close()


def test_work_begun_before_a_commit_that_fails_is_told_so(tmp_path: Path) -> None:
    """A COMMIT that fails after the hook ran (here a deferred foreign key, checked only at
    COMMIT) fails the group's jobs, and the work begun on it gets `NotCommitted` from its
    gate, never a return: it must not make durable what the truth does not hold."""
    path = tmp_path / "t.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE t (v INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)"
        )
    writer = db.Writer(path, "test")
    try:
        writer.conn.execute("PRAGMA foreign_keys = ON")  # before any job: the writer is idle
        seen, work = ahead_of_commit(writer)
        future = writer.submit_grouped("g", 1, insert_value, 7)  # no parent 7: COMMIT fails
        assert isinstance(future.exception(DEADLINE_S), sqlite3.IntegrityError)
        assert isinstance(work[0].exception(DEADLINE_S), NotCommitted)
        assert seen == [("test-writer", True, [])]
        assert writer.submit(lambda conn: conn.in_transaction).result(DEADLINE_S)  # usable
    finally:
        writer.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)


def test_a_before_commit_hook_that_raises_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Work that cannot begin early begins after the COMMIT instead: the hook's exception is
    logged, and the group commits and answers as if there were no hook."""
    writer = counting_writer(tmp_path / "t.db")

    def hook(outcomes: Sequence[db.Outcome]) -> db.Gate:
        raise RuntimeError("no room ahead")

    try:
        writer.before_commit = hook
        futures = held_group(writer, [(None, 1), (None, 2)])
        assert [f.result() for f in futures] == [1, 2]
    finally:
        writer.close()
    assert "work ahead of a COMMIT could not begin" in caplog.text
    with sqlite3.connect(tmp_path / "t.db") as conn:
        assert sorted(v for (v,) in conn.execute("SELECT v FROM t")) == [1, 2]
