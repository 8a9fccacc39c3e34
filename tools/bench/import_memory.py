"""Import memory benchmark: peak RSS of `metanode import` for an export of 10×N claims vs N.

Run: `.venv/bin/python tools/bench/import_memory.py [--n 20000] [--factor 10] [--no-baseline]`.

Two JSON-lines files, as `metanode export` writes them (`metanode.jsonl.encode` of each wire
claim): N and factor×N claims (key `title`, one fresh midhash CID each, one signer), signed over
`metanode.claims.signing_bytes` in this process; the small file is the first N lines of the
large one.
For each file, a fresh data directory (`metanode init`) gets the signer with
`metanode signers add` (a subprocess), then `metanode import FILE` runs as a subprocess and
its peak RSS is `ru_maxrss` from `os.wait4` on that one child (the kernel's high-water mark
of the whole process, interpreter and imports included). Every import must exit 0 having
accepted every claim. `metanode export` of each imported data directory is measured the same
way.

Ratio = peak(factor×N) / peak(N): flat memory gives ≈ 1.0; memory growing with the file gives
≈ factor (less the fixed interpreter cost). The one cache an import fills is the CID parse
cache (`cid._parse`, 65,536 entries, ≈ 24 MiB when full): with N below that, part of the
difference is that cache filling up, bounded whatever the size; `--n 70000 --factor 3` starts
with it full. Baseline, same run: the same imports by the code as
it was before import streamed (the parent of the commit that added `metanode/jsonl.py`, taken
with `git archive` into a temporary directory and run first on PYTHONPATH), which read the whole
file and kept every claim. `--no-baseline` skips it (it takes as long again).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import harness
import nacl.signing

from metanode import cid as cids
from metanode import claims, jsonl
from metanode.clock import now_ms

GOAL = 1.5


@dataclass(frozen=True)
class Run:
    """One measured command: peak RSS in MiB and wall time in seconds."""

    peak_mib: float
    seconds: float


def write_exports(
    key: nacl.signing.SigningKey, small: Path, large: Path, n: int, factor: int
) -> None:
    """The two files: `small` is the first `n` lines of `large` (`n * factor` lines). Signed as
    `claims.sign` does, but with the uid spelled once (base58 is slow in pure Python)."""
    ts, uid = now_ms(), claims.uid_of(bytes(key.verify_key))
    with small.open("wb") as first, large.open("wb") as every:
        for i in range(n * factor):
            cid = cids.midhash_bytes(i.to_bytes(8, "big") + b"import-memory")
            value = f"title {i}"
            sig = key.sign(claims.signing_bytes(uid, cid, "title", value, ts)).signature
            line = jsonl.encode(claims.Claim(uid, cid, "title", value, ts, sig).wire())
            every.write(line)
            if i < n:
                first.write(line)


def measure(argv: list[str], env: dict[str, str]) -> tuple[Run, str]:
    """Run `argv`; its peak RSS (its own `ru_maxrss`, KiB on Linux), wall time and stdout.
    Output goes to files, not pipes: `communicate` would reap the child before `wait4`."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # cwd: not the checkout, whose ./metanode `-m` would put before PYTHONPATH's
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, cwd=tempfile.gettempdir())
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[2:])} exited {proc.returncode}: "
                f"{err.read().decode(errors='replace')}"
            )
        text = out.read().decode()
    return Run(usage.ru_maxrss / 1024, time.perf_counter() - started), text


def metanode(env: dict[str, str], *args: str) -> tuple[Run, str]:
    return measure([sys.executable, "-m", "metanode", *args], env)


def import_run(env: dict[str, str], uid: str, source: Path, data_dir: Path, claims_in: int) -> Run:
    """Register the signer, import `source` into the fresh `data_dir`, check every claim was
    accepted; the import's figures."""
    metanode(env, "init", "--data-dir", str(data_dir))
    metanode(env, "signers", "add", uid, "--name", "bench", "--data-dir", str(data_dir))
    run, out = metanode(env, "import", str(source), "--data-dir", str(data_dir))
    if f"{claims_in} accepted" not in out:
        raise RuntimeError(f"import of {source} did not accept all {claims_in}: {out}")
    return run


