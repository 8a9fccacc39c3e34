"""Groups and merges (SPEC §2.4), the merged record (§2.5) and the feed rows the applier writes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metanode import cache, merge, truth
from metanode import cid as cids
from metanode import claims as claims_mod
from metanode import rid as rids
from metanode.claims import Claim
from metanode.db import Connection
from metanode.errors import NotCommitted
from metanode.maintenance import check, open_store
from metanode.node import Node
from metanode.view import Written
from tests.helpers.claims import NOW_MS, Signer, post, register, verdicts
from tests.helpers.postgres import Storages
from tests.helpers.settings import settings_for

pytestmark = pytest.mark.both_backends

A, B, C, D = (cids.midhash_bytes(f"group {n}".encode()) for n in "ABCD")


@pytest.fixture
async def linker(client: httpx.AsyncClient) -> Signer:
    signer = Signer()
    await register(client, signer, may_link=True, name="linker")
    return signer


def rid_of(node: Node, cid: str) -> str | None:
    return node.truth.group_of(cid)


def feed(node: Node, after: int = 0) -> list[tuple[str, str, str, str | None]]:
    rows = node.cache.conn.execute(
        "SELECT rid, op, key, value FROM feed WHERE seq > ? ORDER BY seq", (after,)
    ).fetchall()
    return [tuple(r) for r in rows]


def feed_seq(node: Node) -> int:
    return int(node.cache.conn.execute("SELECT coalesce(max(seq), 0) FROM feed").fetchone()[0])


async def test_first_sighting_mints_one_rid(
    client: httpx.AsyncClient, node: Node, linker: Signer
) -> None:
    await post(client, linker.claim(A, "title", "a"))
    rid = rid_of(node, A)
    assert rid is not None
    await post(client, linker.claim(A, "year", "1999"))
    assert rid_of(node, A) == rid
    assert node.truth.conn.execute("SELECT count(*) FROM rids").fetchone()[0] == 1
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
    assert node.truth.conn.execute("SELECT count(*) FROM rids").fetchone()[0] == 1
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
    info = node.truth.rid_info(newer)
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
    assert (
        node.cache.conn.execute("SELECT count(*) FROM records WHERE rid = ?", (newer,)).fetchone()[
            0
        ]
        == 0
    )
    response = await client.get(f"/api/metadata/{newer}")
    assert response.status_code == 404
    assert response.json()["error"] == "merged" and response.json()["survivor"] == older
    claims = (await client.get(f"/api/metadata/{older}/claims")).json()
    assert claims["rid"] == older and {c["cid"] for c in claims["claims"]} == {A, B}


async def test_retracting_a_link_does_not_split(
    client: httpx.AsyncClient, node: Node, linker: Signer
) -> None:
    await post(client, linker.claim(A, f"cids/{B}", "true", ts=NOW_MS))
    rid = rid_of(node, A)
    await post(client, linker.claim(A, f"cids/{B}", None, ts=NOW_MS + 1))
    assert rid_of(node, A) == rid_of(node, B) == rid
    doc = (await client.get(f"/api/meta/{A}")).json()
    assert doc["metadata"][f"cids/{B}"] == "true"  # membership comes from the group


async def test_chains_of_merges(
    client: httpx.AsyncClient, node: Node, linker: Signer, tmp_path: Path
) -> None:
    for cid in (A, B, C, D):
        await post(client, linker.claim(cid, "title", cid[-6:]))
    rids = {cid: rid_of(node, cid) for cid in (A, B, C, D)}
    await post(client, linker.claim(A, f"cids/{B}", "true"))
    await post(client, linker.claim(C, f"cids/{D}", "true"))
    await post(client, linker.claim(B, f"cids/{C}", "true"))
    oldest = min(r for r in rids.values() if r is not None)
    assert {rid_of(node, cid) for cid in (A, B, C, D)} == {oldest}
    for cid, rid in rids.items():
        info = node.truth.rid_info(rid or "")
        assert info is not None
        assert info.merged_into == (None if rid == oldest else oldest), cid
    live = {r[0] for r in node.cache.conn.execute("SELECT DISTINCT rid FROM records")}
    assert live == {oldest}
    assert set((await client.get(f"/api/meta/{D}")).json()["cids"]) == {A, B, C, D}
    assert_cache_is_fresh(node, tmp_path)


def assert_cache_is_fresh(node: Node, tmp_path: Path) -> None:
    """The incrementally applied cache equals a rebuild from the truth, and signatures verify."""
    report = check(node.settings, tmp_path / "scratch-cache.db")
    assert report.clean, report.differences + report.bad_signatures


async def test_weights_ties_viewer_and_blocking(
    client: httpx.AsyncClient, node: Node, tmp_path: Path
) -> None:
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


async def test_a_block_through_the_api_answers_once_its_replan_is_done(
    client: httpx.AsyncClient, node: Node, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A signer's records are replanned a step of `REPLAN_CHUNK` claims a transaction, and
    the block's answer waits for the last step (bounded by `apply_wait_s`): read-your-writes
    for the one who blocked, as when it was one transaction."""
    monkeypatch.setattr(cache, "REPLAN_CHUNK", 2)
    spammer = Signer()
    await register(client, spammer)
    for n in range(5):
        await post(client, spammer.claim(POOL[n], "title", f"spam {n}"))
    assert (await client.post(f"/api/signers/{spammer.uid}/block")).status_code == 200
    for n in range(5):
        assert "title" not in (await client.get(f"/api/meta/{POOL[n]}")).json()["metadata"]
    assert (await client.get("/health")).json()["replans"] == 0
    assert node.applier.state.replanned == 3  # 2 + 2 + 1 claims
    assert_cache_is_fresh(node, tmp_path)


