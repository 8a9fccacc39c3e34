"""The rendered documents (cache schema 6): `GET /api/meta/{cid}` answers the bytes the cache
stored when it wrote the record, and they are the bytes its document renders to, for every CID
of a group, through joins, merges, local files and their removal, also when the hot ones are
kept in memory (`hot_documents`: never an old one after a write); `?as=` still answers the
viewer's own view; `check` compares them; the migration renders an older cache's records."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from metanode import applier, cache, db, merge
from metanode import cid as cids
from metanode.applier import PUBLISHED_NAME, PublishedCount
from metanode.maintenance import check
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer, post, register
from tests.helpers.peering import post_claims
from tests.helpers.server import Server

A, B, C = (cids.midhash_bytes(f"rendered {n}".encode()) for n in "ABC")


pytestmark = pytest.mark.both_backends


@pytest.fixture
async def linker(client: httpx.AsyncClient) -> Signer:
    signer = Signer()
    await register(client, signer, may_link=True, name="linker")
    return signer


async def assert_served_as_rendered(client: httpx.AsyncClient, node: Node) -> None:
    """Every CID the cache indexes (and its alias spelling, where it has one) is answered the
    stored document with the asked CID spliced in: exactly the bytes of `node.meta`'s document."""
    every = [r[0] for r in node.cache.conn.execute("SELECT cid FROM cid_index")]
    assert every
    for cid in every:
        for spelling in filter(None, (cid, cids.alias(cid))):
            response = await client.get(f"/api/meta/{spelling}")
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/json"
            assert response.content == cache.render(node.meta(spelling))
            assert response.json()["cid"] == cids.normalise(spelling)


@pytest.mark.parametrize(
    "node",
    [{"hot_documents": 0}, {"hot_documents": 64}],
    ids=["from cache.db", "hot in memory"],
    indirect=True,
)
async def test_every_cid_is_answered_its_rendered_document_through_joins_merges_and_files(
    client: httpx.AsyncClient, node: Node, linker: Signer
) -> None:
    await post(client, linker.claim(A, "title", "Ünïcode “quoted” \\ title"))
    await post(client, linker.claim(B, "title", "b"), linker.claim(C, "year", "1999"))
    await assert_served_as_rendered(client, node)
    await post(client, linker.claim(A, f"cids/{B}", "true"))  # B's group joins A's
    await assert_served_as_rendered(client, node)
    await node.ensure_groups([C])
    await node.apply_local([merge.LocalFile("/media/c.mkv", C, 7, 1, 1)], [])
    doc = (await client.get(f"/api/meta/{C}")).json()
    assert doc["paths"] == ["/media/c.mkv"] and doc["filePath"] == "/media/c.mkv"
    await post(client, linker.claim(C, f"cids/{A}", "true"))  # merges the two groups
    await assert_served_as_rendered(client, node)
    await post(client, linker.claim(B, "year", "2001"))  # a claimed key only: not regrouped
    assert (await client.get(f"/api/meta/{A}")).json()["paths"] == ["/media/c.mkv"]
    await assert_served_as_rendered(client, node)
    await node.apply_local([], ["/media/c.mkv"])
    assert (await client.get(f"/api/meta/{A}")).json()["paths"] == []
    await assert_served_as_rendered(client, node)
    for n in range(3):  # each read after a write is the new document, never the one read before
        await post(client, linker.claim(B, "title", f"b{n}", NOW_MS + 1 + n))
        assert (await client.get(f"/api/meta/{B}")).json()["metadata"]["title"] == f"b{n}"
    unknown = cids.midhash_bytes(b"never claimed")
    response = await client.get(f"/api/meta/{unknown}")
    assert (response.status_code, response.json()["error"]) == (404, "unknown_cid")


async def test_a_viewer_is_answered_its_own_view_not_the_stored_one(
    client: httpx.AsyncClient, node: Node
) -> None:
    light, heavy = Signer(), Signer()
    await register(client, light)
    await register(client, heavy, weight=3)
    await post(client, light.claim(A, "title", "light's"), heavy.claim(A, "title", "heavy's"))
    assert (await client.get(f"/api/meta/{A}")).json()["metadata"]["title"] == "heavy's"
    seen = await client.get(f"/api/meta/{A}", params={"as": light.uid})
    assert seen.json()["metadata"]["title"] == "light's"
    assert seen.json() == node.meta(A, light.uid)


async def test_check_finds_a_tampered_document(
    client: httpx.AsyncClient, node: Node, linker: Signer, tmp_path: Path
) -> None:
    await post(client, linker.claim(A, "title", "truth"))
    assert check(node.settings, tmp_path / "fresh.db").clean
    await node.cache.writer.run(
        lambda conn: conn.execute("UPDATE group_document SET body = ?", (b"{}",))
    )
    report = check(node.settings, tmp_path / "scratch.db")
    assert not report.clean
    assert any(line.startswith("documents: ") for line in report.differences)


