"""Plugin backlog benchmark: the files/s a started node's plugin host gets through a first
scan's backlog, against the built-in plugins' own `process` rate on the same files.

Run: `.venv/bin/python tools/bench/plugin_backlog.py [--files 2000] [--workers 1]` (needs
Debian's `ffmpeg` for the media; mediainfo is left off, as in docs/operations.md's table).

The files are `plugins.py`'s library (real 2 s Matroska videos and MP3s in season, film and
album folders, some `.nfo` and `.srt` sidecars).

* Baseline, in the same run: each plugin's `process` over every file in a plain loop on this
  thread (no signing, no ingest, no bookkeeping); their sum is what one core needs a file.
* Backlog: a real node (real SQLite files, its watcher and plugin host) started in this
  process on a data directory of its own with the files in its watch root; the time from its
  start until every file has every plugin's run done (`plugin_runs`, read from cache.db).
* Ratio = backlog files/s ÷ the baseline's files/s (1.0: the host costs nothing beside the
  plugins' own work on one core). Also each plugin's backlog files/s (its runs ÷ the time its
  last run took to be done) and the CPU seconds this process used a run.
* Commits: the truth transactions that held the plugins' claims (its writer's group
  transactions, /metrics' `metanode_ingest_groups`) and the runs with claims a transaction (its
  jobs ÷ its transactions): 1.0 when each run commits alone.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

from metanode_fileinfo import FileInfo
from metanode_filename import FileName
from metanode_fullhash import FullHash
from metanode_nfo import Nfo

from metanode import config, db
from metanode.node import Node
from metanode.plugins import LocalFile
from metanode.watcher import midhash_file
from plugins import library, make_sources, rate, run_plugin

PLUGINS = (FileInfo(), FileName(), FullHash(), Nfo())


def distinct(files: list[LocalFile]) -> list[LocalFile]:
    """The files made distinct contents (`library` copies two sources: one run would do for
    all of them): a few bytes of each file's own appended, its midhash taken again."""
    out = []
    for n, file in enumerate(files):
        with open(file.path, "ab") as f:
            f.write(n.to_bytes(4, "big"))
        midhash, size = midhash_file(Path(file.path))
        out.append(LocalFile(midhash, file.path, size, 0, file.root, file.relative))
    return out


def contents(root: Path) -> int:
    """The distinct contents below `root` (sidecars included): the runs of each plugin."""
    return len({midhash_file(path)[0] for path in root.rglob("*") if path.is_file()})


def settings_for(data_dir: Path, root: Path, workers: int) -> config.Settings:
    return config.load(
        env={},
        overrides={
            "data_dir": data_dir,
            "watch_roots": (str(root),),
            "watch_settle_s": 0.0,
            "plugins_enabled": True,
            "plugins_disabled": ("mediainfo",),
            "plugin_workers": workers,
        },
    )


def done_runs(cache_path: Path) -> dict[str, int]:
    """Each plugin's runs done (read on a connection of its own)."""
    conn = db.connect(cache_path, readonly=True)
    try:
        rows = conn.execute(
            "SELECT plugin, count(*) FROM plugin_runs WHERE status = 'done' GROUP BY plugin"
        )
        return {plugin: count for plugin, count in rows}
    finally:
        conn.close()


async def backlog(
    data_dir: Path, root: Path, runs: int, workers: int
) -> tuple[float, dict[str, float], tuple[int, int]]:
    """(seconds from the node's start until every plugin is done on every file, each plugin's
    seconds until its last run was done, (the truth's group transactions, the jobs they held))."""
    settings = settings_for(data_dir, root, workers)
    started = time.perf_counter()
    node = Node(settings)
    await node.start()
    finished: dict[str, float] = {}
    try:
        while len(finished) < len(PLUGINS):
            await asyncio.sleep(0.2)
            for plugin, count in done_runs(settings.cache_path).items():
                if count >= runs and plugin not in finished:
                    finished[plugin] = time.perf_counter() - started
        commits = (node.truth.writer.groups, node.truth.writer.grouped)
    finally:
        await node.stop()
    return max(finished.values()), finished, commits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("ffmpeg") is None:
        sys.exit("needs Debian's ffmpeg (apt-get install ffmpeg)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        video, audio = make_sources(folder)
        files = distinct(library(folder / "media", video, audio, args.files))
        runs = contents(folder / "media")
        own = {plugin.name: rate(run_plugin(plugin), files) for plugin in PLUGINS}
        base = 1 / sum(1 / each for each in own.values())
        cpu = time.process_time()
        took, finished, (groups, grouped) = asyncio.run(
            backlog(folder / "data", folder / "media", runs, args.workers)
        )
        cpu = time.process_time() - cpu
    got = runs / took
    print(
        f"{len(files)} media files, {runs} contents a plugin runs on, plugin_workers {args.workers}"
    )
    print(f"{'plugin':<10} {'own files/s':>12} {'backlog files/s':>16}")
    for name, alone in own.items():
        print(f"{name:<10} {alone:>12,.0f} {runs / finished[name]:>16,.1f}")
    print(f"baseline, every plugin's process in a plain loop: {base:,.1f} files/s")
    print(f"backlog, a started node: {got:,.1f} files/s ({took:.1f} s)")
    print(f"CPU of this process a run: {1000 * cpu / (runs * len(PLUGINS)):.2f} ms")
    print(f"truth transactions: {groups:,}, runs with claims a transaction: {grouped / groups:.2f}")
    print(f"ratio backlog ÷ baseline: {got / base:.3f}")


if __name__ == "__main__":
    main()
