"""Claims table layouts: bytes and insert time a claim, truth schema v2 against v3 (and one more).

Run: `.venv/bin/python tools/bench/claims_layout.py [--claims 50000] [--batch 100]`.

The claims table alone, in plain SQLite files in a temporary directory (WAL, `synchronous=FULL`,
as metanode's connections): `--claims` one-claim records (key `title`, each about its own random
CID, one signer) upserted with the statement shape `truth._store` uses, `--batch` claims a
transaction; then one claim replaced (its log seq moves: the upsert must work on each layout),
the WAL checkpointed and the file measured. Layouts:

* `v2`: `WITHOUT ROWID`, primary key (uid, cid, key), index (cid, key), unique index (log_seq)
  (the baseline: what truth.db held until schema v3);
* `v3`: a rowid table keyed by `log_seq`, unique (cid, key, uid), index (uid, log_seq) (schema
  v3, `truth.SCHEMA_V3`);
* `v3 + signer ids`: v3 with the signer as an integer id instead of its 48-character uid (not
  built: the next step for space, docs/benchmarks.md "Claims keyed by their log seq").

Printed: bytes and µs a claim (the COMMITs' share beside it), each ÷ v2's of the same run.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from metanode import cid as cids

COLUMNS = "cid, key, value, ts, sig, log_seq"
UPDATE = "value = excluded.value, ts = excluded.ts, sig = excluded.sig, log_seq = excluded.log_seq"
LAYOUTS = {
    "v2": (
        "uid TEXT",
        "uid TEXT NOT NULL, cid TEXT NOT NULL, key TEXT NOT NULL, value TEXT, ts INTEGER NOT NULL,"
        " sig BLOB NOT NULL, log_seq INTEGER, PRIMARY KEY (uid, cid, key)) WITHOUT ROWID;"
        " CREATE INDEX claims_cid_key ON claims (cid, key);"
        " CREATE UNIQUE INDEX claims_log ON claims (log_seq",
        "(uid, cid, key)",
    ),
    "v3": (
        "uid TEXT",
        "uid TEXT NOT NULL, cid TEXT NOT NULL, key TEXT NOT NULL, value TEXT, ts INTEGER NOT NULL,"
        " sig BLOB NOT NULL, log_seq INTEGER PRIMARY KEY);"
        " CREATE UNIQUE INDEX claims_claim ON claims (cid, key, uid);"
        " CREATE INDEX claims_signer ON claims (uid, log_seq",
        "(cid, key, uid)",
    ),
    "v3 + signer ids": (
        "signer INTEGER",
        "signer INTEGER NOT NULL, cid TEXT NOT NULL, key TEXT NOT NULL, value TEXT,"
        " ts INTEGER NOT NULL, sig BLOB NOT NULL, log_seq INTEGER PRIMARY KEY);"
        " CREATE UNIQUE INDEX claims_claim ON claims (cid, key, signer);"
        " CREATE INDEX claims_signer ON claims (signer, log_seq",
        "(cid, key, signer)",
    ),
}


def measure(path: Path, layout: str, n: int, batch: int) -> tuple[float, float, float]:
    """(bytes, µs to insert, µs of it in COMMIT) a claim for `layout` in a new file `path`."""
    signer_column, body, conflict = LAYOUTS[layout]
    signer: object = 1 if signer_column.startswith("signer") else "u" + "a" * 47
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript(f"CREATE TABLE claims ({body});")
    name = signer_column.split()[0]
    upsert = (
        f"INSERT INTO claims ({name}, {COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
        f"ON CONFLICT {conflict} DO UPDATE SET {UPDATE}"
    )
    made = [cids.midhash_bytes(os.urandom(32)) for _ in range(n)]
    rows = [
        (signer, c, "title", f"title {i}", 1_700_000_000_000 + i, os.urandom(64), i + 1)
        for i, c in enumerate(made)
    ]
    committing = 0.0
    start = time.perf_counter()
    for first in range(0, n, batch):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(upsert, rows[first : first + batch])
        before = time.perf_counter()
        conn.execute("COMMIT")
        committing += time.perf_counter() - before
    spent = time.perf_counter() - start
    conn.execute(upsert, (signer, made[0], "title", "new", 1_800_000_000_000, bytes(64), n + 1))
    assert conn.execute("SELECT count(*), max(log_seq) FROM claims").fetchone() == (n, n + 1)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path.stat().st_size / n, spent / n * 1e6, committing / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--claims", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args(argv)
    if args.claims < 1 or args.batch < 1:
        parser.error("need --claims >= 1 and --batch >= 1")
    with tempfile.TemporaryDirectory(prefix="metanode-layout-") as tmp:
        figures = {
            layout: measure(Path(tmp) / f"{n}.db", layout, args.claims, args.batch)
            for n, layout in enumerate(LAYOUTS)
        }
    base_bytes, base_us, _ = figures["v2"]
    print(f"{args.claims:,} claims, {args.batch} a transaction, WAL, synchronous=FULL")
    for layout, (size, micros, commit) in figures.items():
        print(
            f"  {layout:16s} {size:6.0f} B a claim ({size / base_bytes:.2f} of v2)   "
            f"insert {micros:5.1f} µs a claim ({micros / base_us:.2f} of v2; COMMIT {commit:.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
