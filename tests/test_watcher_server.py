"""The watcher inside a real `metanode serve` process, on real folders (SPEC §6, issue #5).

Every test starts its own server on a fresh data directory in `tmp_path` and watches
`tmp_path/media`, with a short settle window. Files are changed with ordinary file operations;
what the node made of them is read back over HTTP: `GET /api/meta/<midhash>`, `GET /api/files`,
and the change feed, replayed from a cursor (`GET /api/events?since=` up to its `synced` event),
which holds every event ever emitted, so "never happened" is checked exactly, not by sampling.
Waits poll with bounded deadlines; nothing asserts on elapsed time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from metanode import cache, db, watcher
from metanode import cid as cids
from tests.helpers.claims import Signer
from tests.helpers.mounts import Mounts
from tests.helpers.rewrite import rewrite_in_place
from tests.helpers.server import Server
from tests.helpers.vectors import load_vectors
from tests.helpers.wait import DEADLINE_S, poll

T = TypeVar("T")
SPARSE: dict[str, str] = {v["name"]: v["cid"] for v in load_vectors("midhash.json")["vectors"]}
LOCAL_KEYS = ("filePath", "fileSize", "mtimeNano")
# The watcher alone: plugins (fileinfo, filename, fullhash) would add their own claims and CIDs
# to every record a file makes; tests/test_plugins_server.py covers them.
NO_PLUGINS = {"METANODE_PLUGINS_ENABLED": "false"}


# -- a server of our own ------------------------------------------------------------------------


@dataclass
class WatchServer(Server):
    """A `Server` that never rescans on a timer and applies promptly, with HTTP helpers."""

    def base_env(self) -> dict[str, str]:
        return {
            **super().base_env(),
            "METANODE_WATCH_RESCAN_S": "0",
            "METANODE_APPLY_POLL_S": "0.2",
            **NO_PLUGINS,
        }

    # -- reads ----------------------------------------------------------------------------------

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", params=params, headers=self.headers, timeout=10)

    def files(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Every GET /api/files row (all pages) under `prefix`, by path."""
        out: dict[str, dict[str, Any]] = {}
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000, "prefix": prefix}
            if after is not None:
                params["after"] = after
            response = self.get("/api/files", **params)
            assert response.status_code == 200, response.text
            page = response.json()
            out.update((row["path"], row) for row in page["files"])
            if page["next"] is None:
                return out
            after = page["next"]

    def cursor(self) -> str:
        """The id of the newest feed event (replay from the start, read its `synced`)."""
        return replay(self, f"{self.health()['epoch']}-0")[1]

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.url}/health", timeout=10).json()
        return body


@dataclass(frozen=True)
class Event:
    id: str
    op: str  # set | del
    rid: str
    key: str
    value: str | None


def replay(server: Server, since: str) -> tuple[list[Event], str]:
    """Every feed event after cursor `since`, and the cursor after them (from `synced`)."""
    events: list[Event] = []
    fields: dict[str, str] = {}
    with httpx.stream(
        "GET",
        f"{server.url}/api/events",
        params={"since": since},
        headers=server.headers,
        timeout=10,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "":
                kind = fields.get("event")
                if kind is not None:
                    data = json.loads(fields["data"])
                    assert kind != "gap", f"the feed lost events after {since}: {data}"
                    if kind == "synced":
                        return events, str(data["id"])
                    events.append(
                        Event(fields["id"], kind, data["rid"], data["key"], data.get("value"))
                    )
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value[1:] if value.startswith(" ") else value
    raise AssertionError("the feed ended before its `synced` event")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = DEADLINE_S) -> T:
    """Poll `probe` until it answers something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"within {timeout} s: never {what} (last: {last!r})")


Start = Callable[..., WatchServer]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """Start servers on tmp_path/data watching tmp_path/media: `start(settle="0.5", **env)`,
    under a wrapper command if `prefix` gives one (`AS_USER`).

    Each is killed at the end whatever happened; its log is printed (shown if the test failed).
    """
    started: list[WatchServer] = []
    (tmp_path / "media").mkdir(exist_ok=True)

    def launch(settle: str = "0.5", prefix: Sequence[str] = (), **env: str) -> WatchServer:
        full = {
            "METANODE_WATCH_SETTLE_S": settle,
            **{f"METANODE_{k.upper()}": v for k, v in env.items()},
        }
        srv = WatchServer(tmp_path / "data", env=full, prefix=tuple(prefix))
        started.append(srv)
        return srv.start()

    yield launch
    for srv in started:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
    if started:
        started[-1].print_log()  # they share one log file


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def record(
    server: WatchServer, cid: str, want: Callable[[dict[str, Any]], bool] = bool, what: str = ""
) -> dict[str, Any]:
    """Wait until GET /api/meta/<cid> answers a document that satisfies `want`."""

    def probe() -> dict[str, Any] | None:
        doc = server.meta(cid)
        return doc if doc is not None and want(doc) else None

    return wait_for(f"a record for {cid} {what}".strip(), probe)


def has_path(path: Path) -> Callable[[dict[str, Any]], bool]:
    return lambda doc: str(path) in doc["paths"]


def has_file_path(path: Path) -> Callable[[dict[str, Any]], bool]:
    return lambda doc: doc.get("filePath") == str(path)


def rid_of(server: WatchServer, path: Path) -> str:
    rid: str = server.files()[str(path)]["rid"]
    return rid


def local_rows(data_dir: Path) -> list[tuple[str, str, int, int]]:
    conn = sqlite3.connect(f"{(data_dir / 'cache.db').as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT path, midhash, size, mtime_ns FROM local_file ORDER BY path"
        ).fetchall()
    finally:
        conn.close()


def scan(
    data_dir: Path, *paths: Path, code: int = 0, prefix: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """`metanode scan PATHS --data-dir DATA` as a subprocess, in a clean environment; `prefix`
    runs it under a wrapper."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    env.update(NO_PLUGINS)
    done = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "metanode",
            "scan",
            *map(str, paths),
            "--data-dir",
            str(data_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=data_dir.parent,
    )
    assert done.returncode == code, done.stdout + done.stderr
    return done


def summary_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stdout.splitlines() if " seen: " in line]
    assert len(lines) == 1, done.stdout
    return lines[0]


# -- a file appears -----------------------------------------------------------------------------


def test_a_new_file_becomes_a_record_with_its_local_keys(start: Start) -> None:
    server = start()
    data = os.urandom(70_000)
    path = write(server.media / "Movies" / "The Matrix (1999).mkv", data)
    midhash = cids.midhash_bytes(data)
    assert watcher.midhash_file(path) == (midhash, len(data))

    doc = record(server, midhash)
    info = path.stat()
    assert doc["cid"] == midhash and doc["cids"] == [midhash]
    assert doc["filePath"] == str(path) and os.path.isabs(doc["filePath"])
    assert doc["paths"] == [str(path)]
    assert doc["metadata"] == {
        f"cids/{midhash}": "true",
        "filePath": str(path),
        "fileSize": str(len(data)),
        "mtimeNano": str(info.st_mtime_ns),
    }

    row = server.files()[str(path)]
    assert row == {
        "path": str(path),
        "midhash": midhash,
        "size": len(data),
        "mtimeNano": str(info.st_mtime_ns),
        "rid": row["rid"],
    }
    assert server.get("/api/hash-ids").json() == {"hashIds": [row["rid"]], "next": None}
    by_rid = server.get(f"/api/metadata/{row['rid']}").json()
    assert by_rid["hashId"] == row["rid"] and by_rid["filePath"] == str(path)

    events, _ = replay(server, f"{server.health()['epoch']}-0")
    assert {(e.op, e.key, e.value) for e in events} == {
        ("set", f"cids/{midhash}", "true"),
        ("set", "filePath", str(path)),
        ("set", "fileSize", str(len(data))),
        ("set", "mtimeNano", str(info.st_mtime_ns)),
    }
    assert {e.rid for e in events} == {row["rid"]} and len(events) == 4


