"""Who may use which route, decided by the client address (`trusted_networks`, `trusted_proxies`;
docs/compat.md "Access", docs/api.md "Perimeter"), against a real `metanode serve`.

The server trusts only 127.0.0.1/32; the untrusted client is the same machine connecting from
127.0.0.2 (every 127/8 address is on Linux's loopback interface), so the test needs no second
host and exercises the very address uvicorn reports, not a stand-in.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metanode.api import FAMILIES, Access, access_of
from tests.helpers.server import Server, serve_refused

CONTENT = b"trusted networks " * 4096
TRUSTED, UNTRUSTED = "127.0.0.1", "127.0.0.2"
WAIT_S = 60.0
OPENAPI = json.loads((Path(__file__).parents[1] / "schemas" / "openapi.json").read_text("utf-8"))


def client_from(address: str) -> httpx.Client:
    """An HTTP client whose connections leave from `address`."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)


def start(tmp_path: Path, **env: str) -> Server:
    """A server trusting only 127.0.0.1, with one media file hashed and one legacy record."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "film.mkv").write_bytes(CONTENT)
    server = Server(tmp_path / "data", env={"METANODE_TRUSTED_NETWORKS": "127.0.0.1/32", **env})
    return server.start()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = start(tmp_path)
    yield srv
    srv.stop()
    srv.print_log()


def hashed_cid(server: Server) -> str:
    """The midhash of the media file, once the watcher has hashed it (polled, no timer race)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        files = httpx.get(f"{server.url}/api/files", headers=server.headers, timeout=10).json()
        if files["files"]:
            return str(files["files"][0]["midhash"])
        time.sleep(0.1)
    raise AssertionError(f"the watcher did not hash the media file in {WAIT_S} s")


def compat_routes(cid: str) -> list[tuple[str, str, bytes | None]]:
    """One request of every MetaMesh route family that answers 200 on this node."""
    return [
        ("GET", "/meta", None),
        ("GET", f"/meta/{cid}", None),
        ("PATCH", f"/meta/{cid}", b'{"title": "T"}'),
        ("PUT", f"/meta/{cid}/year", b'{"value": "1999"}'),
        ("POST", f"/meta/{cid}/_add/tags", b'{"value": "drama"}'),
        ("DELETE", f"/meta/{cid}/year", None),
        ("GET", f"/meta/{cid}/title", None),
        ("GET", f"/api/file/{cid}/info", None),
        ("GET", f"/file/{cid}", None),
        ("GET", "/urls", None),
        ("GET", "/api/services", None),
    ]


STREAMS = ("/api/events/meta", "/api/events/files")
NATIVE = ("/api/signers", "/api/hash-ids", "/api/files", "/api/plugins", "/api/events", "/metrics")


def status_of(client: httpx.Client, method: str, url: str, **kwargs: object) -> int:
    """The status of a request; a stream is closed as soon as its head has arrived."""
    with client.stream(method, url, **kwargs) as response:  # type: ignore[arg-type]
        if response.status_code != 200:
            response.read()
            assert response.json()["error"] == "unauthorized", response.text
        return response.status_code


def test_compat_routes_are_open_to_trusted_networks_only(server: Server) -> None:
    cid = hashed_cid(server)
    routes = [*compat_routes(cid), *(("GET", path, None) for path in STREAMS)]
    with client_from(TRUSTED) as trusted, client_from(UNTRUSTED) as untrusted:
        for method, path, body in routes:
            url = f"{server.url}{path}"
            assert status_of(untrusted, method, url, content=body) == 401, path
            assert status_of(untrusted, method, url, content=body, headers=server.headers) == 200
            assert status_of(trusted, method, url, content=body) == 200, path
        assert untrusted.get(f"{server.url}/meta/{cid}/title", headers=server.headers).text == "T"


