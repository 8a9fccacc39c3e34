"""tools/claims-migrate against a real redis-server: both meta-core layouts into a data directory.

The fixture runs the Debian package `redis-server` on a free loopback port (installing it with
apt-get if it is missing and that is possible; the tests skip, saying why, only if it is not).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

redis = pytest.importorskip("redis", reason="the redis package (extra `migrate`) is missing")

from metanode import cid as cids  # noqa: E402
from metanode import db, maintenance, truth  # noqa: E402
from metanode import rid as rids  # noqa: E402
from metanode.api import create_app  # noqa: E402
from metanode.clock import now_ms  # noqa: E402
from metanode.node import Node  # noqa: E402
from tests.helpers.postgres import Cluster, Storages  # noqa: E402
from tests.helpers.server import Server, free_port  # noqa: E402
from tests.helpers.settings import settings_for  # noqa: E402
from tools.bench.pgcluster import install  # noqa: E402
from tools.claims_migrate import plan  # noqa: E402
from tools.claims_migrate.__main__ import Options, main, migrate  # noqa: E402
from tools.claims_migrate.report import Report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "tools" / "claims-migrate"

# -- a real redis-server ------------------------------------------------------------------------


def _redis_server() -> tuple[str | None, str]:
    """The redis-server binary, installed through apt-get if missing: (path, why not)."""
    for candidate in (
        shutil.which("redis-server"),
        "/usr/bin/redis-server",
        "/usr/sbin/redis-server",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate, ""
    why = install("redis-server")
    if why:
        return None, why
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )
    return found, "" if found else "apt-get install redis-server failed"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway redis-server on a loopback port, no persistence."""
    binary, why = _redis_server()
    if binary is None:
        pytest.skip(f"no redis-server: {why}")
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--daemonize",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with redis.Redis.from_url(url, socket_connect_timeout=1) as probe:
                    probe.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start (exit {proc.poll()})")
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def connected(url: str) -> Iterator[Any]:
    with redis.Redis.from_url(url) as client:
        yield client


# -- a meta-core keyspace -----------------------------------------------------------------------


def sha256_cid(data: bytes) -> str:
    return cids.encode(cids.RAW, cids.SHA2_256, hashlib.sha256(data).digest())


def ipfs_cid(data: bytes) -> str:
    return cids.encode(cids.DAG_PB, cids.SHA2_256, hashlib.sha256(data).digest())


@dataclass
class Seeded:
    """What `seed` wrote, and what each old CID must resolve to after the migration."""

    rids: dict[str, str]  # record name → its v1.x rid
    cids: dict[str, set[str]]  # record name → every CID of its group
    docs: dict[str, dict[str, str]]  # record name → its fields after the migration
    canonical: dict[str, str]  # record name → the canonical CID

    def every_cid(self) -> Iterator[tuple[str, str]]:
        for name, members in self.cids.items():
            for cid in sorted(members):
                yield name, cid