def test_files_listing_pages_and_prefixes_with_the_records_rids(
    start: Start, tmp_path: Path
) -> None:
    media = tmp_path / "media"
    contents = {
        media / "a" / "1.mkv": b"a1",
        media / "a" / "2.mkv": b"a2",
        media / "b" / "1.mkv": b"b1",
        media / "b" / "2.mkv": b"b2",
        media / "c.mkv": b"c",
    }
    for path, data in contents.items():
        write(path, data)  # before the start: found by the startup reconciliation
    server = start()
    wait_for("all five files listed", lambda: len(server.files()) == 5)
    ordered = sorted(str(p) for p in contents)

    first = server.get("/api/files", limit=2).json()
    assert [f["path"] for f in first["files"]] == ordered[:2] and first["next"] == ordered[1]
    second = server.get("/api/files", limit=2, after=first["next"]).json()
    assert [f["path"] for f in second["files"]] == ordered[2:4] and second["next"] == ordered[3]
    third = server.get("/api/files", limit=2, after=second["next"]).json()
    assert [f["path"] for f in third["files"]] == ordered[4:] and third["next"] is None
    exact = server.get("/api/files", limit=5).json()
    assert len(exact["files"]) == 5 and exact["next"] == ordered[-1]  # a full page: maybe more
    assert server.get("/api/files", limit=2, after=ordered[-1]).json() == {
        "files": [],
        "next": None,
    }

    in_b = server.get("/api/files", prefix=f"{media}/b/").json()
    assert [f["path"] for f in in_b["files"]] == [str(media / "b" / n) for n in ("1.mkv", "2.mkv")]
    assert in_b["next"] is None
    assert server.get(
        "/api/files", prefix=f"{media}/b/", limit=1, after=str(media / "b" / "1.mkv")
    ).json()["files"][0]["path"] == str(media / "b" / "2.mkv")
    assert server.get("/api/files", prefix="/nowhere/").json() == {"files": [], "next": None}
    assert server.get("/api/files", limit=0).status_code == 400

    listed = server.files()
    hash_ids = server.get("/api/hash-ids").json()["hashIds"]
    assert sorted(row["rid"] for row in listed.values()) == sorted(hash_ids)
    for path, data in contents.items():
        row = listed[str(path)]
        assert row["midhash"] == cids.midhash_bytes(data) and row["size"] == len(data)
        by_rid = server.get(f"/api/metadata/{row['rid']}").json()
        assert by_rid["hashId"] == row["rid"] and row["midhash"] in by_rid["cids"]
        assert by_rid["filePath"] == str(path)


# -- settling -----------------------------------------------------------------------------------


LONG_SETTLE_S = "5.0"  # far longer than a step of the tests below, however loaded the machine


def started(server: WatchServer) -> None:
    """Wait until the start's scan has ended: its inotify watch stands from then on, so a file
    written after this is seen as an event and settles (`pending`), where one written sooner
    could be fingerprinted by the scan instead, never `pending` (CI found it)."""
    wait_for("the start's scan to end", lambda: server.health()["watcher"]["scanning"] is False)


def still_settling(server: WatchServer, path: Path) -> None:
    """Wait until the watcher has `path` waiting to settle, and check it is not hashed yet: a
    change made right after this falls inside the settle window (a window that long cannot pass
    between this check and the next line of the test)."""
    wait_for(f"the watcher to queue {path.name}", lambda: server.health()["watcher"]["pending"])
    assert str(path) not in server.files(), f"{path.name} was hashed before it settled"


def test_a_file_written_slowly_is_hashed_once_after_it_settles(start: Start) -> None:
    server = start(settle=LONG_SETTLE_S)
    started(server)
    path = server.media / "slow.mkv"
    chunks = [os.urandom(50_000) for _ in range(6)]
    sizes_seen: set[int] = set()
    with path.open("wb") as out:
        for chunk in chunks:
            out.write(chunk)
            out.flush()
            for _ in range(6):  # 0.3 s between chunks, watching /api/files meanwhile
                row = server.files().get(str(path))
                if row is not None:
                    sizes_seen.add(row["size"])
                time.sleep(0.05)
            still_settling(server, path)  # so the next chunk comes inside the settle window
    final = b"".join(chunks)
    midhash = cids.midhash_bytes(final)
    doc = record(server, midhash, has_path(path))
    assert doc["metadata"]["fileSize"] == str(len(final))

    assert sizes_seen <= {len(final)}, f"listed at an intermediate size: {sizes_seen}"
    partials = [cids.midhash_bytes(b"".join(chunks[:n])) for n in range(1, len(chunks))]
    for partial in partials:
        assert server.meta(partial) is None, "a partial content was hashed and got a record"
    rid = rid_of(server, path)
    assert server.get("/api/hash-ids").json()["hashIds"] == [rid]
    events, _ = replay(server, f"{server.health()['epoch']}-0")
    assert {e.rid for e in events} == {rid}
    assert [e.value for e in events if e.key == "fileSize"] == [str(len(final))]
    assert [(e.op, e.value) for e in events if e.key == "filePath"] == [("set", str(path))]


def test_a_change_during_the_settle_window_restarts_it(start: Start) -> None:
    server = start(settle=LONG_SETTLE_S)
    started(server)
    path = server.media / "twice.mkv"
    first = os.urandom(10_000)
    write(path, first)
    still_settling(server, path)  # the append below comes inside the settle window
    with path.open("ab") as out:
        out.write(b"appended before it settled")
    final = path.read_bytes()
    record(server, cids.midhash_bytes(final), has_path(path))
    assert server.meta(cids.midhash_bytes(first)) is None
    events, _ = replay(server, f"{server.health()['epoch']}-0")
    assert [e.value for e in events if e.key == "fileSize"] == [str(len(final))]


def test_a_10_gib_sparse_file_has_the_known_midhash(start: Start) -> None:
    server = start(settle="0.3")
    for name, size in (
        ("10GiB-sparse-zero", 10 * 1024**3),
        ("4GiB-plus-7-sparse-zero", 4 * 1024**3 + 7),
    ):
        path = server.media / f"{name}.img"
        with path.open("wb") as out:
            out.truncate(size)
        doc = record(server, SPARSE[name], has_path(path))
        assert doc["metadata"]["fileSize"] == str(size)
        assert server.files()[str(path)]["midhash"] == SPARSE[name]
    assert SPARSE["10GiB-sparse-zero"] == (
        "bagacbabaedo3c7zugmfehhbpuge7ejxeohniozz4tefuubk7p5jdm3zuhouic"
    )


# -- moves, copies, deletes, rewrites -----------------------------------------------------------


def settled_after(server: WatchServer, name: str) -> str:
    """Write a sentinel file and wait for its record: anything the watcher had pending before it
    (an earlier path waiting to settle) has been hashed by then. Returns the sentinel's rid."""
    content = f"sentinel {name} {time.monotonic_ns()}".encode()
    path = write(server.media / name, content)
    record(server, cids.midhash_bytes(content), has_path(path))
    return rid_of(server, path)