def test_webdav_is_open_to_trusted_networks_only(server: Server) -> None:
    """`/webdav` is a compat route: meta-fuse and meta-sort read bytes there without a token."""
    hashed_cid(server)
    requests = [
        ("PROPFIND", "/webdav/", {"Depth": "1"}, 207),
        ("HEAD", "/webdav/media/film.mkv", {}, 200),
        ("GET", "/webdav/media/film.mkv", {"Range": "bytes=0-9"}, 206),
        ("GET", "/webdav", {}, 307),  # to /webdav/
    ]
    with client_from(TRUSTED) as trusted, client_from(UNTRUSTED) as untrusted:
        for method, path, headers, status in requests:
            url = f"{server.url}{path}"
            refused = untrusted.request(method, url, headers=headers)
            assert refused.status_code == 401, (method, path)
            if method != "HEAD":
                assert refused.json()["error"] == "unauthorized"
            given = untrusted.request(method, url, headers={**headers, **server.headers})
            assert given.status_code == status, (method, path)
            answer = trusted.request(method, url, headers=headers)
            assert answer.status_code == status, (method, path)
        part = trusted.get(f"{server.url}/webdav/media/film.mkv", headers={"Range": "bytes=0-9"})
        assert part.content == CONTENT[:10]


def test_native_routes_need_the_token_from_everywhere(server: Server) -> None:
    with client_from(TRUSTED) as trusted, client_from(UNTRUSTED) as untrusted:
        for client in (trusted, untrusted):
            for path in NATIVE:
                url = f"{server.url}{path}"
                assert status_of(client, "GET", url) == 401, path
                assert status_of(client, "GET", url, headers=server.headers) == 200, path
            for path in ("/health", "/openapi.json", "/api/meta/not-a-cid"):  # public as before
                assert client.get(f"{server.url}{path}").status_code in (200, 400), path


def test_a_spoofed_forwarded_for_does_not_make_a_client_trusted(server: Server) -> None:
    spoofed = {"X-Forwarded-For": TRUSTED}
    with client_from(UNTRUSTED) as untrusted:
        for path in ("/meta", "/urls", "/api/services"):
            assert status_of(untrusted, "GET", f"{server.url}{path}", headers=spoofed) == 401


def test_forwarded_headers_are_ignored_from_loopback_too(tmp_path: Path) -> None:
    """uvicorn's own default believes X-Forwarded-* from 127.0.0.1; with no trusted_proxies
    metanode does not, so a local client cannot take on another (trusted) address."""
    server = start(tmp_path, METANODE_TRUSTED_NETWORKS=f"{UNTRUSTED}/32")
    try:
        with client_from(TRUSTED) as local:
            meta = f"{server.url}/meta"
            assert status_of(local, "GET", meta, headers={"X-Forwarded-For": UNTRUSTED}) == 401
            forwarded = {**server.headers, "X-Forwarded-Proto": "https"}
            urls = local.get(f"{server.url}/urls", headers=forwarded).json()
            assert urls["baseUrl"] == server.url, urls
    finally:
        server.stop()
        server.print_log()


def test_a_configured_proxy_is_believed(tmp_path: Path) -> None:
    server = start(tmp_path, METANODE_TRUSTED_PROXIES=UNTRUSTED)
    try:
        with client_from(UNTRUSTED) as proxy, client_from(TRUSTED) as trusted:
            meta = f"{server.url}/meta"
            assert status_of(proxy, "GET", meta) == 401  # the proxy itself is not trusted
            assert status_of(proxy, "GET", meta, headers={"X-Forwarded-For": TRUSTED}) == 200
            # the proxy forwarding an outside client: that client's address decides
            outside = {"X-Forwarded-For": "192.0.2.9"}
            assert status_of(proxy, "GET", meta, headers=outside) == 401
            # a client that is no proxy is not believed, even a trusted one
            assert status_of(trusted, "GET", meta, headers=outside) == 200
    finally:
        server.stop()
        server.print_log()


