"""Scale-out benchmark (issue 20): the node on PostgreSQL against the SQLite default, same run.

Run: `.venv/bin/python tools/bench/scale_out.py [--rounds 3] [--seconds 5] [--replicas 1 2]
[--claims 1000000] [--small 10000] [--work-dir DIR]`.

A PostgreSQL cluster of our own (tools/bench/pgcluster.py, Debian's `postgresql`) with its
durable defaults (`fsync` and `synchronous_commit` on: SQLite runs `synchronous=FULL`) and
`shared_buffers` of `--shared-buffers`, on loopback, in `--work-dir` (kept and reused) or a
temporary directory.

1. Ingest and reads, `--rounds` rounds; each round runs every side on fresh stores, in an order
   rotated round by round so machine noise lands on all alike: `sqlite` (one `metanode serve`,
   the default storage), and `pg×N` for each N of `--replicas` (N `metanode serve` on one new
   database; replica n>0 a copy of the first one's data directory (keys, API token), as
   docs/scale-out.md lays them out). On each: one signer registered, `--records` records of 10
   claims posted untimed (the read set, as tools/bench/read.py does), one warm-up batch; then
   * ingest, batches of 100 and then of 1, 8 connections (`--clients`) in all, split evenly
     over the replicas: wrk (one per replica, at once, `--seconds`) posting pre-signed bodies
     of claims about fresh CIDs (tools/bench/ingest.py's `wrk_ingest`); every answer 200 with
     every claim accepted (each is acknowledged only once stored and readable);
   * `GET /api/meta/{cid}` of random known records, 8 connections split the same way (wrk,
     tools/bench/read.py's script, `--seconds`), every answer 200.
   Printed: the median rate of each side, and the ratios pg×1 ÷ sqlite, pg×N ÷ pg×1 (medians
   of the per-round ratios).
2. Lookups at scale: stores of `--small` and `--claims` claims on both backends, built as
   tools/bench/scale.py builds them (`TruthStore.ingest_sync` in transactions of `--chunk`
   claims, then `maintenance.rebuild_cache`; reused from `--work-dir`); four servers at once,
   one sequential keep-alive client alternating between them request by request (scale.py's
   `measure`). Printed: p50/p99/max of each, the ratio p99(large) ÷ p99(small) per backend
   (goal ≤ 1.5), bytes on disk (truth.db + cache.db; the PostgreSQL database's size).

`--phases` picks `ingest` and/or `lookup`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import harness
import ingest
import nacl.signing
import pgcluster
import read
import scale

from metanode.clock import now_ms

log = scale.log

T = TypeVar("T")
GOAL = scale.GOAL
LOCK_NAME = "lock"  # metanode/datadir.py's lock file: never copied to a replica (it names a pid)


@dataclass
class Side:
    """One way of running the node: SQLite, or `replicas` servers on one PostgreSQL database."""

    name: str
    replicas: int  # 0: SQLite
    rates: dict[str, list[float]] = field(default_factory=dict)

    def record(self, metric: str, rate: float) -> None:
        self.rates.setdefault(metric, []).append(rate)


@dataclass(frozen=True)
class Load:
    """What every side of a round posts: the same pre-signed bodies (each side's stores are
    new, so the same claims are new to each)."""

    key: nacl.signing.SigningKey
    warmup: bytes
    hundreds: list[bytes]  # batches of 100 claims
    singles: list[bytes]  # batches of 1 claim


def signed_load(hundreds: int, singles: int) -> Load:
    key = nacl.signing.SigningKey.generate()
    ts = now_ms()
    batch = ingest.make_claims(key, hundreds, ts, "hundred")
    one = ingest.make_claims(key, singles, ts, "single")
    return Load(
        key,
        harness.claims_body(ingest.make_claims(key, 100, ts, "warm-up")),
        [harness.claims_body(batch[i : i + 100]) for i in range(0, len(batch), 100)],
        [harness.claims_body([c]) for c in one],
    )


@contextlib.contextmanager
def serving(root: Path, replicas: int, dsn: str) -> Iterator[list[harness.ServerProc]]:
    """`replicas` servers on the database `dsn` (or one on SQLite if `replicas` is 0), each with
    a data directory in `root`; the first starts alone and the others copy its keys."""
    env = {"METANODE_STORAGE": dsn} if replicas else {}
    with contextlib.ExitStack() as stack:
        first = root / "r0" / "data"
        first.parent.mkdir(parents=True)
        servers = [stack.enter_context(harness.metanode_server(first, **env))]
        for n in range(1, replicas):
            data_dir = root / f"r{n}" / "data"
            ignore = shutil.ignore_patterns(LOCK_NAME, "*.sock")
            shutil.copytree(first, data_dir, ignore=ignore)
            servers.append(stack.enter_context(harness.metanode_server(data_dir, **env)))
        yield servers


def data_dir_of(server: harness.ServerProc) -> Path:
    """The data directory a `harness.metanode_server` serves (its `--data-dir` argument)."""
    return Path(server.argv[server.argv.index("--data-dir") + 1])


def split(items: Sequence[T], parts: int) -> list[list[T]]:
    """`items` dealt into `parts` lists of (nearly) equal length."""
    return [list(items[n::parts]) for n in range(parts)]


def at_once(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Run the jobs (each a wrk process) in threads at the same time; their results in order."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def ingest_rate(
    servers: list[harness.ServerProc], bodies: list[bytes], per: int, clients: int, seconds: float
) -> float:
    """Claims a second posted with wrk to all servers at once, `clients` connections in all."""
    shares = split(bodies, len(servers))
    connections = max(1, clients // len(servers))

    def job(server: harness.ServerProc, share: list[bytes]) -> Callable[[], tuple[int, float]]:
        data_dir = data_dir_of(server)
        return lambda: ingest.wrk_ingest(server, data_dir, share, connections, seconds)

    done = at_once([job(s, share) for s, share in zip(servers, shares, strict=True)])
    return sum(sent for sent, _ in done) * per / max(took for _, took in done)


def read_rate(
    servers: list[harness.ServerProc], known: list[str], clients: int, seconds: float
) -> float:
    """GET /api/meta of random known records a second, `clients` connections in all."""
    connections = max(1, clients // len(servers))

    def job(server: harness.ServerProc) -> Callable[[], harness.Run]:
        script = data_dir_of(server).parent / "read.lua"
        read.write_lua(script, known)
        return lambda: harness.run_wrk(server.url, script, seconds, connections, 1)

    return sum(run.rate for run in at_once([job(s) for s in servers]))


def run_side(
    side: Side, root: Path, dsn: str, load: Load, args: argparse.Namespace, start: float
) -> None:
    """One side's round on fresh stores: the read set, ingest 100 and 1, then reads."""
    with serving(root, side.replicas, dsn) as servers:
        first = servers[0]
        first_dir = data_dir_of(first)
        harness.register_signer(first, first_dir, load.key)
        known = read.populate(first, first_dir, args.records, len(harness.RECORD_KEYS))
        for server in servers:  # the second time a duplicate: warms that replica all the same
            harness.post_all(server, first_dir, [load.warmup])
        side.record(
            "ingest 100", ingest_rate(servers, load.hundreds, 100, args.clients, args.seconds)
        )
        side.record("ingest 1", ingest_rate(servers, load.singles, 1, args.clients, args.seconds))
        side.record("GET /api/meta", read_rate(servers, known, args.clients, args.seconds))
    log(
        f"  {side.name}: "
        + ", ".join(f"{metric} {rates[-1]:,.0f}/s" for metric, rates in side.rates.items()),
        start,
    )