def test_a_rename_is_one_set_of_file_path_and_no_del(start: Start) -> None:
    server = start()
    data = os.urandom(5000)
    old = write(server.media / "old name.mkv", data)
    midhash = cids.midhash_bytes(data)
    record(server, midhash, has_path(old))
    rid = rid_of(server, old)
    (server.media / "Sorted").mkdir()
    settled_after(server, "sentinel-1")  # the folder's creation has gone by
    mark = server.cursor()

    new = server.media / "Sorted" / "new name.mkv"
    os.rename(old, new)
    doc = record(server, midhash, has_file_path(new))
    assert doc["paths"] == [str(new)]
    sentinel = settled_after(server, "sentinel-2")
    assert set(server.files()) == {
        str(new),
        str(server.media / "sentinel-1"),
        str(server.media / "sentinel-2"),
    }
    events, _ = replay(server, mark)
    assert [(e.op, e.rid, e.key, e.value) for e in events if e.rid != sentinel] == [
        ("set", rid, "filePath", str(new))
    ]


def test_a_folder_rename_moves_every_file_in_one_set_each(start: Start) -> None:
    server = start()
    tracks = {server.media / "Album" / f"{i:02}.flac": os.urandom(2000 + i) for i in range(3)}
    for path, data in tracks.items():
        write(path, data)
    for path, data in tracks.items():
        record(server, cids.midhash_bytes(data), has_path(path))
    rids = {rid_of(server, path) for path in tracks}
    mark = server.cursor()
    os.rename(server.media / "Album", server.media / "Album (2001)")
    for path, data in tracks.items():
        moved = server.media / "Album (2001)" / path.name
        record(server, cids.midhash_bytes(data), has_file_path(moved))
    sentinel = settled_after(server, "sentinel")
    events, _ = replay(server, mark)
    assert sorted((e.rid, e.op, e.key) for e in events if e.rid != sentinel) == sorted(
        (rid, "set", "filePath") for rid in rids
    )


def test_duplicates_then_deleting_every_copy_keeps_the_claims(start: Start) -> None:
    server = start()
    data = os.urandom(8000)
    midhash = cids.midhash_bytes(data)
    original = write(server.media / "b-original.mkv", data)
    record(server, midhash, has_path(original))
    rid = rid_of(server, original)

    alice = Signer()
    response = httpx.post(
        f"{server.url}/api/signers",
        headers=server.headers,
        timeout=10,
        json={"uid": alice.uid, "name": "alice"},
    )
    assert response.status_code == 200, response.text
    response = httpx.post(
        f"{server.url}/api/claims",
        headers=server.headers,
        timeout=10,
        json={"claims": [alice.claim(midhash, "title", "The Original")]},
    )
    assert response.status_code == 200 and response.json()["accepted"] == 1, response.text

    copy = server.media / "a-copy.mkv"  # sorts first
    shutil.copyfile(original, copy)
    doc = record(server, midhash, lambda d: len(d["paths"]) == 2, "with two paths")
    assert doc["paths"] == [str(copy), str(original)]
    assert doc["filePath"] == str(copy)  # the lexicographically first path
    assert doc["metadata"]["title"] == "The Original"
    assert {row["rid"] for row in server.files().values()} == {rid}  # one record

    copy.unlink()
    doc = record(server, midhash, lambda d: d["paths"] == [str(original)], "with one path")
    assert doc["filePath"] == str(original)
    assert doc["metadata"]["fileSize"] == str(len(data))

    mark = server.cursor()
    original.unlink()
    doc = record(server, midhash, lambda d: d["paths"] == [], "with no path")
    assert "filePath" not in doc
    assert doc["metadata"] == {f"cids/{midhash}": "true", "title": "The Original"}
    assert server.files() == {}
    events, _ = replay(server, mark)
    assert sorted((e.op, e.key) for e in events) == [("del", k) for k in sorted(LOCAL_KEYS)]
    assert {e.rid for e in events} == {rid}
    by_rid = server.get(f"/api/metadata/{rid}")
    assert by_rid.status_code == 200 and by_rid.json()["metadata"]["title"] == "The Original"


def test_rewriting_a_file_moves_its_path_to_the_new_contents_record(start: Start) -> None:
    server = start()
    path = server.media / "episode.mkv"
    before, after = os.urandom(4000), os.urandom(4000)  # same size, different content
    write(path, before)
    old_cid, new_cid = cids.midhash_bytes(before), cids.midhash_bytes(after)
    record(server, old_cid, has_path(path))
    old_rid = rid_of(server, path)
    mark = server.cursor()

    path.write_bytes(after)
    doc = record(server, new_cid, has_path(path))
    assert doc["filePath"] == str(path) and doc["paths"] == [str(path)]
    new_rid = rid_of(server, path)
    assert new_rid != old_rid
    old_doc = server.meta(old_cid)
    assert old_doc is not None and old_doc["paths"] == [] and "filePath" not in old_doc
    assert not set(LOCAL_KEYS) & set(old_doc["metadata"])
    events, _ = replay(server, mark)
    assert sorted((e.op, e.key) for e in events if e.rid == old_rid) == [
        ("del", k) for k in sorted(LOCAL_KEYS)
    ]
    assert {e.key for e in events if e.rid == new_rid and e.op == "set"} >= set(LOCAL_KEYS)


# -- folders ------------------------------------------------------------------------------------


def test_a_file_written_under_one_of_its_hard_links_changes_under_every_name(
    start: Start,
) -> None:
    """inotify reports a write under the name it was made through only: the file's other
    names (a download hard-linked into the library, and tagged there) kept the old content's
    midhash and size until the next rescan."""
    server = start()
    first = write(server.media / "downloads" / "song.flac", os.urandom(3000))
    second = server.media / "library" / "song.flac"
    second.parent.mkdir()
    os.link(first, second)
    old = cids.midhash_bytes(first.read_bytes())
    poll(lambda: midhash_at(server, second) == old or None, "both names listed")
    with first.open("r+b") as same_inode:
        same_inode.write(os.urandom(4000))
    new = cids.midhash_bytes(second.read_bytes())
    poll(lambda: midhash_at(server, second) == new or None, "the other name's new content")
    assert midhash_at(server, first) == new


def test_a_folder_moved_in_appears_and_a_deleted_folder_goes(start: Start, tmp_path: Path) -> None:
    server = start()
    outside = tmp_path / "downloads"
    albums = {}
    for name in ("First Album", "Second Album"):
        albums[name] = {outside / name / f"{i:02}.flac": os.urandom(3000 + i) for i in range(3)}
        for path, data in albums[name].items():
            write(path, data)
        write(outside / name / ".cover.jpg", b"hidden")
        write(outside / name / "04.flac.part", b"partial")
        (outside / name / "CD2").mkdir()
        write(outside / name / "CD2" / "01.flac", albums[name][outside / name / "00.flac"])

    for name in albums:
        shutil.move(outside / name, server.media / name)
    expected = {str(server.media / name / p.name) for name in albums for p in albums[name]}
    expected |= {str(server.media / name / "CD2" / "01.flac") for name in albums}
    wait_for("every moved-in file listed", lambda: set(server.files()) == expected)

    shutil.rmtree(server.media / "First Album")  # deleted in place
    shutil.move(server.media / "Second Album", outside / "Second Album")  # moved out
    wait_for("the folders' rows gone", lambda: server.files() == {})
    for name in albums:
        for data in albums[name].values():
            doc = server.meta(cids.midhash_bytes(data))
            assert doc is not None and doc["paths"] == [] and "filePath" not in doc


