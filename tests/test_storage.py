"""Storage failures and the data directory: a full disk is a typed retryable 503 (never a 500,
never a reset connection), `/health` degrades and recovers by itself with nothing lost; a node
will not start on a full, read-only or unwritable data directory, nor beside another node;
everything in the data directory (and in a backup) is private.

The full disk is real: a small tmpfs mounted by the fixture (we run as root) and filled up.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import re
import resource
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from metanode import db, errors, jsonl, truth
from metanode.node import Node
from tests.helpers.claims import Signer
from tests.helpers.server import Server, free_port, metanode_check, role_pids
from tests.helpers.settings import settings_for
from tests.helpers.wait import poll
from tools.bench import truth_v4

TMPFS_BYTES = 8 << 20
DEADLINE_S = 60.0


def _mount(point: Path, *options: str) -> None:
    point.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join((f"size={TMPFS_BYTES}", *options)), "tmpfs", point],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {done.stderr}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 8 MiB tmpfs, unmounted afterwards: a disk that can really fill up."""
    point = tmp_path / "mnt"
    _mount(point)
    yield point
    if subprocess.run(["umount", point]).returncode != 0:
        subprocess.run(["umount", "-l", point], check=True)  # a straggling process holds it


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Path]:
    """A fresh 32 MiB ext4 file system on a loop device, mounted `errors=remount-ro` (as a
    root file system is): a disk the kernel can turn read-only under the node's open files
    (`kernel_error`). Unmounted afterwards."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 (e2fsprogs)")
    image, point = tmp_path / "ext4.img", tmp_path / "ext4"
    with image.open("wb") as out:
        out.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True)
    point.mkdir()
    done = subprocess.run(
        ["mount", "-o", "loop,errors=remount-ro", image, point], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a loop device here (needs root and /dev/loop*): {done.stderr}")
    yield point
    if subprocess.run(["umount", point]).returncode != 0:
        subprocess.run(["umount", "-l", point], check=True)


def kernel_error(point: Path) -> None:
    """Have ext4 meet an error on the file system mounted at `point`, as a failing disk would:
    with `errors=remount-ro` the kernel makes it read-only at once, files open or not."""
    device = Path(os.path.realpath(mount_source(point))).name
    trigger = Path(f"/sys/fs/ext4/{device}/trigger_fs_error")
    if not trigger.exists():
        pytest.skip(f"this kernel has no {trigger}")
    trigger.write_text("1")
    with pytest.raises(OSError) as refused:  # `statvfs` does not say so: the mount is `rw`
        (point / "probe").mkdir()
    assert refused.value.errno == errno.EROFS


def mount_source(point: Path) -> str:
    done = subprocess.run(["findmnt", "-no", "SOURCE", point], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def fill(directory: Path) -> Path:
    """A filler file taking every free byte of `directory`'s file system (to ENOSPC)."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as out:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    out.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler


