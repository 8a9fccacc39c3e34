"""Truth schema v3 → v4 (signers and CIDs by integer id): bytes a claim per B-tree, and how long
the migration takes.

Run: `.venv/bin/python tools/bench/truth_v4.py [--records 20000] [--keys 1] [--signers 2]`.

A v3 truth.db (`truth.MIGRATIONS[:3]`) is generated straight in SQL in a temporary directory:
`--records` records, each its own CID (62 characters, as a midhash CID) in its own group, with
`--keys` claims each (one signer per key, 48-character uids, 64-byte signatures), in log order.
It is VACUUMed and measured with `dbstat` (bytes a claim per table and index): the baseline.
Then the v4 migration (`truth._v4`, one transaction, as `metanode serve` runs it at start) is
timed, and the file VACUUMed and measured again. Printed: each B-tree's bytes a claim before and
after, the totals and their ratio (v4 ÷ v3), and the migration's seconds.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

from metanode import db, truth


def generate(path: Path, records: int, keys: int, signers: int) -> None:
    """A v3 truth of `records` one-group records of `keys` claims each, written in SQL."""
    db.migrate_file(path, truth.MIGRATIONS[:3])
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO signers (uid, added_at) VALUES ('z6Mk' || substr(lower(hex(randomblob(22))),"
        " 1, 44), ?)",
        [(n,) for n in range(signers)],
    )
    uids = [r[0] for r in conn.execute("SELECT uid FROM signers ORDER BY uid")]
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
        "INSERT INTO rids (rid, minted_at) SELECT printf('%026d', i), 0 FROM n",
        (records,),
    )
    conn.execute(
        "INSERT INTO cid_group (cid, rid) SELECT 'b' || substr(lower(hex(randomblob(31))), 1, 61),"
        " rid FROM rids"
    )
    conn.execute(
        "CREATE TEMP TABLE ks AS WITH RECURSIVE k(j) AS (SELECT 0 UNION ALL SELECT j + 1 FROM k "
        "WHERE j < ? - 1) SELECT j, 'k' || j AS key FROM k",
        (keys,),
    )
    conn.execute("CREATE TEMP TABLE us (j INTEGER PRIMARY KEY, uid TEXT)")
    conn.executemany(
        "INSERT INTO us VALUES (?, ?)", [(j, uids[j % len(uids)]) for j in range(keys)]
    )
    conn.execute(
        "INSERT INTO claims (uid, cid, key, value, ts, sig, log_seq) "
        "SELECT us.uid, g.cid, ks.key, 'a value', 1700000000000, randomblob(64), "
        "row_number() OVER (ORDER BY g.rid, ks.j) "
        "FROM cid_group g CROSS JOIN ks JOIN us ON us.j = ks.j ORDER BY g.rid, ks.j"
    )
    conn.execute("COMMIT")
    conn.close()


def btrees(path: Path) -> dict[str, int]:
    """VACUUM the file, then bytes on disk of each table and index (`dbstat`)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("VACUUM")
        rows = conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC")
        return {name: int(size) for name, size in rows}
    finally:
        conn.close()


def show(label: str, sizes: dict[str, int], claims: int) -> int:
    total = sum(sizes.values())
    parts = " · ".join(f"{n} {s / claims:.1f}" for n, s in sizes.items() if s / claims >= 0.5)
    print(f"{label}: {total / claims:.1f} B a claim ({parts})")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1)
    parser.add_argument("--signers", type=int, default=2)
    args = parser.parse_args()
    claims = args.records * args.keys
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "truth.db"
        generate(path, args.records, args.keys, args.signers)
        before = show("v3", btrees(path), claims)
        conn = db.connect(path)
        started = time.perf_counter()
        db.migrate(conn, truth.MIGRATIONS)
        took = time.perf_counter() - started
        conn.close()
        after = show("v4", btrees(path), claims)
    print(
        f"ratio {after / before:.2f} (v4 ÷ v3); migration v3 → v4 of {claims:,} claims in "
        f"{args.records:,} records: {took:.1f} s"
    )


if __name__ == "__main__":
    main()
