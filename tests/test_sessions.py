"""A page session: its bound on the change feed it opened (`ui.Sessions.while_signed_in`): the
stream ends when the session does, and whatever ends it, the feed it reads is closed; its
cookie, which the wall clock's steps do not end; and its keeping across restarts of `serve`
(`ui.Sessions.keep`/`restore`), on a real server signed in through the sign-in form."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import httpx
import pytest

from metanode import ui
from metanode.node import Node
from tests.helpers.claims import Signer
from tests.helpers.server import Server, role_pids
from tests.helpers.wait import poll


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


# -- kept across restarts -----------------------------------------------------------------------

KEPT = "ui-sessions.json"


def signed_in(srv: Server, client: httpx.Client) -> str:
    """Sign in as a person does, through the sign-in form the page shows (its `Origin` this
    host); the session's CSRF token, as the signed-in page carries it."""
    assert "<h1>Sign in</h1>" in client.get("/signers").text
    form = {"token": srv.token, "then": "/signers"}
    answer = client.post("/signin", data=form, headers={"Origin": srv.url})
    assert answer.status_code == 303, answer.text
    return csrf_of(client)


def csrf_of(client: httpx.Client) -> str:
    """The CSRF token the Signers page carries for the cookie's session (fails signed out)."""
    page = client.get("/signers")
    assert page.status_code == 200 and ">Signers</h1>" in page.text, page.text[:300]
    found = re.search(r'data-csrf="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def set_status(srv: Server, client: httpx.Client, csrf: str, uid: str, to: str) -> None:
    """Block or unblock a signer with the Signers page's form (a CSRF-protected edit)."""
    form = {"csrf": csrf}
    answer = client.post(f"/signers/{uid}/{to}", data=form, headers={"Origin": srv.url})
    assert answer.status_code == 303, answer.text[:300]
    signers = httpx.get(f"{srv.url}/api/signers", headers=srv.headers).json()["signers"]
    wanted = "blocked" if to == "block" else "active"
    assert next(s["status"] for s in signers if s["uid"] == uid) == wanted


def restarted(srv: Server) -> None:
    assert srv.stop() == 0
    srv.start()


def test_a_session_outlives_a_restart_and_a_sign_out_does_not(tmp_path: Path) -> None:
    """A restart of `serve` (an upgrade, a reboot) signed every browser out. Now the cookie
    and its CSRF token work after it; a sign-out still ends the session for good, restarts
    and all. The kept sessions are as private as the token and not in a backup."""
    srv = Server(tmp_path / "data").start()
    victim = Signer()
    try:
        srv.register(victim.uid, "victim", weight=3)
        with httpx.Client(base_url=srv.url) as browser:
            csrf = signed_in(srv, browser)
            kept = srv.data_dir / KEPT
            assert kept.stat().st_mode & 0o777 == 0o600
            assert srv.token not in kept.read_text()
            restarted(srv)
            assert csrf_of(browser) == csrf  # the same session, no sign-in form
            set_status(srv, browser, csrf, victim.uid, "block")
            restarted(srv)
            set_status(srv, browser, csrf, victim.uid, "unblock")
            backup = tmp_path / "backup"
            backup_cmd = ["backup", "--data-dir", str(srv.data_dir), str(backup)]
            made = subprocess.run(
                [sys.executable, "-m", "metanode", *backup_cmd], cwd=tmp_path, capture_output=True
            )
            assert made.returncode == 0, made.stderr
            assert not [p for p in backup.iterdir() if "session" in p.name]
            cookie = browser.cookies[ui.COOKIE]
            out = browser.post("/signout", data={"csrf": csrf}, headers={"Origin": srv.url})
            assert out.status_code == 303
            restarted(srv)
            browser.cookies.set(ui.COOKIE, cookie)  # a copy of the cookie kept elsewhere
            assert "<h1>Sign in</h1>" in browser.get("/signers").text
            refused = browser.get("/api/signers")
            assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    finally:
        srv.stop()


def test_a_damaged_list_of_sessions_starts_the_node_with_none(tmp_path: Path) -> None:
    """A list of sessions that cannot be read (a damaged card, a hand edit) never stops the
    start: one line in the log, and every browser signs in again."""
    data = tmp_path / "data"
    srv = Server(data).start()
    srv.stop()
    damaged_lists = (b'{"sessions": [{"sid": 1', b"\xff\xfe", b'{"sessions": [7]}', b"[" * 10**5)
    for damaged in damaged_lists:
        (data / KEPT).write_bytes(damaged)
        srv.start()
        try:
            with httpx.Client(base_url=srv.url) as browser:
                signed_in(srv, browser)  # and a new list is written whole over it
            assert srv.log_text().count("is damaged or unreadable") >= 1
        finally:
            srv.stop()
    assert srv.log_text().count("is damaged or unreadable") == len(damaged_lists)


def test_an_owner_worker_replaced_keeps_the_sessions(tmp_path: Path) -> None:
    """Under `serve --workers 2` the owner holds the sessions (a reader hands it every sign-in
    and every request with the cookie): a sign-in through the reader is kept, and an owner
    killed and replaced by the supervisor takes it back (it signed every browser out)."""
    srv = Server(tmp_path / "data", workers=2).start()
    try:
        with httpx.Client(base_url=srv.url) as browser:
            csrf = signed_in(srv, browser)
            killed = role_pids(srv)["owner"]
            os.kill(killed, signal.SIGKILL)
            poll(lambda: role_pids(srv).get("owner") not in (None, killed) or None, "an owner")
            poll(lambda: _signed_in_as(browser, csrf), "the new owner answering")
    finally:
        srv.stop()


def _signed_in_as(browser: httpx.Client, csrf: str) -> bool | None:
    """Whether the Signers page answers for the session of `csrf` (None while it cannot)."""
    try:
        page = browser.get("/signers")
    except httpx.TransportError:
        return None
    if page.status_code == 503:  # no owner answering yet
        return None
    return f'data-csrf="{csrf}"' in page.text or None


def test_a_sign_out_the_disk_refuses_to_keep_removes_the_kept_list(tmp_path: Path) -> None:
    """A sign-out ends its session for good even when the list cannot be written (a full
    disk; here its temporary file's name taken by a folder): the kept list is removed instead,
    so no restart brings the ended session back."""
    settings = SimpleNamespace(ui_session_hours=1, sessions_path=tmp_path / KEPT)
    node = SimpleNamespace(session_secret="s" * 43, token="t" * 43, settings=settings)
    sessions = ui.Sessions(cast(Node, node))
    cookie, session = sessions.create()
    asyncio.run(sessions.keep())
    (tmp_path / f"{KEPT}.part").mkdir()
    sessions.end(session)
    asyncio.run(sessions.keep_ended())
    assert not (tmp_path / KEPT).exists()
    after = ui.Sessions(cast(Node, node))
    after.restore()
    assert after.find(cookie) is None


def test_kept_sessions_are_taken_back_with_their_time_left_and_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kept session runs for what it had left by the wall clock (never more than
    `ui_session_hours`); an ended one is not taken back, nor more than `MOST_SESSIONS`, nor
    any kept under another API token (a token replaced signs every browser out)."""
    monkeypatch.setattr(ui, "MOST_SESSIONS", 3)
    settings = SimpleNamespace(ui_session_hours=1, sessions_path=tmp_path / KEPT)
    node = SimpleNamespace(session_secret="s" * 43, token="t" * 43, settings=settings)
    before = ui.Sessions(cast(Node, node))
    made = [before.create() for _ in range(3)]
    made[0][1].expires = before.clock() + 60  # a minute left
    asyncio.run(before.keep())
    after = ui.Sessions(cast(Node, node), clock=lambda: 5.0, wall=lambda: time.time() + 30)
    after.restore()
    assert [after.find(cookie) is not None for cookie, _ in made] == [True] * 3
    assert 5 + 25 < after.live[made[0][1].sid].expires <= 5 + 30
    assert after.live[made[2][1].sid].expires <= 5 + 3600 - 30
    later = ui.Sessions(cast(Node, node), wall=lambda: time.time() + 61)
    later.restore()
    assert sorted(later.live) == sorted(s.sid for _, s in made[1:])
    monkeypatch.setattr(ui, "MOST_SESSIONS", 1)  # the bound lowered: the newest is kept
    bounded = ui.Sessions(cast(Node, node))
    bounded.restore()
    assert list(bounded.live) == [made[2][1].sid]
    replaced = SimpleNamespace(session_secret="s" * 43, token="u" * 43, settings=settings)
    other = ui.Sessions(cast(Node, replaced))
    other.restore()
    assert other.live == {}
