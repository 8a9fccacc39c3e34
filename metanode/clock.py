"""The wall clock, defined once: milliseconds since the Unix epoch, as claims and rows carry it.

Everything that stamps a time takes a `Clock` (default `now_ms`), so a node, a plugin host or a
cache transaction can be given another one; nothing reads the time any other way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], int]
"""A source of wall-clock milliseconds since the epoch (`now_ms`, or one a caller injects)."""


def now_ms() -> int:
    """The real wall clock in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


def iso(ms: int) -> str:
    """A time in milliseconds since the epoch as people read it in messages: UTC, to the
    second (`2026-12-07T05:23:45Z`), so a clock that is wrong is plain to see."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms // 1000))
