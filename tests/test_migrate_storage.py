"""`metanode migrate-storage` (a SQLite box copied to PostgreSQL) and `metanode backup` on
PostgreSQL (pg_dump, restored with pg_restore): docs/scale-out.md."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from metanode.claims import LINK_PREFIX
from tests.helpers.claims import Signer
from tests.helpers.postgres import Cluster
from tests.helpers.server import Server, metanode_check
from tests.helpers.settings import reading
from tests.helpers.wait import poll

FILES = {"Movies/Alien (1979).mkv": b"alien " * 5000, "Music/song.flac": b"flac " * 3000}


@pytest.fixture
def dsn(postgres: Cluster) -> Iterator[str]:
    setting = postgres.database()
    yield setting
    postgres.drop(setting)


def metanode(
    *args: str, data_dir: Path, storage: str = "sqlite"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metanode", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "METANODE_STORAGE": storage},
    )


def post(server: Server, path: str, body: dict[str, Any]) -> None:
    response = httpx.post(f"{server.url}{path}", headers=server.headers, json=body, timeout=60)
    assert response.status_code == 200, response.text


def populate(server: Server) -> list[str]:
    """Claims, a merge (a link vote joining two groups: one rid survives, one is merged), a
    blocked signer, local files; the CIDs whose documents the test compares."""
    for name, content in FILES.items():
        (server.media / name).parent.mkdir(parents=True, exist_ok=True)
        (server.media / name).write_bytes(content)
    files = [cids.midhash_bytes(content) for content in FILES.values()]
    linker, other = Signer(), Signer()
    post(
        server, "/api/signers", {"uid": linker.uid, "name": "linker", "may_link": True, "weight": 7}
    )
    post(server, "/api/signers", {"uid": other.uid, "name": "other"})
    a, b, c = (cids.midhash_bytes(f"migrate {n}".encode()) for n in range(3))
    post(
        server,
        "/api/claims",
        {"claims": [linker.claim(a, "title", "A"), linker.claim(b, "year", "1979")]},
    )
    post(server, "/api/claims", {"claims": [linker.claim(a, LINK_PREFIX + b, "true")]})
    post(
        server,
        "/api/claims",
        {"claims": [other.claim(c, "title", "C"), linker.claim(files[0], "title", "Alien")]},
    )
    post(server, f"/api/signers/{other.uid}/block", {})
    for midhash in files:  # the watcher recorded both files
        poll(lambda m=midhash: (server.meta(m) or {}).get("filePath"), f"the file {midhash}")
    return [a, b, c, *files]


def groups(data: Path, storage: str) -> tuple[set[Any], set[Any]]:
    """The truth's rids (with status and survivor) and CID groups."""
    with reading(data, "truth", storage) as conn:
        rids = set(conn.execute("SELECT rid, status, merged_into FROM rids").fetchall())
        grouped = set(conn.execute("SELECT cid, rid FROM cid_group").fetchall())
    assert any(status == "merged" for _, status, _ in rids)
    return rids, grouped


def test_a_migrated_sqlite_box_serves_identical_documents(tmp_path: Path, dsn: str) -> None:
    data = tmp_path / "data"
    box = Server(data).start()
    try:
        wanted = populate(box)
        before = {cid: box.meta(cid) for cid in wanted}
    finally:
        box.stop()
    assert set(before[wanted[0]]["cids"]) == set(wanted[:2]), "the link did not merge"

    done = metanode("migrate-storage", "--to", dsn, data_dir=data)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "copied truth.claim_rows: 5 rows" in done.stdout and "clean" in done.stdout, done.stdout
    assert "copied cache.local_file: 2 rows" in done.stdout, done.stdout

    moved = Server(data, env={"METANODE_STORAGE": dsn}).start()
    try:
        after = {cid: moved.meta(cid) for cid in wanted}
        signers = httpx.get(f"{moved.url}/api/signers", headers=moved.headers, timeout=10)
    finally:
        moved.stop()
    assert after == before
    assert groups(data, dsn) == groups(data, "sqlite")  # the same rids, merged ones too
    statuses = {s["name"]: (s["weight"], s["status"]) for s in signers.json()["signers"]}
    assert statuses["linker"] == (7, "active") and statuses["other"][1] == "blocked"
    metanode_check(data, dsn)

    # A second migration into the same, now populated, database is refused, writing nothing.
    again = metanode("migrate-storage", "--to", dsn, data_dir=data)
    assert again.returncode != 0 and "target_not_empty" in again.stderr, again.stderr


def test_backup_on_postgresql_is_a_pg_dump_that_restores(
    tmp_path: Path, dsn: str, postgres: Cluster
) -> None:
    data = tmp_path / "data"
    box = Server(data, env={"METANODE_STORAGE": dsn}).start()
    try:
        signer = Signer()
        post(box, "/api/signers", {"uid": signer.uid, "name": "s"})
        cid = cids.midhash_bytes(b"backed up")
        post(box, "/api/claims", {"claims": [signer.claim(cid, "title", "kept")]})
        before = box.meta(cid)
        log = httpx.get(f"{box.url}/api/claims/log", headers=box.headers, timeout=10).json()
        old_epoch = httpx.get(f"{box.url}/health", timeout=10).json()["epoch"]
        done = metanode("backup", str(tmp_path / "bk"), data_dir=data, storage=dsn)
    finally:
        box.stop()
    assert done.returncode == 0, done.stderr
    dump = Path(done.stdout.strip())
    assert dump.suffix == ".pgdump" and dump.stat().st_mode & 0o077 == 0
    assert any((tmp_path / "bk").glob("keys-*/owner.key"))

    restored = postgres.database()
    try:
        subprocess.run(
            ["pg_restore", "--no-owner", "--dbname", restored, str(dump)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        metanode_check(data, restored)
        renewed = metanode("init", "--new-log", data_dir=data, storage=restored)
        assert renewed.returncode == 0, renewed.stderr  # followers reconcile, never skip
        again = Server(data, env={"METANODE_STORAGE": restored}).start()
        try:
            assert again.meta(cid) == before
            new = httpx.get(f"{again.url}/api/claims/log", headers=again.headers, timeout=10)
            old_id, new_id = log["next"].split(".")[0], new.json()["next"].split(".")[0]
            assert new_id != old_id and f"claim log: {new_id} " in renewed.stdout
            # the feed too: its ids after the backup's end would be given again to other
            # events, and a reader holding one skipped them (the restored cache kept its epoch)
            new_epoch = httpx.get(f"{again.url}/health", timeout=10).json()["epoch"]
            assert new_epoch > old_epoch and f"feed epoch {new_epoch} " in renewed.stdout
        finally:
            again.stop()
    finally:
        postgres.drop(restored)


def test_backup_without_pg_dump_is_refused_naming_it(tmp_path: Path, dsn: str) -> None:
    data = tmp_path / "data"
    assert metanode("init", data_dir=data, storage=dsn).returncode == 0
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "backup", str(tmp_path / "bk"), "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "METANODE_STORAGE": dsn, "PATH": str(tmp_path / "empty")},
    )
    assert done.returncode != 0
    assert "error: tool_missing: backup on PostgreSQL runs `pg_dump" in done.stderr, done.stderr
    assert not list((tmp_path / "bk").glob("truth-*")), "a half backup was left behind"
