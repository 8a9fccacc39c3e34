"""Watcher benchmark: a cold scan of 10,000 files, and a warm rescan against a bare walk.

Run: `.venv/bin/python tools/bench/scan.py [--files 10000] [--repeats 5] [--profile]`.

The tree (made once in a temporary folder, removed at the end): `--files` files in folders of
100, mostly 1-200 KiB of random bytes, 2% of 1-5 MiB, and 20 sparse files of 2-64 GiB made with
`truncate` (they read as zeros; midhash reads 1 MiB from their middle). Every file starts with
its own index, so every file has its own midhash.

1. **Cold scan.** What `metanode scan ROOT` does, in-process: a `Node` on a fresh data directory
   (watcher and plugins off) is started, `await node.scan([root])` reconciles the tree (walk,
   compare with `local_file`, midhash every file, mint a group per midhash, write `local_file`
   and the records' local keys with their feed events), then the node stops. Reported: files/s
   and MiB read (the midhash sample: min(size, 1 MiB) per file) per second. The files were just
   written, so their pages are in the page cache: this is cold for the node (empty database),
   not for the disk; dropping the page cache would disturb other work on the machine.

2. **Warm rescan.** `node.scan([root])` again with nothing changed (a started node, as the
   periodic rescan of `metanode serve` runs in a started node): a walk of the tree, the
   `local_file` rows below the root, and the comparison; nothing is hashed. The baseline is the
   least any rescan must do: a bare recursive `os.scandir` + `DirEntry.stat()` of the same tree.
   Both are timed alternately, `--repeats` times each, and the medians compared. Ratio =
   bare / rescan (goal >= 0.5: the rescan costs at most twice the bare walk).

`--profile` adds a cProfile of one warm rescan (top functions by own time).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import platform
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import harness

from metanode import config, watcher
from metanode.node import Node

PER_FOLDER = 100
SPARSE_FILES = 20
MiB = 1 << 20
GiB = 1 << 30


def make_tree(root: Path, files: int, seed: int = 5) -> tuple[int, int, int]:
    """Write the tree; returns (files, bytes on disk, bytes apparent)."""
    rng = random.Random(seed)
    pool = os.urandom(8 * MiB)  # slices of one random block: fast to write, distinct by prefix
    sparse_at = set(rng.sample(range(files), SPARSE_FILES))
    on_disk = apparent = 0
    for i in range(files):
        folder = root / f"shelf-{i // (PER_FOLDER * 10):02}" / f"folder-{i // PER_FOLDER:03}"
        if i % PER_FOLDER == 0:
            folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"file-{i:05}.bin"
        if i in sparse_at:
            size = rng.randint(2, 64) * GiB + rng.randint(0, MiB)
            with path.open("wb") as out:
                out.write(i.to_bytes(8, "big"))
                out.truncate(size)
            apparent += size
            continue
        size = (
            rng.randint(1, 5) * MiB + rng.randint(0, MiB)
            if rng.random() < 0.02
            else rng.randint(1, 200) * 1024
        )
        start = rng.randint(0, len(pool) - min(size, len(pool)))
        with path.open("wb") as out:
            out.write(i.to_bytes(8, "big"))
            left = size - 8
            while left > 0:
                chunk = pool[start : start + min(left, len(pool) - start)]
                out.write(chunk)
                left -= len(chunk)
                start = 0
        on_disk += size
        apparent += size
    return files, on_disk, apparent


def bare_walk(root: str) -> int:
    """The floor of any rescan: every entry listed and stat'ed, nothing else."""
    count = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                entry.stat()
                if entry.is_dir():
                    stack.append(entry.path)
                else:
                    count += 1
    return count


def settings_for(data_dir: Path, root: Path) -> config.Settings:
    return harness.bench_settings(data_dir, watch_roots=(str(root),), apply_poll_s=3600.0)


async def stop_quietly(node: Node) -> None:
    """Stop the node once its applier is idle.

    Works around a race in `Applier.stop` (metanode/node.py): it closes the truth read
    connection while a cancelled-but-shielded `apply_txn` may still be using it on the cache
    writer thread, which can crash the process (SIGSEGV). With `apply_poll_s` set very high the
    applier only runs when woken: wait until no wake-up is pending and the cache writer has
    finished what it was given, then stop as usual. (Cancelling the applier task ourselves is no
    way out: Python 3.11's `asyncio.wait_for` swallows a cancel that arrives just as the wake-up
    event it waits on fires, and the task then never ends.)
    """
    for _ in range(1000):
        await node.cache.drained()
        await asyncio.sleep(0.01)
        if not node.applier._wake.is_set():
            break
    await node.cache.drained()
    await node.stop()


async def cold_scan(data_dir: Path, root: Path) -> tuple[watcher.Summary, float, float]:
    """(summary, seconds of node.scan alone, seconds including node start and stop)."""
    began = time.perf_counter()
    node = Node(settings_for(data_dir, root))
    await node.start()
    await node.applier.wait_for(0, 30)
    t0 = time.perf_counter()
    summary = await node.scan([str(root)])
    scan_s = time.perf_counter() - t0
    await stop_quietly(node)
    return summary, scan_s, time.perf_counter() - began


