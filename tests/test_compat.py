"""The MetaMesh compatibility routes (metanode/compat.py, docs/compat.md).

Each route is checked against the request/response pairs meta-core gives for it, written out as
literal bodies (from meta-core's handlers as documented in the MetaMesh anchor notes:
`handlers.go@0403a6f` for `/meta`, `/urls` and the content routes, `sse_events.go@415595c` and
`dispatcher.go@415595c` for the two streams), with metanode's documented differences.

The JSON routes run in-process; the two SSE streams run against a real `metanode serve` process
over a raw socket (the in-process ASGI transport buffers a streamed body until it ends), and the
file events come from the real watcher.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sse_starlette import ServerSentEvent
from starlette.routing import Mount

from metanode import cache, compat, config, db, keys, merge, sse, watcher, webdav
from metanode import cid as cids
from metanode import rid as rids
from metanode.api import create_app
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.feed import Frame, Stream
from tests.helpers.rewrite import rewrite_in_place
from tests.helpers.server import Server, free_port
from tests.helpers.settings import settings_for
from tests.helpers.wait import poll

pytestmark = pytest.mark.both_backends  # the tests on a `node` run on both

CID_A = cids.midhash_bytes(b"compat a")
CID_B = cids.midhash_bytes(b"compat b")
SHA_A = cids.encode(cids.RAW, cids.SHA2_256, hashlib.sha256(b"compat a").digest())  # rank 30
WAIT_S = 30.0


# -- helpers --------------------------------------------------------------------------------------


async def register(client: httpx.AsyncClient, signer: Signer, may_link: bool = False) -> None:
    response = await client.post(
        "/api/signers", json={"uid": signer.uid, "name": "test", "may_link": may_link}
    )
    assert response.status_code == 200, response.text


async def post(client: httpx.AsyncClient, *wire: dict[str, Any]) -> None:
    response = await client.post("/api/claims", json={"claims": list(wire)})
    assert response.status_code == 200 and response.json()["accepted"] == len(wire), response.text


async def rid_of(client: httpx.AsyncClient, cid: str) -> str:
    response = await client.get(f"/api/meta/{cid}/claims")
    assert response.status_code == 200, response.text
    return str(response.json()["rid"])


def legacy_uid(node: Node) -> str:
    return keys.uid_of_key(keys.load(node.settings.keys_dir / "legacy-writer.key"))


async def listed_claims(client: httpx.AsyncClient, cid: str) -> list[dict[str, Any]]:
    response = await client.get(f"/api/meta/{cid}/claims")
    assert response.status_code == 200, response.text
    return list(response.json()["claims"])


def envelope(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["error"] == slug and isinstance(body["message"], str), body
    assert body["retryable"] is False, body
    return body


# -- GET /meta, GET /meta/{hash}, GET /meta/{hash}/{key…} ----------------------------------------


async def test_list_and_read_records_by_rid_or_any_cid_spelling(client: httpx.AsyncClient) -> None:
    assert (await client.get("/meta")).json() == {"hashIds": [], "count": 0}
    alice = Signer()
    await register(client, alice)
    await post(
        client,
        alice.claim(CID_A, "title", "The Matrix"),
        alice.claim(CID_A, "titles/eng", "The Matrix (1999)"),
        alice.claim(CID_B, "title", "Other"),
    )
    rid_a, rid_b = await rid_of(client, CID_A), await rid_of(client, CID_B)

    response = await client.get("/meta")
    assert response.status_code == 200
    assert response.json() == {"hashIds": sorted([rid_a, rid_b]), "count": 2}

    expected = {
        "hashId": rid_a,
        "metadata": {
            f"cids/{CID_A}": "true",
            "title": "The Matrix",
            "titles/eng": "The Matrix (1999)",
        },
    }
    alias = cids.alias(CID_A)
    assert alias is not None
    for spelling in (CID_A, CID_A.upper(), alias, rid_a, rid_a.lower()):
        response = await client.get(f"/meta/{spelling}")
        assert response.status_code == 200, (spelling, response.text)
        assert response.json() == expected, spelling

    response = await client.get(f"/meta/{alias}/titles/eng")  # a slash key, an alias spelling
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert response.text == "The Matrix (1999)"
    assert (await client.get(f"/meta/{rid_a}/cids/{CID_A}")).text == "true"


async def test_every_rid_is_read_on_a_connection_of_its_own(
    client: httpx.AsyncClient, node: Node, storage: str
) -> None:
    """`GET /meta` lists every record at once (2.9 MB, and 0.06–0.1 s reading the CID index,
    at 100,000 records): on a thread with a connection of its own, never on the one the event
    loop reads with, which the read held, and every other request with it, as long."""
    alice = Signer()
    await register(client, alice)
    await post(client, alice.claim(CID_A, "title", "a"), alice.claim(CID_B, "title", "b"))
    rids = sorted([await rid_of(client, CID_A), await rid_of(client, CID_B)])
    on_loop: list[str] = []
    if storage == "sqlite":  # PostgreSQL's connections are traced by no callback
        node.cache.conn.set_trace_callback(on_loop.append)
    try:
        response = await client.get("/meta")
    finally:
        if storage == "sqlite":
            node.cache.conn.set_trace_callback(None)
    assert response.json() == {"hashIds": rids, "count": 2}
    assert not [sql for sql in on_loop if "cid_index" in sql], on_loop


async def test_a_missing_or_empty_property_is_404(client: httpx.AsyncClient) -> None:
    alice = Signer()
    await register(client, alice)
    await post(client, alice.claim(CID_A, "title", "T"), alice.claim(CID_A, "empty", ""))
    assert (await client.get(f"/meta/{CID_A}/empty")).status_code == 404  # meta-core: "" = none
    envelope(await client.get(f"/meta/{CID_A}/empty"), 404, "not_found")
    envelope(await client.get(f"/meta/{CID_A}/nothing/here"), 404, "not_found")
    envelope(await client.get(f"/meta/{CID_B}"), 404, "unknown_cid")
    envelope(await client.get(f"/meta/{CID_B}/title"), 404, "unknown_cid")
    envelope(await client.get(f"/meta/{rids.Minter().mint()}"), 404, "unknown_rid")
    # meta-core answered 404 for any key it did not hold, and MetaMesh clients read only a 404
    # as missing: a {hash} that is neither a rid nor a CID is missing too, not a bad request
    envelope(await client.get("/meta/not-a-cid"), 404, "unknown_cid")
    envelope(await client.get("/meta/not-a-cid/title"), 404, "unknown_cid")
    envelope(await client.get(f"/meta/{CID_A}/"), 400, "invalid_request")


# -- writes: PATCH /meta/{hash}, PUT /meta/{hash}/{key…} -----------------------------------------


async def test_patch_to_an_unknown_cid_creates_it_signed_by_the_legacy_writer(
    node: Node, client: httpx.AsyncClient
) -> None:
    response = await client.patch(f"/meta/{CID_A}", json={"title": "T", "year": "1999"})
    assert response.status_code == 200, response.text
    rid = await rid_of(client, CID_A)
    assert response.json() == {"success": True, "hashId": rid, "updated": 2, "ignored": []}
    uid = legacy_uid(node)
    key_file = node.settings.keys_dir / "legacy-writer.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    listed = await listed_claims(client, CID_A)
    assert [(c["uid"], c["cid"], c["key"], c["value"]) for c in listed] == [
        (uid, CID_A, "title", "T"),
        (uid, CID_A, "year", "1999"),
    ]
    signers = (await client.get("/api/signers")).json()["signers"]
    row = next(s for s in signers if s["uid"] == uid)
    assert (row["name"], row["weight"], row["may_link"], row["status"]) == (
        "legacy-writer",
        1,
        True,
        "active",
    )
    assert (await client.get(f"/meta/{CID_A}")).json() == {
        "hashId": rid,
        "metadata": {f"cids/{CID_A}": "true", "title": "T", "year": "1999"},
    }


async def test_a_retraction_on_a_cid_no_record_holds_is_404_and_makes_no_record(
    client: httpx.AsyncClient,
) -> None:
    """Clearing a value of a CID the node never saw made an empty record (it joined `/meta`'s
    list and the meta stream); there is nothing to retract, so it is `unknown_cid`. A key the
    node derives itself says so in `ignored`, where it answered success with nothing done."""
    before = (await client.get("/meta")).json()["count"]
    for response in (
        await client.delete(f"/meta/{CID_B}/title"),
        await client.put(f"/meta/{CID_B}/title", json={"value": ""}),
        await client.patch(f"/meta/{CID_B}", json={"title": ""}),
    ):
        envelope(response, 404, "unknown_cid")
    assert (await client.get("/meta")).json()["count"] == before
    await client.patch(f"/meta/{CID_A}", json={"title": "T"})
    put = await client.put(f"/meta/{CID_A}/filePath", content=b"/etc/passwd")
    assert put.status_code == 200 and put.json()["ignored"] == ["filePath"], put.text
    cleared = await client.delete(f"/meta/{CID_A}/title")
    assert cleared.status_code == 200 and "ignored" not in cleared.json(), cleared.text


async def test_put_property_takes_a_value_object_or_a_raw_body(client: httpx.AsyncClient) -> None:
    response = await client.put(f"/meta/{CID_A}/title", json={"value": "From JSON"})
    assert response.status_code == 200, response.text
    rid = await rid_of(client, CID_A)
    assert response.json() == {"success": True, "hashId": rid, "property": "title"}
    assert (await client.get(f"/meta/{CID_A}/title")).text == "From JSON"

    response = await client.put(f"/meta/{CID_A}/title", content="raw text, \u00e9")
    assert response.json() == {"success": True, "hashId": rid, "property": "title"}
    assert (await client.get(f"/meta/{CID_A}/title")).text == "raw text, \u00e9"

    await client.put(f"/meta/{CID_A}/json", content=b'{"other": 1}')  # no "value": stored raw
    assert (await client.get(f"/meta/{CID_A}/json")).text == '{"other": 1}'

    response = await client.put(f"/meta/{rid}/tmdb/poster", content=b"/p.jpg")  # slash key
    assert response.json() == {"success": True, "hashId": rid, "property": "tmdb/poster"}
    assert (await client.get(f"/meta/{CID_A}/tmdb/poster")).text == "/p.jpg"

    for body in ({"value": ""}, {"value": None}):  # "" is a retraction (so is null)
        await client.put(f"/meta/{CID_A}/title", json={"value": "again"})
        response = await client.put(f"/meta/{CID_A}/title", json=body)
        assert response.status_code == 200, response.text
        envelope(await client.get(f"/meta/{CID_A}/title"), 404, "not_found")
    await client.put(f"/meta/{CID_A}/title", content=b"x")
    envelope(await client.put(f"/meta/{CID_A}/title", content=b""), 400, "invalid_request")
    assert (await client.get(f"/meta/{CID_A}/title")).text == "x"  # an empty body wrote nothing
    await client.put(f"/meta/{CID_A}/title", json={"value": ""})
    envelope(await client.get(f"/meta/{CID_A}/title"), 404, "not_found")
    assert [c for c in await listed_claims(client, CID_A) if c["key"] == "title"] == []
    envelope(await client.put(f"/meta/{CID_A}/title", content=b"\xff\xfe"), 400, "invalid_value")


async def test_a_json_property_body_is_read_as_json_and_nothing_else(
    client: httpx.AsyncClient,
) -> None:
    """`{"value":"a","value":"b"}` declared JSON was stored as that text, and `{"value":"a",
    "extra":1}` as `a`: a member named twice is `invalid_json`, an extra one `invalid_request`
    (docs/api.md "Bodies"), declared or not, and nothing is written."""
    await client.put(f"/meta/{CID_A}/title", json={"value": "kept"})
    declared = {"Content-Type": "application/json"}
    for body, headers, slug in (
        (b'{"value": "a", "value": "b"}', declared, "invalid_json"),
        (b'{"value": "a", "extra": 1}', declared, "invalid_request"),
        (b'{"value": "a", "extra": 1}', {}, "invalid_request"),
        (b'{"value": 5}', {}, "invalid_request"),
        (b'"a"', declared, "invalid_request"),  # JSON, but not the object
        (b"plain text", {"Content-Type": "application/merge-patch+json"}, "invalid_json"),
    ):
        for method, path in (("PUT", f"/meta/{CID_A}/title"), ("POST", f"/meta/{CID_A}/_add/t")):
            response = await client.request(method, path, content=body, headers=headers)
            envelope(response, 400, slug)
    assert (await client.get(f"/meta/{CID_A}/title")).text == "kept"
    envelope(await client.get(f"/meta/{CID_A}/t"), 404, "not_found")
    refused = await client.post("/file/cid", json={"path": "media/x.jpg", "extra": 1})
    assert "'extra'" in envelope(refused, 400, "invalid_request")["message"]


async def test_legacy_writes_are_votes_that_merge_not_overwrites(
    node: Node, client: httpx.AsyncClient
) -> None:
    alice, bob = Signer(), Signer()
    await register(client, alice)
    await register(client, bob)
    await post(client, alice.claim(CID_A, "title", "Alpha"), bob.claim(CID_A, "title", "Alpha"))
    await client.patch(f"/meta/{CID_A}", json={"title": "Beta", "note": "mine"})
    assert (await client.get(f"/meta/{CID_A}/title")).text == "Alpha"  # 2 votes against 1
    assert (await client.get(f"/meta/{CID_A}/note")).text == "mine"
    votes = sorted(
        (c["uid"], c["value"]) for c in await listed_claims(client, CID_A) if c["key"] == "title"
    )
    assert votes == sorted([(alice.uid, "Alpha"), (bob.uid, "Alpha"), (legacy_uid(node), "Beta")])
    # a later legacy write beats its own earlier one, whatever the clock says within a millisecond
    for n in range(5):
        await client.put(f"/meta/{CID_A}/note", content=f"v{n}".encode())
    assert (await client.get(f"/meta/{CID_A}/note")).text == "v4"


async def test_a_rid_names_the_canonical_cid_and_a_cid_names_itself(
    node: Node, client: httpx.AsyncClient
) -> None:
    alice = Signer()
    await register(client, alice, may_link=True)
    await post(
        client, alice.claim(CID_A, "title", "A"), alice.claim(CID_A, f"cids/{SHA_A}", "true")
    )
    rid = await rid_of(client, CID_A)
    response = await client.patch(f"/meta/{rid}", json={"genre": "SF"})
    assert response.json() == {"success": True, "hashId": rid, "updated": 1, "ignored": []}
    await client.put(f"/meta/{CID_A}/note", json={"value": "n"})
    await post(client, alice.claim(CID_B, "title", "B"))
    alias = cids.alias(CID_B)
    assert alias is not None
    await client.put(f"/meta/{alias}/note", json={"value": "b"})  # the grouped spelling is used
    uid = legacy_uid(node)
    mine = {(c["cid"], c["key"]) for c in await listed_claims(client, SHA_A) if c["uid"] == uid}
    assert mine == {(SHA_A, "genre"), (CID_A, "note")}
    assert [
        (c["cid"], c["key"]) for c in await listed_claims(client, CID_B) if c["uid"] == uid
    ] == [(CID_B, "note")]
    assert (await client.get("/meta")).json()["count"] == 2


async def test_an_empty_value_retracts_the_legacy_vote_on_every_cid_of_the_group(
    node: Node, client: httpx.AsyncClient
) -> None:
    await client.patch(f"/meta/{CID_A}", json={"note": "first"})  # on CID_A, then canonical
    alice = Signer()
    await register(client, alice, may_link=True)
    await post(client, alice.claim(CID_A, f"cids/{SHA_A}", "true"))  # canonical is now SHA_A
    rid = await rid_of(client, CID_A)
    await client.patch(f"/meta/{rid}", json={"other": "x"})  # names SHA_A
    assert (await client.get(f"/meta/{rid}/note")).text == "first"
    response = await client.patch(f"/meta/{rid}", json={"note": ""})
    assert response.json() == {"success": True, "hashId": rid, "updated": 1, "ignored": []}
    envelope(await client.get(f"/meta/{rid}/note"), 404, "not_found")
    live = {
        (c["cid"], c["key"])
        for c in await listed_claims(client, CID_A)
        if c["uid"] == legacy_uid(node)
    }
    assert live == {(SHA_A, "other")}


async def test_deprecated_fields_are_refused_and_nothing_is_written(
    client: httpx.AsyncClient,
) -> None:
    for field in ("cid_sha256", "cid_midhash256", "midhash256", "canonical_cid"):
        response = await client.patch(f"/meta/{CID_A}", json={"title": "kept out", field: "x"})
        body = envelope(response, 400, "deprecated_field")
        assert body["field"] == field and "cids/<cid>" in body["message"]
        envelope(
            await client.put(f"/meta/{CID_A}/{field}", json={"value": "x"}), 400, "deprecated_field"
        )
    envelope(await client.get(f"/meta/{CID_A}"), 404, "unknown_cid")  # nothing was written


async def test_invalid_fields_get_the_normal_validation_errors_and_nothing_is_written(
    client: httpx.AsyncClient,
) -> None:
    for fields, slug in (
        ({"a//b": "x"}, "invalid_key"),
        ({"cids/not-a-cid": "true"}, "invalid_member_cid"),
        ({"big": "x" * 65_537}, "invalid_value"),
        ({"title": "kept out", "filePath": "/x", "": "empty key"}, "invalid_key"),
    ):
        envelope(await client.patch(f"/meta/{CID_A}", json=fields), 400, slug)
    for body, slug in (
        (b"[1]", "invalid_request"),
        (b'{"n": 1}', "invalid_request"),
        (b"nope", "invalid_json"),
    ):
        envelope(await client.patch(f"/meta/{CID_A}", content=body), 400, slug)
    envelope(await client.get(f"/meta/{CID_A}"), 404, "unknown_cid")
    envelope(await client.patch(f"/meta/{CID_B}", json={}), 404, "unknown_cid")
    envelope(await client.patch(f"/meta/{CID_B}", json={"filePath": "/x"}), 404, "unknown_cid")


# A meta-sort write, as its `buildRecordFields` makes one (meta-sort-core MetadataUtils.ts): the
# file's own facts, the box-local ones among them, and a `cids/<cid>` key-set of sibling hashes.
META_SORT_PATCH = {
    "filePath": "/files/watch/films/Film (2010).mkv",
    "fileSize": "110",
    "sizeByte": "110",
    "mtimeNano": "1764500000000000000",
    "paths/0": "/files/watch/films/Film (2010).mkv",
    "__fields__": "title,year",
    "fileName": "Film (2010).mkv",
    "title": "Film",
    "year": "2010",
    "fileType": "video",
}


async def test_a_meta_sort_patch_links_ignores_box_local_fields_and_claims_the_rest(
    node: Node, client: httpx.AsyncClient
) -> None:
    body = {**META_SORT_PATCH, f"cids/{SHA_A.upper()}": "true"}  # upper-case base32 is read
    response = await client.patch(f"/meta/{CID_A}", json=body)
    assert response.status_code == 200, response.text
    rid = await rid_of(client, CID_A)
    assert response.json() == {
        "success": True,
        "hashId": rid,
        "updated": 5,  # fileName, title, year, fileType and the link
        "ignored": ["__fields__", "filePath", "fileSize", "mtimeNano", "paths/0", "sizeByte"],
    }
    uid = legacy_uid(node)
    mine = sorted((c["cid"], c["key"], c["value"]) for c in await listed_claims(client, CID_A))
    assert mine == sorted(
        [
            (CID_A, f"cids/{SHA_A}", "true"),  # a link vote, the member in canonical spelling
            (CID_A, "fileName", "Film (2010).mkv"),
            (CID_A, "fileType", "video"),
            (CID_A, "title", "Film"),
            (CID_A, "year", "2010"),
        ]
    )
    assert {c["uid"] for c in await listed_claims(client, CID_A)} == {uid}
    assert await rid_of(client, SHA_A) == rid  # the sibling hash is in the record now
    record = (await client.get(f"/meta/{SHA_A}")).json()
    assert record == {
        "hashId": rid,
        "metadata": {
            f"cids/{CID_A}": "true",
            f"cids/{SHA_A}": "true",
            "fileName": "Film (2010).mkv",
            "fileType": "video",
            "title": "Film",
            "year": "2010",
        },
    }


async def test_a_read_modify_write_of_a_record_with_a_local_file_works(
    node: Node, client: httpx.AsyncClient, media: Path
) -> None:
    """meta-sort reads `GET /meta/{hash}`, changes a field and PATCHes the whole record back:
    the synthesised keys (`cids/…`, `filePath`, `fileSize`, `mtimeNano`) ride along."""
    film, _ = write(media / "films" / "film.mkv", b"film bytes " * 10)
    await node.scan([str(media)])
    record = (await client.get(f"/meta/{film}")).json()["metadata"]
    assert {"filePath", "fileSize", "mtimeNano", f"cids/{film}"} <= set(record)
    record["title"] = "Edited"
    response = await client.patch(f"/meta/{film}", json=record)
    assert response.status_code == 200, response.text
    assert response.json()["ignored"] == ["filePath", "fileSize", "mtimeNano"]
    after = (await client.get(f"/meta/{film}")).json()["metadata"]
    assert after == {**record, "title": "Edited"}
    assert after["filePath"].endswith("films/film.mkv")  # still the watcher's, not a claim


async def test_a_read_modify_write_signs_what_it_changes_not_what_it_read(
    node: Node, client: httpx.AsyncClient
) -> None:
    """meta-sort's `/meta` proxy, through which every MetaMesh plugin writes, GETs the whole
    record and PATCHes it all back with the one key it sets. Signing the echo made the legacy
    writer vote for a person's fix and a plugin's parse: the person's retraction then left
    the fix in place (1 echo vote against the plugin's 1, the echo newer), and blocking the
    plugin left its values."""
    person, parser = Signer(), Signer()
    for who, weight in ((person, 100), (parser, 1)):
        body = {"uid": who.uid, "name": "t", "weight": weight, "may_link": False}
        assert (await client.post("/api/signers", json=body)).status_code == 200
    await post(
        client,
        parser.claim(CID_A, "title", "Parsed"),
        parser.claim(CID_A, "year", "1982"),
        person.claim(CID_A, "title", "Fixed"),
    )
    record = (await client.get(f"/meta/{CID_A}")).json()["metadata"]
    response = await client.patch(f"/meta/{CID_A}", json={**record, "tmdbId": "78"})
    assert response.status_code == 200, response.text
    assert response.json()["updated"] == 1
    mine = [c for c in await listed_claims(client, CID_A) if c["uid"] == legacy_uid(node)]
    assert [(c["key"], c["value"]) for c in mine] == [("tmdbId", "78")]
    await post(client, person.claim(CID_A, "title", None, NOW_MS + 1))
    assert (await client.get(f"/meta/{CID_A}/title")).text == "Parsed"
    assert (await client.post(f"/api/signers/{parser.uid}/block")).status_code == 200
    envelope(await client.get(f"/meta/{CID_A}/year"), 404, "not_found")


async def test_an_echo_over_the_legacy_writers_own_earlier_value_is_not_signed(
    node: Node, client: httpx.AsyncClient
) -> None:
    """Every MetaMesh plugin writes through meta-sort, so the legacy writer has a vote on most
    keys of a record a plugin parsed. A person's fix then shows, and the next plugin's PATCH
    of the whole record carried it back: signed, as it went against the legacy writer's own
    older vote, it became the legacy writer's vote, and the person's Revert left the fix in
    place (the very echo `_echoes` is there to drop)."""
    person = Signer()
    body = {"uid": person.uid, "name": "t", "weight": 100, "may_link": False}
    assert (await client.post("/api/signers", json=body)).status_code == 200
    assert (await client.patch(f"/meta/{CID_A}", json={"title": "Parsed"})).status_code == 200
    await post(client, person.claim(CID_A, "title", "Fixed"))
    record = (await client.get(f"/meta/{CID_A}")).json()["metadata"]
    response = await client.patch(f"/meta/{CID_A}", json={**record, "tmdbId": "78"})
    assert response.json()["updated"] == 1, response.text
    mine = [c for c in await listed_claims(client, CID_A) if c["uid"] == legacy_uid(node)]
    assert sorted((c["key"], c["value"]) for c in mine) == [("title", "Parsed"), ("tmdbId", "78")]
    await post(client, person.claim(CID_A, "title", None, NOW_MS + 1))
    assert (await client.get(f"/meta/{CID_A}/title")).text == "Parsed"


async def test_delete_meta_retracts_the_legacy_writers_claims_only(
    node: Node, client: httpx.AsyncClient
) -> None:
    alice = Signer()
    await register(client, alice)
    await post(client, alice.claim(CID_A, "title", "Alice's"))
    await client.patch(f"/meta/{CID_A}", json={"title": "Legacy", "genre": "SF", "note": "n"})
    rid = await rid_of(client, CID_A)
    response = await client.delete(f"/meta/{CID_A}")
    assert response.status_code == 200, response.text
    assert response.json() == {"success": True, "hashId": rid, "deleted": 3}
    assert (await client.get(f"/meta/{rid}")).json()["metadata"] == {
        f"cids/{CID_A}": "true",
        "title": "Alice's",  # another signer's claim stays: claims are never deleted
    }
    assert {c["uid"] for c in await listed_claims(client, CID_A)} == {alice.uid}
    assert (await client.delete(f"/meta/{rid}")).json() == {
        "success": True,
        "hashId": rid,
        "deleted": 0,
    }
    envelope(await client.delete(f"/meta/{CID_B}"), 404, "unknown_cid")
    envelope(await client.delete("/meta/not-a-cid"), 400, "invalid_cid")


async def test_delete_property_retracts_the_legacy_value_of_that_key(
    client: httpx.AsyncClient,
) -> None:
    await client.patch(f"/meta/{CID_A}", json={"title": "T", "tmdb/poster": "/p.jpg"})
    rid = await rid_of(client, CID_A)
    response = await client.delete(f"/meta/{CID_A}/tmdb/poster")
    assert response.status_code == 200, response.text
    assert response.json() == {"success": True, "hashId": rid, "property": "tmdb/poster"}
    envelope(await client.get(f"/meta/{CID_A}/tmdb/poster"), 404, "not_found")
    assert (await client.get(f"/meta/{CID_A}/title")).text == "T"


async def test_add_to_set_appends_a_member_once(client: httpx.AsyncClient) -> None:
    envelope(await client.post(f"/meta/{CID_A}/_add/tags", content=b"a"), 404, "unknown_cid")
    await client.patch(f"/meta/{CID_A}", json={"title": "T"})
    rid = await rid_of(client, CID_A)
    for body, added, value in (
        ({"content": b"drama"}, True, "drama"),
        ({"json": {"value": "sf"}}, True, "drama|sf"),
        ({"content": b"drama"}, False, "drama|sf"),
    ):
        response = await client.post(f"/meta/{CID_A}/_add/tags", **body)  # type: ignore[arg-type]
        assert response.status_code == 200, response.text
        assert response.json() == {
            "success": True,
            "hashId": rid,
            "property": "tags",
            "added": added,
        }
        assert (await client.get(f"/meta/{CID_A}/tags")).text == value
    for empty in (b"", b'{"value": ""}'):
        envelope(
            await client.post(f"/meta/{CID_A}/_add/tags", content=empty), 400, "invalid_request"
        )
    assert (await client.get(f"/meta/{CID_A}/_add/tags")).status_code == 404  # a key, not a set


# meta-stremio's `MetaCoreApiClient.get_property`, as it reached the node (captured between them):
# urllib's request with the one header it sets
STREMIO_PROPERTY_HEADERS = {
    "Accept": "text/plain",
    "Accept-Encoding": "identity",
    "User-Agent": "Python-urllib/3.11",
    "Connection": "close",
}


async def test_the_ids_show_under_metamesh_names_too(node: Node, client: httpx.AsyncClient) -> None:
    """The nfo plugin signs `imdb` and `tmdb`; MetaMesh reads `imdbid` and `tmdbid`: meta-stremio
    answered Stremio's `stream/movie/tt1375666.json` with no stream for a film whose `.nfo`
    names it, and showed no IMDb link. The MetaMesh routes give the value under both names; a
    record's own `imdbid` (a MetaMesh plugin's, through meta-sort) wins, and retracted, the
    nfo's shows again."""
    nfo = Signer()
    await register(client, nfo)
    await post(client, nfo.claim(CID_A, "imdb", "tt1375666"), nfo.claim(CID_A, "tmdb", "27205"))
    rid = await rid_of(client, CID_A)
    metadata = (await client.get(f"/meta/{rid}")).json()["metadata"]
    assert {k: v for k, v in metadata.items() if "db" in k} == {
        "imdb": "tt1375666",
        "imdbid": "tt1375666",
        "tmdb": "27205",
        "tmdbid": "27205",
    }
    asked = await client.get(f"/meta/{rid}/imdbid", headers=STREMIO_PROPERTY_HEADERS)
    assert (asked.status_code, asked.text) == (200, "tt1375666")
    assert (await client.get(f"/meta/{rid}/tmdbid")).text == "27205"

    put = await client.put(f"/meta/{CID_A}/imdbid", json={"value": "tt0000001"})
    assert put.status_code == 200, put.text
    assert (await client.get(f"/meta/{rid}/imdbid")).text == "tt0000001"  # its own wins
    assert (await client.get(f"/meta/{rid}")).json()["metadata"]["imdb"] == "tt1375666"
    assert (await client.delete(f"/meta/{CID_A}/imdbid")).status_code == 200
    assert (await client.get(f"/meta/{rid}/imdbid")).text == "tt1375666"
    assert (await client.get(f"/api/meta/{CID_A}")).json()["metadata"].keys() >= {"imdb"}
    assert "imdbid" not in (await client.get(f"/api/meta/{CID_A}")).json()["metadata"]

    await post(client, nfo.claim(CID_A, "imdb", None, NOW_MS + 1))
    envelope(await client.get(f"/meta/{rid}/imdbid"), 404, "not_found")
    assert "imdbid" not in (await client.get(f"/meta/{rid}")).json()["metadata"]


