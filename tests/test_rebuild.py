"""`metanode rebuild-cache` beside a serving node (docs/operations.md, "Rebuilding the cache").

Run by the command in one transaction of the whole cache, the rebuild held every write of the
node behind it: at 500,000 claims posts waited 37 s (answered 202 after `apply_wait_s`), and
past SQLite's 30 s busy wait the node logged cache write errors. Now the command asks the node
(`POST /api/cache/rebuild`), whose applier rebuilds in place, `cache.REBUILD_CHUNK` records a
transaction, posts applied between two steps; the feed keeps its epoch and carries what
differed as ordinary events. Real `metanode serve` processes, real CLI processes.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cache
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.feed import Replica, Stream, cid_n, new_cid_claims
from tests.helpers.server import Server, metanode_check
from tests.helpers.settings import reading
from tests.helpers.wait import DEADLINE_S, poll

STRAY = "7ZZZZZZZZZZZZZZZZZZZZZZZZZ"  # a rid no truth holds, after every real one


Launch = Callable[[Path], Server]


@pytest.fixture
def launch(storage: str) -> Iterator[Launch]:
    """Start servers on `storage` (no watcher); whatever still runs at the end is stopped."""
    started: list[Server] = []

    def start(data_dir: Path) -> Server:
        env = {"METANODE_STORAGE": storage, "METANODE_WATCH_ENABLED": "false"}
        srv = Server(data_dir, env=env)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        if srv.proc is not None:
            srv.stop()


def post_records(server: Server, signer: Signer, tag: str, count: int) -> None:
    """`count` records of one title each, in bodies of 500."""
    wires = new_cid_claims(signer, tag, count)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=DEADLINE_S) as http:
        for start in range(0, count, 500):
            answer = http.post("/api/claims", json={"claims": wires[start : start + 500]})
            assert answer.status_code == 200, answer.text


class Poster:
    """Posts one-claim bodies, each on a new CID, back to back on a thread until stopped: every
    answer's status kept, and the claims the node acknowledged (200 or 202)."""

    def __init__(self, server: Server, signer: Signer, tag: str) -> None:
        self.statuses: list[int] = []
        self.acknowledged: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._claims = iter(
            fast_claims(
                signer, [(cid_n(tag, n), "title", f"{tag} {n}", NOW_MS) for n in range(20_000)]
            )
        )
        self._http = httpx.Client(base_url=server.url, headers=server.headers, timeout=DEADLINE_S)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            claim = next(self._claims)
            try:
                answer = self._http.post("/api/claims", json={"claims": [claim]})
            except httpx.TransportError:  # the node was killed: this one was never acknowledged
                return
            self.statuses.append(answer.status_code)
            if answer.status_code in (200, 202):
                self.acknowledged.append(claim)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self._http.close()


def health(server: Server) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{server.url}/health", timeout=DEADLINE_S).json()
    return body


def rebuild_command(data_dir: Path) -> list[str]:
    return [sys.executable, "-m", "metanode", "rebuild-cache", "--data-dir", str(data_dir)]


def all_there(server: Server, acknowledged: list[dict[str, Any]]) -> None:
    """Every acknowledged claim is in the record its CID resolves to."""
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as http:
        for claim in acknowledged:
            got = http.get(f"/api/meta/{claim['cid']}")
            assert got.status_code == 200, got.text
            assert got.json()["metadata"]["title"] == claim["value"], claim


def rid_of(server: Server, cid: str) -> str:
    with reading(server.data_dir, "cache", server.storage) as conn:
        row = conn.execute("SELECT rid FROM cid_index WHERE cid = ?", (cid,)).fetchone()
    return str(row[0])


def tamper(server: Server, changed: str, emptied: str) -> None:
    """Make the cache wrong three ways a rebuild must mend: a title changed, a title gone, and
    a record of a rid the truth does not hold."""
    opened = contextlib.closing(sqlite3.connect(server.data_dir / "cache.db", timeout=60))
    with opened as conn, conn:
        conn.execute(
            "UPDATE records SET value = 'tampered' WHERE rid = ? AND key = 'title'", (changed,)
        )
        conn.execute("DELETE FROM records WHERE rid = ? AND key = 'title'", (emptied,))
        conn.execute("INSERT INTO records VALUES (?, 'title', 'stray')", (STRAY,))


def feed_head(server: Server) -> int:
    with reading(server.data_dir, "cache", server.storage) as conn:
        return int(conn.execute("SELECT value FROM state WHERE name = 'feed_seq'").fetchone()[0])


def quiet_log(server: Server) -> None:
    """No error and no warning in the node's log: the cache's writes never failed."""
    said = [
        line
        for line in server.log_text().splitlines()
        if '"level": "error"' in line or '"level": "warning"' in line
    ]
    assert not said, said


