"""Claim validation off the event loop, coalesced: concurrent requests' claims share jobs.

Signature checks cost ≈ 50 µs a claim and must not run on the event loop. Handing each request's
claims to a pool costs a thread (or process) hop per request, which for one-claim requests is
most of the work (`tools/bench/verify.py`: 0.5 of a plain loop's rate). So, as the truth writer's
group commit does for transactions, the `Verifier` gathers what concurrent requests are waiting
to have validated into one job per free worker, dispatched at once (never waiting for more),
and a large batch is split across the free workers so it uses every core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from metanode import claims

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


class Verifier:
    """Validates wire claims on `pool` (`jobs` workers), coalescing concurrent requests."""

    def __init__(self, pool: concurrent.futures.Executor, jobs: int, limits: claims.Limits) -> None:
        self.pool = pool
        self.jobs = jobs
        self.limits = limits
        self._pending: list[_Run] = []
        self._running = 0

    async def validate(self, items: Sequence[object], now: int) -> Result:
        """(the valid claims, an error item per invalid one, at its index in `items`)."""
        step = max(1, -(-len(items) // self.jobs))  # a large batch spreads over every worker
        runs = [_Run(items[i : i + step], i, now) for i in range(0, len(items), step)]
        self._pending += runs
        self._dispatch()
        parts = [await run.done for run in runs]
        return [c for valid, _ in parts for c in valid], [e for _, errs in parts for e in errs]

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