def test_a_file_replaced_by_a_folder_of_its_name_goes(start: Start, tmp_path: Path) -> None:
    """The file's row goes with the file, though its path is a folder now (it stayed, stale,
    until the next rescan: a folder was walked, and only what vanished was removed)."""
    server = start()
    swap = write(server.media / "Extras", os.urandom(3000))
    wait_for("the file listed", lambda: set(server.files()) == {str(swap)})
    inner = write(tmp_path / "outside" / "Extras" / "trailer.mkv", os.urandom(3001))
    swap.unlink()
    (tmp_path / "outside" / "Extras").rename(swap)  # in the same inotify batch as the unlink
    wanted = {str(swap / inner.name)}
    wait_for("only the folder's file listed", lambda: set(server.files()) == wanted)


# -- what is ignored ----------------------------------------------------------------------------

IGNORED_NAMES = (
    ".hidden.mkv",
    ".dot folder/inside.mkv",
    "sub/.trash/deep.mkv",
    "movie.mkv.part",
    "movie.mkv.PART",
    "movie.tmp",
    "setup.crdownload",
    "torrent.mkv.!qB",
    "movie.nfo",
    "extras/trailer.mkv",
)


def make_ignored(folder: Path, outside: Path) -> None:
    for n, name in enumerate(IGNORED_NAMES):
        write(folder / name, f"ignored {folder} {n}".encode())
    target = write(outside / f"target of {folder.name}.mkv", f"target {folder}".encode())
    write(
        outside / f"linked folder {folder.name}" / "in linked folder.mkv",
        f"linked {folder}".encode(),
    )
    (folder / "link.mkv").symlink_to(target)
    (folder / "folder link").symlink_to(outside / f"linked folder {folder.name}")


def test_ignored_names_and_symlinks_never_appear(start: Start, tmp_path: Path) -> None:
    media, outside = tmp_path / "media", tmp_path / "outside"
    (media / "startup").mkdir(parents=True)
    make_ignored(media / "startup", outside)
    first = write(media / "startup" / "zz sentinel.mkv", b"sentinel one")
    server = start(watch_ignore="*.nfo,extras/*,*/extras/*")
    wait_for("the startup sentinel", lambda: str(first) in server.files())
    assert set(server.files()) == {str(first)}

    (media / "live").mkdir()
    make_ignored(media / "live", outside)
    # a download finishing: written as .part, then renamed to its final name
    part = write(media / "live" / "download.mkv.part", b"finished download")
    os.rename(part, media / "live" / "download.mkv")
    second = write(media / "live" / "zz sentinel.mkv", b"sentinel two")
    wait_for("the live sentinel", lambda: str(second) in server.files())
    wait_for(
        "the finished download", lambda: str(media / "live" / "download.mkv") in server.files()
    )
    assert set(server.files()) == {str(first), str(second), str(media / "live" / "download.mkv")}
    for folder in (media / "startup", media / "live"):
        for n, name in enumerate(IGNORED_NAMES):
            assert server.meta(cids.midhash_bytes(f"ignored {folder} {n}".encode())) is None, name
        assert server.meta(cids.midhash_bytes(f"target {folder}".encode())) is None
        assert server.meta(cids.midhash_bytes(f"linked {folder}".encode())) is None


def test_symlinks_are_followed_when_configured(start: Start, tmp_path: Path) -> None:
    media, outside = tmp_path / "media", tmp_path / "outside"
    target = write(outside / "target.mkv", b"the target")
    write(outside / "folder" / "inner.mkv", b"inside the linked folder")
    media.mkdir(exist_ok=True)
    (media / "link.mkv").symlink_to(target)
    (media / "folder link").symlink_to(outside / "folder")
    server = start(watch_follow_symlinks="true")
    doc = record(server, cids.midhash_bytes(b"the target"), has_path(media / "link.mkv"))
    assert doc["filePath"] == str(media / "link.mkv")  # the path in the root, not the target's
    record(
        server,
        cids.midhash_bytes(b"inside the linked folder"),
        has_path(media / "folder link" / "inner.mkv"),
    )

    late = write(outside / "late.mkv", b"linked after the start")
    (media / "late link.mkv").symlink_to(late)
    record(server, cids.midhash_bytes(b"linked after the start"), has_path(media / "late link.mkv"))


def test_a_link_up_to_the_root_made_while_watched_lists_nothing_twice(
    start: Start, tmp_path: Path
) -> None:
    """With links followed, a link to the root (a loop) made while watched was walked from its
    event: the whole library listed again below it, until the next rescan removed it."""
    media = tmp_path / "media"
    film = write(media / "Films" / "film.mkv", os.urandom(3000))
    write(media / "Music" / "tone.flac", os.urandom(3000))
    server = start(watch_follow_symlinks="true")
    poll(lambda: len(server.files()) == 2 or None, "both files listed")
    (media / "Music" / "library").symlink_to(media)
    (media / "Films" / "here").symlink_to(media / "Films")
    later = write(media / "Films" / "later.mkv", os.urandom(3000))  # after the links' events
    poll(lambda: str(later) in server.files() or None, "the later file listed")
    assert sorted(server.files()) == sorted(
        [str(film), str(later), str(media / "Music" / "tone.flac")]
    )


def test_files_created_in_an_ignored_folder_never_appear(start: Start, tmp_path: Path) -> None:
    media = tmp_path / "media"
    write(media / "Movie" / "Samples" / "at-start.mkv", b"present at start")
    first = write(media / "Movie" / "movie.mkv", b"the movie")
    server = start(watch_ignore="Samples")
    wait_for("the movie", lambda: str(first) in server.files())
    assert set(server.files()) == {str(first)}  # the startup walk skips Samples/: right

    write(media / "Movie" / "Samples" / "live.mkv", b"created while running")
    sentinel = write(media / "Movie" / "sentinel.mkv", b"sentinel")
    wait_for("the sentinel", lambda: str(sentinel) in server.files())
    assert set(server.files()) == {str(first), str(sentinel)}


# -- restarts -----------------------------------------------------------------------------------


def recorded_then_stopped(
    server: WatchServer, contents: dict[Path, bytes]
) -> tuple[list[tuple[str, str, int, int]], str]:
    """Write `contents`, wait until the node has a row for each, stop it: its `local_file`
    rows and its feed cursor then, for a restart to be compared with."""
    for path, data in contents.items():
        write(path, data)
    wait_for("every file", lambda: len(server.files()) == len(contents))
    rows, mark = local_rows(server.data_dir), server.cursor()
    server.stop()
    return rows, mark


def test_a_restart_with_nothing_changed_hashes_nothing(start: Start, tmp_path: Path) -> None:
    server = start()
    contents = {server.media / f"f{i}.mkv": os.urandom(1000 * (i + 1)) for i in range(3)}
    rows, mark = recorded_then_stopped(server, contents)

    again = start()
    marker = write(again.media / "marker.mkv", b"after the restart")
    # The settle loop starts only after the startup reconciliation, so once the marker is in,
    # the reconciliation is over: whatever it re-hashed would be in the feed before the marker.
    record(again, cids.midhash_bytes(b"after the restart"), has_path(marker))
    marker_rid = rid_of(again, marker)
    events, _ = replay(again, mark)
    assert {e.rid for e in events} == {marker_rid}, events
    assert [r for r in local_rows(again.data_dir) if r[0] != str(marker)] == rows
    again.stop()

    done = scan(again.data_dir, again.media)
    assert summary_line(done) == "4 files seen: 0 hashed, 4 unchanged, 0 removed, 0 unreadable"


