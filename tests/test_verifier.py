"""`verifier.Verifier`: concurrent requests' claims share the pool's jobs, and each request
still gets exactly its own valid claims and its own errors, at its own indexes."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from metanode import cid as cids
from metanode import claims
from metanode.verifier import Verifier
from tests.helpers.claims import NOW_MS, Signer

SIGNER = Signer()
GOOD = [SIGNER.claim(cids.midhash_bytes(bytes([n])), "title", f"t{n}") for n in range(8)]
BAD: list[Any] = [
    {**GOOD[0], "value": "tampered"},  # bad signature
    {"cid": GOOD[0]["cid"]},  # missing fields
    "not an object",
]
REQUESTS = st.lists(st.lists(st.sampled_from(GOOD + BAD), max_size=12), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None)
@given(requests=REQUESTS, jobs=st.integers(1, 3))
def test_each_request_gets_its_own_results(requests: list[list[object]], jobs: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:

        async def run() -> list[tuple[list[claims.Claim], list[dict[str, Any]]]]:
            verifier = Verifier(pool, jobs, claims.Limits())
            return await asyncio.gather(*(verifier.validate(items, NOW_MS) for items in requests))

        results = asyncio.run(run())
    for items, (valid, errors) in zip(requests, results, strict=True):
        assert (valid, errors) == claims.validate_items(items, 0, NOW_MS)
