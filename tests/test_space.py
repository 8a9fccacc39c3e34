"""truth.db gives the space of its pruned outbox back (incremental vacuum): a new truth.db is
made incremental, an older one is switched at its first open with its data intact, and pruning
the outbox shrinks the file to the claims and a small reserve. Schema v3 keys the claims by
their log seq (denser, appended rather than scattered): a v2 truth.db keeps every claim and its
log order through the migration, and v2 or v3 keeps them in v4 (signers and CIDs by integer
id); v5 rebuilds the outbox with its rows and its seq counter."""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

import pytest

from metanode import cid as cids
from metanode import db, maintenance, truth
from metanode.claims import Claim
from metanode.config import Settings
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.settings import settings_for

ROWS = 40_000  # ≈ 20 MiB of outbox rows: well over the reserve


def pragma(path: Path, name: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute(f"PRAGMA {name}").fetchone()[0])
    finally:
        conn.close()


def fill_outbox(conn: sqlite3.Connection) -> None:
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
        "INSERT INTO changes (kind, cid, key, at) SELECT 'claim', hex(randomblob(200)), "
        "'title', ? FROM n",
        (ROWS, NOW_MS),
    )


def vacuums(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "incremental vacuum" in r.getMessage()]


def test_an_older_truth_db_is_switched_at_open_with_its_rows_intact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "truth.db"
    db.migrate_file(path, truth.MIGRATIONS)  # as an older metanode made it: no auto_vacuum
    assert pragma(path, "auto_vacuum") == 0
    conn = db.connect(path)
    db.run_txn(conn, fill_outbox)
    conn.close()
    with caplog.at_level(logging.INFO, logger=db.log.name), truth.TruthStore(path).open() as store:
        assert store.max_seq() == ROWS
    assert pragma(path, "auto_vacuum") == db.INCREMENTAL
    assert vacuums(caplog) == [f"switching {path} to incremental vacuum (one VACUUM)"]


def test_a_new_truth_db_is_made_incremental_without_a_vacuum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The mode is set as the file is made, before the WAL switch writes its header: a first
    start neither rewrites the file nor says it does."""
    with (
        caplog.at_level(logging.INFO, logger=db.log.name),
        truth.TruthStore(tmp_path / "new.db").open(),
    ):
        pass
    assert pragma(tmp_path / "new.db", "auto_vacuum") == db.INCREMENTAL
    assert vacuums(caplog) == []


def test_an_upgrade_says_it_migrates_and_a_new_database_does_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first start after an upgrade may rewrite a table for minutes (schema v3: 11 s a
    million claims) and said nothing meanwhile: now a line before and one after."""
    old, new = tmp_path / "old.db", tmp_path / "new.db"
    db.migrate_file(old, truth.MIGRATIONS[:2])  # what an older metanode made
    with caplog.at_level(logging.INFO, logger=db.log.name):
        db.migrate_file(old, truth.MIGRATIONS)
        db.migrate_file(new, truth.MIGRATIONS)
        db.migrate_file(old, truth.MIGRATIONS)  # up to date: nothing to say
    said = [r.getMessage() for r in caplog.records if "migrat" in r.getMessage()]
    newest = len(truth.MIGRATIONS)
    assert said[0] == (
        f"migrating {old} from schema 2 to {newest}, in one transaction "
        "(docs/operations.md, 'Upgrading')"
    )
    assert said[1].startswith(f"migrated {old} to schema {newest} in ") and len(said) == 2


async def test_pruning_the_outbox_gives_its_pages_back(tmp_path: Path) -> None:
    path = tmp_path / "truth.db"
    with truth.TruthStore(path).open() as store:
        empty = pragma(path, "page_count")
        await store.writer.run(fill_outbox)
        full = pragma(path, "page_count")
        assert full > empty + 4 * truth.RESERVE_PAGES
        assert await store.prune_changes(store.max_seq()) == ROWS
        assert pragma(path, "page_count") <= empty + truth.RESERVE_PAGES + 8
        assert store.max_seq() == ROWS  # the counter stays: seqs are never reused
    assert path.stat().st_size <= (empty + truth.RESERVE_PAGES + 8) * 4096


async def test_a_large_transaction_leaves_no_large_wal_behind(tmp_path: Path) -> None:
    """The first retention run after an upgrade returns the old tables' pages in one
    transaction: at 300,000 claims from truth schema 1 it left a 206 MB truth.db-wal beside a
    truth.db shrunk from 176 to 52 MB, for as long as the node ran (the data directory larger
    than before the upgrade). Now the next write after the checkpoint cuts it back to
    `db.WAL_LIMIT_BYTES`; here an outbox of 40,000 rows written and pruned, then one row."""
    path = tmp_path / "truth.db"
    wal = tmp_path / "truth.db-wal"
    with truth.TruthStore(path).open() as store:
        await store.writer.run(fill_outbox)
        assert await store.prune_changes(store.max_seq()) == ROWS
        assert wal.stat().st_size > db.WAL_LIMIT_BYTES  # what the two transactions wrote
        await store.writer.run(one_row)
        assert wal.stat().st_size <= db.WAL_LIMIT_BYTES


