"""The API contract (issue #7): schemas/*.schema.json and schemas/openapi.json against real answers.

Every body here comes from a real node: through the in-process `client` for the JSON routes, and
from a real `metanode serve` for the change feed (the ASGI transport buffers a stream until it
ends). Each is validated twice: against its JSON Schema file, and against what the OpenAPI
document says that operation answers with that status, so the two cannot drift apart from each
other or from the code.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from jsonschema import Draft202012Validator
from schemathesis.core.result import Err
from starlette.routing import BaseRoute, Mount, Route

import metanode
from metanode import cid as cids
from metanode import errors, maintenance, peers, webdav
from metanode import rid as rids
from metanode.api import Access, access_of, create_app
from metanode.node import Node
from tests.helpers.claims import NOW_MS, Signer, register, without_owner
from tests.helpers.contract import (
    BASE,
    FILES,
    OPENAPI,
    OPENAPI_FILE,
    OPENAPI_URI,
    REGISTRY,
    SCHEMAS,
    check,
    file_schema,
)
from tests.helpers.server import Server
from tests.helpers.settings import settings_for
from tests.helpers.vectors import load_vectors
from tools import openapi_sync

ROOT = Path(__file__).parents[1]
WAIT_S = 30.0


# -- the OpenAPI document's view of one real answer -------------------------------------------


def _template(path: str) -> re.Pattern[str]:
    """A regex of the paths a template matches: a parameter is one segment, but `{key}` (of
    `/meta/{hash}/{key}`, a `{key:path}` route) may span several."""
    pattern = re.escape(path).replace(re.escape("{key}"), ".+")
    return re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", pattern) + "$")


TEMPLATES = [(_template(path), path) for path in OPENAPI["paths"]]


def _pointer(*parts: str) -> str:
    return "/".join(part.replace("~", "~0").replace("/", "~1") for part in parts)


def documented(method: str, path: str, status: int) -> tuple[str, dict[str, Any]] | None:
    """(JSON pointer, response object) of what the document says about this answer, or None
    when the path names no documented operation (unknown routes, wrong methods)."""
    matches = [template for regex, template in TEMPLATES if regex.match(path)]
    if not matches or method.lower() not in OPENAPI["paths"][matches[0]]:
        return None
    template = matches[0]
    responses = OPENAPI["paths"][template][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {template} does not document status {status}"
    response = responses[str(status)]
    pointer = _pointer("paths", template, method.lower(), "responses", str(status))
    if "$ref" in response:  # a components/responses entry
        pointer = response["$ref"].lstrip("#/")
        name = pointer.rsplit("/", 1)[1]
        response = OPENAPI["components"]["responses"][name]
    return pointer, response


def conforms(response: httpx.Response, name: str, status: int | None = None) -> Any:
    """The JSON body of `response`, checked against schema file `name` (`#/pointer` allowed)
    and against the document."""
    if status is not None:
        assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    check(file_schema(name), body)
    found = documented(response.request.method, response.request.url.path, response.status_code)
    if found is not None:
        pointer, spec = found
        assert "application/json" in spec["content"], spec
        check(f"{OPENAPI_URI}#/{pointer}/content/application~1json/schema", body)
    return body


def conforms_raw(response: httpx.Response, status: int, media_type: str) -> bytes:
    """A body that is not JSON: its status and media type are the ones the document names."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].split(";")[0] == media_type, response.headers
    found = documented(response.request.method, response.request.url.path, status)
    assert found is not None, response.request.url
    assert media_type in found[1]["content"], found
    return response.content


