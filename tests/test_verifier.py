"""`verifier.Verifier`: concurrent requests' claims share the pool's jobs, and each request
still gets exactly its own valid claims and its own errors, at its own indexes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from metanode import cid as cids
from metanode import claims
from metanode.verifier import BULK_CLAIMS, Processes, Verifier
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.server import Server
from tests.helpers.wait import poll

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
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        verifier = Verifier(pool, 1, claims.Limits(), processes)

        async def run() -> tuple[Any, list[int | None]]:
            try:
                result = await verifier.validate(batch, NOW_MS)
                return result, [p.pid for p in processes.running()]  # what ran it
            finally:
                processes.shutdown()

        result, workers = asyncio.run(run())
    assert len(workers) == 2 and os.getpid() not in workers
    assert result == claims.validate_items(batch, 0, NOW_MS)
    assert [e["index"] for e in result[1]] == [3, BULK_CLAIMS // 2 + 1, BULK_CLAIMS + 8]


def test_queued_large_batches_each_get_their_own_answer_when_one_is_cancelled() -> None:
    """Batches queued in one process at once are answered in the order sent; a request that
    went away (its batch still in the process) is skipped, not handed to the next one, and
    the others each get exactly their own claims and errors."""
    batches: list[list[object]] = []
    for k in range(5):
        batch: list[object] = [GOOD[(n + k) % len(GOOD)] for n in range(BULK_CLAIMS + k)]
        batch[3 * k] = BAD[k % len(BAD)]
        batches.append(batch)
    processes = Processes(1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        verifier = Verifier(pool, 1, claims.Limits(), processes)

        async def run() -> list[Any]:
            try:
                tasks = [asyncio.ensure_future(verifier.validate(b, NOW_MS)) for b in batches]
                while sum(len(p._waiting) for p in processes._processes) < len(batches):
                    await asyncio.sleep(0)  # until all five are in the process
                started = processes.running()
                tasks[1].cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                assert processes.running() == started  # answered there, not on the threads
                return results
            finally:
                processes.shutdown()

        results = asyncio.run(run())
    assert isinstance(results[1], asyncio.CancelledError)
    for k in (0, 2, 3, 4):
        assert results[k] == claims.validate_items(batches[k], 0, NOW_MS)


def test_a_dead_worker_process_costs_no_batch() -> None:
    """A worker process killed (the OOM killer, an operator) breaks its pool: the batches that
    meet it are validated on the threads instead, and the next large batch gets new processes."""
    batch: list[object] = [GOOD[n % len(GOOD)] for n in range(BULK_CLAIMS)]
    expected = claims.validate_items(batch, 0, NOW_MS)
    processes = Processes(1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        verifier = Verifier(pool, 1, claims.Limits(), processes)

        async def run() -> list[Any]:
            try:
                first = await verifier.validate(batch, NOW_MS)
                dead = processes.running()
                for worker in dead:
                    worker.kill()
                    worker.join()
                # two batches meet the dead process at once: both go to the threads
                second, again = await asyncio.gather(
                    verifier.validate(batch, NOW_MS), verifier.validate(batch, NOW_MS)
                )
                third = await verifier.validate(batch, NOW_MS)  # a new process
                assert processes.running() and not set(processes.running()) & set(dead)
                return [first, second, again, third]
            finally:
                processes.shutdown()

        results = asyncio.run(run())
    assert results == [expected] * 4


def test_the_validation_processes_die_with_a_sigkilled_server(tmp_path: Path) -> None:
    """A real `metanode serve` validates a large batch in its worker processes; SIGKILL of the
    server takes them with it (each holds its own job queue's write end, so without
    `die_with_parent` they would wait forever, orphaned). Two of them, so each must go."""
    server = Server(tmp_path / "data", env={"METANODE_VERIFY_PROCESSES": "2"}).start()
    try:
        server.register(SIGNER.uid, "bulk")
        batch = [
            SIGNER.claim(cids.midhash_bytes(f"die {n}".encode()), "title", f"die {n}")
            for n in range(BULK_CLAIMS)
        ]
        response = httpx.post(
            f"{server.url}/api/claims", json={"claims": batch}, headers=server.headers, timeout=60
        )
        assert response.status_code == 200, response.text
        assert server.proc is not None
        spawned = [pid for pid in children(server.proc.pid) if "spawn_main" in cmdline(pid)]
        assert len(spawned) == 2, [cmdline(pid) for pid in children(server.proc.pid)]
        server.proc.kill()
        server.proc.wait(30)
        poll(lambda: not [pid for pid in spawned if alive(pid)] or None, "the processes end")
    finally:
        server.stop()


def children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie does not: it has ended, its parent not reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
