"""Waiting on a condition, never on a timer: a test polls until what it waits for is there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
DEADLINE_S = 90.0  # a bound on a hang, not a measurement: both cores may be busy


def poll(fetch: Callable[[], T | None], what: str, timeout: float = DEADLINE_S) -> T:
    """Call `fetch` until it returns something; fail after `timeout` s (a bound, not a metric)."""
    deadline = time.monotonic() + timeout
    while True:
        found = fetch()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.1)


async def until(done: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    """`poll` for a test on the event loop: await until `done()`, letting the loop run."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)
