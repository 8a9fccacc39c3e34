"""Peers over a bad link (docs/peers.md, "Over a slow or breaking link"): real `metanode serve`
processes following each other through `FaultProxy`, which throttles, cuts, stalls and
partitions what passes. Every wait is on a condition (what a box holds, what it says of its
peer); the only clocks are the nodes' own `peer_timeout_s` and back-off."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from metanode import cid as cids
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.peering import follow, peer_row, peer_token, post_claims, stored_sigs
from tests.helpers.server import Server
from tests.helpers.wait import poll

# A page of 1,000 claims is ≈ 270 KB: over a 40 KB/s link it takes ≈ 7 s, well past 2 s.
ENV = {
    "METANODE_PEER_POLL_S": "0.2",
    "METANODE_PEER_RETRY_S": "0.2",
    "METANODE_PEER_MAX_BACKOFF_S": "1",
    "METANODE_PEER_TIMEOUT_S": "2",
    "METANODE_WATCH_ENABLED": "false",
}
SLOW_S = 240.0  # a bound on a hang over a throttled link, not a measurement


@pytest.fixture
def boxes(tmp_path: Path) -> Iterator[Callable[[str], Server]]:
    """Real servers made on demand by name, each with a signer of its own registered."""
    made: list[Server] = []

    def box(name: str) -> Server:
        (tmp_path / name).mkdir()
        server = Server(tmp_path / name / "data", env=dict(ENV)).start()
        made.append(server)
        return server

    yield box
    for server in made:
        server.stop()
        server.print_log()


def claims_of(server: Server, tag: str, count: int) -> list[dict[str, object]]:
    """`count` title claims by a signer registered on `server`, stored there."""
    signer = Signer()
    server.register(signer.uid, tag)
    made = fast_claims(
        signer,
        [(cids.midhash_bytes(f"{tag} {i}".encode()), "title", tag, NOW_MS) for i in range(count)],
    )
    post_claims(server, made)
    return made


def holds_all_of(follower: Server, followed: Server) -> bool:
    return set(stored_sigs(follower)) >= set(stored_sigs(followed))


def test_a_backlog_over_a_link_slower_than_a_page_per_timeout_gets_through(
    boxes: Callable[[str], Server],
) -> None:
    """At 40 KB/s no page of 1,000 claims comes within the 2 s `peer_timeout_s`: each was given
    up and asked again whole, for ever (20,000 claims at 5 KB/s: 586 KB read in 100 s, none
    stored). Halved at each answer that does not come whole, a page comes; every claim arrives,
    once, and `GET /api/peers` says how much is asked at once."""
    a, b = boxes("a"), boxes("b")
    claims_of(a, "backlog", 3000)
    with FaultProxy(a.port) as link:
        link.faults.down_bps = 40_000
        follow(b, link.url, peer_token(a, "b"), "a")
        poll(lambda: peer_row(b, "a")["page"] < 1000 or None, "the page to be made smaller")
        poll(lambda: holds_all_of(b, a) or None, "every claim over the slow link", SLOW_S)
    row = peer_row(b, "a")
    assert (row["accepted"], row["duplicate"]) == (3000, 0), row


def test_connections_cut_mid_answer_cost_pages_not_claims(
    boxes: Callable[[str], Server],
) -> None:
    """A link that cuts every connection after 60 KB (≈ 220 claims) never carried a page of
    1,000, nor a reconciliation fetch of 1,000; smaller ones come. No claim is stored twice
    or skipped: a cut page is not applied at all (`duplicate` 0)."""
    a, b = boxes("a"), boxes("b")
    claims_of(a, "cut", 2000)
    claims_of(b, "own", 1)  # B holds a claim: its first sync reconciles and fetches
    with FaultProxy(a.port) as link:
        link.faults.cut_after = 60_000
        follow(b, link.url, peer_token(a, "b"), "a")
        poll(lambda: holds_all_of(b, a) or None, "every claim over the breaking link", SLOW_S)
        row = peer_row(b, "a")
        assert link.counts.cuts > 0
    assert (row["accepted"], row["duplicate"]) == (2000, 0), row
    assert row["last_sync"]["fetched"] == 2000, row