def ctimes(data_dir: Path) -> dict[str, int]:
    """path → the ctime its `local_file` row holds (0: none yet)."""
    conn = sqlite3.connect(f"{(data_dir / 'cache.db').as_uri()}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT path, ctime_ns FROM local_file").fetchall())
    finally:
        conn.close()


def as_schema_13(cache_db: Path) -> None:
    """Make a stopped node's cache.db what the metanode before ctimes left: cache schema 13,
    whose `local_file` had no `ctime_ns`, and whose documents were kept under each CID, not
    once a group (v15) (checked column for column against a cache made by the migrations up
    to 13)."""
    fresh = cache_db.with_name("v13.db")
    db.migrate_file(fresh, cache.MIGRATIONS[:13])
    conn = sqlite3.connect(cache_db)
    try:
        conn.execute("ALTER TABLE local_file DROP COLUMN ctime_ns")
        conn.execute("ALTER TABLE cid_index ADD COLUMN body BLOB")
        conn.execute(
            "UPDATE cid_index SET body = (SELECT d.body FROM group_document d "
            "WHERE d.rid = cid_index.rid)"
        )
        conn.execute("DROP TABLE group_document")
        conn.execute("PRAGMA user_version = 13")
        conn.commit()
        old = sqlite3.connect(fresh)
        try:
            for table in ("local_file", "cid_index"):
                columns = f"SELECT * FROM pragma_table_info('{table}')"
                assert conn.execute(columns).fetchall() == old.execute(columns).fetchall()
        finally:
            old.close()
    finally:
        conn.close()
    fresh.unlink()


def test_an_upgraded_cache_takes_each_files_ctime_without_hashing_then_sees_rewrites(
    start: Start, tmp_path: Path
) -> None:
    """A node of cache schema 13 upgraded: its first start gives each row the disk's ctime and
    hashes nothing (the feed holds only a marker written after; a library of 100,000 files is
    not read again), then a file rewritten in place with its size and mtime put back moves to
    its new content at once (inotify), which nothing saw before."""
    server = start()
    contents = {server.media / f"f{i}.mkv": os.urandom(3000 + i) for i in range(3)}
    rows, mark = recorded_then_stopped(server, contents)
    as_schema_13(server.data_dir / "cache.db")

    again = start()
    marker = write(again.media / "marker.mkv", b"after the upgrade")
    record(again, cids.midhash_bytes(b"after the upgrade"), has_path(marker))  # start scan done
    events, _ = replay(again, mark)
    assert {e.rid for e in events} == {rid_of(again, marker)}, events
    assert [r for r in local_rows(again.data_dir) if r[0] != str(marker)] == rows
    on_disk = {str(p): p.stat().st_ctime_ns for p in [*contents, marker]}
    assert ctimes(again.data_dir) == on_disk
    assert "recorded the change time (ctime) of 3 file(s)" in again.log_text()

    first = next(iter(contents))
    rewrite_in_place(first, b"T" * len(contents[first]))
    new = cids.midhash_bytes(first.read_bytes())
    wait_for("the rewrite seen", lambda: midhash_at(again, first) == new)
    served = httpx.get(f"{again.url}/file/{new}", headers=again.headers, timeout=10)
    assert served.status_code == 200 and served.content == first.read_bytes()


def test_a_chmod_is_hashed_again_and_changes_no_record(start: Start) -> None:
    """A chmod moves the ctime as a write does: the file is hashed again, to the midhash it
    had, and its row takes the new ctime (the next look hashes nothing); no feed event."""
    server = start()
    film = write(server.media / "film.mkv", os.urandom(3000))
    midhash = cids.midhash_bytes(film.read_bytes())
    wait_for("listed", lambda: midhash_at(server, film) == midhash)
    mark = server.cursor()
    os.chmod(film, 0o600)
    ctime = film.stat().st_ctime_ns
    wait_for("the new ctime kept", lambda: ctimes(server.data_dir).get(str(film)) == ctime)
    assert midhash_at(server, film) == midhash
    assert replay(server, mark)[0] == []
    served = httpx.get(f"{server.url}/file/{midhash}", headers=server.headers, timeout=10)
    assert served.status_code == 200 and served.content == film.read_bytes()


def test_a_file_dated_past_2262_is_recorded_served_and_not_hashed_again(
    start: Start, tmp_path: Path
) -> None:
    """An mtime past a 64-bit count of nanoseconds (ext4 and NTFS take dates to 2446 and
    beyond; a camera's clock gone wrong) could not be stored: the batch holding the file
    failed, and every reconciliation after it, for good (/health `degraded`), so no file
    sorted after it was ever recorded. It is kept at the largest mtime the databases hold."""
    media = tmp_path / "media"
    future, after = (write(media / n, os.urandom(3000)) for n in ("a-2446.mkv", "b.mkv"))
    os.utime(future, ns=(0, 99_999_999_999 * 10**9))
    if future.stat().st_mtime_ns < 2**63:
        pytest.skip("this file system cannot date a file past 2262")
    server = start()
    poll(lambda: {str(future), str(after)} <= server.files().keys() or None, "both listed")
    midhash = cids.midhash_bytes(future.read_bytes())
    doc = server.meta(midhash)
    assert doc is not None and doc["metadata"]["mtimeNano"] == str(2**63 - 1), doc
    assert server.health()["status"] == "ok"
    served = httpx.get(f"{server.url}/file/{midhash}", headers=server.headers, timeout=10)
    assert served.status_code == 200 and served.content == future.read_bytes()
    rows = local_rows(server.data_dir)
    server.stop()
    again = start()  # nothing changed: nothing hashed (its mtime compares as it was kept)
    marker = write(media / "marker.mkv", os.urandom(3000))
    poll(lambda: str(marker) in again.files() or None, "a file after the restart")
    assert [r for r in local_rows(again.data_dir) if r[0] != str(marker)] == rows
    restarted = again.log_text().split("Started server process")[-1]
    scans = re.findall(r"(\d+) hashed, (\d+) unchanged", restarted)  # the marker's, perhaps
    assert all(unchanged == "2" for _, unchanged in scans), restarted  # the two, not hashed


def test_a_first_scan_says_how_far_it_is_and_a_stop_leaves_the_rest_for_the_next_start(
    start: Start, tmp_path: Path
) -> None:
    """A first scan of a large library takes minutes (100,000 files: about one on a quiet
    machine, far more beside the plugins): /health's `watcher.scan` and the Health page say how
    far it is, and the log when it begins and what it did (it said nothing from start to end).
    A stop during it stops at once (the node waited for the whole scan), and the next start
    goes on. The long settle window holds the first scan open while the test looks."""
    count = watcher.BATCH + 44  # more than a batch: a scan the log says is under way
    for i in range(count):
        write(tmp_path / "media" / f"Season {i // 100}" / f"e{i:03d}.mkv", os.urandom(64))
    server = start(settle="600")
    scan = wait_for("the scan walked", lambda: server.health()["watcher"]["scan"])
    assert scan == {"seen": count, "to_hash": count, "done": 0}
    with httpx.Client(base_url=server.url, timeout=10) as page:
        assert page.post("/signin", data={"token": server.token}).status_code == 303
        said = page.get("/status").text
    assert f"0 of {count} new or changed files fingerprinted ({count} seen)" in said
    assert server.stop() == 0  # not after the 600 s window and the scan: at once
    log = server.log_text()
    assert f"fingerprinting {count} new or changed file(s) of {count} in " in log
    left = f"{count} files seen: 0 hashed, 0 unchanged, 0 removed, 0 unreadable, {count} left"
    assert left in log

    again = start()
    wait_for("every file", lambda: len(again.files()) == count)
    wait_for("the scan said", lambda: f"{count} files seen: {count} hashed" in again.log_text())
    assert again.health()["watcher"]["scan"] is None


