"""Where a CID's rendered document lives: cache schema v6 against v7, time and bytes a new CID.

Run: `.venv/bin/python tools/bench/cache_layout.py [--held 200000] [--cids 50000] [--batch 100]`.

Two real cache.db files in a temporary directory (`db.connect`: WAL, `synchronous=FULL`, as
the node's), one migrated to schema v6 and one to v7 (`cache.MIGRATIONS`). Each first holds
`--held` CIDs (random midhashes, ten a record, each with a ≈ 150-byte body), then `--cids` new
ones are written `--batch` a transaction with the statements the applier runs for a new CID:
v6 upserts the `cid_index` row and then the `documents` row; v7 upserts the `cid_index` row
and then sets its `body` (`cache.refresh`, `cache.render_documents`). Printed: µs of wall time
and of this thread's CPU a new CID, and bytes a CID after a checkpoint, v7 ÷ v6 of the same
run (the baseline).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from metanode import cache, db
from metanode import cid as cids

BODY = b'{"rid":"01M8TVHKZQEM6B8W3PZ187TWZP","metadata":{"title":"A title"},"files":[]}' * 2
INDEX = (
    "INSERT INTO cid_index (cid, rid) VALUES (?, ?) ON CONFLICT (cid) "
    "DO UPDATE SET rid = excluded.rid"
)
Rows = Sequence[tuple[str, str]]


def write_v6(conn: db.Connection, rows: Rows) -> None:
    conn.executemany(INDEX, rows)
    conn.executemany(
        "INSERT INTO documents (cid, body) VALUES (?, ?) ON CONFLICT (cid) DO UPDATE SET "
        "body = excluded.body WHERE documents.body IS DISTINCT FROM excluded.body",
        [(cid, BODY) for cid, _ in rows],
    )


def write_v7(conn: db.Connection, rows: Rows) -> None:
    conn.executemany(INDEX, rows)
    conn.executemany(
        "UPDATE cid_index SET body = ? WHERE cid = ? AND body IS DISTINCT FROM ?",
        [(BODY, cid, BODY) for cid, _ in rows],
    )


SCHEMAS: dict[str, tuple[int, Callable[[db.Connection, Rows], None]]] = {
    "v6": (6, write_v6),
    "v7": (7, write_v7),
}


def new_rows(n: int, first: int) -> list[tuple[str, str]]:
    return [
        (cids.midhash_bytes(os.urandom(32)), f"01M8TV{(first + i) // 10:020d}") for i in range(n)
    ]


def measure(path: Path, schema: str, held: int, n: int, batch: int) -> tuple[float, float, float]:
    """(wall µs, CPU µs, bytes) a new CID on a cache of `schema` holding `held` CIDs."""
    version, write = SCHEMAS[schema]
    conn = db.connect(path)
    try:
        db.migrate(conn, cache.MIGRATIONS[:version])
        conn.execute("BEGIN IMMEDIATE")
        write(conn, new_rows(held, 0))
        conn.execute("COMMIT")
        rows = new_rows(n, held)
        wall, cpu = time.perf_counter(), time.thread_time()
        for first in range(0, n, batch):
            conn.execute("BEGIN IMMEDIATE")
            write(conn, rows[first : first + batch])
            conn.execute("COMMIT")
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return wall / n * 1e6, cpu / n * 1e6, path.stat().st_size / (held + n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--held", type=int, default=200_000)
    parser.add_argument("--cids", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args(argv)
    if args.held < 0 or args.cids < 1 or args.batch < 1:
        parser.error("need --held >= 0, --cids >= 1 and --batch >= 1")
    with tempfile.TemporaryDirectory(prefix="metanode-layout-") as tmp:
        figures = {
            schema: measure(Path(tmp) / f"{schema}.db", schema, args.held, args.cids, args.batch)
            for schema in SCHEMAS
        }
    base = figures["v6"]
    print(f"{args.held:,} CIDs held, {args.cids:,} new, {args.batch} a transaction, WAL, FULL")
    for schema, (wall, cpu, size) in figures.items():
        print(
            f"  {schema}  {wall:5.1f} µs a new CID ({wall / base[0]:.2f} of v6)  "
            f"CPU {cpu:5.1f} µs ({cpu / base[1]:.2f})  {size:5.0f} B a CID ({size / base[2]:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