async def test_an_id_read_under_its_metamesh_name_and_written_back_is_no_vote(
    node: Node, client: httpx.AsyncClient
) -> None:
    """meta-sort's `/meta` proxy (every MetaMesh plugin writes through it) GETs the whole record
    and PATCHes it all back with the key it sets: the `imdbid` it read is the nfo's, so it is an
    echo, not the legacy writer's vote, and goes when the nfo's `imdb` goes."""
    nfo = Signer()
    await register(client, nfo)
    await post(client, nfo.claim(CID_A, "imdb", "tt1375666"))
    record = (await client.get(f"/meta/{CID_A}")).json()["metadata"]
    response = await client.patch(f"/meta/{CID_A}", json={**record, "plot": "A dream."})
    assert (response.status_code, response.json()["updated"]) == (200, 1), response.text
    mine = [c for c in await listed_claims(client, CID_A) if c["uid"] == legacy_uid(node)]
    assert [(c["key"], c["value"]) for c in mine] == [("plot", "A dream.")]
    await post(client, nfo.claim(CID_A, "imdb", None, NOW_MS + 1))
    envelope(await client.get(f"/meta/{CID_A}/imdbid"), 404, "not_found")


async def test_a_cids_field_links_groups_like_any_cids_vote(client: httpx.AsyncClient) -> None:
    alice = Signer()
    await register(client, alice)
    await post(client, alice.claim(CID_A, "title", "A"))
    await post(client, alice.claim(CID_B, "year", "1999"))
    rid_a, rid_b = await rid_of(client, CID_A), await rid_of(client, CID_B)
    assert rid_a < rid_b
    response = await client.patch(f"/meta/{CID_B}", json={f"cids/{CID_A}": "true"})
    assert response.json() == {  # the older rid survives
        "success": True,
        "hashId": rid_a,
        "updated": 1,
        "ignored": [],
    }
    assert (await client.get(f"/meta/{CID_B}")).json() == {
        "hashId": rid_a,
        "metadata": {
            f"cids/{CID_A}": "true",
            f"cids/{CID_B}": "true",
            "title": "A",
            "year": "1999",
        },
    }
    assert envelope(await client.get(f"/meta/{rid_b}"), 404, "merged")["survivor"] == rid_a
    envelope(await client.patch(f"/meta/{rid_b}", json={"x": "y"}), 404, "merged")
    assert (await client.get("/meta")).json() == {"hashIds": [rid_a], "count": 1}


