"""Replicas: several `metanode serve` on one PostgreSQL database (docs/scale-out.md).

Any replica takes claims and serves reads; exactly one applies (the session advisory lock),
the others follow the cache it commits; their feeds carry the same ids; when the applier's
process is SIGKILLed under load, nothing acknowledged is lost and another replica takes over.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.feed import Stream, new_cid_claims
from tests.helpers.load import kill_under_load
from tests.helpers.postgres import Cluster
from tests.helpers.replicas import applier_of, health, replicas
from tests.helpers.server import Server, metanode_check, wait_caught_up
from tests.helpers.wait import poll


@pytest.fixture
def dsn(postgres: Cluster) -> Iterator[str]:
    """A fresh database of the session's cluster."""
    setting = postgres.database()
    yield setting
    postgres.drop(setting)


@pytest.fixture
def pair(tmp_path: Path, dsn: str) -> Iterator[list[Server]]:
    with replicas(tmp_path, dsn, 2) as servers:
        yield servers


def post(server: Server, claims: list[dict[str, Any]]) -> dict[str, Any]:
    """POST /api/claims; it must have been applied before the answer (read-your-writes)."""
    response = httpx.post(
        f"{server.url}/api/claims", headers=server.headers, json={"claims": claims}, timeout=60
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["applied"] is True, body
    return body


def title_of(server: Server, cid: str) -> str | None:
    doc = server.meta(cid)
    return None if doc is None else doc["metadata"].get("title")


def test_claims_posted_to_either_replica_read_back_from_the_other(pair: list[Server]) -> None:
    leader = applier_of(pair)
    follower = next(s for s in pair if s is not leader)
    signer = Signer()
    follower.register(signer.uid, "replicas")  # registered through one replica, signs on any
    for n, (to, back) in enumerate([(leader, follower), (follower, leader)] * 3):
        cid = cids.midhash_bytes(f"replicas {n}".encode())
        post(to, [signer.claim(cid, "title", f"title {n}")])
        # No wait: the answer came after the shared cache held it, and both read that cache.
        assert title_of(back, cid) == f"title {n}"
        assert back.meta(cid) == to.meta(cid)
    # A document a replica has answered is answered anew once the other one changed it: no
    # replica keeps documents in memory on PostgreSQL (`hot_documents`, on by default).
    cid = cids.midhash_bytes(b"replicas 0")
    for n, (to, back) in enumerate([(leader, follower), (follower, leader)], start=1):
        assert title_of(back, cid) is not None
        post(to, [signer.claim(cid, "title", f"retitled {n}", NOW_MS + n)])
        assert title_of(back, cid) == f"retitled {n}"
    assert applier_of(pair) is leader  # taking claims never moved the lock
    for server in pair:
        health = wait_caught_up(server.url)
        assert health["status"] == "ok", health


def test_two_replicas_feeds_give_the_same_events_with_the_same_ids(pair: list[Server]) -> None:
    signer = Signer()
    pair[0].register(signer.uid, "replicas")
    streams = [Stream(server, [("snapshot", "1")]) for server in pair]
    heads = [streamed.events(1)[0] for streamed in streams]  # the empty state's `synced`
    assert heads[0] == heads[1] and heads[0].event == "synced", heads
    epoch = heads[0].data["id"].rsplit("-", 1)[0]
    for n in range(6):  # posted alternately to each: 2 events a claim on a new CID
        post(pair[n % 2], new_cid_claims(signer, f"feed {n}", 5))
    seen = [[(f.event, f.id, f.data) for f in streamed.events(60)] for streamed in streams]
    assert seen[0] == seen[1]
    ids = [event_id for _, event_id, _ in seen[0]]
    assert ids == [f"{epoch}-{seq}" for seq in range(1, 61)]


def test_sigkill_of_the_applier_under_load_loses_nothing_and_the_other_takes_over(
    pair: list[Server], dsn: str
) -> None:
    leader = applier_of(pair)
    other = next(s for s in pair if s is not leader)
    signer = Signer()
    leader.register(signer.uid, "replicas")
    stream = Stream(other, [("snapshot", "1")])
    assert stream.events(1)[0].event == "synced"

    def make_batch(worker: int, n: int) -> list[dict[str, Any]]:
        return [
            signer.claim(cids.midhash_bytes(f"kill {worker} {n} {i}".encode()), "title", f"{n}")
            for i in range(20)
        ]

    killed = kill_under_load(leader, make_batch, posters=4, enough=10, deadline_s=60)
    assert applier_of(pair) is other
    health = wait_caught_up(other.url, timeout=90)
    assert health["status"] == "ok", health
    for batch in killed.acknowledged:  # every acknowledged claim is served by the survivor
        for claim in batch:
            assert title_of(other, claim["cid"]) == claim["value"], claim
    # Its feed went on from the events the dead applier committed, gapless, and it goes on.
    before = health["applied_seq"]
    cid = cids.midhash_bytes(b"after the takeover")
    post(other, [signer.claim(cid, "title", "after", ts=NOW_MS)])
    frames = []
    while not frames or frames[-1].data.get("value") != "after":
        frames.extend(f for f in stream.events(1) if f.event in ("set", "del"))
    seqs = [f.seq for f in frames]
    assert seqs == list(range(1, len(seqs) + 1)), "the feed skipped or repeated an id"
    assert poll(lambda: wait_caught_up(other.url)["applied_seq"] > before or None, "the apply")
    other.stop()
    metanode_check(other.data_dir, dsn)


def test_a_stopped_applier_is_taken_over_and_steps_down_when_continued(
    pair: list[Server], dsn: str
) -> None:
    """A SIGSTOPped applier keeps its session, and so the applier lock, for as long as it is
    stopped: no replica took over (none in 60 s measured), and the claims posted to the others
    were stored but never applied (202 `applied: false`). Now a follower ends a lock session
    idle for `LEAD_STALE_S` and leads; the stopped one, continued, finds its session gone and
    steps down before it applies anything."""
    leader = applier_of(pair)
    other = next(s for s in pair if s is not leader)
    signer = Signer()
    leader.register(signer.uid, "replicas")
    assert leader.proc is not None
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        poll(lambda: health(other)["applier"] or None, "the other replica to take over")
        cid = cids.midhash_bytes(b"while the applier is stopped")
        post(other, [signer.claim(cid, "title", "stopped")])  # 200, applied: read-your-writes
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    poll(lambda: health(leader)["applier"] is False or None, "the continued one to step down")
    assert applier_of(pair) is other
    assert any("its session was ended" in m for m in other.log_messages())
    assert any("another replica took the applier lock" in m for m in leader.log_messages())
    after = cids.midhash_bytes(b"after the stopped applier continued")
    post(leader, [signer.claim(after, "title", "continued")])
    assert title_of(other, after) == "continued" and title_of(leader, cid) == "stopped"
    for server in pair:  # `degraded` may linger a moment (a probe's second) on busy cores
        poll(lambda s=server: wait_caught_up(s.url)["status"] == "ok" or None, "/health ok")
    other.stop()
    leader.stop()
    metanode_check(other.data_dir, dsn)