async def test_an_apply_weighs_votes_with_the_signers_asked_for_only(
    client: httpx.AsyncClient, node: Node
) -> None:
    """What an apply weighs votes with (`TruthView.merge_signers`): the weight and block of each
    signer asked for that the truth knows, and no one else's (an apply used to read every
    signer the box knows, a peer's included: 1.2 µs each, docs/benchmarks.md "Session 20")."""
    light, heavy, other = Signer(), Signer(), Signer()
    for signer, weight in ((light, 1), (heavy, 3), (other, 2)):
        await register(client, signer, weight=weight)
    await client.post(f"/api/signers/{heavy.uid}/block")
    with node.truth.snapshot() as view:
        found = view.merge_signers([light.uid, heavy.uid, Signer().uid])
        assert view.merge_signers([]) == {}
    assert found == {
        light.uid: merge.Signer(weight=1, blocked=False),
        heavy.uid: merge.Signer(weight=3, blocked=True),
    }


async def test_claims_listing_filters(client: httpx.AsyncClient, linker: Signer) -> None:
    other = Signer()
    await register(client, other)
    await post(
        client,
        linker.claim(A, "title", "x"),
        linker.claim(A, "year", "1"),
        other.claim(A, "title", "y"),
    )
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


async def test_missing_lists_the_records_none_of_whose_cids_has_a_local_file(
    client: httpx.AsyncClient, node: Node, linker: Signer, storage: str
) -> None:
    """`GET /api/files?missing=1`: a midhash whose own file is here is not missing, nor one
    whose group holds a file of another of its midhashes; one with neither is (the query
    looks at the midhash's own file first, the group only where that is gone). Read on a
    thread: with nothing missing it reads every midhash, 59 ms at 100,000 files, which held
    the event loop's connection and every request waiting on it."""
    await post(client, linker.claim(A, f"cids/{B}", "true"), linker.claim(C, "title", "c"))
    files = [merge.LocalFile(f"/m/{cid}.mkv", cid, 1, 1, 1) for cid in (B, D)]
    await node.ensure_groups([B, D])
    await node.apply_local(files, [])
    on_loop: list[str] = []
    if storage == "sqlite":  # PostgreSQL's connections are traced by no callback
        node.cache.conn.set_trace_callback(on_loop.append)
    try:
        answer = (await client.get("/api/files", params={"missing": "1"})).json()
    finally:
        if storage == "sqlite":
            node.cache.conn.set_trace_callback(None)
    assert not [sql for sql in on_loop if "local_file" in sql], on_loop
    assert answer == {
        "files": [{"midhash": C, "rid": rid_of(node, C), "fileName": None}],
        "next": None,
    }
    await node.apply_local([], [files[0].path])  # the group's one file goes: A and B are missing
    listed = (await client.get("/api/files", params={"missing": "1"})).json()["files"]
    assert [f["midhash"] for f in listed] == sorted([A, B, C])


