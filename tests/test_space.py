"""truth.db gives the space of its pruned outbox back (incremental vacuum): a new truth.db is
made incremental, an older one is switched at its first open with its data intact, and pruning
the outbox shrinks the file to the claims and a small reserve."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from metanode import db, truth
from tests.helpers.claims import NOW_MS

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


def test_an_older_truth_db_is_switched_at_open_with_its_rows_intact(tmp_path: Path) -> None:
    path = tmp_path / "truth.db"
    db.migrate_file(path, truth.MIGRATIONS)  # as an older metanode made it: no auto_vacuum
    assert pragma(path, "auto_vacuum") == 0
    conn = db.connect(path)
    db.run_txn(conn, fill_outbox)
    conn.close()
    with truth.TruthStore(path).open() as store:
        assert store.max_seq() == ROWS
    assert pragma(path, "auto_vacuum") == db.INCREMENTAL
    with truth.TruthStore(tmp_path / "new.db").open():
        pass
    assert pragma(tmp_path / "new.db", "auto_vacuum") == db.INCREMENTAL


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
