"""A page session: its bound on the change feed it opened (`ui.Sessions.while_signed_in`): the
stream ends when the session does, and whatever ends it, the feed it reads is closed; and its
cookie, which the wall clock's steps do not end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import cast

import pytest

from metanode import ui
from metanode.node import Node


class Feed:
    """A stream of one chunk, then none until it is closed (as a quiet feed waits)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def stream(self) -> AsyncGenerator[bytes, None]:
        try:
            yield b"first"
            await asyncio.Event().wait()
            yield b"never"
        finally:
            self.closed.set()


def session(expires_in: float) -> ui.Session:
    return ui.Session("sid", "csrf", time.monotonic() + expires_in)


SESSIONS = ui.Sessions(cast(Node, None))  # `_bounded` asks nothing of the node


async def test_the_stream_ends_when_the_session_is_ended() -> None:
    feed, signed_in = Feed(), session(3600)
    bounded = SESSIONS._bounded(feed.stream(), signed_in)
    assert await anext(bounded) == b"first"
    waiting = asyncio.ensure_future(anext(bounded))
    SESSIONS.end(signed_in)  # a sign-out in another tab
    assert [chunk async for chunk in _rest(waiting, bounded)] == []
    await asyncio.wait_for(feed.closed.wait(), 60)


async def test_the_stream_ends_when_the_session_expires() -> None:
    feed, signed_in = Feed(), session(3600)
    bounded = SESSIONS._bounded(feed.stream(), signed_in)
    assert await anext(bounded) == b"first"
    signed_in.expires = SESSIONS.clock()  # its hours are up while the feed is quiet
    assert [chunk async for chunk in bounded] == []
    assert feed.closed.is_set()


async def test_a_client_that_leaves_closes_the_feed_it_read() -> None:
    """The stream's task is cancelled (the browser went away) while it waits for the feed:
    the feed is closed then, not left running beside a finished response."""
    feed = Feed()
    bounded = SESSIONS._bounded(feed.stream(), session(3600))
    assert await anext(bounded) == b"first"
    reading = asyncio.ensure_future(anext(bounded))
    await asyncio.sleep(0)  # it waits on the feed now
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    await bounded.aclose()
    await asyncio.wait_for(feed.closed.wait(), 60)


async def _rest(
    first: asyncio.Future[bytes], stream: AsyncGenerator[bytes, None]
) -> AsyncGenerator[bytes, None]:
    """What `stream` yields from the pending `first` step on (nothing once it has ended)."""
    try:
        yield await first
    except StopAsyncIteration:
        return
    async for chunk in stream:
        yield chunk


def test_a_session_outlives_the_wall_clock_stepping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the cookie carried its signing time, checked against the wall clock: a step
    back of a second refused it ("signed in the future"), a step forward past the session's
    hours too, signing every browser out while its session had hours to go."""
    node = SimpleNamespace(session_secret="s" * 43, settings=SimpleNamespace(ui_session_hours=12))
    sessions = ui.Sessions(cast(Node, node))
    cookie, session = sessions.create()
    wall = time.time()
    for step_s in (-3600.0, -365 * 86400.0, 13 * 3600.0):
        monkeypatch.setattr(time, "time", lambda step_s=step_s: wall + step_s)
        assert sessions.find(cookie) is session
    session.expires = sessions.clock()  # its own hours, on the monotonic clock, are up
    assert sessions.find(cookie) is None


def test_the_sessions_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sign-ins never signed out are kept for their hours only; past the bound the oldest is
    ended (its open streams too), so sign-ins at any pace, over any `ui_session_hours`, cannot
    grow the node's memory without end."""
    monkeypatch.setattr(ui, "MOST_SESSIONS", 100)
    node = SimpleNamespace(session_secret="s" * 43, settings=SimpleNamespace(ui_session_hours=1e6))
    sessions = ui.Sessions(cast(Node, node))
    made = [sessions.create() for _ in range(250)]
    assert len(sessions.live) == 100
    assert [sessions.find(cookie) for cookie, _ in made[-100:]] == [s for _, s in made[-100:]]
    assert sessions.find(made[0][0]) is None and made[0][1].ended.is_set()


class Clock:
    """A clock a test moves by hand (monotonic seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_guessing_tokens_waits_twice_as_long_after_each_wrong_one() -> None:
    """`free` wrong tokens cost nothing; then 1 s, 2, 4 … up to the most; a right token, or
    the most without a try, starts the count again; another client is not held up, nor
    another address of the same IPv6 /64 let through."""
    clock = Clock()
    throttle = ui.SignInThrottle(free=3, first_s=1.0, most_s=8.0, clock=clock)
    for _ in range(2):
        throttle.failed("a")
        assert throttle.wait_s("a") == 0
    waits = []
    for _ in range(6):
        throttle.failed("a")
        waits.append(throttle.wait_s("a"))
        clock.now += waits[-1]  # waited it out: the next try is counted
    assert waits == [1, 2, 4, 8, 8, 8] and throttle.wait_s("b") == 0
    throttle.failed("a")
    clock.now += 3
    assert throttle.wait_s("a") == 5  # the most, less what has passed
    throttle.succeeded("a")
    assert throttle.wait_s("a") == 0 and "a" not in throttle.clients
    for _ in range(3):
        throttle.failed("a")
    clock.now += 1 + 8.5  # its wait over, then quiet for longer than the most: forgiven
    throttle.failed("a")
    assert throttle.wait_s("a") == 0 and throttle.clients["a"].failures == 1
    v6 = {"client": ("2001:db8:1:2::1", 5000)}, {"client": ("2001:db8:1:2:ffff::9", 5000)}
    assert ui.client_key(v6[0]) == ui.client_key(v6[1]) == "2001:db8:1:2::/64"
    assert ui.client_key({"client": ("::ffff:192.0.2.7", 1)}) == "192.0.2.7"
    assert ui.client_key({"client": None}) == ""


def test_the_clients_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An address a wrong token: each new one is remembered, the quietest forgotten past the
    bound (a client with many addresses cannot grow the node's memory without end)."""
    monkeypatch.setattr(ui, "MOST_CLIENTS", 100)
    throttle = ui.SignInThrottle(free=1, first_s=1.0, most_s=8.0, clock=Clock())
    for n in range(250):
        throttle.failed(f"192.0.2.{n}")
    assert len(throttle.clients) == 100 and "192.0.2.249" in throttle.clients
    assert "192.0.2.0" not in throttle.clients