def baseline_tree(into: Path) -> Path:
    """The package as it was before import streamed, unpacked under `into`."""
    added = subprocess.run(
        [
            "git",
            "-C",
            str(harness.REPO),
            "log",
            "--diff-filter=A",
            "--format=%H",
            "--",
            "metanode/jsonl.py",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[-1]
    archive = subprocess.run(
        ["git", "-C", str(harness.REPO), "archive", f"{added}^", "metanode"],
        check=True,
        capture_output=True,
    ).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20_000, help="claims in the small file")
    parser.add_argument("--factor", type=int, default=10, help="the large file is factor×N")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the imports by the code before import streamed",
    )
    args = parser.parse_args(argv)
    if args.n < 1 or args.factor < 2:
        parser.error("need --n >= 1 and --factor >= 2")

    key = nacl.signing.SigningKey.generate()
    uid = claims.uid_of(bytes(key.verify_key))
    big = args.n * args.factor
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp_name:
        tmp = Path(tmp_name)
        small, large = tmp / "small.jsonl", tmp / "large.jsonl"
        print(f"signing {big:,} claims …", flush=True)
        write_exports(key, small, large, args.n, args.factor)
        sizes = {small: args.n, large: big}
        print(
            f"files: {small.stat().st_size / 2**20:,.1f} MiB and "
            f"{large.stat().st_size / 2**20:,.1f} MiB",
            flush=True,
        )
        envs = {"streaming": harness.clean_env()}
        if not args.no_baseline:
            old = baseline_tree(tmp / "before")
            envs["before"] = harness.clean_env(PYTHONPATH=str(old))
        imports: dict[tuple[str, Path], Run] = {}
        exports: dict[Path, Run] = {}
        for label, env in envs.items():
            for source, count in sizes.items():
                data_dir = tmp / f"{label}-{source.stem}"
                print(f"{label}: importing {count:,} claims …", flush=True)
                imports[label, source] = import_run(env, uid, source, data_dir, count)
                if label == "streaming":
                    exports[source], _ = metanode(
                        env,
                        "export",
                        "--out",
                        str(tmp / f"out-{source.stem}.jsonl"),
                        "--data-dir",
                        str(data_dir),
                    )

    print(
        f"\npeak RSS of `metanode import` (ru_maxrss), N = {args.n:,}, {args.factor}×N = {big:,}:"
    )
    for label in envs:
        a, b = imports[label, small], imports[label, large]
        print(
            f"  {label:9}  N: {a.peak_mib:7.1f} MiB ({a.seconds:5.1f} s)   {args.factor}×N: "
            f"{b.peak_mib:7.1f} MiB ({b.seconds:5.1f} s)   ratio {b.peak_mib / a.peak_mib:.2f}"
        )
    a, b = exports[small], exports[large]
    print(
        f"  export     N: {a.peak_mib:7.1f} MiB ({a.seconds:5.1f} s)   {args.factor}×N: "
        f"{b.peak_mib:7.1f} MiB ({b.seconds:5.1f} s)   ratio {b.peak_mib / a.peak_mib:.2f}"
    )
    ratio = imports["streaming", large].peak_mib / imports["streaming", small].peak_mib
    print(
        f"ratio peak({args.factor}×N) / peak(N) {ratio:.2f} (goal <= {GOAL}, flat = 1.0): "
        f"{'met' if ratio <= GOAL else 'NOT met'}"
    )
    if "before" in envs:
        against = imports["streaming", large].peak_mib / imports["before", large].peak_mib
        print(f"streaming ÷ before at {args.factor}×N: {against:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
