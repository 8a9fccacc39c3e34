"""metanode behind nginx and behind Caddy, configured exactly as docs/operations.md ("Behind a
reverse proxy") shows (the configurations are read from that page: at the root of a host, and
under a sub-path with `root_path`, each for both), HTTPS ended at the proxy with a self-signed
certificate: Debian's `nginx`, `caddy` and `openssl` (installed with apt-get when missing, as the
other tests install their packages), a real `metanode serve`, and Debian's `chromium` for what
only a browser does (`EventSource`, the page's links, forms and scripts under the sub-path).
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.helpers.server import PLUGINS_ON, Server, free_port
from tests.helpers.wait import poll
from tools.bench.pgcluster import install

DOC = Path(__file__).parents[1] / "docs" / "operations.md"
CHROMIUM = "/usr/bin/chromium"
WAIT_S = 60.0  # a bound on a hang, not a measurement: both cores may be busy
PREFIX = "/metanode"  # the sub-path of the second documented configuration of each proxy
PROXIES = ("nginx", "caddy")


def package(binary: str, name: str) -> str:
    """The path of a Debian package's binary, installed with apt-get if missing; else skip."""
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    if found is None:
        why = install(name)
        found = shutil.which(binary, path="/usr/sbin:/usr/bin")
        if found is None:
            pytest.skip(f"Debian's {name}: {why or 'not found after installing'}")
    return found


def documented(language: str, which: int, ours: dict[str, str]) -> str:
    """docs/operations.md's configuration in `language` (`nginx`, `caddyfile`): the first (at
    the root of a host) or the second (under the sub-path `PREFIX`), each documented value of
    `ours` replaced by ours (ports, certificate)."""
    found = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)
    assert len(found) == 2, f"docs/operations.md shows no two {language} configurations"
    block = str(found[which])
    for documented_value, our_value in ours.items():
        assert documented_value in block, (
            f"the documented configuration has no {documented_value!r}"
        )
        block = block.replace(documented_value, our_value)
    return block


@dataclass
class Site:
    """What a proxy is given: its folder, its port, the node's, the certificate's files."""

    root: Path
    port: int
    upstream: int
    cert: Path
    key: Path


def nginx(site: Site, which: int) -> tuple[list[str], dict[str, str]]:
    """nginx with the documented block on our ports and certificate, in a whole nginx.conf of
    its own (its pid, logs and temporary files under the site's folder)."""
    root = site.root
    block = documented(
        "nginx",
        which,
        {
            "listen 443 ssl;": f"listen 127.0.0.1:{site.port} ssl;",
            "http://127.0.0.1:9000": f"http://127.0.0.1:{site.upstream}",
            "/etc/nginx/metanode.crt": str(site.cert),
            "/etc/nginx/metanode.key": str(site.key),
        },
    )
    temp = " ".join(
        f"{kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi")
    )
    # as root, nginx's workers run as `nobody`, who may not enter pytest's private folders
    user = "user root;\n" if os.geteuid() == 0 else ""
    (root / "nginx.conf").write_text(
        f"{user}pid {root / 'nginx.pid'};\nerror_log {root / 'error.log'} info;\n"
        "events { worker_connections 64; }\n"
        f"http {{\naccess_log {root / 'access.log'};\n{temp} scgi_temp_path {root / 'scgi'};\n"
        f"{block}}}\n"
    )
    binary = package("nginx", "nginx")
    return [binary, "-p", str(root), "-c", str(root / "nginx.conf"), "-g", "daemon off;"], {}