def test_a_restart_reconciles_changes_made_while_stopped(start: Start) -> None:
    server = start()
    media = server.media
    data = {n: os.urandom(2000) for n in ("keep", "modify", "delete", "rename")}
    for name, content in data.items():
        write(media / f"{name}.mkv", content)
    wait_for("four files", lambda: len(server.files()) == 4)
    server.stop()

    (media / "modify.mkv").write_bytes(b"modified while the server was down")
    (media / "delete.mkv").unlink()
    os.rename(media / "rename.mkv", media / "renamed.mkv")
    write(media / "new" / "added.mkv", b"added while the server was down")
    expected = {
        str(media / "keep.mkv"): cids.midhash_bytes(data["keep"]),
        str(media / "modify.mkv"): cids.midhash_bytes(b"modified while the server was down"),
        str(media / "renamed.mkv"): cids.midhash_bytes(data["rename"]),
        str(media / "new" / "added.mkv"): cids.midhash_bytes(b"added while the server was down"),
    }

    again = start()
    wait_for(
        "the disk reflected",
        lambda: {p: row["midhash"] for p, row in again.files().items()} == expected,
    )
    for name in ("modify", "delete"):
        gone = again.meta(cids.midhash_bytes(data[name]))
        assert gone is not None and gone["paths"] == [] and "filePath" not in gone
    renamed = again.meta(cids.midhash_bytes(data["rename"]))
    assert renamed is not None and renamed["filePath"] == str(media / "renamed.mkv")
    assert renamed["paths"] == [str(media / "renamed.mkv")]


def test_a_watch_root_missing_at_start_keeps_its_files_until_it_is_back(start: Start) -> None:
    """A disk not mounted when the node starts: its root was made anew, empty, and every file
    of it dropped from the records (consumers saw them deleted). Now the root is not made, the
    files stay, /health says why it is degraded, and once the folder is back it is watched
    again without a restart."""
    server = start()
    media = server.media
    content = os.urandom(3000)
    kept = write(media / "film.mkv", content)
    wait_for("the file listed", lambda: str(kept) in server.files())
    server.stop()
    unmounted = media.with_name("media.unmounted")
    os.rename(media, unmounted)

    again = start()
    health = wait_for("a degraded health naming the root", lambda: (
        (h := again.health())["status"] == "degraded" and h["watcher"]["unlisted"] and h
    ))  # fmt: skip
    assert health["watcher"]["unlisted"] == [str(media)], health
    assert any(str(media) in problem for problem in health["problems"]), health
    assert str(kept) in again.files() and not media.exists()
    assert again.meta(cids.midhash_bytes(content))["filePath"] == str(kept)  # type: ignore[index]
    os.rename(unmounted, media)
    wait_for("health ok once the root is back", lambda: again.health()["status"] == "ok")
    added = write(media / "later.mkv", os.urandom(3000))  # watched live again
    wait_for("a file added after it came back", lambda: str(added) in again.files())
    assert str(kept) in again.files()


def test_a_watch_root_moved_away_while_watched_keeps_its_files_until_it_is_back(
    start: Start, tmp_path: Path
) -> None:
    """inotify reports a root moved away (or taken off by a rename of its mount point) as the
    root deleted, and that removed every row below it: consumers saw every file deleted, and
    when the folder was back every file was hashed again, as new. A root gone while watched is
    now what a root missing at start is: its files kept, /health degraded naming it."""
    server = start()
    media = server.media
    content = os.urandom(3000)
    kept = write(media / "Films" / "film.mkv", content)
    poll(lambda: str(kept) in server.files() or None, "the file listed")
    cursor = server.cursor()
    away = tmp_path / "media.away"
    os.rename(media, away)
    poll(lambda: server.health()["watcher"]["unlisted"] == [str(media)] or None, "root named")
    assert str(kept) in server.files()
    said_before = len(server.log_text())
    os.rename(away, media)
    poll(lambda: server.health()["status"] == "ok" or None, "health ok once the root is back")
    added = write(media / "later.mkv", os.urandom(3000))  # watched live again
    poll(lambda: str(added) in server.files() or None, "a file added after it came back")
    events, _ = replay(server, cursor)
    assert [e for e in events if e.op == "del"] == [], events
    came_back = server.log_text()[said_before:]
    scans = re.findall(r"(\d+) hashed, (\d+) unchanged", came_back)  # `later.mkv`'s, perhaps
    assert all(unchanged == "1" for _, unchanged in scans), came_back  # the film: not hashed


def test_a_disk_mounted_below_a_root_is_watched_and_kept_while_taken_off(
    start: Start, tmp_path: Path
) -> None:
    """A disk mounted on a folder of the library while the node ran: the watch lay on the
    folder beneath it, so files written to the disk were seen only at the next rescan (10
    minutes); taken off, the next rescan removed each of its files (consumers saw them
    deleted), and hashed them again once it was back. The mount table is looked at with the
    roots: a mount is watched at once, and an empty mount point on another device keeps its
    files, as a root does."""
    usb = tmp_path / "media" / "usb"
    usb.mkdir(parents=True)
    server = start()
    with Mounts() as mounts:
        disk = mounts.mount(tmp_path / "disk")  # the disk, mounted on the library's folder:
        mounts.bind(disk, usb)
        film = write(usb / "film.mkv", os.urandom(3000))  # seen only by a watch of the disk
        poll(lambda: str(film) in server.files() or None, "a file on the mounted disk")
        second = write(usb / "second.mkv", os.urandom(3000))  # the start's walk may have
        poll(lambda: str(second) in server.files() or None, "the mount watched")  # had `film`
        cursor = server.cursor()
        mounts.unmount(usb)
        poll(lambda: server.health()["watcher"]["unlisted"] == [str(usb)] or None, "usb named")
        assert str(film) in server.files()
        write(disk / "later.mkv", os.urandom(3000))  # written elsewhere meanwhile
        mounts.bind(disk, usb)
        poll(lambda: str(usb / "later.mkv") in server.files() or None, "the disk back")
        assert server.health()["status"] == "ok"
        events, _ = replay(server, cursor)
        assert [e for e in events if e.op == "del"] == [], events


def test_a_watch_root_deleted_and_made_again_at_once_is_watched_again(start: Start) -> None:
    """`rm -rf media && mkdir media` (a sync tool starting over): the watch lay on the deleted
    folder, and the new one, of the same name on the same device, was never watched: what was
    written to it after was seen only at the next rescan. A root of a new inode is watched
    anew and reconciled."""
    server = start()
    media = server.media
    gone = write(media / "gone.mkv", os.urandom(3000))
    poll(lambda: str(gone) in server.files() or None, "the first file listed")
    shutil.rmtree(media)
    media.mkdir()
    first = write(media / "first.mkv", os.urandom(3000))
    poll(lambda: str(first) in server.files() or None, "a file of the new folder")
    later = write(media / "later.mkv", os.urandom(3000))
    poll(lambda: str(later) in server.files() or None, "a file written to it later")
    assert str(gone) not in server.files()


