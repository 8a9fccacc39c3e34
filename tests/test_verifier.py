"""`verifier.Verifier`: concurrent requests' claims share the pool's jobs, and each request
still gets exactly its own valid claims and its own errors, at its own indexes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from metanode import cid as cids
from metanode import claims
from metanode.verifier import BULK_CLAIMS, Processes, Verifier
from tests.helpers.claims import NOW_MS, Signer

SIGNER = Signer()
GOOD = [SIGNER.claim(cids.midhash_bytes(bytes([n])), "title", f"t{n}") for n in range(8)]
BAD: list[Any] = [
    {**GOOD[0], "value": "tampered"},  # bad signature
    {"cid": GOOD[0]["cid"]},  # missing fields
    "not an object",
]
REQUESTS = st.lists(st.lists(st.sampled_from(GOOD + BAD), max_size=12), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None)
@given(requests=REQUESTS, jobs=st.integers(1, 3))
def test_each_request_gets_its_own_results(requests: list[list[object]], jobs: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:

        async def run() -> list[tuple[list[claims.Claim], list[dict[str, Any]]]]:
            verifier = Verifier(pool, jobs, claims.Limits())
            return await asyncio.gather(*(verifier.validate(items, NOW_MS) for items in requests))

        results = asyncio.run(run())
    for items, (valid, errors) in zip(requests, results, strict=True):
        assert (valid, errors) == claims.validate_items(items, 0, NOW_MS)


def test_a_large_batch_is_validated_in_worker_processes_with_its_errors_at_its_indexes() -> None:
    """A batch of `BULK_CLAIMS` or more is split among real `spawn` worker processes; what
    comes back is exactly what validating it in this process gives: every valid claim, and
    each error at its index in the batch."""
    batch: list[object] = [GOOD[n % len(GOOD)] for n in range(BULK_CLAIMS + 9)]
    for index, bad in zip((3, BULK_CLAIMS // 2 + 1, BULK_CLAIMS + 8), BAD, strict=True):
        batch[index] = bad
    processes = Processes(2)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            verifier = Verifier(pool, 1, claims.Limits(), processes)
            result = asyncio.run(verifier.validate(batch, NOW_MS))
        workers = processes.pool()._processes  # what ran it: the processes of the pool
        assert workers and all(p.pid != os.getpid() for p in workers.values())
    finally:
        processes.shutdown()
    assert result == claims.validate_items(batch, 0, NOW_MS)
    assert [e["index"] for e in result[1]] == [3, BULK_CLAIMS // 2 + 1, BULK_CLAIMS + 8]


def test_a_dead_worker_process_costs_no_batch() -> None:
    """A worker process killed (the OOM killer, an operator) breaks its pool: the batches that
    meet it are validated on the threads instead, and the next large batch gets new processes."""
    batch: list[object] = [GOOD[n % len(GOOD)] for n in range(BULK_CLAIMS)]
    expected = claims.validate_items(batch, 0, NOW_MS)
    processes = Processes(1)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            verifier = Verifier(pool, 1, claims.Limits(), processes)

            async def run() -> list[Any]:
                first = await verifier.validate(batch, NOW_MS)
                dead = processes.pool()
                for worker in list(dead._processes.values()):
                    worker.kill()
                    worker.join()
                # two batches meet the broken pool at once: both go to the threads
                second, again = await asyncio.gather(
                    verifier.validate(batch, NOW_MS), verifier.validate(batch, NOW_MS)
                )
                third = await verifier.validate(batch, NOW_MS)  # a new pool
                assert processes.pool() is not dead
                return [first, second, again, third]

            results = asyncio.run(run())
    finally:
        processes.shutdown()
    assert results == [expected] * 4
