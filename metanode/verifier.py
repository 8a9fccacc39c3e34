"""Claim validation off the event loop, coalesced: concurrent requests' claims share jobs.

Signature checks cost ≈ 50 µs a claim and must not run on the event loop. Handing each request's
claims to a pool costs a thread (or process) hop per request, which for one-claim requests is
most of the work (`tools/bench/verify.py`: 0.5 of a plain loop's rate). So, as the truth writer's
group commit does for transactions, the `Verifier` gathers what concurrent requests are waiting
to have validated into one job per free worker, dispatched at once (never waiting for more),
and a large batch is split across the free workers so it uses every core.

A batch of `BULK_CLAIMS` or more goes to worker processes instead (`Processes`, the
`verify_processes` setting), split among them. Half of a claim's validation is Python (field
checks, the RFC 8785 signing bytes, the CID decode) that holds the GIL; on threads it contends
with the writer threads, which then wait for the GIL between their SQLite steps. Measured in
the server: batch-100 ingest +10–12 % (docs/benchmarks.md, "Verify in processes"). Smaller
batches stay on the threads: there the pickling and the pipe cost more than they save.

`POST /api/claims` batches of at most `node.WRITER_VALIDATES` (8) claims do not come here at
all: the truth writer validates them as it gathers their group (`TruthStore.ingest_wire`),
saving the hop here and back (docs/benchmarks.md, "Small batches validated on the truth
writer"). The `Verifier` takes the larger batches and the pages pulled from peers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import multiprocessing
import os
import signal
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from metanode import claims

log = logging.getLogger(__name__)
BULK_CLAIMS = 64  # a batch this large is validated in the worker processes, if there are any
PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the one that started it dies, however it dies
    (Linux's `PR_SET_PDEATHSIG`): a server killed with SIGKILL leaves no process behind. (A
    process pool's workers would otherwise wait forever: each holds its job queue's write end
    itself, so it never reads end-of-file.)"""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _worker_started(parent: int) -> None:
    """A validation process's first step: die with the server; end now if it already died
    before the `prctl` (the process was then handed to init)."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)


Result = tuple[list[claims.Claim], list[dict[str, Any]]]


def validate_runs(
    runs: Sequence[tuple[Sequence[object], int, int]], limits: claims.Limits
) -> list[Result]:
    """`claims.validate_items` of each (items, first index, now) run: one job of many requests'
    claims (module-level, so a process pool can run it too)."""
    return [claims.validate_items(items, first, now, limits) for items, first, now in runs]


@dataclass
class _Run:
    items: Sequence[object]
    first: int
    now: int
    done: asyncio.Future[Result] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def _spread(items: Sequence[object], ways: int) -> list[tuple[Sequence[object], int]]:
    """`items` in at most `ways` consecutive runs of near-equal size, each with its first index."""
    step = max(1, -(-len(items) // ways))
    return [(items[i : i + step], i) for i in range(0, len(items), step)]


def _joined(parts: Sequence[Result]) -> Result:
    return [c for valid, _ in parts for c in valid], [e for _, errs in parts for e in errs]


class Processes:
    """The worker processes large batches are validated in: a process pool, started at its
    first use (a node that never gets a large batch never starts one) with `spawn` (the server
    has threads, which `fork` would copy mid-flight), made anew after a worker died, and dying
    with the server (`die_with_parent`; the pool starts its processes from the thread that
    submits, the event loop's, which lives as long as the server)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.count, context, _worker_started, (os.getpid(),)
            )
        return self._pool

    def broken(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        """A worker of `pool` died (killed, out of memory): it is unusable (every job it held
        failed); the next use starts a new one. Only if `pool` is still the current one: of
        several batches that met the same broken pool, only the first replaces it."""
        if pool is self._pool:
            log.warning("a claim validation process died; starting new ones")
            self.shutdown()

    def shutdown(self) -> None:
        """Let the pool go: its processes end once the jobs they hold are done."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class Verifier:
    """Validates wire claims on `pool` (`jobs` workers), coalescing concurrent requests; a
    batch of `BULK_CLAIMS` or more on `processes`, if given."""

    def __init__(
        self,
        pool: concurrent.futures.Executor,
        jobs: int,
        limits: claims.Limits,
        processes: Processes | None = None,
    ) -> None:
        self.pool = pool
        self.jobs = jobs
        self.limits = limits
        self.processes = processes
        self._pending: list[_Run] = []
        self._running = 0

    async def validate(self, items: Sequence[object], now: int) -> Result:
        """(the valid claims, an error item per invalid one, at its index in `items`)."""
        if self.processes is not None and len(items) >= BULK_CLAIMS:
            pool = self.processes.pool()
            try:
                return await self._in_processes(pool, self.processes.count, items, now)
            except BrokenProcessPool:
                self.processes.broken(pool)  # this batch goes to the threads
        runs = [_Run(run, first, now) for run, first in _spread(items, self.jobs)]
        self._pending += runs
        self._dispatch()
        return _joined([await run.done for run in runs])

    async def _in_processes(
        self, pool: concurrent.futures.Executor, count: int, items: Sequence[object], now: int
    ) -> Result:
        """`items` split among the `count` worker processes of `pool`, one run each."""
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(pool, validate_runs, [(run, first, now)], self.limits)
            for run, first in _spread(items, count)
        ]
        return _joined([part for results in await asyncio.gather(*jobs) for part in results])

    def _dispatch(self) -> None:
        """Start a job on each free worker with an equal share of what is waiting."""
        while self._pending and self._running < self.jobs:
            share = -(-len(self._pending) // (self.jobs - self._running))
            job, self._pending = self._pending[:share], self._pending[share:]
            self._running += 1
            future = asyncio.get_running_loop().run_in_executor(
                self.pool, validate_runs, [(r.items, r.first, r.now) for r in job], self.limits
            )
            future.add_done_callback(functools.partial(self._finished, job))

    def _finished(self, job: list[_Run], future: asyncio.Future[list[Result]]) -> None:
        self._running -= 1
        error = future.exception()
        for index, run in enumerate(job):
            if run.done.done():  # its request was cancelled
                continue
            if error is not None:
                run.done.set_exception(error)
            else:
                run.done.set_result(future.result()[index])
        self._dispatch()