def test_the_session_cookie_is_secure_when_a_proxy_says_the_page_came_over_https(
    tmp_path: Path,
) -> None:
    """Behind a TLS proxy, a cookie without `Secure` went along with any plain-HTTP request
    to the same host (a link, the proxy's own redirect from port 80), readable on the way."""
    server = start(tmp_path, METANODE_TRUSTED_PROXIES=UNTRUSTED)
    try:
        with client_from(UNTRUSTED) as proxy, client_from(TRUSTED) as direct:
            form = {"token": server.token, "then": "/"}
            https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "192.0.2.9"}
            over_tls = proxy.post(f"{server.url}/signin", data=form, headers=https)
            plain = direct.post(f"{server.url}/signin", data=form)
            spoofed = direct.post(f"{server.url}/signin", data=form, headers=https)  # no proxy
        for answer in (over_tls, plain, spoofed):
            assert answer.status_code == 303, answer.text
        flags = [
            {part.strip().lower() for part in a.headers["set-cookie"].split(";")[1:]}
            for a in (over_tls, plain, spoofed)
        ]
        assert [("secure" in f, "httponly" in f, "samesite=strict" in f) for f in flags] == [
            (True, True, True),
            (False, True, True),
            (False, True, True),
        ]
        cookie = over_tls.cookies["metanode_session"]
        with client_from(UNTRUSTED) as proxy:
            signed_in = {**https, "Cookie": f"metanode_session={cookie}"}
            csrf = csrf_of(proxy, server, signed_in)
            out = proxy.post(f"{server.url}/signout", data={"csrf": csrf}, headers=signed_in)
        assert out.status_code == 303
        assert "secure" in out.headers["set-cookie"].lower()
    finally:
        server.stop()
        server.print_log()


def csrf_of(client: httpx.Client, server: Server, headers: dict[str, str]) -> str:
    """The CSRF token of the session whose cookie `headers` carry, as its page holds it."""
    page = client.get(f"{server.url}/signers", headers=headers)
    found = re.search(r'data-csrf="([^"]+)"', page.text)
    assert found is not None, page.text
    return found.group(1)


@pytest.mark.parametrize(
    ("name", "value"),
    [("TRUSTED_NETWORKS", "10.0.0.0/33"), ("TRUSTED_NETWORKS", "lan"), ("TRUSTED_PROXIES", "::g")],
)
def test_a_malformed_cidr_refuses_to_start(tmp_path: Path, name: str, value: str) -> None:
    env = {**Server(tmp_path / "data").base_env(), f"METANODE_{name}": value}
    done = serve_refused(tmp_path, env, "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: invalid_request: setting {name.lower()}: {value!r}")


@given(st.from_regex(r"[a-zA-Z0-9._~%-]{1,20}", fullmatch=True))
def test_every_documented_route_is_in_the_family_its_document_says(value: str) -> None:
    """The perimeter's table agrees with the OpenAPI document for every route, whatever a path
    parameter holds: the compat tag is TRUSTED, `security: []` PUBLIC, a peer token among its
    security PEER, the rest TOKEN."""
    for template, item in OPENAPI["paths"].items():
        path = re.sub(r"\{[^}]+\}", value, template)
        for operation in item.values():
            if operation.get("security") == []:
                expected = Access.PUBLIC
            elif {"peerToken": []} in operation.get("security", []):
                expected = Access.PEER
            elif "compat" in operation.get("tags", []):
                expected = Access.TRUSTED
            else:
                expected = Access.TOKEN
            assert access_of(path) is expected, (template, path)
    # WebDAV is outside the document (docs/compat.md "WebDAV") and a compat route all the same
    for path in ("/webdav", "/webdav/", f"/webdav/{value}", f"/webdav/media/{value}"):
        assert access_of(path) is Access.TRUSTED, path
    assert access_of(f"/webdav{value}") is Access.TOKEN  # not the family: no prefix match


def first_family(path: str) -> Access:
    """`access_of` by its definition: the first family of the table that matches."""
    for family, access in FAMILIES:
        if path == family or (family != "/" and family.endswith("/") and path.startswith(family)):
            return access
    return Access.TOKEN


@given(
    st.sampled_from([family for family, _ in FAMILIES] + ["", "/api/claims", "/api/"]),
    st.sampled_from(["", "/", "x", "/x", "s/", "%2F"]),
)
def test_the_indexed_families_answer_as_the_table_read_in_order(family: str, tail: str) -> None:
    """`access_of` looks paths up in an index of `FAMILIES`; it answers as the table does,
    read family by family, for every family, its neighbours and what a path adds to one."""
    assert access_of(family + tail) is first_family(family + tail), family + tail