def one_row(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO changes (kind, cid, key, at) VALUES ('claim', 'c', 'title', 0)")


X, Y = (cids.midhash_bytes(f"schema v3 {n}".encode()) for n in "XY")


async def fill_v3(node: Node, one: Signer, two: Signer) -> None:
    """Two signers' claims on two CIDs, a link vote joining them, a tombstone and a replaced
    claim."""
    await node.add_signer(one.uid, "one", 1, False)
    await node.add_signer(two.uid, "two", 2, True)
    batches = [
        [one.claim(X, "title", "a"), two.claim(Y, "title", "b")],
        [two.claim(X, f"cids/{Y}", "true"), one.claim(Y, "year", "1999")],
        [one.claim(Y, "year", None, ts=NOW_MS + 1)],  # a tombstone replaces "1999"
        [one.claim(X, "title", "c", ts=NOW_MS + 1)],  # replaces "a": to the end of the log
    ]
    for batch in batches:
        assert (await node.ingest({"claims": batch})).status == 200


OLD_TABLES = ("signers", "rids", "cid_group", "claims", "changes", "box", "peer_tokens", "peers")


def to_version(source: Path, dest: Path, version: int) -> None:
    """Copy the truth at `source` into a new truth at `dest` built to an older schema `version`
    (what an older metanode made): every row by the columns both have (v4's `claims` is a view
    of the old shape), the log seqs, the log id and the outbox counter."""
    db.migrate_file(dest, truth.MIGRATIONS[:version])
    into = sqlite3.connect(dest, isolation_level=None)
    try:
        into.execute("ATTACH DATABASE ? AS source", (str(source),))
        into.execute("BEGIN")
        into.execute("DELETE FROM box")
        for table in OLD_TABLES:
            mine = {r[1] for r in into.execute(f"PRAGMA main.table_info({table})")}
            theirs = [r[1] for r in into.execute(f"PRAGMA source.table_info({table})")]
            columns = ", ".join(c for c in theirs if c in mine)
            into.execute(
                f"INSERT INTO main.{table} ({columns}) SELECT {columns} FROM source.{table}"
            )
        into.execute(
            "UPDATE main.sqlite_sequence SET seq = "
            "(SELECT seq FROM source.sqlite_sequence WHERE name = 'changes') WHERE name = 'changes'"
        )
        into.execute("COMMIT")
    finally:
        into.close()


def claims_indexes(path: Path, table: str = "claims") -> set[str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", (table,)
        )
        return {r[0] for r in rows}
    finally:
        conn.close()


def column_types(path: Path, table: str) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        return {r[1]: r[2] for r in conn.execute(f"PRAGMA table_info({table})")}
    finally:
        conn.close()


async def started(settings: Settings) -> Node:
    """A started node whose cache is built (reads need it)."""
    node = Node(settings)
    await node.start()
    assert await node.applier.wait_for(0, 60)
    return node


def log_of(node: Node) -> dict[str, object]:
    return node.claims_log(None, 100, None)


V4_CLAIM_ROWS = {
    "log_seq": "INTEGER",
    "signer": "INTEGER",
    "cid_id": "INTEGER",
    "key": "TEXT",
    "value": "TEXT",
    "ts": "INTEGER",
    "sig": "BLOB",
}
V4_CID_GROUP = {"id": "INTEGER", "cid": "TEXT", "rid": "TEXT"}
# What each older schema keyed the claims by: v2 by (uid, cid, key) and (cid, key), v3 by log seq.
OLD_INDEXES = {2: "claims_cid_key", 3: "claims_claim"}


@pytest.mark.parametrize("version", sorted(OLD_INDEXES))
async def test_an_older_truth_db_keeps_every_claim_and_its_log_order(
    tmp_path: Path, version: int
) -> None:
    """A v2 or v3 truth.db made by a real node (two signers, a link vote, a tombstone, a replaced
    claim) migrates to v4: every claim, the log order and cursor, the documents, `check` clean,
    and the claims name their signer and CID by integer id."""
    one, two = Signer(), Signer()
    made = await started(settings_for(tmp_path / "made"))
    await fill_v3(made, one, two)
    claims: set[Claim] = set(made.truth.claims())
    log, document = log_of(made), made.meta(X)
    await made.stop()
    old = settings_for(tmp_path / "old")
    old.data_dir.mkdir(mode=0o700)
    shutil.copytree(made.settings.keys_dir, old.keys_dir)  # the truth's own keys go with it
    to_version(made.settings.truth_path, old.truth_path, version)
    assert pragma(old.truth_path, "user_version") == version
    assert OLD_INDEXES[version] in claims_indexes(old.truth_path)

    node = await started(old)  # no cache.db: built from the migrated truth at start
    try:
        assert pragma(old.truth_path, "user_version") == len(truth.MIGRATIONS) == 5
        assert claims_indexes(old.truth_path, "claim_rows") == {"claims_claim", "claims_signer"}
        assert column_types(old.truth_path, "claim_rows") == V4_CLAIM_ROWS
        assert column_types(old.truth_path, "signers")["id"] == "INTEGER"
        assert column_types(old.truth_path, "cid_group") == V4_CID_GROUP
        assert set(node.truth.claims()) == claims and len(claims) == 4
        assert log_of(node) == log  # the same claims, seqs and cursor (the log id is kept)
        assert [c["value"] for c in log["claims"]][-1] == "c"  # type: ignore[index]
        assert node.meta(X) == document
        newer = two.claim(Y, "title", "d", ts=NOW_MS + 1)
        assert (await node.ingest({"claims": [newer]})).status == 200
        after = node.claims_log(log["next"], 100, None)  # type: ignore[arg-type]
        assert [c["value"] for c in after["claims"]] == ["d"]
        assert len(log_of(node)["claims"]) == 4  # type: ignore[arg-type]
    finally:
        await node.stop()
    report = maintenance.check(old, tmp_path / "scratch.db")
    assert report.clean and report.claims_checked == 4, report


def test_a_v2_claim_without_a_log_seq_joins_the_end_of_the_log(tmp_path: Path) -> None:
    path = tmp_path / "truth.db"
    db.migrate_file(path, truth.MIGRATIONS[:2])
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO signers (uid, added_at) VALUES ('u', 0)")
    conn.execute("INSERT INTO rids (rid, minted_at) VALUES (?, 0)", ("0" * 26,))
    conn.execute("INSERT INTO cid_group (cid, rid) VALUES ('c', ?)", ("0" * 26,))
    rows = [("k1", 7), ("k2", None), ("k3", 3)]
    conn.executemany(
        "INSERT INTO claims (uid, cid, key, value, ts, sig, log_seq) "
        "VALUES ('u', 'c', ?, 'v', 1, zeroblob(64), ?)",
        rows,
    )
    conn.close()
    db.migrate_file(path, truth.MIGRATIONS)
    conn = sqlite3.connect(path)
    try:
        log = conn.execute("SELECT key, log_seq FROM claims ORDER BY log_seq").fetchall()
    finally:
        conn.close()
    assert log == [("k3", 3), ("k1", 7), ("k2", 8)]


def builds_a_list(conn: sqlite3.Connection) -> bool:
    """Whether the outbox INSERT's program builds an ephemeral table (an `IN` list) each run."""
    program = conn.execute("EXPLAIN " + truth.OUTBOX_INSERT, ("claim",) + (None,) * 5 + (0,))
    return any(row[1] == "OpenEphemeral" for row in program)


@pytest.mark.parametrize("left", [2, 0])
def test_v5_keeps_the_outbox_and_its_counter_and_checks_kinds_without_a_list(
    tmp_path: Path, left: int
) -> None:
    """A v4 truth whose outbox was pruned (to 2 rows, or to none) migrates to v5 with the rows
    left and the AUTOINCREMENT counter: the next row takes the seq after the highest ever given,
    never a pruned one again. The CHECK still refuses an unknown kind, and the outbox INSERT no
    longer builds its `IN` list into a table every run (2 µs a row, benchmarks.md)."""
    path = tmp_path / "truth.db"
    db.migrate_file(path, truth.MIGRATIONS[:4])
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert builds_a_list(conn)
        conn.executemany(
            truth.OUTBOX_INSERT, [("claim", None, f"c{n}", "title", "u", None, n) for n in range(5)]
        )
        conn.execute("DELETE FROM changes WHERE seq <= ?", (5 - left,))
    finally:
        conn.close()
    db.migrate_file(path, truth.MIGRATIONS)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert pragma(path, "user_version") == 5
        assert not builds_a_list(conn)
        rows = conn.execute("SELECT seq, kind, cid, at FROM changes ORDER BY seq").fetchall()
        assert rows == [(n + 1, "claim", f"c{n}", n) for n in range(5 - left, 5)]
        assert truth.max_seq(conn) == 5
        conn.execute(truth.OUTBOX_INSERT, ("group", "r", "c5", None, None, None, 5))
        assert truth.max_seq(conn) == 6
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute(truth.OUTBOX_INSERT, ("bogus", None, None, None, None, None, 6))
    finally:
        conn.close()
