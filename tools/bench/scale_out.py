"""Scale-out benchmark: ingest and GET /api/meta on PostgreSQL with 1 and 2 replicas, against
the SQLite default, in one run; and the lookup p99 at a large claim count ÷ at a small one.

Run: `.venv/bin/python tools/bench/scale_out.py [--batches 300] [--batch 100] [--clients 8]
[--duration 5] [--large 1000000] [--small 10000]`.

The PostgreSQL server is the tests' throw-away cluster (tests/helpers/postgres.py: Debian's
`postgresql`, `initdb` and `pg_ctl` on a loopback port), here with `fsync=on`, so its commits
are as durable as SQLite's `synchronous=FULL`; each scenario gets a database of its own.

1. Ingest: the same `--batches` pre-serialised bodies of `--batch` signed claims (each about a
   fresh CID, one signer) posted by `--clients` concurrent keep-alive clients
   (`harness.post_batches`; every answer must be 200 with every claim accepted), to: one SQLite
   server; one PostgreSQL replica; two replicas of one database (the clients split between
   them; every answer is read-your-writes on the replica that took it). Claims/s and the ratio
   to SQLite.
2. Reads, on the same data right after: `wrk` (`-c{--clients}` a server, `--duration` s, a Lua
   script asking for random ingested CIDs; two wrk processes at once for two replicas) on
   `GET /api/meta/{cid}`. Req/s, p99 (wrk's), the ratio to SQLite.
3. Lookups by size: `--small` and `--large` claims bulk-loaded into two PostgreSQL databases
   through the store (`scale.build`: `TruthStore.ingest_sync` in 5,000-claim transactions,
   then `maintenance.rebuild_cache`), served by one replica each, asked alternately by one
   sequential client (`scale.measure`); p50/p99 per size and p99(large) / p99(small).

Servers run with their default settings but `METANODE_WATCH_ENABLED=false`; the machine's load
(`uptime`) is printed first and last: the ratios are of one run on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import harness
import nacl.signing
import read
import scale

from metanode import cid as cids
from metanode import claims
from metanode.clock import now_ms

sys.path.insert(0, str(harness.REPO))
from tests.helpers.postgres import Cluster, start_cluster  # the tests' throw-away cluster

QUIET = {"METANODE_WATCH_ENABLED": "false", "METANODE_LOG_LEVEL": "warning"}


@dataclass(frozen=True)
class Outcome:
    name: str
    ingest_rate: float  # claims per second
    read: harness.Run  # summed over the replicas (rate), the worst p99


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def signed_bodies(
    batches: int, size: int
) -> tuple[nacl.signing.SigningKey, list[bytes], list[str]]:
    """`batches` bodies of `size` claims, each claim about a fresh CID; their CIDs."""
    key = nacl.signing.SigningKey.generate()
    ts = now_ms()
    known = [cids.midhash_bytes(os.urandom(32)) for _ in range(batches * size)]
    signed = [claims.sign(key, cid, "title", f"title {i}", ts) for i, cid in enumerate(known)]
    bodies = [harness.claims_body(signed[i : i + size]) for i in range(0, len(signed), size)]
    return key, bodies, known


@contextlib.contextmanager
def replicas(root: Path, storage: str, count: int) -> Iterator[list[harness.ServerProc]]:
    """`count` servers on `storage`: the first makes its data directory; the others copy its
    keys and token (docs/scale-out.md, "Replicas")."""
    with contextlib.ExitStack() as stack:
        first = root / "r0" / "data"
        first.mkdir(parents=True)
        servers = [
            stack.enter_context(harness.metanode_server(first, **QUIET, METANODE_STORAGE=storage))
        ]
        for n in range(1, count):
            data = root / f"r{n}" / "data"
            data.mkdir(parents=True)
            for name in ("api-token", "session-secret"):
                (data / name).write_bytes((first / name).read_bytes())
            subprocess.run(["cp", "-a", str(first / "keys"), str(data / "keys")], check=True)
            servers.append(
                stack.enter_context(
                    harness.metanode_server(data, **QUIET, METANODE_STORAGE=storage)
                )
            )
        yield servers


async def ingest(
    servers: Sequence[harness.ServerProc],
    root: Path,
    bodies: Sequence[bytes],
    size: int,
    clients: int,
) -> float:
    """Post every body, split evenly over the servers; claims per second overall."""
    headers = harness.auth(root / "r0" / "data")
    shares = [bodies[n :: len(servers)] for n in range(len(servers))]
    begin = time.perf_counter()
    await asyncio.gather(
        *(
            harness.post_batches(
                s.url, headers, share, [size] * len(share), clients // len(servers)
            )
            for s, share in zip(servers, shares, strict=True)
        )
    )
    return len(bodies) * size / (time.perf_counter() - begin)


def reads(
    servers: Sequence[harness.ServerProc], script: Path, duration: float, clients: int
) -> harness.Run:
    """wrk on every server at once (`clients` connections split among them); summed req/s."""
    share = max(1, clients // len(servers))
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        runs = list(pool.map(lambda s: harness.run_wrk(s.url, script, duration, share, 1), servers))
    return harness.Run(
        sum(r.rate for r in runs),
        max(r.p50_ms for r in runs),
        max(r.p99_ms for r in runs),
        sum(r.requests for r in runs),
    )


def scenario(
    name: str,
    storage: str,
    count: int,
    work: Path,
    args: argparse.Namespace,
    load: tuple[nacl.signing.SigningKey, list[bytes], list[str]],
) -> Outcome:
    key, bodies, known = load
    root = work / name
    with replicas(root, storage, count) as servers:
        harness.register_signer(servers[0], root / "r0" / "data", key)
        rate = asyncio.run(ingest(servers, root, bodies, args.batch, args.clients))
        script = root / "read.lua"
        read.write_lua(script, known[:: max(1, len(known) // 5_000)])
        reads(servers, script, 1, args.clients)  # warm-up
        run = reads(servers, script, args.duration, args.clients)
    print(f"  {name}: done", flush=True)
    return Outcome(name, rate, run)


def database_mib(dsn: str) -> float:
    """The database's size on disk (`pg_database_size`: tables, indexes, TOAST), in MiB."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return float(row[0]) / 2**20 if row else float("nan")