# -- /urls, the perimeter -------------------------------------------------------------------------


async def test_urls_has_no_redis_and_names_the_webdav_root(
    node: Node, client: httpx.AsyncClient
) -> None:
    """`hostname` is the internal URL's host and port: meta-fuse reads WebDAV at
    `http://<hostname>/webdav` (meta-core's nginx on port 80), so a bare host name sent it to
    port 80 of a box where nothing listens."""
    response = await client.get("/urls")
    assert response.status_code == 200
    assert response.json() == {
        "hostname": node.settings.client_url.removeprefix("http://"),
        "baseUrl": "http://node",
        "apiUrl": "http://node",
        "redisUrl": "",
        "webdavUrl": "http://node/webdav",
        "webdavUrlInternal": f"{node.settings.client_url}/webdav",
    }


COMPAT_ROUTES = (
    ("GET", "/meta"),
    ("GET", f"/meta/{CID_A}"),
    ("PATCH", f"/meta/{CID_A}"),
    ("GET", f"/meta/{CID_A}/title"),
    ("PUT", f"/meta/{CID_A}/title"),
    ("DELETE", f"/meta/{CID_A}"),
    ("DELETE", f"/meta/{CID_A}/title"),
    ("POST", f"/meta/{CID_A}/_add/tags"),
    ("GET", "/api/events/meta"),
    ("GET", "/api/events/files"),
    ("GET", f"/api/file/{CID_A}/info"),
    ("GET", f"/file/{CID_A}"),
    ("GET", "/urls"),
    ("GET", "/api/services"),
    ("POST", "/file/cid"),
)