async def test_check_finds_a_tampered_cache_and_rebuild_repairs_it(
    client: httpx.AsyncClient, node: Node, linker: Signer, tmp_path: Path
) -> None:
    await post(client, linker.claim(A, "title", "truth"))
    await node.cache.writer.run(
        lambda conn: conn.execute("UPDATE records SET value = 'tampered' WHERE key = 'title'")
    )
    report = check(node.settings, tmp_path / "scratch.db")
    assert not report.clean
    assert any("tampered" in line for line in report.differences)
    epoch = node.applier.state.epoch
    state = await node.cache.build(node.truth)
    assert state.epoch > epoch
    assert_cache_is_fresh(node, tmp_path)


ROWS = st.lists(
    st.tuples(st.sampled_from("abcé\U0010ffff"), st.sampled_from(["x", "y"])),
    unique_by=lambda row: row[0],
).map(sorted)


@given(ROWS, ROWS)
@example([("a", "x")], [("a", "y")])
def test_check_s_side_by_side_read_finds_what_sets_would(
    live: list[tuple[str, str]], fresh: list[tuple[str, str]]
) -> None:
    """`check` reads each table of both caches in key order, side by side, holding only what
    differs (sets of the whole tables held both caches in memory: 560 MB at 100,000 files);
    it finds exactly the rows the sets' differences held, a changed row on both sides."""
    only_live, only_fresh = cache.differences(iter(live), iter(fresh), 1)
    assert only_live == sorted(set(live) - set(fresh))
    assert only_fresh == sorted(set(fresh) - set(live))


# -- a batch written and applied at once agrees with one claim at a time ------------------------

POOL = [cids.midhash_bytes(f"pool {n}".encode()) for n in range(8)]
UIDS = ("z6MkTestSignerA", "z6MkTestSignerB")  # ingest_txn takes validated claims: no signing

CLAIMS = st.builds(
    Claim,
    uid=st.sampled_from(UIDS),
    cid=st.sampled_from(POOL),
    key=st.sampled_from(["title", "year"]) | st.sampled_from([f"cids/{cid}" for cid in POOL]),
    value=st.sampled_from([None, "x", "y"]),
    ts=st.integers(NOW_MS, NOW_MS + 2),
    sig=st.sampled_from([bytes([n]) * 64 for n in range(3)]),
)
BATCHES = st.lists(CLAIMS, min_size=1, max_size=16).map(
    lambda batch: batch + batch[:2]
)  # the same claim twice in a batch, often


APPLIES = ("ahead", "handed", "read back")
HOLD_S = 60.0  # the longest a truth COMMIT is held for an apply ahead of it