def ratio(top: Side, bottom: Side, metric: str) -> float:
    """Median of the per-round ratios of `metric`."""
    pairs = zip(top.rates[metric], bottom.rates[metric], strict=True)
    return statistics.median(a / b for a, b in pairs)


def ingest_phase(
    cluster: pgcluster.Cluster, root: Path, args: argparse.Namespace, start: float
) -> None:
    sides = [Side("sqlite", 0), *(Side(f"pg×{n}", n) for n in args.replicas)]
    log(f"signing {args.hundreds:,} + {args.singles:,} claims …", start)
    load = signed_load(args.hundreds, args.singles)
    for round_ in range(args.rounds):
        log(f"round {round_ + 1} of {args.rounds}", start)
        for side in sides[round_ % len(sides) :] + sides[: round_ % len(sides)]:
            where = root / f"round-{round_}-{side.replicas}"
            dsn = cluster.database(f"ingest_{secrets.token_hex(4)}") if side.replicas else "sqlite"
            try:
                run_side(side, where, dsn, load, args, start)
            finally:
                shutil.rmtree(where, ignore_errors=True)
                if side.replicas:
                    cluster.drop(dsn)
    print(f"\n{'side':>8s} {'ingest 100/s':>14s} {'ingest 1/s':>12s} {'GET meta/s':>12s}")
    for side in sides:
        cells = [
            statistics.median(side.rates[m]) for m in ("ingest 100", "ingest 1", "GET /api/meta")
        ]
        print(f"{side.name:>8s} " + " ".join(f"{c:>12,.0f}" for c in cells))
    base, pg1 = sides[0], sides[1] if len(sides) > 1 else None
    for metric in ("ingest 100", "ingest 1", "GET /api/meta"):
        parts = [f"{metric}:"]
        for side in sides[1:]:
            parts.append(f"{side.name} ÷ sqlite {ratio(side, base, metric):.2f}")
            if pg1 is not None and side is not pg1:
                parts.append(f"{side.name} ÷ {pg1.name} {ratio(side, pg1, metric):.2f}")
        print("  ".join(parts))
    print(
        f"[{args.rounds} rounds of {args.seconds:.0f} s per measurement; wrk, {args.clients} "
        f"connections in all; per-side rates are medians, ratios medians of per-round ratios]"
    )