def caddy(site: Site, which: int) -> tuple[list[str], dict[str, str]]:
    """Caddy with the documented Caddyfile, its site our address with our certificate (the
    documented name would have Caddy ask a certificate authority), its admin endpoint off and
    its state under the site's folder. Stopped with an `EventSource` still open, it ends within
    the documented `grace_period` (without it, it waited for the feed for good)."""
    name = ("metanode.home.arpa {", "home.example {")[which]
    ours = f"https://127.0.0.1:{site.port} {{\n    tls {site.cert} {site.key}"
    block = documented(
        "caddyfile", which, {name: ours, "127.0.0.1:9000": f"127.0.0.1:{site.upstream}"}
    )
    (site.root / "Caddyfile").write_text(block.replace("{\n", "{\n    admin off\n", 1))
    binary = package("caddy", "caddy")
    state = {"XDG_DATA_HOME": str(site.root / "data-caddy"), "HOME": str(site.root)}
    command = [binary, "run", "--config", str(site.root / "Caddyfile"), "--adapter", "caddyfile"]
    return command, {"XDG_CONFIG_HOME": str(site.root / "config-caddy"), **state}


@dataclass
class Proxied:
    """A node behind a proxy: `url` is the proxy's (HTTPS), `server.url` the node's own."""

    server: Server
    url: str
    tls: ssl.SSLContext

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=self.tls, timeout=WAIT_S)


@contextmanager
def behind(root: Path, proxy: str, which: int, env: dict[str, str]) -> Iterator[Proxied]:
    """A node with `env` behind `proxy` (nginx or caddy) with its documented configuration
    `which`, under `root`."""
    openssl = package("openssl", "openssl")
    cert, key = root / "cert.pem", root / "key.pem"
    self_signed = ["-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=x"]
    for_ip = ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [openssl, "req", *self_signed, *for_ip, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    (root / "data").mkdir()
    server = Server(root / "data", env={"METANODE_TRUSTED_PROXIES": "127.0.0.1/32", **env}).start()
    server.media.mkdir(exist_ok=True)
    port = free_port()
    command, proxy_env = {"nginx": nginx, "caddy": caddy}[proxy](
        Site(root, port, server.port, cert, key), which
    )
    with (root / "proxy.out").open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=out, env={**os.environ, **proxy_env}, cwd=root
        )
    tls = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"
    health = f"{env.get('METANODE_ROOT_PATH', '')}/health"

    def up() -> bool | None:
        assert proc.poll() is None, (root / "proxy.out").read_text()
        try:
            return httpx.get(f"{url}{health}", verify=tls, timeout=5).status_code == 200 or None
        except httpx.TransportError:
            return None

    try:
        poll(up, f"{proxy} in front of the node")
        yield Proxied(server, url, tls)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.stop()
        server.print_log()


@pytest.fixture(scope="module", params=PROXIES)
def proxied(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxied]:
    """A node at the root of the proxy's host (its first documented configuration)."""
    root = tmp_path_factory.mktemp(f"proxy-{request.param}")
    with behind(root, request.param, 0, {"METANODE_WATCH_SETTLE_S": "0.3"}) as proxied:
        yield proxied


@pytest.fixture(scope="module", params=PROXIES)
def subpath(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxied]:
    """A node under the proxy's `PREFIX` (its second documented configuration, `root_path`),
    with the built-in plugins on (the Plugins page's script asks for their counts)."""
    root = tmp_path_factory.mktemp(f"subpath-{request.param}")
    env = {**PLUGINS_ON, "METANODE_ROOT_PATH": PREFIX}
    with behind(root, request.param, 1, env) as proxied:
        yield proxied


def sign_in(client: httpx.Client, token: str, origin: str, prefix: str = "") -> httpx.Response:
    """POST /signin as the page's form does (a browser names the page's `Origin`)."""
    return client.post(
        f"{prefix}/signin",
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
    """nginx buffers what it proxies unless told not to (`X-Accel-Buffering: no`; Caddy flushes
    an event stream as it comes): one event is far less than a buffer, so a buffered feed would
    say nothing within the bound."""
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
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        why = install("chromium")
        if why:
            pytest.skip(f"Debian's chromium: {why}")
    with sync_playwright() as p:
        # --no-sandbox: the suite runs as root, where Chromium's sandbox refuses to start
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser: Browser) -> Page:
    return browser.new_context(ignore_https_errors=True).new_page()


FOLLOW = """url => {
  window.seen = [];
  window.feed = new EventSource(url);
  for (const name of ["add", "change", "rename", "delete", "reset", "gap"])
    window.feed.addEventListener(name, e => window.seen.push([e.type, e.lastEventId, e.data]));
}"""


