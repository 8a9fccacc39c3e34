"""What caches may keep, on a real `metanode serve`: a record's `ETag` and the 304 that
revalidates it (the same tag after a restart and after `rebuild-cache`), the pages' style sheets
and scripts kept a year under a versioned URL, and the token routes' answers kept by none."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from metanode import cid as cids
from metanode import rid as rids
from tests.helpers.claims import Signer
from tests.helpers.server import Server

A = cids.midhash_bytes(b"caching A")
KEPT = "public, max-age=31536000, immutable"


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[Server]:
    server = Server(tmp_path / "data", env={"METANODE_WATCH_ENABLED": "0"}).start()
    yield server
    server.stop()
    server.print_log()


def record(srv: Server, tag: str | None = None, **params: str) -> httpx.Response:
    headers = {} if tag is None else {"If-None-Match": tag}
    return httpx.get(f"{srv.url}/api/meta/{A}", params=params, headers=headers, timeout=10)


def test_a_record_is_revalidated_by_its_etag_across_restarts_and_rebuilds(srv: Server) -> None:
    """No answer had an `ETag`: a consumer polling records fetched every body again. The tag
    is of the document's bytes, so a restart and a rebuilt cache (which render the same bytes)
    still answer 304 to a copy that is current, and a change answers the new body."""
    signer = Signer()
    srv.register(signer.uid, "t", weight=1)
    claim = signer.claim(A, "title", "first")
    posted = httpx.post(
        f"{srv.url}/api/claims", json={"claims": [claim]}, headers=srv.headers, timeout=10
    )
    assert posted.status_code == 200, posted.text
    first = record(srv)
    tag = first.headers["etag"]
    assert re.fullmatch(r'"[0-9a-f]{24}"', tag) and first.headers["cache-control"] == "no-cache"
    for given in (tag, f"W/{tag}", f'"other", {tag}', "*"):  # RFC 9110's weak comparison
        same = record(srv, given)
        assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", tag), given
        assert same.headers["vary"] == "Origin"  # as the 200 says
    assert record(srv, '"other"').status_code == 200
    viewer = record(srv, None, **{"as": signer.uid})  # the record as one signer sees it
    assert record(srv, viewer.headers["etag"], **{"as": signer.uid}).status_code == 304
    missing = httpx.get(f"{srv.url}/api/meta/{cids.midhash_bytes(b'none')}", timeout=10)
    assert missing.status_code == 404 and "etag" not in missing.headers
    spec = httpx.get(f"{srv.url}/openapi.json", timeout=10)  # what the API docs page loads
    again = {"If-None-Match": spec.headers["etag"]}
    assert httpx.get(f"{srv.url}/openapi.json", headers=again, timeout=10).status_code == 304
    srv.stop()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "metanode", "rebuild-cache", "--data-dir", str(srv.data_dir)],
        env=srv.base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rebuilt.returncode == 0, rebuilt.stderr
    srv.start()
    assert record(srv, tag).status_code == 304
    newer = signer.claim(A, "title", "second", ts=int(claim["ts"]) + 1)
    httpx.post(f"{srv.url}/api/claims", json={"claims": [newer]}, headers=srv.headers, timeout=10)
    changed = record(srv, tag)
    assert changed.status_code == 200 and changed.headers["etag"] != tag
    assert changed.json()["metadata"]["title"] == "second"


def test_a_page_of_another_site_may_read_and_revalidate_a_records_etag(srv: Server) -> None:
    """A browser hides every header of a cross-origin answer but the safelisted ones, so a
    page of another site got a record's body but no `ETag` to revalidate it with (nor the
    `X-Request-ID` of an answer, nor a 503's `Retry-After`); and its own `If-None-Match`
    failed the preflight. Both are allowed now, on the public routes only."""
    signer = Signer()
    srv.register(signer.uid, "t", weight=1)
    posted = httpx.post(
        f"{srv.url}/api/claims",
        json={"claims": [signer.claim(A, "title", "t")]},
        headers=srv.headers,
        timeout=10,
    )
    assert posted.status_code == 200, posted.text
    site = {"Origin": "http://consumer.example"}
    preflight = httpx.options(
        f"{srv.url}/api/meta/{A}",
        headers={
            **site,
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "if-none-match",
        },
        timeout=10,
    )
    assert preflight.status_code == 200, preflight.text
    assert "if-none-match" in preflight.headers["access-control-allow-headers"].lower()
    first = httpx.get(f"{srv.url}/api/meta/{A}", headers=site, timeout=10)
    again = httpx.get(
        f"{srv.url}/api/meta/{A}", headers={**site, "If-None-Match": first.headers["etag"]}
    )
    missing = httpx.get(f"{srv.url}/api/meta/{cids.midhash_bytes(b'none')}", headers=site)
    for answer, status in ((first, 200), (again, 304), (missing, 404)):
        assert answer.status_code == status
        assert answer.headers["access-control-allow-origin"] == "*"
        exposed = answer.headers["access-control-expose-headers"].lower().split(", ")
        assert exposed == ["etag", "retry-after", "x-request-id"], status
    private = httpx.get(f"{srv.url}/api/signers", headers={**srv.headers, **site}, timeout=10)
    assert "access-control-expose-headers" not in private.headers  # no CORS at all there


def test_the_claims_and_the_metamesh_reads_are_revalidated_as_a_record_is(srv: Server) -> None:
    """A record's claims and the MetaMesh reads (`/meta`, `/meta/{hash}`, one property) had
    no `ETag`: a consumer polling them (meta-sort reads each record again) fetched every body
    again. They are tagged as `/api/meta/{cid}` is, a property kept a value (`text/plain`,
    never a page) on its 304 too, and a change answers the new body."""
    signer = Signer()
    srv.register(signer.uid, "t", weight=1)
    claim = signer.claim(A, "title", "first")
    httpx.post(f"{srv.url}/api/claims", json={"claims": [claim]}, headers=srv.headers)
    rid = httpx.get(f"{srv.url}/meta/{A}", timeout=10).json()["hashId"]
    paths = [f"/api/meta/{A}/claims", "/meta", f"/meta/{rid}", f"/meta/{A}/title"]
    tags = {}
    for path in paths:
        first = httpx.get(srv.url + path, timeout=10)
        tag = first.headers["etag"]
        assert re.fullmatch(r'"[0-9a-f]{24}"', tag) and first.headers["cache-control"] == "no-cache"
        same = httpx.get(srv.url + path, headers={"If-None-Match": f"W/{tag}"}, timeout=10)
        assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", tag), path
        tags[path] = tag
    value = httpx.get(f"{srv.url}/meta/{A}/title", timeout=10)
    assert value.text == "first" and value.headers["content-type"] == "text/plain; charset=utf-8"
    assert value.headers["x-content-type-options"] == "nosniff"
    assert "sandbox" in value.headers["content-security-policy"]
    newer = signer.claim(A, "title", "second", ts=int(claim["ts"]) + 1)
    httpx.post(f"{srv.url}/api/claims", json={"claims": [newer]}, headers=srv.headers)
    for path in paths:
        again = httpx.get(srv.url + path, headers={"If-None-Match": tags[path]}, timeout=10)
        wanted = 200 if path != "/meta" else 304  # the same rids: the list is unchanged
        assert again.status_code == wanted, path
    assert httpx.get(f"{srv.url}/meta/{A}/title", timeout=10).text == "second"


@contextlib.contextmanager
def signed_in(srv: Server) -> Iterator[httpx.Client]:
    """A client holding a session's cookie, as a browser does once signed in."""
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        answer = client.post("/signin", data={"token": srv.token, "then": "/"})
        assert answer.status_code == 303, answer.text
        yield client