def lookup_store(
    cluster: pgcluster.Cluster,
    root: Path,
    n: int,
    backend: str,
    args: argparse.Namespace,
    start: float,
) -> tuple[Path, list[str], str, int]:
    """A built store of `n` claims on `backend`: (data dir, known CIDs, storage, bytes on disk)."""
    name = f"{backend}-{n}"
    if backend == "sqlite":
        data_dir, known = scale.prepared(root, name, n, args, start)
        return data_dir, known, "sqlite", harness.dir_size(data_dir, scale.DB_FILES)
    dsn = cluster.dsn(f"lookup_{n}")

    def empty() -> None:
        cluster.drop(dsn)
        cluster.database(f"lookup_{n}")

    data_dir, known = scale.prepared(root, name, n, args, start, dsn, empty)
    return data_dir, known, dsn, cluster.database_bytes(dsn)


def lookup_phase(
    cluster: pgcluster.Cluster, root: Path, args: argparse.Namespace, start: float
) -> None:
    built = {
        (backend, n): lookup_store(cluster, root, n, backend, args, start)
        for backend in ("sqlite", "postgresql")
        for n in (args.small, args.claims)
    }
    log("starting four servers …", start)
    with contextlib.ExitStack() as stack:
        sides = []
        for (backend, n), (data_dir, known, storage, _) in built.items():
            env = {} if storage == "sqlite" else {"METANODE_STORAGE": storage}
            server = stack.enter_context(harness.metanode_server(data_dir, **env))
            draw = scale.drawing(known, "uniform", 0.0)
            sides.append(scale.Latencies(f"{backend} {n:,}", server, draw, []))
        log(f"{args.warmup} + {args.requests:,} lookups per store, alternating …", start)
        try:
            scale.measure(sides, args.requests, args.warmup)
        finally:
            for side in sides:
                side.close()
        rss = [side.server.rss_mib("VmHWM") for side in sides]
    print(
        f"\n{'store':>24s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} "
        f"{'disk MiB':>9s} {'HWM MiB':>8s}"
    )
    for side, (_, _, _, size), hwm in zip(sides, built.values(), rss, strict=True):
        p50, p99, top = scale.summary(side)
        print(f"{side.name:>24s} {p50:8.3f} {p99:8.3f} {top:8.2f} {size / 2**20:9.1f} {hwm:8.1f}")
    for small, large in (sides[0:2], sides[2:4]):
        p99 = scale.summary(large)[1] / scale.summary(small)[1]
        p50 = scale.summary(large)[0] / scale.summary(small)[0]
        print(
            f"{large.name.split()[0]}: p99({args.claims:,}) ÷ p99({args.small:,}) = {p99:.2f} "
            f"(goal ≤ {GOAL}: {'met' if p99 <= GOAL else 'NOT met'}); p50 ratio {p50:.2f}"
        )


@contextlib.contextmanager
def running_cluster(root: Path, shared_buffers: str, keep: bool) -> Iterator[pgcluster.Cluster]:
    """The benchmark's cluster in `root`/pg (made there or reused), durable; stopped at the end,
    its files kept if `keep`."""
    root.chmod(
        root.stat().st_mode | 0o111
    )  # the server's user must reach root/pg (a mkdtemp is 0700)
    (root / "pg").mkdir(exist_ok=True)
    cluster, why = pgcluster.start_cluster(
        root / "pg",
        harness.free_port(),
        durable=True,
        options=(f"shared_buffers={shared_buffers}",),
    )
    if cluster is None:
        raise SystemExit(f"no PostgreSQL: {why}")
    try:
        yield cluster
    finally:
        if keep:
            cluster.pause()
        else:
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--phases", nargs="+", choices=("ingest", "lookup"), default=["ingest", "lookup"]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="each wrk measurement")
    parser.add_argument("--clients", type=int, default=8, help="connections in all (default 8)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1], help="PostgreSQL sides")
    parser.add_argument("--records", type=int, default=2_000, help="records of the read set")
    parser.add_argument("--hundreds", type=int, default=60_000, help="claims for batches of 100")
    parser.add_argument("--singles", type=int, default=15_000, help="claims for batches of 1")
    parser.add_argument("--claims", type=int, default=1_000_000, help="the large lookup store")
    parser.add_argument("--small", type=int, default=10_000, help="the small lookup store")
    parser.add_argument("--keys-per-record", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=5_000, help="claims per truth transaction")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="signers")
    parser.add_argument("--requests", type=int, default=5_000, help="timed lookups per store")
    parser.add_argument("--warmup", type=int, default=500, help="untimed lookups per store")
    parser.add_argument("--shared-buffers", default="1GB", help="PostgreSQL's shared_buffers")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep and reuse data here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(n < 1 for n in args.replicas) or not 1 <= args.keys_per_record <= 10:
        parser.error("need --rounds >= 1, --replicas >= 1, 1 <= --keys-per-record <= 10")
    if not args.keys_per_record <= args.small <= args.claims:
        parser.error("need --keys-per-record <= --small <= --claims")

    start = time.monotonic()
    with (
        scale.work_root(args.work_dir) as root,
        running_cluster(root, args.shared_buffers, args.work_dir is not None) as cluster,
    ):
        if "ingest" in args.phases:
            ingest_phase(cluster, root, args, start)
        if "lookup" in args.phases:
            lookup_phase(cluster, root, args, start)
    print(f"total time {time.monotonic() - start:.0f} s; load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
