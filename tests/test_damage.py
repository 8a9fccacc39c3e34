"""A data directory damaged on disk (a failing SD card, a pulled plug, a careless `rm`): each
damage found by `check`, refused by `serve` in words naming the file and the way out, and the
way out that the words and docs/operations.md ("A damaged or lost file") name working."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from metanode import cid as cids
from tests.helpers.claims import Signer
from tests.helpers.server import Server, free_port, serve_refused

CLAIMS = 400
PAGE = 4096


def metanode(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`metanode ARGS` (under the command `prefix`), run to its end whatever it answers."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "metanode", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("METANODE_")},
    )


def ok(*args: str) -> str:
    """`metanode ARGS`, which must succeed: its standard output."""
    done = metanode(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def refused(done: subprocess.CompletedProcess[str], slug: str) -> str:
    """The one-line error of a command that must have refused with `slug`, exit 2, no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.rstrip().splitlines()[-1]  # after any warning logged on the way
    assert last.startswith(f"error: {slug}: "), done.stderr
    assert "Traceback" not in done.stderr
    return last


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A node made by `init`, holding CLAIMS imported claims and its built cache."""
    data = tmp_path / "data"
    ok("init", "--data-dir", str(data))
    signer = Signer()
    lines = (
        json.dumps(signer.claim(cids.midhash_bytes(f"d{n}".encode()), "title", f"t{n}" * 40))
        for n in range(CLAIMS)
    )
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    ok("import", str(tmp_path / "in.jsonl"), "--register-signers", "--data-dir", str(data))
    return data


def scramble(path: Path, pages: int = 4) -> None:
    """Random bytes over `pages` pages in use (table and index pages: SQLite's `dbstat`, not
    the free pages the truth keeps in reserve, whose damage harms nothing) from the middle of
    `path` on: a failing card's damage."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        used = [row[0] for row in conn.execute("SELECT pageno FROM dbstat ORDER BY pageno")]
    hit = used[len(used) // 2 :: 2][:pages]
    with path.open("r+b") as damaged:
        for number in hit:
            damaged.seek((number - 1) * PAGE)
            damaged.write(os.urandom(PAGE))


@pytest.mark.parametrize("how", ["scrambled", "truncated", "no database"])
def test_a_damaged_cache_is_rebuilt_by_the_command_its_error_names(data: Path, how: str) -> None:
    """A damaged cache.db made `rebuild-cache`, the way out every storage_corrupt error names,
    fail with that same error: it opened the damaged file to rebuild it. Now it is moved into
    replaced-<stamp>/ and built anew from the truth, nothing of the truth lost."""
    cache = data / "cache.db"
    if how == "scrambled":
        scramble(cache)
    elif how == "truncated":
        os.truncate(cache, cache.stat().st_size // 3)
    else:
        with cache.open("r+b") as damaged:
            damaged.write(os.urandom(100))
    said = ok("rebuild-cache", "--data-dir", str(data))
    assert said.startswith("cache.db was damaged ("), said
    (aside,) = data.glob("replaced-*")
    assert f"moved into {aside}" in said
    assert (aside / "cache.db").is_file() and cache.is_file()
    assert ok("check", "--data-dir", str(data)).endswith(f"{CLAIMS} claims verified; clean\n")


def test_a_sound_cache_is_rebuilt_in_place(data: Path) -> None:
    """A sound cache.db is rebuilt where it is, nothing moved aside."""
    said = ok("rebuild-cache", "--data-dir", str(data))
    assert said.startswith("rebuilt: epoch ") and not list(data.glob("replaced-*"))


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_a_lost_truth_is_refused_and_put_back_from_the_backup(
    data: Path, tmp_path: Path, how: str
) -> None:
    """truth.db deleted (a careless `rm`) or emptied to 0 bytes (a card that lost it): `serve`
    made an empty truth in its place, served no claims and rebuilt the cache from none, and
    `check` said `0 claims verified; clean`. Now both refuse, naming the file and the way
    out; `restore` of the backup brings every claim back, and `init` starts over on purpose."""
    ok("backup", str(tmp_path / "backups"), "--data-dir", str(data))
    truth = data / "truth.db"
    if how == "deleted":
        for name in ("truth.db", "truth.db-wal", "truth.db-shm"):
            (data / name).unlink(missing_ok=True)
    else:
        truth.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    started = serve_refused(tmp_path, env, "--data-dir", str(data), "--port", str(free_port()))
    said = refused(started, "truth_missing")
    assert f"{truth} is {'missing' if how == 'deleted' else 'empty (0 bytes)'}" in said
    assert "`metanode restore <folder>/truth-<stamp>.db`" in said
    assert (truth.stat().st_size == 0) if how == "emptied" else not truth.exists()  # none made
    for command in ("check", "export", "scan"):
        extra = [str(tmp_path)] if command == "scan" else []
        refused(metanode(command, *extra, "--data-dir", str(data)), "truth_missing")
    (backup,) = (tmp_path / "backups").glob("truth-*.db")
    ok("restore", str(backup), "--data-dir", str(data))
    assert ok("check", "--data-dir", str(data)).endswith(f"{CLAIMS} claims verified; clean\n")


def test_init_starts_a_box_over_after_its_truth_was_lost(data: Path) -> None:
    """With no backup, `init` is the way to start over, said on purpose: then a start works."""
    (data / "truth.db").unlink()
    ok("init", "--data-dir", str(data))
    assert ok("check", "--data-dir", str(data)).endswith("0 claims verified; clean\n")


@pytest.mark.parametrize(
    ("name", "content"),
    [("api-token", b""), ("api-token", b"\x89\xfe\x00garbage"), ("session-secret", b"\xff\x00")],
)
def test_a_damaged_token_file_is_refused_and_made_anew_once_removed(
    data: Path, tmp_path: Path, name: str, content: bytes
) -> None:
    """An empty api-token started a node that refused every token (no request can send an
    empty one); a damaged one stopped the start with a UnicodeDecodeError traceback. Now the
    start is refused naming the file; removed, the next start makes a new one."""
    (data / name).write_bytes(content)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    started = serve_refused(tmp_path, env, "--data-dir", str(data), "--port", str(free_port()))
    said = refused(started, "file_failed")
    assert said.startswith(f"error: file_failed: {data / name} is ") and "remove it" in said
    (data / name).unlink()
    server = Server(data).start()
    try:
        assert (data / name).read_text().strip() and server.meta(cids.midhash_bytes(b"d1"))
    finally:
        server.stop()


@pytest.mark.parametrize("name", ["owner", "fileinfo"])
def test_a_damaged_key_file_is_found_and_refused_with_the_way_back(
    data: Path, tmp_path: Path, name: str
) -> None:
    """A damaged plugin key let `serve` start and its owner worker die at every restart with a
    traceback, and `check` said clean; a damaged owner key was refused without a word of what
    to do. Now `check` lists it (exit 1), `serve` refuses naming it and the way back, and the
    key copied back from the backup serves again."""
    server = Server(data, env={"METANODE_PLUGINS_ENABLED": "true"}).start()  # the plugins' keys
    server.stop()
    ok("backup", str(tmp_path / "backups"), "--data-dir", str(data))
    key = data / "keys" / f"{name}.key"
    key.write_bytes(os.urandom(120))
    checked = metanode("check", "--data-dir", str(data))
    damaged = f"{key}: not a key file, or one cut short (not JSON)"
    assert checked.returncode == 1 and damaged in checked.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    started = serve_refused(tmp_path, env, "--data-dir", str(data), "--port", str(free_port()))
    said = refused(started, "invalid_key_file")
    assert said.startswith(f"error: invalid_key_file: {damaged}: put it back from the backup")
    assert "`<backup folder>/keys-<stamp>/`" in said
    (kept,) = (tmp_path / "backups").glob(f"keys-*/{name}.key")
    shutil.copy(kept, key)
    assert ok("check", "--data-dir", str(data)).endswith("clean\n")


@pytest.mark.parametrize("name", ["truth.db", "cache.db"])
def test_check_reads_both_databases_for_damage_and_names_the_way_out(data: Path, name: str) -> None:
    """`check` met damage only on the pages its comparison read, then stopped with an error
    that did not always name the file (a damaged cache.db: `the data directory failed:
    database disk image is malformed`). Now it reads each database whole first, names the
    damaged one and its way out, exit 1."""
    scramble(data / name)
    checked = metanode("check", "--data-dir", str(data))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    first, verdict = checked.stdout.splitlines()
    assert first.startswith(f"{data / name} is damaged (") and verdict.startswith("DAMAGED")
    way_out = "`metanode rebuild-cache`" if name == "cache.db" else "`metanode restore "
    assert way_out in first


# root may read anything; without these capabilities it meets the modes, as any user does
NO_OVERRIDE = ("setpriv", "--bounding-set=-dac_override,-fowner,-dac_read_search", "--")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("name", ["truth.db", "cache.db", "api-token", "keys/owner.key"])
def test_a_file_it_may_not_read_is_said_to_be_a_permission(data: Path, name: str) -> None:
    """A `chmod 000` (or a copy made by root) was `Permission denied` and no more, a read-only
    disk's slug beside it; an owner key it may not read was `cannot read key file`, which the
    way out of a damaged key followed. Now each says whose it must be and how."""
    (data / name).chmod(0)
    started = metanode(
        "serve", "--data-dir", str(data), "--port", str(free_port()), prefix=NO_OVERRIDE
    )
    said = refused(started, "storage_read_only")
    assert f"{data / name}: Permission denied; the data directory and every file" in said
    assert "`chown -R` them to it" in said
    if name == "keys/owner.key":  # `check` reads no key: it lists one it cannot read
        checked = metanode("check", "--data-dir", str(data), prefix=NO_OVERRIDE)
        assert checked.returncode == 1 and "Permission denied; the data" in checked.stdout


def accepted(server: Server, signer: Signer, tag: str, count: int) -> httpx.Response:
    """POST `count` new claims of `signer` in one batch."""
    batch = [
        signer.claim(cids.midhash_bytes(f"{tag}{n}".encode()), "title", tag) for n in range(count)
    ]
    return httpx.post(
        f"{server.url}/api/claims", json={"claims": batch}, headers=server.headers, timeout=60
    )


@pytest.mark.parametrize("name", ["truth.db-wal", "truth.db-shm"])
def test_a_log_removed_under_a_running_node_loses_no_acknowledged_claim(
    data: Path, name: str
) -> None:
    """`rm truth.db-wal` under a running node: it went on committing into the unlinked log,
    answered 200, and a SIGKILL then lost every claim since the last checkpoint (1,000 of
    1,000 acknowledged, tried). Now the first commit after the removal checkpoints the log
    into truth.db, later writes are 503 `storage_io_error` naming the file, /health says so,
    and every acknowledged claim survives the kill; the next start serves again."""
    server = Server(data).start()
    signer = Signer()
    server.register(signer.uid, "w")
    try:
        assert accepted(server, signer, "before", 200).status_code == 200
        (data / name).unlink()
        assert accepted(server, signer, "after", 200).status_code == 200  # saved by the watch
        refused = accepted(server, signer, "refused", 200)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "storage_io_error"
        assert f"{data / name} was removed" in refused.json()["message"]
        (problem,) = httpx.get(f"{server.url}/health", timeout=10).json()["problems"]
        assert problem.startswith("writes to truth.db are failing (storage_io_error")
    finally:
        server.stop(signal.SIGKILL)
    exported = ok("export", "--data-dir", str(data)).splitlines()
    assert len(exported) == CLAIMS + 400  # every acknowledged claim, none refused
    server.start()
    try:
        assert accepted(server, signer, "again", 10).status_code == 200
    finally:
        server.stop()


def salvage_steps() -> str:
    """The shell steps of docs/operations.md that save a damaged truth's claims: the test runs
    them as written, so the page cannot drift from what works."""
    page = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    start = page.index("```sh\n  # 1. what the damaged truth still holds")
    block = page[start : page.index("```\n", start + 6)]
    return "\n".join(line.removeprefix("  ") for line in block.splitlines()[1:])


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="needs the sqlite3 command")
def test_a_damaged_truth_keeps_every_claim_through_the_documented_salvage(
    data: Path, tmp_path: Path
) -> None:
    """A damaged truth.db with a backup older than its last claims: the backup alone lost
    them, and `export` of the damaged file stops at the damage. The steps the page gives
    (salvage what SQLite still reads, restore the backup, import the salvage) keep every
    claim not on a damaged page, and `check` is clean."""
    ok("backup", str(tmp_path / "backups"), "--data-dir", str(data))
    newer = Signer()
    lines = (
        json.dumps(newer.claim(cids.midhash_bytes(f"n{n}".encode()), "title", "after"))
        for n in range(300)
    )
    (tmp_path / "newer.jsonl").write_text("\n".join(lines) + "\n")
    ok("import", str(tmp_path / "newer.jsonl"), "--register-signers", "--data-dir", str(data))
    scramble(data / "truth.db")
    (backup,) = (tmp_path / "backups").glob("truth-*.db")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "metanode").write_text(f'#!/bin/sh\nexec {sys.executable} -m metanode "$@"\n')
    (bin_dir / "metanode").chmod(0o755)
    steps = salvage_steps().replace("backups/truth-<stamp>.db", str(backup))
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    done = subprocess.run(
        ["sh", "-ec", steps], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("claims verified; clean")
    kept = int(done.stdout.rstrip().splitlines()[-1].split()[0])
    assert CLAIMS + 300 - 60 <= kept <= CLAIMS + 300  # at most the few on 4 damaged pages


@pytest.mark.parametrize("name", ["cache.db", "truth.db"])
def test_a_start_after_a_kill_reads_both_databases_for_damage(
    data: Path, tmp_path: Path, name: str
) -> None:
    """Damage after an unclean stop (a pulled plug on a card that lies about its flushes)
    started a node that answered from a damaged cache, or wrote to a damaged truth, `/health`
    degraded. Now such a start reads both: a damaged cache.db is moved aside and built anew
    (every claim kept), a damaged truth.db refuses the start with its way out."""
    server = Server(data).start()
    server.stop(signal.SIGKILL)
    with contextlib.closing(sqlite3.connect(data / name)) as conn:  # as its checkpoints do
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # (a page the WAL holds hides damage)
    scramble(data / name)
    if name == "truth.db":
        env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
        started = serve_refused(tmp_path, env, "--data-dir", str(data), "--port", str(free_port()))
        said = refused(started, "storage_corrupt")
        assert said.startswith(f"error: storage_corrupt: {data / name} is damaged (")
        assert "`metanode restore <folder>/truth-<stamp>.db`" in said
        return
    server.start()
    try:
        assert any(m.startswith("cache.db was damaged: moved into") for m in server.log_messages())
        assert server.meta(cids.midhash_bytes(b"d7"))
    finally:
        server.stop()
    (aside,) = data.glob("replaced-*")
    assert (aside / "cache.db").is_file()
    assert ok("check", "--data-dir", str(data)).endswith(f"{CLAIMS} claims verified; clean\n")


def test_a_damaged_cache_is_not_moved_from_under_a_running_node(data: Path) -> None:
    """Damage that came while the node was stopped starts it degraded (a clean stop's start
    reads no page it does not need); `rebuild-cache` then refuses to move the damaged file
    from under it, which would go on writing the file moved away: stop it first."""
    scramble(data / "cache.db")
    server = Server(data).start()
    try:
        moved = metanode("rebuild-cache", "--data-dir", str(data))
        refused(moved, "data_dir_locked")
        assert not list(data.glob("replaced-*"))
    finally:
        server.stop()
    assert ok("rebuild-cache", "--data-dir", str(data)).startswith("cache.db was damaged (")


def test_a_backup_of_a_damaged_truth_names_the_truth(data: Path, tmp_path: Path) -> None:
    """`backup` of a damaged truth.db said the copy it was making was damaged, and how to
    rebuild a cache; now it names truth.db and the way to save its claims, and leaves nothing."""
    scramble(data / "truth.db")
    said = refused(
        metanode("backup", str(tmp_path / "b"), "--data-dir", str(data)), "storage_corrupt"
    )
    assert said.startswith(f"error: storage_corrupt: {data / 'truth.db'} is damaged (")
    assert "save the claims it still holds" in said and not list((tmp_path / "b").iterdir())
