"""What `metanode rebuild-cache` run beside a serving node costs its writers: one-claim post
latency, answers and log lines while the cache is rebuilt.

Run: `.venv/bin/python tools/bench/rebuild_live.py [--claims 500000] [--work-dir DIR]`.

The data directory is built as `scale.py` builds it (`--claims` signed claims straight into the
truth, the cache built by `maintenance.rebuild_cache`; kept in `--work-dir` and reused), then
copied, so every run starts from the same one. A real `metanode serve` runs on the copy; a
writer registered through `POST /api/signers` posts one-claim requests back to back with one
keep-alive client: `--seconds` before, then while `metanode rebuild-cache` runs as a
subprocess (its own time measured), then `--seconds` after. Reported: the rebuild's time and
what it printed, each phase's post latencies (p50, max) and answers by status, the server's log
lines at level error or warning, and whether every acknowledged claim is in the record its
CID resolves to afterwards. The ratio: the posts' p50 and longest latency during the rebuild ÷
before it, in the same run.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import harness
import httpx
import ingest
import nacl.signing
import scale

from metanode.clock import now_ms

WRITES = 60_000  # one-claim bodies signed for the writer up front: more than a run posts


class Phase:
    """The posts of one phase: latencies (ms), answers by status, the acknowledged claims."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.statuses: collections.Counter[int] = collections.Counter()
        self.acknowledged: list[tuple[str, str]] = []  # (cid, value)

    def summary(self) -> str:
        if not self.latencies:
            return "no posts"
        return (
            f"{len(self.latencies):,} posts, p50 {statistics.median(self.latencies):.1f} ms, "
            f"max {max(self.latencies):.0f} ms, answers {dict(self.statuses)}"
        )


def post_for(
    client: httpx.Client, bodies: Iterator[tuple[str, str, bytes]], until: threading.Event
) -> Phase:
    """Post one body after another until `until` is set."""
    phase = Phase()
    while not until.is_set():
        cid, value, body = next(bodies)
        start = time.perf_counter()
        answer = client.post("/api/claims", content=body)
        phase.latencies.append((time.perf_counter() - start) * 1e3)
        phase.statuses[answer.status_code] += 1
        if answer.status_code in (200, 202):
            phase.acknowledged.append((cid, value))
    return phase


def rebuild(data_dir: Path, took: list[float], output: list[str], done: threading.Event) -> None:
    """`metanode rebuild-cache` on `data_dir`, timed; `done` set however it ends."""
    start = time.perf_counter()
    try:
        ran = subprocess.run(
            [sys.executable, "-m", "metanode", "rebuild-cache", "--data-dir", str(data_dir)],
            capture_output=True,
            text=True,
            env=harness.clean_env(),
            cwd=data_dir.parent,
            check=False,
        )
        took.append(time.perf_counter() - start)
        output.append(f"exit {ran.returncode}: {(ran.stdout + ran.stderr).strip()}")
    finally:
        done.set()


def missing(client: httpx.Client, acknowledged: list[tuple[str, str]]) -> int:
    """How many acknowledged claims the node does not show in their CID's record."""
    lost = 0
    for cid, value in acknowledged:
        answer = client.get(f"/api/meta/{cid}")
        if answer.status_code != 200 or answer.json()["metadata"].get("title") != value:
            lost += 1
    return lost


def run(args: argparse.Namespace) -> None:
    start = time.monotonic()
    built, _ = scale.prepared(args.work_dir, "rebuild", args.claims, args, start)
    run_dir = args.work_dir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    data_dir = run_dir / "data"
    shutil.copytree(built, data_dir)
    writer = nacl.signing.SigningKey.generate()
    with harness.metanode_server(data_dir) as server:
        harness.register_signer(server, data_dir, writer)
        writes = ingest.make_claims(writer, WRITES, now_ms(), "live")
        bodies = iter((c.cid, str(c.value), harness.claims_body([c])) for c in writes)
        headers = {**harness.auth(data_dir), "Content-Type": "application/json"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=600) as client:
            stop = threading.Event()
            threading.Timer(args.seconds, stop.set).start()
            before = post_for(client, bodies, stop)
            done, took, output = threading.Event(), list[float](), list[str]()
            thread = threading.Thread(target=rebuild, args=(data_dir, took, output, done))
            thread.start()
            during = post_for(client, bodies, done)
            thread.join()
            stop = threading.Event()
            threading.Timer(args.seconds, stop.set).start()
            after = post_for(client, bodies, stop)
            acknowledged = before.acknowledged + during.acknowledged + after.acknowledged
            lost = missing(client, acknowledged)
        log_path = server.log_path
    assert log_path is not None
    said = [
        line
        for line in log_path.read_text(errors="replace").splitlines()
        if '"level": "error"' in line or '"level": "warning"' in line
    ]
    print(f"{args.claims:,} claims; rebuild-cache took {took[0]:.1f} s: {output[0]}")
    print(f"before: {before.summary()}")
    print(f"during: {during.summary()}")
    print(f"after:  {after.summary()}")
    if before.latencies and during.latencies:  # the baseline: the same posts before it began
        p50 = statistics.median(during.latencies) / statistics.median(before.latencies)
        longest = max(during.latencies) / max(before.latencies)
        print(f"ratio during ÷ before: p50 {p50:.2f}, max {longest:.2f}")
    print(f"acknowledged {len(acknowledged):,}, missing afterwards {lost}")
    print(f"server log lines at level error or warning: {len(said)}")
    for line in said[:5]:
        print(f"  {line[:300]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=500_000)
    parser.add_argument("--keys-per-record", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=5_000, help="claims per truth transaction")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--seconds", type=float, default=3.0, help="posting before and after")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/rebuild-bench"))
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
