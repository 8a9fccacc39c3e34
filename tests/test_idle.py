"""An idle node leaves its data directory as it is: what it does periodically when nothing
changed (retention, the watcher's rescan, a /metrics scrape, the plugins' counts) commits
nothing and touches no file, since on a Raspberry Pi's SD card every needless write is wear
(docs/operations.md, "Small boxes")."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from metanode import cid as cids
from metanode import watcher
from metanode.node import Node
from tests.helpers.claims import Signer, post, register

Files = dict[str, tuple[int, int, int]]


def files_of(data_dir: Path) -> Files:
    """Every file of the data directory with its size, mtime and ctime (ns): a write moves the
    first two, and a change to the inode alone (an fchown, a chmod) the third."""
    out = {}
    for path in sorted(data_dir.rglob("*")):
        if path.is_file():
            st = path.stat()
            out[str(path.relative_to(data_dir))] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


@contextlib.contextmanager
def versions(data_dir: Path) -> Iterator[dict[str, sqlite3.Connection]]:
    """A read connection to each database, whose `PRAGMA data_version` moves when any other
    connection commits a change."""
    conns = {
        name: sqlite3.connect(f"{(data_dir / name).as_uri()}?mode=ro", uri=True)
        for name in ("truth.db", "cache.db")
    }
    try:
        yield conns
    finally:
        for conn in conns.values():
            conn.close()


def data_versions(conns: dict[str, sqlite3.Connection]) -> dict[str, int]:
    return {name: conn.execute("PRAGMA data_version").fetchone()[0] for name, conn in conns.items()}


async def test_retention_with_nothing_to_drop_commits_nothing(
    node: Node, client: httpx.AsyncClient
) -> None:
    """The first turn after a claim drops the outbox rows the cache applied (a commit to
    truth.db); the turns after it find nothing to drop and commit nothing to either database."""
    signer = Signer()
    await register(client, signer)
    response = await post(client, signer.claim(cids.midhash_bytes(b"idle"), "title", "x"))
    assert response.status_code == 200, response.text
    data = node.settings.data_dir
    with versions(data) as conns:
        before = data_versions(conns)
        await node.retain()
        pruned = data_versions(conns)
        assert pruned["truth.db"] != before["truth.db"]
        files = files_of(data)
        for _ in range(3):
            await node.retain()
        assert data_versions(conns) == pruned
        assert files_of(data) == files


@pytest.mark.parametrize("node", [{"watch_enabled": True}], indirect=True)
async def test_rescans_scrapes_and_plugin_counts_of_an_idle_node_touch_no_file(
    node: Node, client: httpx.AsyncClient
) -> None:
    """The reads made off the event loop (a /metrics scrape's counts, `GET /api/plugins`, the
    rescan's look at files below no root) each take a read connection; one opened anew each
    time was, under root, SQLite's fchown of the WAL: an inode change, so a journal commit on
    the data directory's disk, every scrape. Once the first of each has run, the files stay as
    they are."""
    assert node.watcher is not None
    media = Path(node.settings.watch_roots[0])
    media.mkdir(exist_ok=True)
    (media / "film.mkv").write_bytes(b"an idle library" * 100)
    await node.watcher.reconcile()  # found now, whether or not inotify was watching yet
    assert len(node.cache.files("", "", 10)) == 1

    async def look() -> None:
        assert node.watcher is not None
        await node.watcher.reconcile()
        for path in ("/metrics", "/api/plugins"):
            answer = await client.get(path)
            assert answer.status_code == 200, answer.text
        await node.retain()

    await look()
    data = node.settings.data_dir
    with versions(data) as conns:  # opened first: under root, opening one changes the WAL's inode
        seen, files = data_versions(conns), files_of(data)
        for _ in range(3):
            await look()
        assert data_versions(conns) == seen
        assert files_of(data) == files


async def test_a_file_recorded_as_it_is_already_commits_nothing(node: Node, tmp_path: Path) -> None:
    """Two looks at one file (the start's reconciliation and a rescan, or a settled event a
    rescan beat) each hash it and hand the cache the same row: the second found it recorded
    and still wrote it, and the feed's state, a commit on an idle box."""
    film = tmp_path / "film.mkv"
    film.write_bytes(b"looked at twice" * 100)
    st = watcher.stat_of(str(film), follow_symlinks=False)
    assert st is not None
    row = watcher.recorded(str(film), watcher.midhash_file(film)[0], st)
    await node.ensure_groups([row.midhash])
    await node.apply_local([row], [])
    assert await node.applier.wait_for(node.truth.max_seq(), 60)  # the group's making, applied
    with versions(node.settings.data_dir) as conns:
        seen = data_versions(conns)
        await node.apply_local([row], [])
        assert data_versions(conns) == seen
        await node.apply_local([replace(row, ctime_ns=row.ctime_ns + 1)], [])  # a chmod since
        assert data_versions(conns)["cache.db"] != seen["cache.db"]
