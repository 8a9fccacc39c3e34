"""schemathesis over schemas/openapi.json against the in-process ASGI app (issue #7), and
against a real `metanode serve`.

schemathesis loads the document and generates requests for every operation (the documented
examples, the coverage phase's boundary values and unexpected methods, then `max_examples` random
ones, derandomized so a failure reproduces) with the bearer token, and checks that no answer is a
5xx, that every status is documented for its operation, that every body matches the
documented schema and its Content-Type a documented media type, that every header the document
marks required is sent with a value its schema allows (Retry-After on a 503, the file routes'
ETag, the peer routes' X-Metanode-Instance), that a 405 names the methods in `Allow`, and that
a request without a required header is refused. Against the real server (through uvicorn and
the HTTP edge of server.py; ≈ 1,600 requests on loopback, about 35 s) also `ignored_auth`, which
sends requests of its own that an ASGI app cannot take: without the token, every operation the
document says needs one must be refused.

The app's lifespan is run by schemathesis's ASGI transport, on its own event loop thread, so the
node is created here but started by that lifespan. Before it starts, the data directory is seeded
(with the node's own API, on a throwaway node) with the first signer and claim of
`tests/vectors/claims.json`, which are the document's examples, so the example phase reaches the
200 answers of the CID and uid routes, not only their 404s.

The SSE routes never end, so they are not fuzzed: tests/test_schemas.py checks their frames
against the FeedEvent schema (and the compat event schemas) on a real server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    ignored_auth,
    missing_required_header,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from metanode.api import create_app
from metanode.node import Node
from tests.helpers.server import Server
from tests.helpers.settings import settings_for
from tests.helpers.vectors import load_vectors

OPENAPI = Path(__file__).parents[1] / "schemas" / "openapi.json"
# Endless text/event-stream answers (see the module docstring): /api/events and the compat ones.
EXCLUDED_PATHS = sorted(
    path
    for path, item in json.loads(OPENAPI.read_text(encoding="utf-8"))["paths"].items()
    if "text/event-stream"
    in item.get("get", {}).get("responses", {}).get("200", {}).get("content", {})
)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    response_schema_conformance,
    content_type_conformance,
    response_headers_conformance,
    allow_header_conformance,
    missing_required_header,
]
READY_S = 30.0


async def seed(data_dir: Path) -> None:
    """The document's examples exist: vector signer 0 registered, its first claim stored."""
    vectors = load_vectors("claims.json")
    uid = vectors["signers"][0]["uid"]
    node = Node(settings_for(data_dir))
    await node.start()
    try:
        await node.add_signer(uid, "vector signer", 1, False)
        answer = await node.ingest({"claims": [vectors["vectors"][0]["claim"]]})
        assert answer.body["accepted"] == 1, answer.body
    finally:
        await node.stop()


@pytest.fixture(scope="module")
def fuzz_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One seeded data directory for every operation's test."""
    data_dir = tmp_path_factory.mktemp("fuzz") / "data"
    asyncio.run(seed(data_dir))
    return data_dir


@pytest.fixture
def fuzz_node(fuzz_data: Path) -> Iterator[tuple[Node, Any]]:
    """A node on the seeded data and its app, started by schemathesis's ASGI lifespan.

    A new node per test: schemathesis ends every ASGI lifespan when a test ends (its
    `pytest_runtest_teardown`), and a stopped `Node` is not started again.
    """
    node = Node(settings_for(fuzz_data))
    app: Any = create_app(node)  # an ASGI app; schemathesis types it more narrowly than Starlette
    try:
        with asgi.get_client(app) as client:  # starts the lifespan, i.e. node.start()
            deadline = time.monotonic() + READY_S
            while not client.get("/health").json()["cache_ready"]:
                assert time.monotonic() < deadline, f"the cache was not ready in {READY_S} s"
                time.sleep(0.02)
        yield node, app
    finally:
        asgi.shutdown_lifespans()  # node.stop(), on the loop that started it (if not yet done)


# Loaded from the file at collection time, one test per operation; tests/test_schemas.py checks
# that the app serves exactly this file. (`schemathesis.pytest.from_fixture`, which would load it
# from the running app, does not work with pytest 9.2: it sets the removed `Node._nodeid`.)
schema = schemathesis.openapi.from_path(OPENAPI).exclude(path=EXCLUDED_PATHS)
# the same 30 cases of each operation at every run, in the app and against a real server
FUZZED = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@FUZZED
def test_openapi_conformance(case: schemathesis.Case[Any], fuzz_node: tuple[Node, Any]) -> None:
    node, app = fuzz_node
    case.call_and_validate(
        app=app, headers={"Authorization": f"Bearer {node.token}"}, checks=CHECKS
    )


@pytest.fixture(scope="module")
def fuzz_server(fuzz_data: Path) -> Iterator[Server]:
    """A real `metanode serve` on a seeded data directory of its own (the in-process tests'
    nodes write to theirs)."""
    data_dir = fuzz_data.parent / "server" / "data"
    asyncio.run(seed(data_dir))
    server = Server(data_dir).start()
    try:
        yield server
    finally:
        server.stop()


# Against a real server the requests go through uvicorn and the HTTP edge (server.py), and
# schemathesis may send its own: `ignored_auth` drops the token and expects 401 where the
# document requires one (the MetaMesh routes once said they did, and answered loopback without
# it). Not `POST /api/peers`: a generated address would be followed, off this machine.
on_server = schema.exclude(path="/api/peers", method="POST")


@on_server.parametrize()
@FUZZED
def test_openapi_conformance_of_a_real_server(
    case: schemathesis.Case[Any], fuzz_server: Server
) -> None:
    case.call_and_validate(
        base_url=fuzz_server.url, headers=fuzz_server.headers, checks=[*CHECKS, ignored_auth]
    )
