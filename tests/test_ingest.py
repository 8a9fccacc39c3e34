"""The claim lifecycle over HTTP (in-process ASGI): verdicts, rejections, atomicity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from metanode import claims
from metanode.node import Node
from metanode.verifier import BULK_CLAIMS
from tests.helpers.claims import NOW_MS, Signer, post, register, verdicts, without_owner
from tests.helpers.postgres import every_row

pytestmark = pytest.mark.both_backends

CID_A = cids.midhash_bytes(b"content a")
CID_B = cids.midhash_bytes(b"content b")


async def db_bytes(node: Node) -> dict[str, bytes]:
    """Every byte of both databases and their WALs (on PostgreSQL, every row of every table),
    once the cache has caught up."""
    assert await node.applier.wait_for(node.truth.max_seq(), 10)
    for writer in (node.truth.writer, node.cache.writer):
        await writer.run(lambda conn: None)  # drain queued jobs
    if node.settings.postgresql:
        return {name: repr(rows).encode() for name, rows in every_row(node).items()}
    out = {}
    for path in (node.settings.truth_path, node.settings.cache_path):
        for suffix in ("", "-wal"):
            file = Path(str(path) + suffix)
            out[file.name] = file.read_bytes() if file.exists() else b""
    return out


@pytest.fixture
def alice() -> Signer:
    return Signer()


async def test_accepted_then_duplicate_then_stale(client: httpx.AsyncClient, alice: Signer) -> None:
    await register(client, alice)
    first = alice.claim(CID_A, "title", "The Matrix", ts=NOW_MS)
    response = await post(client, first)
    assert response.status_code == 200
    assert response.json() == {
        "results": [{"status": "accepted"}],
        "accepted": 1,
        "duplicate": 0,
        "stale": 0,
        "applied": True,
    }
    assert verdicts(await post(client, first)) == ["duplicate"]
    older = alice.claim(CID_A, "title", "Old", ts=NOW_MS - 1)
    assert verdicts(await post(client, older)) == ["stale"]
    doc = (await client.get(f"/api/meta/{CID_A}")).json()
    assert doc["metadata"]["title"] == "The Matrix"
    assert doc["cid"] == CID_A and doc["canonical_cid"] == CID_A and doc["cids"] == [CID_A]


async def test_newer_replaces_and_retraction_removes(
    client: httpx.AsyncClient, alice: Signer
) -> None:
    await register(client, alice)
    await post(client, alice.claim(CID_A, "title", "One", ts=NOW_MS))
    assert verdicts(await post(client, alice.claim(CID_A, "title", "Two", ts=NOW_MS + 1))) == [
        "accepted"
    ]
    assert (await client.get(f"/api/meta/{CID_A}")).json()["metadata"]["title"] == "Two"
    assert verdicts(await post(client, alice.claim(CID_A, "title", None, ts=NOW_MS + 2))) == [
        "accepted"
    ]
    assert "title" not in (await client.get(f"/api/meta/{CID_A}")).json()["metadata"]
    # the tombstone blocks replay of the older value
    assert verdicts(await post(client, alice.claim(CID_A, "title", "Two", ts=NOW_MS + 1))) == [
        "stale"
    ]


async def test_a_weight_zero_signer_is_listed_never_counted(
    client: httpx.AsyncClient, alice: Signer
) -> None:
    """SPEC §2.5 rule 1, end to end: stored and listed, absent from the merged record (even as
    the only value), visible to its signer with `?as=`; raising the weight counts it."""
    await register(client, alice, weight=0)
    claim = alice.claim(CID_A, "title", "Mine alone")
    assert verdicts(await post(client, claim)) == ["accepted"]
    assert "title" not in (await client.get(f"/api/meta/{CID_A}")).json()["metadata"]
    listed = (await client.get(f"/api/meta/{CID_A}/claims")).json()["claims"]
    assert [c["value"] for c in listed if c["key"] == "title"] == ["Mine alone"]
    mine = await client.get(f"/api/meta/{CID_A}", params={"as": alice.uid})
    assert mine.json()["metadata"]["title"] == "Mine alone"
    await register(client, alice, weight=1)
    assert (await client.get(f"/api/meta/{CID_A}")).json()["metadata"]["title"] == "Mine alone"


async def test_equal_ts_tie_break_smaller_signature_wins(
    client: httpx.AsyncClient, alice: Signer
) -> None:
    await register(client, alice)
    one = alice.claim(CID_A, "title", "one", ts=NOW_MS)
    two = alice.claim(CID_A, "title", "two", ts=NOW_MS)
    raw = {c["value"]: cids_sig(c) for c in (one, two)}
    winner, loser = sorted((one, two), key=lambda c: raw[c["value"]])
    assert verdicts(await post(client, loser)) == ["accepted"]
    assert verdicts(await post(client, winner)) == ["accepted"]
    assert verdicts(await post(client, loser)) == ["stale"]
    doc = (await client.get(f"/api/meta/{CID_A}")).json()
    assert doc["metadata"]["title"] == winner["value"]


def cids_sig(wire: dict[str, Any]) -> bytes:
    from metanode.claims import decode_sig

    return decode_sig(wire["sig"])


@pytest.mark.parametrize(
    ("mutate", "slug"),
    [
        (lambda c: {**c, "ts": NOW_MS + 3_600_000}, "ts_in_future"),
        (
            lambda c: {**c, "sig": c["sig"][:-2] + ("AA" if c["sig"][-2:] != "AA" else "AQ")},
            "bad_signature",
        ),
        (lambda c: {**c, "key": "filePath"}, "reserved_key"),
        (lambda c: {**c, "cid": c["cid"].upper()}, "noncanonical_cid"),
        (lambda c: {**c, "cid": "garbage"}, "invalid_cid"),
        (lambda c: {**c, "uid": "z6Mkbogus"}, "invalid_uid"),
        (lambda c: {**c, "key": "a//b"}, "invalid_key"),
        (lambda c: {**c, "value": 5}, "invalid_value"),
        (lambda c: {**c, "ts": 5}, "invalid_ts"),
    ],
)
async def test_invalid_claim_rejects_whole_batch_and_writes_nothing(
    client: httpx.AsyncClient, node: Node, alice: Signer, mutate: Any, slug: str
) -> None:
    await register(client, alice)
    before = await db_bytes(node)
    good = alice.claim(CID_A, "title", "fine")
    response = await post(client, good, mutate(alice.claim(CID_B, "title", "bad")))
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "invalid_batch" and body["retryable"] is False
    assert [(i["index"], i["error"]) for i in body["items"]] == [(1, slug)]
    assert await db_bytes(node) == before
    assert (await client.get(f"/api/meta/{CID_A}")).status_code == 404


async def test_a_signature_over_other_bytes_is_answered_with_the_bytes_it_should_cover(
    client: httpx.AsyncClient, alice: Signer
) -> None:
    """A signer written without metanode that serialised the array its own way (here Python's
    default `json.dumps`, with spaces and `\\u00e9`; `ts` as a string is another) got only
    `signature does not verify against uid`: the item now carries `signed`, the signing bytes
    the node verified, which are the RFC 8785 form docs/protocol.md names."""
    await register(client, alice)
    good = alice.claim(CID_A, "title", "Amélie", ts=NOW_MS)
    own_way = json.dumps(["metanode-claim/1", alice.uid, CID_A, "title", "Amélie", NOW_MS])
    sig = claims.encode_sig(alice.key.sign(own_way.encode()).signature)
    response = await post(client, {**good, "sig": sig})
    [item] = response.json()["items"]
    assert (item["error"], item["signed"]) == (
        "bad_signature",
        f'["metanode-claim/1","{alice.uid}","{CID_A}","title","Amélie",{NOW_MS}]',
    )
    assert item["signed"].encode() == claims.signing_bytes(
        alice.uid, CID_A, "title", "Amélie", NOW_MS
    )
    assert verdicts(await post(client, good)) == ["accepted"]  # signed over those bytes
    malformed = (await post(client, {**good, "sig": sig + "=="})).json()["items"][0]
    assert malformed["error"] == "bad_signature" and "signed" not in malformed  # not a signature


@pytest.mark.parametrize(
    "node", [{"verify_processes": 1}, {"verify_processes": 2}], indirect=True, ids=["1", "2"]
)
async def test_a_large_batch_is_validated_in_worker_processes(
    client: httpx.AsyncClient, node: Node, alice: Signer
) -> None:
    """A batch of `BULK_CLAIMS` or more is validated in the `verify_processes` (real `spawn`
    processes; with 2, split between them): a bad claim in it still rejects the whole batch,
    at its index in the batch, writing nothing; the good batch is then accepted whole and
    readable."""
    await register(client, alice)
    before = await db_bytes(node)
    batch = [
        alice.claim(cids.midhash_bytes(f"bulk {n}".encode()), "title", f"bulk {n}")
        for n in range(BULK_CLAIMS + 36)
    ]
    bad = BULK_CLAIMS + 13
    tampered = {**batch[bad], "value": "tampered"}
    response = await post(client, *batch[:bad], tampered, *batch[bad + 1 :])
    assert response.status_code == 400, response.text
    [item] = response.json()["items"]
    assert (item["index"], item["error"]) == (bad, "bad_signature")
    fields = {name: tampered[name] for name in ("uid", "cid", "key", "value", "ts")}
    assert item["signed"].encode() == claims.signing_bytes(**fields)  # from a verify process
    assert await db_bytes(node) == before
    assert node.verifier.processes is not None and node.verifier.processes.running()
    response = await post(client, *batch)
    assert (response.status_code, response.json()["accepted"]) == (200, len(batch))
    assert (await client.get(f"/api/meta/{batch[bad]['cid']}")).json()["metadata"]["title"] == (
        f"bulk {bad}"
    )


async def test_unknown_and_blocked_signers_are_403(
    client: httpx.AsyncClient, node: Node, alice: Signer
) -> None:
    stranger = Signer()
    response = await post(client, stranger.claim(CID_A, "title", "x"))
    assert response.status_code == 403
    assert response.json()["items"][0]["error"] == "unknown_signer"
    await register(client, alice)
    assert (await client.post(f"/api/signers/{alice.uid}/block")).json()["status"] == "blocked"
    before = await db_bytes(node)
    response = await post(client, alice.claim(CID_A, "title", "x"))
    assert response.status_code == 403
    assert response.json()["items"][0]["error"] == "blocked_signer"
    assert await db_bytes(node) == before


async def test_link_needs_may_link(client: httpx.AsyncClient, alice: Signer) -> None:
    await register(client, alice, may_link=False)
    response = await post(client, alice.claim(CID_A, f"cids/{CID_B}", "true"))
    assert response.status_code == 403
    assert response.json()["items"][0]["error"] == "link_not_permitted"


async def test_oversize_batches_are_413(client: httpx.AsyncClient, alice: Signer) -> None:
    await register(client, alice)
    claim = alice.claim(CID_A, "title", "x")
    response = await post(client, *([claim] * 1001))
    assert response.status_code == 413 and response.json()["error"] == "too_large"
    big = {"claims": [], "pad": "x" * (4 * 1024 * 1024)}
    response = await client.post("/api/claims", json=big)
    assert response.status_code == 413 and response.json()["error"] == "too_large"


async def test_malformed_bodies(client: httpx.AsyncClient) -> None:
    response = await client.post("/api/claims", content=b"{not json")
    assert (response.status_code, response.json()["error"]) == (400, "invalid_json")
    response = await client.post("/api/claims", json={"claim": []})
    assert (response.status_code, response.json()["error"]) == (400, "invalid_request")
    response = await client.post("/api/claims", json={"claims": ["nope"]})
    assert response.json()["items"][0]["error"] == "invalid_claim"


async def test_accept_unknown_signers_registers_them(tmp_path: Path) -> None:
    from metanode.api import create_app
    from tests.helpers.settings import settings_for

    node = Node(settings_for(tmp_path / "d", accept_unknown_signers=True))
    await node.start()
    try:
        transport = httpx.ASGITransport(app=create_app(node))
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://n",
            headers={"Authorization": f"Bearer {node.token}"},
        ) as c:
            stranger = Signer()
            assert verdicts(await post(c, stranger.claim(CID_A, "title", "x"))) == ["accepted"]
            listed = (await c.get("/api/signers")).json()["signers"]
            assert [s["uid"] for s in without_owner(listed)] == [stranger.uid]
            # an unregistered signer still may not link
            response = await post(c, Signer().claim(CID_A, f"cids/{CID_B}", "true"))
            assert response.json()["items"][0]["error"] == "link_not_permitted"
    finally:
        await node.stop()


async def test_perimeter(client: httpx.AsyncClient, node: Node) -> None:
    anonymous = {"Authorization": ""}
    for method, path in (
        ("GET", "/api/signers"),
        ("POST", "/api/claims"),
        ("GET", "/api/hash-ids"),
        ("GET", "/api/metadata/x"),
    ):
        response = await client.request(method, path, headers=anonymous)
        assert (response.status_code, response.json()["error"]) == (401, "unauthorized")
    assert (await client.get("/health", headers=anonymous)).status_code == 200
    response = await client.get(
        f"/api/meta/{CID_A}", headers={**anonymous, "Origin": "http://elsewhere"}
    )
    assert response.json()["error"] == "unknown_cid"
    assert response.headers["access-control-allow-origin"] == "*"
    allowed = await client.options(
        f"/api/meta/{CID_A}",
        headers={"Origin": "http://elsewhere", "Access-Control-Request-Method": "GET"},
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"
    refused = await client.options(
        f"/api/meta/{CID_A}",
        headers={
            "Origin": "http://elsewhere",
            "Access-Control-Request-Method": "DELETE",
            "Access-Control-Request-Headers": "x-secret",
        },
    )  # a refused preflight was starlette's plain text, the one answer out of the envelope
    assert (refused.status_code, refused.json()["error"]) == (400, "invalid_request")
    assert refused.json()["message"] == (
        "cross-origin request refused (Disallowed CORS method, headers): another site's page "
        "may only GET this route, with no headers but the simple ones (asked: 'DELETE', "
        "headers 'x-secret')"
    )
    assert refused.headers["access-control-allow-methods"] == "GET"


async def test_a_public_answer_varies_on_origin_whether_asked_with_one_or_not(
    client: httpx.AsyncClient,
) -> None:
    """The public routes send `Access-Control-Allow-Origin` only to a request with an
    `Origin`, so every answer of theirs says `Vary: Origin` (a shared cache that kept the answer
    to a plain GET gave it to a browser's page, which refused it for lacking the header); the
    token routes send no CORS header and do not vary on it."""
    for path in (f"/api/meta/{CID_A}", "/health", "/openapi.json"):
        for asked in ({}, {"Origin": "http://elsewhere"}):
            response = await client.get(path, headers=asked)
            assert response.headers.get_list("vary") == ["Origin"], (path, asked)
            assert ("access-control-allow-origin" in response.headers) == bool(asked)
    assert "vary" not in (await client.get("/api/signers")).headers


async def test_lookup_spellings_and_alias(client: httpx.AsyncClient, alice: Signer) -> None:
    await register(client, alice)
    digest = hashlib.sha256(b"x").digest()
    raw_spelling = cids.encode(cids.RAW, cids.SHA2_256, digest)
    await post(client, alice.claim(raw_spelling, "title", "t"))
    other = cids.alias(raw_spelling)
    assert other is not None
    doc = (await client.get(f"/api/meta/{other}")).json()
    assert doc["cid"] == other and doc["metadata"]["title"] == "t"
    from multiformats import CID

    for spelling in (CID.decode(raw_spelling).encode("base58btc"), raw_spelling.upper()):
        response = await client.get(f"/api/meta/{spelling}")
        assert response.status_code == 200 and response.json()["cid"] == raw_spelling


async def test_a_read_of_a_stored_cid_parses_nothing(
    client: httpx.AsyncClient, node: Node, alice: Signer
) -> None:
    """A stored CID is canonical, so reading it needs no parse (whose cache a large library
    overflows): the lookup comes first. An unknown or non-canonical spelling is still parsed,
    and a junk one still refused."""
    await register(client, alice)
    stored = cids.midhash_bytes(b"parse-free")
    await post(client, alice.claim(stored, "title", "t"))
    cids._parse.cache_clear()
    assert (await client.get(f"/api/meta/{stored}")).json()["metadata"]["title"] == "t"
    assert node.resolve_cid(stored)[0] == stored
    assert cids._parse.cache_info().misses == 0
    unknown = cids.midhash_bytes(b"never stored")
    response = await client.get(f"/api/meta/{unknown}")
    assert response.json()["error"] == "unknown_cid" and cids._parse.cache_info().misses == 1
    junk = await client.get(f"/api/meta/{stored[:-1]}!")
    assert (junk.status_code, junk.json()["error"]) == (400, "invalid_cid")


async def test_a_batch_of_new_records_adds_one_full_text_segment(
    client: httpx.AsyncClient, node: Node, alice: Signer, backend: str
) -> None:
    """The library's FTS5 index is written by one statement an apply, so a batch of new records
    adds one index segment, not one per record (each statement flushes FTS5's pending terms as
    a segment); every record is still found by its title. (PostgreSQL's GIN index has no
    segments: there only the search is checked.)"""
    await register(client, alice)

    def segments() -> int:
        if backend != "sqlite":
            return 0
        return int(node.cache.conn.execute("SELECT count(*) FROM library_fts_idx").fetchone()[0])

    before = segments()
    titles = [f"segment{n} movie" for n in range(40)]
    batch = [alice.claim(cids.midhash_bytes(t.encode()), "title", t) for t in titles]
    response = await post(client, *batch)
    assert response.status_code == 200 and response.json()["accepted"] == 40, response.text
    assert segments() == before + (backend == "sqlite")
    for title in titles[::13]:
        found = node.library(title.split()[0], "", None, 10).rows
        assert [row.title for row in found] == [title]
