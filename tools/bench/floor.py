"""What the ingest goals ask of this machine: each stage's own cost, and the best ratio it allows.

Run: `.venv/bin/python tools/bench/floor.py [--claims 4000] [--seconds 3]`.

Issue 18's ingest goals are ratios to one core's raw Ed25519 verify: one claim a request with 8
clients >= 0.1, batches of 100 with 8 clients >= 0.5. This script measures, in one run, what a
claim costs in each stage of the write path when that stage runs alone, and from those costs
the best ratio the machine could reach if nothing else cost anything: no GIL, no thread hand-off,
no client, every core busy all the time. A goal above that ceiling cannot be met by tuning how
the stages overlap; only by making a stage itself cheaper, or by changing the shape the ceiling
assumes (docs/benchmarks.md, "What the ingest goals ask of this machine").

Measured, same run, same claims (each about its own fresh CID, one registered signer):

* raw verify: `VerifyKey.verify` over precomputed signing bytes, a plain loop (the baseline);
* validate: `claims.validate` of one wire claim (field rules, canonical bytes, verify), one thread;
* truth: `TruthStore.ingest_sync` of a group (8 claims: the 8 one-claim requests one group commit
  holds; 200: the ~2 batches of 100 it holds), CPU and wall time, COMMIT (fsync) included;
* cache: `CacheStore.apply_sync` of what that group wrote, CPU and wall time;
* HTTP: what uvicorn and Starlette alone spend on the event loop to read, parse and answer the
  same POST bodies: `bare_app.py`'s `POST /api/claims` under `wrk` with 8 connections, CPU per
  claim (any handler on this stack pays it); beside it, for comparison, a real `metanode serve`'s
  main thread under the same load (its handler, the hand-offs to the threads, the applier).

Ceilings (ratios to raw verify):

* batch 1, lockstep: 8 clients each wait for their answer, so one cycle is the HTTP work of 8
  requests on the one event loop, their 8 validations on the truth writer's thread (where a
  small batch is validated, as its group is gathered), then the group's truth and cache
  transactions one after the other (the cache applies what the truth committed): 8 / that time;
* batch 1, every core: the CPU a request costs in all stages, spread perfectly over every core;
* batch 100, every core: the same for a claim of a batch of 100.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import harness
import ingest
import nacl.signing

from metanode.clock import now_ms

GOALS = {"batch 1, lockstep": 0.1, "batch 1, every core": 0.1, "batch 100, every core": 0.5}
CLIENTS = 8  # the goals' clients; one group commit holds up to one request of each
# wrk posting the bodies of a file in turn, round and round (the bare app stores nothing)
CYCLE_LUA = (
    ingest.BODIES_LUA
    + """request = function()
  n = n %% #bodies + 1
  return wrk.format(nil, "/api/claims", nil, bodies[n])