class Store:
    """A truth and a cache on disk, written and applied as the node's writers do."""

    def __init__(self, data_dir: Path, apply: str, storage: str) -> None:
        """`apply`: "ahead", each ingest's apply begins before its COMMIT, as the node's
        applier's does, and that COMMIT is held until the apply reaches a read that must wait
        for it, or its own end (the latest an apply can read too early); "handed", the applies
        are handed what the ingests wrote (`view.Written`) after their COMMIT; "read back",
        they read it all back from the truth."""
        assert apply in APPLIES
        self.mode, self.written = apply, list[Written]()
        self.ahead: concurrent.futures.Future[cache.State] | None = None
        settings = settings_for(data_dir, storage=storage)
        open_store(settings)
        self.source = truth.TruthStore.configured(settings, lambda: NOW_MS).open()
        self.store = cache.CacheStore.configured(settings).open()
        self.truth, self.cache = self.source.conn, self.store.conn  # to read the files
        self.minter = rids.Minter()
        self.closed = False
        for uid in UIDS:
            self.source.add_signer_sync(uid, "t", 1, True)
        self.store.build_sync(self.source)
        if apply == "ahead":
            self.source.on_written(self._apply_ahead)

    def _apply_ahead(self, written: Sequence[Written], committed: Callable[[], None]) -> None:
        reached = threading.Event()

        def held() -> None:
            reached.set()
            committed()

        self.ahead = self.store.apply_ahead(self.source, written, held)
        reached.wait(HOLD_S)

    def close(self) -> None:
        """Close both stores (once: a test may close them before its fixture does)."""
        if not self.closed:
            self.closed = True
            self.store.close()
            self.source.close()

    def ingest(self, batch: list[Claim], policy: truth.Policy | None = None) -> list[str]:
        result = self.source.ingest_sync(batch, self.minter, policy or truth.Policy(), NOW_MS)
        self.written.append(result.written)
        return list(result.verdicts)

    def apply(self) -> cache.State:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:  # nothing ahead if the batch wrote nothing
            return ahead.result(HOLD_S)
        written, self.written = self.written if self.mode == "handed" else [], []
        return self.store.apply_sync(self.source, written)

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every truth table and the cache's records, rids named by minting order (two stores
        mint different rids for the same groups)."""
        names = {
            rid: f"rid {n}"
            for n, (rid,) in enumerate(self.truth.execute("SELECT rid FROM rids ORDER BY rid"))
        }
        tables = [
            (self.truth, t, "*") for t in ("claims", "cid_group", "rids", "changes", "signers")
        ]
        # Not the cache index's row ids (the order of insertion) or bodies (they spell the rid).
        tables += [(self.cache, "records", "*"), (self.cache, "cid_index", "cid, rid")]
        return {
            table: sorted(
                tuple(names.get(v, v) for v in row)
                for row in conn.execute(f"SELECT {columns} FROM {table}")
            )
            for conn, table, columns in tables
        }

    def records(self) -> dict[tuple[str, str], str]:
        return {
            (rid, key): value
            for rid, key, value in self.cache.execute("SELECT rid, key, value FROM records")
        }


def expected_feed(
    before: dict[tuple[str, str], str], after: dict[tuple[str, str], str], losers: list[str]
) -> list[tuple[str, str, str, str | None]]:
    """What one apply must feed: a `del` per key of each merged-away record, then every other
    changed key in (rid, key) order."""
    events = [
        (rid, "del", key, None) for loser in losers for rid, key in sorted(before) if rid == loser
    ]
    for rid, key in sorted((set(before) | set(after)) - {k for k in before if k[0] in losers}):
        value = after.get((rid, key))
        if before.get((rid, key)) != value:
            events.append((rid, "del", key, None) if value is None else (rid, "set", key, value))
    return events


def _title(n: int) -> Claim:
    return Claim(UIDS[0], POOL[n], "title", str(n), NOW_MS, bytes(64))


def _link(a: int, b: int) -> Claim:
    return Claim(UIDS[0], POOL[a], f"cids/{POOL[b]}", "true", NOW_MS, bytes(64))


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # `storages`: made per example
)
@pytest.mark.parametrize("apply", ["handed", "ahead"])
@given(batches=st.lists(BATCHES, min_size=1, max_size=3))
@example(batches=[[_title(n) for n in range(4)], [_link(1, 0), _link(3, 2)]])  # two survivors
@example(batches=[[_title(n) for n in range(3)], [_link(2, 1), _link(1, 0), _link(2, 3)]])
def test_batches_agree_with_one_claim_at_a_time(
    apply: str, batches: list[list[Claim]], storages: Storages
) -> None:
    """`ingest_txn` resolves a batch against stored claims read once and kept current in
    memory, groups it in memory and writes set-wise; `apply_txn` recomputes records with one
    read per table, answering from what the ingest handed it (`view.Overlay`) what it can,
    after the ingest's COMMIT or begun before it (`apply_ahead_txn`, reading the truth only
    once it has committed). Both must do exactly what one claim per transaction, read back
    from the truth, does."""
    with tempfile.TemporaryDirectory() as tmp, storages() as first, storages() as second:
        batched = Store(Path(tmp) / "batched", apply, storage=first)
        single = Store(Path(tmp) / "single", "read back", storage=second)
        try:
            for batch in batches:
                before, mark = batched.records(), cache.read_state(batched.cache)
                verdicts = batched.ingest(batch)
                batched.apply()
                assert verdicts == [v for claim in batch for v in single.ingest([claim])]
                single.apply()
                assert batched.dump() == single.dump()
                losers = [
                    rid
                    for (rid,) in batched.truth.execute(
                        "SELECT rid FROM changes WHERE kind = 'merge' AND seq > ? ORDER BY seq",
                        (mark.applied_seq,),
                    )
                ]
                fed = batched.cache.execute(
                    "SELECT rid, op, key, value FROM feed WHERE seq > ? ORDER BY seq",
                    (mark.feed_seq,),
                ).fetchall()
                assert fed == expected_feed(before, batched.records(), losers)
            with cache.CacheStore(Path(tmp) / "fresh.db") as fresh:
                fresh.build_sync(batched.source)
                assert batched.store.diff(fresh) == []
        finally:
            batched.close()
            single.close()


def test_an_apply_ahead_of_a_commit_that_failed_leaves_the_cache_as_it_was(
    tmp_path: Path,
) -> None:
    """If the truth's COMMIT fails, the apply begun ahead of it learns so at its first read
    of the truth (`committed()` raises `NotCommitted`) and rolls back: the cache holds nothing
    of it, its state is unchanged, and the next apply (reading the outbox back) applies all
    of what the truth does hold."""
    store = Store(tmp_path / "data", "handed", storage="sqlite")
    try:
        before, state = store.records(), cache.read_state(store.cache)
        store.ingest([_title(n) for n in range(3)] + [_link(1, 0)])

        def failed() -> None:
            raise NotCommitted("the truth's COMMIT failed")

        ahead = store.store.apply_ahead(store.source, store.written, failed)
        assert isinstance(ahead.exception(HOLD_S), NotCommitted)
        assert (store.records(), cache.read_state(store.cache)) == (before, state)
        store.mode = "read back"
        assert store.apply().applied_seq == store.source.max_seq()
        # 0 and 1 joined: one signer's titles with one ts and one signature, the smaller CID's
        joined = "0" if POOL[0] < POOL[1] else "1"
        assert sorted(v for (_, k), v in store.records().items() if k == "title") == [joined, "2"]
    finally:
        store.close()


class CountedSource:
    """A `view.TruthSource` that counts the snapshots opened through it (the truth reads)."""

    def __init__(self, source: truth.TruthStore) -> None:
        self.source = source
        self.snapshots = 0

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Any]:
        self.snapshots += 1
        with self.source.snapshot() as view:
            yield view


def test_an_apply_ahead_applies_through_its_own_writes_at_most(tmp_path: Path) -> None:
    """An apply ahead that finds a gap before its writes reads them back from the truth, but
    only through its own last seq, though later transactions have committed; one whose writes
    an earlier apply took already does nothing, reading nothing. (Taking the later
    transactions' changes made their applies ahead find the same, and read back in turn: a
    burst of writes read back to its end.) The next apply ahead then answers from what its
    ingest wrote, and the cache ends as a rebuild makes it."""
    store = Store(tmp_path / "data", "handed", storage="sqlite")
    try:
        store.ingest([_title(0)])
        store.store.apply_sync(store.source)  # read back: the cache is at the first's last
        for n in (1, 2, 3):
            store.ingest([_title(n)])
        _, second, third, fourth = store.written
        counted = CountedSource(store.source)

        gap = store.store.apply_ahead(counted, [third], lambda: None).result(HOLD_S)
        assert gap.applied_seq == third.last < fourth.last
        assert counted.snapshots >= 1  # the second's changes were read back

        counted.snapshots = 0
        stale = store.store.apply_ahead(counted, [second], lambda: None).result(HOLD_S)
        assert (stale.applied_seq, counted.snapshots) == (third.last, 0)

        last = store.store.apply_ahead(store.source, [fourth], lambda: None).result(HOLD_S)
        assert last.applied_seq == fourth.last == store.source.max_seq()
        with cache.CacheStore(tmp_path / "fresh.db") as fresh:
            fresh.build_sync(store.source)
            assert store.store.diff(fresh) == []
    finally:
        store.close()


def test_an_unknown_signers_claims_applied_ahead_agree_with_reading_them_back(
    tmp_path: Path,
) -> None:
    """An apply ahead of the COMMIT reads the signers before it (`view.Ahead`): right only if
    an ingest registers an unknown signer exactly as the merge takes a signer it has never
    heard of (`merge.Signer()`). A registered and an unknown signer vote on one key."""
    accept = truth.Policy(accept_unknown_signers=True)
    stranger = "z6MkTestSignerUnknown"
    batch = [
        Claim(UIDS[0], POOL[0], "title", "registered", NOW_MS, bytes(64)),
        Claim(stranger, POOL[0], "title", "stranger", NOW_MS + 1, bytes(64)),
        Claim(stranger, POOL[1], "year", "1999", NOW_MS, bytes(64)),
    ]
    ahead = Store(tmp_path / "ahead", "ahead", storage="sqlite")
    back = Store(tmp_path / "back", "read back", storage="sqlite")
    try:
        for store in (ahead, back):
            assert store.ingest(batch, accept) == ["accepted"] * 3
            store.apply()
        assert ahead.dump() == back.dump()
        assert ahead.truth.execute("SELECT count(*) FROM signers").fetchone() == (3,)
    finally:
        ahead.close()
        back.close()


# -- a signer's replan, a step a transaction -----------------------------------------------------


def titled(store: Store) -> int:
    """How many records hold a title."""
    return sum(1 for _, key in store.records() if key == "title")


def fresh_diff(store: Store, at: Path) -> list[str]:
    """How `store`'s cache differs from one rebuilt from its truth."""
    with cache.CacheStore(at) as fresh:
        fresh.build_sync(store.source)
        return store.store.diff(fresh)


