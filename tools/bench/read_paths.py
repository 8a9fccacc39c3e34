"""Read paths benchmark: which read goes on the event loop and which through aiosqlite.

Run: `.venv/bin/python tools/bench/read_paths.py [--records 10000] [--reads 20000] [--rounds 5]`.

A cache.db of `--records` records (two signed keys and a `cids/…` key each: signed claims written
through `TruthStore`, the cache built by `maintenance.rebuild_cache`, in a temporary directory),
read in-process:

1. **Paged snapshot** of every record, 500 rows a page, as `feed.Snapshot` reads it:
   * `aiosqlite`: what the code does, `CacheStore.records_reading` (a `cache.Reading`: its own
     read-only aiosqlite connection, `BEGIN`, the state, then `fetchmany` pages, then `close`);
   * baseline `off_loop (old)`: the implementation it replaced, kept in this file only for this
     comparison (`OldReading`, `old_off_loop`: a `sqlite3` read-only connection whose pages are
     fetched by `asyncio.to_thread`, a cancellation held back until the fetch has returned);
   * `on the loop`: the same pages fetched on the event loop, for the stall it would cause.
   Reported: ms per snapshot (median over rounds, variants alternating), the ratio aiosqlite ÷
   old, and the longest the event loop went without running a 1 ms ticker meanwhile.
2. **Primary-key read**, what GET /api/meta does: one `SELECT key, value FROM records WHERE
   rid = ?` of a random known rid, `--reads` times one after the other, on a plain read-only
   connection on the loop (`db.connect`, as `CacheStore` holds one) against the same statement
   through an aiosqlite connection (`db.connect_reader`). Reported: µs per read and the ratio.
3. **Feed page**, what `feed.Hub` reads once per page for every subscriber: 500 rows of a
   table by key range (here `records` by rid, 500 rows), on the loop against through aiosqlite.

Ratios are of medians in the same run; absolute figures move with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import harness
import nacl.signing

from metanode import cache, claims, config, db, maintenance, rid, truth
from metanode import cid as cids
from metanode.clock import now_ms

PAGE = 500
T = TypeVar("T")
PK_READ = "SELECT key, value FROM records WHERE rid = ?"
RANGE_READ = "SELECT rid, key, value FROM records WHERE rid >= ? ORDER BY rid, key LIMIT ?"


# -- the replaced implementation, for the comparison only ----------------------------------------


async def old_off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`db.off_loop` as it was before aiosqlite: `fn(*args)` on a worker thread; a cancellation
    is held back until `fn` has returned (the loop: anyio cancels again at every await)."""
    running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while not running.done():
        try:
            await asyncio.wait([running])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        running.exception()
        raise asyncio.CancelledError
    return running.result()


class OldReading:
    """`cache.Reading` as it was before aiosqlite (sqlite3 connection, pages by `old_off_loop`)."""

    def __init__(self, path: Path) -> None:
        self._conn = db.connect(path, readonly=True)
        self._conn.execute("BEGIN")
        self.state = cache.read_state(self._conn)
        self._rows = self._conn.execute(*cache.records_in_order())

    async def rows(self) -> list[Any]:
        return await old_off_loop(self._rows.fetchmany, PAGE)

    async def rows_on_loop(self) -> list[Any]:
        """The same page fetched on the event loop (the stall the off-loop paths avoid)."""
        return self._rows.fetchmany(PAGE)

    def close(self) -> None:
        self._rows.close()
        self._conn.close()


# -- building the data --------------------------------------------------------------------------


def build(data_dir: Path, records: int) -> list[str]:
    """truth.db and cache.db with `records` records × 2 keys; returns the records' rids."""
    settings = config.load(env={}, overrides={"data_dir": data_dir})
    maintenance.open_store(settings)
    key = nacl.signing.SigningKey.generate()
    uid = claims.uid_of(bytes(key.verify_key))
    ts = now_ms()
    with truth.TruthStore(settings.truth_path, lambda: ts) as store:
        store.add_signer_sync(uid, "bench", 1, False)
        minter, policy = rid.Minter(), truth.Policy()
        for first in range(0, records, 1000):
            batch = [
                claims.sign(key, cid, name, f"{name} of record {i}", ts)
                for i in range(first, min(records, first + 1000))
                for cid in [cids.midhash_bytes(os.urandom(32))]
                for name in ("title", "year")
            ]
            store.ingest_sync(batch, minter, policy, ts)
    maintenance.rebuild_cache(settings)
    with cache.CacheStore(settings.cache_path) as store:
        return store.all_rids()


# -- measuring ----------------------------------------------------------------------------------


