"""A disk too slow for what is asked of it (an SD card, a USB stick): writes wait, reads are
answered meanwhile, and /health says where the writes wait (docs/operations.md, "Small
boxes"). The wait is made real by another connection holding truth.db's write lock, which
the node's writer waits for as it would for a slow COMMIT."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import httpx

from metanode import cid as cids
from metanode.node import Node
from tests.helpers.claims import Signer, post, register
from tests.helpers.wait import DEADLINE_S


async def writes(client: httpx.AsyncClient) -> dict[str, dict[str, float]]:
    health = (await client.get("/health")).json()
    assert health["status"] == "ok", health  # slow is not failing
    return dict(health["writes"])


async def written(client: httpx.AsyncClient) -> None:
    """Wait until no write of either database is queued (the applier's poll and retention
    write now and then: idle is a moment, not a state)."""
    deadline = time.monotonic() + DEADLINE_S  # a bound on a hang, not a measurement
    while (seen := await writes(client)) != {
        name: {"queued": 0, "waiting_s": 0.0} for name in ("truth.db", "cache.db")
    }:
        assert time.monotonic() < deadline, seen
        await asyncio.sleep(0.05)


async def test_health_says_how_many_writes_wait_and_for_how_long(
    node: Node, client: httpx.AsyncClient
) -> None:
    signer = Signer()
    await register(client, signer)
    await written(client)
    cid = cids.midhash_bytes(b"a slow disk")
    blocker = sqlite3.connect(node.settings.truth_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the writer's next BEGIN waits, as for a slow COMMIT
    try:
        posting = asyncio.create_task(post(client, signer.claim(cid, "title", "x")))
        deadline = time.monotonic() + DEADLINE_S  # a bound on a hang, not a measurement
        seen = await writes(client)
        while not (seen["truth.db"]["queued"] >= 1 and seen["truth.db"]["waiting_s"] > 0):
            assert time.monotonic() < deadline and not posting.done(), seen
            await asyncio.sleep(0.05)
            seen = await writes(client)
        assert (await client.get(f"/api/meta/{cid}")).status_code == 404  # reads go on
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert (await posting).status_code == 200
    await written(client)
