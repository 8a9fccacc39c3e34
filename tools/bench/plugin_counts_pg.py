"""Counted plugin runs on PostgreSQL: what the count triggers cost a statement of many runs, in
PostgreSQL's cache schema 6 (a row trigger: one update of a count row a run) and in the
current one (statement triggers: one update a statement), each against the same schema with
its triggers dropped, in the same run (docs/benchmarks.md, "Counted plugin runs").

Run: `.venv/bin/python tools/bench/plugin_counts_pg.py [--files 8000 20000 50000] [--copy 200000]`.

A throw-away cluster of our own (`pgcluster`, `fsync=off`), one schema a measure:

* queue: `--files` files for five plugins in one transaction (`enqueue_runs_txn`: a plugin's
  new version, or plugins enabled, on a library the watcher knows);
* copy: `--copy` done runs of five plugins copied from a SQLite cache.db (`copy_local_txn`,
  what `migrate-storage` does), counted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import harness
import pgcluster

from metanode import cache, db, pg

PLUGINS = [(name, "1") for name in ("fullhash", "fileinfo", "filename", "mediainfo", "nfo")]
ROW_TRIGGERS = 6  # PostgreSQL's cache schema counting a run at a time


def timed(
    dsn: str,
    schema: str,
    migrations: Sequence[db.Migration],
    counted: bool,
    write: Callable[[db.Connection], object],
) -> float:
    """Seconds `write` took in one transaction on a new schema at `migrations`, its count
    triggers dropped first unless `counted`."""
    target = pg.Target(dsn, schema)
    db.migrate_file(target, migrations)
    conn = db.connect(target)
    try:
        if not counted:
            db.run_txn(conn, drop_triggers)
        started = time.perf_counter()
        db.run_txn(conn, write)
        return time.perf_counter() - started
    finally:
        conn.close()


def drop_triggers(conn: db.Connection) -> None:
    for (name,) in conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = CAST('plugin_runs' AS regclass) "
        "AND NOT tgisinternal"
    ).fetchall():
        conn.execute(f"DROP TRIGGER {name} ON plugin_runs")


def source_cache(path: Path, runs: int) -> db.Connection:
    """A SQLite cache.db holding `runs` done runs of the five plugins."""
    conn = db.connect(path)
    db.migrate(conn, cache.MIGRATIONS)
    db.run_txn(
        conn,
        lambda c: c.executemany(
            "INSERT INTO plugin_runs (plugin, version, midhash, status, updated_at) "
            "VALUES (?, ?, ?, 'done', 1)",
            [(*PLUGINS[n % len(PLUGINS)], f"m{n:09d}") for n in range(runs)],
        ),
    )
    return conn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--files", type=int, nargs="*", default=[8_000, 20_000, 50_000])
    parser.add_argument("--copy", type=int, default=200_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="metanode-counts-"))  # the cluster's (given to nobody)
    cluster, why = pgcluster.start_cluster(root, harness.free_port())
    if cluster is None:
        sys.exit(why)
    schemas = {"schema 6": cache.PG_MIGRATIONS[:ROW_TRIGGERS], "now": cache.PG_MIGRATIONS}
    try:
        dsn = cluster.database()
        for files in args.files:
            midhashes = [f"m{n:09d}" for n in range(files)]

            def queue(c: db.Connection, m: list[str] = midhashes) -> None:
                cache.enqueue_runs_txn(c, PLUGINS, m, 1)

            for name, migrations in schemas.items():
                tag = f"q{files}{name[-1]}"
                plain = timed(dsn, tag + "n", migrations, False, queue)
                counted = timed(dsn, tag + "c", migrations, True, queue)
                print(f"queue {files:,} files x 5, {name}: {plain:.2f} s, counted {counted:.2f} s")
        scratch = Path(tempfile.mkdtemp(prefix="metanode-counts-"))
        source = source_cache(scratch / "cache.db", args.copy)
        try:
            for name, migrations in schemas.items():
                took = timed(
                    dsn,
                    f"copy{name[-1]}",
                    migrations,
                    True,
                    lambda c: cache.copy_local_txn(c, source),
                )
                print(f"copy {args.copy:,} runs, {name}: {took:.2f} s")
        finally:
            source.close()
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
