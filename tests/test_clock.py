"""A box whose clock is wrong: one without a real-time clock that boots in 1970, one whose
clock network time steps back. The node's own signers (the owner, the plugins) date a new word
after their own newest on the same key, so it counts; what no valid date can make count waits,
saying why, instead of being refused for good or stored stale; what a peer sent that the
clock refused is fetched once the clock is set. The clock is the node's seam
(`Node(clock=...)`), set by each test."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest

from metanode import cid as cids
from metanode import claims, db, plugins
from metanode.errors import ClockBehind, UnknownCid
from metanode.node import Node
from metanode.plugins import Plugin
from tests.helpers.claims import Signer
from tests.helpers.plugins import claim, probe
from tests.helpers.server import Server
from tests.helpers.settings import settings_for
from tests.helpers.wait import until

pytestmark = pytest.mark.both_backends  # the tests with a `storage` run on both

T = 1_764_500_000_000  # 2025-11-30T10:53:20Z: the right time, in these tests
SKEW = claims.Limits().max_skew_ms
HOUR = 3_600_000
YEAR = 365 * 24 * HOUR
BOOT = 13_000  # 1970-01-01T00:00:13Z: a box without a real-time clock, before network time
CID_A = cids.midhash_bytes(b"clock a")
CID_B = cids.midhash_bytes(b"clock b")


class Clock:
    """A clock the test sets: milliseconds since the epoch, standing still between settings."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def said(signer: str, ts: int, key: str = "title") -> claims.Claim:
    return claims.Claim(signer, CID_A, key, "x", ts, bytes(64))


# -- the rule ------------------------------------------------------------------------------------


def test_a_new_word_is_dated_now_or_just_after_the_signers_newest() -> None:
    limits = claims.Limits()
    assert claims.next_ts(T, None, limits) == T
    assert claims.next_ts(T, said("u", T - 1), limits) == T  # the clock is ahead of it: now
    assert claims.next_ts(T, said("u", T), limits) == T + 1  # within one millisecond
    assert claims.next_ts(T, said("u", T + SKEW - 1), limits) == T + SKEW  # stepped back a little


def test_a_word_no_valid_date_makes_count_is_refused_saying_from_when() -> None:
    limits = claims.Limits()
    with pytest.raises(ClockBehind) as behind:
        claims.next_ts(T - HOUR, said("u", T), limits)
    assert behind.value.extra == {"valid_from": T + 1 - SKEW}
    assert behind.value.message == (
        "the last word on 'title' is dated 2025-11-30T10:53:20Z, ahead of this box's clock "
        "(2025-11-30T09:53:20Z): a new one must be dated after it to count, and this node takes "
        "claims dated at most 300000 ms ahead of its clock, so from 2025-11-30T10:48:20Z on (the "
        "clock stepped back, or was ahead when that word was said)"
    )
    with pytest.raises(ClockBehind) as unset:
        claims.next_ts(BOOT, None, limits)
    assert unset.value.extra == {"valid_from": claims.MIN_TS}
    assert "reads 1970-01-01T00:00:13Z, before 2000: it has not been set" in unset.value.message


# -- the owner -----------------------------------------------------------------------------------


@pytest.fixture
async def owned(tmp_path: Path, storage: str) -> AsyncIterator[tuple[Node, Clock]]:
    """A started node whose clock the test sets, at `T`."""
    clock = Clock(T)
    node = Node(settings_for(tmp_path / "data", storage=storage), clock=clock)
    await node.start()
    yield node, clock
    await node.stop()


def owner_ts(node: Node, key: str) -> list[int]:
    rid = node.group_of(CID_A)
    assert rid is not None
    return [c["ts"] for c in node.group_claims(rid, key, node.owner.uid)["claims"]]


