"""What keeping each file's ctime costs the watcher (docs/watcher.md, "What the ctime sees").

Run: `.venv/bin/python tools/bench/ctime.py [--files 20000]`.

A tree of `--files` files of 4-64 KiB of random bytes in folders of 100 (made in a temporary
folder, removed at the end), and a `Node` on a fresh SQLite data directory in-process (watcher
and plugins off), which reconciles it with `node.scan` as `metanode scan` does. Timed, each
`node.scan` alone:

1. **first scan**: every file hashed (the baseline of a scan that reads every file);
2. **unchanged rescan**: nothing hashed (a stat a file);
3. **first look after the upgrade**: every row's `ctime_ns` set to 0, as cache schema v14
   leaves the rows of a schema-13 cache; the scan gives each the disk's ctime without hashing
   (`cache.fill_ctimes_txn`): it must hash nothing;
4. **after `chmod` of every file**: each ctime moved, so each file is hashed again and found
   unchanged (what a `chmod -R` over a library costs); then a rescan, which must hash nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from metanode import config, watcher
from metanode.node import Node

PER_FOLDER = 100
KiB = 1 << 10


def make_tree(root: Path, files: int, seed: int = 7) -> int:
    """Write the tree; its bytes."""
    rng = random.Random(seed)
    pool = os.urandom(64 * KiB)
    total = 0
    for i in range(files):
        folder = root / f"folder-{i // PER_FOLDER:04}"
        if i % PER_FOLDER == 0:
            folder.mkdir(parents=True)
        size = rng.randint(4, 64) * KiB
        (folder / f"file-{i:06}.bin").write_bytes(i.to_bytes(8, "big") + pool[: size - 8])
        total += size
    return total


async def timed(node: Node, root: Path) -> tuple[watcher.Summary, float]:
    """One `node.scan` of `root`: its summary and seconds."""
    began = time.perf_counter()
    summary = await node.scan([str(root)])
    return summary, time.perf_counter() - began


async def measure(work: Path, files: int) -> list[tuple[str, watcher.Summary, float]]:
    """The rounds of the module's docstring, each (what, summary, seconds)."""
    root = work / "media"
    make_tree(root, files)
    settings = config.load(
        env={},
        overrides={
            "data_dir": work / "data",
            "watch_enabled": False,
            "plugins_enabled": False,
            "watch_roots": (str(root),),
        },
    )
    node = Node(settings)
    await node.start()
    await node.applier.wait_for(0, 30)
    rounds: list[tuple[str, watcher.Summary, float]] = []
    try:
        rounds.append(("first scan (every file hashed)", *await timed(node, root)))
        rounds.append(("unchanged rescan", *await timed(node, root)))
        await node.cache.writer.run(lambda c: c.execute("UPDATE local_file SET ctime_ns = 0"))
        rounds.append(("first look after the upgrade (ctimes filled)", *await timed(node, root)))
        for path in root.rglob("*.bin"):
            os.chmod(path, 0o600)
        rounds.append(("after chmod of every file", *await timed(node, root)))
        rounds.append(("rescan after that", *await timed(node, root)))
    finally:
        await node.cache.drained()
        await node.stop()
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description="What keeping each file's ctime costs")
    parser.add_argument("--files", type=int, default=20_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="metanode-ctime-"))
    try:
        rounds = asyncio.run(measure(work, args.files))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"| {args.files:,} files | seconds | hashed | unchanged |")
    print("|---|---:|---:|---:|")
    for name, summary, seconds in rounds:
        print(f"| {name} | {seconds:.2f} | {summary.hashed:,} | {summary.unchanged:,} |")


if __name__ == "__main__":
    main()