def seed(client: Any) -> Seeded:
    """Records in the three layouts, with aliases, a conflicting `cids/*` member, a stranded
    CID-named root, deprecated, local, invalid and unreadable fields, plus noise."""
    minter = rids.Minter()
    ra, rb, rc, rg, rh = (minter.mint() for _ in range(5))
    ma, sa = cids.midhash_bytes(b"matrix"), sha256_cid(b"matrix")
    mb, ib = cids.midhash_bytes(b"inception"), ipfs_cid(b"inception")
    mc = cids.midhash_bytes(b"c-movie")
    md, sd = cids.midhash_bytes(b"old movie"), sha256_cid(b"old movie")
    me_digest = hashlib.sha256(b"hex movie").digest()
    me, se = cids.midhash_cid(me_digest), sha256_cid(b"hex movie")
    mh, sh = cids.midhash_bytes(b"h movie"), sha256_cid(b"h movie")
    poster = cids.midhash_bytes(b"poster.jpg")
    dangling = cids.midhash_bytes(b"deleted long ago")

    r = client
    r.set("meta-core:schema-version", "2")
    r.sadd(
        "file:__index__", ra, rb, rc, rg, rh, f"midhash256:{md}", f"midhash256:{me_digest.hex()}"
    )
    # A: v1.x flat, two CIDs, every kind of field that is not claimed
    a = f"file:{ra}/"
    r.mset(
        {
            a + "filePath": "/files/watch/The.Matrix.1999.mkv",
            a + "sizeByte": "734003200",
            a + "mtimeNano": "1700000000000000000",
            a + "fileSize": "734003200",
            a + "title": "The Matrix",
            a + "year": "1999",
            a + "tmdb/poster": poster,
            a + "titles/eng/The Matrix": "true",
            a + f"cids/{ma}": "true",
            a + f"cids/{sa}": "true",
            a + "canonical_cid": sa,
            a + "cid_sha256": sa,
            a + "midhash256": ma,
            a + "hashId": ra,
            a + "bad//key": "x",
            a + "genres": "Action|Sci-Fi",
            a + "blob": b"\xff\xfe\x00",
        }
    )
    r.sadd(a + "__fields__", "title", "year")
    r.sadd(a + "duplicates", "/files/watch/copy.mkv")
    r.set(f"cid:{ma}", ra)
    r.set(f"cid:{sa}", ra)
    # B: its `cids/*` names A's sha256, which the index gives to A; an index-only IPFS alias
    b = f"file:{rb}/"
    r.mset(
        {
            b + "title": "Inception",
            b + "year": "2010",
            b + f"cids/{mb}": "true",
            b + f"cids/{sa}": "true",
        }
    )
    r.set(f"cid:{mb}", rb)
    r.set(f"cid:{ib}", rb)
    # a stranded root named by B's midhash (the dual-root bug): folded into B
    r.mset({f"file:{mb}/plot": "dreams within dreams", f"file:{mb}/title": "Inception!"})
    # C: an alias in the intermediate `<algo>:<cid>` token form
    r.mset({f"file:{rc}/title": "C Movie", f"file:{rc}/cids/{mc}": "true"})
    r.set(f"cid:midhash256:{mc}", rc)
    # H: the intermediate layout: a `cids` SET of tokens, token-keyed aliases, a stored canonical
    r.mset({f"file:{rh}/title": "H Movie", f"file:{rh}/canonical_cid": f"sha256:{sh}"})
    r.sadd(f"file:{rh}/cids", f"midhash256:{mh}", f"sha256:{sh}")
    r.set(f"cid:midhash256:{mh}", rh)
    r.set(f"cid:sha256:{sh}", rh)
    # D: the older layout, one HASH per record named by a midhash token
    r.hset(
        f"file:midhash256:{md}",
        mapping={
            "title": "Old Movie",
            "year": "1987",
            "filePath": "movies/old.avi",
            "sizeByte": "1000",
            "mtime": "2019-01-01T00:00:00Z",
            "cid_sha256": sd,
            "midhash256": md,
            "poster": poster,
        },
    )
    # E: the older layout with hex digests instead of CIDs
    r.hset(
        f"file:midhash256:{me_digest.hex()}",
        mapping={"title": "Hex Movie", "cid_sha256": hashlib.sha256(b"hex movie").hexdigest()},
    )
    # G: a v1.x record with no CID at all; a dangling alias; the watcher's stream
    r.set(f"file:{rg}/title", "Nothing to claim about")
    r.set(f"cid:{dangling}", minter.mint())
    r.xadd("file:events", {"type": "add", "path": "x"})

    return Seeded(
        rids={"A": ra, "B": rb, "C": rc, "H": rh},
        cids={"A": {ma, sa}, "B": {mb, ib}, "C": {mc}, "D": {md, sd}, "E": {me, se}, "H": {mh, sh}},
        docs={
            "A": {
                "title": "The Matrix",
                "year": "1999",
                "tmdb/poster": poster,
                "titles/eng/The Matrix": "true",
                "genres": "Action|Sci-Fi",
            },
            "B": {"title": "Inception", "year": "2010", "plot": "dreams within dreams"},
            "C": {"title": "C Movie"},
            "D": {"title": "Old Movie", "year": "1987", "poster": poster},
            "E": {"title": "Hex Movie"},
            "H": {"title": "H Movie"},
        },
        canonical={"A": sa, "B": ib, "C": mc, "D": sd, "E": se, "H": sh},
    )


