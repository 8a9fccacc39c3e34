"""Load a real server from posting threads until enough batches are acknowledged, then SIGKILL
it: what the crash tests check against the truth afterwards."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.helpers.server import Server

Batch = list[dict[str, Any]]


@dataclass
class Killed:
    """The batches the server acknowledged (200 or 202), those sent that got no answer, and
    any other answer (there should be none)."""

    acknowledged: list[Batch] = field(default_factory=list)
    in_doubt: list[Batch] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def kill_under_load(
    srv: Server,
    make_batch: Callable[[int, int], Batch],
    posters: int,
    enough: int,
    deadline_s: float,
) -> Killed:
    """`posters` threads post `make_batch(worker, n)` to `/api/claims`, one batch a request,
    until `enough` batches are acknowledged; then the server is SIGKILLed and the threads end
    (a request cut by the kill is in doubt)."""
    killed = Killed()
    lock, reached, stop = threading.Lock(), threading.Event(), threading.Event()

    def poster(worker: int) -> None:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=30) as http:
            n = 0
            while not stop.is_set():
                batch = make_batch(worker, n)
                n += 1
                try:
                    response = http.post("/api/claims", json={"claims": batch})
                except httpx.TransportError:
                    with lock:
                        killed.in_doubt.append(batch)
                    return
                with lock:
                    if response.status_code in (200, 202):
                        killed.acknowledged.append(batch)
                    else:
                        killed.refused.append(f"{response.status_code} {response.text}")
                    if len(killed.acknowledged) >= enough:
                        reached.set()

    threads = [threading.Thread(target=poster, args=(w,)) for w in range(posters)]
    for t in threads:
        t.start()
    try:
        assert reached.wait(timeout=deadline_s), (
            f"{enough} batches were never acknowledged; refused: {killed.refused}"
        )
        assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=deadline_s)
    assert not any(t.is_alive() for t in threads)
    assert not killed.refused, killed.refused
    with lock:
        return killed