async def warm_rounds(
    data_dir: Path, root: Path, repeats: int, profile: bool
) -> tuple[list[float], list[float], dict[str, float], str]:
    """Alternate warm rescans and bare walks; (rescan times, bare times, the rescan's parts
    timed alone, profile text)."""
    node = Node(settings_for(data_dir, root))
    await node.start()
    await node.applier.wait_for(0, 30)
    rescans: list[float] = []
    bares: list[float] = []
    parts: dict[str, float] = {}
    report = ""
    try:
        files = len(node.cache.local_stats([str(root)]))
        for _ in range(repeats):
            t0 = time.perf_counter()
            summary = await node.scan([str(root)])
            rescans.append(time.perf_counter() - t0)
            assert summary.hashed == 0 and summary.unchanged == files, summary
            t0 = time.perf_counter()
            walked = bare_walk(str(root))
            bares.append(time.perf_counter() - t0)
            assert walked == files, (walked, files)
        parts = await rescan_parts(node, str(root))
        if profile:
            report = profile_rescan(node, str(root))
    finally:
        await stop_quietly(node)
    return rescans, bares, parts, report


def profile_rescan(node: Node, root: str) -> str:
    """cProfile of the work of one warm rescan, run on this thread (the scan itself walks on a
    worker thread, which cProfile does not see): the walk as `reconcile` does it, the
    `local_file` rows below the root, and the plan."""
    w = node._make_watcher([root])
    profiler = cProfile.Profile()
    profiler.enable()
    disk = w._files_below(root, root)
    known = node.cache.local_stats([root])
    watcher.plan(disk, known)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


async def rescan_parts(node: Node, root: str) -> dict[str, float]:
    """Each part of a warm rescan timed alone, best of 3 (seconds)."""
    w = node._make_watcher([root])
    rules = w.rules
    paths = list(w._files_below(root, root))

    async def best(fn: Callable[[], Awaitable[object]]) -> float:
        out = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            await fn()
            out = min(out, time.perf_counter() - t0)
        return out

    async def sync(fn: Callable[[], object]) -> object:
        return fn()

    known = node.cache.local_stats([root])
    disk = w._files_below(root, root)
    return {
        "bare scandir + stat": await best(lambda: sync(lambda: bare_walk(root))),
        "watcher.walk (scandir, stat, Rules.ignored per entry)": await best(
            lambda: sync(lambda: sum(1 for _ in watcher.walk(root, rules)))
        ),
        "Watcher._files_below (walk + Rules.ignored again per file)": await best(
            lambda: sync(lambda: w._files_below(root, root))
        ),
        "  of which Rules.ignored, once per file": await best(
            lambda: sync(lambda: [rules.ignored(root, p) for p in paths])
        ),
        "  of which os.path.relpath, once per file": await best(
            lambda: sync(lambda: [os.path.relpath(p, root) for p in paths])
        ),
        "cache.local_stats (rows below the root)": await best(
            lambda: sync(lambda: node.cache.local_stats([root]))
        ),
        "watcher.plan": await best(lambda: sync(lambda: watcher.plan(disk, known))),
        "Node._settled (wake the applier, wait for it)": await best(node._settled),
        "Watcher.reconcile (in the loop, walk on a thread)": await best(
            lambda: w.reconcile([root], settle=False)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile one warm rescan")
    parser.add_argument("--dir", default=None, help="where to make the tree (default: a temp dir)")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="metanode-scan-bench-", dir=args.dir))
    try:
        root, data_dir = base / "media", base / "data"
        t0 = time.perf_counter()
        files, on_disk, apparent = make_tree(root, args.files)
        print(
            f"tree: {files:,} files in {files // PER_FOLDER} folders, {on_disk / MiB:,.0f} MiB "
            f"written, {apparent / GiB:,.0f} GiB apparent ({SPARSE_FILES} sparse); "
            f"made in {time.perf_counter() - t0:.1f} s"
        )

        summary, scan_s, total_s = asyncio.run(cold_scan(data_dir, root))
        sampled = summary.bytes_sampled / MiB
        print(
            f"cold scan: {summary.hashed:,} hashed of {summary.seen:,} in {scan_s:.2f} s "
            f"({total_s:.2f} s with node start/stop): {summary.hashed / scan_s:,.0f} files/s, "
            f"{sampled:,.0f} MiB read, {sampled / scan_s:,.0f} MiB/s"
        )
        assert summary.hashed == files and not summary.failed, summary

        rescans, bares, parts, report = asyncio.run(
            warm_rounds(data_dir, root, args.repeats, args.profile)
        )
        rescan, bare = statistics.median(rescans), statistics.median(bares)
        print(
            f"warm rescan (nothing changed): median {rescan * 1000:.0f} ms "
            f"(min {min(rescans) * 1000:.0f}), {files / rescan:,.0f} files/s"
        )
        print(
            f"bare scandir+stat walk:        median {bare * 1000:.0f} ms "
            f"(min {min(bares) * 1000:.0f}), {files / bare:,.0f} files/s"
        )
        print(f"ratio bare / rescan: {bare / rescan:.2f} (goal >= 0.5)")
        print("parts of a warm rescan, each alone (best of 3):")
        for part, seconds in parts.items():
            print(f"  {part}: {seconds * 1000:.1f} ms")
        if report:
            print(report)
        print(f"python {platform.python_version()}, {os.cpu_count()} cpus, {sys.platform}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