@pytest.fixture
def seeded(redis_url: str) -> Seeded:
    with connected(redis_url) as client:
        client.flushall()
        return seed(client)


def run(redis_url: str, data_dir: Path, **options: Any) -> Report:
    return migrate(Options(redis_url=redis_url, data_dir=data_dir, progress="never", **options))


@contextlib.asynccontextmanager
async def started(data_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process node on the data directory, with an API client."""
    the_node = Node(settings_for(data_dir))
    await the_node.start()
    try:
        await the_node.applier.wait_for(0, 10)
        transport = httpx.ASGITransport(app=create_app(the_node))
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://node",
            headers={"Authorization": f"Bearer {the_node.token}"},
        ) as client:
            yield client
    finally:
        await the_node.stop()


def fields_of(document: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in document["metadata"].items() if not k.startswith("cids/")}


def truth_state(data_dir: Path, uid: str) -> tuple[set[frozenset[str]], set[tuple[str, str, Any]]]:
    """Groups (as CID sets) and the legacy signer's claims (cid, key, value) of a truth."""
    conn = db.connect(data_dir / "truth.db", readonly=True)
    try:
        groups: dict[str, set[str]] = {}
        for cid, rid in conn.execute("SELECT cid, rid FROM cid_group"):
            groups.setdefault(rid, set()).add(cid)
        claimed = {(c.cid, c.key, c.value) for c in truth.all_claims(conn, uid)}
        return {frozenset(g) for g in groups.values()}, claimed
    finally:
        conn.close()


# -- the tests ----------------------------------------------------------------------------------


async def test_every_old_cid_resolves_to_its_fields_and_rids_are_kept(
    redis_url: str, seeded: Seeded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    assert main(["--redis", redis_url, "--data-dir", str(data), "--progress", "never"]) == 0
    printed = capsys.readouterr().out
    marker = json.loads((data / "claims-migrate.json").read_text())
    uid = marker["uid"]
    assert f"legacy signer: {uid}" in printed and f"metanode signers block {uid}" in printed
    key_file = data / marker["key_file"]
    assert key_file.name.startswith("legacy-migrate-") and key_file.suffix == ".key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

    async with started(data) as client:
        for name, cid in seeded.every_cid():
            response = await client.get(f"/api/meta/{cid}")
            assert response.status_code == 200, (name, cid, response.text)
            document = response.json()
            assert fields_of(document) == seeded.docs[name], (name, cid)
            assert set(document["cids"]) == seeded.cids[name]
            assert document["canonical_cid"] == seeded.canonical[name]
            assert "filePath" not in document  # left to the watcher's rescan
        for name, rid in seeded.rids.items():
            response = await client.get(f"/api/metadata/{rid}")
            assert response.status_code == 200, response.text
            assert response.json()["hashId"] == rid
            assert fields_of(response.json()) == seeded.docs[name]
        listed = (await client.get("/api/hash-ids", params={"limit": 100})).json()["hashIds"]
        assert set(seeded.rids.values()) <= set(listed) and len(listed) == 6
        signers = (await client.get("/api/signers")).json()["signers"]
        legacy = next(s for s in signers if s["uid"] == uid)
        assert (legacy["weight"], legacy["may_link"], legacy["status"]) == (1, True, "active")
        claims = (await client.get(f"/api/meta/{seeded.canonical['A']}/claims")).json()
        assert {c["uid"] for c in claims["claims"]} == {uid}
        assert {c["key"] for c in claims["claims"]} == {
            *seeded.docs["A"],
            f"cids/{cids.midhash_bytes(b'matrix')}",
        }

    settings = settings_for(data)
    report = maintenance.check(settings, tmp_path / "scratch.db")
    assert report.clean, report.differences + report.bad_signatures
    checked = subprocess.run(
        [sys.executable, "-m", "metanode", "check", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    again = run(redis_url, data)
    assert again.changes == 0
    assert (again.claims_signed, again.claims_accepted, again.rids_created, again.cids_joined) == (
        0,
        0,
        0,
        0,
    )
    assert again.fields_unchanged == sum(len(doc) for doc in seeded.docs.values())
    assert again.legacy_signer["uid"] == uid and not again.legacy_signer["created"]


def test_report_counts_records_fields_groups_and_conflicts(
    redis_url: str, seeded: Seeded, tmp_path: Path
) -> None:
    report = run(redis_url, tmp_path / "data")
    out = report.as_json()
    assert out["records"]["total"] == 8  # A B C D E G H + the stranded root
    assert out["records"]["layouts"] == {"flat": 6, "hash": 2}
    assert (report.rids_kept, report.rids_minted, report.rids_reused) == (4, 2, 0)
    assert report.without_cid == [seeded_rid_g(report)]
    assert report.absorbed == [
        {"record": cids.midhash_bytes(b"inception"), "into": seeded.rids["B"]}
    ]
    assert out["groups"]["total"] == 6
    assert report.cids_joined == sum(len(c) for c in seeded.cids.values())
    assert report.rids_created == 6
    claimed = sum(len(doc) for doc in seeded.docs.values())
    assert report.fields_claimed == claimed
    links = sum(len(c) - 1 for c in seeded.cids.values())
    assert report.links_accepted == links
    assert report.claims_accepted == claimed + links
    assert dict(report.dropped) == {
        "deprecated": 5 + 2 + 1 + 2,  # A: canonical_cid cid_sha256 midhash256 + 2 SETs; D; E; H
        "local": 4 + 3,  # A: filePath sizeByte mtimeNano fileSize; D: filePath sizeByte mtime
        "reserved_key": 1,  # hashId
        "invalid_key": 1,  # bad//key
        "invalid_utf8": 1,
        "index_wins": 1,  # B's cids/<A's sha256>
        "folded_conflict": 1,  # the stranded root's title: B keeps its own
        "no_cid": 1,  # G's title
    }
    total = report.fields_claimed + report.group_members + sum(report.dropped.values())
    assert total == report.fields
    sa = sha256_cid(b"matrix")
    assert report.disagreements == [
        {
            "record": seeded.rids["B"],
            "cid": sa,
            "source": "cids/*",
            "owner": seeded.rids["A"],
            "rule": "the cid: index wins",
        },
        {
            "record": cids.midhash_bytes(b"inception"),
            "cid": cids.midhash_bytes(b"inception"),
            "source": "root id",
            "owner": seeded.rids["B"],
            "rule": "the cid: index wins",
        },
    ]
    assert report.field_conflicts == [
        {"record": cids.midhash_bytes(b"inception"), "into": seeded.rids["B"], "key": "title"}
    ]
    assert report.conflicts_resolved == 3
    assert [a["reason"] for a in report.dangling_aliases] == ["no such record"]
    assert report.keyspace["schema_version"] == "2"
    assert report.keyspace["ignored_keys"] == {"stream": 1}
    assert report.changes > 0


def seeded_rid_g(report: Report) -> str:
    """G is the one v1.x record without a CID (its rid is minted in `seed`)."""
    assert len(report.without_cid) == 1
    return report.without_cid[0]


def test_dry_run_writes_nothing_and_reports_what_a_run_would_do(
    redis_url: str, seeded: Seeded, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    dry = run(redis_url, data, dry_run=True)
    assert not data.exists()
    assert dry.dry_run and dry.legacy_signer["key_file"] is None
    real = run(redis_url, data)
    for name in ("claims_accepted", "cids_joined", "rids_created", "fields_claimed", "changes"):
        assert getattr(dry, name) == getattr(real, name), name
    before = contents(data)
    again = run(redis_url, data, dry_run=True)
    assert again.changes == 0 and again.claims_accepted == 0
    assert again.legacy_signer["uid"] == real.legacy_signer["uid"]  # the key of the real run
    assert contents(data) == before


def test_a_dry_run_on_postgresql_writes_nothing_there(
    redis_url: str,
    seeded: Seeded,
    tmp_path: Path,
    postgres: Cluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dry run of a box on PostgreSQL wrote into its live database (19 claims, a signer
    `legacy-migrate-dry-run`): the scratch copy kept the `storage` setting. It works on a
    SQLite copy of the truth's rows now, and reports what a run would do."""
    data = tmp_path / "data"
    with Storages(postgres)() as dsn:
        monkeypatch.setenv("METANODE_STORAGE", dsn)
        maintenance.open_store(settings_for(data, storage=dsn))
        with maintenance.truth_store(settings_for(data, storage=dsn)) as store:
            before = (store.max_seq(), store.signers())
        dry = run(redis_url, data, dry_run=True)
        with maintenance.truth_store(settings_for(data, storage=dsn)) as store:
            assert (store.max_seq(), store.signers()) == before
        assert dry.dry_run and dry.claims_accepted > 0 and dry.changes > 0
        real = run(redis_url, data)
        assert (real.claims_accepted, real.changes) == (dry.claims_accepted, dry.changes)


def contents(data: Path) -> dict[str, bytes]:
    """Every file of `data` by name, but SQLite's `-shm`: the WAL's index in shared memory,
    which any reader of the database rebuilds (the WAL was emptied at the last close)."""
    return {
        p.name: p.read_bytes() for p in data.rglob("*") if p.is_file() and p.suffix != ".db-shm"
    }


def test_shim_report_file_and_refusal_while_the_server_runs(
    redis_url: str, seeded: Seeded, tmp_path: Path
) -> None:
    data, report_file = tmp_path / "data", tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SHIM),
            "--redis",
            redis_url,
            "--data-dir",
            str(data),
            "--legacy-weight",
            "3",
            "--report",
            str(report_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_file.read_text())
    assert report["legacy_signer"]["weight"] == 3
    assert report["fields"]["claimed"] == sum(len(doc) for doc in seeded.docs.values())
    assert report["disagreements"][0]["rule"] == "the cid: index wins"
    assert report["legacy_signer"]["uid"] in done.stdout

    server = Server(data).start()
    try:
        document = httpx.get(f"{server.url}/api/meta/{seeded.canonical['D']}", timeout=10).json()
        assert fields_of(document) == seeded.docs["D"]
        refused = subprocess.run(
            [sys.executable, str(SHIM), "--redis", redis_url, "--data-dir", str(data)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 1
        assert "in use" in refused.stderr and "Stop the server" in refused.stderr
    finally:
        server.stop()


def test_a_run_that_stopped_half_way_finishes_on_the_next(
    redis_url: str, seeded: Seeded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = run(redis_url, tmp_path / "whole")
    real_ingest = truth.ingest_txn
    calls = {"n": 0}

    def crashing(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash")
        return real_ingest(*args)

    monkeypatch.setattr(truth, "ingest_txn", crashing)
    data = tmp_path / "data"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(redis_url, data, batch=1)
    monkeypatch.setattr(truth, "ingest_txn", real_ingest)
    finished = run(redis_url, data, batch=1)
    assert finished.fields_unchanged > 0 and finished.claims_accepted > 0
    assert run(redis_url, data).changes == 0

    uid_whole, uid = whole.legacy_signer["uid"], finished.legacy_signer["uid"]
    groups_whole, claims_whole = truth_state(tmp_path / "whole", uid_whole)
    groups, claimed = truth_state(data, uid)
    assert groups == groups_whole
    assert claimed == claims_whole
    assert maintenance.check(settings_for(data), tmp_path / "scratch.db").clean


def test_a_cid_the_node_grouped_already_merges_and_the_old_rid_survives(
    redis_url: str, seeded: Seeded, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    settings = settings_for(data)
    maintenance.open_store(settings)
    ma = cids.midhash_bytes(b"matrix")
    conn = db.connect(settings.truth_path)
    try:  # the watcher saw the file before the migration: a fresh (younger) rid
        db.run_txn(conn, truth.ensure_groups_txn, [ma], rids.Minter(), now_ms())
        fresh = truth.group_of(conn, ma)
    finally:
        conn.close()
    assert fresh is not None and fresh > seeded.rids["A"]
    report = run(redis_url, data)
    assert report.groups_merged == [
        {"record": seeded.rids["A"], "lost": fresh, "into": seeded.rids["A"]}
    ]
    conn = sqlite3.connect(settings.truth_path)
    try:
        assert truth.group_of(conn, ma) == seeded.rids["A"]
        assert truth.rid_info(conn, fresh) == truth.RidInfo(fresh, "merged", seeded.rids["A"])
    finally:
        conn.close()
    assert maintenance.check(settings, tmp_path / "scratch.db").clean


def test_the_legacy_key_is_found_again_and_a_blocked_one_stops_the_run(
    redis_url: str, seeded: Seeded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    first = run(redis_url, data, legacy_weight=0)
    uid = first.legacy_signer["uid"]
    (data / "claims-migrate.json").unlink()  # as if the run had stopped before writing it
    again = run(redis_url, data)
    assert again.legacy_signer["uid"] == uid and again.legacy_signer["weight"] == 0
    assert again.changes == 0
    assert json.loads((data / "claims-migrate.json").read_text())["uid"] == uid

    conn = db.connect(data / "truth.db")
    try:
        db.run_txn(conn, truth.set_signer_status_txn, uid, "blocked", now_ms())
    finally:
        conn.close()
    assert main(["--redis", redis_url, "--data-dir", str(data)]) == 1
    assert f"the legacy signer {uid} is blocked" in capsys.readouterr().err


def test_redis_unreachable_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["--redis", url, "--data-dir", str(tmp_path / "data")]) == 1
    assert "cannot reach Redis" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_adopt_group_txn_keeps_the_rid_and_links_like_a_vote(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "data")
    maintenance.open_store(settings)
    minter = rids.Minter()
    old, never_adopted, old2 = minter.mint(), minter.mint(), minter.mint()
    a, b, c = (cids.midhash_bytes(x) for x in (b"a", b"b", b"c"))
    conn = db.connect(settings.truth_path)
    try:
        done = db.run_txn(conn, truth.adopt_group_txn, old, [a, b], now_ms())
        assert done == truth.Adopted(old, True, (a, b), ())
        seq = truth.max_seq(conn)
        assert db.run_txn(conn, truth.adopt_group_txn, old, [b, a], now_ms()) == truth.Adopted(
            old, False, (), ()
        )
        assert truth.max_seq(conn) == seq  # nothing written the second time
        # a younger rid naming a CID of an older group is merged into it
        merged = db.run_txn(conn, truth.adopt_group_txn, old2, [c, a], now_ms())
        assert merged == truth.Adopted(old, True, (c,), (old2,))
        assert set(truth.group_cids(conn, old)) == {a, b, c}
        # a merged-away rid stands for its survivor
        assert db.run_txn(conn, truth.adopt_group_txn, old2, [c], now_ms()).rid == old
        with pytest.raises(ValueError):
            db.run_txn(conn, truth.adopt_group_txn, never_adopted, [], now_ms())
        assert truth.rid_info(conn, never_adopted) is None
        # minting after an adoption stays above every rid the truth holds
        minted = db.run_txn(
            conn, truth.ensure_group, cids.midhash_bytes(b"d"), rids.Minter(), now_ms()
        )
        assert minted > max(old, old2)
    finally:
        conn.close()


# -- identifiers ---------------------------------------------------------------------------------


def test_cid_of_reads_every_spelling_meta_core_used() -> None:
    digest = hashlib.sha256(b"x").digest()
    mid = cids.midhash_cid(digest)
    raw_sha = cids.encode(cids.RAW, cids.SHA2_256, digest)
    assert plan.cid_of(mid) == mid
    assert plan.cid_of(f"midhash256:{mid}") == mid
    assert plan.cid_of(f"midhash256:{digest.hex()}") == mid
    assert plan.cid_of(digest.hex(), "sha256") == raw_sha
    assert plan.cid_of(f"sha256:{digest.hex().upper()}") == raw_sha
    v0 = "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG"
    assert plan.cid_of(v0) == cids.normalise(v0)
    assert plan.cid_of(f"ipfs:{v0}") == cids.normalise(v0)
    for junk in ("", "  ", "midhash256:", "not a cid", digest.hex(), f"md5:{digest.hex()}"):
        assert plan.cid_of(junk) is None, junk


def test_rid_of_keeps_uuid7_rids_only() -> None:
    rid = rids.Minter().mint()
    assert plan.rid_of(rid) == rid
    assert plan.rid_of(rid.lower()) == rid
    assert plan.rid_of(str(uuid.UUID(int=rids.decode(rid)))) == rid
    assert plan.rid_of("00000000-0000-4000-8000-000000000000") is None  # a UUIDv4
    assert plan.rid_of(f"midhash256:{cids.midhash_bytes(b'x')}") is None
    assert plan.rid_of(cids.midhash_bytes(b"x")) is None
