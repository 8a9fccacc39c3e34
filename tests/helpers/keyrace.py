"""Real processes racing to make one key file (`keys.create`, `keys.load_or_create`).

Each round starts its processes, lets them all reach a barrier, then releases them at once, so
their creations meet at the same instant as closely as processes can; each reports the uid it
ended with or the error it got (type and text)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
from multiprocessing.queues import Queue
from pathlib import Path

from tests.helpers.wait import DEADLINE_S

Outcome = tuple[str, str]  # ("ok", uid) or (the exception's type name, its text)


def _make(
    path: str, how: str, ready: multiprocessing.synchronize.Barrier, out: Queue[Outcome]
) -> None:
    from metanode import keys  # imported before the barrier in the parent, forked with it

    ready.wait()
    try:
        if how == "create":
            out.put(("ok", keys.create(path)))
        else:
            out.put(("ok", keys.uid_of_key(keys.load_or_create(path))))
    except Exception as exc:  # the outcome to count, whatever it is
        out.put((type(exc).__name__, str(exc)))


def race(path: Path, how: str, processes: int) -> list[Outcome]:
    """`processes` processes making the key `path` at once (`how`: "create" or
    "load_or_create"); their outcomes."""
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Barrier(processes)
    out: Queue[Outcome] = ctx.Queue()
    workers = [
        ctx.Process(target=_make, args=(str(path), how, ready, out)) for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    outcomes = [out.get(timeout=DEADLINE_S) for _ in workers]
    for worker in workers:
        worker.join(DEADLINE_S)
        assert worker.exitcode == 0, worker.exitcode
    return outcomes