def test_an_older_cache_gets_its_documents_from_the_migration(tmp_path: Path) -> None:
    """Cache schema 7 renders the records a cache from before v6 holds, so an upgraded node answers
    them without a rebuild."""
    rid = "01M8T1AD8YE3198EENNAK7KT12"
    conn = db.connect(tmp_path / "cache.db")
    try:
        db.migrate(conn, cache.MIGRATIONS[:5])
        conn.executescript(
            f"INSERT INTO records VALUES ('{rid}', 'title', 'Old Lamp'),"
            f"('{rid}', 'filePath', '/m/old.lamp.mkv');"
            f"INSERT INTO cid_index VALUES ('{A}', '{rid}'), ('{B}', '{rid}');"
            f"INSERT INTO local_file VALUES ('/m/old.lamp.mkv', '{A}', 1, 1, 1);"
        )
        assert db.migrate(conn, cache.MIGRATIONS) == len(cache.MIGRATIONS)
        group = cache.group_by_cid(conn, B)
        assert group is not None
        for cid in (A, B):
            rest = cache.rendered(conn, cid)
            assert rest is not None
            assert cache.splice(cid, rest) == cache.render(cache.document(group, cid))
    finally:
        conn.close()


def test_the_v7_migration_moves_each_stored_document_into_its_index_row(tmp_path: Path) -> None:
    """A v6 cache's rendered bodies are carried over as they are (not rendered again), each in
    its CID's `cid_index` row, and the `documents` table is gone."""
    rid = "01M8T1AD8YE3198EENNAK7KT12"
    conn = db.connect(tmp_path / "cache.db")
    try:
        db.migrate(conn, cache.MIGRATIONS[:6])
        conn.executescript(
            f"INSERT INTO records VALUES ('{rid}', 'title', 'Kept');"
            f"INSERT INTO cid_index VALUES ('{A}', '{rid}'), ('{B}', '{rid}');"
            f"INSERT INTO documents VALUES ('{A}', X'7B2261227D'), ('{B}', X'7B2262227D');"
        )
        assert db.migrate(conn, cache.MIGRATIONS[:7]) == 7
        bodies = dict(conn.execute("SELECT cid, body FROM cid_index"))
        assert bodies == {A: b'{"a"}', B: b'{"b"}'}
        assert cache.lookup(conn, B) == rid
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        assert "documents" not in tables
    finally:
        conn.close()


def test_the_v15_migration_keeps_one_document_a_group(tmp_path: Path) -> None:
    """A v14 cache's documents, one a CID, become one a group (its first row's, carried over
    as it is): every CID of the group is answered it, and `cid_index` keeps no body."""
    rid, other = "01M8T1AD8YE3198EENNAK7KT12", "01M8T1AD8YE3198EENNAK7KT13"
    conn = db.connect(tmp_path / "cache.db")
    try:
        db.migrate(conn, cache.MIGRATIONS[:14])
        conn.executescript(
            f"INSERT INTO cid_index (cid, rid, body) VALUES ('{A}', '{rid}', X'7B2261227D'),"
            f"('{B}', '{rid}', X'7B2261227D'), ('{C}', '{other}', X'7B2263227D');"
        )
        assert db.migrate(conn, cache.MIGRATIONS) == len(cache.MIGRATIONS)
        assert [cache.rendered(conn, cid) for cid in (A, B, C)] == [b'{"a"}', b'{"a"}', b'{"c"}']
        assert conn.execute("SELECT count(*) FROM group_document").fetchone()[0] == 2
        columns = {r[1] for r in conn.execute("PRAGMA table_info(cid_index)")}
        assert "body" not in columns
    finally:
        conn.close()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(JSON_VALUES)
def test_a_document_renders_to_the_bytes_starlette_answers(value: object) -> None:
    """`cache.render` (one encoder made once) gives exactly `JSONResponse`'s body: the stored
    documents are answered as they are, so they must be what the route used to render, text
    with any character, quotes and control characters included."""
    assert cache.render(value) == JSONResponse(value).body


def test_the_published_count_is_shared_and_only_counts_up(tmp_path: Path) -> None:
    """`PublishedCount`: what the owner's bump writes, a reader's map of the same file reads
    at once; a count opened again (a restarted owner) goes on from what the file holds, so a
    reader never sees a value again that it saw before its documents went old."""
    path = tmp_path / PUBLISHED_NAME
    owner, reader = PublishedCount(path), PublishedCount(path)
    assert reader.read() == 0
    seen = []
    for _ in range(3):
        owner.bump()
        seen.append(reader.read())
    restarted = PublishedCount(path)
    restarted.bump()
    seen.append(reader.read())
    assert seen == [1, 2, 3, 4]
    assert path.stat().st_mode & 0o777 == 0o600


def test_hot_documents_of_a_large_group_stay_within_their_bytes(tmp_path: Path) -> None:
    """A group's document lists every CID of it twice (`cids`, `cids/…` keys): one of 600 CIDs
    is ≈ 80 KB, and the hot documents are kept by the CID as asked, so reading each CID of the
    group once kept 600 copies, ≈ 50 MB, where `hot_documents` was said to cost ≈ 10 MiB
    (groups merged by peers' link votes reached 523 CIDs in the peers soak, benchmarks.md). At
    most `applier.HOT_BYTES` are kept, whatever the documents' sizes."""
    members = [cids.midhash_bytes(f"large group {n}".encode()) for n in range(600)]
    linker = Signer()
    server = Server(tmp_path / "data").start()
    try:
        server.register(linker.uid, "linker", may_link=True)
        post_claims(server, [linker.claim(members[0], f"cids/{m}", "true") for m in members[1:]])
        with httpx.Client(base_url=server.url, timeout=60) as http:
            first = http.get(f"/api/meta/{members[0]}")
            assert len(first.content) > 70_000, len(first.content)
            before = server.rss_mib()
            for member in members:
                assert http.get(f"/api/meta/{member}").status_code == 200
            grown = server.rss_mib() - before
    finally:
        server.stop()
    assert grown < 2 * applier.HOT_BYTES / 2**20, f"{grown:.0f} MiB more resident"