def seen(page: Page, name: str) -> bool | None:
    return page.evaluate("n => window.seen.some(e => e[2].includes(n))", name) or None


# -- under a sub-path ---------------------------------------------------------------------------


def test_under_a_sub_path_every_url_the_node_gives_is_under_it(subpath: Proxied) -> None:
    """The second documented configuration: nginx strips `PREFIX`, the node (`root_path`)
    puts it in everything it names: the sign-in form and its assets, the redirects, the
    cookie's `Path`, `/urls`, `/api/services`, WebDAV's redirect and listings, the OpenAPI
    document's server."""
    base = f"{subpath.url}{PREFIX}"
    with subpath.client() as browser:
        bare = browser.get(PREFIX, follow_redirects=False)  # nginx's own, to the location
        assert bare.status_code == 301 and bare.headers["location"].endswith(f"{PREFIX}/")
        signin = browser.get(f"{PREFIX}/")
        assert signin.status_code == 200 and "<h1>Sign in</h1>" in signin.text
        named = re.findall(r'(?:href|src|action)="([^"#][^"]*)"', signin.text)
        assert {url for url in named if not url.startswith(f"{PREFIX}/")} == {"data:,"}
        assets = [url for url in named if url.startswith(f"{PREFIX}/static/")]
        assert len(assets) == 3, named  # the stylesheets (with and without scripts), the script
        for url in assets:
            assert browser.get(url).status_code == 200, url
        signed_in = sign_in(browser, subpath.server.token, subpath.url, PREFIX)
        assert signed_in.status_code == 303, signed_in.text
        assert signed_in.headers["location"] == f"{PREFIX}/files"
        cookie = signed_in.headers["set-cookie"]
        assert f"Path={PREFIX};" in cookie and "Secure" in cookie, cookie
        page = browser.get(f"{PREFIX}/files")
        assert page.status_code == 200 and "<h1>Files</h1>" in page.text, page.text
        assert 'data-root="/metanode"' in page.text

        urls = browser.get(f"{PREFIX}/urls").json()
        assert urls["baseUrl"] == urls["apiUrl"] == base
        assert urls["webdavUrl"] == f"{base}/webdav"
        (node, *_) = browser.get(f"{PREFIX}/api/services").json()["services"]
        assert node["baseUrl"] == node["apiUrl"] == base
        assert node["healthUrl"] == f"{base}/health"
        (server,) = browser.get(f"{PREFIX}/openapi.json").json()["servers"]
        assert server["url"] == PREFIX  # the API docs' "Try it out" asks under it

        to_root = browser.request("PROPFIND", f"{PREFIX}/webdav", headers={"Depth": "0"})
        assert (to_root.status_code, to_root.headers["location"]) == (307, f"{PREFIX}/webdav/")
        listing = browser.request("PROPFIND", f"{PREFIX}/webdav/", headers={"Depth": "1"})
        assert listing.status_code == 207, listing.text
        hrefs = re.findall(r"<ns0:href>([^<]+)</ns0:href>", listing.text)
        assert hrefs == [f"{PREFIX}/webdav/", f"{PREFIX}/webdav/media/"], listing.text
        media = browser.request("PROPFIND", hrefs[1], headers={"Depth": "0"})  # as a client does
        assert media.status_code == 207, media.text

        out = browser.post(
            f"{PREFIX}/signout", data={"csrf": csrf_of(page.text)}, headers={"Origin": subpath.url}
        )
        assert out.status_code == 303 and out.headers["location"] == f"{PREFIX}/"
        assert f"Path={PREFIX};" in out.headers["set-cookie"]


def links(page: Page) -> list[str]:
    """Every link of the page, as the browser resolves it, without its fragment."""
    found = page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)")
    return [str(href).split("#")[0] for href in found]