def test_the_pages_assets_are_kept_under_their_version_and_revalidated_otherwise(
    srv: Server,
) -> None:
    """The style sheets and scripts had no `Cache-Control`: a browser asked for each again on
    every page (or kept a stale one by its own guess after an upgrade). Now a page names each
    with its content's version, kept a year; any other URL of it is revalidated, 304 by ETag."""
    with signed_in(srv) as browser:
        pages = browser.get("/").text + browser.get("/docs").text
        assets = set(re.findall(r'(?:href|src)="(/(?:static|docs/assets)/[^"]+)"', pages))
        assert len(assets) == 7, assets  # metanode.css/js, noscript.css, docs.css/js, Swagger 2
        for url in assets:
            assert re.search(r"\?v=[0-9a-f]{12}$", url), url
            kept = httpx.get(srv.url + url, timeout=10)  # no session needed, as before
            assert kept.status_code == 200 and kept.headers["cache-control"] == KEPT, url
            bare = httpx.get(srv.url + url.split("?")[0], timeout=10)
            assert bare.headers["cache-control"] == "no-cache" and bare.content == kept.content
            tag = {"If-None-Match": bare.headers["etag"]}
            again = httpx.get(srv.url + url.split("?")[0], headers=tag, timeout=10)
            assert (again.status_code, again.content) == (304, b""), url
        stale = httpx.get(f"{srv.url}/static/metanode.css?v=000000000000", timeout=10)
        assert stale.headers["cache-control"] == "no-cache"  # not kept under another's version
        assert browser.get("/").headers["cache-control"] == "no-store"  # the pages themselves
        signers = browser.get("/api/signers")  # with the session's cookie
        assert signers.status_code == 200 and signers.headers["cache-control"] == "no-store"