end
"""
    + harness.WRK_DONE.replace("%", "%%")
)


def bodies_of(key: nacl.signing.SigningKey, batch: int, seconds: float, now: int) -> list[bytes]:
    """Enough POST /api/claims bodies of `batch` new claims for `seconds` of wrk."""
    n = int(seconds * 3000) if batch == 1 else int(seconds * 12_000) // batch * batch
    signed = ingest.make_claims(key, n, now, "loop")
    return [harness.claims_body(signed[i : i + batch]) for i in range(0, n, batch)]


def loop_cost(
    key: nacl.signing.SigningKey, bodies: Sequence[bytes], batch: int, seconds: float, now: int
) -> tuple[float, float]:
    """(a real node's main thread CPU seconds a claim, claims/s) under `wrk` with `CLIENTS`
    connections posting `bodies` (of `batch` new claims each)."""
    with tempfile.TemporaryDirectory(prefix="metanode-floor-") as tmp:
        data_dir = Path(tmp) / "data"
        with harness.metanode_server(data_dir) as server:
            harness.register_signer(server, data_dir, key)
            warmup = ingest.make_claims(key, batch, now, "warm-up")
            harness.post_all(server, data_dir, [harness.claims_body(warmup)])
            with harness.CpuMeter(server.pid) as meter:
                posted, elapsed = ingest.wrk_ingest(server, data_dir, bodies, CLIENTS, seconds)
    main_thread = meter.by_tid.get(server.pid, 0.0)
    return main_thread / (posted * batch), posted * batch / elapsed


def bare_cost(bodies: Sequence[bytes], batch: int, seconds: float) -> float:
    """CPU seconds a claim of `bare_app.py`'s POST /api/claims (uvicorn and Starlette reading,
    parsing and answering the same bodies, nothing else) under `wrk` with `CLIENTS`
    connections: what any POST handler on this stack pays on the event loop."""
    with tempfile.TemporaryDirectory(prefix="metanode-floor-") as tmp:
        lines, script = Path(tmp) / "bodies.jsonl", Path(tmp) / "post.lua"
        lines.write_bytes(b"\n".join(bodies) + b"\n")
        script.write_text(CYCLE_LUA % lines, encoding="utf-8")
        port = harness.free_port()
        bare = harness.ServerProc(
            [sys.executable, str(Path(__file__).with_name("bare_app.py")), "--port", str(port)],
            port,
            cwd=Path(tmp),
            log_path=Path(tmp) / f"bare-{port}.log",
        )
        try:
            bare.start("/api/meta/x")
            with harness.CpuMeter(bare.pid) as meter:
                posted = harness.run_wrk(bare.url, script, seconds, CLIENTS, 1).requests
        finally:
            bare.stop()
    return meter.total / (posted * batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--claims", type=int, default=4000, help="claims a stage (default 4000)")
    parser.add_argument("--seconds", type=float, default=3.0, help="wrk seconds (default 3)")
    args = parser.parse_args(argv)
    if args.claims < 200 or args.seconds <= 0:
        parser.error("need --claims >= 200 and --seconds > 0")
    cores = os.cpu_count() or 1
    key = nacl.signing.SigningKey.generate()
    now = now_ms()
    print(f"signing {args.claims:,} claims …", flush=True)
    signed = ingest.make_claims(key, args.claims, now, "floor")
    raw = max(ingest.raw_verify_rate(key, signed) for _ in range(2))
    validate = ingest.validate_cost(
        [c.wire() for c in ingest.make_claims(key, 2000, now, "v")], now
    )
    truth8, cache8 = ingest.writer_costs(signed, key, CLIENTS, now)
    truth200, cache200 = ingest.writer_costs(signed, key, 200, now)
    print("measuring the server's event loop under wrk …", flush=True)
    single, hundreds = bodies_of(key, 1, args.seconds, now), bodies_of(key, 100, args.seconds, now)
    loop1, rate1 = loop_cost(key, single, 1, args.seconds, now)
    loop100, rate100 = loop_cost(key, hundreds, 100, args.seconds, now)
    bare1, bare100 = bare_cost(single, 1, args.seconds), bare_cost(hundreds, 100, args.seconds)

    us = 1e6
    print(f"\nraw verify, one core: {raw:,.0f}/s ({us / raw:.1f} µs a claim); {cores} cores")
    print("stage costs a claim, each stage alone (µs):")
    print(f"  validate                       {validate * us:7.1f} CPU")
    for name, stage in (
        ("truth, groups of 8", truth8),
        ("cache, groups of 8", cache8),
        ("truth, groups of 200", truth200),
        ("cache, groups of 200", cache200),
    ):
        print(f"  {name:30s} {stage.cpu * us:7.1f} CPU {stage.wall * us:7.1f} wall")
    for name, bare, loop, rate in (
        ("batch 1", bare1, loop1, rate1),
        ("batch 100", bare100, loop100, rate100),
    ):
        print(
            f"  HTTP POST, {name:19s} {bare * us:7.1f} CPU in the bare Starlette app; "
            f"metanode's event loop {loop * us:.1f} (at {rate:,.0f} claims/s)"
        )

    cycle = CLIENTS * (bare1 + validate + truth8.wall + cache8.wall)
    per_request = bare1 + validate + truth8.cpu + cache8.cpu
    per_claim = bare100 + validate + truth200.cpu + cache200.cpu
    ceilings = {
        "batch 1, lockstep": CLIENTS / cycle / raw,
        "batch 1, every core": cores / per_request / raw,
        "batch 100, every core": cores / per_claim / raw,
    }
    print("\nceilings (ratio to raw verify if nothing but the stages cost anything):")
    for name, ceiling in ceilings.items():
        goal = GOALS[name]
        verdict = "reachable" if ceiling >= goal else "NOT reachable"
        print(f"  {name:22s} {ceiling:6.3f}  goal >= {goal}: {verdict}")
    print(
        f"\nbatch 1 lockstep cycle for {CLIENTS} requests: {cycle * 1e3:.2f} ms "
        f"(HTTP {CLIENTS * bare1 * 1e3:.2f}, validation {CLIENTS * validate * 1e3:.2f}, "
        f"truth {CLIENTS * truth8.wall * 1e3:.2f}, cache {CLIENTS * cache8.wall * 1e3:.2f})"
    )
    print(
        f"server as measured: batch 1 {rate1 / raw:.3f}, batch 100 {rate100 / raw:.3f} "
        "(ratios to the same raw verify)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
