"""Operability: metrics, logs with request ids, health, backup, export and import."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pty
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cache, db, keys, logs, maintenance, pg, truth, watcher
from metanode import cid as cids
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer, fast_claims, post, register
from tests.helpers.postgres import Storages
from tests.helpers.server import Server, metanode_check
from tests.helpers.settings import settings_for
from tests.helpers.wait import poll, until


def metric(text: str, name: str) -> float:
    """The value of one sample line `name value` of a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.both_backends
async def test_metrics_change_as_claims_flow(client: httpx.AsyncClient, node: Node) -> None:
    signer = Signer()
    await register(client, signer, may_link=True)
    before = (await client.get("/metrics")).text
    a, b = cids.midhash_bytes(b"m1"), cids.midhash_bytes(b"m2")
    await post(client, signer.claim(a, "title", "x"), signer.claim(b, "title", "y"))
    await post(client, signer.claim(a, "title", "x"))  # duplicate
    await post(client, signer.claim(a, f"cids/{b}", "true"))  # merges the two groups
    await post(client, {**signer.claim(a, "year", "1"), "sig": "A" * 86})  # rejected
    after = (await client.get("/metrics")).text
    assert (
        metric(after, 'metanode_claims_total{verdict="accepted"}')
        - metric(before, 'metanode_claims_total{verdict="accepted"}')
        == 3
    )
    assert metric(after, 'metanode_claims_total{verdict="duplicate"}') == 1
    assert metric(after, 'metanode_claims_rejected_total{slug="bad_signature"}') == 1
    assert metric(after, "metanode_records") == 1
    assert (metric(after, "metanode_groups"), metric(after, "metanode_merges")) == (1, 1)
    assert metric(after, "metanode_ingest_seconds_count") == 3
    # the posts that wrote something (not the duplicate) were applied during their COMMIT
    assert metric(after, "metanode_applied_ahead_total") == (0 if node.settings.postgresql else 2)
    assert metric(after, "metanode_apply_lag") == 0
    assert metric(after, "metanode_replans") == 0
    assert (
        metric(after, "metanode_health_problems"),
        metric(after, "metanode_health_warnings"),
    ) == (0, 0)
    assert 'metanode_request_seconds_count{method="POST",route="/api/claims",status="200"}' in after
    assert "_created" not in after  # `metanode_claims_created{…} 1.79e+09` read as a count
    assert (await client.get("/metrics", headers={"Authorization": ""})).status_code == 401


async def test_a_scrape_counts_rows_off_the_event_loops_connections(
    client: httpx.AsyncClient, node: Node
) -> None:
    """The gauges that count rows (scans: 0.4 s at 1M records) are read on a thread, on
    connections of their own: none of them runs on the connections the event loop reads with,
    which a scan would hold for as long."""
    signer = Signer()
    await register(client, signer)
    await post(client, signer.claim(cids.midhash_bytes(b"scrape"), "title", "x"))
    on_loop: list[str] = []
    loop_connections = (node.truth.conn, node.cache.conn)
    for conn in loop_connections:
        conn.set_trace_callback(on_loop.append)
    try:
        text = (await client.get("/metrics")).text
    finally:
        for conn in loop_connections:
            conn.set_trace_callback(None)
    assert (metric(text, "metanode_records"), metric(text, "metanode_groups")) == (1, 1)
    assert on_loop and not [sql for sql in on_loop if "count(" in sql.lower()], on_loop


@pytest.mark.both_backends
async def test_a_scrape_and_the_replicas_poll_answer_while_every_lent_connection_is_held(
    client: httpx.AsyncClient, node: Node, storage: str
) -> None:
    """Long reads (exports, reconciliation, plugin threads) may take every lent read
    connection of a store (PostgreSQL's pool, `POOL_MAX` each); a scrape and the applier's
    poll of the truth (`applier.Replica`) read on connections of their own, so they never wait
    for them (they did: 10 s, then a 503 and a failed poll)."""
    with contextlib.ExitStack() as held:
        for store in (node.truth, node.cache):
            for _ in range(1 if storage == "sqlite" else pg.POOL_MAX):
                held.enter_context(store.reading())
        response = await client.get("/metrics")
        polled = await asyncio.to_thread(node.truth.max_seq_apart)
    assert response.status_code == 200, response.text
    assert metric(response.text, "metanode_records") == 0
    assert polled == node.truth.max_seq()


