"""Counted plugin runs (cache schema 10): what `GET /api/plugins` and `/metrics` read, and what
the triggers that keep the counts cost the plugin host's writes, each against a baseline
measured in the same run.

Run: `.venv/bin/python tools/bench/plugin_counts.py [--runs 500000] [--writes 20000]`.

Two real cache.db files of `--runs` runs of five plugins (a fifth of them skipped with one of
three reasons, a few failed): one at schema 9 (no counts: the baseline), one at this schema.

* read: `cache.run_counts` (the counts table) against the scan schema 9 made of every run
  (the same GROUP BY as before), 5 rounds each, alternating; medians.
* write: `--writes` runs finished (`finish_run_txn`, 100 a transaction, as the host commits
  them) on either file, alternating in blocks; the ratio is µs a finished run with the
  triggers ÷ without.
* insert: the one transaction that puts the runs in, with the triggers and without (a first
  start queues a run per file and plugin in one statement).
* migrate: the time of schema 10's migration (counting the runs once) on a schema 9 copy.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from metanode import cache, db

PLUGINS = ("fullhash", "fileinfo", "filename", "mediainfo", "nfo")
REASONS = ("skipped: ffprobe not found", "skipped: refused", "skipped: too large")
# schema 9's read of the counts: every run, grouped
SCAN = (
    "SELECT plugin, version, CASE WHEN status = 'done' AND error IS NOT NULL THEN 'skipped' "
    "ELSE status END AS shown, CASE WHEN status = 'done' THEN error END AS reason, count(*) "
    "FROM plugin_runs GROUP BY plugin, version, shown, reason"
)


def build(path: Path, runs: int, version: int) -> float:
    """A cache.db at schema `version` holding `runs` runs (pending ones left for the writes);
    the seconds their one insert transaction took (a first start queues a run per file and
    plugin so, `enqueue_runs_txn`)."""
    conn = db.connect(path)
    try:
        db.migrate(conn, cache.MIGRATIONS[:version])
        rows = []
        for n in range(runs):
            plugin = PLUGINS[n % len(PLUGINS)]
            status, error = ("done", None)
            if n % 5 == 0:
                status, error = "done", REASONS[n % 3]
            elif n % 97 == 0:
                status, error = "failed", "boom"
            elif n % 11 == 0:
                status = "pending"
            rows.append((plugin, "1", f"m{n:09d}", status, error))
        started = time.perf_counter()
        db.run_txn(
            conn,
            lambda c: c.executemany(
                "INSERT INTO plugin_runs (plugin, version, midhash, status, error, updated_at) "
                "VALUES (?, ?, ?, ?, ?, 1)",
                rows,
            ),
        )
        return time.perf_counter() - started
    finally:
        conn.close()


def read_ms(path: Path, counted: bool) -> float:
    conn = db.connect(path)
    try:
        started = time.perf_counter()
        if counted:
            cache.run_counts(conn, 3)
        else:
            conn.execute(SCAN).fetchall()
        return (time.perf_counter() - started) * 1000
    finally:
        conn.close()


def finish_us(path: Path, count: int) -> float:
    """µs a run finished: `count` pending runs marked done, 100 a transaction."""
    conn = db.connect(path)
    try:
        pending = conn.execute(
            "SELECT plugin, version, midhash, updated_at FROM plugin_runs "
            "WHERE status = 'pending' ORDER BY midhash LIMIT ?",
            (count,),
        ).fetchall()
        started = time.perf_counter()
        for at in range(0, len(pending), 100):
            chunk = pending[at : at + 100]

            def txn(c: db.Connection, chunk: list[tuple[str, str, str, int]] = chunk) -> None:
                for plugin, version, midhash, updated in chunk:
                    run = cache.PluginRun(plugin, version, midhash, 0, updated)
                    cache.finish_run_txn(c, run, "done", 1, 0, None, 2)

            db.run_txn(conn, txn)
        return (time.perf_counter() - started) * 1e6 / max(1, len(pending))
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=500_000)
    parser.add_argument("--writes", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old, new = Path(tmp, "v9.db"), Path(tmp, "v10.db")
        plain_s = build(old, args.runs, 9)
        shutil.copy(old, Path(tmp, "migrated.db"))
        conn = db.connect(Path(tmp, "migrated.db"))
        started = time.perf_counter()
        db.migrate(conn, cache.MIGRATIONS)
        migrate_s = time.perf_counter() - started
        conn.close()
        counted_s = build(new, args.runs, len(cache.MIGRATIONS))
        scans, counts = [], []
        for _ in range(5):
            scans.append(read_ms(old, False))
            counts.append(read_ms(new, True))
        scan, counted = statistics.median(scans), statistics.median(counts)
        print(f"runs: {args.runs:,}")
        print(f"read: scan {scan:.1f} ms, counted {counted:.3f} ms, ratio {counted / scan:.4f}")
        without, with_ = [], []
        block = args.writes // 4
        for _ in range(4):
            without.append(finish_us(old, block))
            with_.append(finish_us(new, block))
        plain, triggered = statistics.median(without), statistics.median(with_)
        print(
            f"write: {plain:.1f} µs a finished run without counts, {triggered:.1f} with, "
            f"ratio {triggered / plain:.2f}"
        )
        print(
            f"insert: {args.runs:,} runs in one transaction {plain_s:.2f} s without counts, "
            f"{counted_s:.2f} s with, ratio {counted_s / plain_s:.2f}"
        )
        print(f"migrate: schema 10 counted {args.runs:,} runs in {migrate_s:.2f} s")


if __name__ == "__main__":
    main()