def test_rebuild_cache_beside_a_serving_node_is_done_in_place_between_posts(
    tmp_path: Path, launch: Launch
) -> None:
    """The command asks the node; the node mends what differed, posts answered 200 throughout,
    the feed on its epoch without a gap carrying the mends, nothing logged."""
    server = launch(tmp_path / "data")
    signer = Signer()
    server.register(signer.uid, "rebuild")
    records = 20 * cache.REBUILD_CHUNK
    post_records(server, signer, "before", records)
    changed, emptied = rid_of(server, cid_n("before", 3)), rid_of(server, cid_n("before", 7))
    tamper(server, changed, emptied)
    epoch = health(server)["epoch"]
    stream = Stream(server, params=[("snapshot", "1")])
    replica = stream.until(lambda r: bool(r.synced), Replica(gaps_allowed=False))
    assert replica.state[(changed, "title")] == "tampered"  # the feed read the wrong cache

    refused = httpx.post(f"{server.url}/api/cache/rebuild", timeout=DEADLINE_S)
    assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    poster = Poster(server, signer, "during")
    try:
        done = subprocess.run(
            rebuild_command(server.data_dir),
            capture_output=True,
            text=True,
            timeout=DEADLINE_S * 2,
            env=server.base_env() | server.env,
        )
    finally:
        poster.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rebuilds its cache in place" in done.stdout, done.stdout
    assert done.stdout.splitlines()[-1].startswith(f"rebuilt: epoch {epoch}, "), done.stdout
    assert poster.statuses and set(poster.statuses) == {200}, poster.statuses
    after = health(server)
    assert (after["epoch"], after["rebuilding"], after["status"]) == (epoch, False, "ok"), after

    replica = stream.until(lambda r: r.position == feed_head(server), replica)
    stream.close()
    with reading(server.data_dir, "cache", server.storage) as conn:
        rows = conn.execute("SELECT rid, key, value FROM records").fetchall()
    assert replica.state == {(rid, key): value for rid, key, value in rows}
    mends = [(f.event, f.data["rid"], f.data.get("value")) for f in replica.history]
    assert ("set", changed, "before 3") in mends and ("set", emptied, "before 7") in mends
    assert ("del", STRAY, None) in mends
    all_there(server, poster.acknowledged)
    quiet_log(server)
    server.stop()
    metanode_check(server.data_dir, server.storage)


def rebuilt_through(server: Server) -> int | None:
    """The high half of the rid the rebuild in place has reached, None if none is under way."""
    with reading(server.data_dir, "cache", server.storage) as conn:
        row = conn.execute("SELECT value FROM state WHERE name = ?", (cache.REBUILD_HI,)).fetchone()
    return None if row is None else int(row[0])


@pytest.mark.both_backends
def test_a_rebuild_in_place_outlives_its_command_and_goes_on_after_a_sigkill(
    tmp_path: Path, launch: Launch
) -> None:
    """The command killed while it waits: the node rebuilds on. Asked again, it starts over;
    the node killed mid-rebuild: the waiting command says the rebuild goes on, and the
    restarted node goes on from the last step that committed, no acknowledged claim lost, the
    cache ending as a rebuild makes it (`metanode check`)."""
    data = tmp_path / "data"
    first = launch(data)
    signer = Signer()
    first.register(signer.uid, "rebuild")
    post_records(first, signer, "before", 80 * cache.REBUILD_CHUNK)
    poster = Poster(first, signer, "during")
    env = first.base_env() | first.env
    killed = subprocess.Popen(
        rebuild_command(data), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        poll(lambda: True if health(first)["rebuilding"] else None, "the rebuild started")
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(DEADLINE_S)
    poll(lambda: rebuilt_through(first) or None, "a step without the command")

    said = tmp_path / "rebuild-cache.out"
    with said.open("w") as out:
        waiting = subprocess.Popen(rebuild_command(data), env=env, stdout=out, stderr=out)
    try:
        poll(lambda: "in place" in said.read_text() or None, "the rebuild asked again")
        poll(lambda: rebuilt_through(first) or None, "a step of the rebuild started over")
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        assert waiting.wait(DEADLINE_S) == 2
    finally:
        waiting.kill()
        poster.stop()
    assert "error: unreachable: " in said.read_text()
    assert "the rebuild goes on from its last step when the node starts again" in said.read_text()
    assert set(poster.statuses) <= {200}, poster.statuses
    assert rebuilt_through(first), "killed mid-rebuild, a step committed"

    second = launch(data)
    poll(
        lambda: (
            True if not health(second)["rebuilding"] and not health(second)["apply_lag"] else None
        ),
        "the rebuild gone on to its end after the restart",
    )
    all_there(second, poster.acknowledged)
    second.stop()
    metanode_check(data, second.storage)
