"""fullhash benchmark: one-pass throughput against `sha256sum` and `openssl dgst -sha256`, where
the time goes, and peak memory on a 10 GiB file.

Run: `.venv/bin/python tools/bench/fullhash.py [--size-mib 1024] [--rounds 3] [--dir DIR]`.

1. **Throughput.** A file of random bytes (1 GiB by default) is written once in a temporary
   directory and read once to warm the page cache; nothing is dropped from the cache, so every
   timed pass reads from memory and the figures compare CPU cost, not disk speed. Each round
   times, in turn, `metanode_fullhash.hash_file` (in this process: sha2-256 + blake3 + IPFS CID +
   midhash from one read), `sha256sum FILE` and `openssl dgst -sha256 FILE` (subprocesses; their
   start-up is a few ms). Best of `--rounds`. Ratio = fullhash throughput ÷ baseline throughput
   (goal vs sha256sum: ≥ 0.8). Debian's `sha256sum` (coreutils) has no SHA-NI code path, so it is
   a weak baseline on CPUs that have SHA-NI; openssl uses it and is the honest one.
2. **Breakdown.** The same read loop (4 MiB `readinto`) with only one consumer each: nothing,
   whole-file sha2-256, blake3 (AUTO threads and 1 thread), the IPFS builder, and the builder's
   leaf sha2-256 alone on memoryview slices. Best of 2.
   Then a cProfile of one `hash_file` pass, top functions by own time.
3. **Peak memory.** `hash_file` on a 10 GiB sparse file (a hole: reads as zero pages) in a child
   process that reports its own RSS after the imports and its peak (VmHWM, reset after the
   imports through /proc/self/clear_refs) while hashing.

Every figure is a ratio against a baseline measured in the same run; absolute rates are context.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3
from metanode_fullhash import BLOCK, Digests, hash_file, ipfs

from metanode import cid as cids

MIB = 1 << 20
GIB = 1 << 30
SPARSE_SIZE = 10 * GIB


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def write_random(path: Path, size: int) -> None:
    with path.open("wb") as out:
        left = size
        while left:
            n = min(left, 64 * MIB)
            out.write(os.urandom(n))
            left -= n


def read_loop(path: Path, consume: Callable[[memoryview], object]) -> None:
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while got := f.readinto(buffer):
            consume(view[:got])


def hex_of_tool(command: list[str], path: Path) -> str:
    """Run a digest tool; its hex digest (sha256sum: first field; openssl: after '= ')."""
    out = subprocess.run(
        [*command, str(path)], check=True, capture_output=True, text=True
    ).stdout.strip()
    return out.split("= ")[-1] if "= " in out else out.split()[0]


# -- sections -----------------------------------------------------------------------------------


def throughput(path: Path, size: int, rounds: int) -> tuple[Digests, dict[str, float]]:
    digests = hash_file(str(path))
    expected = cids.encode(cids.RAW, cids.SHA2_256, bytes.fromhex(hex_of_tool(["sha256sum"], path)))
    assert digests.sha256 == expected, "sha256sum disagrees with fullhash"
    assert hex_of_tool(["openssl", "dgst", "-sha256"], path) == hex_of_tool(["sha256sum"], path)
    best = {name: float("inf") for name in ("fullhash", "sha256sum", "openssl")}
    runs: dict[str, Callable[[], object]] = {
        "fullhash": lambda: hash_file(str(path)),
        "sha256sum": lambda: hex_of_tool(["sha256sum"], path),
        "openssl": lambda: hex_of_tool(["openssl", "dgst", "-sha256"], path),
    }
    for r in range(rounds):
        line = []
        for name, run in runs.items():
            seconds = timed(run)
            best[name] = min(best[name], seconds)
            line.append(f"{name} {seconds:.3f} s")
        print(f"  round {r + 1}: " + ", ".join(line))
    print(
        f"\nthroughput on {size / MIB:.0f} MiB of random bytes (page cache warm), best of {rounds}:"
    )
    for name, seconds in best.items():
        print(f"  {name:10} {seconds:7.3f} s  {size / seconds / 1e6:8.0f} MB/s")
    for base in ("sha256sum", "openssl"):
        print(
            f"  ratio fullhash / {base:9} = {best[base] / best['fullhash']:.2f}"
            + ("   (goal >= 0.8)" if base == "sha256sum" else "")
        )
    return digests, best


def breakdown(path: Path, size: int) -> None:
    def leaf_hashes(block: memoryview) -> None:
        for i in range(0, len(block), ipfs.CHUNK):
            hashlib.sha256(block[i : i + ipfs.CHUNK])

    parts: list[tuple[str, Callable[[], Callable[[memoryview], object]]]] = [
        ("read only", lambda: lambda block: None),
        ("sha2-256, whole file", lambda: hashlib.sha256().update),
        ("blake3, AUTO threads", lambda: blake3.blake3(max_threads=blake3.blake3.AUTO).update),
        ("blake3, 1 thread", lambda: blake3.blake3().update),
        ("IPFS builder", lambda: ipfs.Builder().update),
        ("  its leaf sha2-256 alone", lambda: leaf_hashes),
    ]
    print("\nbreakdown (the same read loop, one consumer each, best of 2):")

    def one_pass(make: Callable[[], Callable[[memoryview], object]]) -> float:
        return timed(lambda: read_loop(path, make()))

    for name, make in parts:
        seconds = min(one_pass(make) for _ in range(2))
        print(f"  {name:28} {seconds:7.3f} s  {size / seconds / 1e6:8.0f} MB/s")
    profiler = cProfile.Profile()
    profiler.runcall(hash_file, str(path))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
    print("\ncProfile of one hash_file pass (own time):")
    keep = False
    for line in text.getvalue().splitlines():
        keep = keep or line.lstrip().startswith("ncalls")
        if keep and line.strip():
            print("  " + line.rstrip())


CHILD = """
import json, sys
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
from metanode_fullhash import hash_file
imported = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
hash_file(sys.argv[1])
print(json.dumps({"imported": imported, "peak": status("VmHWM")}))
"""


def peak_memory(folder: Path) -> None:
    """Peak RSS of a child hashing a 10 GiB sparse file, from the child's own /proc status.

    (`os.wait4`'s ru_maxrss is not used: Linux carries the parent's RSS at fork into the child's
    figure, so it would report this benchmark process, not the hashing.)
    """
    sparse = folder / "sparse-10g.bin"
    with sparse.open("wb") as f:
        f.truncate(SPARSE_SIZE)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(sparse)], check=True, capture_output=True, text=True
    ).stdout
    seconds = time.perf_counter() - start
    figures = json.loads(out)
    imported, peak = figures["imported"] / 1024, figures["peak"] / 1024
    print(
        f"\npeak RSS hashing a 10 GiB sparse file in a child (VmHWM): {peak:.1f} MiB; after "
        f"the imports {imported:.1f} MiB, so hashing adds {peak - imported:.1f} MiB "
        f"(took {seconds:.1f} s, {SPARSE_SIZE / seconds / 1e6:.0f} MB/s on zero pages)"
    )
    sparse.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the test files go")
    parser.add_argument("--skip-rss", action="store_true")
    args = parser.parse_args()
    for tool in ("sha256sum", "openssl"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed")
    size = args.size_mib * MIB
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fullhash-bench-") as tmp:
        folder = Path(tmp)
        path = folder / "random.bin"
        print(f"writing {size / MIB:.0f} MiB of random bytes to {path} …")
        write_random(path, size)
        read_loop(path, lambda block: None)  # warm the page cache; nothing is ever dropped
        openssl = subprocess.run(["openssl", "version"], capture_output=True, text=True)
        print(
            f"python {sys.version.split()[0]}, blake3 {blake3.__version__}, "
            f"{openssl.stdout.strip()}, {os.cpu_count()} CPUs, BLOCK {BLOCK // MIB} MiB"
        )
        throughput(path, size, args.rounds)
        breakdown(path, size)
        path.unlink()
        if not args.skip_rss:
            peak_memory(folder)


if __name__ == "__main__":
    main()
