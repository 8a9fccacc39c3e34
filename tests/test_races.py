"""Concurrent ingest: overlapping batches that mint and merge the same groups at the same time.

Every batch is posted by several clients at once against one node; the truth must come out as if
the batches had been applied one after the other, and the cache must equal a fresh rebuild.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from metanode import db, truth
from metanode.claims import LINK_PREFIX, decode_sig
from metanode.maintenance import check as node_check
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.postgres import Cluster
from tests.helpers.replicas import replicas
from tests.helpers.server import Server, metanode_check, wait_caught_up
from tests.helpers.settings import reading

pytestmark = pytest.mark.both_backends

POOL = [cids.midhash_bytes(f"x{i}".encode()) for i in range(40)]


# -- the workload -------------------------------------------------------------------------------


def link_edges(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """A fixed sparse set of pool pairs to vote links on: several components, some singletons."""
    edges: set[tuple[str, str]] = set()
    while len(edges) < count:
        a, b = rng.sample(POOL, 2)
        edges.add((a, b))
    return sorted(edges)


def make_batches(
    signers: list[Signer], clients: int, batches: int, size: int, seed: int
) -> list[list[list[dict[str, Any]]]]:
    """`clients` lists of `batches` batches of `size` wire claims that overlap heavily.

    Half the claims are `title` claims on random pool CIDs with random timestamps (so the same
    (uid, cid, key) is raced with newer, older and equal-ts rivals); half are `cids/<member>`
    link votes drawn from one small edge set, so the same link is sent by many clients at once and
    the same groups are minted and merged concurrently.
    """
    rng = random.Random(seed)
    edges = link_edges(rng, 24)
    out: list[list[list[dict[str, Any]]]] = []
    for c in range(clients):
        mine: list[list[dict[str, Any]]] = []
        for b in range(batches):
            batch = []
            for i in range(size):
                signer = rng.choice(signers)
                if rng.random() < 0.5:
                    subject, member = rng.choice(edges)
                    batch.append(signer.claim(subject, LINK_PREFIX + member, "true"))
                else:
                    batch.append(
                        signer.claim(
                            rng.choice(POOL),
                            "title",
                            f"t-{c}-{b}-{i}",
                            ts=NOW_MS - rng.randrange(0, 5),
                        )
                    )
            mine.append(batch)
        out.append(mine)
    return out


@dataclass
class Outcome:
    """Every (batch, response body) a client got back."""

    posted: list[tuple[list[dict[str, Any]], int, dict[str, Any]]] = field(default_factory=list)

    def add(self, batch: list[dict[str, Any]], status: int, body: dict[str, Any]) -> None:
        self.posted.append((batch, status, body))


# -- what the truth must look like --------------------------------------------------------------


def components(nodes: Iterable[str], pairs: Iterable[tuple[str, str]]) -> set[frozenset[str]]:
    """Connected components (union-find) of `nodes` under the undirected edges `pairs`."""
    parent: dict[str, str] = {n: n for n in nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
    groups: dict[str, set[str]] = {}
    for n in parent:
        groups.setdefault(find(n), set()).add(n)
    return {frozenset(g) for g in groups.values()}


def sig_order(wire: dict[str, Any]) -> tuple[int, bytes]:
    """Newest-wins order (SPEC §2.3): higher ts, then the smaller raw signature."""
    raw = decode_sig(wire["sig"])
    return (-wire["ts"], raw)


def verify_outcome(outcome: Outcome, conn: db.Connection) -> None:
    """Check the truth against everything that was posted (SPEC §2.3, §2.4)."""
    claims_sent = [c for batch, _, _ in outcome.posted for c in batch]
    for batch, status, body in outcome.posted:
        assert status == 200, body
        assert body["applied"] is True, body
        assert len(body["results"]) == len(batch)

    verdicts: dict[tuple[str, str, str, str], list[str]] = {}
    for batch, _, body in outcome.posted:
        for claim, result in zip(batch, body["results"], strict=True):
            ident = (claim["uid"], claim["cid"], claim["key"], claim["sig"])
            verdicts.setdefault(ident, []).append(result["status"])

    subjects = {c["cid"] for c in claims_sent}
    links = [
        (c["cid"], c["key"][len(LINK_PREFIX) :])
        for c in claims_sent
        if c["key"].startswith(LINK_PREFIX)
    ]
    posted_cids = subjects | {m for _, m in links}

    with db.snapshot(conn):
        grouped = conn.execute("SELECT cid, rid FROM cid_group").fetchall()
        rid_rows = conn.execute("SELECT rid, status, merged_into FROM rids").fetchall()
        stored = {
            (u, c, k): (v, ts, bytes(sig))
            for u, c, k, v, ts, sig in conn.execute(
                "SELECT uid, cid, key, value, ts, sig FROM claims"
            )
        }

    # Every CID of every claim is in exactly one group, and nothing else is.
    group_cids = [cid for cid, _ in grouped]
    assert len(group_cids) == len(set(group_cids))
    assert set(group_cids) == posted_cids

    # rids: distinct, every group points at an active rid, every active rid holds a CID,
    # every merged rid names an active, older survivor.
    assert len({r for r, _, _ in rid_rows}) == len(rid_rows)
    status = {r: s for r, s, _ in rid_rows}
    assert set(status.values()) <= {"active", "merged"}
    active = {r for r, s in status.items() if s == "active"}
    for cid, rid in grouped:
        assert status.get(rid) == "active", f"{cid} points at {rid} ({status.get(rid)})"
    assert active == {rid for _, rid in grouped}, "an active rid holds no CID"
    for rid, state, into in rid_rows:
        if state == "merged":
            assert into in active, f"{rid} merged into {into}, which is not active"
            assert into < rid, f"{rid} merged into the younger {into}"
        else:
            assert into is None
    # A rid is minted only for a first-seen CID: never more rids than CIDs.
    assert len(rid_rows) <= len(posted_cids)
    # The workload did race merges (else this test would prove little).
    assert len(rid_rows) > len(active), "no group was ever merged"

    # The groups are exactly the connected components of the link votes.
    members: dict[str, set[str]] = {}
    for cid, rid in grouped:
        members.setdefault(rid, set()).add(cid)
    assert {frozenset(m) for m in members.values()} == components(posted_cids, links)

    # Newest wins per (uid, cid, key), whatever order the racing batches committed in; the
    # winner was answered `accepted` and each copy of a link vote exactly once so.
    by_key: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in claims_sent:
        by_key.setdefault((c["uid"], c["cid"], c["key"]), []).append(c)
    assert set(stored) == set(by_key)
    for ident, rivals in by_key.items():
        winner = min(rivals, key=sig_order)
        assert stored[ident] == (winner["value"], winner["ts"], decode_sig(winner["sig"])), ident
        assert "accepted" in verdicts[(*ident, winner["sig"])]
    for (_, _, key, _), seen in verdicts.items():
        if key.startswith(LINK_PREFIX):
            assert seen.count("accepted") == 1, seen
            assert set(seen) <= {"accepted", "duplicate"}, seen


# -- against a real server ----------------------------------------------------------------------


@pytest.fixture
def isolated_server(tmp_path: Path, storage: str) -> Iterator[Server]:
    """A real server whose watcher watches an empty folder of its own (not ./media of the cwd),
    its stores on this test's backend."""
    env = {"METANODE_WATCH_ROOTS": str(tmp_path / "media"), "METANODE_STORAGE": storage}
    srv = Server(tmp_path / "data", env=env)
    try:
        yield srv.start()
    finally:
        srv.stop()