def cli(*args: str, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """A `metanode` command in a clean environment (plugins off); `prefix` runs it under a
    wrapper. A server expected to refuse to start times out if it started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    env["METANODE_PLUGINS_ENABLED"] = "false"
    return subprocess.run(
        [*prefix, sys.executable, "-m", "metanode", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def serve_once(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """`metanode serve` expected to refuse to start."""
    return cli("serve", "--data-dir", str(data_dir), "--port", str(free_port()))


def assert_refused(done: subprocess.CompletedProcess[str], slug: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"error: {slug}: "), done.stderr
    assert "Traceback" not in done.stderr


# -- over HTTP, one keep-alive connection -------------------------------------------------------


class Connection:
    """One HTTP/1.1 connection, kept alive: every request must go over the same TCP socket
    (http.client would reconnect silently after a `Connection: close`, so the local port is
    checked on every answer)."""

    def __init__(self, srv: Server) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        self.headers = {**srv.headers, "Content-Type": "application/json"}
        self.http.connect()
        assert self.http.sock is not None
        self.local = self.http.sock.getsockname()

    def request(
        self, method: str, path: str, body: Any = None
    ) -> tuple[int, http.client.HTTPResponse, Any]:
        payload = None if body is None else json.dumps(body)
        self.http.request(method, path, body=payload, headers=self.headers)
        response = self.http.getresponse()
        data = json.loads(response.read())
        assert self.http.sock is not None, "the server closed the connection"
        assert self.http.sock.getsockname() == self.local, "the connection was not kept"
        return response.status, response, data

    def health(self) -> dict[str, Any]:
        status, _, body = self.request("GET", "/health")
        assert status == 200, body
        result: dict[str, Any] = body
        return result

    def close(self) -> None:
        self.http.close()


def wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def batch(signer: Signer, tag: str, n: int) -> list[dict[str, Any]]:
    """n claims, each about its own CID, with 2 KB values: a batch that needs disk space."""
    return [
        signer.claim(cids.midhash_bytes(f"{tag}-{i}".encode()), "title", f"{tag}-{i}-" + "v" * 2000)
        for i in range(n)
    ]


# Requests of routes, methods and answers not seen before: each a series of
# `metanode_request_seconds`, a few kilobytes more of the workers' metric files.
UNKNOWN = cids.midhash_bytes(b"no record holds it")
NEW_SERIES = [
    ("GET", f"/api/meta/{UNKNOWN}"),
    ("GET", f"/api/meta/{UNKNOWN}/claims"),
    ("GET", "/api/meta/not-a-cid"),
    ("GET", "/api/signers"),
    ("GET", "/api/peers"),
    ("GET", "/api/plugins"),
    ("DELETE", "/api/peers/nobody"),
    ("POST", "/api/plugins/nothing/retry"),
    ("POST", "/api/signers/z6Mknobody/block"),
]


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_a_full_disk_is_a_retryable_503_then_health_recovers_and_nothing_is_lost(
    tmpfs: Path, tmp_path: Path, workers: int
) -> None:
    """With two workers as with one: their metric files (memory-mapped, in the data directory)
    and the supervisor's restart counts are on the full disk too. A store through the map
    into a hole the disk had no block for killed a worker (SIGBUS), and the supervisor
    ended on its `workers.json`, every worker with it."""
    srv = Server(
        tmpfs,
        log=tmp_path / "serve.log",  # the log must not need the full disk
        env={
            "METANODE_ACCEPT_UNKNOWN_SIGNERS": "true",
            "METANODE_APPLY_WAIT_S": "0.5",
            "METANODE_APPLY_POLL_S": "0.2",
            "METANODE_FEED_PRUNE_S": "0.2",  # retention too meets the full disk
        },
        workers=workers,
    ).start()
    try:
        # every worker up before the disk fills: /health was answered by the owner while the
        # reader still started, which then could not make its metric file (refused, by design,
        # while the disk is full) and exited until there was room again
        poll(
            lambda: srv.log_text().count("Application startup complete.") >= workers or None,
            "every worker started",
        )
        acknowledged = fill_refuse_recover(srv, tmpfs)
        for claim in acknowledged:  # every acknowledged claim is there, cache and truth
            document = srv.meta(claim["cid"])
            assert document is not None and document["metadata"]["title"] == claim["value"]
    finally:
        stopped = srv.stop()  # also when it failed: the tmpfs is unmounted next
    assert stopped == 0
    assert " exited (" not in srv.log_text()  # no worker died on the way
    assert "Traceback" not in srv.log_text()  # expected: said in lines, not as a crash
    metanode_check(tmpfs)


def fill_refuse_recover(srv: Server, tmpfs: Path) -> list[dict[str, Any]]:
    """Over one kept-alive connection: claims until the filled disk refuses them, the typed
    503, new metric series, `/health` degraded while full and ok by itself once there is room,
    claims taken again. The claims acknowledged on the way."""
    signer = Signer()
    conn = Connection(srv)
    acknowledged: list[dict[str, Any]] = []
    try:
        first = batch(signer, "before", 5)
        # 202 on a busy machine: stored, its apply not done within the 0.5 s waited
        assert conn.request("POST", "/api/claims", {"claims": first})[0] in (200, 202)
        acknowledged += first

        filler = fill(tmpfs)
        refusal: tuple[http.client.HTTPResponse, dict[str, Any]] | None = None
        for n in range(200):  # where the disk runs out depends on the WAL: until it does
            claims = batch(signer, f"full-{n}", 20)
            status, response, body = conn.request("POST", "/api/claims", {"claims": claims})
            assert status in (200, 202, 503), (status, body)  # never a 500
            if status == 503:
                refusal = response, body
                break
            acknowledged += claims  # 202: stored in the truth, the cache apply failed
        assert refusal is not None, "the filled disk never refused a write"
        response, body = refusal
        assert body["error"] in ("storage_full", "storage_io_error"), body
        assert body["retryable"] is True and set(body) == {"error", "message", "retryable"}
        assert int(response.headers["Retry-After"]) >= 1

        for method, path in NEW_SERIES:  # new metric series on the full disk: no worker dies
            answered, _, envelope = conn.request(method, path)
            assert answered < 500 or envelope["retryable"], (method, path, answered, envelope)
        health = conn.health()  # the same connection still answers
        assert health["status"] == "degraded", health
        assert any(body["error"] in problem for problem in health["problems"]), health
        settle = time.monotonic() + 3  # the probe must not call a full disk healthy
        while time.monotonic() < settle:
            assert conn.health()["status"] == "degraded"
            time.sleep(0.2)

        filler.unlink()
        wait_for(
            "/health recovers by itself",
            lambda: (h := conn.health())["status"] == "ok" and h["apply_lag"] == 0,
        )

        after = batch(signer, "after", 20)
        status, _, body = conn.request("POST", "/api/claims", {"claims": after})
        assert status == 200 and body["accepted"] == 20, body
        acknowledged += after
    finally:
        conn.close()
    return acknowledged


def test_a_worker_that_dies_on_a_full_disk_is_restarted_once_there_is_room(
    tmpfs: Path, tmp_path: Path
) -> None:
    """The supervisor writes each restart's count into the data directory (`workers.json`,
    for /metrics): on a full disk that write failed and ended the supervisor, every worker
    with it, so one worker's death took the whole node down for good."""
    srv = Server(tmpfs, log=tmp_path / "serve.log", workers=2).start()
    try:
        filler = fill(tmpfs)
        killed = role_pids(srv)["reader"]
        os.kill(killed, signal.SIGKILL)
        wait_for("the unwritten count is said", lambda: "cannot write" in srv.log_text())
        filler.unlink()
        wait_for("a new reader", lambda: role_pids(srv).get("reader") not in (None, killed))
        assert srv.proc is not None and srv.proc.poll() is None  # the supervisor served on
        assert health(srv)["status"] == "ok"
    finally:
        stopped = srv.stop()
    assert stopped == 0