def test_a_watch_root_that_cannot_be_made_is_said_and_the_others_are_watched(
    start: Start, tmp_path: Path
) -> None:
    """A root that is a file (a typo in `watch_roots`) made the watcher's start fail: every
    root went unwatched, /health said only "the watcher has stopped" and the log nothing."""
    typo = tmp_path / "film.mkv"
    typo.write_bytes(os.urandom(3000))
    server = start(watch_roots=f"{typo}:{tmp_path / 'media'}")
    added = write(server.media / "film.mkv", os.urandom(3000))
    wait_for("a file of the other root listed", lambda: str(added) in server.files())
    health = server.health()
    assert health["watcher"]["unlisted"] == [str(typo)], health
    assert "the watcher has stopped" not in health["problems"], health
    assert f"cannot make watch root {typo}" in server.log_text()


def test_a_folder_taken_out_of_watch_roots_loses_the_rows_of_its_deleted_files(
    start: Start, tmp_path: Path
) -> None:
    """A review moved the node from one folder to another: the first folder's files stayed on
    their records for good, deleted or not (only a rebuild cleared them). At start, and at each
    rescan, the files below no root are looked at again; a gone one loses its row."""
    server = start()
    gone, kept = (write(server.media / n, os.urandom(3000)) for n in ("gone.mkv", "kept.mkv"))
    wait_for("both listed", lambda: {str(gone), str(kept)} <= server.files().keys())
    server.stop()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    gone.unlink()
    again = start(watch_roots=str(elsewhere))
    wait_for("the deleted file's row gone", lambda: str(gone) not in again.files())
    assert str(kept) in again.files()  # still there, only no longer watched


# -- metanode scan ------------------------------------------------------------------------------


def test_scan_command_counts_and_a_second_run_hashes_nothing(tmp_path: Path, start: Start) -> None:
    media, data_dir = tmp_path / "media", tmp_path / "data"
    files = {
        media / "a.mkv": os.urandom(3000),
        media / "sub" / "b.mkv": os.urandom(2_000_000),
        media / "sub" / "c.mkv": b"c",
    }
    for path, content in files.items():
        write(path, content)
    write(media / ".hidden", b"ignored")
    write(media / "d.part", b"ignored")

    first = scan(data_dir, media)  # a fresh data directory
    assert summary_line(first) == "3 files seen: 3 hashed, 0 unchanged, 0 removed, 0 unreadable"
    second = scan(data_dir, media)
    assert summary_line(second) == "3 files seen: 0 hashed, 3 unchanged, 0 removed, 0 unreadable"

    (media / "a.mkv").write_bytes(b"rewritten")
    (media / "sub" / "c.mkv").unlink()
    write(media / "e.mkv", b"new")
    third = scan(data_dir, media)
    assert summary_line(third) == "3 files seen: 2 hashed, 1 unchanged, 1 removed, 0 unreadable"
    only_sub = scan(data_dir, media / "sub")
    assert summary_line(only_sub) == "1 file seen: 0 hashed, 1 unchanged, 0 removed, 0 unreadable"

    server = start()  # the scanned data directory, served: nothing left to do
    listed = server.files()
    assert {p: row["midhash"] for p, row in listed.items()} == {
        str(media / "a.mkv"): cids.midhash_bytes(b"rewritten"),
        str(media / "sub" / "b.mkv"): cids.midhash_bytes(files[media / "sub" / "b.mkv"]),
        str(media / "e.mkv"): cids.midhash_bytes(b"new"),
    }
    doc = server.meta(cids.midhash_bytes(b"new"))
    assert doc is not None and doc["filePath"] == str(media / "e.mkv")
    server.stop()
    assert summary_line(scan(data_dir, media)) == (
        "3 files seen: 0 hashed, 3 unchanged, 0 removed, 0 unreadable"
    )


