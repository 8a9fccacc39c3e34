"""How much work SQLite does for a call, counted rather than timed."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable


def vm_steps(conn: sqlite3.Connection, work: Callable[[], object]) -> int:
    """The SQLite virtual-machine instructions `work` runs on `conn`: the same on every run of
    the same statements over the same rows, and growing with the rows they visit, so a test
    can say a read does not grow with a table (a scan does) without timing anything."""
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0  # go on

    conn.set_progress_handler(step, 1)
    try:
        work()
    finally:
        conn.set_progress_handler(None, 1)
    return steps
