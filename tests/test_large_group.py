"""A write into a large group (docs/benchmarks.md, "A write into a large group"): a claim on one
CID of a group of many writes as many cache rows as one into a group of one CID (its group's
document is stored once, `group_document`, not under each CID), and what it writes is what a
rebuild makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from metanode import cid as cids
from metanode.maintenance import check
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer, fast_claims, post, register

LARGE = 60


async def changed_rows(node: Node, client: httpx.AsyncClient, claim: dict[str, Any]) -> int:
    """The cache rows (inserted, updated or deleted, triggers' too) that applying `claim`
    changed: the cache writer's connection's `total_changes` before and after its answer,
    which comes once the claim is applied."""
    before = await node.cache.writer.run(lambda conn: conn.total_changes)
    response = await post(client, claim)
    assert response.status_code == 200, response.text
    return await node.cache.writer.run(lambda conn: conn.total_changes) - before  # type: ignore[no-any-return]


async def test_a_claim_into_a_large_group_changes_the_rows_one_into_a_small_group_does(
    node: Node, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    writer = Signer()
    await register(client, writer, may_link=True)
    small = cids.midhash_bytes(b"a group of one")
    large = [cids.midhash_bytes(f"a large group {n}".encode()) for n in range(LARGE)]
    links = [(large[0], f"cids/{cid}", "true", NOW_MS) for cid in large[1:]]
    assert (await post(client, *fast_claims(writer, links))).status_code == 200
    for cid in (small, large[-1]):  # each record gets its title, so the next claim changes it
        assert (await post(client, writer.claim(cid, "title", "first"))).status_code == 200

    into_small = await changed_rows(node, client, writer.claim(small, "title", "next", NOW_MS + 1))
    into_large = await changed_rows(
        node, client, writer.claim(large[-1], "title", "next", NOW_MS + 1)
    )

    assert into_large == into_small
    for cid in (large[0], large[LARGE // 2]):
        assert (await client.get(f"/api/meta/{cid}")).json()["metadata"]["title"] == "next"
    report = check(node.settings, tmp_path / "fresh.db")
    assert report.clean, report.differences