async def test_the_owners_edit_after_the_clock_stepped_back_counts(
    owned: tuple[Node, Clock],
) -> None:
    node, clock = owned
    await node.owner_says([(CID_A, "title", "First")])
    clock.ms = T - 60_000  # network time steps the clock back a minute
    assert (await node.owner_says([(CID_A, "title", "Second")])).body["accepted"] == 1
    rid = node.group_of(CID_A)
    assert rid is not None
    assert node.record_value(rid, "title") == "Second"  # not stale behind "First"
    assert owner_ts(node, "title") == [T + 1]
    await node.owner_says([(CID_A, "note", "kept")])  # a key it has no newer word on: now
    assert owner_ts(node, "note") == [T - 60_000]

    clock.ms = T - HOUR  # an hour back: "Second" is further ahead than any claim it takes
    with pytest.raises(ClockBehind) as behind:
        await node.owner_says([(CID_A, "title", "Third")])
    assert behind.value.extra == {"valid_from": T + 2 - SKEW}
    assert node.record_value(rid, "title") == "Second"
    # every other key takes the owner's word as ever (one signer-wide floor refused them all)
    assert (await node.owner_says([(CID_A, "year", "1999")])).body["accepted"] == 1
    assert node.record_value(rid, "year") == "1999"

    clock.ms = T + 2 - SKEW  # once the clock is within the skew of that word
    assert (await node.owner_says([(CID_A, "title", "Third")])).body["accepted"] == 1
    assert node.record_value(rid, "title") == "Third"
    clock.ms = T - 60_000  # back again: a Revert's tombstone is dated after "Third" too
    assert (await node.owner_says([(CID_A, "title", None)])).body["accepted"] == 1
    assert node.record_value(rid, "title") is None


async def test_the_owners_word_is_dated_after_its_word_on_another_cid_of_the_group(
    owned: tuple[Node, Clock],
) -> None:
    """The record counts a signer's newest vote on a key across the group's CIDs: an edit
    signed on one CID must be newer than the same signer's vote through another."""
    node, clock = owned
    await node.owner_says([(CID_A, f"cids/{CID_B}", "true")])  # one group of A and B
    await node.owner_says([(CID_B, "title", "Through B")])
    clock.ms = T - 60_000
    await node.owner_says([(CID_A, "title", "Through A")])
    rid = node.group_of(CID_A)
    assert rid is not None and node.group_of(CID_B) == rid
    assert node.record_value(rid, "title") == "Through A"


async def test_a_clock_never_set_refuses_the_owners_edit_and_health_says_why(
    owned: tuple[Node, Clock],
) -> None:
    node, clock = owned
    clock.ms = BOOT
    with pytest.raises(ClockBehind, match="before 2000: it has not been set"):
        await node.owner_says([(CID_A, "title", "Too early")])
    health = node.health()
    assert health["status"] == "degraded"
    assert any("clock reads 1970-01-01T00:00:13Z" in p for p in health["problems"])
    clock.ms = T  # network time
    assert (await node.owner_says([(CID_A, "title", "On time")])).body["accepted"] == 1
    assert node.health()["problems"] == []


# -- the plugins ---------------------------------------------------------------------------------


async def plugin_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found: Sequence[Plugin], clock: Clock
) -> Node:
    """A node watching `tmp_path/media`, running `found` as its plugins, on `clock`."""
    monkeypatch.setattr(plugins, "discover", lambda: (list(found), []))
    settings = settings_for(
        tmp_path / "data",
        plugins_enabled=True,
        watch_enabled=True,
        watch_settle_s=0.2,
        plugin_retry_s=0.1,
        plugin_max_attempts=3,
    )
    node = Node(settings, clock=clock)
    await node.start()
    return node


def run_row(node: Node, plugin: Plugin, midhash: str) -> tuple[str, int, str | None] | None:
    """(status, attempts, error) of a plugin's run on a midhash, as the cache holds it."""
    conn = db.connect(node.settings.cache_path, readonly=True)
    try:
        row = conn.execute(
            "SELECT status, attempts, error FROM plugin_runs WHERE plugin = ? AND version = ? "
            "AND midhash = ?",
            (plugin.name, plugin.version, midhash),
        ).fetchone()
    finally:
        conn.close()
    return None if row is None else (row[0], row[1], row[2])


