"""metanode behind nginx, configured exactly as docs/operations.md ("Behind a reverse proxy")
shows (the configuration is read from that page), HTTPS ended at nginx with a self-signed
certificate: Debian's `nginx` and `openssl` (installed with apt-get when missing, as the other
tests install their packages), a real `metanode serve`, and Debian's `chromium` for what only
a browser's `EventSource` does.
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from tests.helpers.server import Server, free_port
from tests.helpers.wait import poll
from tools.bench.pgcluster import install

DOC = Path(__file__).parents[1] / "docs" / "operations.md"
CHROMIUM = "/usr/bin/chromium"
WAIT_S = 60.0  # a bound on a hang, not a measurement: both cores may be busy


def package(binary: str, name: str) -> str:
    """The path of a Debian package's binary, installed with apt-get if missing; else skip."""
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    if found is None:
        why = install(name)
        found = shutil.which(binary, path="/usr/sbin:/usr/bin")
        if found is None:
            pytest.skip(f"Debian's {name}: {why or 'not found after installing'}")
    return found


def documented_config() -> str:
    """The nginx `server` block of docs/operations.md."""
    found = re.search(r"```nginx\n(.*?)```", DOC.read_text(), re.S)
    assert found, "docs/operations.md shows no nginx configuration"
    return found.group(1)


def nginx_config(root: Path, port: int, upstream: int, cert: Path, key: Path) -> str:
    """The documented block on our ports and certificate, in a whole nginx.conf of its own
    (its pid, logs and temporary files under `root`)."""
    block = documented_config()
    for documented, ours in (
        ("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;"),
        ("http://127.0.0.1:9000;", f"http://127.0.0.1:{upstream};"),
        ("/etc/nginx/metanode.crt", str(cert)),
        ("/etc/nginx/metanode.key", str(key)),
    ):
        assert documented in block, f"the documented configuration has no {documented!r}"
        block = block.replace(documented, ours)
    temp = " ".join(
        f"{kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi")
    )
    # as root, nginx's workers run as `nobody`, who may not enter pytest's private folders
    user = "user root;\n" if os.geteuid() == 0 else ""
    return (
        f"{user}pid {root / 'nginx.pid'};\nerror_log {root / 'error.log'} info;\n"
        "events { worker_connections 64; }\n"
        f"http {{\naccess_log {root / 'access.log'};\n{temp} scgi_temp_path {root / 'scgi'};\n"
        f"{block}}}\n"
    )


