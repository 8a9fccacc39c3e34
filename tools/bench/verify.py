"""Where claim validation costs least: threads, a process pool, or one call per batch.

Run: `.venv/bin/python tools/bench/verify.py [--claims 4000] [--clients 8] [--rounds 3]`.

In-process, on a running asyncio loop, `--clients` coroutines validate pre-made wire claims
(each about its own midhash CID, a few signers) in batches of 1 and of 100, as concurrent
requests would, through `claims.validate_items` handed off in one of these ways:

* `threads, chunked` — what `Node._validate` did: the batch split into one chunk per core, each
  chunk a job on a thread pool of one thread per core;
* `threads, one job` — the whole batch one job on that pool;
* `process pool` — the batch split into one chunk per core on a `ProcessPoolExecutor` of one
  process per core (the wire claims pickled there, the `Claim`s pickled back);
* `process pool, one job` — the whole batch one job on that pool;
* `threads, coalesced` / `process pool, coalesced` — `verifier.Verifier` on either pool: what
  concurrent requests wait to have validated is shared out over the free workers at once;
* `verify processes` — what the server does (`verifier.Processes`, one process a core): a batch
  of `BULK_CLAIMS` or more split among processes spoken to from the loop over socket pairs,
  smaller ones on the threads, coalesced.

The baseline, same run: `validate_items` over every claim in a plain loop on one core (no hand-
off, no loop). Reported: claims/s of each way ÷ the baseline, and how long the event loop went
without running at worst (a 1 ms ticker), since the loop must stay free, and the CPU this
process spent a claim (the loop and its threads: what a hand-off costs the server's process,
whose one GIL the writer threads need; a process's own work is not in it). Each way validates
one batch untimed first (processes start at their first batch). Rounds alternate the ways;
medians.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import harness
import nacl.signing

from metanode import cid as cids
from metanode import claims
from metanode.clock import now_ms
from metanode.verifier import BULK_CLAIMS, Processes, Verifier

Way = Callable[[list[object], int], Coroutine[Any, Any, list[claims.Claim]]]
CORES = os.cpu_count() or 2


def make_wire(n: int) -> list[object]:
    keys = [nacl.signing.SigningKey.generate() for _ in range(4)]
    ts = now_ms()
    return [
        claims.sign(keys[i % 4], cids.midhash_bytes(os.urandom(32)), "title", f"t{i}", ts).wire()
        for i in range(n)
    ]


def ways(
    threads: concurrent.futures.Executor, processes: concurrent.futures.Executor
) -> dict[str, Way]:
    def chunked(pool: concurrent.futures.Executor) -> Way:
        async def validate(items: list[object], now: int) -> list[claims.Claim]:
            loop = asyncio.get_running_loop()
            step = max(1, -(-len(items) // CORES))
            parts = await asyncio.gather(
                *(
                    loop.run_in_executor(pool, claims.validate_items, items[i : i + step], i, now)
                    for i in range(0, len(items), step)
                )
            )
            return [claim for part, _ in parts for claim in part]

        return validate

    def whole(pool: concurrent.futures.Executor) -> Way:
        async def validate(items: list[object], now: int) -> list[claims.Claim]:
            loop = asyncio.get_running_loop()
            valid, _ = await loop.run_in_executor(pool, claims.validate_items, items, 0, now)
            return valid

        return validate

    def coalesced(pool: concurrent.futures.Executor) -> Way:
        verifier: list[Verifier] = []  # made on the running loop, at the first call

        async def validate(items: list[object], now: int) -> list[claims.Claim]:
            if not verifier:
                verifier.append(Verifier(pool, CORES, claims.Limits()))
            valid, _ = await verifier[0].validate(items, now)
            return valid

        return validate

    return {
        "verify processes": Spoken(threads),
        "threads, coalesced": coalesced(threads),
        "process pool, coalesced": coalesced(processes),
        "threads, chunked": chunked(threads),
        "threads, one job": whole(threads),
        "process pool": chunked(processes),
        "process pool, one job": whole(processes),
    }


class Spoken:
    """`Verifier` with `Processes`, as the server validates; its processes made on the running
    loop at the first call and let go by `close`, since each round runs its own loop."""

    def __init__(self, threads: concurrent.futures.Executor) -> None:
        self.threads = threads
        self.processes = Processes(CORES)
        self.verifier: Verifier | None = None

    async def __call__(self, items: list[object], now: int) -> list[claims.Claim]:
        if self.verifier is None:
            self.verifier = Verifier(self.threads, CORES, claims.Limits(), self.processes)
        valid, _ = await self.verifier.validate(items, now)
        return valid

    def close(self) -> None:
        self.processes.shutdown()


async def run_way(
    way: Way, wire: list[object], batch: int, clients: int
) -> tuple[float, float, float]:
    """(claims/s, the loop's longest stall in ms, this process's CPU µs a claim) of `clients`
    coroutines validating `wire`, after one untimed batch."""
    await way(wire[:BULK_CLAIMS], now_ms())
    try:
        return await timed_way(way, wire, batch, clients)
    finally:
        if isinstance(way, Spoken):
            way.close()


async def timed_way(
    way: Way, wire: list[object], batch: int, clients: int
) -> tuple[float, float, float]:
    batches = [wire[i : i + batch] for i in range(0, len(wire), batch)]
    queue = iter(batches)
    now = now_ms()

    async def client() -> None:
        for items in queue:
            valid = await way(items, now)
            assert len(valid) == len(items)

    async def all_clients() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.perf_counter() - start

    cpu = time.process_time()
    elapsed, stall_ms = await harness.max_stall_ms(all_clients())
    return len(wire) / elapsed, stall_ms, (time.process_time() - cpu) / len(wire) * 1e6


def baseline(wire: list[object]) -> float:
    start = time.perf_counter()
    valid, _ = claims.validate_items(wire, 0, now_ms())
    assert len(valid) == len(wire)
    return len(wire) / (time.perf_counter() - start)


def warm(pool: concurrent.futures.Executor) -> None:
    """Start every worker of `pool` (a process's first job imports metanode)."""
    list(pool.map(claims.validate_items, [make_wire(4)] * CORES, [0] * CORES, [now_ms()] * CORES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--claims", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    wire = make_wire(args.claims)
    threads = concurrent.futures.ThreadPoolExecutor(max_workers=CORES)
    processes = concurrent.futures.ProcessPoolExecutor(max_workers=CORES)
    warm(threads)
    warm(processes)
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    bases: list[float] = []
    try:
        for _ in range(args.rounds):
            bases.append(baseline(wire))
            for batch in (1, 100):
                for name, way in ways(threads, processes).items():
                    results.setdefault((name, batch), []).append(
                        asyncio.run(run_way(way, wire, batch, args.clients))
                    )
    finally:
        threads.shutdown()
        processes.shutdown()
    base = statistics.median(bases)
    print(f"baseline: validate_items in a plain loop, one core: {base:,.0f} claims/s")
    for (name, batch), runs in results.items():
        rate, stall, cpu = (statistics.median(run[i] for run in runs) for i in range(3))
        print(
            f"batch {batch:3d}, {args.clients} clients, {name:23s}: {rate:8,.0f} claims/s  "
            f"ratio {rate / base:.2f}  loop stall {stall:.1f} ms  here {cpu:5.1f} µs a claim"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
