"""Space benchmark: truth.db bytes per claim after ingest and outbox pruning, against the least
the same claims take.

Run: `.venv/bin/python tools/bench/space.py [--claims 100000] [--batch 500]`.

A fresh data directory; `metanode serve` (one process, `feed_prune_s` `--prune-s`: at the
default 60 s a fast ingest piles up its outbox before retention runs); one signer; `--claims`
claims (key `title`, each about its own fresh midhash CID, so each makes a record, a group and
two outbox rows) posted in batches of `--batch`. Then
the bench waits until the outbox is empty, stops the server (its last checkpoint folds the WAL
into the file) and measures truth.db. Baseline, same run: a copy of that truth.db with the
outbox emptied and a full `VACUUM` — the least the same claims take in this schema. Reported:
bytes per claim of each, and the ratio (1.0: nothing wasted), with `PRAGMA freelist_count`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import harness
import nacl.signing

from metanode import cid as cids
from metanode import claims
from metanode.clock import now_ms


def outbox_rows(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM changes").fetchone()[0])
    finally:
        conn.close()


def least(path: Path, into: Path) -> int:
    """Bytes of a copy of `path` with no outbox rows, fully vacuumed."""
    shutil.copyfile(path, into)
    conn = sqlite3.connect(into, isolation_level=None)
    try:
        conn.execute("DELETE FROM changes")
        conn.execute("VACUUM")
    finally:
        conn.close()
    return into.stat().st_size


def pragma(path: Path, name: str) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(conn.execute(f"PRAGMA {name}").fetchone()[0])
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--claims", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument(
        "--prune-s", default="60", help="feed_prune_s of the server (default 60, the setting's)"
    )
    args = parser.parse_args(argv)
    key = nacl.signing.SigningKey.generate()
    ts = now_ms()
    signed = [
        claims.sign(key, cids.midhash_bytes(os.urandom(32)), "title", f"title {i}", ts)
        for i in range(args.claims)
    ]
    bodies = [
        harness.claims_body(signed[i : i + args.batch]) for i in range(0, len(signed), args.batch)
    ]
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        truth_db = data_dir / "truth.db"
        with harness.metanode_server(
            data_dir, METANODE_FEED_PRUNE_S=args.prune_s, METANODE_PLUGINS_ENABLED="false"
        ) as server:
            harness.register_signer(server, data_dir, key)
            start = time.perf_counter()
            harness.post_all(server, data_dir, bodies)
            print(f"ingested {args.claims:,} claims in {time.perf_counter() - start:.1f} s")
            deadline = time.monotonic() + 3 * float(args.prune_s) + 60
            while outbox_rows(truth_db) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = outbox_rows(truth_db)
        size = truth_db.stat().st_size
        floor = least(truth_db, Path(tmp) / "least.db")
        free = pragma(truth_db, "freelist_count")
        mode = pragma(truth_db, "auto_vacuum")
    print(
        f"truth.db: {size:,} bytes = {size / args.claims:.0f} B a claim "
        f"(outbox rows left {left}, free pages {free}, auto_vacuum {mode})"
    )
    print(f"least (no outbox, VACUUM): {floor:,} bytes = {floor / args.claims:.0f} B a claim")
    print(f"ratio {size / floor:.2f} (1.0: nothing wasted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