def drop(tmp_path: Path, name: str, data: bytes) -> str:
    """A file written into the watched folder; its midhash."""
    media = tmp_path / "media"
    media.mkdir(exist_ok=True)
    (media / name).write_bytes(data)
    return cids.midhash_bytes(data)


def title(node: Node, midhash: str) -> str | None:
    """The record's title, None while the watcher has not seen the file or none is said."""
    try:
        value: str | None = node.meta(midhash)["metadata"].get("title")
    except UnknownCid:
        return None
    return value


async def test_plugin_runs_wait_for_a_clock_never_set_then_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, each run was refused `invalid_ts` (dated 1970) and failed for good: the files
    first seen before network time never got their plugins' claims, restarts or not."""
    clock = Clock(BOOT)
    namer = probe("namer", claim("title", "Heat"))
    node = await plugin_node(tmp_path, monkeypatch, [namer], clock)
    try:
        midhash = drop(tmp_path, "Heat.1995.mkv", b"a film seen at boot")

        def waits() -> bool:
            row = run_row(node, namer, midhash)
            return row is not None and row[2] is not None and "waits for the clock" in row[2]

        await until(waits, "the run waits for the clock")
        row = run_row(node, namer, midhash)
        assert row is not None and row[:2] == ("pending", 0)  # no attempt spent
        assert namer.calls == []  # nor the plugin's work
        clock.ms = T  # network time
        done = ("done", 1, None)
        await until(lambda: run_row(node, namer, midhash) == done, "the run once it is set")
        assert title(node, midhash) == "Heat"
        assert len(namer.calls) == 1
    finally:
        await node.stop()