def error_of(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    body = conforms(response, "error.schema.json", status)
    assert body["error"] == slug, body
    return dict(body)


# -- the schema files themselves ----------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_schema_file_is_a_valid_draft_2020_12_schema(name: str) -> None:
    schema = openapi_sync.load(SCHEMAS / name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == BASE + name
    assert isinstance(schema.get("description"), str)


def _walk(node: Any, pointer: str = "") -> Iterator[tuple[str, Any]]:
    yield pointer, node
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in ("examples", "const", "enum", "default"):
                yield from _walk(value, f"{pointer}/{_pointer(key)}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{pointer}/{index}")


@pytest.mark.parametrize("name", FILES)
def test_every_ref_resolves_and_every_example_validates(name: str) -> None:
    schema = openapi_sync.load(SCHEMAS / name)
    resolver = REGISTRY.resolver(base_uri=BASE + name)
    for pointer, node in _walk(schema):
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            resolver.lookup(node["$ref"])  # raises if it does not resolve
        if isinstance(node, dict) and "examples" in node:
            for example in node["examples"]:
                check(file_schema(name, pointer), example)


def test_the_slug_examples_are_every_slug_the_code_has() -> None:
    def subclasses(cls: type[errors.MetanodeError]) -> Iterator[type[errors.MetanodeError]]:
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    in_code = {errors.MetanodeError.slug} | {cls.slug for cls in subclasses(errors.MetanodeError)}
    documented_slugs = openapi_sync.load(SCHEMAS / "common.schema.json")["$defs"]["slug"]
    assert set(documented_slugs["examples"]) == in_code


def test_claim_schema_accepts_the_vectors_and_refuses_malformed_claims() -> None:
    for vector in load_vectors("claims.json")["vectors"]:
        check(file_schema("claim.schema.json"), vector["claim"])
    good = load_vectors("claims.json")["vectors"][0]["claim"]
    for bad in (
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "value"},
        {**good, "value": 5},
        {**good, "ts": 1.5},
        {**good, "ts": 1},
        {**good, "sig": good["sig"] + "A"},
        {**good, "sig": "=" * 86},
        {**good, "uid": "did:key:" + good["uid"]},
        {**good, "cid": "z" + good["cid"]},
        {**good, "cid": good["cid"].upper()},
        {**good, "key": ""},
        {**good, "key": "a\nb"},
    ):
        errors_found = list(
            Draft202012Validator(
                {"$ref": file_schema("claim.schema.json")}, registry=REGISTRY
            ).iter_errors(bad)
        )
        assert errors_found, f"the claim schema accepted {bad!r}"


# -- the OpenAPI document ---------------------------------------------------------------------


def test_openapi_components_and_packaged_copy_are_in_sync() -> None:
    assert openapi_sync.stale() == [], "run: python tools/openapi_sync.py"


def test_openapi_document_is_valid_and_every_operation_resolves() -> None:
    loaded = schemathesis.openapi.from_path(OPENAPI_FILE)
    loaded.validate()  # against the OpenAPI 3.1 meta-schema
    operations = []
    for result in loaded.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operations.append(result.ok())
    assert {(op.method.upper(), op.path) for op in operations} == {
        (method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item
    }
    assert OPENAPI["openapi"].startswith("3.1")
    assert OPENAPI["info"]["version"] == metanode.__version__


def _routes(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    for route in routes:
        if getattr(route, "path", None) == webdav.MOUNT:
            continue  # WebDAV (RFC 4918) and its root's redirect, outside the OpenAPI document
        if isinstance(route, Mount):
            yield from _routes(list(route.routes), prefix + route.path)
        else:
            assert isinstance(route, Route), f"{route!r}: describe it in schemas/openapi.json"
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", prefix + route.path)  # {key:path}
            for method in sorted(route.methods or {"GET"}):
                if method != "HEAD":
                    yield method, path


def test_openapi_document_describes_every_route_of_the_app(tmp_path: Path) -> None:
    app = create_app(Node(settings_for(tmp_path / "data")))  # not started: routes only
    # the web page's routes (HTML, docs/ui.md) are not the API's
    in_app = {r for r in _routes(list(app.routes)) if access_of(r[1]) is not Access.PAGE}
    in_document = {
        (method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item
    }
    assert in_app == in_document


@pytest.mark.parametrize("path", sorted(OPENAPI["paths"]))
def test_security_is_public_exactly_on_the_public_routes(path: str) -> None:
    public = path.startswith("/api/meta/") or path in ("/health", "/openapi.json")
    for method, operation in OPENAPI["paths"][path].items():
        security = operation.get("security", OPENAPI["security"])
        assert (security == []) == public, f"{method} {path}: security {security}"
        # the MetaMesh routes answer a trusted network without the token: none is an option
        assert ({} in security) == (family(path) is Access.TRUSTED), (method, path, security)
        if not public:
            assert operation["responses"]["401"] == {"$ref": "#/components/responses/Unauthorized"}
        for status, response in operation["responses"].items():
            if int(status) >= 400:  # every error answer is the envelope
                if "$ref" in response:
                    response = OPENAPI["components"]["responses"][response["$ref"].split("/")[-1]]
                schema = response["content"]["application/json"]["schema"]
                assert "#/components/schemas/Error" in json.dumps(schema), (method, path, status)


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/api/claims/log"), ("POST", "/api/claims/reconcile")]
)
async def test_the_peer_routes_say_which_box_answered(
    node: Node, client: httpx.AsyncClient, method: str, path: str
) -> None:
    """`X-Metanode-Instance`, as documented, on the answer and on the 401 of a token it does
    not take: a `peers add` of this box's own address is refused whatever token it was given."""
    body = {"fetch": []} if method == "POST" else None
    answered = await client.request(method, path, json=body)
    found = documented(method, path, answered.status_code)
    assert found is not None and "X-Metanode-Instance" in found[1]["headers"]
    refused = await client.request(method, path, json=body, headers={"Authorization": "Bearer x"})
    error_of(refused, 401, "unauthorized")
    for response in (answered, refused):
        assert response.headers[peers.SELF_HEADER] == node.instance


async def test_the_served_document_is_the_file(node: Node) -> None:
    transport = httpx.ASGITransport(app=create_app(node))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as anonymous:
        response = await anonymous.get("/openapi.json")  # public: no token
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == OPENAPI_FILE.read_bytes()
    assert response.content == (ROOT / "metanode" / "openapi.json").read_bytes()


# -- real answers -----------------------------------------------------------------------------


def sha256_cid(data: bytes) -> str:
    return cids.encode(cids.RAW, cids.SHA2_256, hashlib.sha256(data).digest())


CONTENT = b"metanode schema test film " * 40


async def test_real_bodies_conform(node: Node, client: httpx.AsyncClient, tmp_path: Path) -> None:
    signer = Signer()
    body = {"uid": signer.uid, "name": "schema test", "weight": 2, "may_link": True}
    check(file_schema("signer-request.schema.json"), body)
    conforms(await client.post("/api/signers", json=body), "signer.schema.json", 200)

    media = tmp_path / "media"
    media.mkdir()
    (media / "film.mkv").write_bytes(CONTENT)
    (media / "copy.mkv").write_bytes(CONTENT)
    await node.scan([str(media)])
    midhash, sha = cids.midhash_bytes(CONTENT), sha256_cid(CONTENT)

    batch = {
        "claims": [
            signer.claim(midhash, "title", "The Matrix"),
            signer.claim(midhash, f"cids/{sha}", "true"),
            signer.claim(sha, "year", "1999"),
            signer.claim(sha, "retracted", None),
        ]
    }
    check(file_schema("claims-request.schema.json"), batch)
    first = conforms(
        await client.post("/api/claims", json=batch), "claims-response.schema.json", 200
    )
    assert first["accepted"] == 4 and first["applied"] is True
    again = conforms(
        await client.post("/api/claims", json=batch), "claims-response.schema.json", 200
    )
    assert again["duplicate"] == 4

    document = conforms(await client.get(f"/api/meta/{sha}"), "document.schema.json", 200)
    assert document["cids"] == [sha, midhash] and len(document["paths"]) == 2
    assert document["filePath"] == document["paths"][0]
    assert {"title", "year", "fileSize", "mtimeNano", f"cids/{sha}"} <= set(document["metadata"])
    viewer = await client.get(f"/api/meta/{midhash}", params={"as": signer.uid})
    assert conforms(viewer, "document.schema.json", 200)["cid"] == midhash

    listing = conforms(
        await client.get(f"/api/meta/{midhash}/claims"), "claims-listing.schema.json", 200
    )
    assert len(listing["claims"]) == 3  # the retraction is not listed
    rid = listing["rid"]
    filtered = await client.get(f"/api/meta/{sha}/claims", params={"key": "year"})
    assert len(conforms(filtered, "claims-listing.schema.json", 200)["claims"]) == 1
    by_rid = conforms(
        await client.get(f"/api/metadata/{rid.lower()}"), "rid-document.schema.json", 200
    )
    assert by_rid["hashId"] == rid and by_rid["cid"] == by_rid["canonical_cid"] == sha
    conforms(
        await client.get(f"/api/metadata/{rid}/claims", params={"uid": signer.uid}),
        "claims-listing.schema.json",
        200,
    )

    signer2 = Signer()
    await register(client, signer2)
    await client.post("/api/claims", json={"claims": [signer2.claim(sha256_cid(b"2"), "t", "v")]})
    page = conforms(
        await client.get("/api/hash-ids", params={"limit": 1}), "hash-ids.schema.json", 200
    )
    assert page["next"] == page["hashIds"][0]
    last = await client.get("/api/hash-ids", params={"after": page["next"], "limit": 1000})
    assert conforms(last, "hash-ids.schema.json", 200)["next"] is None

    files = conforms(await client.get("/api/files", params={"limit": 1}), "files.schema.json", 200)
    assert files["files"][0]["rid"] == rid and files["next"] == files["files"][0]["path"]
    conforms(
        await client.get("/api/files", params={"prefix": str(media)}), "files.schema.json", 200
    )

    signers = conforms(await client.get("/api/signers"), "signers.schema.json", 200)
    assert {s["uid"] for s in without_owner(signers["signers"])} == {signer.uid, signer2.uid}
    blocked = conforms(
        await client.post(f"/api/signers/{signer2.uid}/block"), "signer.schema.json", 200
    )
    assert blocked["status"] == "blocked"
    conforms(await client.post(f"/api/signers/{signer2.uid}/unblock"), "signer.schema.json", 200)

    conforms(await client.get("/health"), "health.schema.json", 200)
    assert conforms(await client.get("/api/plugins"), "plugins.schema.json", 200) == {
        "plugins": [],
        "not_loaded": [],
    }


async def test_health_and_plugins_of_a_node_with_watcher_and_plugins(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (media / "The.Matrix.1999.mkv").write_bytes(CONTENT)
    node = Node(
        settings_for(
            tmp_path / "data", watch_enabled=True, plugins_enabled=True, watch_settle_s=0.05
        )
    )
    await node.start()
    try:
        transport = httpx.ASGITransport(app=create_app(node))
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://node",
            headers={"Authorization": f"Bearer {node.token}"},
        ) as c:
            deadline = time.monotonic() + WAIT_S
            while True:  # until every plugin has finished with the file
                plugins = conforms(await c.get("/api/plugins"), "plugins.schema.json", 200)
                if plugins["plugins"] and all(
                    p["runs"]["pending"] == 0
                    and p["runs"]["done"] + p["runs"]["failed"] + p["runs"]["skipped"] == 1
                    for p in plugins["plugins"]
                ):
                    break
                assert time.monotonic() < deadline, plugins
                await asyncio.sleep(0.05)
            assert {p["name"] for p in plugins["plugins"]} >= {"fullhash", "fileinfo"}
            health = conforms(await c.get("/health"), "health.schema.json", 200)
            assert health["watcher"]["roots"] == [str(media.resolve())]
            document = await c.get(f"/api/meta/{cids.midhash_bytes(CONTENT)}")
            assert conforms(document, "document.schema.json", 200)["paths"] == [
                str((media / "The.Matrix.1999.mkv").resolve())
            ]
    finally:
        await node.stop()


async def test_error_envelopes_conform(node: Node, client: httpx.AsyncClient) -> None:
    linker, plain, stranger = Signer(), Signer(), Signer()
    await register(client, linker, may_link=True)
    await register(client, plain)
    older, younger, unknown = sha256_cid(b"older"), sha256_cid(b"younger"), sha256_cid(b"none")
    await client.post("/api/claims", json={"claims": [linker.claim(older, "title", "a")]})
    await client.post("/api/claims", json={"claims": [linker.claim(younger, "title", "b")]})
    loser = (await client.get(f"/api/meta/{younger}/claims")).json()["rid"]
    survivor = (await client.get(f"/api/meta/{older}/claims")).json()["rid"]
    link = await client.post(
        "/api/claims", json={"claims": [linker.claim(older, f"cids/{younger}", "true")]}
    )
    assert link.status_code == 200, link.text
    unknown_rid = rids.encode(0x0190_0000_0000_7000_8000_0000_0000_0001)  # never minted

    async def batch(*claims: Any) -> httpx.Response:
        return await client.post("/api/claims", json={"claims": list(claims)})

    cases: list[tuple[httpx.Response, int, str]] = [
        (await client.get("/api/meta/not-a-cid"), 400, "invalid_cid"),
        (await client.get(f"/api/meta/{unknown}"), 404, "unknown_cid"),
        (await client.get(f"/api/meta/{older}", params={"as": "nobody"}), 400, "invalid_uid"),
        (await client.get("/api/meta/midhash256:x/claims"), 400, "invalid_cid"),
        (await client.get(f"/api/meta/{unknown}/claims"), 404, "unknown_cid"),
        (await client.get("/api/metadata/not-a-rid"), 400, "invalid_rid"),
        (await client.get(f"/api/metadata/{unknown_rid}"), 404, "unknown_rid"),
        (await client.get(f"/api/metadata/{unknown_rid}/claims"), 404, "unknown_rid"),
        (await client.get("/api/hash-ids", params={"limit": 0}), 400, "invalid_request"),
        (await client.get("/api/hash-ids", params={"after": "x"}), 400, "invalid_rid"),
        (await client.get("/api/files", params={"limit": 1001}), 400, "invalid_request"),
        (await client.post("/api/claims", content=b"{not json"), 400, "invalid_json"),
        (await client.post("/api/claims", json=[]), 400, "invalid_request"),
        (await client.post("/api/claims", json={"claims": [{}] * 1001}), 413, "too_large"),
        (await batch(stranger.claim(older, "title", "x")), 403, "invalid_batch"),
        (await batch(plain.claim(older, f"cids/{unknown}", "true")), 403, "invalid_batch"),
        (await client.post("/api/signers", json={"uid": "nobody"}), 400, "invalid_uid"),
        (
            await client.post("/api/signers", json={"uid": plain.uid, "weight": -1}),
            400,
            "invalid_request",
        ),
        (await client.post("/api/signers", content=b"["), 400, "invalid_json"),
        (await client.post("/api/signers", content=b" " * 70_000), 413, "too_large"),
        (await client.post(f"/api/signers/{stranger.uid}/block"), 404, "unknown_signer"),
        (await client.post(f"/api/signers/{stranger.uid}/unblock"), 404, "unknown_signer"),
        (await client.get("/api/events", params={"since": "yesterday"}), 400, "invalid_cursor"),
        (await client.get("/api/events", params={"rid": "x"}), 400, "invalid_rid"),
        (await client.get("/api/nothing-here"), 404, "not_found"),
        (await client.get("/api/claims"), 405, "method_not_allowed"),
        (await client.delete("/api/signers"), 405, "method_not_allowed"),
    ]
    for response, status, slug in cases:
        error_of(response, status, slug)

    merged = error_of(await client.get(f"/api/metadata/{loser}"), 404, "merged")
    assert merged["survivor"] == survivor
    error_of(await client.get(f"/api/metadata/{loser}/claims"), 404, "merged")

    good = linker.claim(older, "k", "v")
    rejected = error_of(
        await batch(
            good,
            {**good, "sig": "A" * 86},
            {**good, "extra": 1},
            linker.claim(older.upper(), "k", "v"),
            linker.claim(older, "cid_x", "v"),
            linker.claim(older, "k", "v", ts=NOW_MS + 3_600_000),
        ),
        400,
        "invalid_batch",
    )
    assert [(item["index"], item["error"]) for item in rejected["items"]] == [
        (1, "bad_signature"),
        (2, "invalid_claim"),
        (3, "noncanonical_cid"),
        (4, "reserved_key"),
        (5, "ts_in_future"),
    ]
    policy = error_of(await batch(stranger.claim(older, "k", "v")), 403, "invalid_batch")
    assert policy["items"][0]["error"] == "unknown_signer"
    link_refused = error_of(
        await batch(plain.claim(older, f"cids/{unknown}", "true")), 403, "invalid_batch"
    )
    assert link_refused["items"][0]["error"] == "link_not_permitted"

    transport = httpx.ASGITransport(app=create_app(node))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as anonymous:
        for path in ("/api/signers", "/api/hash-ids", "/metrics", f"/api/metadata/{survivor}"):
            error_of(await anonymous.get(path), 401, "unauthorized")
        error_of(await anonymous.post("/api/claims", json={"claims": []}), 401, "unauthorized")

    node.applier.ready = False  # as while the cache is first built
    try:
        for path in (
            f"/api/meta/{older}",
            f"/api/metadata/{survivor}",
            "/api/hash-ids",
            "/api/events",
        ):
            response = await client.get(path)
            error_of(response, 503, "cache_not_ready")
            assert response.headers["retry-after"] == "1"
    finally:
        node.applier.ready = True


SOME_CID = "bagacbabaea6gwjljwuu3cyxlrwwxgnmlfwd2gfshoi6mrtxysc4mnahe2hsqu"


# -- what the edge answers before any route (api.Edge): documented on every operation ----------

OPERATIONS = sorted(
    (method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item
)
STREAMS = {  # the endless text/event-stream answers
    path
    for path, item in OPENAPI["paths"].items()
    if "text/event-stream"
    in item.get("get", {}).get("responses", {}).get("200", {}).get("content", ())
}


def slugs(response: dict[str, Any]) -> list[str]:
    """The error slugs an error answer of the document allows (its `$ref` followed)."""
    if "$ref" in response:
        response = OPENAPI["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    schema = response["content"]["application/json"]["schema"]
    return list(schema["allOf"][1]["properties"]["error"]["enum"])


def family(path: str) -> Access:
    """The perimeter's family of a documented path (its parameters filled in)."""
    return access_of(re.sub(r"\{\w+\}", "x", path))


def example_path(path: str) -> str:
    """`path` with each parameter given a value of its kind, so the route itself is reached."""
    values = {"cid": SOME_CID, "hash": SOME_CID, "key": "title", "name": "nobody"}
    values |= {"rid": "01M8QES7K2E25SPMXXY50YCFYW", "uid": Signer().uid}
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_operation_documents_the_edges_own_refusals(method: str, path: str) -> None:
    """A client generated from the document meets these on any route: a path or query that is
    not UTF-8 (400 invalid_request), a peer token where the API token is needed (403
    peer_token_scope), a browser's script load of a MetaMesh route (403 forbidden)."""
    responses = OPENAPI["paths"][path][method.lower()]["responses"]
    assert "invalid_request" in slugs(responses["400"])
    if family(path) in (Access.TOKEN, Access.TRUSTED):
        assert "peer_token_scope" in slugs(responses["403"])
    if family(path) is Access.TRUSTED:
        assert "forbidden" in slugs(responses["403"])


async def test_the_edges_own_refusals_conform(node: Node, client: httpx.AsyncClient) -> None:
    peer = maintenance.create_peer_token(node.settings, "schema peer")
    for method, path in OPERATIONS:
        url = example_path(path)
        error_of(await client.request(method, f"{url}?q=%FF"), 400, "invalid_request")
        if family(path) is Access.TOKEN:
            scoped = await client.request(method, url, headers={"Authorization": f"Bearer {peer}"})
            error_of(scoped, 403, "peer_token_scope")
        if family(path) is Access.TRUSTED:
            script = await client.request(method, url, headers={"Sec-Fetch-Dest": "script"})
            error_of(script, 403, "forbidden")


async def test_every_read_while_the_cache_is_first_built_is_documented(
    node: Node, client: httpx.AsyncClient
) -> None:
    """Every status a read answers while the cache is first built is one its operation
    documents (`GET /api/files?missing=1` answered an undocumented 503), and a 503 says when to
    retry. The endless streams are left out (their 503 is checked above)."""
    node.applier.ready = False
    try:
        for method, path in OPERATIONS:
            if method != "GET" or path in STREAMS:
                continue
            for params in ({}, {"missing": "1"}) if path == "/api/files" else ({},):
                response = await client.get(example_path(path), params=params)
                found = documented("GET", response.request.url.path, response.status_code)
                assert found is not None, path
                if response.status_code == 503:
                    error_of(response, 503, "cache_not_ready")
                    assert response.headers["retry-after"] == "1"
    finally:
        node.applier.ready = True


# Bugs found while fuzzing and probing (issue #7): bad input that answers 500 instead of an
# error envelope; each of these once was one.
NEVER_500 = [
    pytest.param(
        "GET", "/api/hash-ids?limit=%C2%B2", {}, 400, "invalid_request", id="limit-superscript"
    ),
    pytest.param(
        "POST",
        "/api/claims",
        {"content": b"{}", "headers": {"content-length": "\xb2".encode("latin-1")}},
        400,
        "invalid_request",
        id="content-length",
    ),
    pytest.param(
        "POST",
        "/api/claims",
        {"content": b"[" * 5000 + b"]" * 5000},
        400,
        "invalid_json",
        id="deep-json",
    ),
    pytest.param(
        "POST",
        "/api/signers",
        {"content": b'{"uid": "%UID%", "name": "\\ud800"}'},
        400,
        "invalid_request",
        id="signer-name-surrogate",
    ),
    pytest.param(
        "POST",
        "/api/claims",
        {"content": b'{"claims": [{"\\ud800": 1}]}'},
        400,
        "invalid_batch",
        id="field-name-surrogate",
    ),
    pytest.param(
        "PATCH",
        f"/meta/{SOME_CID}",
        {"content": b"[" * 5000 + b"]" * 5000},
        400,
        "invalid_json",
        id="compat-patch-deep-json",
    ),
    pytest.param(
        "PUT",
        f"/meta/{SOME_CID}/title",
        {"content": b"[" * 5000 + b"]" * 5000},
        200,
        "",
        id="compat-put-deep-json",
    ),
    pytest.param(
        "PATCH",
        f"/meta/{SOME_CID}",
        {"content": b"{}", "headers": {"content-length": "\xb2".encode("latin-1")}},
        404,
        "unknown_cid",
        id="compat-content-length",
    ),  # the bogus length is ignored; an empty PATCH of nothing
    pytest.param(
        "PATCH",
        f"/meta/{SOME_CID}",
        {"content": b'{"cid_\\ud800": "x"}'},
        400,
        "deprecated_field",
        id="compat-deprecated-surrogate",
    ),
]


@pytest.mark.parametrize(("method", "path", "request_args", "status", "slug"), NEVER_500)
async def test_bad_input_is_never_a_500(
    node: Node, method: str, path: str, request_args: dict[str, Any], status: int, slug: str
) -> None:
    transport = httpx.ASGITransport(app=create_app(node), raise_app_exceptions=False)
    content = request_args.get("content", b"").replace(b"%UID%", Signer().uid.encode())
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://node",
        headers={"Authorization": f"Bearer {node.token}"},
    ) as c:
        response = await c.request(
            method, path, content=content, headers=request_args.get("headers")
        )
    if slug:
        error_of(response, status, slug)
    else:
        assert response.status_code == status, response.text


async def test_a_link_vote_naming_its_own_cid_is_accepted(node: Node) -> None:
    transport = httpx.ASGITransport(app=create_app(node), raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://node",
        headers={"Authorization": f"Bearer {node.token}"},
    ) as c:
        linker = Signer()
        await register(c, linker, may_link=True)
        fresh = sha256_cid(b"links to itself")
        response = await c.post(
            "/api/claims", json={"claims": [linker.claim(fresh, f"cids/{fresh}", "true")]}
        )
    assert conforms(response, "claims-response.schema.json", 200)["accepted"] == 1


# -- the change feed, from a real server --------------------------------------------------------


class Feed:
    """An SSE route of a real server, parsed into `{"event", "id"?, "data"}` dicts as a client
    sees them, each checked against `frame` (a schema file, `#/pointer` allowed)."""

    def __init__(
        self,
        client: httpx.Client,
        params: dict[str, str] | None = None,
        last_event_id: str | None = None,
        path: str = "/api/events",
        frame: str = "events.schema.json",
    ) -> None:
        self.frame = frame
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        self._context = client.stream("GET", path, params=params, headers=headers)
        response = self._context.__enter__()
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        self._lines = response.iter_lines()

    def next(self) -> dict[str, Any]:
        """The next event (keep-alive comments skipped), as {"event", "id"?, "data"}."""
        fields: dict[str, str] = {}
        for line in self._lines:
            if line == "":
                if "data" in fields:
                    event: dict[str, Any] = {
                        "event": fields["event"],
                        "data": json.loads(fields["data"]),
                    }
                    if "id" in fields:
                        event["id"] = fields["id"]
                    check(file_schema(self.frame), event)
                    return event
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")
        raise AssertionError("the stream ended")

    def until(self, kind: str) -> list[dict[str, Any]]:
        events = [self.next()]
        while events[-1]["event"] != kind:
            events.append(self.next())
        return events

    def through_id(self) -> list[dict[str, Any]]:
        """Events up to the first whose id is a feed position, not one inside a full state
        (`<epoch>-<seq>.<n>`): the end of a compat full state."""
        events = [self.next()]
        while "." in events[-1].get("id", "."):
            events.append(self.next())
        return events

    def close(self) -> None:
        self._context.__exit__(None, None, None)


def test_feed_events_conform(server: Server) -> None:
    linker = Signer()
    a, b = sha256_cid(b"feed a"), sha256_cid(b"feed b")
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=WAIT_S) as client:
        assert (
            client.post("/api/signers", json={"uid": linker.uid, "may_link": True}).status_code
            == 200
        )
        for cid, title in ((a, "A"), (b, "B")):
            response = client.post(
                "/api/claims", json={"claims": [linker.claim(cid, "title", title)]}
            )
            assert response.status_code == 200, response.text

        snapshot = Feed(client, {"snapshot": "1"})
        first = snapshot.until("synced")
        assert {e["event"] for e in first} == {"set", "synced"} and len(first) == 5
        end = first[-1]["id"]  # the snapshot's rows carry ids inside it, `synced` its end
        assert [e["id"] for e in first] == [f"{end}.{n}" for n in range(1, 5)] + [end]

        gapped = Feed(client, last_event_id="0-0")
        second = gapped.until("synced")
        assert second[0] == {
            "event": "gap",
            "id": f"{end}.0",
            "data": {"requested": "0-0", "reason": "unknown_epoch", "resumeFrom": f"{end}.0"},
        }
        assert second[1:] == first
        gapped.close()

        for claim in (
            linker.claim(a, f"cids/{b}", "true"),  # a merge: del, then set
            linker.claim(a, "end", "here"),
        ):  # then this set ends the test's reading
            response = client.post("/api/claims", json={"claims": [claim]})
            assert response.status_code == 200, response.text
        live = [snapshot.next()]
        while live[-1]["data"].get("key") != "end":
            live.append(snapshot.next())
        assert {e["event"] for e in live} == {"del", "set"}
        assert all("id" in e for e in live)
        snapshot.close()

        resumed = Feed(client, {"since": live[0]["id"]})
        replayed = resumed.until("synced")
        assert replayed[:-1] == live[1:] and replayed[-1]["data"]["id"] == live[-1]["id"]
        resumed.close()


# -- the MetaMesh compatibility routes (metanode/compat.py) ---------------------------------------


def compat(name: str) -> str:
    return f"compat.schema.json#/$defs/{name}"


async def test_a_compat_write_the_clock_cannot_date_conforms(tmp_path: Path) -> None:
    """A MetaMesh write on a box whose clock reads before 2000 (never set) is 503 clock_behind
    with `valid_from` (docs/api.md): once an envelope the schemas did not allow."""
    reading = [NOW_MS]
    node = Node(settings_for(tmp_path / "data"), clock=lambda: reading[0])
    await node.start()
    try:
        await node.ensure_groups([SOME_CID])
        reading[0] = 13_000  # 1970-01-01T00:00:13Z: a box without a real-time clock
        transport = httpx.ASGITransport(app=create_app(node))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as c:
            for response in (
                await c.patch(f"/meta/{SOME_CID}", json={"title": "x"}),
                await c.put(f"/meta/{SOME_CID}/title", content=b"x"),
            ):
                refused = error_of(response, 503, "clock_behind")
                assert refused["valid_from"] == 946_684_800_000, refused
                assert response.headers["retry-after"] == "60"
    finally:
        await node.stop()


async def test_compat_bodies_conform(node: Node, client: httpx.AsyncClient, tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (media / "film.mkv").write_bytes(CONTENT)
    await node.scan([str(media)])
    midhash, unknown = cids.midhash_bytes(CONTENT), sha256_cid(b"nobody has this")

    patch = {"title": "The Matrix", "__fields__": "ignored"}
    check(file_schema(compat("metaPatch")), patch)
    written = conforms(
        await client.patch(f"/meta/{midhash}", json=patch), compat("metaWritten"), 200
    )
    rid = written["hashId"]
    assert written["updated"] == 1
    listing = conforms(await client.get("/meta"), compat("metaList"), 200)
    assert listing == {"hashIds": [rid], "count": 1}
    for name in (midhash, rid, rid.lower()):
        record = conforms(await client.get(f"/meta/{name}"), compat("metaRecord"), 200)
        assert record["hashId"] == rid and record["metadata"]["title"] == "The Matrix"
    assert conforms_raw(await client.get(f"/meta/{midhash}/title"), 200, "text/plain") == (
        b"The Matrix"
    )
    put = {"value": "1999"}
    check(file_schema(compat("propertyPut")), put)
    stored = conforms(
        await client.put(f"/meta/{midhash}/year", json=put), compat("propertyWritten"), 200
    )
    assert stored == {"success": True, "hashId": rid, "property": "year"}
    conforms(
        await client.put(f"/meta/{rid}/a/b", content=b"raw text"), compat("propertyWritten"), 200
    )
    assert conforms_raw(await client.get(f"/meta/{rid}/a/b"), 200, "text/plain") == b"raw text"

    info = conforms(await client.get(f"/api/file/{midhash}/info"), compat("fileInfo"), 200)
    assert info["exists"] is True and info["size"] == len(CONTENT)
    for name in (unknown, "not-a-cid"):
        absent = await client.get(f"/api/file/{name}/info")
        assert conforms(absent, compat("fileInfo"), 200) == {"exists": False}
    whole = await client.get(f"/file/{midhash}")
    assert whole.status_code == 200 and whole.content == CONTENT
    part = await client.get(f"/file/{midhash}", headers={"Range": "bytes=0-9"})
    assert part.status_code == 206 and part.content == CONTENT[:10]
    for response in (whole, part):  # any media type: the file's own
        found = documented("GET", f"/file/{midhash}", response.status_code)
        assert found is not None and list(found[1]["content"]) == ["*/*"]
        assert {name.lower() for name in found[1]["headers"]} <= set(response.headers.keys())
    refused = await client.get(f"/file/{midhash}", headers={"Range": "bytes=9-1"})
    error_of(refused, 416, "range_not_satisfiable")
    assert refused.headers["content-range"] == f"bytes */{len(CONTENT)}"
    conforms(await client.get("/urls"), compat("urls"), 200)
    services = conforms(await client.get("/api/services"), compat("services"), 200)
    assert services["services"][0]["baseUrl"] == "http://node"

    deprecated = error_of(
        await client.patch(f"/meta/{midhash}", json={"cid_sha256": "x"}), 400, "deprecated_field"
    )
    assert deprecated["field"] == "cid_sha256"
    ignored = conforms(
        await client.patch(f"/meta/{midhash}", json={"filePath": "/x"}), compat("metaWritten"), 200
    )
    assert (ignored["updated"], ignored["ignored"]) == (0, ["filePath"])
    error_of(await client.patch(f"/meta/{midhash}", json={"a//b": "x"}), 400, "invalid_key")
    error_of(await client.patch(f"/meta/{midhash}", json={"n": 1}), 400, "invalid_request")
    error_of(await client.patch(f"/meta/{midhash}", content=b"{"), 400, "invalid_json")
    error_of(await client.patch(f"/meta/{unknown}", json={}), 404, "unknown_cid")
    error_of(await client.put(f"/meta/{midhash}/a", content=b"\xff"), 400, "invalid_value")
    error_of(await client.get(f"/meta/{midhash}/missing"), 404, "not_found")
    error_of(await client.get(f"/meta/{midhash}/"), 400, "invalid_request")
    error_of(await client.get("/meta/not-a-cid"), 404, "unknown_cid")
    error_of(await client.get(f"/meta/{unknown}"), 404, "unknown_cid")
    unknown_rid = rids.encode(0x0190_0000_0000_7000_8000_0000_0000_0001)
    error_of(await client.get(f"/meta/{unknown_rid}"), 404, "unknown_rid")
    error_of(await client.get(f"/file/{unknown}"), 404, "unknown_cid")
    error_of(await client.get("/file/not-a-cid"), 400, "invalid_cid")
    error_of(await client.get("/api/events/meta", params={"since": "x"}), 400, "invalid_cursor")
    error_of(await client.get("/api/events/files", params={"since": "x"}), 400, "invalid_cursor")


def test_compat_feed_events_conform(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.mkv").write_bytes(CONTENT)
    server = Server(tmp_path / "data", env={"METANODE_WATCH_SETTLE_S": "0.05"}).start()
    try:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=WAIT_S) as client:
            deadline = time.monotonic() + WAIT_S
            while not client.get("/api/files").json()["files"]:
                assert time.monotonic() < deadline, "the watcher did not index a.mkv"
                time.sleep(0.05)
            patch = client.patch(f"/meta/{cids.midhash_bytes(CONTENT)}", json={"title": "A"})
            assert patch.status_code == 200, patch.text

            meta = Feed(
                client, last_event_id="0-0", path="/api/events/meta", frame=compat("metaEvent")
            )
            state = meta.through_id()
            assert state[0]["event"] == "gap" and state[0]["data"]["requested"] == "0-0"
            assert {e["event"] for e in state[1:]} == {"set"}
            assert any(e["data"]["key"].endswith("/title") for e in state[1:])
            client.patch(f"/meta/{cids.midhash_bytes(CONTENT)}", json={"title": ""})
            live = meta.next()
            assert live["event"] == "del" and "id" in live
            meta.close()

            files = Feed(
                client, {"since": "0-0"}, path="/api/events/files", frame=compat("filesEvent")
            )
            state = files.through_id()
            assert [e["event"] for e in state] == ["gap", "reset", "add"]
            assert state[0]["id"] == state[0]["data"]["resumeFrom"] == f"{state[-1]['id']}.0"
            assert state[-1]["data"]["path"] == "media/a.mkv"
            (media / "a.mkv").rename(media / "b.mkv")
            moved = files.next()
            assert moved["event"] == "rename" and moved["data"]["oldPath"] == "media/a.mkv", moved
            files.close()
    finally:
        server.stop()
