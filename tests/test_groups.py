"""Groups and merges (SPEC §2.4), the merged record (§2.5) and the feed rows the applier writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cache, truth
from metanode import cid as cids
from metanode.node import Node, check
from tests.conftest import NOW_MS, Signer
from tests.test_ingest import post, register, verdicts

A, B, C, D = (cids.midhash_bytes(f"group {n}".encode()) for n in "ABCD")


@pytest.fixture
async def linker(client: httpx.AsyncClient) -> Signer:
    signer = Signer()
    await register(client, signer, may_link=True, name="linker")
    return signer


def rid_of(node: Node, cid: str) -> str | None:
    return truth.group_of(node.truth_reader, cid)


def feed(node: Node, after: int = 0) -> list[tuple[str, str, str, str | None]]:
    rows = node.cache_reader.execute(
        "SELECT rid, op, key, value FROM feed WHERE seq > ? ORDER BY seq", (after,)).fetchall()
    return [tuple(r) for r in rows]


def feed_seq(node: Node) -> int:
    return int(node.cache_reader.execute("SELECT coalesce(max(seq), 0) FROM feed").fetchone()[0])


async def test_first_sighting_mints_one_rid(client: httpx.AsyncClient, node: Node,
                                            linker: Signer) -> None:
    await post(client, linker.claim(A, "title", "a"))
    rid = rid_of(node, A)
    assert rid is not None
    await post(client, linker.claim(A, "year", "1999"))
    assert rid_of(node, A) == rid
    assert node.truth_reader.execute("SELECT count(*) FROM rids").fetchone()[0] == 1
    listed = (await client.get("/api/hash-ids")).json()
    assert listed == {"hashIds": [rid], "next": None}
    doc = (await client.get(f"/api/metadata/{rid.lower()}")).json()
    assert doc["hashId"] == rid and doc["metadata"]["title"] == "a"


async def test_link_vote_joins_a_new_member_without_minting(
    client: httpx.AsyncClient, node: Node, linker: Signer
) -> None:
    await post(client, linker.claim(A, "title", "a"))
    await post(client, linker.claim(A, f"cids/{B}", "true"))
    assert rid_of(node, B) == rid_of(node, A)
    assert node.truth_reader.execute("SELECT count(*) FROM rids").fetchone()[0] == 1
    doc = (await client.get(f"/api/meta/{B}")).json()
    assert doc["cid"] == B and sorted(doc["cids"]) == sorted([A, B])
    assert doc["metadata"][f"cids/{A}"] == doc["metadata"][f"cids/{B}"] == "true"
    assert doc["metadata"]["title"] == "a"


async def test_merge_keeps_older_rid_and_feeds_del_then_set(
    client: httpx.AsyncClient, node: Node, linker: Signer
) -> None:
    await post(client, linker.claim(A, "title", "old group"))
    await post(client, linker.claim(B, "title", "new group", ts=NOW_MS + 1))
    await post(client, linker.claim(B, "genre", "sf"))
    older, newer = rid_of(node, A), rid_of(node, B)
    assert older is not None and newer is not None and older < newer
    mark = feed_seq(node)
    assert verdicts(await post(client, linker.claim(B, f"cids/{A}", "true"))) == ["accepted"]
    assert rid_of(node, A) == rid_of(node, B) == older
    info = truth.rid_info(node.truth_reader, newer)
    assert info is not None and (info.status, info.merged_into) == ("merged", older)
    events = feed(node, mark)
    loser_events = [e for e in events if e[0] == newer]
    assert loser_events and all(e[1] == "del" for e in loser_events)
    assert {e[2] for e in loser_events} == {"title", "genre", f"cids/{B}"}
    first_survivor = next(i for i, e in enumerate(events) if e[0] == older)
    assert all(e[0] == newer for e in events[:first_survivor])
    survivor_sets = {e[2]: e[3] for e in events if e[0] == older}
    assert survivor_sets == {"title": "new group", "genre": "sf", f"cids/{B}": "true"}
    # the loser is gone from the cache and answers 404 merged with its survivor
    assert node.cache_reader.execute(
        "SELECT count(*) FROM records WHERE rid = ?", (newer,)).fetchone()[0] == 0
    response = await client.get(f"/api/metadata/{newer}")
    assert response.status_code == 404
    assert response.json()["error"] == "merged" and response.json()["survivor"] == older
    claims = (await client.get(f"/api/metadata/{older}/claims")).json()
    assert claims["rid"] == older and {c["cid"] for c in claims["claims"]} == {A, B}


async def test_retracting_a_link_does_not_split(client: httpx.AsyncClient, node: Node,
                                                linker: Signer) -> None:
    await post(client, linker.claim(A, f"cids/{B}", "true", ts=NOW_MS))
    rid = rid_of(node, A)
    await post(client, linker.claim(A, f"cids/{B}", None, ts=NOW_MS + 1))
    assert rid_of(node, A) == rid_of(node, B) == rid
    doc = (await client.get(f"/api/meta/{A}")).json()
    assert doc["metadata"][f"cids/{B}"] == "true"  # membership comes from the group


async def test_chains_of_merges(client: httpx.AsyncClient, node: Node, linker: Signer,
                                tmp_path: Path) -> None:
    for cid in (A, B, C, D):
        await post(client, linker.claim(cid, "title", cid[-6:]))
    rids = {cid: rid_of(node, cid) for cid in (A, B, C, D)}
    await post(client, linker.claim(A, f"cids/{B}", "true"))
    await post(client, linker.claim(C, f"cids/{D}", "true"))
    await post(client, linker.claim(B, f"cids/{C}", "true"))
    oldest = min(r for r in rids.values() if r is not None)
    assert {rid_of(node, cid) for cid in (A, B, C, D)} == {oldest}
    for cid, rid in rids.items():
        info = truth.rid_info(node.truth_reader, rid or "")
        assert info is not None
        assert info.merged_into == (None if rid == oldest else oldest), cid
    live = {r[0] for r in node.cache_reader.execute("SELECT DISTINCT rid FROM records")}
    assert live == {oldest}
    assert set((await client.get(f"/api/meta/{D}")).json()["cids"]) == {A, B, C, D}
    assert_cache_is_fresh(node, tmp_path)


def assert_cache_is_fresh(node: Node, tmp_path: Path) -> None:
    """The incrementally applied cache equals a rebuild from the truth, and signatures verify."""
    report = check(node.settings, tmp_path / "scratch-cache.db")
    assert report.clean, report.differences + report.bad_signatures


async def test_weights_ties_viewer_and_blocking(client: httpx.AsyncClient, node: Node,
                                               tmp_path: Path) -> None:
    light1, light2, heavy = Signer(), Signer(), Signer()
    await register(client, light1)
    await register(client, light2)
    await register(client, heavy, weight=3)

    async def title(**params: Any) -> str | None:
        doc = (await client.get(f"/api/meta/{A}", params=params)).json()
        return doc["metadata"].get("title")

    await post(client, light1.claim(A, "title", "light", ts=NOW_MS))
    await post(client, light2.claim(A, "title", "light", ts=NOW_MS))
    await post(client, heavy.claim(A, "title", "heavy", ts=NOW_MS - 10))
    assert await title() == "heavy"  # 3 beats 1 + 1
    assert await title(**{"as": light1.uid}) == "light"  # the viewer's own vote wins for them
    await client.post(f"/api/signers/{heavy.uid}/block")
    assert await title() == "light"
    await client.post(f"/api/signers/{heavy.uid}/unblock")
    assert await title() == "heavy"
    # re-weighting recomputes: now 1 vs 2
    await register(client, heavy, weight=1)
    assert await title() == "light"
    # equal score: the value whose newest vote is newest wins
    await post(client, light2.claim(A, "title", "newest", ts=NOW_MS + 5))
    assert await title() == "newest"
    assert_cache_is_fresh(node, tmp_path)


async def test_claims_listing_filters(client: httpx.AsyncClient, linker: Signer) -> None:
    other = Signer()
    await register(client, other)
    await post(client, linker.claim(A, "title", "x"), linker.claim(A, "year", "1"),
               other.claim(A, "title", "y"))
    listing = (await client.get(f"/api/meta/{A}/claims", params={"key": "title"})).json()
    assert sorted(c["value"] for c in listing["claims"]) == ["x", "y"]
    listing = (await client.get(f"/api/meta/{A}/claims", params={"uid": other.uid})).json()
    assert [(c["key"], c["value"]) for c in listing["claims"]] == [("title", "y")]
    assert (await client.get(f"/api/meta/{B}/claims")).json()["error"] == "unknown_cid"


async def test_rid_routes_errors(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/metadata/not-a-rid")
    assert (response.status_code, response.json()["error"]) == (400, "invalid_rid")
    response = await client.get("/api/metadata/01JBVC87HBFGYSWKTTDDY8V7GF")
    assert (response.status_code, response.json()["error"]) == (404, "unknown_rid")
    response = await client.get("/api/hash-ids", params={"limit": "0"})
    assert (response.status_code, response.json()["error"]) == (400, "invalid_request")


async def test_hash_ids_pagination(client: httpx.AsyncClient, linker: Signer) -> None:
    batch = [linker.claim(cids.midhash_bytes(bytes([n])), "title", str(n)) for n in range(5)]
    await post(client, *batch)
    first = (await client.get("/api/hash-ids", params={"limit": 3})).json()
    assert len(first["hashIds"]) == 3 and first["next"] == first["hashIds"][-1]
    rest = (await client.get("/api/hash-ids", params={"limit": 3, "after": first["next"]})).json()
    assert len(rest["hashIds"]) == 2 and rest["next"] is None
    assert first["hashIds"] + rest["hashIds"] == sorted(first["hashIds"] + rest["hashIds"])


async def test_check_finds_a_tampered_cache_and_rebuild_repairs_it(
    client: httpx.AsyncClient, node: Node, linker: Signer, tmp_path: Path
) -> None:
    await post(client, linker.claim(A, "title", "truth"))
    await node.cache_writer.run(
        lambda conn: conn.execute("UPDATE records SET value = 'tampered' WHERE key = 'title'"))
    report = check(node.settings, tmp_path / "scratch.db")
    assert not report.clean
    assert any("tampered" in line for line in report.differences)
    epoch = node.applier.state.epoch
    state = await node.cache_writer.run(cache.build_txn, node.applier._source)
    assert state.epoch > epoch
    assert_cache_is_fresh(node, tmp_path)
