"""Plugins benchmark: each built-in plugin's files/s over 1,000 small media files, and how much
of a 4 GiB file mediainfo's ffprobe reads.

Run: `.venv/bin/python tools/bench/plugins.py [--files 1000] [--dir DIR]` (needs Debian's
`ffmpeg` for the media and for mediainfo).

1. **Files/s.** ffmpeg makes one real 2 s Matroska video (320x240, mpeg4 + AAC) and one 2 s MP3;
   1,000 files are written from them in a library layout (episodes in season folders, films in
   titled folders, albums; a tenth of the films with a `movie.nfo`, a tenth of the episodes with
   an `.en.srt`). Each plugin's `process` runs over every file in this process, its drafts
   collected (signing and ingest are the host's and cost the same for every plugin). Baseline,
   in the same run: the watcher's midhash of the same files. Ratio = plugin files/s ÷ midhash
   files/s.
2. **Header-only reads.** The same video with a 4 GiB hole appended (a sparse file: the hole
   reads as zeros and costs no disk), probed by the very command mediainfo runs. Bytes read are
   the ffprobe child's `rchar` from `/proc/<pid>/io`, read after it exited and before it is
   reaped (`waitid(WNOWAIT)`): no strace. Ratio = bytes read ÷ file size (goal < 1 %); baseline,
   in the same run: the bytes the watcher's midhash reads of the same file (1 MiB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from metanode_fileinfo import FileInfo
from metanode_filename import FileName
from metanode_fullhash import FullHash
from metanode_mediainfo import MediaInfo, ffprobe_argv
from metanode_nfo import Nfo

from metanode import cid as cids
from metanode.plugins import LocalFile, Plugin
from metanode.watcher import midhash_file

GIB = 1 << 30
NFO = (
    b'<movie><title>Film</title><year>2001</year><uniqueid type="imdb">tt0000001</uniqueid></movie>'
)
SRT = b"1\n00:00:01,000 --> 00:00:02,000\nHello\n"


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-y", *args], check=True, timeout=300)


def make_sources(folder: Path) -> tuple[Path, Path]:
    video, audio = folder / "source.mkv", folder / "source.mp3"
    ffmpeg(
        "-f", "lavfi", "-i", "testsrc=size=320x240:rate=10:duration=2",
        "-f", "lavfi", "-i", "sine=duration=2", "-c:v", "mpeg4", "-c:a", "aac", str(video),
    )  # fmt: skip
    ffmpeg("-f", "lavfi", "-i", "sine=duration=2", str(audio))
    return video, audio


def library(root: Path, video: Path, audio: Path, count: int) -> list[LocalFile]:
    """`count` media files in a library layout (with some .nfo and .srt sidecars beside them)."""
    files: list[LocalFile] = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            season = f"0{i % 5 + 1}"
            name = f"Show.{i % 7}.S{season}E{i:03d}.720p.WEB-DL.x264-GRP.mkv"
            relative = f"Show {i % 7}/Season {season}/{name}"
            source = video
        elif kind == 1:
            relative = f"Film {i} ({1950 + i % 70})/Film.{i}.{1950 + i % 70}.1080p.BluRay.x264.mkv"
            source = video
        else:
            relative = f"Artist {i % 11}/Album {i % 13}/{i % 20:02d} Song {i}.mp3"
            source = audio
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, path)
        if kind == 1 and i % 10 == 1:
            (path.parent / "movie.nfo").write_bytes(NFO)
        if kind == 0 and i % 10 == 0:
            path.with_suffix(".en.srt").write_bytes(SRT)
        midhash, size = midhash_file(path)
        files.append(LocalFile(midhash, str(path), size, 0, str(root), relative))
    return files


def rate(work: Callable[[LocalFile], object], files: list[LocalFile]) -> float:
    started = time.perf_counter()
    for file in files:
        work(file)
    return len(files) / (time.perf_counter() - started)


def run_plugin(plugin: Plugin) -> Callable[[LocalFile], object]:
    def work(file: LocalFile) -> None:
        drafts: list[tuple[str, str, str | None]] = []
        plugin.process(file, lambda cid: None, lambda c, k, v: drafts.append((c, k, v)))

    return work


def child_rchar(argv: list[str]) -> int:
    """Bytes a child read through read(2) and friends, from its /proc/<pid>/io once it has
    exited and before it is reaped."""
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    with open(f"/proc/{child.pid}/io") as io:
        fields = dict(line.split(": ") for line in io.read().splitlines())
    child.wait()
    return int(fields["rchar"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("ffmpeg") is None or shutil.which("ffprobe") is None:
        sys.exit("needs Debian's ffmpeg (apt-get install ffmpeg)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        video, audio = make_sources(folder)
        files = library(folder / "media", video, audio, args.files)
        base = rate(lambda f: midhash_file(f.path), files)
        print(f"{len(files)} files; baseline midhash: {base:,.0f} files/s")
        print(f"{'plugin':<10} {'files/s':>10} {'÷ midhash':>10}")
        for plugin in (FileInfo(), FileName(), MediaInfo(), Nfo(), FullHash()):
            got = rate(run_plugin(plugin), files)
            print(f"{plugin.name:<10} {got:>10,.0f} {got / base:>10.4f}")

        big = folder / "big.mkv"
        shutil.copyfile(video, big)
        with open(big, "r+b") as f:
            f.truncate(4 * GIB)  # a hole after the real header and streams
        size = big.stat().st_size
        tool = shutil.which("ffprobe") or "ffprobe"
        probed = child_rchar(ffprobe_argv(tool, str(big)))
        sampled = min(size, cids.MIDHASH_SAMPLE)
        print(f"\n4 GiB sparse file ({size:,} bytes):")
        print(f"  mediainfo's ffprobe read {probed:,} bytes = {100 * probed / size:.4f} % of it")
        print(
            f"  baseline, the watcher's midhash read: {sampled:,} bytes;"
            f" ratio {probed / sampled:.2f}"
        )
        ok = probed / size < 0.01
        print(f"  goal < 1 %: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