def test_the_token_routes_answers_are_kept_by_no_cache(srv: Server) -> None:
    """The token routes' answers said nothing of caching, so a shared cache could keep an
    answer made for a session's cookie (a cookie does not keep one out) and hand it on."""
    for path in ("/api/signers", "/api/peers", "/health", "/metrics", "/api/hash-ids"):
        answer = httpx.get(srv.url + path, headers=srv.headers, timeout=10)
        wanted = "no-store" if path != "/health" else None  # /health is public
        assert answer.status_code == 200 and answer.headers.get("cache-control") == wanted, path
    refused = httpx.get(f"{srv.url}/api/signers", timeout=10)
    assert refused.status_code == 401 and refused.headers["cache-control"] == "no-store"
    with httpx.stream(
        "GET", f"{srv.url}/api/events", headers=srv.headers, timeout=10
    ) as events:  # the feed says its own, once
        assert events.headers.get_list("cache-control") == ["no-cache"]


def test_a_record_and_its_claims_by_rid_are_revalidated_and_kept_private(srv: Server) -> None:
    """`GET /api/metadata/{rid}` and its claims answered no `ETag`: a consumer polling records
    by rid fetched every body again, where the same record by CID answered 304. Tagged now as
    that one is, `private` (a token route: a shared cache keeps none), and a change answers
    the new body."""
    signer = Signer()
    srv.register(signer.uid, "t", weight=1)
    claim = signer.claim(A, "title", "first")
    httpx.post(f"{srv.url}/api/claims", json={"claims": [claim]}, headers=srv.headers)
    rid = httpx.get(f"{srv.url}/meta/{A}", timeout=10).json()["hashId"]
    paths = [f"/api/metadata/{rid}", f"/api/metadata/{rid.lower()}/claims"]
    tags = {}
    for path in paths:
        first = httpx.get(srv.url + path, headers=srv.headers, timeout=10)
        tag = first.headers["etag"]
        assert re.fullmatch(r'"[0-9a-f]{24}"', tag), path
        assert first.headers.get_list("cache-control") == ["private, no-cache"], path
        held = {**srv.headers, "If-None-Match": f"W/{tag}"}
        same = httpx.get(srv.url + path, headers=held, timeout=10)
        assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", tag), path
        assert same.headers.get_list("cache-control") == ["private, no-cache"], path
        refused = httpx.get(srv.url + path, headers={"If-None-Match": tag}, timeout=10)
        assert refused.status_code == 401 and refused.headers["cache-control"] == "no-store"
        tags[path] = tag
    newer = signer.claim(A, "title", "second", ts=int(claim["ts"]) + 1)
    httpx.post(f"{srv.url}/api/claims", json={"claims": [newer]}, headers=srv.headers)
    for path in paths:
        held = {**srv.headers, "If-None-Match": tags[path]}
        again = httpx.get(srv.url + path, headers=held, timeout=10)
        assert again.status_code == 200 and again.headers["etag"] != tags[path], path
    document = httpx.get(f"{srv.url}/api/metadata/{rid}", headers=srv.headers, timeout=10)
    assert document.json()["metadata"]["title"] == "second"
    never = rids.Minter().mint()
    unknown = httpx.get(f"{srv.url}/api/metadata/{never}", headers=srv.headers, timeout=10)
    assert unknown.status_code == 404 and "etag" not in unknown.headers