async def test_a_plugins_rerun_after_the_clock_stepped_back_replaces_its_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a run stamped with the clock (and a runner's own last stamp only) was stale
    behind the plugin's earlier word once the clock read earlier: after a restart its new
    reading (a renamed file's title) was silently dropped, the run said done; and a runner that
    had stamped ahead of the clock had every run refused for good, new files' too."""
    clock = Clock(T)
    first = probe("namer", claim("title", "The Matrix"))
    node = await plugin_node(tmp_path, monkeypatch, [first], clock)
    midhash = drop(tmp_path, "film.mkv", b"a film")
    await until(lambda: title(node, midhash) == "The Matrix", "the first reading")
    await node.stop()

    clock.ms = T - 60_000  # restarted with the clock a minute behind its last word
    second = probe("namer", claim("title", "Heat"), version="2")
    node = await plugin_node(tmp_path, monkeypatch, [second], clock)
    try:
        await until(lambda: title(node, midhash) == "Heat", "the second reading counts")
    finally:
        await node.stop()

    clock.ms = T - HOUR  # an hour behind: no date the node takes is after "Heat"'s
    third = probe("namer", claim("title", "Ronin"), version="3")
    node = await plugin_node(tmp_path, monkeypatch, [third], clock)
    try:

        def waits() -> bool:
            row = run_row(node, third, midhash)
            return row is not None and row[2] is not None and "'title' is dated" in row[2]

        await until(waits, "the third run waits for the clock")
        row = run_row(node, third, midhash)
        assert row is not None and row[:2] == ("pending", 0)
        assert title(node, midhash) == "Heat"
        other = drop(tmp_path, "other.mkv", b"another film, new here")
        await until(lambda: title(node, other) == "Ronin", "a file it has no word on runs")
        clock.ms = T + 2 - SKEW  # the clock within the skew of "Heat"'s date
        done = ("done", 1, None)
        await until(lambda: run_row(node, third, midhash) == done, "the waiting run, once it can")
        assert title(node, midhash) == "Ronin"
    finally:
        await node.stop()


async def test_a_new_plugin_version_runs_once_after_a_wrong_year_was_put_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 1 ran while the year was set wrong (a year ahead); the clock put right, version 2
    came. Before, version 2's runs, stamped by the clock, were older than version 1's: every
    start read that as a rollback (2 → 1 → 2) and ran version 2 on every file again."""
    clock = Clock(T + YEAR)
    first = probe("namer", claim("title", "Heat"))
    node = await plugin_node(tmp_path, monkeypatch, [first], clock)
    seen = drop(tmp_path, "Heat.1995.mkv", b"a film seen in the wrong year")
    await until(lambda: run_row(node, first, seen) == ("done", 1, None), "version 1's run")
    await node.stop()

    clock.ms = T
    first_start = await ran_at_start(tmp_path, monkeypatch, clock, "start 1")
    assert first_start == {seen, cids.midhash_bytes(b"start 1")}  # a new version: every file
    again = await ran_at_start(tmp_path, monkeypatch, clock, "start 2")
    assert again == {cids.midhash_bytes(b"start 2")}  # the new file only


async def ran_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock, tag: str
) -> set[str]:
    """Start the node with version 2, drop a file tagged `tag`, and once no run is left to do
    stop it: the midhashes version 2 ran on."""
    second = probe("namer", claim("title", "Heat"), version="2")
    node = await plugin_node(tmp_path, monkeypatch, [second], clock)
    try:
        new = drop(tmp_path, f"{tag}.mkv", tag.encode())
        await until(lambda: run_row(node, second, new) == ("done", 1, None), "the new file")
        await until(lambda: not pending(node), "no run left to do")
    finally:
        await node.stop()
    return {file.cid for file in second.calls}


def pending(node: Node) -> bool:
    """Whether any plugin run waits to be done."""
    conn = db.connect(node.settings.cache_path, readonly=True)
    try:
        return bool(conn.execute("SELECT 1 FROM plugin_runs WHERE status = 'pending'").fetchall())
    finally:
        conn.close()


# -- the peers -----------------------------------------------------------------------------------


def peer_token(server: Server, name: str) -> str:
    """`metanode peers token create` on a running server's data directory."""
    command = ["peers", "token", "create", "--name", name, "--data-dir", str(server.data_dir)]
    made = subprocess.run(
        [sys.executable, "-m", "metanode", *command],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return made.stdout.strip()


async def test_a_peers_claims_refused_before_network_time_are_fetched_once_it_is_set(
    tmp_path: Path,
) -> None:
    """A box that boots at 1970 refuses every claim of the peer it follows as dated 56 years
    ahead (`ts_in_future`), and reads the log past them. Before, it reconciled for them after
    a timer of 56 years, which never rang once network time set the clock: they stayed lacking
    (after a restart too) until someone ran `peers sync`."""
    (tmp_path / "a").mkdir()
    a = Server(tmp_path / "a" / "data", env={"METANODE_WATCH_ENABLED": "false"}).start()
    try:
        signer = Signer()
        a.register(signer.uid, "t", weight=1)
        wire = signer.claim(CID_A, "title", "From a", ts=time.time_ns() // 1_000_000)
        answer = httpx.post(f"{a.url}/api/claims", json={"claims": [wire]}, headers=a.headers)
        assert answer.status_code == 200, answer.text
        clock = Clock(BOOT)
        settings = settings_for(
            tmp_path / "b" / "data", peer_poll_s=0.2, peer_retry_s=0.2, peer_max_backoff_s=1.0
        )
        node = Node(settings, clock=clock)
        await node.start()
        try:
            await node.add_peer(a.url, peer_token(a, "b"), 1, "a")
            follower = node.peers.followers["a"]
            await until(lambda: follower.resync_at is not None, "the claim refused as ahead")
            assert node.claim_count() == 0
            clock.ms = time.time_ns() // 1_000_000  # network time
            await until(lambda: node.claim_count() == 1, "the claim fetched once it is valid")
            rid = node.group_of(CID_A)
            assert rid is not None and node.record_value(rid, "title") == "From a"
        finally:
            await node.stop()
    finally:
        a.stop()
        a.print_log()