def test_claims_stored_while_the_cache_cannot_apply_them_are_applied_once_it_can(
    tmpfs: Path, tmp_path: Path
) -> None:
    """truth.db has room, cache.db (a link onto the small tmpfs) has none: the claims are stored
    and acknowledged (202), and applied by the applier's retry once the cache has space."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "cache.db").symlink_to(tmpfs / "cache.db")  # SQLite keeps its -wal beside the target
    srv = Server(
        data, env={"METANODE_ACCEPT_UNKNOWN_SIGNERS": "true", "METANODE_APPLY_WAIT_S": "0.5"}
    ).start()
    signer = Signer()
    conn = Connection(srv)
    acknowledged: list[dict[str, Any]] = []
    try:
        filler = fill(tmpfs)
        for n in range(200):
            claims = batch(signer, f"pending-{n}", 20)
            status, _, body = conn.request("POST", "/api/claims", {"claims": claims})
            assert status in (200, 202), (status, body)  # the truth has room: always stored
            acknowledged += claims
            if status == 202:
                break
        assert status == 202, "the full cache never held an apply back"
        wait_for(
            "/health names the failing cache",
            lambda: any("cache.db" in problem for problem in conn.health()["problems"]),
        )
        filler.unlink()
        wait_for(
            "the cache catches up by itself",
            lambda: (h := conn.health())["status"] == "ok" and h["apply_lag"] == 0,
        )
    finally:
        conn.close()
    for claim in acknowledged:
        document = srv.meta(claim["cid"])
        assert document is not None and document["metadata"]["title"] == claim["value"]
    assert srv.stop() == 0
    metanode_check(data)


def health(srv: Server) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{srv.url}/health", timeout=10).json()
    return body


def test_a_cache_build_that_runs_out_of_space_is_retried_until_it_fits(
    tmpfs: Path, tmp_path: Path
) -> None:
    """A node that must build its cache (here: cache.db lost) on a disk that passes the start-up
    check but cannot hold the whole cache keeps retrying the build, degraded, and finishes it
    by itself once the disk is larger: nothing lost, `check` clean."""
    data = tmp_path / "data"
    signer = Signer()
    lines = tmp_path / "claims.jsonl"
    with lines.open("wb") as out:
        for claim in batch(signer, "big", 5_000):  # ≈ 10 MB of values: more than the tmpfs
            out.write(jsonl.encode(claim))
    cli("init", "--data-dir", str(data))
    imported = cli("import", str(lines), "--register-signers", "--data-dir", str(data))
    assert imported.returncode == 0, imported.stderr
    for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
        (data / name).unlink(missing_ok=True)
    (data / "cache.db").symlink_to(tmpfs / "cache.db")
    srv = Server(data).start()  # /health and /api/signers answer while the cache is built
    try:
        wait_for(
            "/health says the build is failing",
            lambda: "applying truth changes to the cache is failing" in health(srv)["problems"],
        )
        problems = health(srv)["problems"]
        assert health(srv)["cache_ready"] is False
        assert any("cache.db" in p for p in problems) and not any("truth.db" in p for p in problems)
        subprocess.run(["mount", "-o", "remount,size=256m", tmpfs], check=True)
        wait_for("the build finishes by itself", lambda: health(srv)["status"] == "ok")
        for claim in batch(signer, "big", 5_000)[::500]:
            document = srv.meta(claim["cid"])
            assert document is not None and document["metadata"]["title"] == claim["value"]
    finally:
        assert srv.stop() == 0
        srv.print_log()
    metanode_check(data)


def test_a_migration_that_runs_out_of_space_says_so_and_changes_nothing(
    tmpfs: Path, tmp_path: Path
) -> None:
    """An upgrade across several schemas rewrites the claims in one transaction (300,000
    claims from truth schema 1 needed 325 to 385 MB free beside a 176 MB truth.db). Without
    that room the start said only `the data directory failed: database or disk is full
    (SQLITE_FULL)`: no file, no migration, no word that nothing had changed. Now it names the
    migration, says the database is as it was, its size and the room free; with room, the next
    try migrates it whole. A disk too full even for the WAL's index (`-shm`) was a
    `storage_io_error` (SQLITE_IOERR_SHMSIZE): it is `storage_full` too."""
    made = tmp_path / "truth.db"
    truth_v4.generate(made, records=3_000, keys=2, signers=2)  # schema 3, as an older node made
    path = tmpfs / "truth.db"
    shutil.copyfile(made, path)
    claims = sorted_claims(made)
    filler = fill(tmpfs)
    with pytest.raises(errors.StorageFull, match="SQLITE_IOERR_SHMSIZE"):
        truth.TruthStore(path).migrate()
    os.truncate(filler, filler.stat().st_size - (512 << 10))  # room to open, not to migrate
    with pytest.raises(errors.StorageFull) as refused:
        truth.TruthStore(path).migrate()
    newest = len(truth.MIGRATIONS)
    assert refused.value.message.startswith(
        f"migrating {path} from schema 3 to {newest} failed and changed nothing (it is still "
        "schema 3; the next start tries again): the data directory failed: "
    )
    assert re.search(r"the file is \d+ MB, \d+ MB are free \(docs/", refused.value.message)
    assert user_version(path) == 3 and sorted_claims(path) == claims
    filler.unlink()
    truth.TruthStore(path).migrate()
    assert user_version(path) == newest and sorted_claims(path) == claims


def test_a_full_disk_names_the_database_it_could_not_write(tmpfs: Path) -> None:
    """SQLite's "database or disk is full" names no file, and the writer's transactions passed
    none: a client and `/health` read `the data directory failed: database or disk is full
    (SQLITE_FULL)`, with truth.db and cache.db (and the temporary files) possibly on different
    disks. The refusal and the writer's failure (what `/health` shows) now name the database."""
    path = tmpfs / "x.db"
    db.migrate_file(path, [lambda conn: conn.execute("CREATE TABLE t (v BLOB)")])
    writer = db.Writer(path, "x")
    try:
        fill(tmpfs)
        with pytest.raises(errors.StorageError) as full:
            for _ in range(1_000):  # where the disk runs out depends on the WAL: until it does
                writer.run_sync(
                    lambda conn: conn.execute("INSERT INTO t VALUES (?)", (b"v" * 50_000,))
                )
        assert full.value.slug in ("storage_full", "storage_io_error"), full.value.message
        assert full.value.message.startswith(f"the data directory failed: {path}: ")
        assert writer.failure is not None and str(path) in writer.failure.message
    finally:
        writer.close()


