"""Claim validation off the event loop, coalesced: concurrent requests' claims share jobs.

Signature checks cost ≈ 50 µs a claim and must not run on the event loop. Handing each request's
claims to a pool costs a thread (or process) hop per request, which for one-claim requests is
most of the work (`tools/bench/verify.py`: 0.5 of a plain loop's rate). So, as the truth writer's
group commit does for transactions, the `Verifier` gathers what concurrent requests are waiting
to have validated into one job per free worker, dispatched at once (never waiting for more),
and a large batch is split across the free workers so it uses every core.

A batch of `BULK_CLAIMS` or more goes to worker processes instead (`Processes`, the
`verify_processes` setting), split among them, each spoken to from the event loop over a socket
pair (`_Process`). Half of a claim's validation is Python (field
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
import collections
import concurrent.futures
import ctypes
import dataclasses
import functools
import logging
import marshal
import multiprocessing
import multiprocessing.process
import os
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from metanode import claims

log = logging.getLogger(__name__)
BULK_CLAIMS = 64  # a batch this large is validated in the worker processes, if there are any
PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the one that started it dies, however it dies
    (Linux's `PR_SET_PDEATHSIG`): a server killed with SIGKILL leaves no process behind, not
    even one in the middle of a large batch, which would read its end-of-file only after."""
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
    """`claims.validate_items` of each (items, first index, now) run: one thread job of many
    requests' claims."""
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


class ProcessDied(RuntimeError):
    """A validation process ended (killed, out of memory) with jobs of this server in it: the
    batches it held are validated on the threads instead (`Verifier.validate`). Never leaves
    this module."""


FRAME_HEAD = 8  # bytes of a frame's length, big-endian, before its `marshal` payload


def _frame(value: Any) -> bytes:
    payload = marshal.dumps(value)
    return len(payload).to_bytes(FRAME_HEAD, "big") + payload


def _serve(sock: socket.socket, parent: int) -> None:
    """A validation process's whole life: jobs (wire claims, the first's index, now, the
    `Limits` fields) in, each answered in order with (valid claims as field tuples, error
    items); it ends at end-of-file, when the server closes its end or dies."""
    _worker_started(parent)
    with sock, sock.makefile("rb") as stream:
        while len(head := stream.read(FRAME_HEAD)) == FRAME_HEAD:
            items, first, now, limits = marshal.loads(stream.read(int.from_bytes(head, "big")))
            valid, errors = claims.validate_items(items, first, now, claims.Limits(*limits))
            sock.sendall(_frame(([dataclasses.astuple(c) for c in valid], errors)))


class _Process:
    """One validation process and the socket pair to it, spoken over from the event loop:
    `ask` queues a job without blocking (the stream's buffer takes it), and `_answers` takes
    the answers, which come back in the order asked, off the socket as they arrive.

    Why not a `ProcessPoolExecutor`: its management thread and queue-feeder thread wake and
    pickle in the server's process for every job, taking the GIL from the writer threads; at
    batch 100 they cost the server ≈ 6-9 µs of its ≈ 120 µs a claim, this ≈ 3
    (docs/benchmarks.md, "Session 22: the verify process spoken to from the loop")."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(theirs, os.getpid()), daemon=True
        )
        self.process.start()
        theirs.close()
        self.alive = True
        self._waiting: collections.deque[asyncio.Future[Result]] = collections.deque()
        self._sock = ours
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None  # held: the loop keeps only weak refs
        self._opened = asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        self._reading = asyncio.ensure_future(self._answers(reader))

    async def ask(
        self, items: Sequence[object], first: int, now: int, limits: claims.Limits
    ) -> Result:
        await self._opened
        if not self.alive or self._writer is None:
            raise ProcessDied("a claim validation process died")
        answer: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)
        self._writer.write(_frame((list(items), first, now, dataclasses.astuple(limits))))
        return await answer

    async def _answers(self, reader: asyncio.StreamReader) -> None:
        """Each answer to the oldest job waiting; at end-of-file every job waiting fails."""
        try:
            while True:
                head = await reader.readexactly(FRAME_HEAD)
                valid, errors = marshal.loads(await reader.readexactly(int.from_bytes(head, "big")))
                answer = self._waiting.popleft()
                if not answer.done():  # its request was cancelled
                    answer.set_result(([claims.Claim(*fields) for fields in valid], errors))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._ended()

    def _ended(self) -> None:
        if self.alive:
            self.alive = False
            log.warning("a claim validation process died; starting a new one")
        while self._waiting:
            answer = self._waiting.popleft()
            if not answer.done():
                answer.set_exception(ProcessDied("a claim validation process died"))

    def close(self) -> None:
        """Let the process go: it ends at the end-of-file, once the jobs it holds are done."""
        self.alive = False
        if self._writer is not None:
            self._writer.close()
        else:
            self._opened.cancel()
            self._sock.close()


class Processes:
    """The processes large batches are validated in, each batch split among them: started at
    their first use (a node that never gets a large batch never starts one) with `spawn` (the
    server has threads, which `fork` would copy mid-flight), one started anew in place of one
    that died, and each dying with the server (`die_with_parent`)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._processes: list[_Process] = []

    def running(self) -> list[multiprocessing.process.BaseProcess]:
        """The processes started and not known to have died (what `ps` would show)."""
        return [p.process for p in self._processes if p.alive]

    async def validate(self, items: Sequence[object], now: int, limits: claims.Limits) -> Result:
        """`items` split among the processes, one run each; `ProcessDied` if one died with
        its run (every process that died is replaced at the next batch)."""
        self._processes = [p for p in self._processes if p.alive]
        while len(self._processes) < self.count:
            self._processes.append(_Process())
        runs = _spread(items, self.count)
        parts = await asyncio.gather(
            *(
                p.ask(run, first, now, limits)
                for p, (run, first) in zip(self._processes, runs, strict=False)
            ),
            return_exceptions=True,
        )
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return _joined(parts)  # type: ignore[arg-type]  # no exception is left in `parts`

    def shutdown(self) -> None:
        for process in self._processes:
            process.close()
        self._processes = []


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
            try:
                return await self.processes.validate(items, now, self.limits)
            except ProcessDied:
                pass  # this batch goes to the threads
        runs = [_Run(run, first, now) for run, first in _spread(items, self.jobs)]
        self._pending += runs
        self._dispatch()
        return _joined([await run.done for run in runs])

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
