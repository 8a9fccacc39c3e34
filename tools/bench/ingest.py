"""Ingest benchmark: claims/s through a real `metanode serve` vs raw Ed25519 verify on one core.

Run: `.venv/bin/python tools/bench/ingest.py [--n 20000] [--batch 500] [--clients 2]`.

A fresh data directory in a temporary directory; `metanode serve` (uvicorn, default settings) on a
free loopback port; one signer registered through `POST /api/signers` with the data directory's
API token. N claims (key `title`, each about its own fresh midhash CID, one signer) are signed
with `metanode.claims.sign` and serialised into `POST /api/claims` bodies of `--batch` claims
before anything is timed. One extra batch of other claims is posted first, untimed, to warm the
server (thread pool, lazy imports). Then `--clients` httpx clients (each its own keep-alive
connection) take batches from one shared queue; the time is the wall time from the first post to
the last response, and every response must be 200 with every claim `accepted`.

Baseline, same run, same claims: `nacl.signing.VerifyKey.verify(signing_bytes, sig)` in a plain
loop on one core, signing bytes precomputed and the key object built once, i.e. the floor every
implementation pays per claim. It is timed just before and just after the ingest (server idle)
and the faster of the two is used. Ratio = ingest claims/s / raw verify/s (goal >= 0.5).

`--rounds N` repeats all of it on a fresh server each round (a new data directory, so the same
claims are new again) and prints the median ratio with its range: on a shared 2-vCPU VM one
round of the same build moved by up to 1.9x (docs/benchmarks.md, "What the ingest goals ask of
this machine"), so a single round says little.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import harness
import httpx
import nacl.signing

from metanode import cache, claims, config, maintenance, rid, truth
from metanode import cid as cids
from metanode.clock import now_ms

GOAL = 0.5  # batches of 100 or more
GOAL_SINGLE = 0.1  # one claim a request
# wrk's script: the bodies of a file (`%s`, its path), posted to /api/claims as JSON
BODIES_LUA = """
local bodies = {}
for line in io.lines("%s") do bodies[#bodies + 1] = line end
local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
"""
# ...each once, in order, with the token (`%s`)
POST_LUA = (
    BODIES_LUA
    + """wrk.headers["Authorization"] = "Bearer %s"
request = function()
  n = n + 1
  return wrk.format(nil, "/api/claims", nil, bodies[n] or bodies[#bodies])
end
"""
    + harness.WRK_DONE.replace("%", "%%")
)


def group_sizes(server: harness.ServerProc, data_dir: Path) -> tuple[float, float]:
    """(group transactions, batches they held) from the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers=harness.auth(data_dir), timeout=30).text
    found = dict(
        line.split() for line in text.splitlines() if line.startswith("metanode_ingest_group")
    )
    return float(found["metanode_ingest_groups_total"]), float(
        found["metanode_ingest_grouped_total"]
    )


def wrk_ingest(
    server: harness.ServerProc,
    data_dir: Path,
    bodies: Sequence[bytes],
    clients: int,
    seconds: float,
) -> tuple[int, float]:
    """Post `bodies` in order with wrk (`clients` connections, one thread) for `seconds`:
    (bodies posted, seconds). Far less client CPU than httpx, so a batch of one claim measures
    the server. Every body must be posted once: more requests than bodies is an error."""
    script = data_dir.parent / "post.lua"
    lines = data_dir.parent / "bodies.jsonl"
    lines.write_bytes(b"\n".join(bodies) + b"\n")
    script.write_text(POST_LUA % (lines, harness.token(data_dir)), encoding="utf-8")
    run = harness.run_wrk(server.url, script, seconds, clients, 1)
    if run.requests > len(bodies):
        raise RuntimeError(f"wrk posted {run.requests} bodies of {len(bodies)}: raise --n")
    return run.requests, run.requests / run.rate


def make_claims(key: nacl.signing.SigningKey, n: int, ts: int, tag: str) -> list[claims.Claim]:
    return [
        claims.sign(key, cids.midhash_bytes(os.urandom(32)), "title", f"{tag} {i}", ts)
        for i in range(n)
    ]


def raw_verify_rate(key: nacl.signing.SigningKey, signed: Sequence[claims.Claim]) -> float:
    """Raw PyNaCl verifies per second over `signed`, one core, signing bytes precomputed."""
    vk = nacl.signing.VerifyKey(bytes(key.verify_key))
    pairs = [(c.signing_bytes(), c.sig) for c in signed]
    start = time.perf_counter()
    for message, sig in pairs:
        vk.verify(message, sig)
    return len(pairs) / (time.perf_counter() - start)


@dataclass(frozen=True)
class Stage:
    """One stage's cost a claim: CPU seconds and wall seconds."""

    cpu: float
    wall: float


def validate_cost(wires: Sequence[dict[str, object]], now: int) -> float:
    """CPU seconds to validate one wire claim, on this thread."""
    start = time.thread_time()
    for wire in wires:
        claims.validate(wire, now)
    return (time.thread_time() - start) / len(wires)


def writer_costs(
    signed: Sequence[claims.Claim],
    key: nacl.signing.SigningKey,
    group: int,
    now: int,
    others: Sequence[str] = (),
) -> tuple[Stage, Stage]:
    """(truth, cache) cost a claim when groups of `group` claims are committed and applied one
    after the other on a fresh data directory, the uids `others` registered beside `key`'s
    (signers that vote on nothing here). The writer threads run each transaction while this
    thread waits, so the process's CPU time is theirs."""
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        settings = config.load(env={}, overrides={"data_dir": Path(tmp)})
        maintenance.open_store(settings)
        with (
            truth.TruthStore(settings.truth_path, lambda: now) as source,
            cache.CacheStore(settings.cache_path, lambda: now) as store,
        ):
            source.add_signer_sync(claims.uid_of(bytes(key.verify_key)), "bench", 1, False)
            for n, uid in enumerate(others):
                source.add_signer_sync(uid, f"other {n}", 1, False)
            store.build_sync(source)
            minter, policy = rid.Minter(), truth.Policy()
            truth_cpu = truth_wall = cache_cpu = cache_wall = 0.0
            for start in range(0, len(signed), group):
                cpu, wall = time.process_time(), time.perf_counter()
                result = source.ingest_sync(signed[start : start + group], minter, policy, now)
                mid_cpu, mid_wall = time.process_time(), time.perf_counter()
                store.apply_sync(source, (result.written,))
                truth_cpu += mid_cpu - cpu
                truth_wall += mid_wall - wall
                cache_cpu += time.process_time() - mid_cpu
                cache_wall += time.perf_counter() - mid_wall
    n = len(signed)
    return Stage(truth_cpu / n, truth_wall / n), Stage(cache_cpu / n, cache_wall / n)


def breakdown(
    key: nacl.signing.SigningKey, signed: Sequence[claims.Claim], batch: int, ts: int
) -> dict[str, float]:
    """µs per claim of each stage of ingest, run in-process on one thread on a fresh data dir.

    The stages a node runs for every batch: validate every claim (on the verify threads, or for
    a batch of at most 8 on the truth writer's thread), `truth.ingest_txn`
    (`TruthStore.ingest_sync`, on the truth writer thread) and `cache.apply_txn`
    (`CacheStore.apply_sync`, handed what the truth wrote, on the cache writer thread), each as
    its own transaction, as the server commits them (`writer_costs`)."""
    truth_cost, cache_cost = writer_costs(signed, key, batch, ts)
    return {
        "validate": validate_cost([c.wire() for c in signed], ts) * 1e6,
        "truth.ingest_txn": truth_cost.wall * 1e6,
        "cache.apply_txn": cache_cost.wall * 1e6,
    }


@dataclass(frozen=True)
class Round:
    """One round's figures: a fresh server, the same claims."""

    posted: int
    elapsed: float
    raw_before: float
    raw_after: float
    groups: float
    grouped: float
    cpu: str
    client_cpu: float

    @property
    def rate(self) -> float:
        return self.posted / self.elapsed

    @property
    def raw(self) -> float:
        return max(self.raw_before, self.raw_after)

    @property
    def ratio(self) -> float:
        return self.rate / self.raw

    def report(self, args: argparse.Namespace, goal: float) -> None:
        client = "httpx" if args.wrk is None else "wrk"
        print(
            f"ingest: {self.rate:,.0f} claims/s ({self.posted:,} claims in {self.elapsed:.2f} s, "
            f"batches of {args.batch}, {args.clients} clients, {client}, all 200)"
        )
        print(
            f"raw nacl verify, one core: {self.raw:,.0f}/s (before {self.raw_before:,.0f}/s, "
            f"after {self.raw_after:,.0f}/s; the faster is used)"
        )
        met = "met" if self.ratio >= goal else "NOT met"
        print(f"ratio {self.ratio:.3f} (goal >= {goal}): {met}")
        print(f"group commit: {self.grouped:,.0f} batches in {self.groups:,.0f} truth transactions")
        print(self.cpu)
        print(f"client (this process) CPU {self.client_cpu:.2f} s")


def one_round(
    args: argparse.Namespace,
    key: nacl.signing.SigningKey,
    signed: Sequence[claims.Claim],
    warmup: Sequence[claims.Claim],
    bodies: Sequence[bytes],
    sizes: Sequence[int],
) -> Round:
    """Post `bodies` to a fresh `metanode serve` (a new data directory: the claims are new to
    it), between two raw-verify baselines."""
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        env = {}
        if args.verify_processes is not None:
            env["METANODE_VERIFY_PROCESSES"] = str(args.verify_processes)
        env["METANODE_WORKERS"] = str(args.workers)
        with harness.metanode_server(data_dir, **env) as server:
            harness.register_signer(server, data_dir, key)
            harness.post_all(server, data_dir, [harness.claims_body(warmup)])
            raw_before = raw_verify_rate(key, signed)
            headers = {**harness.auth(data_dir), "Content-Type": "application/json"}
            print(
                f"posting {len(bodies)} batches of {args.batch} with {args.clients} clients …",
                flush=True,
            )
            own = os.times()
            posted = len(signed)
            with (
                harness.py_spy(server.pid, args.py_spy),
                harness.CpuMeter(server.pid, tree=args.workers > 1) as cpu,
            ):
                if args.wrk is not None:
                    sent, elapsed = wrk_ingest(server, data_dir, bodies, args.clients, args.wrk)
                    posted = sum(sizes[:sent])
                else:
                    elapsed = asyncio.run(
                        harness.post_batches(server.url, headers, bodies, sizes, args.clients)
                    )
            client_cpu = sum(os.times()[:2]) - sum(own[:2])
            groups, grouped = group_sizes(server, data_dir)
            raw_after = raw_verify_rate(key, signed)
            names = harness.thread_names(server.pid)
    return Round(
        posted, elapsed, raw_before, raw_after, groups, grouped, cpu.report(names), client_cpu
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20_000, help="claims to ingest (default 20000)")
    parser.add_argument("--batch", type=int, default=500, help="claims per POST (default 500)")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients (default 2)")
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="OUT",
        help="sample the server with py-spy during the ingest; raw output to OUT",
    )
    parser.add_argument(
        "--wrk",
        type=float,
        default=None,
        metavar="SECONDS",
        help="post with wrk for SECONDS instead of httpx (as many bodies as it gets through)",
    )
    parser.add_argument(
        "--verify-processes",
        type=int,
        default=None,
        metavar="N",
        help="the server's verify_processes setting (default: the node's default)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="the server's serving processes (`serve --workers N`; default 1)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="afterwards, time each ingest stage in-process on one thread",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds, each on a fresh server; with more than one, the median ratio (default 1)",
    )
    args = parser.parse_args(argv)
    if args.n < 1 or not 1 <= args.batch <= 1000 or args.clients < 1 or args.rounds < 1:
        parser.error("need --n >= 1, 1 <= --batch <= 1000, --clients >= 1, --rounds >= 1")

    key = nacl.signing.SigningKey.generate()
    ts = now_ms()
    print(f"signing {args.n:,} claims …", flush=True)
    signed = make_claims(key, args.n, ts, "title")
    warmup = make_claims(key, args.batch, ts, "warm-up")
    batches = [signed[i : i + args.batch] for i in range(0, len(signed), args.batch)]
    bodies = [harness.claims_body(b) for b in batches]
    sizes = [len(b) for b in batches]

    goal = GOAL_SINGLE if args.batch == 1 else GOAL
    rounds: list[Round] = []
    for number in range(1, args.rounds + 1):
        rounds.append(one_round(args, key, signed, warmup, bodies, sizes))
        print(f"round {number}:")
        rounds[-1].report(args, goal)
    ratios = sorted(done.ratio for done in rounds)
    raw = max(done.raw for done in rounds)
    if len(rounds) > 1:
        print(
            f"median ratio {statistics.median(ratios):.3f} over {len(rounds)} rounds "
            f"(from {ratios[0]:.3f} to {ratios[-1]:.3f}; goal >= {goal}: "
            f"{'met' if statistics.median(ratios) >= goal else 'NOT met'})"
        )
    if args.breakdown:
        stages = breakdown(key, make_claims(key, args.n, ts, "breakdown"), args.batch, ts)
        print(
            f"in-process breakdown, one thread, µs per claim ({args.n:,} new claims, "
            f"batches of {args.batch}):"
        )
        for stage, micros in stages.items():
            print(f"  {micros:7.1f}  {stage}")
        serial = stages["truth.ingest_txn"] + stages["cache.apply_txn"]
        print(f"  {1e6 / raw:7.1f}  raw nacl verify (the baseline)")
        print(
            f"  the two writer stages alone allow at most {1e6 / serial:,.0f} claims/s "
            f"= ratio {1e6 / serial / raw:.2f}"
        )
    if args.py_spy is not None:
        print(f"server profile ({args.py_spy}):\n{harness.profile_summary(args.py_spy)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