def user_version(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


def sorted_claims(path: Path) -> list[tuple[Any, ...]]:
    """Every claim of the truth at `path`, whatever its schema (v4 on: the `claims` view)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return sorted(conn.execute("SELECT uid, cid, key, value, ts, sig, log_seq FROM claims"))


def test_a_disk_the_kernel_made_read_only_is_said_so_and_loses_nothing(
    ext4: Path, tmp_path: Path
) -> None:
    """ext4 remounts itself read-only after a disk error (`errors=remount-ro`), under the
    node's open files; no `remount,rw` undoes it. Writes then failed `storage_io_error: disk I/O
    error (SQLITE_IOERR_WRITE)`, which named neither the mount nor the way out: now they are
    `storage_read_only`, saying so and what to do, reads go on, and after the operator's
    fsck and a restart every acknowledged claim is there."""
    data = ext4 / "data"
    srv = Server(data, log=tmp_path / "serve.log", env={"METANODE_ACCEPT_UNKNOWN_SIGNERS": "true"})
    signer = Signer()
    acknowledged = batch(signer, "before", 5)
    srv.start()
    conn = Connection(srv)
    try:
        assert conn.request("POST", "/api/claims", {"claims": acknowledged})[0] == 200
        kernel_error(ext4)
        status, response, body = conn.request(
            "POST", "/api/claims", {"claims": batch(signer, "after", 5)}
        )
        assert status == 503 and body["error"] == "storage_read_only", body
        assert body["retryable"] is True and int(response.headers["Retry-After"]) >= 1
        assert "read-only now" in body["message"] and "fsck" in body["message"], body
        problems = conn.health()["problems"]
        assert any("storage_read_only" in problem for problem in problems), problems
        assert srv.meta(acknowledged[0]["cid"]) is not None  # reads go on
    finally:
        conn.close()
        assert srv.stop() == 0
    assert "Traceback" not in srv.log_text()
    subprocess.run(["umount", ext4], check=True)  # what the operator does: fsck, mount
    checked = subprocess.run(["e2fsck", "-fy", tmp_path / "ext4.img"], capture_output=True)
    assert checked.returncode in (0, 1), checked  # 1: errors found and mended
    subprocess.run(["mount", "-o", "loop", tmp_path / "ext4.img", ext4], check=True)
    srv = Server(data, log=tmp_path / "serve.log").start()
    try:
        for claim in acknowledged:
            document = srv.meta(claim["cid"])
            assert document is not None and document["metadata"]["title"] == claim["value"]
    finally:
        assert srv.stop() == 0
    metanode_check(data)


def test_a_data_directory_made_inaccessible_while_serving_answers_no_500_and_is_said(
    tmp_path: Path,
) -> None:
    """The data directory's mode or owner changed under a running node (a `chown -R root`, a
    `chmod 000`): after each commit the writer looks at the `-wal` and `-shm`, and that look
    raised `Permission denied`. The claims were stored, yet answered 500 `internal_error`, every
    write after too, with a traceback each. The files the node holds open still take writes:
    they are acknowledged, `/health` says what is wrong and that a restart would be refused,
    and once the mode is back it is ok by itself."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux): root's override of file modes must be dropped")
    data = tmp_path / "data"
    srv = Server(
        data,
        env={"METANODE_ACCEPT_UNKNOWN_SIGNERS": "true"},
        prefix=("setpriv", "--bounding-set=-dac_override,-fowner,-dac_read_search", "--"),
    ).start()
    signer = Signer()
    acknowledged = batch(signer, "before", 3)
    try:
        conn = Connection(srv)
        assert conn.request("POST", "/api/claims", {"claims": acknowledged})[0] == 200
        data.chmod(0)
        during = batch(signer, "during", 3)
        status, _, body = conn.request("POST", "/api/claims", {"claims": during})
        assert status == 200 and body["accepted"] == 3, body
        acknowledged += during
        problems = conn.health()["problems"]
        assert any("Permission denied" in p and "not start again" in p for p in problems), problems
        data.chmod(0o700)
        wait_for("/health ok by itself", lambda: conn.health()["status"] == "ok")
        conn.close()
        for claim in acknowledged:
            document = srv.meta(claim["cid"])
            assert document is not None and document["metadata"]["title"] == claim["value"]
    finally:
        data.chmod(0o700)
        assert srv.stop() == 0
    assert "Traceback" not in srv.log_text()
    metanode_check(data)


@pytest.mark.parametrize("initialised", [True, False], ids=["existing", "fresh"])
def test_serve_refuses_a_full_disk(tmpfs: Path, initialised: bool) -> None:
    if initialised:
        assert cli("init", "--data-dir", str(tmpfs)).returncode == 0
    fill(tmpfs)
    assert_refused(serve_once(tmpfs), "storage_full")


def test_serve_and_init_refuse_a_read_only_data_directory(tmpfs: Path) -> None:
    assert cli("init", "--data-dir", str(tmpfs)).returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", tmpfs], check=True)
    assert_refused(serve_once(tmpfs), "storage_read_only")
    assert_refused(cli("init", "--data-dir", str(tmpfs)), "storage_read_only")


def test_serve_refuses_a_data_directory_it_may_not_write(tmp_path: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop the capability to write anywhere")
    data = tmp_path / "data"
    data.mkdir(mode=0o500)
    # Root may write anywhere; without CAP_DAC_OVERRIDE/CAP_FOWNER it meets the modes, as any
    # user does.
    done = cli(
        "serve",
        "--data-dir",
        str(data),
        "--port",
        str(free_port()),
        prefix=["setpriv", "--bounding-set=-dac_override,-fowner,-dac_read_search", "--"],
    )
    assert_refused(done, "storage_read_only")
    assert "Permission denied" in done.stderr


def test_scan_out_of_file_descriptors_says_so_and_the_way_out(tmp_path: Path) -> None:
    """`scan` under open-file limits from 8 up to one it works with: each runs out at another
    file (truth.db, cache.db, the owner's key; measured). SQLite says only "unable to open
    database file" (SQLITE_CANTOPEN), which was `storage_read_only`, and the key
    `invalid_key_file`: both sent the operator to files that were fine. Every refusal is now the
    one slug, with the limit and how to raise it, exit 2."""
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to set the open-file limit")
    data, media = tmp_path / "data", tmp_path / "media"
    media.mkdir()
    for n in range(5):
        (media / f"f{n}.bin").write_bytes(os.urandom(20_000))
    assert cli("init", "--data-dir", str(data)).returncode == 0
    refused: list[str] = []
    for nofile in range(8, 40):
        done = cli(
            "scan", "--data-dir", str(data), str(media), prefix=["prlimit", f"--nofile={nofile}"]
        )
        if done.returncode == 0:
            assert "5 files seen" in done.stdout, done.stdout
            break
        assert_refused(done, "too_many_open_files")
        assert f"open-file limit allows ({nofile};" in done.stderr and "ulimit -n" in done.stderr
        said = next(line for line in done.stderr.splitlines() if line.startswith("error: "))
        refused.append(said.split(": ")[3])  # the file it ran out at (warnings may come first)
    else:
        pytest.fail("scan did not work under an open-file limit of 39")
    assert {"truth.db", "owner.key"} <= {Path(file).name for file in refused}, refused


def test_a_database_opened_with_no_descriptor_to_spare_is_too_many_open_files(
    tmp_path: Path,
) -> None:
    """In this process: every descriptor its (lowered) limit allows held, a database cannot be
    opened, and says why; with them given back, a database that cannot be opened for another
    reason (its folder is missing) keeps its old name."""
    path = tmp_path / "x.db"
    db.connect_file(path).close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        for readonly in (True, False):  # SQLite's SQLITE_CANTOPEN; our own os.open's EMFILE
            with pytest.raises(errors.OutOfFiles) as out:
                db.connect_file(path, readonly=readonly)
            assert out.value.slug == "too_many_open_files" and out.value.retryable
            assert "x.db" in out.value.message and "ulimit -n" in out.value.message
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with pytest.raises(errors.StorageReadOnly) as other:
        db.connect_file(tmp_path / "missing.db", readonly=True)
    assert "SQLITE_CANTOPEN" in other.value.message


@pytest.mark.parametrize("command", ["serve", "init", "restore"])
def test_a_data_directory_that_is_a_file_is_said_so(tmp_path: Path, command: str) -> None:
    """Named by METANODE_DATA_DIR (click checks --data-dir itself), a file was
    `file_failed: …: File exists`, of a folder that did not."""
    data = tmp_path / "data"
    data.write_text("not a folder")
    args = {"serve": ["--port", str(free_port())], "restore": [str(tmp_path / "x.db")]}
    done = cli(command, *args.get(command, []), prefix=["env", f"METANODE_DATA_DIR={data}"])
    assert_refused(done, "file_failed")
    assert f"{data} is a file, not a folder" in done.stderr


# -- the database layer maps real SQLite errors ------------------------------------------------


def test_real_sqlite_failures_map_to_typed_errors_and_others_pass_through(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    conn = db.connect(path)
    db.run_txn(conn, lambda c: c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY)"))
    reader = db.connect(path, readonly=True)
    with pytest.raises(errors.StorageReadOnly):
        db.run_txn(reader, lambda c: c.execute("INSERT INTO t VALUES (1)"))
    holder = db.connect(path)
    holder.execute("BEGIN IMMEDIATE")
    conn.execute("PRAGMA busy_timeout=0")
    with pytest.raises(errors.StorageLocked) as locked:
        db.run_txn(conn, lambda c: c.execute("INSERT INTO t VALUES (1)"))
    assert locked.value.retryable and locked.value.status == 503
    holder.execute("ROLLBACK")
    db.run_txn(conn, lambda c: c.execute("INSERT INTO t VALUES (1)"))  # usable after a failure
    with pytest.raises(sqlite3.IntegrityError):  # a constraint is a bug, not a full disk
        db.run_txn(conn, lambda c: c.execute("INSERT INTO t VALUES (1)"))
    assert not conn.in_transaction
    for c in (conn, reader, holder):
        c.close()


@pytest.mark.parametrize(
    ("code", "slug"),
    [
        (errno.ENOSPC, "storage_full"),
        (errno.EDQUOT, "storage_full"),
        (errno.EROFS, "storage_read_only"),
        (errno.EACCES, "storage_read_only"),
        (errno.EIO, "storage_io_error"),
        (errno.EMFILE, "too_many_open_files"),
        (errno.ENFILE, "too_many_open_files"),
        (errno.ENOENT, None),
    ],
)
def test_os_errors_map_by_errno(code: int, slug: str | None) -> None:
    typed = errors.storage_error(OSError(code, os.strerror(code), "/data/x"))
    assert (typed.slug if typed else None) == slug
    if typed is not None:
        assert typed.retryable and "/data/x" in typed.message


# -- anything else: a 500 envelope, the connection kept -----------------------------------------


async def test_an_unexpected_error_is_a_500_envelope(node: Node, client: httpx.AsyncClient) -> None:
    node.truth.conn.close()  # a real fault: every read of the truth now raises
    try:
        response = await client.get("/api/signers")
    finally:
        node.truth._reader = db.connect(node.settings.truth_path, readonly=True)
    assert response.status_code == 500
    body = response.json()
    assert body["error"] == "internal_error" and body["retryable"] is False, body
    assert response.headers["x-request-id"] in body["message"]
    assert (await client.get("/api/signers")).status_code == 200


# -- the lock ----------------------------------------------------------------------------------


def test_a_second_node_on_the_data_directory_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = Server(data).start()
    try:
        assert first.proc is not None
        done = serve_once(data)
        assert_refused(done, "data_dir_locked")
        assert done.stderr.strip() == (
            f"error: data_dir_locked: {data.resolve()} is in use by pid {first.proc.pid} (a "
            "running node: stop it first, or give another --data-dir)"
        )
        media = tmp_path / "media"
        assert_refused(cli("scan", str(media), "--data-dir", str(data)), "data_dir_locked")
        for offline in (["signers", "list"], ["check"], ["export", "--out", os.devnull]):
            done = cli(*offline, "--data-dir", str(data))
            assert done.returncode == 0, done.stderr  # SQLite makes these safe beside it
    finally:
        first.stop()
    again = Server(data).start()  # the lock went with the process
    again.stop()


# -- private modes -----------------------------------------------------------------------------


def modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]
    }


def assert_private(root: Path) -> None:
    for name, mode in modes(root).items():
        wanted = 0o700 if (root / name).is_dir() else 0o600
        assert mode & ~wanted == 0, f"{name} is {mode:o}"


def test_the_data_directory_and_backups_are_private_and_loose_ones_are_tightened(
    tmp_path: Path,
) -> None:
    data, backups = tmp_path / "data", tmp_path / "backups"
    old = os.umask(0o022)  # the usual umask, under which SQLite would create files 0644
    srv = Server(data, env={"METANODE_ACCEPT_UNKNOWN_SIGNERS": "true"})
    try:
        assert cli("keygen", "--out", str(data / "keys" / "own.key")).returncode == 0
        srv.start()
        response = httpx.post(
            f"{srv.url}/api/claims",
            headers=srv.headers,
            timeout=30,
            json={"claims": batch(Signer(), "private", 3)},
        )
        assert response.status_code == 200, response.text
        names = set(modes(data))
        assert {
            "truth.db",
            "truth.db-wal",
            "truth.db-shm",
            "cache.db",
            "cache.db-wal",
            "api-token",
            "lock",
            "keys",
            "keys/own.key",
        } <= names, names
        assert_private(data)
        done = cli("backup", str(backups), "--data-dir", str(data))
        assert done.returncode == 0, done.stderr
        assert_private(backups)
        assert any(name.startswith("keys-") for name in modes(backups))
        srv.stop()

        for loose in (data, data / "keys"):
            loose.chmod(0o755)
        for loose in (data / "truth.db", data / "api-token", data / "keys" / "own.key"):
            loose.chmod(0o644)
        srv.start()
        assert_private(data)
        srv.stop()
        assert f"tightened {data / 'truth.db'} from 644 to 600" in srv.log_text()
    finally:
        os.umask(old)
        if srv.proc is not None:
            srv.stop()


@pytest.mark.parametrize(("fsync", "follower"), [(False, False), (True, False), (False, True)])
async def test_only_the_cache_writer_of_the_writing_process_commits_without_an_fsync(
    tmp_path: Path, fsync: bool, follower: bool
) -> None:
    """`cache_fsync` off: the cache's writer commits with `synchronous=NORMAL` (1) where boots
    can be told apart (`db.boot_id`), and only in the process that writes (not a reader
    worker, which never commits there); the truth's writer always with `FULL` (2)."""
    settings = settings_for(tmp_path / "data", cache_fsync=fsync)
    if follower:
        owner = Node(settings)  # a reader worker needs the owner's schema and build
        await owner.start()
        await owner.stop()
    node = Node(settings, follower=follower)
    await node.start()
    try:
        relaxed = not fsync and not follower and db.boot_id() is not None
        levels = [
            s.writer.conn.execute("PRAGMA synchronous").fetchone()[0]
            for s in (node.truth, node.cache)
        ]
        assert levels == [2, 1 if relaxed else 2]
    finally:
        await node.stop()


def test_a_worker_started_on_a_full_disk_leaves_no_empty_metric_file(
    tmpfs: Path, tmp_path: Path
) -> None:
    """A worker restarted while the disk is full cannot allocate its metric files and exits;
    the empty file it made must not be left for the owner's scrape, which read every file of
    the folder and failed on it (a struct.error: /metrics a 500 until the node restarted).
    The metric folder is made in the runtime folder, here the full disk itself."""
    env = {"XDG_RUNTIME_DIR": str(tmpfs)}
    srv = Server(tmpfs, log=tmp_path / "serve.log", workers=2, env=env).start()
    try:
        filler = fill(tmpfs)
        killed = role_pids(srv)["reader"]
        os.kill(killed, signal.SIGKILL)
        # the restarted reader, on the full disk, exits too
        wait_for(
            "a reader restarted on the full disk", lambda: srv.log_text().count(" exited (") >= 2
        )
        filler.unlink()
        wait_for("a new reader", lambda: role_pids(srv).get("reader") not in (None, killed))
        files = (tmpfs / "metrics").glob("*.db")  # the metric files (`fold.lock` is empty)
        empty = [f.name for f in files if f.stat().st_size == 0]
        assert empty == []
        scraped = httpx.get(f"{srv.url}/metrics", headers=srv.headers, timeout=10)
        assert scraped.status_code == 200, scraped.text
    finally:
        stopped = srv.stop()
    assert stopped == 0