def race_on(servers: list[Server]) -> None:
    """8 clients race overlapping batches, client i posting to server i mod len(servers) (all
    on one truth); the truth must come out as if the batches were applied one by one."""
    signers = [Signer(), Signer()]
    for n, signer in enumerate(signers):
        response = httpx.post(
            f"{servers[0].url}/api/signers",
            headers=servers[0].headers,
            timeout=10,
            json={"uid": signer.uid, "name": f"s{n}", "may_link": True},
        )
        assert response.status_code == 200, response.text
    work = make_batches(signers, clients=8, batches=15, size=20, seed=1)
    outcome = Outcome()
    lock = threading.Lock()
    start = threading.Barrier(len(work))
    failures: list[BaseException] = []

    def client(batches: list[list[dict[str, Any]]], server: Server) -> None:
        try:
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as http:
                start.wait(timeout=10)
                for batch in batches:
                    response = http.post("/api/claims", json={"claims": batch})
                    with lock:
                        outcome.add(batch, response.status_code, response.json())
        except BaseException as exc:
            failures.append(exc)

    threads = [
        threading.Thread(target=client, args=(b, servers[n % len(servers)]))
        for n, b in enumerate(work)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, failures
    assert len(outcome.posted) == 8 * 15
    first = servers[0]
    with reading(first.data_dir, "truth", first.env.get("METANODE_STORAGE", "sqlite")) as conn:
        verify_outcome(outcome, conn)


def test_concurrent_clients_on_a_real_server(isolated_server: Server, storage: str) -> None:
    server = isolated_server
    race_on([server])
    health = wait_caught_up(server.url)
    assert health["status"] == "ok", health
    with (
        reading(server.data_dir, "cache", storage) as cache,
        reading(server.data_dir, "truth", storage) as truth_conn,
    ):
        applied = dict(cache.execute("SELECT name, value FROM state"))["applied_seq"]
        assert applied == truth.max_seq(truth_conn)
        assert dict(cache.execute("SELECT cid, rid FROM cid_index")) == dict(
            truth_conn.execute("SELECT cid, rid FROM cid_group")
        )
    metanode_check(server.data_dir, storage)

    # And what the API serves agrees with the groups: each CID's document lists its group.
    with reading(server.data_dir, "truth", storage) as conn:
        groups = dict(conn.execute("SELECT cid, rid FROM cid_group"))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for cid in POOL[:10]:
            if cid not in groups:
                continue
            doc = http.get(f"/api/meta/{cid}").json()
            assert set(doc["cids"]) == {c for c, r in groups.items() if r == groups[cid]}


# -- in process ---------------------------------------------------------------------------------


async def test_concurrent_posts_in_process(
    client: httpx.AsyncClient, node: Node, tmp_path: Path
) -> None:
    signers = [Signer(), Signer()]
    for signer in signers:
        response = await client.post("/api/signers", json={"uid": signer.uid, "may_link": True})
        assert response.status_code == 200, response.text
    work = make_batches(signers, clients=8, batches=5, size=10, seed=2)
    outcome = Outcome()

    async def post_all(batches: list[list[dict[str, Any]]]) -> None:
        for batch in batches:
            response = await client.post("/api/claims", json={"claims": batch})
            outcome.add(batch, response.status_code, response.json())

    await asyncio.gather(*(post_all(b) for b in work))
    assert len(outcome.posted) == 8 * 5
    verify_outcome(outcome, node.truth.conn)

    assert await node.applier.wait_for(node.truth.max_seq(), 10)
    report = node_check(node.settings, tmp_path / "scratch-cache.db")
    assert report.clean, report.differences + report.bad_signatures
    assert report.claims_checked == len(
        {(c["uid"], c["cid"], c["key"]) for batch, _, _ in outcome.posted for c in batch}
    )


def test_concurrent_clients_on_two_replicas(tmp_path: Path, postgres: Cluster) -> None:
    """The 8-writer race with the writers split over two `serve` processes on one PostgreSQL
    database: still one rid per CID, and both replicas serve the same groups."""
    dsn = postgres.database()
    try:
        with replicas(tmp_path, dsn, 2) as pair:
            race_on(pair)
            health = [wait_caught_up(server.url) for server in pair]
            assert {h["applied_seq"] for h in health} == {health[0]["truth_seq"]}
            with reading(pair[0].data_dir, "truth", dsn) as conn:
                groups = dict(conn.execute("SELECT cid, rid FROM cid_group"))
            for cid in POOL[:10]:
                if cid in groups:
                    assert pair[0].meta(cid) == pair[1].meta(cid)
            for server in pair:
                server.stop()
            metanode_check(pair[0].data_dir, dsn)
    finally:
        postgres.drop(dsn)