@pytest.fixture
def titled_8(
    storages: Storages, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[Store, str]]:
    """(a store holding 8 one-title records of `UIDS[0]`, applied; its `storage`), replans
    going 3 claims a step."""
    monkeypatch.setattr(cache, "REPLAN_CHUNK", 3)
    with storages() as storage:
        store = Store(tmp_path / "data", "handed", storage=storage)
        try:
            store.ingest([_title(n) for n in range(8)])
            assert store.apply().replans == 0 and titled(store) == 8
            yield store, storage
        finally:
            store.close()


def test_a_blocked_signers_records_are_replanned_a_step_a_transaction_writes_between(
    titled_8: tuple[Store, str], tmp_path: Path
) -> None:
    """Blocking a signer recomputes every record it has a claim on, `REPLAN_CHUNK` of its
    claims a cache transaction (in one, a signer of 1M records held every write ≈ 47 s): each
    apply takes one step, an apply of a write between two steps is applied at once, and the
    last step leaves the cache as a rebuild would."""
    store, _ = titled_8
    store.source.set_signer_status_sync(UIDS[0], "blocked")
    state = store.apply()
    assert (state.replans, titled(store), state.applied_seq) == (1, 5, store.source.max_seq())
    store.ingest([Claim(UIDS[1], POOL[0], "year", "1999", NOW_MS, bytes(64))])
    state = store.apply()
    assert (state.replans, titled(store)) == (1, 2)
    assert state.applied_seq == store.source.max_seq()
    assert "1999" in store.records().values()
    assert store.apply().replans == 0 and titled(store) == 0
    assert store.apply() == cache.read_state(store.cache)  # nothing left to step
    assert fresh_diff(store, tmp_path / "fresh.db") == []