@pytest.mark.parametrize("log_access", [False, True])
async def test_request_id_is_echoed_and_logged(
    tmp_path: Path, log_access: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from metanode.api import create_app

    caplog.set_level(logging.INFO, logger="metanode.access")
    node = Node(settings_for(tmp_path / "d", log_access=log_access))
    await node.start()
    try:
        transport = httpx.ASGITransport(app=create_app(node))
        async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
            response = await client.get("/health", headers={"X-Request-ID": "abc-123"})
            assert response.headers["x-request-id"] == "abc-123"
            ids = {(await client.get("/health")).headers["x-request-id"] for _ in range(3)}
    finally:
        await node.stop()
    assert len(ids) == 3 and all(len(i) == 16 for i in ids)
    access = [r for r in caplog.records if r.name == "metanode.access"]
    logged = {getattr(r, "fields", {}).get("path") for r in access}
    assert logged == ({"/health"} if log_access else set())


def test_json_log_lines_carry_the_request_id() -> None:
    record = logging.LogRecord(
        "metanode.test", logging.INFO, __file__, 1, "hello %s", ("you",), None
    )
    record.request_id = "r-1"
    record.fields = {"status": 200}
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["msg"] == "hello you" and line["request_id"] == "r-1" and line["status"] == 200
    assert line["level"] == "info" and line["ts"].endswith("Z")


def test_on_a_terminal_a_request_can_neither_end_a_log_line_nor_command_the_terminal(
    tmp_path: Path,
) -> None:
    """On a terminal the log is readable lines, not JSON. The access line wrote a request's
    path as uvicorn decoded it: `%0A` ended the line, so the rest read as a line of the
    sender's wording (a forged `ERROR`), and `%1B` sent the terminal an escape sequence (colour,
    title, worse on some terminals). A real `serve` on a pseudo-terminal; both are escaped."""
    server = Server(tmp_path / "data", env={"METANODE_LOG_ACCESS": "true"})
    main, terminal = pty.openpty()
    said = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):  # EIO once the process and its terminal are gone
            while chunk := os.read(main, 65536):
                said.extend(chunk)

    serve = [sys.executable, "-m", "metanode", "serve", "--data-dir", str(server.data_dir)]
    process = subprocess.Popen(
        [*serve, "--port", str(server.port), "--workers", "1"],
        env={**server.base_env(), **server.env},
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        poll(lambda: b"Application startup complete" in said or None, "the node to start")
        forged = "/x%0A2026-01-01 00:00:00,000 ERROR metanode forged%1B]0;owned%07%1B[31m"
        assert httpx.get(f"{server.url}{forged}", timeout=10).status_code == 401
        poll(lambda: b"GET /x" in said or None, "the access line")
    finally:
        process.terminate()
        process.wait(timeout=30)
        reader.join(timeout=30)
        os.close(main)
    text = said.decode("utf-8", "replace")
    line = next(line for line in text.splitlines() if "GET /x" in line)
    assert " 401 " in line and line.endswith(" ms")  # the path did not end the line
    assert "\\n2026-01-01 00:00:00,000 ERROR metanode forged\\x1b]0;owned\\x07\\x1b[31m" in line
    assert "\x1b" not in text and "\x07" not in text
    assert not any(row.startswith("2026-01-01") for row in text.splitlines())


def test_a_terminal_log_line_escapes_a_file_names_control_characters() -> None:
    """A name holding an escape sequence recoloured the terminal `serve` logged it to, one
    holding a line feed made two lines; a traceback keeps its lines."""
    name = "/media/\x1b[31mred\x1b[0m\nline\x85.mkv"
    try:
        raise ValueError("disk on fire")
    except ValueError:
        failure = sys.exc_info()
    record = logging.LogRecord(
        "metanode.test", logging.WARNING, __file__, 1, "at %s", (name,), failure
    )
    record.request_id = "-"
    line = logs.ReadableFormatter().format(record)
    first, *traceback = line.split("\n")
    assert first.endswith(
        " WARNING metanode.test [-] at /media/\\x1b[31mred\\x1b[0m\\nline\\x85.mkv"
    )
    assert traceback[0] == "Traceback (most recent call last):"


@pytest.mark.parametrize("chatty", ["httpx", "watchfiles.main"])
def test_libraries_that_log_each_request_or_file_event_are_quiet_at_info(chatty: str) -> None:
    """watchfiles said `1 change detected` at info for every batch of file events (a download
    into the library: a line a second), httpx each peer poll."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logs.configure("info", json_lines=True)
        assert not logging.getLogger(chatty).isEnabledFor(logging.INFO)
        assert logging.getLogger(chatty).isEnabledFor(logging.WARNING)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name in ("httpx", "watchfiles"):
            logging.getLogger(name).setLevel(logging.NOTSET)


async def test_a_service_that_fails_is_said_in_the_log_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A watcher ended by an exception no code foresaw: /health said "the watcher has
    stopped", and the log nothing of why until the node stopped (if ever)."""

    async def broken(self: Any) -> None:
        raise RuntimeError("an unforeseen failure")

    monkeypatch.setattr(watcher.Watcher, "run", broken)
    node = Node(settings_for(tmp_path / "d", watch_enabled=True))
    await node.start()
    try:
        await until(
            lambda: any(
                "watcher stopped: an unforeseen failure" in r.message for r in caplog.records
            ),
            "the watcher's failure in the log",
        )
        (said,) = [r for r in caplog.records if "watcher stopped" in r.message]
        assert said.levelname == "ERROR" and said.exc_info is not None
        assert "the watcher has stopped" in node.health()["problems"]
    finally:
        await node.stop()


async def test_health_degrades_when_the_watcher_stalls(tmp_path: Path) -> None:
    node = Node(settings_for(tmp_path / "d", watch_enabled=True))
    await node.start()
    try:
        assert node.health()["problems"] == ["the cache is being built"] or node.applier.ready
        assert await node.applier.wait_for(0, 10)
        assert node.health()["status"] == "ok"
        assert node.watcher is not None
        node.watcher.heartbeat -= 3600  # as if the settle loop had not turned for an hour
        health = node.health()
        assert health["status"] == "degraded" and "the watcher has stopped" in health["problems"]
    finally:
        await node.stop()


def cli(*args: str, storage: str = "sqlite") -> subprocess.CompletedProcess[str]:
    """`metanode ARGS` (the stores on `storage`); it must succeed."""
    done = metanode(*args, storage=storage)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def metanode(*args: str, storage: str = "sqlite") -> subprocess.CompletedProcess[str]:
    """`metanode ARGS` (the stores on `storage`), run to its end whatever it answers."""
    return subprocess.run(
        [sys.executable, "-m", "metanode", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "METANODE_STORAGE": storage},
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_stops_the_node_cleanly_and_says_so(tmp_path: Path, workers: int) -> None:
    """SIGHUP, what a closed terminal sends `make serve` (or a `kill -HUP` meant as "reload"),
    killed the node outright: no line in the log, and nothing of a clean stop (feeds cut,
    the sockets left, the data directory's lock not marked stopped). It is a clean stop as
    SIGTERM's, said in the log; MetaMesh's lock file stays, as at every stop (compat.announce)."""
    volume = tmp_path / "meta-core"
    srv = Server(tmp_path / "data", env={"METANODE_METAMESH_VOLUME": str(volume)}, workers=workers)
    srv.start()
    lock = volume / "locks" / "kv-leader.info"
    assert lock.exists()
    assert srv.stop(signal.SIGHUP) == 0
    log = srv.log_text()
    assert "SIGHUP: stopping" in log and "Application shutdown complete" in log, log
    assert lock.exists()
    assert (srv.data_dir / "lock").read_text().split()[1:] == ["stopped"]
    assert not (srv.data_dir / "owner.sock").exists()


def test_a_leaked_token_is_replaced_by_removing_it_and_restarting(tmp_path: Path) -> None:
    """operations.md's way to replace a token others have seen (in `docker logs`, a shared
    screenshot): stop, remove `api-token`, start. The start prints a new one, once; the old one
    is refused, and a browser signed in with it is signed out; the claims and keys stay."""
    srv = Server(tmp_path / "data").start()
    old = srv.token
    owner = httpx.get(f"{srv.url}/api/signers", headers=srv.headers).json()
    cookies = httpx.Cookies()
    with httpx.Client(base_url=srv.url, cookies=cookies) as browser:
        signin = {"token": old, "then": "/files"}
        signed_in = browser.post(
            "/signin", data=signin, headers={"Origin": srv.url}, follow_redirects=True
        )
        assert signed_in.status_code == 200 and "<h1>Files</h1>" in signed_in.text
    srv.stop()
    (srv.data_dir / "api-token").unlink()
    srv.start()
    try:
        new = srv.token
        assert new != old
        shown = f"API token, shown once (kept in {srv.data_dir / 'api-token'}): {new}"
        assert srv.log_text().count("API token, shown once") == 2 and shown in srv.log_text()
        with httpx.Client(base_url=srv.url, cookies=cookies) as browser:
            refused = browser.get("/api/signers", headers={"Authorization": f"Bearer {old}"})
            assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
            assert browser.get("/api/signers", headers=srv.headers).json() == owner
            assert "<h1>Sign in</h1>" in browser.get("/files").text  # the session ended
    finally:
        srv.stop()


def test_backup_names_within_one_second_never_meet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backups are named by the second: the next ones within it get `-2`, `-3` rather than
    failing on the name, past a keys folder already there too (the clock held still)."""
    still = time.gmtime(1796083584)
    monkeypatch.setattr(time, "gmtime", lambda *_: still)
    (tmp_path / "keys-20261201T000624Z-3").mkdir()
    names = [maintenance._backup_names(tmp_path, "db") for _ in "123"]
    for _, _, held in names:
        os.close(held)
    assert [(copy.name, folder.name) for copy, folder, _ in names] == [
        ("truth-20261201T000624Z.db", "keys-20261201T000624Z"),
        ("truth-20261201T000624Z-2.db", "keys-20261201T000624Z-2"),
        ("truth-20261201T000624Z-4.db", "keys-20261201T000624Z-4"),
    ]
    reserved = [copy.with_name(copy.name + ".partial") for copy, _, _ in names]
    assert all(p.is_file() and p.stat().st_mode & 0o777 == 0o600 for p in reserved)
    assert not any(copy.exists() for copy, _, _ in names)  # the name of a whole backup only


def test_two_backups_are_two_and_a_failed_one_leaves_nothing(tmp_path: Path) -> None:
    """Each backup is a truth copy and its keys. A keys folder that cannot be copied (a named
    pipe in it) fails the backup whole: no truth copy is left without its keys."""
    data, into = tmp_path / "data", tmp_path / "bk"
    cli("init", "--data-dir", str(data))
    first, second = (
        Path(cli("backup", str(into), "--data-dir", str(data)).stdout.strip()) for _ in "12"
    )
    assert first != second and first.is_file() and second.is_file()
    assert len([p for p in into.iterdir() if p.name.startswith("keys-")]) == 2
    os.mkfifo(data / "keys" / "a-pipe")
    bad = ["backup", str(tmp_path / "bad"), "--data-dir", str(data)]
    done = subprocess.run(
        [sys.executable, "-m", "metanode", *bad],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    pipe = data / "keys" / "a-pipe"
    assert done.stderr.splitlines()[-1] == f"error: file_failed: `{pipe}` is a named pipe"
    assert list((tmp_path / "bad").iterdir()) == []


@contextlib.contextmanager
def truth_locked(data: Path) -> Iterator[None]:
    """truth.db held under an exclusive lock (no reader gets in) for the block."""
    lock = sqlite3.connect(data / "truth.db", isolation_level=None)
    lock.execute("PRAGMA locking_mode=EXCLUSIVE")
    lock.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def backup_begun(into: Path) -> subprocess.Popen[str]:
    """A `backup` into `into` whose copy has begun (its `.partial` made)."""
    data = into.parent / "data"
    backup = subprocess.Popen(
        [sys.executable, "-m", "metanode", "backup", str(into), "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    poll(lambda: True if into.is_dir() and any(into.glob("*.partial")) else None, "a .partial")
    return backup


def test_ctrl_c_stops_a_backup_waiting_on_a_locked_truth_at_once(tmp_path: Path) -> None:
    """SQLite waits for a locked database in C (its busy timeout, 30 s), where a Ctrl-C is not
    taken: a `backup` waiting on a locked truth.db exited 130 only 30 s after the SIGINT. Now
    it waits in Python, which takes it at once: it exits before the busy timeout could have
    ended, leaving nothing; and a backup whose truth is unlocked meanwhile still completes."""
    data, into = tmp_path / "data", tmp_path / "bk"
    cli("init", "--data-dir", str(data))
    with truth_locked(data):
        began = time.monotonic()
        backup = backup_begun(into)
        assert backup.poll() is None, "the backup did not wait for the locked truth"
        backup.send_signal(signal.SIGINT)
        # a bound on a hang, not a measurement: SQLite's own wait would have ended here
        out, err = backup.communicate(
            timeout=db.BUSY_TIMEOUT_MS / 1000 - (time.monotonic() - began)
        )
    assert backup.returncode == 130, out + err
    assert err.splitlines()[-1] == "error: interrupted"
    assert list(into.iterdir()) == []
    with truth_locked(data):
        waiting = backup_begun(into)
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, out + err
    assert Path(out.strip()).is_file()


def test_a_killed_backup_leaves_no_backup_name_and_the_next_one_clears_what_it_left(
    tmp_path: Path,
) -> None:
    """`backup` wrote its copy under its final name from the start: killed mid-way it left a
    file that looked like the newest backup. Then it wrote `truth-<stamp>.db.partial`, renamed
    once whole, but left that `.partial` (and the keys copied by then) to be deleted by hand,
    and `restore` took a `.partial` that held a whole copy. Now a running backup holds its
    `.partial` (`flock`), and the next backup into the folder removes every one no backup
    holds, with what that backup made beside it; `restore` refuses any `.partial`. Held
    mid-way deterministically: the truth is locked, so the copies wait for it."""
    data, into = tmp_path / "data", tmp_path / "bk"
    cli("init", "--data-dir", str(data))
    kept = Path(cli("backup", str(into), "--data-dir", str(data)).stdout.strip())
    partials = lambda: sorted(into.glob("*.partial"))  # noqa: E731
    with truth_locked(data):
        killed = backup_begun(into)
        first = partials()
        running = subprocess.Popen(
            [sys.executable, "-m", "metanode", "backup", str(into), "--data-dir", str(data)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            poll(lambda: True if len(partials()) == 2 else None, "the second backup begun")
            assert first[0] in partials(), "a running backup's .partial was taken"
        finally:
            killed.kill()
            killed.communicate()
            running.send_signal(signal.SIGINT)  # cleans up after itself (exit 130)
            _, err = running.communicate(timeout=120)
    assert running.returncode == 130, err
    assert partials() == first  # the killed one's alone, left
    # a backup killed after its keys were copied, made by hand: the same names
    stamp = "20000101T000000Z"
    shutil.copy(kept, into / f"truth-{stamp}.db.partial")  # whole, never renamed
    shutil.copytree(data / "keys", into / f"keys-{stamp}")
    (into / f"watched-folders-{stamp}.json").write_text("[]")
    refused = metanode("restore", str(into / f"truth-{stamp}.db.partial"),
                       "--data-dir", str(tmp_path / "restored"))  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: invalid_request: ") and (
        "is the copy of a backup that did not finish (killed mid-way)" in refused.stderr
    ), refused.stderr
    assert not (tmp_path / "restored").exists()
    done = cli("backup", str(into), "--data-dir", str(data))
    whole = Path(done.stdout.strip())
    removed = sorted([first[0].name, f"truth-{stamp}.db.partial", f"keys-{stamp}",
                      f"watched-folders-{stamp}.json"])  # fmt: skip
    said = done.stderr.strip().removeprefix("removed what backups that did not finish left: ")
    assert sorted(said.split(", ")) == removed, done.stderr
    stamps = [kept.name.removesuffix(".db"), whole.name.removesuffix(".db")]
    assert sorted(p.name for p in into.iterdir()) == sorted(
        [*(f"{t}.db" for t in stamps), *(t.replace("truth-", "keys-") for t in stamps)]
    )
    cli("restore", str(whole), "--data-dir", str(tmp_path / "restored"))
    assert (tmp_path / "restored" / "truth.db").is_file()


def test_backup_copies_the_truth_as_it_is_and_a_newer_schema_is_refused_in_words(
    tmp_path: Path,
) -> None:
    """`backup` migrated the truth before copying it, so the copy taken before an upgrade (as
    the docs advise) no longer opened in the version before; and a truth of a newer metanode
    was a RuntimeError traceback for every command. Here a truth one schema ahead: `backup`
    copies it untouched, the others say `schema_too_new`, exit 2."""
    data = tmp_path / "data"
    cli("init", "--data-dir", str(data))
    newer = len(truth.MIGRATIONS) + 1
    with contextlib.closing(sqlite3.connect(data / "truth.db")) as conn:
        conn.execute(f"PRAGMA user_version = {newer}")
    copy = Path(cli("backup", str(tmp_path / "bk"), "--data-dir", str(data)).stdout.strip())
    for db_file in (data / "truth.db", copy):
        with contextlib.closing(sqlite3.connect(db_file)) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == newer, db_file
    for args in (("check",), ("export",), ("serve", "--workers", "1")):
        done = subprocess.run(
            [sys.executable, "-m", "metanode", *args, "--data-dir", str(data)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "METANODE_WATCH_ENABLED": "0"},
        )
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.startswith(
            f"error: schema_too_new: {data / 'truth.db'} is of schema {newer}, newer than this "
            f"metanode's ({len(truth.MIGRATIONS)}): upgrade metanode, or go back to what a "
            "backup taken before the upgrade holds (`metanode restore`"
        ), done.stderr


def test_a_newer_cache_is_named_and_building_it_anew_keeps_every_claim(tmp_path: Path) -> None:
    """Going back to an older metanode after an upgrade that changed only the cache's schema
    (from 2ae3e30, truth 5 and cache 9, to cache 11) was refused with "database schema 11 is
    newer than this metanode's (9): ... restore a backup taken before", naming neither file,
    and the restore would have lost every claim made since the upgrade. The cache holds nothing
    the truth does not: the refusal names cache.db and says to move it aside, and doing so
    brings the node back with every claim (a cache of a schema one ahead stands in for it)."""
    data = tmp_path / "data"
    cli("init", "--data-dir", str(data))
    signer = Signer()
    claims = [
        signer.claim(cids.midhash_bytes(f"n{n}".encode()), "title", f"t{n}") for n in range(50)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(c) + "\n" for c in claims))
    cli("import", str(tmp_path / "in.jsonl"), "--register-signers", "--data-dir", str(data))
    newer = len(cache.MIGRATIONS) + 1
    with contextlib.closing(sqlite3.connect(data / "cache.db")) as conn:
        conn.execute(f"PRAGMA user_version = {newer}")
    done = metanode("check", "--data-dir", str(data))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        f"error: schema_too_new: {data / 'cache.db'} is of schema {newer}, newer than this "
        f"metanode's ({len(cache.MIGRATIONS)}): upgrade metanode, or let it build the cache anew "
        "from the truth: with the node stopped, move cache.db (with its -wal and -shm) out of "
        "the data directory;"
    ), done.stderr
    aside = tmp_path / "aside"
    aside.mkdir()
    for path in data.glob("cache.db*"):
        path.rename(aside / path.name)
    cli("rebuild-cache", "--data-dir", str(data))  # what the next start does by itself
    assert cli("check", "--data-dir", str(data)).stdout.strip() == "50 claims verified; clean"
    exported = cli("export", "--data-dir", str(data)).stdout
    assert sorted(json.loads(line)["value"] for line in exported.splitlines()) == sorted(
        c["value"] for c in claims
    )


class _HeldMidway(list[str]):
    """The truth's rids, holding the rebuild that reads them at its second chunk: `midway` is
    set there, and the rebuild goes on once `resume` is."""

    def __init__(self) -> None:
        super().__init__()
        self.midway, self.resume = threading.Event(), threading.Event()

    def filled(self, rids: list[str]) -> _HeldMidway:
        self[:] = rids
        return self

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice) and index.start:
            self.midway.set()
            self.resume.wait()
        return super().__getitem__(index)


def test_ctrl_c_stops_a_rebuild_and_keeps_the_cache_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C of `rebuild-cache` (or of `check`'s fresh rebuild) waited for the rebuild, one
    transaction on the writer's thread, to run to its end (26 s on a busy box of 340,000
    changes), and then said `error: interrupted`, exit 130: the cache rebuilt all the same, a
    new epoch and a gap for every feed reader. Now the rebuild stops at its next chunk and
    rolls back. Held at its second chunk here, the Ctrl-C sent to the waiting thread."""
    data = tmp_path / "data"
    cli("init", "--data-dir", str(data))
    signer, lines = Signer(), tmp_path / "claims.jsonl"
    made = fast_claims(
        signer, [(cids.midhash_bytes(f"c{n}".encode()), "title", f"t{n}", NOW_MS) for n in range(6)]
    )
    lines.write_text("".join(json.dumps(c) + "\n" for c in made))
    cli("import", str(lines), "--register-signers", "--data-dir", str(data))
    monkeypatch.setattr(cache, "CHUNK", 2)
    rids = _HeldMidway()
    real = truth.active_rids
    monkeypatch.setattr(truth, "active_rids", lambda conn: rids.filled(real(conn)))

    def interrupt() -> None:
        rids.midway.wait()
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        try:
            poll(lambda: True if _waiting_out_the_rebuild() else None, "the Ctrl-C taken")
        finally:  # else the rebuild runs to its end, as it did before
            rids.resume.set()

    settings = settings_for(data)
    with (
        truth.TruthStore.configured(settings).open() as source,
        cache.CacheStore.configured(settings).open() as store,
    ):
        before = (store.state(), store.conn.execute("SELECT * FROM records").fetchall())
        helper = threading.Thread(target=interrupt)
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            store.build_sync(source)
        helper.join()
    with cache.CacheStore.configured(settings).open() as store:  # the rebuild over, either way
        after = (store.state(), store.conn.execute("SELECT * FROM records").fetchall())
    assert len(before[1]) >= 6 and after == before


def _waiting_out_the_rebuild() -> bool:
    """The main thread took the Ctrl-C and waits for the rebuild to roll back."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == "wait" and "concurrent" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_backup_during_ingest_is_consistent(tmp_path: Path) -> None:
    server = Server(tmp_path / "data").start()
    signer = Signer()
    stop = threading.Event()
    try:
        httpx.post(
            f"{server.url}/api/signers",
            headers=server.headers,
            timeout=10,
            json={"uid": signer.uid, "name": "s", "may_link": True},
        ).raise_for_status()

        def ingest() -> None:
            n = 0
            while not stop.is_set() and n < 200:
                batch = [
                    signer.claim(cids.midhash_bytes(f"b{n}-{i}".encode()), "title", str(i))
                    for i in range(50)
                ]
                httpx.post(
                    f"{server.url}/api/claims",
                    json={"claims": batch},
                    headers=server.headers,
                    timeout=30,
                ).raise_for_status()
                n += 1

        keys.create(server.data_dir / "keys" / "someone.key")
        writer = threading.Thread(target=ingest)
        writer.start()
        copies = [
            Path(
                cli(
                    "backup", str(tmp_path / "bk"), "--data-dir", str(server.data_dir)
                ).stdout.strip()
            )
        ]
        stop.set()
        writer.join()
    finally:
        stop.set()
        server.stop()
    restored = tmp_path / "restored"
    restored.mkdir()
    copies[0].rename(restored / "truth.db")
    cli("rebuild-cache", "--data-dir", str(restored))
    assert "clean" in cli("check", "--data-dir", str(restored)).stdout
    assert list((tmp_path / "bk").glob("keys-*")), "the keys were not backed up"


@pytest.mark.parametrize("stop", ["clean", "killed"])
def test_restore_puts_the_backup_back_whatever_wal_the_node_left(tmp_path: Path, stop: str) -> None:
    """A restore by hand (the backup copied over truth.db, the cache deleted) kept a claim
    written after the backup: the stopped node's truth.db-wal (left even by a clean stop: the
    read-only connection closed last) was replayed onto the copy at the next open. A clean
    stop now empties the WAL, and `metanode restore` moves truth.db with its WAL aside, so
    even after a SIGKILL (a full WAL left) the node comes back exactly as the backup was."""
    server = Server(tmp_path / "data").start()
    signer = Signer()
    before, after = (cids.midhash_bytes(name) for name in (b"before", b"after"))
    try:
        server.register(signer.uid, "s")
        posted(server, signer.claim(before, "title", "in the backup"))
        made = cli("backup", str(tmp_path / "bk"), "--data-dir", str(server.data_dir))
        posted(server, signer.claim(after, "title", "after the backup"))
    finally:
        server.stop(sig=15 if stop == "clean" else 9)
    wal = server.data_dir / "truth.db-wal"
    if stop == "clean":
        assert wal.stat().st_size == 0
    else:
        assert wal.stat().st_size > 0
    done = cli("restore", made.stdout.strip(), "--data-dir", str(server.data_dir))
    aside = Path(done.stdout.splitlines()[-1].removeprefix("what it replaced: "))
    assert {p.name for p in aside.iterdir()} >= {"truth.db", "keys"}
    assert not list(server.data_dir.glob("cache.db*"))
    checked = cli("check", "--data-dir", str(server.data_dir)).stdout  # it listed every record
    assert checked.splitlines() == [  # as missing from the cache and said MISMATCH
        "the cache is not built yet (the next start builds it): not compared",
        "1 claims verified; clean",
    ]
    server.start()
    try:
        assert (server.meta(before) or {})["metadata"]["title"] == "in the backup"
        assert "making the cache from the truth (outbox seq " in server.log_text()
        assert server.meta(after) is None
    finally:
        server.stop()
    assert "clean" in cli("check", "--data-dir", str(server.data_dir)).stdout


def check_run(data_dir: Path, storage: str = "sqlite") -> subprocess.CompletedProcess[str]:
    """`metanode check` on `data_dir`, run to its end (its exit code the caller's to judge)."""
    return subprocess.run(
        [sys.executable, "-m", "metanode", "check", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "METANODE_STORAGE": storage},
    )


def damage_title(storage: str, data_dir: Path, cid: str) -> None:
    """The title row of `cid`'s record in the live cache changed by hand, the node running."""
    sql = (
        "UPDATE {s}records SET value = 'damaged' WHERE key = 'title' AND rid = "
        "(SELECT rid FROM {s}cid_index WHERE cid = {p})"
    )
    if storage == "sqlite":
        with contextlib.closing(sqlite3.connect(data_dir / "cache.db", timeout=60)) as conn:
            conn.execute(sql.format(s="", p="?"), (cid,))
            conn.commit()
        return
    import psycopg

    with psycopg.connect(storage, autocommit=True) as conn:
        conn.execute(sql.format(s="cache.", p="%s").encode(), (cid,))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_check_beside_a_node_under_load_is_clean_and_still_finds_damage(
    tmp_path: Path, storage: str
) -> None:
    """`check` read the live cache, rebuilt from the truth, and compared: a node writing
    meanwhile (`serve`, a replica) made it say MISMATCH, 1,702 to 5,302 lines of differences,
    of a sound cache. On SQLite it compares copies of both stores taken at one moment (the
    cache's, then the truth's, the changes in between applied to the cache's copy): clean
    under load, and a row damaged by hand under the same load is MISMATCH, that row alone. On
    PostgreSQL (live schemas) never MISMATCH for writes in flight: clean or INCONCLUSIVE
    (exit 3), also with the damaged row (a cache behind the truth is not compared there)."""
    server = Server(tmp_path / "data", env={"METANODE_STORAGE": storage}).start()
    signer = Signer()
    stop = threading.Event()
    written = [0]

    def write() -> None:  # batches of 100 without pause
        while not stop.is_set():
            written[0] += 1
            batch = [(cids.midhash_bytes(b"%d.%d" % (written[0], i)), "title", "t", NOW_MS)
                     for i in range(100)]  # fmt: skip
            httpx.post(f"{server.url}/api/claims", json={"claims": fast_claims(signer, batch)},
                       headers=server.headers, timeout=120).raise_for_status()  # fmt: skip

    writer = threading.Thread(target=write)
    try:
        server.register(signer.uid, "s")
        writer.start()
        poll(lambda: written[0] > 30 or None, "claims coming in")
        before = written[0]
        sound = check_run(server.data_dir, storage)
        during = written[0] - before
        damage_title(storage, server.data_dir, cids.midhash_bytes(b"1.0"))  # written once
        before = written[0]
        damaged = check_run(server.data_dir, storage)
        during_damaged = written[0] - before
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        server.stop()
    assert during > 1 and during_damaged > 1  # claims came in while each checked
    lines = damaged.stdout.splitlines()
    differences = [line for line in lines if line.startswith("records: ")]
    ours = [line for line in differences if "'damaged')" in line]
    if storage != "sqlite":  # the live schemas: what moved meanwhile is no verdict
        assert sound.returncode in (0, 3), sound.stdout + sound.stderr
        assert damaged.returncode in (1, 3), damaged.stdout + damaged.stderr
        verdicts = {0: "clean", 1: "MISMATCH", 3: "INCONCLUSIVE"}
        for done in (sound, damaged):
            assert done.stdout.splitlines()[-1].endswith(f"; {verdicts[done.returncode]}")
        assert damaged.returncode == 3 or len(ours) == 1, lines
        return
    assert len(ours) == 1 and ours[0].startswith("records: only in live cache: ("), lines
    assert sound.returncode == 0, sound.stdout + sound.stderr
    assert sound.stdout.splitlines()[-1].endswith(" claims verified; clean"), sound.stdout
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert lines[-1].endswith(" claims verified; MISMATCH"), damaged.stdout
    assert len(differences) == 2, damaged.stdout
    assert differences[1].startswith("records: missing from live cache: (")
    assert differences[1].endswith("'title', 't')")
    assert len(lines) == 3 + sum(line.startswith("note: ") for line in lines), damaged.stdout


def write_locked(path: Path) -> bool | None:
    """True once another connection holds the write lock of the SQLite database `path`."""
    with contextlib.closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as conn:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return True
        conn.execute("ROLLBACK")
        return None


def test_check_beside_a_rebuild_says_so_and_a_second_rebuild_names_the_first(
    tmp_path: Path,
) -> None:
    """A `check` beside a `rebuild-cache` waited for the rebuild's transaction (its store's
    migration took the write lock even with nothing to migrate) and, after SQLite's 30 s,
    said `storage_locked: … cache.db: database is locked`, naming no rebuild (33 s, exit 2,
    the rebuild held mid-way). Now it takes no write lock, compares the cache as committed,
    and says a rebuild is under way; a second `rebuild-cache` is refused at once naming the
    first (its pid), from the marker the first holds (`cache.db-holder`). The rebuild is held
    mid-transaction by SIGSTOP, so nothing here depends on how long it takes."""
    data = tmp_path / "data"
    cli("init", "--data-dir", str(data))
    signer = Signer()
    items = [(cids.midhash_bytes(b"%d" % n), "title", f"t{n}", NOW_MS) for n in range(10_000)]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps(c) + "\n" for c in fast_claims(signer, items))
    )
    cli("import", str(tmp_path / "in.jsonl"), "--register-signers", "--data-dir", str(data))
    rebuild = subprocess.Popen(
        [sys.executable, "-m", "metanode", "rebuild-cache", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        poll(lambda: write_locked(data / "cache.db"), "the rebuild's transaction", timeout=60)
        rebuild.send_signal(signal.SIGSTOP)
        checked = metanode("check", "--data-dir", str(data))
        second = metanode("rebuild-cache", "--data-dir", str(data))
        assert write_locked(data / "cache.db"), "the rebuild was held in its transaction"
    finally:
        rebuild.send_signal(signal.SIGCONT)
        out, err = rebuild.communicate(timeout=120)
    assert rebuild.returncode == 0, out + err
    holds = f"`metanode rebuild-cache` (pid {rebuild.pid}, since "
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert lines[-1] == "10000 claims verified; clean", checked.stdout
    assert lines[0].startswith(f"note: {holds}") and "is rebuilding cache.db" in lines[0]
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stderr.startswith(
        f"error: storage_locked: the data directory failed: {data / 'cache.db'}: {holds}"
    ), second.stderr
    assert " holds it: wait for it to end, or stop it" in second.stderr
    assert not (data / "cache.db-holder").exists()
    assert cli("check", "--data-dir", str(data)).stdout == "10000 claims verified; clean\n"


def test_restore_into_a_new_data_directory_replaces_nothing(tmp_path: Path) -> None:
    """A new machine: its data directory does not exist yet. The restore left an empty
    `replaced-<stamp>/` and said it held what it replaced."""
    old, new = tmp_path / "old", tmp_path / "new"
    cli("init", "--data-dir", str(old))
    cli("signers", "add", Signer().uid, "--name", "kept", "--data-dir", str(old))
    made = cli("backup", str(tmp_path / "bk"), "--data-dir", str(old)).stdout.strip()
    done = cli("restore", made, "--data-dir", str(new))
    assert done.stdout.splitlines()[-1] == "what it replaced: nothing (a new data directory)"
    assert not list(new.glob("replaced-*"))
    listed = cli("signers", "list", "--data-dir", str(new)).stdout
    assert listed == cli("signers", "list", "--data-dir", str(old)).stdout


def test_restore_refuses_what_it_cannot_put_back_and_changes_nothing(tmp_path: Path) -> None:
    """Garbage, an empty file (a backup killed as it began), another store's database, keys
    that cannot be copied: refused, and the data directory as it was (a failed copy of the
    keys had replaced truth.db already). The backup is only read: no `-shm` beside it."""
    data = tmp_path / "data"
    cli("init", "--data-dir", str(data))
    made = Path(cli("backup", str(tmp_path / "bk"), "--data-dir", str(data)).stdout.strip())
    (tmp_path / "garbage.db").write_bytes(os.urandom(8192))
    (tmp_path / "empty.db").write_bytes(b"")
    shutil.copytree(made.parent / made.name.replace("truth-", "keys-").removesuffix(".db"),
                    tmp_path / "broken-keys")  # fmt: skip
    (tmp_path / "broken-keys" / "dangling.key").symlink_to(tmp_path / "nowhere")
    before = sorted(p.name for p in data.iterdir() if p.name != "lock")  # restore's lock
    for args, said in (
        ((str(tmp_path / "garbage.db"),), "invalid_request: "),  # not "holds no owner.key"
        ((str(made), "--keep-keys", "--keys", str(tmp_path)), "invalid_request: "),
        ((str(data / "truth.db"), "--keep-keys"), "invalid_request: "),
        ((str(tmp_path / "empty.db"), "--keep-keys"), "invalid_request: "),
        ((str(data / "cache.db"), "--keep-keys"), "invalid_request: "),
        ((str(tmp_path / "missing.db"),), "file_failed: "),
        ((str(made), "--keys", str(tmp_path)), "file_failed: "),
        ((str(made), "--keys", str(tmp_path / "broken-keys")), "file_failed: "),
    ):
        refused = subprocess.run(
            [sys.executable, "-m", "metanode", "restore", *args, "--data-dir", str(data)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and refused.stderr.startswith(f"error: {said}"), refused
        assert sorted(p.name for p in data.iterdir() if p.name != "lock") == before
    typo = tmp_path / "dta"  # a mistyped --data-dir: refused, and not left made
    refused = subprocess.run(
        [sys.executable, "-m", "metanode", "restore", str(tmp_path / "garbage.db"),
         "--data-dir", str(typo)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and not typo.exists(), refused
    cli("restore", str(made), "--data-dir", str(data))
    assert sorted(p.name for p in made.parent.iterdir()) == [f"keys-{made.stem[6:]}", made.name]
    server = Server(data).start()
    try:
        locked = subprocess.run(
            [sys.executable, "-m", "metanode", "restore", str(made), "--data-dir", str(data)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert locked.stderr.startswith("error: data_dir_locked: ")
        renewing = subprocess.run(  # a live node's followers would all reconcile
            [sys.executable, "-m", "metanode", "init", "--new-log", "--data-dir", str(data)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert renewing.stderr.startswith("error: data_dir_locked: "), renewing.stderr
    finally:
        server.stop()


def test_a_damaged_truth_is_said_in_words_with_the_way_out(tmp_path: Path) -> None:
    """A review's truth.db, damaged (a stale WAL replayed onto a restored copy), made `export`
    and `check` print Python tracebacks: now `storage_corrupt`, exit 2, and what to do (`check`
    now reads both databases for damage first: tests/test_damage.py)."""
    data = tmp_path / "data"
    cli("init", "--data-dir", str(data))
    signer = Signer()
    lines = [
        json.dumps(signer.claim(cids.midhash_bytes(f"d{n}".encode()), "title", "v" * 200))
        for n in range(2000)
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    cli("import", str(tmp_path / "in.jsonl"), "--register-signers", "--data-dir", str(data))
    with open(data / "truth.db", "r+b") as damaged:
        damaged.seek(20 * 4096)
        damaged.write(b"\xff" * 5 * 4096)
    for command in (["export", "--out", str(tmp_path / "out.jsonl")],):
        done = subprocess.run(
            [sys.executable, "-m", "metanode", *command, "--data-dir", str(data)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: storage_corrupt: ") and "Traceback" not in done.stderr
        assert done.stderr.rstrip().endswith("(docs/operations.md, 'A damaged or lost file')")


def posted(server: Server, claim: dict[str, Any]) -> None:
    httpx.post(
        f"{server.url}/api/claims", json={"claims": [claim]}, headers=server.headers, timeout=30
    ).raise_for_status()


async def documents(node: Node) -> dict[str, dict[str, Any]]:
    """Every CID's document, keyed by CID."""
    every = [r[0] for r in node.cache.conn.execute("SELECT cid FROM cid_index")]
    return {c: node.meta(c) for c in every}


@pytest.mark.both_backends
async def test_export_then_import_gives_identical_documents(
    client: httpx.AsyncClient, node: Node, tmp_path: Path, storage: str, storages: Storages
) -> None:
    alice, bob = Signer(), Signer()
    await register(client, alice, may_link=True)
    await register(client, bob)
    a, b, c = (cids.midhash_bytes(x) for x in (b"e1", b"e2", b"e3"))
    await post(
        client,
        alice.claim(a, "title", "A", ts=NOW_MS),
        bob.claim(b, "title", "B"),
        alice.claim(a, f"cids/{b}", "true"),
        bob.claim(c, "genre", "g"),
        alice.claim(c, "title", "C", ts=NOW_MS - 5),
    )
    await post(client, alice.claim(c, "title", None, ts=NOW_MS))  # a tombstone travels too
    export = tmp_path / "claims.jsonl"
    data = str(node.settings.data_dir)
    cli("export", "--out", str(export), "--data-dir", data, storage=storage)
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert len(lines) == 5 and any(line["value"] is None for line in lines)
    second = tmp_path / "second"
    with storages() as there:
        args = ("import", str(export), "--data-dir", str(second))
        cli("init", "--data-dir", str(second), storage=there)
        done = cli(*args, "--register-signers", storage=there)
        assert "5 accepted" in done.stdout
        assert "5 duplicate" in cli(*args, storage=there).stdout
        other = Node(settings_for(second, storage=there))
        await compare_documents(node, other)


async def compare_documents(node: Node, other: Node) -> None:
    """The two nodes serve the same documents, under each box's own rids."""
    await other.start()
    try:
        await other.applier.wait_for(0, 10)
        theirs, ours = await documents(other), await documents(node)
        assert theirs == ours and len(ours) == 3
        rid_here = node.cache.conn.execute("SELECT rid FROM cid_index").fetchone()[0]
        rid_there = other.cache.conn.execute("SELECT rid FROM cid_index").fetchone()[0]
        assert rid_here != rid_there  # the same records under each box's own rids
    finally:
        await other.stop()


def test_import_refuses_a_tampered_file_and_writes_nothing(tmp_path: Path) -> None:
    signer = Signer()
    good = signer.claim(cids.midhash_bytes(b"t"), "title", "ok")
    bad = {**good, "value": "tampered"}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")

    def importing(*extra: str, into: Path = tmp_path / "d") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "metanode",
                "import",
                str(source),
                "--data-dir",
                str(into),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    typo = importing("--register-signers", into=tmp_path / "typo")  # it made a node there
    assert typo.returncode == 2 and typo.stderr.startswith("error: no_node: ")
    assert not (tmp_path / "typo").exists()
    cli("init", "--data-dir", str(tmp_path / "d"))
    done = importing("--register-signers")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: invalid_batch: 1 claim(s) rejected; nothing was written",
        "  claim 2: bad_signature: signature does not verify against uid",
    ]
    assert (
        cli("export", "--out", "-", "--data-dir", str(tmp_path / "d")).stderr
        == "exported 0 claims\n"
    )
    many = [signer.claim(cids.midhash_bytes(b"t"), f"k{n}", "v") for n in range(12)]
    source.write_text("".join(json.dumps(c) + "\n" for c in many))
    unknown = importing()  # one unknown signer was one line a claim, the error last, no way out
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.splitlines() == [
        "error: invalid_batch: 12 claim(s) rejected; nothing was written",
        f"  claims 1, 2, 3, 4, 5, 6, 7, 8, … (12): unknown_signer: signer {signer.uid} is not "
        "registered (POST /api/signers or `metanode signers add` registers it)",
        "  register each signer first (`metanode signers add UID --weight W`), or trust every "
        "signer of the file with --register-signers",
    ]
    cli("signers", "add", signer.uid, "--data-dir", str(tmp_path / "d"))  # known, may not link
    other = cids.midhash_bytes(b"the same film, cut")
    linking = signer.claim(cids.midhash_bytes(b"t"), f"cids/{other}", "true")
    source.write_text(json.dumps(linking) + "\n")
    refused = importing("--register-signers")  # which registers no known signer again
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1] == (
        "  a signer whose cids/ votes may link groups is given that first (`metanode signers "
        "add UID --may-link`)"
    )


# -- the outbox ------------------------------------------------------------------------------


def outbox(path: Path) -> tuple[int, int]:
    """(rows in truth.db's outbox, the newest seq ever written)."""
    conn = db.connect(path, readonly=True)
    try:
        return conn.execute("SELECT count(*) FROM changes").fetchone()[0], truth.max_seq(conn)
    finally:
        conn.close()


def copy_db(source: Path, target: Path) -> None:
    """A consistent copy of a live SQLite database (its WAL included)."""
    src, dst = sqlite3.connect(source), sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


async def started(data_dir: Path) -> Node:
    node = Node(settings_for(data_dir, feed_prune_s=0.05))
    await node.start()
    await node.applier.wait_for(0, 10)
    return node


async def wait_pruned(node: Node) -> None:
    for _ in range(200):
        if outbox(node.settings.truth_path)[0] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the outbox was not pruned: {outbox(node.settings.truth_path)}")


async def test_applied_outbox_rows_are_pruned_and_seqs_go_on(tmp_path: Path) -> None:
    """Retention drops the outbox rows the cache has applied; the seq counter survives it (and a
    restart), so new changes are applied after the old ones and nothing is rebuilt."""
    signer = Signer()
    titles = {cids.midhash_bytes(f"o{i}".encode()): f"t{i}" for i in range(20)}
    node = await started(tmp_path / "d")
    try:
        await node.add_signer(signer.uid, "s", 1, True)
        answer = await node.ingest(
            {"claims": [signer.claim(c, "title", t) for c, t in list(titles.items())[:10]]}
        )
        assert answer.status == 200
        await wait_pruned(node)
        assert outbox(node.settings.truth_path) == (0, 10 + 10)  # a group and a claim each
        epoch = node.applier.state.epoch
    finally:
        await node.stop()
    node = await started(tmp_path / "d")
    try:
        assert node.applier.state.epoch == epoch, "a pruned outbox made the node rebuild"
        answer = await node.ingest(
            {"claims": [signer.claim(c, "title", t) for c, t in list(titles.items())[10:]]}
        )
        assert answer.status == 200 and node.applier.applied_seq == 40
        assert {c: node.meta(c)["metadata"]["title"] for c in titles} == titles
        await wait_pruned(node)
    finally:
        await node.stop()
    assert "clean" in metanode_check(tmp_path / "d")


async def test_a_cache_older_than_the_pruned_outbox_is_rebuilt(tmp_path: Path) -> None:
    """An old copy of cache.db put back after the outbox it needs was pruned: the node cannot
    catch it up change by change, so it rebuilds it (a new epoch) rather than skip changes."""
    signer = Signer()
    cid_a, cid_b = cids.midhash_bytes(b"old cache a"), cids.midhash_bytes(b"old cache b")
    node = await started(tmp_path / "d")
    try:
        await node.add_signer(signer.uid, "s", 1, True)
        assert (await node.ingest({"claims": [signer.claim(cid_a, "title", "a")]})).status == 200
        old_epoch = node.applier.state.epoch
        copy_db(node.settings.cache_path, tmp_path / "old-cache.db")
        assert (await node.ingest({"claims": [signer.claim(cid_b, "title", "b")]})).status == 200
        await wait_pruned(node)
    finally:
        await node.stop()
    copy_db(tmp_path / "old-cache.db", tmp_path / "d" / "cache.db")
    node = await started(tmp_path / "d")
    try:
        assert node.applier.state.epoch > old_epoch
        assert node.meta(cid_a)["metadata"]["title"] == "a"
        assert node.meta(cid_b)["metadata"]["title"] == "b"
    finally:
        await node.stop()
    assert "clean" in metanode_check(tmp_path / "d")
