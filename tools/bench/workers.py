"""Workers benchmark: GET /api/meta/{cid} req/s of `metanode serve --workers 2` ÷ `--workers 1`.

Run: `.venv/bin/python tools/bench/workers.py [--records 2000] [--duration 5] [--rounds 3]
[--connections 16] [--threads 1] [--workers 2]`.

One data directory in a temporary directory, populated once through the API of a single-process
server (`read.populate`: `--records` records × 3 claims). Then, each round, the same data
directory is served by `metanode serve --workers 1` and by `--workers N` in turn (the order
alternates between rounds; each a fresh server on a fresh port, its cache ready), and `wrk`
(`--threads` threads, `--connections` keep-alive connections, a Lua script asking for a random
known CID per request) runs 1 s of warm-up and then `--duration` seconds against it; every
answer must be 2xx. Reported per run: req/s, p50/p99, the CPU seconds the server (supervisor
and workers) and wrk itself spent during the timed run, so a reader sees how much of the
machine the load generator took. Ratio = median of the per-round ratios (goal ≥ 1.6 on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import harness
import httpx
import nacl.signing
import read

from metanode import cid as cids
from metanode import claims
from metanode.clock import now_ms

GOAL = 1.6


@dataclass(frozen=True)
class Measured:
    run: harness.Run
    server_cpu: float  # seconds, supervisor and workers
    wrk_cpu: float  # seconds


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(data_dir: Path, workers: int, script: Path, args: argparse.Namespace) -> Measured:
    """One fresh server of `workers` processes on `data_dir`: warm-up, then the timed wrk run."""
    with harness.metanode_server(
        data_dir,
        METANODE_WORKERS=str(workers),
        METANODE_LOG_LEVEL="warning",
        METANODE_HOT_DOCUMENTS=str(args.hot_documents),
    ) as server:
        harness.run_wrk(server.url, script, 1, args.connections, args.threads)
        server_before, wrk_before = harness.tree_cpu(server.pid), children_cpu()
        run = harness.run_wrk(server.url, script, args.duration, args.connections, args.threads)
        server_cpu = harness.tree_cpu(server.pid) - server_before
        return Measured(run, server_cpu, children_cpu() - wrk_before)


def pinned_on(url: str, headers: dict[str, str], role: str) -> httpx.Client:
    """A one-connection client that landed on the worker named `role`."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    for _ in range(200):
        client = httpx.Client(base_url=url, headers=headers, limits=limits, timeout=60)
        if client.get("/api/meta/x").headers.get("x-metanode-worker") == role:
            return client
        client.close()
    raise RuntimeError(f"no connection reached the {role}")


def write_latency(data_dir: Path, writes: int) -> dict[str, float]:
    """ms per single-claim POST, one after the other, on a connection to the owner and on one
    to a reader (which hands it to the owner): the cost of the hand-over."""
    key = nacl.signing.SigningKey.generate()
    out: dict[str, float] = {}
    with harness.metanode_server(data_dir, METANODE_WORKERS="2") as server:
        harness.register_signer(server, data_dir, key)
        ts = now_ms()
        for role in ("owner", "reader-1", "owner", "reader-1"):
            client = pinned_on(server.url, harness.auth(data_dir), role)
            signed = (
                claims.sign(key, cids.midhash_bytes(os.urandom(32)), "title", "t", ts)
                for _ in range(writes)
            )
            bodies = [harness.claims_body([claim]) for claim in signed]
            start = time.perf_counter()
            for body in bodies:
                response = client.post("/api/claims", content=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
            ms = (time.perf_counter() - start) / writes * 1e3
            client.close()
            out[role] = min(out.get(role, ms), ms)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=2_000)
    parser.add_argument("--duration", type=float, default=5.0, help="wrk seconds per run")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="against --workers 1")
    harness.add_hot_documents(parser)
    parser.add_argument(
        "--writes", type=int, default=0, help="then time this many writes via each worker"
    )
    args = parser.parse_args(argv)
    if not shutil.which("wrk"):
        parser.error("wrk is not installed (apt-get install wrk)")
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        script = Path(tmp) / "paths.lua"
        with harness.metanode_server(data_dir) as server:
            print(f"populating {args.records:,} records × 3 claims …", flush=True)
            read.write_lua(script, read.populate(server, data_dir, args.records, 3))
        if args.writes:
            for role, ms in write_latency(data_dir, args.writes).items():
                print(f"one-claim POST, sequential, via the {role}: {ms:.2f} ms (best of 2)")
        runs: dict[int, list[Measured]] = {1: [], args.workers: []}
        for r in range(args.rounds):
            for workers in (1, args.workers) if r % 2 == 0 else (args.workers, 1):
                m = measure(data_dir, workers, script, args)
                runs[workers].append(m)
                print(
                    f"round {r + 1} --workers {workers}: {m.run.rate:8,.0f} req/s  "
                    f"p50 {m.run.p50_ms:.2f} ms  p99 {m.run.p99_ms:.2f} ms  "
                    f"server CPU {m.server_cpu:.2f} s  wrk CPU {m.wrk_cpu:.2f} s "
                    f"over {args.duration:g} s",
                    flush=True,
                )
    if not args.rounds:
        return 0
    ratios = [
        many.run.rate / one.run.rate for one, many in zip(runs[1], runs[args.workers], strict=True)
    ]
    ratio = statistics.median(ratios)
    for workers, measured in runs.items():
        rate = statistics.median(m.run.rate for m in measured)
        print(f"--workers {workers}: {rate:,.0f} req/s (median)")
    verdict = "met" if ratio >= GOAL else "NOT met"
    print(
        f"ratio --workers {args.workers} ÷ --workers 1: {ratio:.2f} (goal >= {GOAL}): {verdict}  "
        f"[per round: {', '.join(f'{x:.2f}' for x in ratios)}; wrk -t{args.threads} "
        f"-c{args.connections} -d{args.duration:g}s, {args.records:,} records]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