@dataclass
class Proxied:
    """A node behind nginx: `url` is nginx's (HTTPS), `server.url` the node's own."""

    server: Server
    url: str
    tls: ssl.SSLContext

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=self.tls, timeout=WAIT_S)


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxied]:
    nginx = package("nginx", "nginx")
    openssl = package("openssl", "openssl")
    root = tmp_path_factory.mktemp("proxy")
    cert, key = root / "cert.pem", root / "key.pem"
    self_signed = ["-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=x"]
    for_ip = ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [openssl, "req", *self_signed, *for_ip, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    (root / "data").mkdir()
    server = Server(
        root / "data",
        env={"METANODE_TRUSTED_PROXIES": "127.0.0.1/32", "METANODE_WATCH_SETTLE_S": "0.3"},
    ).start()
    server.media.mkdir(exist_ok=True)
    port = free_port()
    (root / "nginx.conf").write_text(nginx_config(root, port, server.port, cert, key))
    with (root / "nginx.out").open("wb") as out:
        proc = subprocess.Popen(
            [nginx, "-p", str(root), "-c", str(root / "nginx.conf"), "-g", "daemon off;"],
            stdout=out,
            stderr=out,
        )
    tls = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"

    def up() -> bool | None:
        assert proc.poll() is None, (root / "nginx.out").read_text()
        try:
            return httpx.get(f"{url}/health", verify=tls, timeout=5).status_code == 200 or None
        except httpx.TransportError:
            return None

    try:
        poll(up, "nginx in front of the node")
        yield Proxied(server, url, tls)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.stop()
        server.print_log()


def sign_in(client: httpx.Client, token: str, origin: str) -> httpx.Response:
    """POST /signin as the page's form does (a browser names the page's `Origin`)."""
    return client.post(
        "/signin",
        data={"token": token, "then": "/files"},
        headers={"Origin": origin},
        follow_redirects=False,
    )


def drop(server: Server, name: str) -> None:
    """A file of its own content in the watched folder, written whole before it shows."""
    part = server.media / f".{name}.part"
    part.write_bytes(name.encode() * 512)
    part.rename(server.media / name)


# -- the tests ----------------------------------------------------------------------------------


def test_signing_in_through_the_proxy_over_https_gives_a_secure_cookie(proxied: Proxied) -> None:
    with proxied.client() as browser:
        assert "<h1>Sign in</h1>" in browser.get("/").text
        signed_in = sign_in(browser, proxied.server.token, proxied.url)
        assert signed_in.status_code == 303, signed_in.text
        assert signed_in.headers["location"] == "/files"
        cookie = signed_in.headers["set-cookie"]
        assert "Secure" in cookie and "HttpOnly" in cookie and "Path=/;" in cookie, cookie
        page = browser.get("/files")  # the client keeps the cookie: it was sent over HTTPS
        assert page.status_code == 200 and "<h1>Files</h1>" in page.text, page.text
        for asset in re.findall(r'(?:href|src)="(/static/[^"]+)"', page.text):
            assert browser.get(asset).status_code == 200, asset
        out = browser.post(
            "/signout", data={"csrf": csrf_of(page.text)}, headers={"Origin": proxied.url}
        )
        assert out.status_code == 303 and "Secure" in out.headers["set-cookie"]
    with httpx.Client(base_url=proxied.server.url) as direct:  # plain HTTP: not Secure
        signed_in = sign_in(direct, proxied.server.token, proxied.server.url)
        assert signed_in.status_code == 303
        assert "Secure" not in signed_in.headers["set-cookie"]


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


def test_a_proxy_that_rewrites_host_gets_a_refusal_that_says_so(proxied: Proxied) -> None:
    """nginx's `proxy_set_header Host $host` drops the port the browser named: the node's own
    sign-in form is then refused, and the refusal names both sides, so a person sees why."""
    with httpx.Client(base_url=proxied.server.url) as client:
        refused = client.post(
            "/signin",
            data={"token": proxied.server.token},
            headers={"Origin": "http://box:8080", "Host": "box"},
        )
    assert refused.status_code == 403
    said = "this form came from http://box:8080, but reached the node addressed to &#39;box&#39;"
    assert said in refused.text
    assert "set-cookie" not in refused.headers


def test_what_the_node_names_through_the_proxy_is_the_proxy(proxied: Proxied) -> None:
    with proxied.client() as client:  # from loopback through a trusted proxy: a trusted client
        urls = client.get("/urls").json()
        assert urls["baseUrl"] == urls["apiUrl"] == proxied.url
        assert urls["webdavUrl"] == f"{proxied.url}/webdav"
        (node, *_) = client.get("/api/services").json()["services"]
        assert node["healthUrl"] == f"{proxied.url}/health"
        listing = client.request("PROPFIND", "/webdav/", headers={"Depth": "1"})
        assert listing.status_code == 207
        assert "<ns0:href>/webdav/media/</ns0:href>" in listing.text, listing.text
        # a batch over nginx's default body limit (1 MiB) reaches the node, answered in its envelope
        big = client.post(
            "/api/claims",
            content=b'{"claims": "' + b"x" * 2_000_000 + b'"}',
            headers={**proxied.server.headers, "Content-Type": "application/json"},
        )
        assert big.status_code == 400 and big.json()["error"] == "invalid_request", big.text


def test_a_feed_through_the_proxy_comes_event_by_event(proxied: Proxied) -> None:
    """nginx buffers what it proxies unless told not to (`X-Accel-Buffering: no`): one event
    is far less than its buffer, so a buffered feed would say nothing within the bound."""
    server = proxied.server
    with (
        proxied.client() as client,
        client.stream("GET", "/api/events?prefix=filePath", headers=server.headers) as stream,
    ):
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        drop(server, "through-nginx.bin")
        for line in stream.iter_lines():
            if line.startswith("data:") and "through-nginx.bin" in line:
                break


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    if not Path(CHROMIUM).exists():
        why = install("chromium")
        if why:
            pytest.skip(f"Debian's chromium: {why}")
    with sync_playwright() as p:
        # --no-sandbox: the suite runs as root, where Chromium's sandbox refuses to start
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(ignore_https_errors=True)
        yield context.new_page()
        browser.close()


FOLLOW = """url => {
  window.seen = [];
  window.feed = new EventSource(url);
  for (const name of ["add", "change", "rename", "delete", "reset", "gap"])
    window.feed.addEventListener(name, e => window.seen.push([e.type, e.lastEventId, e.data]));
}"""


def seen(page: Page, name: str) -> bool | None:
    return page.evaluate("n => window.seen.some(e => e[2].includes(n))", name) or None


def test_an_event_source_through_the_proxy_resumes_after_the_node_restarts(
    proxied: Proxied, page: Page
) -> None:
    """While the node is down, the feeds' location closes the connection rather than answer
    nginx's 502 (which would stop an EventSource for good): the browser retries, and resumes
    from its last id once the node is back, nothing lost or doubled. Last in the module: it
    restarts the node."""
    server = proxied.server
    page.goto(f"{proxied.url}/health")  # a page of the node's origin, through the proxy
    page.evaluate(FOLLOW, "/api/events/files")  # a MetaMesh stream: no session to lose
    drop(server, "before-restart.bin")
    poll(lambda: seen(page, "before-restart.bin"), "the file's add event")

    before = page.evaluate("window.seen.length")
    server.stop()
    with proxied.client() as client:
        assert client.get("/health").status_code == 502
        with pytest.raises(httpx.RemoteProtocolError):  # closed with no answer at all
            client.get("/api/events/files")
    drop(server, "while-down.bin")
    port = server.port
    server.start()
    assert server.port == port, "the node came back on another port than nginx's upstream"

    poll(lambda: seen(page, "while-down.bin"), "the file made while the node was down")
    drop(server, "after-restart.bin")
    poll(lambda: seen(page, "after-restart.bin"), "the file made after the restart")
    assert page.evaluate("window.feed.readyState") == 1  # OPEN: it never gave up
    events = page.evaluate("window.seen")
    assert len({tuple(e) for e in events}) == len(events), events  # nothing doubled
    added = [e[2] for e in events if e[0] == "add"]
    assert sum("while-down.bin" in a for a in added) == 1
    assert [e for e in events[before:] if e[0] in ("gap", "reset")] == []  # resumed, not restarted