def as_user() -> list[str]:
    """The wrapper that makes root meet file modes as any user does (none needed when not run
    as root): without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH. Skips the test if there is none."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("runs as root without setpriv (util-linux): chmod 000 cannot stop root")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_scan_command_reports_an_unreadable_file(tmp_path: Path) -> None:
    media, data_dir = tmp_path / "media", tmp_path / "data"
    write(media / "ok.mkv", b"readable")
    locked = write(media / "locked.mkv", b"unreadable")
    locked.chmod(0)
    try:
        done = scan(data_dir, media, prefix=as_user())
        assert summary_line(done) == (
            "2 files seen: 1 hashed, 0 unchanged, 0 removed, 1 unreadable"
        )
        assert f"unreadable: {locked}" in done.stderr
    finally:
        locked.chmod(0o644)


def midhash_at(server: WatchServer, path: Path) -> str | None:
    """The midhash /api/files lists at `path` (None: not listed)."""
    row = server.files().get(str(path))
    return None if row is None else str(row["midhash"])


def test_an_unreadable_file_is_said_once_however_many_rescans_try_it_again(
    start: Start, tmp_path: Path
) -> None:
    """An unreadable file was said at every rescan, two lines each `watch_rescan_s` (the
    warning, and a `scanned` summary as if something had changed, after waiting
    `watch_settle_s`). Each rescan still tries it (a permission fixed on a network mount sends
    no event), quietly; made readable, it is fingerprinted."""
    prefix = as_user()
    content = os.urandom(3000)
    locked = write(tmp_path / "media" / "locked.mkv", content)
    locked.chmod(0)
    # A file below no root: each full reconciliation looks at it again, which shows one ran.
    stray = write(tmp_path / "elsewhere" / "stray.mkv", b"stray")
    scan(tmp_path / "data", stray.parent, prefix=prefix)
    server = start(prefix=prefix, watch_rescan_s="0.1")
    try:
        for n in range(1, 4):
            stray.write_bytes(b"stray" * (n + 1))
            want = cids.midhash_bytes(stray.read_bytes())
            poll(lambda w=want: midhash_at(server, stray) == w or None, f"rescan {n} saw it")
        assert server.log_text().count("skipping unreadable file") == 1
        assert str(locked) not in server.files()
    finally:
        locked.chmod(0o644)
    poll(lambda: str(locked) in server.files() or None, "the file listed once readable")
    assert server.files()[str(locked)]["midhash"] == cids.midhash_bytes(content)


def test_an_unreadable_folder_leaves_every_other_folder_watched(
    start: Start, tmp_path: Path
) -> None:
    """notify stops a recursive watch at the first folder it may not read, and says nothing:
    with `lost+found` at the root of a disk and the node not run as root (the container's
    user), the folders after it in the walk were never watched, their new files unseen until a
    rescan. Two rounds of new files, the second after the first is listed: no reconciliation
    runs then, so inotify reports them."""
    media = tmp_path / "media"
    folders = [media / f"Film {i:02}" for i in range(40)]
    for folder in folders:
        folder.mkdir(parents=True)
    locked = media / "lost+found"
    locked.mkdir(mode=0)
    try:
        server = start(prefix=as_user())
        wait_for("the folder named unreadable", lambda: server.health()["watcher"]["unlisted"])
        for round in ("first", "second"):
            wanted = {str(write(f / f"{round}.mkv", os.urandom(2000))) for f in folders}
            wait_for(f"every {round} file listed", lambda w=wanted: w <= set(server.files()))
        assert server.health()["watcher"]["unlisted"] == [str(locked)]
    finally:
        locked.chmod(0o755)


def test_scan_command_survives_a_file_name_that_is_not_utf8(tmp_path: Path) -> None:
    media, data_dir = tmp_path / "media", tmp_path / "data"
    write(media / "a.mkv", b"a")
    write(media / "b.mkv", b"b")
    media.mkdir(exist_ok=True)
    with open(os.path.join(os.fsencode(media), b"caf\xe9.mkv"), "wb") as out:
        out.write(b"latin-1 name")
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "scan", str(media), "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, **NO_PLUGINS},
        cwd=tmp_path,
    )
    # today: exit 1 with a UnicodeEncodeError traceback, or SIGSEGV when the failed scan's
    # Node.stop also hits the Applier.stop bug (the applier is still applying the minted groups)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1500:]}"
    counts = summary_line(done)
    # the name left out is counted, and named whole, its byte that is not UTF-8 as \xNN
    assert counts.startswith("2 files seen: ") and counts.endswith(", 1 not UTF-8 left out")
    assert f"not UTF-8, left out (rename it): {media}/caf\\xe9.mkv" in done.stderr, done.stderr
    assert {r[0] for r in local_rows(data_dir)} == {str(media / "a.mkv"), str(media / "b.mkv")}


def test_live_watching_survives_a_file_name_that_is_not_utf8(start: Start) -> None:
    server = start(settle="0.3")
    before = write(server.media / "before.mkv", b"before")
    wait_for("the first file", lambda: str(before) in server.files())
    latin1 = os.path.join(os.fsencode(server.media), b"caf\xe9.mkv")
    inotify_warning = "inotify cannot report a change to"

    def listed(path: Path) -> Callable[[], bool]:
        return lambda: str(path) in server.files()

    for round_ in range(3):  # a download being written: each change fails watchfiles again
        with open(latin1, "ab") as out:
            out.write(b"latin-1 name")
        wait_for(
            "the watcher to fail on the non-UTF-8 name and watch again",
            lambda: (
                inotify_warning in server.log_text()
                and "ignoring a name that is not valid UTF-8" in server.log_text()
            ),
        )
        after = write(server.media / f"after-{round_}.mkv", f"after {round_}".encode())
        wait_for("a file created after the non-UTF-8 one", listed(after))
    log_text = server.log_text()
    # one warning of each kind for the name, however often it changed, and no traceback
    assert log_text.count(inotify_warning) == 1, log_text[-3000:]
    assert log_text.count("ignoring a name that is not valid UTF-8") == 1, log_text[-3000:]
    assert "Traceback" not in log_text, log_text[-3000:]
    # the whole path, so it can be found in a library of many folders; /health lists it too
    shown = f"{server.media}/caf\\xe9.mkv"
    said = f"ignoring a name that is not valid UTF-8: {shown} (rename it: docs/watcher.md)"
    assert said in server.log_messages(), log_text[-3000:]
    assert server.health()["watcher"]["not_utf8"] == {"count": 1, "paths": [shown]}


STOP_WHILE_APPLYING = """
import asyncio, sys
from pathlib import Path
from metanode import cid, config
from metanode.node import Node

async def main() -> None:
    for i in range(5):
        settings = config.load(env={}, overrides={
            "data_dir": Path(sys.argv[1]), "watch_enabled": False, "plugins_enabled": False})
        node = Node(settings)
        await node.start()
        # what a scan batch does: mint groups (the applier is woken to apply them)…
        await node.ensure_groups([cid.midhash_bytes(f"{i}-{k}".encode()) for k in range(2000)])
        await node.stop()  # …and stop right after, as `metanode scan` does

asyncio.run(main())
"""


def test_node_stop_while_the_applier_runs_does_not_crash(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    done = subprocess.run(
        [sys.executable, "-c", STOP_WHILE_APPLYING, str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "closed database" not in done.stderr, done.stderr[-2000:]


def in_a_user_namespace(watches: int) -> list[str]:
    """The wrapper that runs the server in a user namespace of its own whose inotify watch
    limit is `watches` (its own `user.max_inotify_watches`, which root may set there); skips
    the test where user namespaces cannot be made."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux): the watch limit cannot be lowered for one process")
    tried = subprocess.run(["unshare", "-U", "-r", "true"], capture_output=True, check=False)
    if tried.returncode != 0:
        pytest.skip(f"user namespaces cannot be made here: {tried.stderr.decode().strip()}")
    limit = f'echo {watches} > /proc/sys/user/max_inotify_watches && exec "$@"'
    return ["unshare", "-U", "-r", "sh", "-c", limit, "sh"]


def test_the_inotify_watch_limit_reached_is_said_in_health(start: Start, tmp_path: Path) -> None:
    """notify fails for every folder past the user's watch limit and watchfiles says nothing:
    a library of more folders than the limit (8,192 on older kernels, shared with every other
    program of the same uid, in a container the host user's) had most of them unwatched, the
    node healthy. /health says so, with the setting to raise."""
    for i in range(60):
        (tmp_path / "media" / f"Album {i:02}").mkdir(parents=True)
    server = start(prefix=in_a_user_namespace(30))
    health = wait_for(
        "the limit said", lambda: (h := server.health())["watcher"]["watches_full"] and h
    )
    assert health["status"] == "degraded"
    said = " ".join(health["problems"])
    assert "inotify watch limit is reached" in said and "fs.inotify.max_user_watches" in said
    # the namespace's own limit, not the host's, and what the folders need (the root and 60)
    assert "(the limit here: 30; the watched folders need 61, one each)" in said


def test_files_met_while_the_process_is_out_of_descriptors_are_fingerprinted_after(
    start: Start, tmp_path: Path
) -> None:
    """Connections that hold every file descriptor the process may have (feed subscribers past
    `ulimit -n`): a file added meanwhile cannot be opened. It was skipped as unreadable until it
    changed, one warning a file, so once the connections were gone it was still in no record.
    It waits instead, said once, and is fingerprinted as soon as a descriptor is free."""
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to lower the open-file limit")
    limit = 96
    server = start(prefix=["prlimit", f"--nofile={limit}", "--"])
    assert server.proc is not None
    descriptors = Path(f"/proc/{server.proc.pid}/fd")
    held: list[socket.socket] = []
    said = "cannot open files to fingerprint or watch"
    try:
        # more than the limit: a descriptor the node frees goes to the next connection waiting
        held += [socket.create_connection(("127.0.0.1", server.port)) for _ in range(limit + 32)]
        wait_for("every descriptor held", lambda: len(os.listdir(descriptors)) >= limit)
        paths = [write(tmp_path / "media" / f"song {i}.flac", os.urandom(4000)) for i in range(20)]
        wait_for("the wait said", lambda: said in server.log_text())
    finally:
        for connection in held:
            connection.close()
    rows = wait_for("every file listed", lambda: len(files := server.files()) == 20 and files)
    assert sorted(rows) == sorted(map(str, paths))
    wait_for("the wait over", lambda: server.health()["status"] == "ok")
    log_text = server.log_text()
    assert "skipping unreadable file" not in log_text
    assert log_text.count(said) == 1 and "Traceback" not in log_text