def test_a_browser_under_the_sub_path_never_leaves_it(subpath: Proxied, browser: Browser) -> None:
    """A real Chromium through nginx under `PREFIX`: it signs in, follows every link of the
    library and of each page that leads to (Live, Files, Plugins, Signers, Health, the API
    docs, a record, its JSON, /health, /metrics), tries the API docs, saves an edit, sees a
    change on Live and signs out, and not one request it makes (a stylesheet, a script, the
    feed, the scripts' calls, a form, a redirect) is outside the prefix."""
    base = f"{subpath.url}{PREFIX}"
    server = subpath.server
    drop(server, "Quiet.Harbour.2004.mkv")
    context = browser.new_context(ignore_https_errors=True)
    context.set_default_timeout(WAIT_S * 1000)
    page = context.new_page()
    asked: list[str] = []
    failed: list[tuple[str, int]] = []
    page.on("request", lambda r: asked.append(r.url))
    page.on("response", lambda r: failed.append((r.url, r.status)) if r.status >= 400 else None)

    page.goto(f"{base}/")
    page.get_by_label("API token").fill(server.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Library")).to_be_visible()
    assert page.url == f"{base}/"
    display = "() => getComputedStyle(document.querySelector('header')).display"
    assert page.evaluate(display) == "flex"  # the stylesheet (metanode.css) applies

    def listed() -> bool | None:
        page.reload()
        return page.get_by_role("table").get_by_role("link").count() > 0 or None

    poll(listed, "the dropped file's record in the library")
    seen = {f"{base}/"}
    frontier = links(page)
    for _depth in range(2):  # the library's links, then the links of the pages they lead to
        found: list[str] = []
        for href in frontier:
            if href in seen or not href.startswith(f"{subpath.url}/"):
                continue  # another site's (the API document's licence), not the node's
            assert href.startswith(f"{base}/"), f"a link outside {PREFIX}: {href}"
            seen.add(href)
            response = page.goto(href)
            assert response is not None and response.status == 200, href
            if "text/html" in response.headers["content-type"]:
                found += links(page)
        frontier = found
    for page_of in ("live", "files", "plugins", "signers", "status", "docs", "records/", "api/"):
        assert any(href.startswith(f"{base}/{page_of}") for href in seen), (page_of, seen)

    with page.expect_request(lambda r: "/api/plugins" in r.url) as polled:
        page.goto(f"{base}/plugins")  # its script asks for the counts two seconds later
    assert polled.value.url == f"{base}/api/plugins"
    page.goto(f"{base}/docs")
    page.locator(".opblock-summary", has_text="/health").first.click()
    page.get_by_role("button", name="Try it out").click()
    with page.expect_response(lambda r: r.url.endswith("/health")) as tried:
        page.get_by_role("button", name="Execute").click()
    assert (tried.value.url, tried.value.status) == (f"{base}/health", 200)

    page.goto(f"{base}/")
    page.get_by_role("table").get_by_role("link").first.click()
    page.get_by_label("New key").fill("shelf")
    page.get_by_label("Value", exact=True).fill("B-12")
    page.get_by_role("button", name="Add").click()  # a form, then a redirect to the record
    row = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name="shelf"))
    expect(row.locator(".value")).to_have_text("B-12")
    assert page.url.startswith(f"{base}/records/")
    expect(page.get_by_role("status")).to_have_text("Saved shelf.")

    page.get_by_role("link", name="Live").click()
    expect(page.get_by_role("status")).to_have_text("connected")  # the feed, under the prefix
    drop(server, "Second.Light.2010.mkv")
    change = (
        page.get_by_role("list", name="Changes")
        .get_by_role("listitem")
        .filter(has_text="Second.Light.2010.mkv")
        .first
    )
    # named as the library names it: asked of `<prefix>/records/<rid>/label`
    expect(change.get_by_role("link")).to_have_text(re.compile("Second"))
    assert str(change.get_by_role("link").get_attribute("href")).startswith(f"{PREFIX}/records/")

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("API token")).to_be_visible()
    assert page.url == f"{base}/" and context.cookies() == []
    context.close()

    outside = [url for url in asked if not url.startswith(f"{base}/") and url != "data:,"]
    assert outside == [], outside
    assert failed == []
    assert any(url.startswith(f"{base}/api/events") for url in asked)
    assert any(url.endswith("/label") for url in asked)


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