def lookups(cluster: Cluster, work: Path, args: argparse.Namespace) -> None:
    """Part 3: p99 of one sequential client at `--large` claims ÷ at `--small`, on PostgreSQL."""
    start = time.monotonic()
    built: list[tuple[str, Path, list[str], int]] = []
    for label, n in (("small", args.small), ("large", args.large)):
        dsn = cluster.database()
        data = work / f"lookup-{label}" / "data"
        data.mkdir(parents=True)
        scale.log(f"bulk-loading {n:,} claims into PostgreSQL ({label}) …", start)
        known = scale.build(data, n, args.keys_per_record, 5_000, os.cpu_count() or 2, start, dsn)
        built.append((dsn, data, known, n))
        scale.log(f"  database size: {database_mib(dsn):,.0f} MiB", start)
    with (
        harness.metanode_server(built[0][1], **QUIET, METANODE_STORAGE=built[0][0]) as small,
        harness.metanode_server(built[1][1], **QUIET, METANODE_STORAGE=built[1][0]) as large,
    ):
        sides = [
            scale.Latencies("small", small, scale.drawing(built[0][2], "uniform", 0.0), []),
            scale.Latencies("large", large, scale.drawing(built[1][2], "uniform", 0.0), []),
        ]
        try:
            scale.measure(sides, args.lookups, args.lookups // 10)
        finally:
            for side in sides:
                side.close()
    for side, (_, _, known, n) in zip(sides, built, strict=True):
        p50, p99, top = scale.summary(side)
        print(
            f"  {n:>10,} claims ({len(known):,} records): "
            f"p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {top:.2f} ms"
        )
    ratio = scale.summary(sides[1])[1] / scale.summary(sides[0])[1]
    print(
        f"  p99({args.large:,}) / p99({args.small:,}) = {ratio:.2f} (goal <= {scale.GOAL}): "
        f"{'met' if ratio <= scale.GOAL else 'NOT met'}; {args.lookups:,} lookups a size; "
        f"{time.monotonic() - start:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, default=300, help="ingest batches (default 300)")
    parser.add_argument("--batch", type=int, default=100, help="claims a batch (default 100)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of wrk a scenario")
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--keys-per-record", type=int, default=10)
    parser.add_argument("--lookups", type=int, default=3_000, help="timed lookups a size")
    parser.add_argument("--skip-lookups", action="store_true", help="parts 1 and 2 only")
    args = parser.parse_args(argv)
    print(f"load before: {uptime()}", flush=True)
    cluster, why = start_cluster(fsync=True)
    if cluster is None:
        print(f"no PostgreSQL: {why}")
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="metanode-scale-out-") as tmp:
            work = Path(tmp)
            load = signed_bodies(args.batches, args.batch)
            print(
                f"ingest: {args.batches} × {args.batch} claims, {args.clients} clients; "
                f"reads: wrk {args.duration:g} s",
                flush=True,
            )
            outcomes = [
                scenario("sqlite", "sqlite", 1, work, args, load),
                scenario("pg-1", cluster.database(), 1, work, args, load),
                scenario("pg-2", cluster.database(), 2, work, args, load),
            ]
            base = outcomes[0]
            for o in outcomes:
                ingest_ratio, read_ratio = (
                    o.ingest_rate / base.ingest_rate,
                    o.read.rate / base.read.rate,
                )
                print(
                    f"{o.name:>8s}: ingest {o.ingest_rate:8,.0f} claims/s ({ingest_ratio:.2f}× "
                    f"SQLite); GET /api/meta {o.read.rate:8,.0f} req/s ({read_ratio:.2f}×), "
                    f"p99 {o.read.p99_ms:.2f} ms"
                )
            if not args.skip_lookups:
                lookups(cluster, work, args)
    finally:
        cluster.stop()
    print(f"load after: {uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