async def test_every_compat_route_needs_the_token_outside_the_trusted_networks(
    node: Node,
) -> None:
    transport = httpx.ASGITransport(app=create_app(node), client=("192.0.2.7", 4000))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as stranger:
        for method, path in COMPAT_ROUTES:
            response = await stranger.request(method, path, content=b"{}")
            envelope(response, 401, "unauthorized")
        with_token = {"Authorization": f"Bearer {node.token}"}
        assert (await stranger.get("/meta", headers=with_token)).status_code == 200
        envelope(
            await stranger.put(f"/meta/{CID_A}", headers=with_token), 405, "method_not_allowed"
        )


def test_a_browser_on_a_trusted_machine_carries_no_page_of_another_site_in(
    launch: Callable[[dict[str, str]], Server],
) -> None:
    """Loopback is trusted, so a browser on the box could carry any site's page in: its
    script read every record (the MetaMesh routes answered CORS `*`), its form or `fetch` wrote
    legacy claims (a simple POST needs no preflight), and a name pointed at 127.0.0.1 after the
    page loaded (DNS rebinding) was same-origin. Programs, which send no `Origin` and name the
    box by an address, a private name or one of `trusted_hosts`, keep the network's trust, and
    the public routes keep CORS."""
    server = launch({"METANODE_WATCH_ENABLED": "0", "METANODE_TRUSTED_HOSTS": "tv.example.com"})
    url, port = server.url, server.port
    created = httpx.patch(f"{url}/meta/{CID_A}", json={"title": "Kept"}, timeout=10)
    assert created.status_code == 200, created.text  # a program: no token, trusted by address
    evil = {"Origin": "http://evil.example"}
    read = httpx.get(f"{url}/meta", headers=evil, timeout=10)
    assert read.status_code == 200 and "access-control-allow-origin" not in read.headers
    public = httpx.get(f"{url}/api/meta/{CID_A}", headers=evil, timeout=10)
    assert public.headers["access-control-allow-origin"] == "*"
    add = f"{url}/meta/{CID_A}/_add/genres"
    for browser in (
        {**evil, "Content-Type": "text/plain"},
        {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
        {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-site"},
    ):
        envelope(httpx.post(add, content=b"injected", headers=browser, timeout=10), 401,
                 "unauthorized")  # fmt: skip
    rebound = {"Host": f"evil.example:{port}"}  # over plain HTTP a browser says nothing more
    said = envelope(httpx.get(f"{url}/meta", headers=rebound, timeout=10), 401, "unauthorized")
    assert "'evil.example:" in said["message"] and "trusted_hosts" in said["message"], said
    names = ("localhost", "metanode:9000", "nas.local", "host.docker.internal", "box.fritz.box")
    # a trailing dot is the same name, fully qualified (a browser sends it as typed)
    dotted = ("localhost.", f"nas.fritz.box.:{port}", "nas.", "tv.example.com.")
    for host in (f"127.0.0.1:{port}", f"[::1]:{port}", *names, *dotted, "tv.example.com"):
        got = httpx.get(f"{url}/meta", headers={"Host": host}, timeout=10)
        assert got.status_code == 200, host  # the last one: trusted_hosts
    for public in ("evil.example.", "fritz.box.evil.example", "."):
        envelope(httpx.get(f"{url}/meta", headers={"Host": public}, timeout=10), 401,
                 "unauthorized")  # fmt: skip
    for odd in ("[", "http://["):  # unparseable: refused as not this box's, never a 500
        weird = {"Host": odd, "Origin": odd, "Content-Type": "text/plain"}
        envelope(httpx.post(add, content=b"x", headers=weird, timeout=10), 401, "unauthorized")
    with_token = {**evil, **server.headers, "Content-Type": "text/plain"}
    assert httpx.post(add, content=b"by token", headers=with_token, timeout=10).status_code == 200
    genres = httpx.get(f"{url}/meta/{CID_A}/genres", timeout=10).text
    assert "injected" not in genres and "by token" in genres, genres


def route_table() -> list[tuple[str, str, str]]:
    """(method, path template, metanode column) of each row of docs/compat.md's route table."""
    text = (Path(__file__).parents[1] / "docs" / "compat.md").read_text()
    rows = []
    for line in text.split("## Routes", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if len(cells) == 4 and cells[0].startswith("`") and " " in cells[0]:
            method, path = cells[0].strip("`").split(" ", 1)
            rows.append((method, path, cells[2]))
    return rows


def served_routes(node: Node) -> set[tuple[str, str]]:
    """(method, path template) of every route the compatibility layer serves, HEAD aside."""
    served = set()
    for route in compat.routes(node):
        if isinstance(route, Mount):  # WebDAV: its reads, on any path below the mount
            served |= {("PROPFIND", f"{route.path}/{{path}}"), ("GET", f"{route.path}/{{path}}")}
            continue
        if getattr(route, "path", None) == webdav.MOUNT:  # its redirect to the mount's root
            continue
        for method in getattr(route, "methods", None) or {"GET"}:
            if method != "HEAD":
                served.add((method, route.path.replace(":path}", "}")))  # type: ignore[attr-defined]
    return served


async def test_the_route_table_is_what_the_node_serves(
    node: Node, client: httpx.AsyncClient
) -> None:
    rows = route_table()
    assert len(rows) > 20
    compat_rows = {
        (method, path)
        for method, path, said in rows
        if not said.startswith(("not served", "native"))
    }
    assert compat_rows == served_routes(node)
    rid = rids.Minter().mint()
    transport = httpx.ASGITransport(app=create_app(node), client=("127.0.0.1", 4000))
    tokenless = httpx.AsyncClient(transport=transport, base_url="http://node")
    for method, path, said in rows:
        if not said.startswith(("not served", "native")):
            continue  # served: the tests of each route (a stream would never end here)
        concrete = path.replace("{hash}", CID_A).replace("{hashId}", rid)
        response = await client.request(method, concrete)
        if said.startswith("not served"):
            status = int(said.split("(", 1)[1][:3])
            slug = {404: "not_found", 405: "method_not_allowed"}[status]
            envelope(response, status, slug)
            envelope(await tokenless.request(method, concrete), status, slug)  # a consumer
        elif said.startswith("native"):
            assert response.status_code not in (404, 405) or response.json()["error"] not in (
                "not_found",
                "method_not_allowed",
            ), (method, path)
    await tokenless.aclose()


async def test_api_services_lists_this_node_only(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/services")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 1 and len(body["services"]) == 1
    this = body["services"][0]
    heartbeat = this.pop("lastHeartbeat")
    assert this == {
        "name": "metanode",
        "hostname": socket.gethostname(),
        "baseUrl": "http://node",
        "apiUrl": "http://node",
        "healthUrl": "http://node/health",
        "status": "running",
    }
    assert heartbeat.endswith("Z") and len(heartbeat) == len("2026-01-01T00:00:00Z")
    assert (await client.get("/health")).status_code == 200  # the health URL answers
    # meta-stremio's navigation asks meta-core's older path, naming itself: it got a 404
    older = (await client.get("/services", params={"current": "meta-stremio"})).json()
    assert older["current"] == "meta-stremio" and older["services"][0]["name"] == "metanode"


async def test_api_services_lists_the_services_registered_in_the_metamesh_volume(
    tmp_path: Path,
) -> None:
    """meta-core listed the registrations the consumers write to `<volume>/services/`; this
    node listed itself alone, so every consumer's navigation lost its links to the others."""
    volume = tmp_path / "meta-core"
    (volume / "services").mkdir(parents=True)
    now = datetime.datetime.now(datetime.UTC)
    beats = {"meta-fuse-box": now, "meta-sort-box": now - datetime.timedelta(minutes=5)}
    for name, beat in beats.items():
        registration = {
            "name": name.removesuffix("-box"),
            "hostname": "box",
            "baseUrl": f"http://{name}:8080",
            "status": "running",
            "lastHeartbeat": beat.isoformat().replace("+00:00", "Z"),
        }
        (volume / "services" / f"{name}.json").write_text(json.dumps(registration))
    (volume / "services" / "broken.json").write_text("{not json")
    node = Node(settings_for(tmp_path / "data", metamesh_volume=str(volume)))
    await node.start()
    try:
        transport = httpx.ASGITransport(app=create_app(node))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            body = (await client.get("/api/services")).json()
    finally:
        await node.stop()
    assert [(s["name"], s["status"]) for s in body["services"]] == [
        ("metanode", "running"),
        ("meta-fuse", "running"),
        ("meta-sort", "stale"),  # its heartbeat is five minutes old
    ]
    assert body["count"] == 3 and body["services"][1]["baseUrl"] == "http://meta-fuse-box:8080"


# -- GET /api/file/{cid}/info, GET /file/{cid} ---------------------------------------------------


@pytest.fixture
def media(node: Node) -> Path:
    """The node's watch root (tests/helpers/settings.py: data_dir.parent / "media")."""
    root = Path(node.settings.watch_roots[0])
    root.mkdir(parents=True, exist_ok=True)
    return root


def write(path: Path, data: bytes) -> tuple[str, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return watcher.midhash_file(path)[0], path


async def test_post_file_cid_hashes_a_file_named_as_file_path_names_it(
    node: Node, client: httpx.AsyncClient, media: Path
) -> None:
    """MetaMesh's plugins ask meta-core for a file's sha256 CID in the same call (jellyfin-nfo
    its poster, subtitle a sibling file): 405 here, so they got none."""
    data = b"poster bytes " * 100_000  # more than one read of the hash
    write(media / "art" / "poster.jpg", data)
    expected = cids.encode(cids.RAW, cids.SHA2_256, hashlib.sha256(data).digest())
    for asked in ("media/art/poster.jpg", "/files/media/art/poster.jpg"):
        answer = await client.post("/file/cid", json={"path": asked})
        assert answer.json() == {"cid": expected, "path": asked, "size": len(data)}
    write(media.parent / "outside" / "poster.jpg", data)
    (media / "out").symlink_to(media.parent / "outside")  # a link out: not followed by default
    for asked, status, slug in (
        ("media/art", 400, "invalid_request"),  # a folder
        ("media/art/missing.jpg", 404, "not_found"),
        ("elsewhere/poster.jpg", 404, "not_found"),  # no root of that name
        ("media/../media/art/poster.jpg", 404, "not_found"),
        ("media/out/poster.jpg", 404, "not_found"),  # through the link out
        ("media/art/poster.jpg\x00.txt", 400, "invalid_request"),  # realpath: ValueError
        ("media/\ud800", 400, "invalid_request"),  # a lone surrogate: UnicodeEncodeError
    ):
        body = json.dumps({"path": asked}).encode()  # `\ud800` escaped, as a client sends it
        answer = await client.post("/file/cid", content=body)
        assert (answer.status_code, answer.json()["error"]) == (status, slug), asked
    refused = await client.post("/file/cid", json={"file": "media/art/poster.jpg"})
    assert (refused.status_code, refused.json()["error"]) == (400, "invalid_request")


async def test_file_info_is_always_200(node: Node, client: httpx.AsyncClient, media: Path) -> None:
    film, path = write(media / "films" / "film.mp4", b"film bytes " * 10)
    await node.scan([str(media)])
    for cid in (CID_B, "not-a-cid"):
        response = await client.get(f"/api/file/{cid}/info")
        assert (response.status_code, response.json()) == (200, {"exists": False})
    expected = {
        "exists": True,
        "contentType": "video/mp4",
        "size": 110,
        "filePath": "media/films/film.mp4",  # the WebDAV path: the root's collection, then below
    }
    assert (await client.get(f"/api/file/{film}/info")).json() == expected

    alice = Signer()
    await register(client, alice, may_link=True)
    await post(
        client,
        alice.claim(film, "mimeType", "video/x-test"),
        alice.claim(film, f"cids/{SHA_A}", "true"),
    )
    expected["contentType"] = "video/x-test"  # the record's mimeType wins over the guess
    for cid in (film, SHA_A):  # any CID of the group finds the content
        assert (await client.get(f"/api/file/{cid}/info")).json() == expected

    with path.open("ab") as out:  # changed on disk, not yet rehashed: no longer that content
        out.write(b"more")
    assert (await client.get(f"/api/file/{film}/info")).json() == {"exists": False}
    envelope(await client.get(f"/file/{film}"), 404, "unknown_cid")


async def test_file_bytes_with_range_and_last_modified(
    node: Node, client: httpx.AsyncClient, media: Path
) -> None:
    data = bytes(range(256)) * 4
    poster, path = write(media / "poster.jpg", data)
    await node.scan([str(media)])
    modified = formatdate(path.stat().st_mtime, usegmt=True)

    response = await client.get(f"/file/{poster}")
    assert response.status_code == 200 and response.content == data
    assert response.headers["content-type"] == "image/jpeg"
    assert response.headers["content-length"] == "1024"
    assert response.headers["accept-ranges"] == "bytes"
    assert response.headers["last-modified"] == modified
    alias = cids.alias(poster)
    assert alias is not None
    assert (await client.get(f"/file/{alias}")).content == data

    for wanted, status, body, content_range in (
        ("bytes=0-9", 206, data[:10], "bytes 0-9/1024"),
        ("bytes=-16", 206, data[-16:], "bytes 1008-1023/1024"),
        ("bytes=1000-", 206, data[1000:], "bytes 1000-1023/1024"),
        ("bytes=1000-5000", 206, data[1000:], "bytes 1000-1023/1024"),
    ):
        response = await client.get(f"/file/{poster}", headers={"Range": wanted})
        assert (response.status_code, response.content) == (status, body), wanted
        assert response.headers["content-range"] == content_range
        assert response.headers["last-modified"] == modified

    for wanted in ("bytes=1024-", "bytes=5000-6000", "bytes=5-2", "items=0-1", "bytes=+5-10"):
        response = await client.get(f"/file/{poster}", headers={"Range": wanted})
        assert response.status_code == 416, wanted
        assert response.json() == {
            "error": "range_not_satisfiable",
            "retryable": False,
            "message": f"range {wanted!r} cannot be served from 1024 bytes",
        }
        assert response.headers["content-range"] == "bytes */1024"

    stale = {"Range": "bytes=0-9", "If-Range": "Mon, 01 Jan 2001 00:00:00 GMT"}
    response = await client.get(f"/file/{poster}", headers=stale)
    assert (response.status_code, response.content) == (200, data)  # If-Range: whole file
    response = await client.get(f"/file/{poster}", headers={**stale, "If-Range": modified})
    assert (response.status_code, response.content) == (206, data[:10])
    response = await client.head(f"/file/{poster}")
    assert (response.status_code, response.content) == (200, b"")
    assert response.headers["content-length"] == "1024"

    envelope(await client.get(f"/file/{CID_B}"), 404, "unknown_cid")
    envelope(await client.get("/file/not-a-cid"), 400, "invalid_cid")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def swap_in(path: Path, replacement: Path) -> None:
    """Replace `path` atomically by a symbolic link to `replacement`."""
    link = path.with_name(path.name + ".swap")
    link.symlink_to(replacement)
    link.replace(path)


async def test_a_path_swapped_after_hashing_is_never_served(
    node: Node, client: httpx.AsyncClient, media: Path, tmp_path: Path
) -> None:
    """The content route serves the file that was hashed or nothing: not a symbolic link swapped
    in later, not a file of equal size and mtime renamed over it, not a path through a linked
    folder leading out of the watch root; and it leaves no descriptor open."""
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(b"S" * 64)
    film, path = write(media / "film.mkv", b"F" * 64)
    stamp = secret.stat().st_mtime_ns
    os.utime(path, ns=(stamp, stamp))  # the same size and mtime as the file it will be swapped for
    await node.scan([str(media)])
    before = open_fds()
    assert (await client.get(f"/file/{film}")).content == b"F" * 64

    swap_in(path, secret)  # 1. a link to a file outside the root, same size and mtime
    envelope(await client.get(f"/file/{film}"), 404, "unknown_cid")
    assert (await client.get(f"/api/file/{film}/info")).json() == {"exists": False}

    hard = tmp_path / "hard"  # 2. a hard link to the outside file renamed over the path
    os.link(secret, hard)
    hard.replace(path)
    assert path.stat().st_size == 64 and path.stat().st_mtime_ns == stamp
    envelope(await client.get(f"/file/{film}"), 404, "unknown_cid")

    folder = media / "shows"  # 3. a folder swapped for a link leading out of the root
    episode, _ = write(folder / "e01.mkv", b"E" * 64)
    await node.scan([str(media)])
    assert (await client.get(f"/file/{episode}")).content == b"E" * 64
    elsewhere = tmp_path / "elsewhere"
    folder.rename(elsewhere)
    folder.symlink_to(elsewhere, target_is_directory=True)
    envelope(await client.get(f"/file/{episode}"), 404, "unknown_cid")
    assert open_fds() == before


async def test_links_are_served_when_the_owner_follows_them(tmp_path: Path) -> None:
    """With `watch_follow_symlinks`, a linked file is what was hashed, so it is served; the
    inode check still refuses a different file swapped in behind the link."""
    media, elsewhere = tmp_path / "media", tmp_path / "elsewhere"
    media.mkdir()
    elsewhere.mkdir()
    target = elsewhere / "film.mkv"
    target.write_bytes(b"L" * 32)
    (media / "film.mkv").symlink_to(target)
    n = Node(settings_for(tmp_path / "data", watch_follow_symlinks=True))
    await n.start()
    try:
        await n.scan([str(media)])
        film = watcher.midhash_file(target)[0]
        transport = httpx.ASGITransport(app=create_app(n))
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://node",
            headers={"Authorization": f"Bearer {n.token}"},
        ) as c:
            assert (await c.get(f"/file/{film}")).content == b"L" * 32
            other = elsewhere / "other"  # exists beside the target: a different inode
            other.write_bytes(b"M" * 32)
            stamp = target.stat().st_mtime_ns
            os.utime(other, ns=(stamp, stamp))
            other.replace(target)
            envelope(await c.get(f"/file/{film}"), 404, "unknown_cid")
    finally:
        await n.stop()


async def test_rows_hashed_before_inodes_were_kept_are_hashed_again(
    node: Node, client: httpx.AsyncClient, media: Path
) -> None:
    """A local_file row from an older cache has no inode: it is not served until the next
    reconciliation hashes the file again and records it (with no feed event: nothing changed)."""
    film, _ = write(media / "film.mkv", b"F" * 64)
    await node.scan([str(media)])
    await node.cache.writer.run(lambda conn: conn.execute("UPDATE local_file SET ino = 0"))
    envelope(await client.get(f"/file/{film}"), 404, "unknown_cid")
    seq = node.applier.state.feed_seq
    summary = await node.scan([str(media)])
    assert summary.hashed == 1
    assert (await client.get(f"/file/{film}")).content == b"F" * 64
    assert node.applier.state.feed_seq == seq


async def test_a_file_rewritten_with_its_size_and_mtime_put_back_is_not_served_as_before(
    node: Node, client: httpx.AsyncClient, media: Path
) -> None:
    """Same inode, size and mtime, new bytes: only the ctime tells. The old CID is not served
    the new bytes while the watcher has not hashed them; once it has, the new CID is served.
    A chmod moves the ctime too: the file waits for its hash again, then is served as before."""
    old, path = write(media / "song.flac", b"A" * 64)
    await node.scan([str(media)])
    rewrite_in_place(path, b"B" * 64)
    envelope(await client.get(f"/file/{old}"), 404, "unknown_cid")
    await node.scan([str(media)])
    new = cids.midhash_bytes(b"B" * 64)
    assert (await client.get(f"/file/{new}")).content == b"B" * 64
    os.chmod(path, 0o600)
    envelope(await client.get(f"/file/{new}"), 404, "unknown_cid")
    await node.scan([str(media)])
    assert (await client.get(f"/file/{new}")).content == b"B" * 64


# -- file events in the cache (pure, and through local_txn) --------------------------------------


def lf(path: str, midhash: str, size: int = 1, mtime: int = 1) -> merge.LocalFile:
    return merge.LocalFile(path, midhash, size, mtime)


def test_file_events_pair_a_removal_and_an_upsert_of_the_same_content_as_a_rename() -> None:
    removed = {
        "/m/a.mkv": ("M1", 5, 1),
        "/m/x/b.mkv": ("M2", 6, 1),
        "/m/y/b.mkv": ("M2", 6, 1),
        "/m/gone.mkv": ("M3", 7, 1),
    }
    written = [
        (lf("/m/new.mkv", "M9", 9), True),
        (lf("/m/old.mkv", "M8", 8), False),
        (lf("/m/c.mkv", "M1", 5), True),
        (lf("/m/z/b.mkv", "M2", 6), True),
    ]
    assert cache.file_events(removed, written) == [
        cache.FileEvent("delete", "/m/gone.mkv", None, 7, "M3"),
        cache.FileEvent("delete", "/m/y/b.mkv", None, 6, "M2"),
        cache.FileEvent("add", "/m/new.mkv", None, 9, "M9"),
        cache.FileEvent("change", "/m/old.mkv", None, 8, "M8"),
        cache.FileEvent("rename", "/m/c.mkv", "/m/a.mkv", 5, "M1"),
        cache.FileEvent("rename", "/m/z/b.mkv", "/m/x/b.mkv", 6, "M2"),
    ]  # first of same name


async def test_local_txn_appends_file_events_on_a_dense_counter(node: Node) -> None:
    m1, m2 = CID_A, CID_B
    await node.ensure_groups([m1, m2])

    async def rows_after(
        calls: list[tuple[list[merge.LocalFile], list[str]]],
    ) -> list[tuple[Any, ...]]:
        head = cache.file_feed_head(node.cache.conn)
        for files, removals in calls:
            await node.apply_local(files, removals)
        return node.cache.conn.execute(
            "SELECT seq, op, path, old_path, size, midhash FROM file_feed WHERE seq > ? "
            "ORDER BY seq",
            (head,),
        ).fetchall()

    assert await rows_after([([lf("/m/a", m1, 3)], [])]) == [(1, "add", "/m/a", None, 3, m1)]
    assert await rows_after([([lf("/m/a", m1, 3)], [])]) == []  # nothing changed: no event
    assert await rows_after([([lf("/m/a", m2, 4, 2)], [])]) == [(2, "change", "/m/a", None, 4, m2)]
    assert await rows_after([([lf("/m/d/b", m2, 4, 2)], ["/m/a"])]) == [
        (3, "rename", "/m/d/b", "/m/a", 4, m2)
    ]
    assert await rows_after([([lf("/m/d/b", m2, 4, 2)], ["/m/d/b"])]) == []  # gone and back
    assert await rows_after([([], ["/m/d"])]) == [(4, "delete", "/m/d/b", None, 4, m2)]
    assert cache.file_feed_head(node.cache.conn) == 4
    at = node.cache.conn.execute("SELECT min(at), max(at) FROM file_feed").fetchone()
    assert abs(at[0] - time.time() * 1000) < 60_000 and abs(at[1] - time.time() * 1000) < 60_000


def test_an_existing_cache_gains_the_file_feed_table(tmp_path: Path) -> None:
    conn = db.connect(tmp_path / "cache.db")
    try:
        db.migrate(conn, cache.MIGRATIONS[:2])  # a cache.db from before file events
        assert db.migrate(conn, cache.MIGRATIONS) == len(cache.MIGRATIONS)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(cache.MIGRATIONS)
        assert conn.execute("SELECT count(*) FROM file_feed").fetchone()[0] == 0
        assert cache.file_feed_head(conn) == 0
    finally:
        conn.close()


# -- the streams' logic, in-process (the generator itself, no HTTP) ------------------------------


async def take(
    node: Node, kind: type[compat._Follow[Any]], cursor: str | None, n: int
) -> list[ServerSentEvent]:
    """The first `n` events (a comment counts) of a stream, from its chunks of whole frames."""
    stream = kind(node, sse.parse_cursor(cursor)).stream()
    events: list[ServerSentEvent] = []
    try:
        while len(events) < n:
            events += parse_chunk(await asyncio.wait_for(anext(stream), WAIT_S))
        return events[:n]
    finally:
        await stream.aclose()


def parse_chunk(chunk: bytes) -> list[ServerSentEvent]:
    """Whole SSE frames (each field on one line, as the streams send them) as events."""
    events = []
    for frame in chunk.decode().split("\n\n"):
        if frame:
            fields = dict(line.split(": ", 1) for line in frame.split("\n"))
            events.append(
                ServerSentEvent(
                    data=fields.get("data"),
                    event=fields.get("event"),
                    id=fields.get("id"),
                    comment=fields.get(""),
                )
            )
    return events


def data(event: ServerSentEvent) -> Any:
    return json.loads(str(event.data))


async def test_the_files_stream_gives_a_gap_and_the_full_state_for_a_pruned_cursor(
    node: Node,
) -> None:
    await node.ensure_groups([CID_A, CID_B])
    await node.apply_local([lf("/elsewhere/a", CID_A)], [])
    await node.apply_local([lf("/elsewhere/b", CID_B)], [])
    await node.apply_local([], ["/elsewhere/a"])
    epoch = node.applier.state.epoch
    head = f"{epoch}-3"
    resumed = await take(node, compat.FilesFollow, f"{epoch}-1", 2)
    assert [(e.event, e.id, data(e)["path"]) for e in resumed] == [
        ("add", f"{epoch}-2", "elsewhere/b"),
        ("delete", head, "elsewhere/a"),
    ]

    await node.cache.writer.run(cache.prune_feed_txn, 1, 0)  # keeps only the newest file event
    for cursor, reason in (
        (f"{epoch}-1", "retention"),
        (f"{epoch}-9", "future"),
        ("0-0", "unknown_epoch"),
        (f"{epoch + 1}-2", "unknown_epoch"),
    ):
        gap, reset, add = await take(node, compat.FilesFollow, cursor, 3)
        assert (gap.event, gap.id, data(gap)) == (
            "gap",
            f"{head}.0",
            {"reason": reason, "requested": cursor, "resumeFrom": f"{head}.0"},
        )
        assert (reset.event, reset.id, list(data(reset))) == (
            "reset",
            f"{head}.1",
            ["path", "timestamp"],
        )
        assert (add.event, add.id, data(add)["path"]) == ("add", head, "elsewhere/b")
    kept = await take(node, compat.FilesFollow, f"{epoch}-2", 1)  # everything after it is kept
    assert [(e.event, e.id) for e in kept] == [("delete", head)]


async def test_the_meta_stream_resumes_and_replays(node: Node, client: httpx.AsyncClient) -> None:
    alice = Signer()
    await register(client, alice)
    await post(client, alice.claim(CID_A, "title", "T"))  # events 1-2: cids/…, title
    rid = await rid_of(client, CID_A)
    epoch = node.applier.state.epoch
    gap, first, last = await take(node, compat.MetaFollow, "0-0", 3)
    start = f"{epoch}-2.0"
    assert (gap.id, data(gap)) == (
        start,
        {"reason": "unknown_epoch", "requested": "0-0", "resumeFrom": start},
    )
    assert [(e.event, e.id, data(e)["key"]) for e in (first, last)] == [
        ("set", f"{epoch}-2.1", f"file:{rid}/cids/{CID_A}"),
        ("set", f"{epoch}-2", f"file:{rid}/title"),
    ]
    (replayed,) = await take(node, compat.MetaFollow, f"{epoch}-1", 1)
    assert (replayed.event, replayed.id, data(replayed)["key"]) == (
        "set",
        f"{epoch}-2",
        f"file:{rid}/title",
    )
    row_at = node.cache.conn.execute("SELECT at FROM feed WHERE seq = 2").fetchone()[0]
    assert data(replayed) == {"key": f"file:{rid}/title", "ts": str(row_at)}


async def until_seq(stream: Any, seq: str) -> list[ServerSentEvent]:
    """Events of `stream` up to and including the one with id `seq`."""
    events: list[ServerSentEvent] = []
    while not events or events[-1].id != seq:
        events += parse_chunk(await asyncio.wait_for(anext(stream), WAIT_S))
    return events


async def test_the_meta_stream_names_an_id_as_metamesh_does_too(
    node: Node, client: httpx.AsyncClient
) -> None:
    """A change of `imdb` comes after the same event on `imdbid` (no id: the cursor names the
    row's own event), a `del` after `del` and `set` of it (the record may hold an `imdbid` of
    its own, which a consumer then reads again); the full state sets both. meta-fuse keeps in
    its view only the properties it has seen a `set` for, so a renaming rule with `{imdbid}`
    had nothing from an `.nfo`."""
    nfo = Signer()
    await register(client, nfo)
    await post(client, nfo.claim(CID_A, "title", "T"))  # events 1-2: cids/…, title
    rid = await rid_of(client, CID_A)
    epoch = node.applier.state.epoch
    await post(client, nfo.claim(CID_A, "imdb", "tt1375666"))  # event 3
    await post(client, nfo.claim(CID_A, "imdb", None, NOW_MS + 1))  # event 4
    got = await take(node, compat.MetaFollow, f"{epoch}-2", 5)
    assert [(e.event, e.id, data(e)["key"]) for e in got] == [
        ("set", None, f"file:{rid}/imdbid"),
        ("set", f"{epoch}-3", f"file:{rid}/imdb"),
        ("del", None, f"file:{rid}/imdbid"),
        ("set", None, f"file:{rid}/imdbid"),
        ("del", f"{epoch}-4", f"file:{rid}/imdb"),
    ]
    await post(client, nfo.claim(CID_A, "imdb", "tt0816692", NOW_MS + 2))  # event 5
    _, *state = await take(node, compat.MetaFollow, "0-0", 5)
    assert [(e.event, e.id, data(e)["key"]) for e in state] == [
        ("set", f"{epoch}-5.1", f"file:{rid}/cids/{CID_A}"),
        ("set", f"{epoch}-5.2", f"file:{rid}/imdbid"),
        ("set", f"{epoch}-5.3", f"file:{rid}/imdb"),
        ("set", f"{epoch}-5", f"file:{rid}/title"),
    ]


async def test_many_meta_subscribers_share_one_read_per_page(
    node: Node, client: httpx.AsyncClient, backend: str
) -> None:
    """40 MetaMesh meta-stream subscribers and 10 of /api/events at the head: one batch of new
    events costs one read of the feed table, not one per subscriber (one shared feed.Hub). The
    reads are counted through SQLite's trace callback; on PostgreSQL only the delivery is
    checked."""
    alice = Signer()
    await register(client, alice)
    await post(client, alice.claim(CID_A, "title", "T"))  # events 1-2
    # a replay first: the hub reads page 0 and learns the cache's epoch (it was created before
    # the cache was built), so what follows counts only the reads the new events cost
    await take(node, compat.MetaFollow, sse.event_id(node.applier.state.epoch, 1), 1)
    statements: list[str] = []
    traced = backend == "sqlite"
    if traced:
        node.cache.conn.set_trace_callback(statements.append)
    meta = [compat.MetaFollow(node, None).stream() for _ in range(40)]
    native = [node.subscribe(None, False, sse.Filter()) for _ in range(10)]
    try:
        waiting = [asyncio.create_task(anext(stream)) for stream in [*meta, *native]]
        await post(
            client,
            *[
                alice.claim(cids.midhash_bytes(b"share %d" % i), "title", f"v{i}")
                for i in range(100)
            ],
        )  # events 3-202
        head = sse.event_id(node.applier.state.epoch, 202)
        for stream, first in zip([*meta, *native], waiting, strict=True):
            got = parse_chunk(await asyncio.wait_for(first, WAIT_S))
            if got[-1].id != head:
                got += await until_seq(stream, head)
            assert [e.id for e in got] == [
                sse.event_id(node.applier.state.epoch, seq) for seq in range(3, 203)
            ]
        assert {e.event for e in got} == {"set"}
    finally:
        if traced:
            node.cache.conn.set_trace_callback(None)
        for stream in [*meta, *native]:
            await stream.aclose()
    feed_reads = [s for s in statements if "FROM feed WHERE seq >" in s]
    assert not traced or 1 <= len(feed_reads) <= 2, feed_reads  # 2: the applier published twice


@pytest.fixture
async def quiet_node(tmp_path: Path) -> Any:
    """A node whose streams send a keep-alive after 0.2 s of silence, with 60 feed events and
    12 file events of which retention kept the newest 8 of each."""
    n = Node(settings_for(tmp_path / "data", feed_keep_alive_s=0.2))
    await n.start()
    try:
        await n.applier.wait_for(0, WAIT_S)
        signer = Signer()
        await n.add_signer(signer.uid, "test", 1, False)
        answer = await n.ingest_wire(
            [signer.claim(cids.midhash_bytes(b"h %d" % i), "title", f"t{i}") for i in range(30)]
        )
        assert answer.status == 200
        files = [cids.midhash_bytes(b"f %d" % i) for i in range(8)]
        await n.ensure_groups(files)
        for i, midhash in enumerate(files):  # 8 adds, then 4 deletes
            await n.apply_local([lf(f"/elsewhere/{i}", midhash, i + 1)], [])
        for i in range(4):
            await n.apply_local([], [f"/elsewhere/{i}"])
        await n.cache.writer.run(cache.prune_feed_txn, 8, 0)
        yield n
    finally:
        await n.stop()


async def until_quiet(
    node: Node, kind: type[compat._Follow[Any]], cursor: str
) -> list[ServerSentEvent]:
    """Everything a stream sends before its first keep-alive, which it sends only once it has
    sent every event it has (so no timing decides what comes before it)."""
    stream = kind(node, sse.parse_cursor(cursor)).stream()
    events: list[ServerSentEvent] = []
    try:
        while not events or events[-1].comment is None:
            events += parse_chunk(await asyncio.wait_for(anext(stream), WAIT_S))
    finally:
        await stream.aclose()
    return events[:-1]


def meta_table(node: Node, after: int) -> tuple[list[Any], list[Any]]:
    """(every event after `after` as the meta stream frames it, its full state), from the
    tables themselves."""
    epoch, conn = node.applier.state.epoch, node.cache.conn
    rows = conn.execute(
        "SELECT seq, rid, op, key, at FROM feed WHERE seq > ? ORDER BY seq", (after,)
    ).fetchall()
    events = [
        (op, sse.event_id(epoch, seq), {"key": f"file:{rid}/{key}", "ts": str(at)})
        for seq, rid, op, key, at in rows
    ]
    state = [
        ("set", {"key": f"file:{rid}/{key}"})
        for rid, key in conn.execute("SELECT rid, key FROM records ORDER BY rid, key")
    ]
    return events, state


def files_table(node: Node, after: int) -> tuple[list[Any], list[Any]]:
    """The same for the files stream (paths outside every root lose their leading `/`)."""
    epoch, conn = node.applier.state.epoch, node.cache.conn
    rows = conn.execute(
        "SELECT seq, op, path, size, midhash, at FROM file_feed WHERE seq > ? ORDER BY seq",
        (after,),
    ).fetchall()
    events = [
        (
            op,
            sse.event_id(epoch, seq),
            {"midhash256": midhash, "path": path[1:], "size": str(size), "timestamp": str(at)},
        )
        for seq, op, path, size, midhash, at in rows
    ]
    state = [("reset", {"path": ""})] + [
        ("add", {"midhash256": m, "path": p[1:], "size": str(z)})
        for p, m, z in conn.execute("SELECT path, midhash, size FROM local_file ORDER BY path")
    ]
    return events, state


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # examples only read
@given(draw=st.data(), files=st.booleans())
async def test_meta_stream_replay_agrees_with_the_table_whatever_the_cursor(
    quiet_node: Node, draw: st.DataObject, files: bool
) -> None:
    """Any cursor, of any epoch and any seq (pruned, retained, at the head, in the future):
    either exactly the table's events after it, or a gap by the resume rule and then the full
    state from the tables, whose last event carries the head's id."""
    node = quiet_node
    kind: type[compat._Follow[Any]] = compat.FilesFollow if files else compat.MetaFollow
    state = node.applier.state
    head = state.file_feed_seq if files else state.feed_seq
    table = "file_feed" if files else "feed"
    oldest = node.cache.conn.execute(f"SELECT min(seq) FROM {table}").fetchone()[0]
    epoch = draw.draw(st.just(state.epoch) | st.sampled_from([state.epoch - 1, state.epoch + 1, 0]))
    edges = [oldest - 2, oldest - 1, oldest, head - 1, head, head + 1]  # where the rule turns
    seq = draw.draw(st.sampled_from(edges) | st.integers(0, head + 3))
    cursor = sse.event_id(epoch, seq)
    got = await until_quiet(node, kind, cursor)
    events, full = (files_table if files else meta_table)(node, seq)
    reason = (
        "unknown_epoch"
        if epoch != state.epoch
        else "future"
        if seq > head
        else "retention"
        if seq < oldest - 1
        else None
    )
    if reason is None:
        assert [(e.event, e.id, json.loads(str(e.data))) for e in got] == events
        return
    gap, *rest = got
    marker = sse.event_id(state.epoch, head)
    assert (gap.event, gap.id, json.loads(str(gap.data))) == (
        "gap",
        f"{marker}.0",
        {"reason": reason, "requested": cursor, "resumeFrom": f"{marker}.0"},
    )
    numbered = [sse.state_id(state.epoch, head, n) for n in range(1, len(full))]
    assert [e.id for e in rest] == [*numbered, marker]
    shown = [
        (
            e.event,
            {k: v for k, v in json.loads(str(e.data)).items() if k not in ("ts", "timestamp")},
        )
        for e in rest
    ]
    assert shown == full


# -- the streams on a real server -----------------------------------------------------------------


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Server]]:
    started: list[Server] = []

    def start(env: dict[str, str]) -> Server:
        server = Server(tmp_path / "data", env=env).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_hashes_asked_at_once_leave_the_nodes_threads_to_the_rest(
    launch: Callable[[dict[str, str]], Server],
) -> None:
    """`POST /file/cid` reads its whole file on a thread of the default pool, which the
    watcher, `/file/{cid}`'s open and the applier share: eight asked at once for one 20 GB file
    held all six threads of a 2-core box, and `/api/file/{cid}/info` waited 133 s. At most
    `compat.HASHING` hash at once now; the rest wait their turn, and the info is answered
    before any of them."""
    server = launch({})
    server.media.mkdir(parents=True, exist_ok=True)
    film = server.media / "film.mkv"
    film.write_bytes(b"a film " * 100_000)
    big = server.media / "big.bin"
    with big.open("wb") as out:
        out.truncate(1 << 30)  # sparse: read as zeros, without the disk
    cid = watcher.midhash_file(film)[0]
    info = f"{server.url}/api/file/{cid}/info"
    poll(lambda: httpx.get(info, timeout=WAIT_S).json()["exists"] or None, "the film hashed")
    assert server.proc is not None
    fds = Path(f"/proc/{server.proc.pid}/fd")

    def reading() -> int:
        return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(big))

    finished: list[str] = []
    asked = min(32, (os.cpu_count() or 1) + 4) + 2  # more than asyncio's default pool holds

    def hash_big() -> httpx.Response:
        answer = httpx.post(f"{server.url}/file/cid", json={"path": "media/big.bin"}, timeout=600)
        finished.append("hash")
        return answer

    with concurrent.futures.ThreadPoolExecutor(asked) as pool:
        hashes = [pool.submit(hash_big) for _ in range(asked)]
        poll(lambda: reading() >= compat.HASHING or None, "the node to read big.bin")
        assert httpx.get(info, timeout=600).json()["exists"] is True
        finished.append("info")
        answers = [h.result() for h in hashes]
    assert finished[0] == "info", finished
    assert {(a.status_code, a.json()["size"]) for a in answers} == {(200, 1 << 30)}


def open_stream(server: Server, path: str, last_event_id: str | None = None) -> Stream:
    """An SSE client on `path`; closed by the autouse `close_streams` fixture after the test."""
    return Stream(server, last_event_id=last_event_id, path=path)


def epoch_of(server: Server) -> int:
    return int(httpx.get(f"{server.url}/health", timeout=WAIT_S).json()["epoch"])


def http(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=server.headers, timeout=WAIT_S)


def test_events_meta_full_replay_live_tail_resume_and_keep_alive(
    launch: Callable[[dict[str, str]], Server],
) -> None:
    server = launch({"METANODE_FEED_KEEP_ALIVE_S": "0.5", "METANODE_WATCH_ENABLED": "false"})
    alice = Signer()
    with http(server) as client:
        assert client.post("/api/signers", json={"uid": alice.uid}).status_code == 200
        response = client.post(
            "/api/claims",
            json={
                "claims": [
                    alice.claim(CID_A, "title", "A"),
                    alice.claim(CID_A, "year", "1999"),
                    alice.claim(CID_B, "title", "B"),
                ]
            },
        )
        assert response.json()["accepted"] == 3
        rid_a = client.get(f"/api/meta/{CID_A}/claims").json()["rid"]
        rid_b = client.get(f"/api/meta/{CID_B}/claims").json()["rid"]
    ep = epoch_of(server)  # 5 feed events: cids/A, title, year; cids/B, title

    replay = open_stream(server, "/api/events/meta", last_event_id="0-0")
    assert replay.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert replay.headers["cache-control"] == "no-cache"
    assert replay.headers["x-accel-buffering"] == "no"
    gap, *state = replay.events(6)
    assert (gap.event, gap.id, gap.data) == (
        "gap",
        f"{ep}-5.0",
        {"reason": "unknown_epoch", "requested": "0-0", "resumeFrom": f"{ep}-5.0"},
    )
    keys = sorted(
        [
            (rid_a, f"cids/{CID_A}"),
            (rid_a, "title"),
            (rid_a, "year"),
            (rid_b, f"cids/{CID_B}"),
            (rid_b, "title"),
        ]
    )
    assert [(f.event, f.data["key"]) for f in state] == [("set", f"file:{r}/{k}") for r, k in keys]
    assert [f.id for f in state] == [f"{ep}-5.{n}" for n in range(1, 5)] + [f"{ep}-5"]
    assert all(list(f.data) == ["key", "ts"] and f.data["ts"].isdigit() for f in state)

    with http(server) as client:
        client.post("/api/claims", json={"claims": [alice.claim(CID_A, "title", "A2", NOW_MS + 1)]})
        client.post("/api/claims", json={"claims": [alice.claim(CID_A, "year", None, NOW_MS + 1)]})
    live = replay.events(2)
    assert [(f.event, f.id, f.data["key"]) for f in live] == [
        ("set", f"{ep}-6", f"file:{rid_a}/title"),
        ("del", f"{ep}-7", f"file:{rid_a}/year"),
    ]
    frame = (
        f'id: {ep}-6\nevent: set\ndata: {{"key":"file:{rid_a}/title",'
        f'"ts":"{live[0].data["ts"]}"}}\n\n'
    ).encode()
    assert frame in replay.raw  # meta-core's framing: id, event, one line of JSON data
    deadline = time.monotonic() + WAIT_S
    while replay.next().comment != "keep-alive":
        assert time.monotonic() < deadline
    assert b"\n\n: keep-alive\n\n" in replay.raw
    replay.close()

    resumed = open_stream(server, "/api/events/meta", last_event_id=f"{ep}-6")
    assert [(f.event, f.id) for f in resumed.events(1)] == [("del", f"{ep}-7")]
    resumed.close()
    with http(server) as client:
        response = client.get("/api/events/meta", headers={"Last-Event-ID": "garbage"})
    assert (response.status_code, response.json()["error"]) == (400, "invalid_cursor")


def test_events_files_from_the_watcher_and_full_replay(
    launch: Callable[[dict[str, str]], Server],
) -> None:
    server = launch(
        {
            "METANODE_WATCH_SETTLE_S": "0.3",
            "METANODE_WATCH_RESCAN_S": "0",
            "METANODE_FEED_KEEP_ALIVE_S": "1",
        }
    )
    media = server.data_dir.parent / "media"
    ep = epoch_of(server)
    stream = open_stream(server, "/api/events/files")  # no cursor: the (empty) state first
    (reset,) = stream.events(1)
    assert (reset.event, reset.id, reset.data["path"]) == ("reset", f"{ep}-0", "")

    def expect(
        kind: str, seq: int, midhash: str, path: str, size: int, old_path: str | None = None
    ) -> None:
        (frame,) = stream.events(1)
        assert (frame.event, frame.id) == (kind, f"{ep}-{seq}"), frame
        expected = {"midhash256": midhash, "path": path, "size": str(size)}
        if old_path is not None:
            expected["oldPath"] = old_path
        timestamp = frame.data.pop("timestamp")
        assert timestamp.isdigit() and abs(int(timestamp) - time.time() * 1000) < 60_000
        assert frame.data == expected
        assert list(json.loads(frame_json(stream, frame))) == sorted([*expected, "timestamp"])

    alpha, a = write(media / "a.bin", b"alpha")
    expect("add", 1, alpha, "media/a.bin", 5)
    alpha2, _ = write(a, b"alpha, longer")
    expect("change", 2, alpha2, "media/a.bin", 13)
    os.rename(a, media / "b.bin")
    expect("rename", 3, alpha2, "media/b.bin", 13, old_path="media/a.bin")
    gamma, _ = write(media / "sub" / "c.bin", b"gamma")
    expect("add", 4, gamma, "media/sub/c.bin", 5)
    (media / "b.bin").unlink()
    expect("delete", 5, alpha2, "media/b.bin", 13)
    stream.close()

    replay = open_stream(server, "/api/events/files", last_event_id="0-0")
    gap, reset, add = replay.events(3)
    assert (gap.event, gap.id, gap.data) == (
        "gap",
        f"{ep}-5.0",
        {"reason": "unknown_epoch", "requested": "0-0", "resumeFrom": f"{ep}-5.0"},
    )
    assert (reset.event, reset.id, reset.data["path"]) == ("reset", f"{ep}-5.1", "")
    assert (add.event, add.id) == ("add", f"{ep}-5")
    assert {k: v for k, v in add.data.items() if k != "timestamp"} == {
        "midhash256": gamma,
        "path": "media/sub/c.bin",
        "size": "5",
    }
    replay.close()

    resumed = open_stream(server, "/api/events/files", last_event_id=f"{ep}-3")
    assert [(f.event, f.id, f.data["path"]) for f in resumed.events(2)] == [
        ("add", f"{ep}-4", "media/sub/c.bin"),
        ("delete", f"{ep}-5", "media/b.bin"),
    ]
    resumed.close()

    # meta-sort's first start asks with no cursor: the library it did not know, without a gap
    first = open_stream(server, "/api/events/files")
    reset, add = first.events(2)
    assert [(f.event, f.id, f.data["path"]) for f in (reset, add)] == [
        ("reset", f"{ep}-5.1", ""),
        ("add", f"{ep}-5", "media/sub/c.bin"),
    ]
    write(media / "d.bin", b"delta")
    (live,) = first.events(1)
    assert (live.event, live.id, live.data["path"]) == ("add", f"{ep}-6", "media/d.bin")
    first.close()


def frame_json(stream: Stream, frame: Frame) -> str:
    """The data line of `frame` exactly as sent (to check key order)."""
    marker = f"id: {frame.id}\nevent: {frame.event}\ndata: ".encode()
    start = stream.raw.index(marker) + len(marker)
    return stream.raw[start : stream.raw.index(b"\n", start)].decode()


def test_compat_app_builds_without_a_started_node(tmp_path: Path) -> None:
    app = create_app(Node(settings_for(tmp_path / "data")))
    paths = {getattr(route, "path", "") for route in app.routes}
    assert {
        "/meta",
        "/meta/{hash}",
        "/meta/{hash}/{key:path}",
        "/api/events/meta",
        "/api/events/files",
        "/api/file/{cid}/info",
        "/file/{cid}",
        "/urls",
    } <= paths


@pytest.mark.parametrize(
    ("host", "port", "hostname"),
    [
        ("0.0.0.0", 9000, f"{socket.gethostname()}:9000"),
        ("0.0.0.0", 80, socket.gethostname()),
        ("127.0.0.1", 9100, "127.0.0.1:9100"),
        ("::1", 80, "[::1]"),
    ],
)
def test_the_urls_hostname_is_where_webdav_answers(host: str, port: int, hostname: str) -> None:
    settings = config.Settings(host=host, port=port)
    assert compat.internal_host(settings) == hostname


def test_meta_fuse_reads_bytes_at_its_hostname_url_under_a_root_path(
    launch: Callable[[dict[str, str]], Server],
) -> None:
    """meta-fuse (9061c7a), run against a node under nginx's `/metanode`: it asks `/urls` under
    the prefix, reads WebDAV at `http://<hostname>/webdav` (index.ts), which has no prefix, and
    its driver reads a file in 128 KiB `Range`s of `webdavUrl + <filePath less /files>`, each
    segment `encodeURIComponent`'d (parentheses left as they are), after a `HEAD` when it has no
    size (statViaWebDAV). The node answers those paths without the prefix as with it."""
    server = launch({"METANODE_ROOT_PATH": "/metanode"})
    content = os.urandom(300_000)
    film = server.media / "Movies" / "Big Test (2020)" / "Big.Test.2020.1080p.mkv"
    film.parent.mkdir(parents=True)
    film.write_bytes(content)
    cid = watcher.midhash_file(film)[0]
    prefixed = f"{server.url}/metanode"
    info = f"{prefixed}/api/file/{cid}/info"
    poll(lambda: httpx.get(info, timeout=WAIT_S).json()["exists"] or None, "the film hashed")

    urls = httpx.get(f"{prefixed}/urls", headers={"Accept": "application/json"}).json()
    assert urls["apiUrl"] == prefixed and "/" not in urls["hostname"]
    webdav = f"http://{urls['hostname']}/webdav"
    file_path = httpx.get(
        f"{urls['apiUrl']}/meta/{cid}/filePath", headers={"Accept": "text/plain"}
    ).text
    assert file_path == "/files/media/Movies/Big Test (2020)/Big.Test.2020.1080p.mkv"
    segments = file_path.removeprefix("/files").split("/")
    url = webdav + "/".join(quote(segment, safe="!'()*~") for segment in segments)
    assert url.endswith("/webdav/media/Movies/Big%20Test%20(2020)/Big.Test.2020.1080p.mkv")
    head = httpx.head(url, timeout=WAIT_S)
    assert (head.status_code, head.headers["content-length"]) == (200, str(len(content)))
    read = b""
    for offset in range(0, len(content), 131072):
        end = min(offset + 131071, len(content) - 1)
        part = httpx.get(url, headers={"Range": f"bytes={offset}-{end}"}, timeout=WAIT_S)
        assert part.status_code == 206, part.text
        read += part.content
    assert read == content


@pytest.mark.parametrize("workers", [1, 2])
def test_the_metamesh_volume_names_the_node_as_meta_cores_lock_file_did(
    tmp_path: Path, workers: int
) -> None:
    """meta-fuse (and meta-sort, meta-stremio before their UDP discovery) find the core only
    by `<META_CORE_PATH>/locks/kv-leader.info`, a URL they then ask `/urls` of: without it
    they waited for a core for ever. They also watch it, and take any event on it for a new
    core: meta-stremio's LeaderClient drops its connection on a delete and, after five
    minutes without the file, for good (a rename back is no event to it); meta-fuse opens
    a second meta stream beside the first. So the file stays through a stop and a restart at the
    same URL (the same inode, never rewritten), as meta-core's did, and is replaced whole
    only when the URL changes."""
    volume = tmp_path / "meta-core"
    env = {"METANODE_METAMESH_VOLUME": str(volume)}
    server = Server(tmp_path / "data", env=env, workers=workers).start()
    lock = volume / "locks" / "kv-leader.info"
    try:
        url = lock.read_text(encoding="utf-8")
        assert url == f"http://127.0.0.1:{server.port}\n"
        urls = httpx.get(f"{url.strip()}/urls", timeout=10).json()
        assert urls["webdavUrlInternal"] == f"{url.strip()}/webdav"
        written = lock.stat()
    finally:
        assert server.stop() == 0
    assert lock.read_text(encoding="utf-8") == url
    server.start()
    try:
        again = lock.stat()
        assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    finally:
        assert server.stop() == 0
    other = next(port for port in iter(free_port, None) if port != server.port)
    moved = Server(tmp_path / "data", env=env, port=other, workers=workers).start()
    try:
        assert lock.read_text(encoding="utf-8") == f"http://127.0.0.1:{moved.port}\n"
        assert sorted(p.name for p in lock.parent.iterdir()) == ["kv-leader.info"]
    finally:
        assert moved.stop() == 0