def test_a_signer_changed_again_during_its_replan_is_replanned_from_the_start(
    titled_8: tuple[Store, str], tmp_path: Path
) -> None:
    """The records a replan reached were weighed before the next change: unblocked after one
    step, every record is recomputed again, those of the first step too."""
    store, _ = titled_8
    store.source.set_signer_status_sync(UIDS[0], "blocked")
    assert store.apply().replans == 1 and titled(store) == 5
    store.source.set_signer_status_sync(UIDS[0], "active")
    while store.apply().replans:
        pass
    assert titled(store) == 8
    assert fresh_diff(store, tmp_path / "fresh.db") == []


STRAY = "7ZZZZZZZZZZZZZZZZZZZZZZZZZ"  # a rid no truth holds, after every real one


def _mistaken(conn: Connection, rid: str) -> None:
    """The cache wrong two ways: `rid`'s title changed, a record of a rid the truth lacks."""
    conn.execute("UPDATE records SET value = 'wrong' WHERE rid = ? AND key = 'title'", (rid,))
    conn.execute("INSERT INTO records (rid, key, value) VALUES (?, 'title', 'stray')", (STRAY,))


def test_a_rebuild_in_place_goes_a_step_an_apply_and_feeds_only_its_mends(
    titled_8: tuple[Store, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`rebuild-cache` beside a serving node: each apply recomputes `REBUILD_CHUNK` records (3
    here), a write between two steps applied with the next (a merge of the last record, not
    reached yet, into the first, passed already); what was right feeds nothing, a record the
    cache had wrong gets its `set`, one the truth lacks its `del`; it ends as a rebuild would,
    on the same epoch."""
    monkeypatch.setattr(cache, "REBUILD_CHUNK", 3)
    store, _ = titled_8
    rids = sorted({rid for rid, _ in store.records()})
    store.store.writer.run_sync(_mistaken, rids[5])
    begun = store.store.writer.run_sync(cache.start_rebuild_txn)
    assert begun.rebuilding
    first = store.apply()
    assert first.rebuilding and first.feed_seq == begun.feed_seq  # rids 0–2 were right
    store.ingest([_link(0, 7)])
    assert store.apply().rebuilding  # the merge, and rids 3–5
    last = store.apply()  # rid 6 (7 merged away), and the stray after it
    assert not last.rebuilding and last.epoch == begun.epoch
    assert store.apply() == cache.read_state(store.cache)  # nothing left to step
    fed = store.cache.execute(
        "SELECT rid, op, key, value FROM feed WHERE seq > ? ORDER BY seq", (begun.feed_seq,)
    ).fetchall()
    assert (rids[5], "set", "title", "5") in fed and (STRAY, "del", "title", None) in fed
    assert {row[0] for row in fed} == {rids[0], rids[5], rids[7], STRAY}
    assert fresh_diff(store, tmp_path / "fresh.db") == []


def test_check_reports_a_replan_under_way(
    storages: Storages, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`metanode check` on a cache whose replan is under way says so first (real signed
    claims: `check` verifies every stored signature): on SQLite it recomputes them in its copy
    of the cache and compares (clean), on PostgreSQL it is not clean."""
    monkeypatch.setattr(cache, "REPLAN_CHUNK", 3)
    signer = Signer()
    signed = [claims_mod.validate(signer.claim(POOL[n], "title", str(n)), NOW_MS) for n in range(4)]
    with storages() as storage:
        store = Store(tmp_path / "data", "handed", storage=storage)
        try:
            store.source.add_signer_sync(signer.uid, "real", 1, False)
            store.ingest(signed)
            store.apply()
            store.source.set_signer_status_sync(signer.uid, "blocked")
            assert store.apply().replans == 1
        finally:
            store.close()
        report = check(settings_for(tmp_path / "data", storage=storage), tmp_path / "scratch.db")
    if storage == "sqlite":  # compared once recomputed in a copy: said, not a difference
        assert report.clean, report
        assert report.notes[0].startswith("the records of 1 blocked or re-weighed signer(s)")
        return
    assert not report.clean
    assert report.differences[0].startswith("the records of 1 blocked or re-weighed signer(s)")


def test_check_says_a_cache_behind_the_truth_is_behind_in_one_line(
    storages: Storages, tmp_path: Path
) -> None:
    """Claims stored but not applied yet (a `scan` interrupted between its two commits): one
    line saying so, not a difference for every record the rebuild had and the cache not yet
    (about a thousand after a scan of 20,000 files); once applied, clean. On SQLite `check`
    applies them to its copy of the cache first, as the next start will: clean, with a note."""
    signer = Signer()
    signed = [claims_mod.validate(signer.claim(POOL[n], "title", str(n)), NOW_MS) for n in range(6)]
    with storages() as storage:
        settings = settings_for(tmp_path / "data", storage=storage)
        store = Store(tmp_path / "data", "handed", storage=storage)
        try:
            store.source.add_signer_sync(signer.uid, "real", 1, False)
            store.ingest(signed[:2])
            store.apply()
            store.ingest(signed[2:])  # stored, not applied
            behind = check(settings, tmp_path / "scratch.db")
            store.apply()
        finally:
            store.close()
        applied = check(settings, tmp_path / "scratch2.db")
    assert applied.clean, applied.differences
    assert behind.claims_checked == 6
    if storage == "sqlite":  # the changes applied to a copy of the cache, then compared
        assert behind.clean, behind
        assert behind.notes[0].startswith("the cache was 8 change(s) behind the truth ")
        return
    assert not behind.clean
    assert len(behind.differences) == 1, behind.differences
    assert " change(s) behind the truth (applied seq " in behind.differences[0]


def test_a_replan_goes_on_after_a_restart_where_its_last_step_committed(
    titled_8: tuple[Store, str], tmp_path: Path
) -> None:
    """A replan's progress is in the cache's state, written in its step's transaction: stores
    closed after one step and opened again (no rebuild) take the remaining steps."""
    store, storage = titled_8
    store.source.set_signer_status_sync(UIDS[0], "blocked")
    assert store.apply().replans == 1
    store.close()
    settings = settings_for(tmp_path / "data", storage=storage)
    with (
        truth.TruthStore.configured(settings, lambda: NOW_MS) as source,
        cache.CacheStore.configured(settings) as reopened,
    ):
        assert reopened.state().replans == 1
        assert [reopened.apply_sync(source).replans for _ in range(2)] == [1, 0]
        titles = reopened.conn.execute("SELECT count(*) FROM records WHERE key = 'title'")
        assert titles.fetchone()[0] == 0
        with cache.CacheStore(tmp_path / "fresh.db") as fresh:
            fresh.build_sync(source)
            assert reopened.diff(fresh) == []