async def snapshot_aiosqlite(store: cache.CacheStore) -> int:
    reading = await store.records_reading((), PAGE)
    try:
        return await count_pages(reading.rows)
    finally:
        await reading.close()


async def snapshot_old(path: Path) -> int:
    reading = OldReading(path)
    try:
        return await count_pages(reading.rows)
    finally:
        reading.close()


async def snapshot_on_loop(path: Path) -> int:
    reading = OldReading(path)
    try:
        return await count_pages(reading.rows_on_loop)
    finally:
        reading.close()


async def count_pages(page: Callable[[], Awaitable[list[Any]]]) -> int:
    total = 0
    while rows := await page():
        total += len(rows)
    return total


async def timed(work: Callable[[], Awaitable[int]], expect: int) -> tuple[float, float]:
    """(ms, worst loop stall in ms) of one run of `work`, which must return `expect`."""
    started = time.perf_counter()
    got, stall = await harness.max_stall_ms(work())
    elapsed = (time.perf_counter() - started) * 1e3
    if got != expect:
        raise RuntimeError(f"read {got} rows, expected {expect}")
    return elapsed, stall


async def snapshots(store: cache.CacheStore, rows: int, rounds: int) -> None:
    path = store.path
    assert isinstance(path, Path), "the read paths are SQLite's"
    variants: dict[str, Callable[[], Awaitable[int]]] = {
        "off_loop (old)": lambda: snapshot_old(path),
        "aiosqlite": lambda: snapshot_aiosqlite(store),
        "on the loop": lambda: snapshot_on_loop(path),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    stalls: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for n in range(rounds + 1):  # round 0 warms the page cache
        for name in names if n % 2 else names[::-1]:
            ms, stall = await timed(variants[name], rows)
            if n:
                times[name].append(ms)
                stalls[name].append(stall)
    print(f"paged snapshot of {rows:,} rows ({PAGE} a page), median of {rounds}:")
    for name in names:
        print(
            f"  {name:15} {statistics.median(times[name]):8.1f} ms   "
            f"longest loop stall {statistics.median(stalls[name]):6.1f} ms"
        )
    ratio = statistics.median(times["aiosqlite"]) / statistics.median(times["off_loop (old)"])
    print(f"  ratio aiosqlite ÷ off_loop (old) time: {ratio:.2f}")


async def per_read(
    reads: int,
    rounds: int,
    name: str,
    loop_read: Callable[[], Any],
    async_read: Callable[[], Awaitable[Any]],
) -> None:
    """µs per read, one after the other, on the loop against through aiosqlite."""
    on_loop: list[float] = []
    through: list[float] = []
    for n in range(rounds + 1):
        order = [True, False] if n % 2 else [False, True]
        for loop_first in order:
            started = time.perf_counter()
            if loop_first:
                for _ in range(reads):
                    loop_read()
            else:
                for _ in range(reads):
                    await async_read()
            us = (time.perf_counter() - started) / reads * 1e6
            if n:
                (on_loop if loop_first else through).append(us)
    loop_us, aio_us = statistics.median(on_loop), statistics.median(through)
    print(f"{name}, {reads:,} reads one after the other, median of {rounds}:")
    print(f"  on the loop (sqlite3)   {loop_us:8.1f} µs")
    print(f"  through aiosqlite       {aio_us:8.1f} µs")
    print(f"  ratio aiosqlite ÷ loop: {aio_us / loop_us:.2f}")


async def run(args: argparse.Namespace, data_dir: Path) -> None:
    rids = build(data_dir, args.records)
    path = data_dir / "cache.db"
    rows = await snapshot_on_loop(path)  # every variant must read these many
    print(f"{len(rids):,} records, {rows:,} record rows; Python {sys.version.split()[0]}")
    with cache.CacheStore(path) as store:
        await snapshots(store, rows, args.rounds)
    loop_conn = db.connect(path, readonly=True)
    aio_conn = await db.connect_reader(path)
    try:
        pick = random.Random(1).choice
        await per_read(
            args.reads,
            args.rounds,
            "primary-key read (GET /api/meta's SELECT)",
            lambda: loop_conn.execute(PK_READ, (pick(rids),)).fetchall(),
            lambda: aio_conn.execute_fetchall(PK_READ, (pick(rids),)),
        )
        await per_read(
            max(1, args.reads // 100),
            args.rounds,
            f"a page of {PAGE} rows (feed.Hub's read)",
            lambda: loop_conn.execute(RANGE_READ, (pick(rids), PAGE)).fetchall(),
            lambda: aio_conn.execute_fetchall(RANGE_READ, (pick(rids), PAGE)),
        )
    finally:
        loop_conn.close()
        await aio_conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--reads", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args, Path(tmp) / "data"))


if __name__ == "__main__":
    main()
