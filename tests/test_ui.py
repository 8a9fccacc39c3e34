"""The web page (docs/ui.md) in a real headless Chromium (Debian's `chromium`, driven by
Playwright) against a real `metanode serve` with the built-in plugins and a watched folder.

Elements are found by role and accessible name, as a person using a screen reader would. With
`METANODE_UI_SCREENSHOTS=<dir>` the screenshot test also writes its PNGs there (docs/ui/).
"""

from __future__ import annotations

import contextlib
import http.server
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Page,
    Playwright,
    Route,
    expect,
    sync_playwright,
)

from metanode import cache, db, labels, rid, ui
from metanode import cid as cids
from tests.helpers.claims import Signer
from tests.helpers.plugins import install_plugin
from tests.helpers.server import Server, free_port, plugins_server
from tests.helpers.wait import poll
from tools.bench.pgcluster import install

CHROMIUM = "/usr/bin/chromium"
WAIT_MS = 60_000  # Playwright's bound for anything to appear: generous, both cores may be busy
# Matroska's EBML magic with DocType "matroska", so fileinfo sniffs a video.
MKV_HEAD = bytes.fromhex("1A45DFA3A34286810142F7810142F2810442F381084282886D6174726F736B61")
JPEG_HEAD = bytes.fromhex("FFD8FFE000104A46494600010100000100010000")
DESKTOP = {"width": 1280, "height": 900}
DESKTOP_ZOOMED = {"width": 640, "height": 450}  # the desktop at the browser's 200 % zoom
# the narrowest phone, and WCAG's reflow width (a 1280 px screen zoomed to 400 %)
PHONE = {"width": 320, "height": 640}
COMMON_PHONE = {"width": 360, "height": 740}
expect.set_options(timeout=WAIT_MS)


# -- the browser --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed with apt if missing (never `playwright install`: nothing
    is downloaded but packages); the tests skip, saying why, only where it cannot be."""
    if not Path(CHROMIUM).exists():
        why = install("chromium")
        if why:
            pytest.skip(f"Debian's chromium: {why}")
    return CHROMIUM


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    """Module-scoped: Playwright's sync API keeps an event loop running in this thread while
    it is open, which the async tests of later modules must not find."""
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright, chromium: str) -> Iterator[Browser]:
    # --no-sandbox: the suite runs as root, where Chromium's sandbox refuses to start
    b = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    yield b
    b.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server with the built-in plugins on, shared by the module (each test drops
    files of its own)."""
    with plugins_server(tmp_path_factory.mktemp("ui-server") / "data") as server:
        yield server
    server.print_log()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    ctx = browser.new_context(viewport=DESKTOP)
    ctx.set_default_timeout(WAIT_MS)
    yield ctx
    ctx.close()


@pytest.fixture
def page(context: BrowserContext, srv: Server) -> Page:
    """A signed-in page on the library."""
    p = context.new_page()
    sign_in(p, srv, srv.token)
    expect(p.get_by_role("heading", name="Library")).to_be_visible()
    return p


def sign_in(page: Page, srv: Server, token: str) -> None:
    page.goto(srv.url + "/")
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Sign in").click()


# -- the library's files ------------------------------------------------------------------------


def drop(srv: Server, name: str, head: bytes = MKV_HEAD) -> Path:
    """A file in the watched folder starting with `head` (a video's, by default), renamed in
    whole; its content is unique."""
    final = srv.media / name
    part = final.with_name(final.name + ".part")  # the watcher ignores *.part
    part.write_bytes(head + os.urandom(4096) + name.encode())
    part.rename(final)
    return final


def midhash_of(srv: Server, path: Path) -> str:
    """The midhash the watcher gave `path` (from GET /api/files), once it has."""

    def fetch() -> str | None:
        files = httpx.get(f"{srv.url}/api/files", headers=srv.headers, timeout=10).json()
        return next((f["midhash"] for f in files["files"] if f["path"] == str(path)), None)

    return poll(fetch, f"the watcher to list {path}")


def titled(srv: Server, path: Path, title: str) -> str:
    """`path`'s midhash once its record has `title` (the filename plugin's)."""
    return claimed(srv, path, "title", title)


def claimed(srv: Server, path: Path, key: str, value: str) -> str:
    """`path`'s midhash once its record's `key` is `value`."""
    midhash = midhash_of(srv, path)

    def fetch() -> str | None:
        doc = srv.meta(midhash)
        return midhash if doc is not None and doc["metadata"].get(key) == value else None

    return poll(fetch, f"{path.name} to get the {key} {value!r}")


@contextlib.contextmanager
def elsewhere(host: str, html: str) -> Iterator[str]:
    """The address of `html`, served by a web server of its own on a free port of `host`:
    `localhost` is another site than the node's `127.0.0.1` to the browser, `127.0.0.1` the
    same site (a site has no port). Its own page, not one of the node's rewritten in place,
    which would keep the node's Content-Security-Policy."""
    body = html.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Page) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://{host}:{server.server_address[1]}/"
        finally:
            server.shutdown()


def post(srv: Server, *claims: dict[str, Any]) -> None:
    response = httpx.post(
        f"{srv.url}/api/claims", headers=srv.headers, json={"claims": list(claims)}, timeout=130
    )
    assert response.status_code == 200, response.text


def field(page: Page, key: str) -> Any:
    """The row of `key` on a record page."""
    return page.get_by_role("row").filter(has=page.get_by_role("rowheader", name=key, exact=True))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- the tests ----------------------------------------------------------------------------------


def test_sign_in_refuses_a_wrong_token_and_gives_a_strict_httponly_cookie(
    context: BrowserContext, srv: Server
) -> None:
    page = context.new_page()
    response = page.goto(srv.url + "/")
    assert response is not None and "text/html" in response.headers["content-type"]
    sign_in(page, srv, "not-the-token")
    expect(page.get_by_role("alert")).to_contain_text("not this node's API token")
    assert context.cookies() == []
    sign_in(page, srv, srv.token)
    expect(page.get_by_role("heading", name="Library")).to_be_visible()
    (cookie,) = context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert srv.token not in cookie["value"]
    assert cookie["expires"] > time.time()  # it expires
    assert page.evaluate("document.cookie") == ""  # the page's scripts cannot read it


def test_signing_in_goes_on_to_the_page_asked_for(context: BrowserContext, srv: Server) -> None:
    midhash = titled(srv, drop(srv, "Slate.Harbour.2007.mkv"), "Slate Harbour")
    page = context.new_page()
    response = page.goto(f"{srv.url}/records/{midhash}?from=link")
    assert response is not None and response.status == 401
    page.get_by_label("API token").fill("not the token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_have_text("That is not this node's API token.")
    page.get_by_label("API token").fill(srv.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Slate Harbour")).to_be_visible()
    assert page.url == f"{srv.url}/records/{midhash}?from=link"


@example("//evil.example/x")
@example("/\\evil.example/x")
@example("https://evil.example/")
@example("/records/x?q=1#top")
@example("/signout")
@given(st.text())
def test_signing_in_goes_on_only_to_a_page_of_this_node(then: str) -> None:
    went = ui.local_path(then)
    assert went in (then, "/")
    for seen in (went, went.replace("\\", "/")):  # browsers take a backslash for a slash
        parts = urlsplit(seen)
        assert seen.startswith("/") and not parts.scheme and not parts.netloc
    assert urlsplit(went).path not in ("/signin", "/signout")


def test_the_library_lists_a_dropped_file_by_title_and_search_finds_it(
    page: Page, srv: Server
) -> None:
    titled(srv, drop(srv, "Zanzibar.Express.2011.mkv"), "Zanzibar Express")
    page.reload()
    expect(page.get_by_role("link", name="Zanzibar Express")).to_be_visible()
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Zanzibar Express"))
    expect(row).to_contain_text("2011")
    expect(row).to_contain_text("movie")

    page.get_by_label("Search").fill("zanzibar")
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_role("link", name="Zanzibar Express")).to_be_visible()
    expect(page).to_have_title("Library: “zanzibar” · metanode")  # which list the tab holds
    expect(page.get_by_role("table", name="Records matching “zanzibar”: 1")).to_be_visible()
    expect(page.get_by_role("navigation", name="Pages of the library")).to_have_count(0)

    page.get_by_label("Search").fill("quokka")
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_text("No record matches.")).to_be_visible()
    expect(page.get_by_role("link", name="Zanzibar Express")).to_have_count(0)

    page.get_by_label("Search").fill("")
    page.get_by_label("Type").select_option("movie")
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_role("link", name="Zanzibar Express")).to_be_visible()


def test_the_search_finds_a_title_and_a_file_name_as_a_person_types_them(
    page: Page, srv: Server
) -> None:
    """Without accents or in capitals, a word of the file name's dotted parts, a stray quote
    or operator typed with it: the record is found; a search of nothing but syntax finds
    nothing, and no search is an error."""
    titled(srv, drop(srv, "Amélie.2001.1080p.x264.mkv"), "Amélie")
    for typed, found in (
        ("amelie", True),
        ("AMÉLIE 2001", True),
        ("x264 1080p", True),
        ('"amelie', True),
        ("amelie -x264 *", True),
        ("amelie OR quokka", False),
        ('"', False),
        ("NEAR(", False),
    ):
        page.get_by_label("Search").fill(typed)
        page.get_by_role("button", name="Find").click()
        expect(page).to_have_title(f"Library: “{typed}” · metanode")  # the page of this search
        link = page.get_by_role("link", name="Amélie", exact=True)
        expect(link).to_have_count(1 if found else 0)
        if not found:
            expect(page.get_by_text("No record matches.")).to_be_visible()


def test_a_save_outweighed_by_another_signer_says_the_value_still_shown(
    page: Page, srv: Server
) -> None:
    """A signer weighing more than the owner (100) keeps its value: the page said "Saved
    title." and showed the value unchanged."""
    midhash = titled(srv, drop(srv, "Heavy.Anchor.2004.mkv"), "Heavy Anchor")
    heavy = Signer()
    srv.register(heavy.uid, "heavy", weight=150)
    post(srv, heavy.claim(midhash, "title", "The Heavy Anchor", now_ms()))
    page.goto(f"{srv.url}/records/{midhash}")
    page.get_by_role("button", name="Edit title").click()
    page.get_by_label("title", exact=True).fill("Anchor, Heavy")
    page.get_by_role("button", name="Save title").click()
    expect(field(page, "title").get_by_role("status")).to_have_text(
        "Saved title, but the record still shows “The Heavy Anchor”: its signers outweigh "
        "the owner."
    )
    expect(field(page, "title")).to_contain_text("Anchor, Heavy")  # listed as competing


def test_the_record_page_shows_who_said_what_for_a_key_two_signers_set(
    page: Page, srv: Server
) -> None:
    midhash = titled(srv, drop(srv, "Quiet.Harbour.1987.mkv"), "Quiet Harbour")
    critic = Signer()
    srv.register(critic.uid, "critic", weight=7)
    post(srv, critic.claim(midhash, "title", "The Quiet Harbour", now_ms()))
    page.goto(f"{srv.url}/records/{midhash}")
    expect(page.get_by_role("heading", name="The Quiet Harbour")).to_be_visible()
    title = field(page, "title")
    expect(title.locator(".value")).to_have_text("The Quiet Harbour")
    expect(title).to_contain_text("critic (7)")
    expect(title.locator(".competing")).to_contain_text("Quiet Harbour")
    expect(title.locator(".competing")).to_contain_text("plugin:filename (1)")
    expect(page.get_by_text(midhash, exact=True).first).to_be_visible()
    doc = srv.meta(midhash)
    assert doc is not None
    expect(page.get_by_role("listitem").filter(has_text=doc["paths"][0])).to_be_visible()
    expect(page.get_by_role("link", name="claims as JSON")).to_have_attribute(
        "href", f"/api/meta/{doc['canonical_cid']}/claims"
    )


def test_a_title_fixed_on_the_page_stays_through_reload_and_rename_and_reverts(
    page: Page, srv: Server
) -> None:
    path = drop(srv, "Glass.Orchard.2003.mkv")
    midhash = titled(srv, path, "Glass Orchard")
    page.goto(f"{srv.url}/records/{midhash}")
    page.get_by_role("button", name="Edit title").click()
    page.get_by_label("title", exact=True).fill("The Glass Orchard (director's cut)")
    page.get_by_role("button", name="Save").click()
    title = field(page, "title")
    expect(title.locator(".value")).to_have_text("The Glass Orchard (director's cut)")
    expect(title).to_contain_text("owner (100)")
    meta = srv.meta(midhash)
    assert meta is not None and meta["metadata"]["title"] == "The Glass Orchard (director's cut)"

    page.reload()
    expect(field(page, "title").locator(".value")).to_have_text(
        "The Glass Orchard (director's cut)"
    )

    # a new name the filename plugin reads the same title from (it runs again on a rename)
    renamed = path.rename(path.with_name("Glass Orchard (2003) 1080p.mkv"))
    poll(
        lambda: True if (srv.meta(midhash) or {}).get("filePath") == str(renamed) else None,
        "the rename to reach the record",
    )
    page.reload()
    title = field(page, "title")
    expect(page.get_by_role("listitem").filter(has_text=str(renamed))).to_be_visible()
    expect(title.locator(".value")).to_have_text("The Glass Orchard (director's cut)")
    expect(title.locator(".competing")).to_contain_text("Glass Orchard")
    expect(title.locator(".competing")).to_contain_text("plugin:filename")

    page.get_by_role("button", name="Revert title").click()
    title = field(page, "title")
    expect(title.locator(".value")).to_have_text("Glass Orchard")
    expect(title).to_contain_text("plugin:filename (1)")
    expect(page.get_by_role("button", name="Revert title")).to_have_count(0)


def test_a_new_key_added_on_the_page_is_the_owners(page: Page, srv: Server) -> None:
    midhash = titled(srv, drop(srv, "Amber.Fields.1999.mkv"), "Amber Fields")
    page.goto(f"{srv.url}/records/{midhash}")
    page.get_by_label("New key").fill("shelf")
    page.get_by_label("Value", exact=True).fill("B-12")
    page.get_by_role("button", name="Add").click()
    expect(field(page, "shelf").locator(".value")).to_have_text("B-12")
    expect(field(page, "shelf")).to_contain_text("owner (100)")
    # Edit, then Escape: the form closes, and the focus is back on its Edit button
    edit = page.get_by_role("button", name="Edit shelf")
    edit.click()
    expect(page.get_by_label("shelf", exact=True)).to_be_focused()
    page.keyboard.press("Escape")
    expect(page.get_by_label("shelf", exact=True)).to_be_hidden()
    expect(edit).to_be_focused()
    expect(edit).to_have_attribute("aria-expanded", "false")


def test_an_edit_is_said_once_on_the_record_and_a_refused_one_says_why_there(
    page: Page, srv: Server
) -> None:
    """What an edit did, or why it was refused (a key of the disk, a key the node refuses), is
    said on the record page it was made on, once; a message in the URL is not shown."""
    midhash = titled(srv, drop(srv, "Cinder.Bay.2011.mkv"), "Cinder Bay")
    page.goto(f"{srv.url}/records/{midhash}?saved=year was deleted by admin")
    expect(page.get_by_role("heading", name="Cinder Bay")).to_be_visible()
    expect(page.get_by_text("deleted by admin")).to_have_count(0)

    page.get_by_label("New key").fill("filePath")
    page.get_by_label("Value", exact=True).fill("/elsewhere.mkv")
    page.get_by_role("button", name="Add").click()
    expect(page.get_by_role("alert")).to_have_text(
        "'filePath' cannot be set here: it comes from the disk."
    )
    expect(page.get_by_role("heading", name="Cinder Bay")).to_be_visible()

    page.get_by_role("button", name="Edit year").click()
    page.get_by_label("year", exact=True).fill("2012")
    page.get_by_role("button", name="Save").click()
    expect(page.get_by_role("status")).to_have_text("Saved year.")
    page.reload()
    expect(field(page, "year").locator(".value")).to_have_text("2012")
    expect(page.get_by_role("status")).to_have_count(0)  # said once
    stale = page.context.new_page()  # a second tab, on the record as it was
    stale.goto(page.url)
    page.get_by_role("button", name="Revert year").click()
    expect(page.get_by_role("status")).to_have_text(
        "Reverted year: the owner's word on it is withdrawn."
    )
    expect(field(page, "year").locator(".value")).to_have_text("2011")
    stale.get_by_role("button", name="Revert year").click()  # it said it reverted again
    expect(stale.get_by_role("status")).to_have_text(
        "Nothing to revert: the owner has no word on year."
    )
    stale.close()

    page.get_by_label("New key").fill("notes//draft")  # the node's rule, not the page's
    page.get_by_label("Value", exact=True).fill("x")
    page.get_by_role("button", name="Add").click()
    expect(page.get_by_role("alert")).to_have_text(
        "'notes//draft' was not changed: key has an empty, '.' or '..' segment."
    )
    expect(page.get_by_role("heading", name="Cinder Bay")).to_be_visible()


def test_a_multiline_value_keeps_its_line_breaks_and_an_unchanged_save_signs_nothing(
    page: Page, srv: Server
) -> None:
    """An nfo's plot of two paragraphs is shown and edited with its line breaks (a one-line
    input glued them together on Save, and the owner's 100 then pinned the damage); Save of
    an unchanged value signs nothing."""
    midhash = titled(srv, drop(srv, "Tide.Clock.2016.mkv"), "Tide Clock")
    writer = Signer()
    srv.register(writer.uid, "nfo-like", weight=2)
    plot = "First paragraph of the plot.\n\nSecond paragraph, after a blank line."
    post(srv, writer.claim(midhash, "plot", plot, now_ms()))
    page.goto(f"{srv.url}/records/{midhash}")
    shown = field(page, "plot").locator(".value")
    assert shown.inner_text() == plot  # pre-wrap: the browser renders the breaks
    page.get_by_role("button", name="Edit plot").click()
    box = page.get_by_label("plot", exact=True)
    assert box.evaluate("e => e.tagName") == "TEXTAREA"
    expect(box).to_have_value(plot)
    field(page, "plot").get_by_role("button", name="Save").click()
    expect(page.get_by_role("status")).to_have_text("Nothing to save: plot already has that value.")
    expect(field(page, "plot")).not_to_contain_text("owner (100)")
    meta = srv.meta(midhash)
    assert meta is not None and meta["metadata"]["plot"] == plot

    page.get_by_role("button", name="Edit plot").click()
    page.get_by_label("plot", exact=True).fill(plot + "\nThird line.")
    field(page, "plot").get_by_role("button", name="Save").click()
    expect(page.get_by_role("status")).to_have_text("Saved plot.")
    meta = srv.meta(midhash)
    assert meta is not None and meta["metadata"]["plot"] == plot + "\nThird line."  # no CR


def test_a_long_value_leaves_the_other_columns_their_width(page: Page, srv: Server) -> None:
    """A 600-letter paragraph wraps in its own cell: the key, the signers and the Edit button
    keep their width (every cell shrank to a letter a line, Edit drawn one letter a row)."""
    midhash = titled(srv, drop(srv, "Loom.Weather.2018.mkv"), "Loom Weather")
    page.goto(f"{srv.url}/records/{midhash}")
    page.get_by_label("New key").fill("description")
    page.get_by_label("Value", exact=True).fill("A long description of the film, " * 20)
    page.get_by_role("button", name="Add").click()
    expect(field(page, "description")).to_contain_text("owner (100)")
    for row in ("description", "fileName", "title"):
        edit = page.get_by_role("button", name=f"Edit {row}")
        box = edit.bounding_box()
        assert box is not None and box["height"] < 3 * 16, (row, box)  # one line of text
        key = page.get_by_role("rowheader", name=row, exact=True).bounding_box()
        assert key is not None and key["width"] > 100, (row, key)


def test_an_edit_sent_after_the_session_ended_is_kept_through_signing_in(
    page: Page, context: BrowserContext, srv: Server
) -> None:
    """The session ends (signed out in another tab, a restart) while a record is open: Save
    shows the sign-in form saying the change was not saved, and signing in goes back to the
    record with what was typed in its form, to save again."""
    midhash = titled(srv, drop(srv, "Hollow.Signal.2009.mkv"), "Hollow Signal")
    page.goto(f"{srv.url}/records/{midhash}")
    other = context.new_page()
    other.goto(srv.url + "/")
    other.get_by_role("button", name="Sign out").click()
    expect(other.get_by_label("API token")).to_be_visible()

    page.get_by_role("button", name="Edit title").click()
    page.get_by_label("title", exact=True).fill("Hollow Signal (restored)")
    page.get_by_role("button", name="Save").click()
    expect(page.get_by_role("alert")).to_contain_text("so that change was not saved")
    expect(page.get_by_label("API token")).to_be_focused()
    expect(page.get_by_label("API token")).to_have_accessible_description(
        re.compile("so that change was not saved")
    )
    page.get_by_label("API token").fill(srv.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Hollow Signal")).to_be_visible()
    assert urlsplit(page.url).path.startswith("/records/")
    expect(page.get_by_role("alert")).to_contain_text("Not saved: you had been signed out")
    typed = page.get_by_label("title", exact=True)
    expect(typed).to_have_value("Hollow Signal (restored)")
    expect(typed).to_be_focused()
    assert (srv.meta(midhash) or {})["metadata"]["title"] == "Hollow Signal"
    field(page, "title").get_by_role("button", name="Save").click()
    expect(field(page, "title").locator(".value")).to_have_text("Hollow Signal (restored)")


def test_a_form_another_site_posts_is_never_carried_through_signing_in(
    context: BrowserContext, srv: Server
) -> None:
    """Another site's page makes the browser post an edit (without the session: the cookie is
    SameSite=Strict, so it meets the sign-in form as a lost edit would): it must not be said
    to be lost, nor wait in the record's form, focused, for the owner to save."""
    midhash = titled(srv, drop(srv, "Amber.Tide.2012.mkv"), "Amber Tide")
    evil = context.new_page()
    form = (
        f'<form method="post" action="{srv.url}/records/{midhash}/edit">'
        '<input name="key" value="title"><input name="value" value="Planted">'
        '<input name="action" value="save"><button type="submit">Go</button></form>'
    )
    with elsewhere("localhost", form) as there:  # localhost is another site than 127.0.0.1
        evil.goto(there)
    with evil.expect_navigation():
        evil.get_by_role("button", name="Go").click()
    expect(evil.get_by_label("API token")).to_be_visible()
    expect(evil.get_by_text("not saved")).to_have_count(0)
    assert "Planted" not in evil.content()
    evil.get_by_label("API token").fill(srv.token)
    evil.get_by_role("button", name="Sign in").click()
    expect(evil.get_by_role("heading", name="Library")).to_be_visible()
    evil.goto(f"{srv.url}/records/{midhash}")
    expect(evil.get_by_role("heading", name="Amber Tide")).to_be_visible()
    assert "Planted" not in evil.content()


def test_a_value_over_the_limit_is_refused_on_the_record_with_what_was_typed(
    page: Page, srv: Server
) -> None:
    """A value longer than `max_value_bytes` is the node's refusal on the record page, the
    Add form keeping the key and value typed (it was a bare 413 page, the text lost); the
    focus and the view go to the message."""
    midhash = titled(srv, drop(srv, "Salt.Meridian.2004.mkv"), "Salt Meridian")
    page.goto(f"{srv.url}/records/{midhash}")
    long = "x" * 70_000
    page.get_by_label("New key").fill("notes")
    page.get_by_label("Value", exact=True).fill(long)
    page.get_by_role("button", name="Add").click()
    said = page.get_by_role("alert")
    expect(said).to_contain_text("'notes' was not changed: value is 70000 bytes")
    expect(said).to_be_focused()
    assert urlsplit(page.url).fragment == "add"
    expect(page.get_by_label("New key")).to_have_value("notes")
    assert page.get_by_label("Value", exact=True).input_value() == long
    assert "notes" not in (srv.meta(midhash) or {})["metadata"]
    # far longer (over the form's own limit, which holds any value the node could take)
    page.get_by_label("Value", exact=True).fill("é" * 120_000)  # 720,000 characters sent
    page.get_by_role("button", name="Add").click()
    expect(page.get_by_role("alert")).to_have_text(
        "Not saved: that is far more than a value may hold (65,536 bytes of UTF-8)."
    )


def test_after_an_edit_the_page_is_at_its_row_with_the_focus_on_what_it_says(
    page: Page, srv: Server
) -> None:
    """The page goes back to the edited row (`#field-<key>`, spaces and all) and focuses the
    message there, not the top of the page; a skip link leads past the navigation."""
    midhash = titled(srv, drop(srv, "Iron.Lullaby.2013.mkv"), "Iron Lullaby")
    page.goto(f"{srv.url}/records/{midhash}")
    page.get_by_label("New key").fill("my rating")
    page.get_by_label("Value", exact=True).fill("4/5")
    page.get_by_role("button", name="Add").click()
    said = field(page, "my rating").get_by_role("status")
    expect(said).to_have_text("Saved my rating.")
    expect(said).to_be_focused()
    assert urlsplit(page.url).fragment == "field-my%20rating"
    assert page.evaluate("[...document.querySelectorAll('[id]')].every(e => !/\\s/.test(e.id))")
    page.get_by_label("New key").fill("my rating")  # again: it replaces, and says what
    page.get_by_label("Value", exact=True).fill("5/5")
    page.get_by_role("button", name="Add").click()
    expect(field(page, "my rating").get_by_role("status")).to_have_text(
        "Saved my rating, in place of “4/5”."
    )
    page.goto(f"{srv.url}/records/{midhash}")
    page.keyboard.press("Tab")
    skip = page.get_by_role("link", name="Skip to content")
    expect(skip).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("main")).to_be_focused()


def test_addresses_only_forms_post_to_lead_to_their_page_and_a_mistyped_one_signs_in(
    context: BrowserContext, srv: Server
) -> None:
    """Typed again or opened from the history, `/signin`, `/signout`, a record's `/edit` lead
    to their page, not a 405 envelope; a mistyped address opened signed out shows the sign-in
    form, which goes on to it (the 404 page), not a 401 envelope."""
    page = context.new_page()
    response = page.goto(f"{srv.url}/libary")
    assert response is not None and response.status == 401
    page.get_by_label("API token").fill(srv.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Not found")).to_be_visible()
    for path, heading in (
        ("/signin", "Library"),
        ("/signout", "Library"),
        ("/records/x/edit", "Not found"),
        ("/signers/x/block", "Signers"),
    ):
        response = page.goto(srv.url + path)
        assert response is not None and "text/html" in response.headers["content-type"], path
        expect(page.get_by_role("heading", name=heading)).to_be_visible()
    api = httpx.get(f"{srv.url}/libary", timeout=10)  # no browser: the envelope, as before
    assert api.status_code == 401 and api.json()["error"] == "unauthorized"


def test_newest_keeps_the_search_it_pages(page: Page, srv: Server) -> None:
    titled(srv, drop(srv, "Velvet.Quarry.2001.mkv"), "Velvet Quarry")
    newest_possible = rid.from_uuid("ffffffff-ffff-7fff-bfff-ffffffffffff")
    page.goto(f"{srv.url}/?q=velvet&type=movie&sidecars=1&before={newest_possible}")
    page.get_by_role("link", name="Newest").click()
    expect(page.get_by_role("link", name="Velvet Quarry")).to_be_visible()
    expect(page.get_by_label("Search")).to_have_value("velvet")
    expect(page.get_by_label("subtitles, nfo, artwork too")).to_be_checked()
    assert urlsplit(page.url).query == "q=velvet&type=movie&sidecars=1"


def test_the_library_pages_older_and_back_newer_through_a_search(page: Page, srv: Server) -> None:
    """Older records, then Newer records, give back the very pages seen (a review found only
    Older and Newest: a person one page too far had to start again from the top)."""
    pager = Signer()
    srv.register(pager.uid, "pager", weight=1)
    stamp = now_ms()
    post(
        srv,
        *[
            pager.claim(cids.midhash_bytes(f"paged {n}".encode()), "title", f"Quillwort {n}", stamp)
            for n in range(ui.PAGE * 2 + 20)
        ],
    )

    def shown() -> list[str]:
        links = page.get_by_role("table").get_by_role("link")
        expect(links.first).to_be_visible()
        return links.all_inner_texts()

    page.goto(f"{srv.url}/?q=quillwort")
    pages = [shown()]
    caption = f"Records matching “quillwort”: {ui.PAGE} on this page"
    expect(page.get_by_role("table", name=caption)).to_be_visible()
    expect(page.get_by_role("link", name="Newer records")).to_have_count(0)
    for _ in range(2):
        page.get_by_role("link", name="Older records").click()
        pages.append(shown())
    expect(page.get_by_role("link", name="Older records")).to_have_count(0)
    assert [len(rows) for rows in pages] == [ui.PAGE, ui.PAGE, 20]
    assert len({title for rows in pages for title in rows}) == ui.PAGE * 2 + 20
    for seen in pages[-2::-1]:
        page.get_by_role("link", name="Newer records").click()
        assert shown() == seen
        expect(page.get_by_label("Search")).to_have_value("quillwort")
    expect(page.get_by_role("link", name="Newer records")).to_have_count(0)
    expect(page.get_by_role("link", name="Older records")).to_be_visible()
    # back at the top: the first page again, not "older records" with a Newest link
    expect(page.get_by_role("link", name="Newest")).to_have_count(0)
    expect(page).to_have_title("Library: “quillwort” · metanode")


def test_the_files_filter_hides_records_whose_files_are_gone(page: Page, srv: Server) -> None:
    """A deleted or re-tagged file's record stays (claims are never deleted): a review's
    library filled up with rows of 0 files and no way to leave them out."""
    titled(srv, drop(srv, "Quillon.Meadow.1990.mkv"), "Quillon Meadow")
    gone_path = drop(srv, "Quillon.Tide.1991.mkv")
    gone = titled(srv, gone_path, "Quillon Tide")
    gone_path.unlink()
    poll(lambda: (srv.meta(gone) or {}).get("paths") == [], "the deleted file's path gone")
    page.reload()
    page.get_by_label("Search").fill("quillon")
    for where, shown, hidden in (
        ("on this box", "Quillon Meadow", "Quillon Tide"),
        ("none left", "Quillon Tide", "Quillon Meadow"),
    ):
        page.get_by_label("Files").select_option(label=where)
        page.get_by_role("button", name="Find").click()
        expect(page.get_by_role("link", name=shown)).to_be_visible()
        expect(page.get_by_role("link", name=hidden)).to_have_count(0)
    page.get_by_label("Files").select_option(label="any")
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_role("link", name="Quillon Tide")).to_be_visible()
    expect(page.get_by_role("link", name="Quillon Meadow")).to_be_visible()


def test_the_library_leaves_out_subtitles_nfos_and_artwork_unless_asked(
    page: Page, srv: Server
) -> None:
    """A folder kept for a media server holds, beside each film, its subtitles, an nfo and
    pictures: each a record of its own, which the list showed as often as the films."""
    titled(srv, drop(srv, "Quorra.Vale.2003.mkv"), "Quorra Vale")
    for name, head, file_type in (
        ("Quorra.Vale.2003.en.srt", b"1\n00:00:01,000 --> 00:00:02,000\nHi\n", "subtitle"),
        ("quorra-vale.nfo", b"<movie><title>Quorra Vale</title></movie>", "document"),
        ("Quorra.Vale.2003-poster.jpg", JPEG_HEAD, "image"),
        ("quorra-vale-at-sea.jpg", JPEG_HEAD, "image"),  # a picture, not named as artwork
    ):
        claimed(srv, drop(srv, name, head), "fileType", file_type)
    page.reload()

    def find(kind: str, sidecars: bool) -> list[str]:
        page.get_by_label("Search").fill("quorra")
        page.get_by_label("Type").select_option(kind)
        page.get_by_label("subtitles, nfo, artwork too").set_checked(sidecars)
        page.get_by_role("button", name="Find").click()
        expect(page.get_by_role("caption")).to_contain_text("quorra")
        return sorted(page.locator("td[data-label=type]").all_inner_texts())

    assert find("", sidecars=False) == ["image", "movie"]
    assert find("", sidecars=True) == ["artwork", "image", "movie", "nfo", "subtitle"]
    assert find("subtitle", sidecars=False) == ["subtitle"]


def test_a_folder_split_between_pages_of_files_says_its_count_is_the_pages(
    page: Page, srv: Server
) -> None:
    """A folder over two pages of the Files page showed `(120)` on one and `(30)` on the
    next, each read as the folder's count; each page's title says which (all were `Files`)."""
    folder = srv.media / "Split Folder"
    folder.mkdir()
    first, second = (drop(srv, f"Split Folder/Split.{n}.mkv") for n in (1, 2))
    for path in (first, second):
        midhash_of(srv, path)
    page.goto(f"{srv.url}/files?prefix={quote(str(folder))}")
    expect(page.get_by_text(f"{folder} (2)", exact=True)).to_be_visible()
    expect(page).to_have_title(f"Files under {folder} · metanode")
    page.goto(f"{srv.url}/files?prefix={quote(str(folder))}&after={quote(str(first))}")
    expect(page.get_by_text(f"{folder} (1 on this page)", exact=True)).to_be_visible()
    expect(page).to_have_title(f"Files under {folder}, more · metanode")


def test_the_files_page_goes_down_a_folder_at_a_time_and_back_up(page: Page, srv: Server) -> None:
    """A library of a folder a film showed every file of the root on pages of 200 (500 pages
    for 100,000 files) and no way into one folder; now each folder lists the folders in it,
    and a trail leads back up to its watched folder."""
    films = srv.media / "Films"
    for name in ("Alpha (2001)/Alpha.mkv", "Beta (2002)/Beta.mkv", "Beta (2002)/extras/x.mkv"):
        (films / name).parent.mkdir(parents=True, exist_ok=True)
        midhash_of(srv, drop(srv, f"Films/{name}"))
    page.get_by_role("link", name="Files").click()
    page.get_by_role("link", name=str(srv.media)).click()
    folders = page.get_by_role("list", name=f"Folders in {srv.media}")
    folders.get_by_role("link", name="Films", exact=True).click()
    expect(
        page.get_by_role("list", name=f"Folders in {films}").get_by_role("listitem")
    ).to_have_text(["Alpha (2001)", "Beta (2002)"])
    page.get_by_role("link", name="Beta (2002)").click()
    trail = page.get_by_role("navigation", name="Folders above")
    expect(trail.get_by_role("link")).to_have_text([str(srv.media), "Films", "Beta (2002)"])
    expect(trail.get_by_role("link", name="Beta (2002)")).to_have_attribute("aria-current", "page")
    expect(
        page.get_by_role("list", name=f"Folders in {films}/Beta (2002)").get_by_role("listitem")
    ).to_have_text(["extras"])
    expect(page.get_by_text(f"{films}/Beta (2002)/extras (1)", exact=True)).to_be_visible()
    trail.get_by_role("link", name="Films").click()
    expect(page).to_have_title(f"Files under {films} · metanode")
    page.get_by_role("link", name="Alpha (2001)").click()
    expect(page.get_by_text("No folder in it holds files.")).to_be_visible()


def test_the_owner_adds_a_folder_on_the_files_page_and_stops_watching_it(
    context: BrowserContext, tmp_path: Path
) -> None:
    """Folders no setting names are the owner's (docs/watcher.md, "Choosing the folders on
    the page"): a refused folder is said at its field with what was typed; one added is
    watched at once (an ffmpeg video dropped in it gets its record); Stop watching says what
    becomes of its files before it is confirmed."""
    if shutil.which("ffmpeg") is None:
        pytest.skip("needs Debian's ffmpeg")
    srv = Server(tmp_path / "data", unset=("METANODE_WATCH_ROOTS",)).start()
    try:
        page = context.new_page()
        sign_in(page, srv, srv.token)
        page.get_by_role("link", name="Files", exact=True).click()
        watched = page.get_by_role("table", name="Watched folders")
        expect(watched.get_by_role("row", name=str(srv.media))).to_contain_text("watching")
        field = page.get_by_label("Folder to watch")
        field.fill(str(tmp_path / "nowhere"))
        page.get_by_role("button", name="Add folder").click()
        expect(page.get_by_role("alert")).to_contain_text("does not exist")
        expect(field).to_have_value(str(tmp_path / "nowhere"))
        expect(field).to_be_focused()
        films = tmp_path / "Films"
        films.mkdir()
        field.fill(str(films))
        page.get_by_role("button", name="Add folder").click()
        expect(page.get_by_role("status")).to_contain_text(f"Watching {films} as well")
        expect(watched.get_by_role("row", name=str(films))).to_contain_text("watching")
        film = films / "Film.2010.mkv"
        part = films / "Film.2010.mkv.part"
        subprocess.run(
            [
                *("ffmpeg", "-v", "error", "-f", "lavfi", "-i", "testsrc=d=1", "-f", "matroska"),
                str(part),
            ],
            check=True,
            timeout=120,
        )
        part.rename(film)
        midhash_of(srv, film)
        stopping = f"{srv.url}/files?stop={quote(str(films))}#stop"
        fits(page, stopping, "files, a folder to stop watching", None)  # named, a phone's width
        page.set_viewport_size(DESKTOP)
        page.goto(srv.url + "/files")
        page.get_by_role("link", name=f"Stop watching {films}").click()
        confirm = page.get_by_role("region", name=f"Stop watching {films}?")
        expect(confirm).to_contain_text("keep their records")
        confirm.get_by_role("button", name=f"Stop watching {films}").click()
        expect(page.get_by_role("status")).to_contain_text(f"No longer watching {films}")
        expect(watched.get_by_role("row", name=str(films))).to_have_count(0)
        assert midhash_of(srv, film)  # its record and path stay
    finally:
        srv.stop()


def test_live_shows_a_claim_posted_with_claim_post(page: Page, srv: Server) -> None:
    midhash = titled(srv, drop(srv, "Northern.Lanterns.2015.mkv"), "Northern Lanterns")
    poster = Signer()
    srv.register(poster.uid, "poster", weight=1)
    page.get_by_role("link", name="Live").click()
    expect(page.get_by_role("status")).to_have_text("connected")
    claim = poster.claim(midhash, "mood", "wistful", now_ms())
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "claim", "post", "--url", srv.url, json.dumps(claim)],
        env={**os.environ, "METANODE_TOKEN": srv.token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    event = (
        page.get_by_role("list", name="Changes")
        .get_by_role("listitem")
        .filter(has_text="mood = wistful")
    )
    expect(event).to_contain_text("Northern Lanterns")
    expect(event.get_by_role("link", name="Northern Lanterns")).to_be_visible()


def test_live_asks_the_node_for_only_the_changes_it_shows(page: Page, srv: Server) -> None:
    """Live lists no record's `cids/…` links, so it asks the node to leave them out
    (`?exclude=cids/`) rather than receive them (a fifth of a new file's events) and drop them:
    the page itself no longer drops any, so one sent would be listed."""
    with page.expect_request(lambda r: "/api/events" in r.url) as asked:
        page.get_by_role("link", name="Live").click()
    assert parse_qs(urlsplit(asked.value.url).query) == {"exclude": ["cids/"]}
    expect(page.get_by_role("status")).to_have_text("connected")
    drop(srv, "Quiet.Harbour.2012.mkv")
    changes = page.get_by_role("list", name="Changes").get_by_role("listitem")
    # the file's `cids/<midhash>` comes in the same chunk as its `filePath`, before it
    expect(changes.filter(has_text="filePath").first).to_contain_text("Quiet.Harbour.2012.mkv")
    expect(changes.filter(has_text="cids/")).to_have_count(0)


def test_live_and_plugins_go_on_after_a_restart_and_say_so_when_the_session_is_gone(
    browser: Browser, tmp_path: Path
) -> None:
    """The node keeps its sessions across a restart: the open Live and Plugins pages go on,
    signed in. Where the session is gone meanwhile (here its kept list lost), they say so
    (not "reconnecting…" for ever, nor a poll failing unseen), and signing in again goes back
    to the page; while the node is down nothing throws."""
    with plugins_server(tmp_path / "data") as server:
        ctx = browser.new_context(viewport=DESKTOP)
        ctx.set_default_timeout(WAIT_MS)
        live, plugins = ctx.new_page(), ctx.new_page()
        thrown: list[str] = []
        loaded: list[str] = []  # what failed to load, by URL: a new origin asks for its icon
        for p in (live, plugins):
            p.on("pageerror", lambda exc: thrown.append(str(exc)))
            p.on(
                "console", lambda m: loaded.append(m.location["url"]) if m.type == "error" else None
            )
        sign_in(live, server, server.token)
        live.goto(server.url + "/live")
        expect(live.get_by_role("status")).to_have_text("connected")
        plugins.goto(server.url + "/plugins")
        for p in (live, plugins):
            p.evaluate(WRITTEN)
        server.stop()
        expect(plugins.get_by_role("status")).to_have_text("The node does not answer; retrying…")
        expect(live.get_by_role("status")).to_have_text("reconnecting…")
        # a screen reader reads a status region out at each change, the same words included:
        # each was written again at every attempt while the node was down
        for p, asked in ((plugins, "/api/plugins"), (live, "/api/events")):
            for _ in range(2):  # two attempts more
                p.wait_for_event(
                    "requestfailed", lambda r, asked=asked: urlsplit(r.url).path.endswith(asked)
                )
        assert plugins.evaluate("window.written") == ["The node does not answer; retrying…"]
        assert live.evaluate("window.written") == ["reconnecting…"]
        server.start()
        expect(live.get_by_role("status")).to_have_text("connected")
        expect(plugins.get_by_role("status")).to_have_text("")
        server.stop()
        expect(live.get_by_role("status")).to_have_text("reconnecting…")
        (server.data_dir / "ui-sessions.json").unlink()
        server.start()
        gone = "Signed out (here or in another tab, or the session ended). Sign in again"
        expect(live.get_by_role("status")).to_have_text(gone)
        expect(plugins.get_by_role("status")).to_have_text(gone)
        live.get_by_role("link", name="Sign in again").click()
        live.get_by_label("API token").fill(server.token)
        live.get_by_role("button", name="Sign in").click()
        expect(live.get_by_role("heading", name="Live")).to_be_visible()
        expect(live.get_by_role("status")).to_have_text("connected")
        assert thrown == []
        assert [url for url in loaded if url.endswith("/favicon.ico")] == []
        ctx.close()


def test_live_follows_again_from_its_last_change_after_the_node_refused_its_feed(
    browser: Browser, tmp_path: Path
) -> None:
    """A feed the node refuses for a while (503 `too_busy`: every connection it takes is held)
    stopped Live for good, saying "Signed out" of a session still alive. It says
    "reconnecting…", and once the node takes the feed again it goes on from its last change:
    what came meanwhile is shown, once."""
    if os.geteuid() != 0:
        pytest.skip("cutting the page's connections (ss -K) needs root, as the suite runs in CI")
    ss = shutil.which("ss") or shutil.which("ss", path="/usr/sbin:/sbin:/usr/bin")
    if ss is None and (why := install("iproute2")):
        pytest.skip(f"Debian's iproute2 (ss, to cut the page's connections): {why}")
    env = {"METANODE_MAX_CONNECTIONS": "6", "METANODE_HEADER_TIMEOUT_S": "600"}
    server = Server(tmp_path / "data", env=env).start()
    held: list[socket.socket] = []
    try:
        ctx = browser.new_context(viewport=DESKTOP)
        ctx.set_default_timeout(WAIT_MS)
        live = ctx.new_page()
        sign_in(live, server, server.token)
        live.goto(server.url + "/live")
        status = live.get_by_role("status")
        expect(status).to_have_text("connected")
        live.evaluate(WRITTEN)
        changes = live.get_by_role("list", name="Changes").get_by_role("listitem")
        midhash = midhash_of(server, drop(server, "Held.Line.2001.mkv"))
        expect(changes.filter(has_text="Held.Line.2001.mkv").first).to_be_visible()
        ctx.set_offline(True)  # the page's feed, cut below, is not taken up again meanwhile
        cut = [ss or "ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{server.port}"]
        subprocess.run(cut, check=True, capture_output=True)
        poster = Signer()
        server.register(poster.uid, "poster", weight=1)
        while_away = poster.claim(midhash, "mood", "while away", now_ms())
        posted = httpx.post(
            f"{server.url}/api/claims", json={"claims": [while_away]}, headers=server.headers
        )
        assert posted.status_code == 200, posted.text

        def full() -> bool | None:  # every connection the node takes is held, idle
            held.append(socket.create_connection(("127.0.0.1", server.port)))
            return httpx.get(f"{server.url}/health", timeout=10).status_code == 503 or None

        poll(full, "the node's connections all held")
        with live.expect_response(lambda r: "/api/events" in r.url and r.status == 503):
            ctx.set_offline(False)
        expect(status).to_have_text("reconnecting…")
        with live.expect_request(lambda r: r.method == "HEAD" and r.url.endswith("/live")):
            pass  # the page asks whether its session is alive, and is refused again: 503
        for sock in held:
            sock.close()
        expect(status).to_have_text("connected")
        expect(changes.filter(has_text="mood = while away")).to_have_count(1)
        assert not any("Signed out" in said for said in live.evaluate("window.written"))
        ctx.close()
    finally:
        for sock in held:
            sock.close()
        server.stop()


# what the page's status region (role=status) says, in order, each time it is written
WRITTEN = """() => { const region = document.querySelector("[role=status]"); window.written = [];
    new MutationObserver(() => window.written.push(region.textContent))
        .observe(region, { childList: true, characterData: true, subtree: true }); }"""


def test_state_changes_without_the_sessions_csrf_token_are_refused(
    page: Page, context: BrowserContext, srv: Server
) -> None:
    victim = Signer()
    srv.register(victim.uid, "victim", weight=3)
    url = f"{srv.url}/signers/{victim.uid}/block"

    def status() -> str:
        signers = httpx.get(f"{srv.url}/api/signers", headers=srv.headers, timeout=10).json()
        return next(s["status"] for s in signers["signers"] if s["uid"] == victim.uid)

    # another site's page (localhost is another site than 127.0.0.1) posts a form here
    evil = context.new_page()
    form = (
        f'<form method="post" action="{url}"><input name="x" value="1"><button>Go</button></form>'
    )
    with elsewhere("localhost", form) as there:
        evil.goto(there)
    with evil.expect_navigation():
        evil.get_by_role("button", name="Go").click()
    assert status() == "active"

    # this very site's page, with the cookie but without the token
    answers = page.evaluate(
        """async ([url]) => {
            const form = await fetch(url, {method: "POST", body: new URLSearchParams({x: "1"})});
            const api = await fetch("/api/signers", {method: "POST",
                headers: {"Content-Type": "application/json"}, body: "{}"});
            return [form.status, api.status];
        }""",
        [url],
    )
    assert answers == [403, 401]
    assert status() == "active"

    # the page's own form carries the token: that one works (so the refusals above were real)
    page.get_by_role("link", name="Signers").click()
    page.get_by_role("button", name="Block victim").click()
    expect(page.get_by_role("button", name="Unblock victim")).to_be_visible()
    expect(page.get_by_role("status")).to_have_text(
        "Blocked victim: its votes no longer count (Unblock gives them back)."
    )
    assert status() == "blocked"
    page.get_by_role("button", name="Unblock victim").click()
    expect(page.get_by_role("button", name="Block victim")).to_be_visible()
    expect(page.get_by_role("status")).to_have_text("Unblocked victim: its votes count again.")
    assert status() == "active"


def test_the_plugins_page_says_why_runs_failed_and_retries_them(
    context: BrowserContext, tmp_path: Path
) -> None:
    """A plugin whose runs failed (a tool it needs not installed yet): the page showed a count;
    now it says which file failed and why, and Retry runs them again once the tool is there. A
    plugin that failed to load was only in the log: the page says so, and why. A skipped run
    is counted apart, with the plugin's reason, and runs again on request too."""
    site = tmp_path / "site"
    site.mkdir()
    tool = tmp_path / "tool-installed"
    install_plugin(
        site,
        "needstool",
        "needstool",
        f"if not os.path.exists({str(tool)!r}):\n"
        "    raise RuntimeError('the tool is not installed')\n"
        "register(file.cid, 'tooled', 'yes')",
    )
    install_plugin(  # works on a file until the tool is there: the page names it meanwhile
        site,
        "waiter",
        "waiter",
        f"while not os.path.exists({str(tool)!r}):\n"
        "    __import__('time').sleep(0.05)\n"
        "register(file.cid, 'waited', 'yes')",
    )
    install_plugin(
        site,
        "skipper",
        "skipper",
        f"if not os.path.exists({str(tool)!r}):\n"
        "    from metanode.plugins import Skip\n"
        "    raise Skip('no tool for ' + file.path[-3:])\n"
        "register(file.cid, 'skipper', 'ran')",
    )
    install_plugin(site, "broken", "broken")
    broken = site / "broken_plugin.py"
    broken.write_text("import not_installed_anywhere\n" + broken.read_text())
    # the site before the PYTHONPATH the tests run with (a worktree's checkout, say)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "METANODE_PLUGIN_MAX_ATTEMPTS": "1"}
    with plugins_server(tmp_path / "data", **env) as server:
        dropped = drop(server, "Needs.A.Tool.2020.mkv")
        page = context.new_page()
        sign_in(page, server, server.token)
        page.get_by_role("link", name="Plugins").click()
        not_running = page.get_by_role("region", name="Plugins not running")
        expect(not_running).to_contain_text(
            "broken_plugin:P: ModuleNotFoundError: No module named 'not_installed_anywhere' "
            f"(at {broken}:1 in <module>)"
        )
        listed = subprocess.run(
            [sys.executable, "-m", "metanode", "plugins", "list", "--url", server.url],
            env={**os.environ, "METANODE_TOKEN": server.token},
            capture_output=True,
            text=True,
            timeout=60,
        )  # the command line's list says it too, on stderr
        assert listed.returncode == 0 and listed.stderr.startswith(
            'warning: not_loaded: {"entry_point": "broken", "source": "broken_plugin:P", '
        )
        failures = page.get_by_role("region", name="needstool failures")

        def shown() -> int | None:
            page.reload()  # the list is the page's at its load
            return failures.count() or None

        poll(shown, "the failure on the page")
        expect(failures).to_contain_text(str(dropped))
        expect(failures).to_contain_text("RuntimeError: the tool is not installed")
        # a run the node refused is not retried (it said each had all plugin_max_attempts)
        expect(failures).to_contain_text(
            "each was tried as often as plugin_max_attempts allows, or once if the node refused "
            "its claims (it would refuse them again: mend the plugin)"
        )
        skipper = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name="skipper"))
        expect(skipper.locator(".skipped")).to_have_text("1")  # the bar counts it done
        expect(skipper.get_by_role("progressbar")).to_have_attribute("value", "1")
        skips = page.get_by_role("region", name="skipper skipped files")
        expect(skips).to_contain_text("1 file: no tool for mkv")
        waiter = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name="waiter"))
        expect(waiter.locator(".running")).to_have_text(str(dropped))
        tool.touch()
        # the page's refresh: the run is over (two seconds after each answer)
        expect(waiter.locator(".running")).to_have_text("", timeout=30_000)
        expect(waiter.locator(".done")).to_have_text("1")
        page.get_by_role("button", name="Retry failed runs of needstool").click()
        expect(page.get_by_text("Retrying 1 failed run of needstool.")).to_be_visible()
        midhash = midhash_of(server, dropped)
        poll(
            lambda: (server.meta(midhash) or {}).get("metadata", {}).get("tooled"),
            "the retried run's claim",
        )
        page.get_by_role("button", name="Run the skipped files of skipper again").click()
        expect(page.get_by_text("Retrying 1 skipped run of skipper.")).to_be_visible()
        poll(
            lambda: (server.meta(midhash) or {}).get("metadata", {}).get("skipper"),
            "the skipped run's claim, run again",
        )


def test_the_page_does_not_block_the_nodes_own_key(page: Page, srv: Server) -> None:
    """The owner's key signs the page's edits: its row offers no Block, and a form sent
    anyway (with the session's token) is refused with the node's reason."""
    signers = httpx.get(f"{srv.url}/api/signers", headers=srv.headers, timeout=10).json()
    owner = next(s["uid"] for s in signers["signers"] if s["name"] == "owner")
    page.get_by_role("link", name="Signers").click()
    row = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name="owner"))
    expect(row).to_contain_text("this node's own key")
    expect(row.get_by_role("button")).to_have_count(0)
    page.evaluate(
        """([uid]) => {
            const form = document.createElement("form");
            form.method = "post";
            form.action = `/signers/${uid}/block`;
            const csrf = document.createElement("input");
            csrf.name = "csrf";
            csrf.value = document.getElementById("main").dataset.csrf;
            form.append(csrf);
            document.body.append(form);
            form.submit();
        }""",
        [owner],
    )
    expect(page.get_by_role("alert")).to_contain_text(
        "Not changed: the box owner's key signs the edits made on the web page"
    )
    signers = httpx.get(f"{srv.url}/api/signers", headers=srv.headers, timeout=10).json()
    assert next(s["status"] for s in signers["signers"] if s["uid"] == owner) == "active"


def test_the_cookie_authorises_the_pages_own_api_calls_with_the_csrf_header(
    page: Page, srv: Server
) -> None:
    signer = Signer()
    answers = page.evaluate(
        """async ([uid]) => {
            const csrf = document.getElementById("main").dataset.csrf;
            const read = await fetch("/api/signers");
            const write = await fetch("/api/signers", {method: "POST", headers: {
                "Content-Type": "application/json", "X-CSRF-Token": csrf},
                body: JSON.stringify({uid, name: "from-the-page", weight: 2})});
            return [read.status, write.status];
        }""",
        [signer.uid],
    )
    assert answers == [200, 200]
    listed = httpx.get(f"{srv.url}/api/signers", headers=srv.headers, timeout=10).json()
    assert any(s["name"] == "from-the-page" for s in listed["signers"])


# A page's script that, run as a page of the node, acts as the signed-in person: it reads the
# CSRF token of the web page and registers a signer of its own with the session's cookie.
HOSTILE_SCRIPT = """<script>(async () => {
  const csrf = (await (await fetch("/")).text()).match(/data-csrf="([^"]+)"/)[1];
  await fetch("/api/signers", {method: "POST", headers: {"Content-Type": "application/json",
    "X-CSRF-Token": csrf}, body: JSON.stringify({uid: "UID", name: "NAME", weight: 1000})});
})()</script>"""


def test_a_page_or_drawing_in_the_media_never_runs_as_the_signed_in_page(
    page: Page, srv: Server
) -> None:
    """An HTML page or an SVG drawing that came with a download is served by WebDAV and
    `/file/{cid}` (the trusted network needs no sign-in) on the web page's own origin: opened
    in the signed-in browser (a link on any site), its script read the page's CSRF token and
    used the session. Served as a sandboxed document now, its script never runs."""
    served = []
    for name, wrap in (
        ("Readme.Release.html", "<!doctype html><title>readme</title>{}"),
        ("Release.Poster.svg", '<svg xmlns="http://www.w3.org/2000/svg">{}</svg>'),
    ):
        signer = Signer()
        script = HOSTILE_SCRIPT.replace("UID", signer.uid).replace("NAME", name)
        path = srv.media / name
        path.write_text(wrap.format(script) + f"<!-- {os.urandom(8).hex()} -->")
        midhash = midhash_of(srv, path)
        served += [(name, f"/webdav/{srv.media.name}/{name}"), (name, f"/file/{midhash}")]
    for _, address in served:
        with page.expect_console_message(lambda m: "Blocked script execution" in m.text):
            page.goto(srv.url + address)
        response = httpx.get(srv.url + address, timeout=30)
        assert response.headers["content-security-policy"] == "sandbox allow-same-origin"
        assert response.headers["x-content-type-options"] == "nosniff"
    signers = httpx.get(f"{srv.url}/api/signers", headers=srv.headers, timeout=10).json()
    assert not {s["name"] for s in signers["signers"]} & {name for name, _ in served}


def test_a_script_of_the_media_runs_in_no_page(page: Page, srv: Server) -> None:
    """A script file of the watched folders (a `.js` that came with a download) was served to
    a page's `<script src>`: another site's page, through the browser of a trusted address
    (WebDAV and `/file/{cid}` need no token there, and a script needs no CORS), ran it and
    read what it holds; and on the node's own origin it would be a script `default-src 'self'`
    lets run, should a value ever reach a page unescaped. The MetaMesh routes now refuse what
    a browser loads as a script, a style sheet or a worker (`Sec-Fetch-Dest`); a film still
    plays, a page of them still opens."""
    path = srv.media / "Release.Notes.js"
    path.write_text(f'window.leaked = "{os.urandom(8).hex()}";')
    midhash = midhash_of(srv, path)
    sources = [f"/webdav/{srv.media.name}/{path.name}", f"/file/{midhash}"]
    scripts = "".join(f'<script src="{srv.url}{source}"></script>' for source in sources)
    sheets = "".join(f'<link rel="stylesheet" href="{srv.url}{source}">' for source in sources)
    with elsewhere("localhost", f"<p>news</p>{scripts}{sheets}") as there:
        page.goto(there)
        assert page.evaluate("window.leaked") is None
    for source, dest in itertools.product(sources, ("script", "style", "worker")):
        refused = httpx.get(srv.url + source, headers={"Sec-Fetch-Dest": dest}, timeout=30)
        assert (refused.status_code, refused.json()["error"]) == (403, "forbidden")
    for dest in ("document", "video", None):  # opened, played, or read by a program
        asked = {"Sec-Fetch-Dest": dest} if dest else {}
        answer = httpx.get(srv.url + sources[0], headers=asked, timeout=30)
        assert answer.text == path.read_text()


def test_no_other_page_frames_the_pages_and_nothing_inline_runs_in_them(
    page: Page, srv: Server
) -> None:
    """A page of another port of the same host is the same site to the browser, so the
    SameSite=Strict cookie went along into its frame: it framed the signed-in Signers page,
    Block buttons and all, under whatever it drew over them (clickjacking). Every page says
    `frame-ancestors 'none'` (and `X-Frame-Options: DENY`), and runs only the node's own
    files."""
    framing = f'<p>Click the button</p><iframe src="{srv.url}/signers"></iframe>'
    with elsewhere("127.0.0.1", framing) as there:  # another port: the same site
        page.goto(there)  # its load waits for its frame's
    (framed,) = page.main_frame.child_frames
    assert framed.url.startswith("chrome-error://"), framed.url  # refused: no Signers page
    signed_in = page.context.cookies()
    answers = [
        httpx.get(f"{srv.url}/signers", cookies={c["name"]: c["value"] for c in signed_in}),
        httpx.get(f"{srv.url}/"),  # the sign-in form
        httpx.get(
            f"{srv.url}/records/nothing-of-the-kind",
            cookies={c["name"]: c["value"] for c in signed_in},
        ),
        httpx.get(f"{srv.url}/docs"),
    ]
    assert [a.status_code for a in answers] == [200, 200, 404, 200]
    for answer in answers:
        assert answer.headers["content-type"].startswith("text/html")
        policy = answer.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "default-src 'self'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_signing_out_ends_the_session_for_every_copy_of_the_cookie(
    page: Page, context: BrowserContext, srv: Server
) -> None:
    (cookie,) = context.cookies()
    copied = {cookie["name"]: cookie["value"]}
    assert httpx.get(f"{srv.url}/api/signers", cookies=copied, timeout=10).status_code == 200
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("API token")).to_be_visible()
    assert context.cookies() == []
    assert httpx.get(f"{srv.url}/api/signers", cookies=copied, timeout=10).status_code == 401
    again = httpx.get(f"{srv.url}/files", cookies=copied, timeout=10)
    assert again.status_code == 401 and "API token" in again.text


def test_signing_out_ends_a_live_feed_left_open(
    page: Page, context: BrowserContext, srv: Server
) -> None:
    """A Live tab left open read on after a sign-out in another tab, its cookie refused for
    everything else, naming records by rid: its stream ends with the session."""
    page.get_by_role("link", name="Live").click()
    expect(page.get_by_role("status")).to_have_text("connected")
    other = context.new_page()
    other.goto(srv.url + "/")
    other.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("status")).to_contain_text("Signed out")
    midhash = midhash_of(srv, drop(srv, "After.The.Sign.Out.2019.mkv"))
    poll(lambda: srv.meta(midhash), "the new file's record")
    rows = page.get_by_role("list", name="Changes").get_by_role("listitem")
    expect(rows.filter(has_text="After.The.Sign.Out")).to_have_count(0)


def test_live_names_a_record_as_the_library_does_in_every_row(page: Page, srv: Server) -> None:
    """Every episode's changes were named by its show's title alone, a record's first rows by
    its rid or file name and its later ones by its title; and the record page said only the
    show's title too. A screen reader hears a count of the changes, not every row."""
    poster = Signer()
    srv.register(poster.uid, "poster", weight=1)
    page.get_by_role("link", name="Live").click()
    expect(page.get_by_role("status")).to_have_text("connected")
    cid = cids.midhash_bytes(b"an episode with no file here")
    now = now_ms()
    said = {"title": "Quill Show", "season": "31", "episode": "47", "episodeTitle": "Pilot"}
    post(srv, *(poster.claim(cid, key, value, now) for key, value in said.items()))
    rows = page.get_by_role("list", name="Changes").get_by_role("listitem")
    for key, value in said.items():
        row = rows.filter(has_text=f" set {key} = {value}")
        expect(row.get_by_role("link")).to_have_text("Quill Show S31E47 · Pilot")
    # a screen reader hears a count and the newest, not every row (nor every renaming of one)
    assert page.get_by_role("list", name="Changes").get_attribute("aria-live") is None
    news = page.locator("#live-news[aria-live=polite]")
    expect(news).to_have_text(re.compile(r"^(1 new change: |\d+ new changes, the newest: )\S"))
    rows.filter(has_text=" set title = Quill Show").get_by_role("link").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Quill Show S31E47 · Pilot")


def test_live_reads_out_the_start_of_a_long_value_only(page: Page, srv: Server) -> None:
    """A screen reader hears the newest change, clipped: an nfo's plot of paragraphs was read
    out whole, every five seconds while a folder of films came in."""
    poster = Signer()
    srv.register(poster.uid, "poster", weight=1)
    page.get_by_role("link", name="Live").click()
    expect(page.get_by_role("status")).to_have_text("connected")
    plot = "A lighthouse keeper counts the ships that never come. " * 40  # 2160 characters
    post(srv, poster.claim(cids.midhash_bytes(b"a film with a plot"), "plot", plot, now_ms()))
    news = page.locator("#live-news[aria-live=polite]")
    expect(news).to_have_text(re.compile(r"^1 new change: .* set plot = A lighthouse .*…$"))
    assert len(news.text_content() or "") < 160


def test_live_keeps_the_change_a_keyboard_reader_is_on(page: Page, srv: Server) -> None:
    """Live keeps the newest 200 changes; the row holding the keyboard's focus was dropped
    with the oldest, and the focus fell to the page. It stays until the focus leaves it."""
    poster = Signer()
    srv.register(poster.uid, "poster", weight=1)
    page.get_by_role("link", name="Live").click()
    expect(page.get_by_role("status")).to_have_text("connected")
    first = cids.midhash_bytes(b"the first change")
    post(srv, poster.claim(first, "mood", "first", now_ms()))
    changes = page.get_by_role("list", name="Changes").get_by_role("listitem")
    expect(changes).to_have_count(1)
    changes.first.get_by_role("link").focus()
    at = now_ms()
    post(
        srv,
        *(
            poster.claim(cids.midhash_bytes(f"change {n}".encode()), "mood", f"n{n}", at + n)
            for n in range(250)
        ),
    )
    expect(changes.filter(has_text="mood = n249")).to_have_count(1)
    expect(changes).to_have_count(200)  # the focused one, and the newest 199
    expect(changes.last).to_contain_text("mood = first")
    held = page.evaluate("() => document.activeElement.closest('li').textContent")
    assert "mood = first" in held
    page.keyboard.press("Shift+Tab")  # the focus leaves it: the next change trims it away
    post(srv, poster.claim(first, "mood", "again", now_ms()))
    expect(changes.filter(has_text="mood = first")).to_have_count(0)
    expect(changes).to_have_count(200)


# Where a name's mark of a hidden character is, and whether the text after the name (a file's
# size) is drawn after it: RIGHT-TO-LEFT OVERRIDE reversed the rest of the row, the size too
# (`Good` + U+202E + `vkm.Film.exe` read `Goodexe.mliF.mkv`, its `9.3 kB` drawn inside it).
AFTER_THE_NAME = """(link) => {
  const size = link.parentElement.querySelector('small');
  return size.getBoundingClientRect().left >= link.getBoundingClientRect().right - 1;
}"""


def test_a_name_is_shown_as_it_is_and_never_reorders_its_row(page: Page, srv: Server) -> None:
    """A file name's control characters and bidirectional overrides are shown as their code
    points, never obeyed (`Kestrel` + U+202E + `gpj.exe.mkv` read `Kestrelvkm.exe.jpg`), each
    name in a `<bdi>` (a right-to-left name keeps to itself), on the Files page, the record
    page, the library and Live; a name written decomposed is found by a search so written."""
    spoof = drop(srv, "Kestrel\u202egpj.exe.mkv")
    drop(srv, "Kestrel\nline.mkv")
    drop(srv, "\u0641\u064a\u0644\u0645 \u0639\u0631\u0628\u064a (1999).mkv")
    drop(srv, "Kestre\u0301l Ame\u0301lie.mkv")  # as macOS writes `é`: e, combining accent
    titled(srv, spoof, "Kestrelgpj exe")  # the filename plugin's title leaves the override out
    titled(srv, srv.media / "Kestrel\nline.mkv", "Kestrel line")
    titled(srv, srv.media / "Kestre\u0301l Ame\u0301lie.mkv", "Kestr\u00e9l Am\u00e9lie")
    page.goto(srv.url + "/files")
    for shown, mark in (
        ("KestrelU+202Egpj.exe.mkv", "U+202E"),
        ("KestrelU+000Aline.mkv", "U+000A"),
        ("\u0641\u064a\u0644\u0645 \u0639\u0631\u0628\u064a (1999).mkv", ""),
    ):
        link = page.get_by_role("link", name=shown, exact=True)
        expect(link.locator("bdi")).to_have_count(1)
        expect(link.locator(".hidden-char")).to_have_text([mark] if mark else [])
        assert link.evaluate(AFTER_THE_NAME), f"{shown!r} reorders its row"
    assert "\u202e" not in page.locator("main").inner_text()

    page.goto(f"{srv.url}/records/{midhash_of(srv, spoof)}")
    expect(page.get_by_role("heading", level=1)).to_have_text("Kestrelgpj exe")
    expect(field(page, "fileName").locator(".value")).to_have_text("KestrelU+202Egpj.exe.mkv")
    expect(
        page.get_by_role("listitem").filter(has_text="/KestrelU+202Egpj.exe.mkv")
    ).to_be_visible()
    assert "\u202e" not in page.locator("main").inner_text()

    page.goto(srv.url + "/?q=kestrel")
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name="Kestrelgpj exe"))
    expect(row.locator("small .hidden-char")).to_have_text("U+202E")
    page.get_by_label("Search").fill("Ame\u0301lie")  # a name copied from macOS's Finder
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_role("link", name="Kestr\u00e9l Am\u00e9lie")).to_be_visible()

    page.goto(srv.url + "/live")
    expect(page.get_by_role("status")).to_have_text("connected")
    drop(srv, "Kestrel\u202e2.mkv")
    changes = page.get_by_role("list", name="Changes").get_by_role("listitem")
    said = changes.filter(has_text="set fileName = KestrelU+202E2.mkv")
    expect(said.locator("bdi .hidden-char")).to_have_text(["U+202E"])
    assert "\u202e" not in page.locator("main").inner_text()


def test_an_unknown_record_is_a_404_page(page: Page, srv: Server) -> None:
    for missing in ("bafkreiaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "not-a-cid"):
        response = page.goto(f"{srv.url}/records/{missing}")
        assert response is not None and response.status == 404
        expect(page.get_by_role("heading", name="Not found")).to_be_visible()
        expect(page).to_have_title("Not found · metanode")  # the tab's name, not a bare "404"
        expect(page.get_by_role("alert")).to_contain_text("no record")
    # an address that is no page at all: a page to a browser, the JSON envelope to a client
    for path in ("/nope", "/records/<b>x</b>"):
        response = page.goto(srv.url + path)
        assert response is not None and response.status == 404
        expect(page.get_by_role("heading", name="Not found")).to_be_visible()
        expect(page.get_by_role("alert")).to_have_text(f"no route {path}")
        expect(page.get_by_role("button", name="Sign out")).to_be_visible()  # still signed in
    answer = httpx.get(f"{srv.url}/nope", headers=srv.headers, timeout=10)
    assert answer.status_code == 404 and answer.json()["error"] == "not_found"


def test_swagger_uis_demo_pages_are_not_served(page: Page, srv: Server) -> None:
    """`/docs/assets/` served the whole swagger-ui-bundle folder to anyone: its demo
    `index.html` ran Swagger UI as a page of the node's origin, outside the page policy,
    fetching petstore.swagger.io's document and sending it to validator.swagger.io. Only the
    two files `/docs` uses are served now."""
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(srv.url) else outside.append(r.url))
    for name in ("index.html", "oauth2-redirect.html", "swagger-initializer.js", "index.css"):
        answer = page.goto(f"{srv.url}/docs/assets/{name}")
        assert answer is not None and answer.status == 404, name
    assert outside == []
    for name in ("swagger-ui.css", "swagger-ui-bundle.js"):
        assert httpx.get(f"{srv.url}/docs/assets/{name}").status_code == 200


def test_api_docs_render_from_the_package(page: Page, srv: Server) -> None:
    outside: list[str] = []
    page.on(
        "request",
        lambda r: outside.append(r.url) if not r.url.startswith(srv.url) else None,
    )
    page.goto(f"{srv.url}/docs")
    expect(page.get_by_text("/api/claims").first).to_be_visible()
    expect(page.get_by_text("The API docs need JavaScript")).to_be_hidden()
    # "Try it out" asks this very node (the document names no fixed address)
    page.locator(".opblock-summary", has_text="/health").first.click()
    page.get_by_role("button", name="Try it out").click()
    with page.expect_response(lambda r: r.url.endswith("/health")) as answered:
        page.get_by_role("button", name="Execute").click()
    assert answered.value.url == f"{srv.url}/health" and answered.value.status == 200
    assert outside == []


def test_the_api_docs_are_outlined_without_a_skipped_level(page: Page, srv: Server) -> None:
    """The API docs' headings, as a screen reader lists them, go down one level at a time, an
    operation opened too: Swagger UI went from its h1 (the API's title) to an h3 per tag."""
    page.goto(f"{srv.url}/docs")
    expect(page.get_by_role("heading", name="records", level=3)).to_be_visible()
    expect(page.get_by_role("heading", name="Operations", level=2)).to_be_attached()
    assert page.evaluate(OUTLINE) == {
        "h1": 1,
        "skips": False,
        "landmarks": ["header", "main"],
        "lang": "en",
        "current": [],
    }
    page.locator(".opblock-summary", has_text="/api/claims").first.click()
    expect(page.get_by_role("heading", name="Parameters")).to_be_visible()
    assert page.evaluate(OUTLINE)["skips"] is False


# what a page's script reads of a public record fetched from another origin, and of the same
# fetch again with the tag it kept (past the browser's cache, as a consumer keeping its own copy)
REVALIDATE = """async (url) => {
  const first = await fetch(url);
  const tag = first.headers.get("ETag");
  const again = await fetch(url, {headers: {"If-None-Match": tag}, cache: "no-store"});
  return {status: first.status, title: (await first.json()).metadata.title, tagged: !!tag,
          id: !!first.headers.get("X-Request-ID"), again: again.status,
          same: again.headers.get("ETag") === tag}; }"""


def test_a_page_of_another_origin_keeps_a_record_by_its_etag(browser: Browser, srv: Server) -> None:
    """A page of another origin read a record (CORS `*`) but not its `ETag`, which the browser
    hid, so it could not revalidate its copy; and its `If-None-Match` failed the preflight.
    In Chromium, from `localhost` (another origin than `127.0.0.1`'s), it now reads the tag
    and the request id and gets 304 for a copy that is current."""
    signer = Signer()
    srv.register(signer.uid, "elsewhere", weight=1)
    cid = cids.midhash_bytes(b"read from another origin")
    post(srv, signer.claim(cid, "title", "Far Origin"))
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(f"http://localhost:{srv.port}/health")
        seen = page.evaluate(REVALIDATE, f"{srv.url}/api/meta/{cid}")
    finally:
        ctx.close()
    assert seen == {
        "status": 200,
        "title": "Far Origin",
        "tagged": True,
        "id": True,
        "again": 304,
        "same": True,
    }


PAGES = {
    "library": "/",
    "live": "/live",
    "files": "/files",
    "plugins": "/plugins",
    "signers": "/signers",
    "health": "/status",
}

NAMELESS_CONTROLS = """() => [...document.querySelectorAll("a, button, input, select, textarea")]
    .filter((e) => e.type !== "hidden" && e.offsetParent !== null)
    .filter((e) => {
        const labelled = e.labels && e.labels.length > 0;
        const named = (e.getAttribute("aria-label") || e.textContent || "").trim() !== "";
        return !labelled && !named;
    })
    .map((e) => e.outerHTML)
    .concat([...document.querySelectorAll("table")]  // a screen reader's list of tables
        .filter((t) => !t.caption && !t.hasAttribute("aria-labelledby"))
        .map((t) => t.outerHTML.slice(0, 80)))"""


def test_every_page_names_its_controls_and_fits_a_phone(
    page: Page, context: BrowserContext, srv: Server
) -> None:
    """Every page at desktop and phone width: no control without an accessible name, nothing
    wider than the screen, no error in the browser's console; then the same with long
    unbroken names and values (a release's file name, a title of one 300-letter word, a key as
    long). With METANODE_UI_SCREENSHOTS, a PNG of each page before the long ones."""
    midhash = titled(srv, drop(srv, "Paper.Moons.2020.mkv"), "Paper Moons")
    shutil.copy(srv.media / "Paper.Moons.2020.mkv", srv.media / "paper-moons-copy.mkv")
    pages = {**PAGES, "record": f"/records/{midhash}", "sign-in": "/", "not-found": "/records/x"}
    signed_out = context.browser.new_context() if context.browser else None
    assert signed_out is not None
    console: list[str] = []  # what the browser complains of (a failed load, a script's error)
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    into = os.environ.get("METANODE_UI_SCREENSHOTS")
    for name, path in pages.items():
        target = signed_out.new_page() if name == "sign-in" else page
        target.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        fits(target, srv.url + path, name, Path(into) if into else None)

    long_name = "The.Extraordinarily.Long.Named.Film.2021.2160p.UHD.BluRay.REMUX.HDR.HEVC-GRP.mkv"
    long_one = midhash_of(srv, drop(srv, long_name))
    writer = Signer()
    srv.register(writer.uid, "writer", weight=5)
    word = "Supercalifragilistic" * 15
    post(srv, writer.claim(long_one, "title", word, now_ms()), writer.claim(long_one, word, "x"))
    for name, path in {
        "long record": f"/records/{long_one}",
        "long library": "/?q=" + word[:30],
        "files": "/files",
        "signers": "/signers",
        "long not-found": "/records/" + word,
    }.items():
        fits(page, srv.url + path, name, None)
    signed_out.close()
    not_found = "Failed to load resource: the server responded with a status of 404 (Not Found)"
    assert [m for m in console if m != not_found] == []  # the not-found pages' own 404s


# where `fits` looks at a page: [its name, the viewport, whether it is a touch screen]
SCREENS = (
    ("desktop", DESKTOP, False),
    ("zoomed", DESKTOP_ZOOMED, False),
    ("narrowest", PHONE, False),
    ("phone", COMMON_PHONE, True),
)


def fits(page: Page, url: str, name: str, into: Path | None) -> None:
    """`url` at desktop width, zoomed to 200 %, at 320 px and on a 360 px touch screen: every
    control named, nothing wider than the screen; a screenshot of the desktop and the phone
    into `into`, if given."""
    touch = page.context.new_cdp_session(page)
    for width, viewport, touching in SCREENS:
        touch.send("Emulation.setTouchEmulationEnabled", {"enabled": touching})
        page.set_viewport_size(viewport)
        page.goto(url)
        page.wait_for_load_state("networkidle")
        assert page.evaluate(NAMELESS_CONTROLS) == [], name
        overflow = page.evaluate("document.documentElement.scrollWidth - innerWidth")
        assert overflow <= 0, f"{name} is {overflow} px wider than a {width} screen"
        spilled = page.evaluate(  # a cell narrower than its text: on a phone, the library's
            "[...document.querySelectorAll('td')]"  # year, type and files were drawn over
            ".filter(td => td.scrollWidth > td.clientWidth + 1).map(td => td.textContent)"
        )  # one another
        assert spilled == [], f"{name} at {width} width: cells overflow: {spilled}"
        if into is not None and width in ("desktop", "phone"):
            page.screenshot(path=str(into / f"{name}-{width}.png"), full_page=True)
    touch.send("Emulation.setTouchEmulationEnabled", {"enabled": False})
    touch.detach()


def test_an_older_cache_gets_its_library_index_from_the_migration(tmp_path: Path) -> None:
    """Cache schema 5 adds the library index and fills it from the records already cached, so
    an upgraded node lists and finds them without a rebuild."""
    with older_cache(
        tmp_path,
        4,
        "INSERT INTO records VALUES ('01M8T1AD8YE3198EENNAK7KT12', 'title', 'Old Lamp'),"
        "('01M8T1AD8YE3198EENNAK7KT12', 'year', '1961'),"
        "('01M8T1AD8YE3198EENNAK7KT12', 'filePath', '/m/old.lamp.mkv');"
        "INSERT INTO cid_index VALUES ('bafkqaaa', '01M8T1AD8YE3198EENNAK7KT12');"
        "INSERT INTO local_file VALUES ('/m/old.lamp.mkv', 'bafkqaaa', 1, 1, 1);",
    ) as conn:
        (row,) = cache.library_page(conn, "lamp", "", None, cache.NEWEST, 50)
        assert row == cache.LibraryRow(
            "01M8T1AD8YE3198EENNAK7KT12", "Old Lamp", "old.lamp.mkv", "1961", "", 1
        )
        assert cache.library_page(conn, "zebra", "", None, cache.NEWEST, 50) == []


def cached(records: dict[str, dict[str, str]], listed: dict[str, tuple[str, str, str]]) -> str:
    """The SQL that puts `records` (rid → key → value) into an older cache, listed in its
    library as `listed` (rid → its title, name and type then)."""
    rows = ", ".join(
        f"('{rid}', '{key}', '{value}')"
        for rid, record in records.items()
        for key, value in record.items()
    )
    library = ", ".join(
        f"('{rid}', '{t}', '{n}', '', '{k}', 0)" for rid, (t, n, k) in listed.items()
    )
    return (
        f"INSERT INTO records VALUES {rows};"
        f"INSERT INTO library (rid, title, name, year, type, files) VALUES {library};"
    )


@contextlib.contextmanager
def older_cache(tmp_path: Path, version: int, rows: str) -> Iterator[db.Connection]:
    """A cache.db of schema `version` holding `rows` (SQL), then migrated to this version's."""
    conn = db.connect(tmp_path / "cache.db")
    try:
        db.migrate(conn, cache.MIGRATIONS[:version])
        conn.executescript(rows)
        assert db.migrate(conn, cache.MIGRATIONS) == len(cache.MIGRATIONS)
        yield conn
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("record", "name", "kind"),
    [
        ({"fileType": "subtitle", "title": "Film"}, "Film.en.srt", "subtitle"),
        ({"fileType": "subtitle", "videoType": "movie"}, "Film.srt", "subtitle"),
        ({"fileType": "document"}, "movie.nfo", "nfo"),
        ({"fileType": "document"}, "Show.S01E02.NFO", "nfo"),
        ({}, "tvshow.nfo", "nfo"),
        ({"fileType": "image"}, "poster.jpg", "artwork"),
        ({"fileType": "image"}, "Film (2010)-fanart.png", "artwork"),
        ({"fileType": "image"}, "season01-poster.jpg", "artwork"),
        ({"fileType": "image"}, "Folder.JPG", "artwork"),
        ({"fileType": "image"}, "backdrop2.webp", "artwork"),
        ({"fileType": "image"}, "holiday.jpg", "image"),
        ({"fileType": "image"}, "thumbnails.jpg", "image"),
        ({"fileType": "image"}, "poster", "image"),  # no extension: no known artwork name
        ({"fileType": "video"}, "poster.mkv", "video"),
        ({"fileType": "video", "videoType": "episode"}, "S01E02.mkv", "episode"),
        ({}, "", ""),
    ],
)
def test_the_library_tells_sidecars_from_media(
    record: dict[str, str], name: str, kind: str
) -> None:
    """Subtitles, nfos and pictures named as media servers name artwork are `SIDECARS` (left
    out of the list unless asked); a picture of another name is media (a photo)."""
    assert labels.kind(record, name) == kind


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        ("audioStreamCodec", "audio<wbr>Stream<wbr>Codec"),
        ("subtitles/en.forced", "subtitles/<wbr>en.forced"),
        ("mtimeNano", "mtime<wbr>Nano"),
        ("title", "title"),
        ("a</b>B", "a&lt;/<wbr>b&gt;B"),  # escaped, whatever a key holds
    ],
)
def test_a_key_breaks_between_its_words(key: str, shown: str) -> None:
    """On the record page, `audioStreamCodec` broke in its narrow column as `audioStreamCode`
    over `c`."""
    assert str(ui.word_breaks(key)) == shown


def test_the_v9_migration_lists_an_older_caches_sidecars_as_such(tmp_path: Path) -> None:
    """A cache of schema 8 listed a subtitle as `subtitle` but a poster as `image` and an nfo
    as `document`: the migration indexes them again, so the list leaves them out."""
    records = {
        "01M8T1AD8YE3198EENNAK7KT12": {"fileType": "image", "fileName": "poster.jpg"},
        "01M8T1AD8YE3198EENNAK7KT13": {"fileType": "document", "fileName": "movie.nfo"},
        "01M8T1AD8YE3198EENNAK7KT14": {"fileType": "image", "fileName": "beach.jpg"},
    }
    listed_as = {rid: ("", r["fileName"], r["fileType"]) for rid, r in records.items()}
    with older_cache(tmp_path, 8, cached(records, listed_as)) as conn:
        listed = cache.library_page(conn, "", "", None, cache.NEWEST, 50)
        assert [row.name for row in listed] == ["beach.jpg"]
        every = cache.library_page(conn, "", "", None, cache.NEWEST, 50, sidecars=True)
        assert [row.type for row in every] == ["image", "nfo", "artwork"]


@pytest.mark.parametrize(
    ("record", "listed"),
    [
        ({"title": "Show Name", "season": "1", "episode": "2"}, "Show Name S01E02"),
        (
            {"title": "Show Name", "season": "1", "episode": "3", "episodeTitle": "Pilot"},
            "Show Name S01E03 · Pilot",
        ),
        ({"title": "Show Name", "episode": "112"}, "Show Name E112"),
        ({"title": "Show Name", "season": "one", "episode": "2"}, "Show Name E02"),
        ({"title": "Film", "episodeTitle": "not an episode"}, "Film"),
        ({"title": "Dune", "part": "2", "year": "2024"}, "Dune Part 2"),
        ({"title": "Kill Bill", "volume": "2"}, "Kill Bill Vol. 2"),
        ({"title": "Dune: Part Two", "part": "2"}, "Dune: Part Two"),  # an nfo's: once only
        ({"title": "Kill Bill: Volume 2", "volume": "2"}, "Kill Bill: Volume 2"),
        ({"title": "Partisan", "part": "2"}, "Partisan Part 2"),
        ({"season": "1", "episode": "2"}, ""),
    ],
)
def test_the_library_tells_episodes_apart(record: dict[str, str], listed: str) -> None:
    """Every episode of a show has the show's title: the library listed `Show Name` once per
    episode. Its number and its own title are part of the listed (and searched) title, and so
    are a film's part and volume (`Dune` twice), unless its title names them (an nfo's `Dune:
    Part Two` was listed `Dune: Part Two Part 2`)."""
    assert labels.title(record) == listed


def test_the_v8_migration_lists_the_episodes_of_an_older_cache_apart(tmp_path: Path) -> None:
    """A cache of schema 7 listed an episode by its show's title alone, and a record whose
    files are gone by its rid (the rows inserted here): the migration indexes such records
    again, and leaves the others as they were."""
    records = {
        "01M8T1AD8YE3198EENNAK7KT12": {"title": "Show Name", "season": "1", "episode": "2"},
        "01M8T1AD8YE3198EENNAK7KT13": {"title": "Film"},
        "01M8T1AD8YE3198EENNAK7KT14": {"fileName": "movie.nfo"},
    }
    listed_as = {rid: (r.get("title", ""), "", "") for rid, r in records.items()}
    with older_cache(tmp_path, 7, cached(records, listed_as)) as conn:
        found = cache.library_page(conn, "s01e02", "", None, cache.NEWEST, 50)
        assert [row.title for row in found] == ["Show Name S01E02"]
        assert [
            (row.title, row.name)
            for row in cache.library_page(conn, "", "", None, cache.NEWEST, 50, sidecars=True)
        ] == [("", "movie.nfo"), ("Film", ""), ("Show Name S01E02", "")]


# -- the keyboard, a screen reader, low vision, no JavaScript -------------------------------------


def test_a_refused_token_or_edit_is_read_with_the_field_the_focus_lands_in(
    context: BrowserContext, srv: Server
) -> None:
    """After a refusal the focus is in the field to correct, which a screen reader reads with
    why it was refused: a wrong token left the focus at the top of the page (three Tabs back to
    the field), and a refused Edit focused its field with no word of the refusal."""
    page = context.new_page()
    page.goto(srv.url + "/")
    token = page.get_by_label("API token")
    expect(token).to_be_focused()  # the page's one field
    page.keyboard.type("not-the-token")
    page.keyboard.press("Enter")
    expect(page.get_by_role("alert")).to_be_visible()
    expect(token).to_be_focused()
    expect(token).to_have_accessible_description("That is not this node's API token.")
    page.keyboard.type(srv.token)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Library")).to_be_visible()

    midhash = titled(srv, drop(srv, "Tin.Compass.2016.mkv"), "Tin Compass")
    page.goto(f"{srv.url}/records/{midhash}")
    page.get_by_role("button", name="Edit title").focus()
    page.keyboard.press("Enter")
    typed = page.get_by_label("title", exact=True)
    expect(typed).to_be_focused()
    typed.fill("x" * 70_000)
    page.keyboard.press("Enter")
    expect(page.get_by_role("alert")).to_be_visible()
    typed = page.get_by_label("title", exact=True)
    expect(typed).to_be_focused()
    expect(typed).to_have_accessible_description(
        re.compile("^'title' was not changed: value is 70000 bytes")
    )
    # a form the page did not show again is described by nothing
    expect(page.get_by_label("New key")).to_have_accessible_description("")


def test_without_javascript_values_are_edited_and_live_says_it_needs_it(
    browser: Browser, srv: Server
) -> None:
    """With JavaScript off the Edit buttons could not open their forms, so no value could be
    changed: the forms are shown instead, and Live and the API docs say why they show
    nothing."""
    midhash = titled(srv, drop(srv, "Chalk.Lantern.2008.mkv"), "Chalk Lantern")
    ctx = browser.new_context(viewport=DESKTOP, java_script_enabled=False)
    try:
        page = ctx.new_page()
        sign_in(page, srv, srv.token)
        page.goto(f"{srv.url}/records/{midhash}")
        expect(page.get_by_role("button", name="Edit title")).to_have_count(0)
        field(page, "title").get_by_label("title", exact=True).fill("Chalk Lantern (no script)")
        field(page, "title").get_by_role("button", name="Save").click()
        expect(field(page, "title").get_by_role("status")).to_have_text("Saved title.")
        expect(field(page, "title").locator(".value")).to_have_text("Chalk Lantern (no script)")
        page.goto(f"{srv.url}/live")
        expect(page.get_by_text("Live needs JavaScript")).to_be_visible()
        expect(page.get_by_text("connecting…")).to_be_hidden()
        page.goto(f"{srv.url}/docs")  # Swagger UI is all script: it was a blank page
        expect(page.get_by_text("The API docs need JavaScript")).to_be_visible()
        page.get_by_role("link", name="openapi.json").click()
        expect(page.get_by_text('"openapi"')).to_be_visible()
    finally:
        ctx.close()


def test_the_pages_take_the_text_size_the_browser_is_set_to(
    page: Page, context: BrowserContext, srv: Server
) -> None:
    """A reader who set the browser's text size to twice its default (32 px, WCAG 1.4.4's
    200 %) gets it on every page, which still fits a desktop and a phone: the pages fixed their
    text at 16 px whatever the browser said, and once they did not, the library's search field
    stuck out 95 px from a 360 px phone and a progress bar 38 px from a 320 px one."""
    midhash = titled(srv, drop(srv, "Glass.Orchard.2019.mkv"), "Glass Orchard")
    context.new_cdp_session(page).send(
        "Page.setFontSizes", {"fontSizes": {"standard": 32, "fixed": 26}}
    )
    pages = {**PAGES, "record": f"/records/{midhash}", "not-found": "/records/x"}
    for name, path in pages.items():
        for viewport in (DESKTOP, COMMON_PHONE, PHONE):
            page.set_viewport_size(viewport)
            page.goto(srv.url + path)
            assert page.evaluate("getComputedStyle(document.body).fontSize") == "32px", name
            overflow = page.evaluate("document.documentElement.scrollWidth - innerWidth")
            assert overflow <= 0, f"{name} is {overflow} px wider than {viewport['width']} px"


EDGES = """() => [...document.querySelectorAll("input, select, textarea")]
    .filter((e) => !["hidden", "checkbox", "radio"].includes(e.type) && e.offsetParent !== null)
    .map((e) => [e.id, getComputedStyle(e).borderTopColor])"""
WHITE = "rgb(255, 255, 255)"  # the page's background
FOCUSED_RING = """() => { const s = getComputedStyle(document.activeElement);
    return [s.outlineStyle, parseFloat(s.outlineWidth), s.outlineColor]; }"""


def test_fields_and_the_focus_ring_stand_out_from_the_page(page: Page, srv: Server) -> None:
    """A field's edge and the keyboard's focus ring contrast at least 3:1 with the white page
    (WCAG 1.4.11): the fields were drawn in the rules' grey, 1.4:1, hard to find at all with
    low vision."""
    midhash = titled(srv, drop(srv, "Moss.Beacon.2015.mkv"), "Moss Beacon")
    page.goto(f"{srv.url}/records/{midhash}")
    page.get_by_role("button", name="Edit title").click()  # its field shown, beside Add's
    edges = page.evaluate(EDGES)
    page.goto(srv.url + "/")  # the search field and the selects
    edges += page.evaluate(EDGES)
    names = {name for name, _ in edges}
    assert {"new-key", "new-value", "q", "type", "files"} <= names, names
    assert any(name.startswith("value-") for name in names), names  # the open Edit's
    for name, colour in edges:
        assert contrast(colour, WHITE) >= 3, (name, colour)
    for _ in range(3):  # the skip link, the brand, a navigation link: each ringed
        page.keyboard.press("Tab")
        style, width, colour = page.evaluate(FOCUSED_RING)
        assert style == "solid" and width >= 2, (style, width)
        assert contrast(colour, WHITE) >= 3, colour


# the text drawn in a colour under WCAG's 4.5:1 (3:1 for large text) against what is behind it
# (each background over the ones under it, to the white canvas)
LOW_CONTRAST = """() => {
  const rgba = (c) => { const v = c.match(/[\\d.]+/g).map(Number);
    return [...v.slice(0, 3), v[3] ?? 1]; };
  const over = (top, under) => [0, 1, 2]
    .map((i) => top[i] * top[3] + under[i] * (1 - top[3])).concat(1);
  const luminance = (c) => c.slice(0, 3).map((v) => v / 255)
    .map((v) => (v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4))
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const ratio = (a, b) => { const [l, d] = [luminance(a), luminance(b)].sort((x, y) => y - x);
    return (l + 0.05) / (d + 0.05); };
  const behind = (e) => { const layers = [];
    for (; e; e = e.parentElement) layers.push(rgba(getComputedStyle(e).backgroundColor));
    return layers.reverse().reduce((under, top) => over(top, under), [255, 255, 255, 1]); };
  const low = [];
  const texts = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let text = texts.nextNode(); text; text = texts.nextNode()) {
    const e = text.parentElement;
    if (!text.textContent.trim() || !e.checkVisibility() || e.closest(".visually-hidden")) continue;
    const style = getComputedStyle(e);
    const back = behind(e);
    const size = parseFloat(style.fontSize);
    const large = size >= 24 || (size >= 18.66 && Number(style.fontWeight) >= 700);
    const r = ratio(over(rgba(style.color), back), back);
    if (r < (large ? 3 : 4.5)) low.push(`${text.textContent.trim().slice(0, 30)}: ${r.toFixed(2)}`);
  }
  return [...new Set(low)];
}"""
# a page's outline as a screen reader lists it
OUTLINE = """() => ({
  h1: document.querySelectorAll("h1").length,
  skips: [...document.querySelectorAll("h1, h2, h3, h4, h5, h6")].map((h) => Number(h.tagName[1]))
    .some((level, i, levels) => i > 0 && level > levels[i - 1] + 1),
  landmarks: ["header", "main"].filter((tag) => document.querySelectorAll(tag).length === 1),
  lang: document.documentElement.lang,
  current: [...document.querySelectorAll("nav [aria-current=page]")].map((a) => a.textContent),
})"""
# elements that move: a transition or an animation longer than a millisecond
MOVING = """() => [...document.querySelectorAll("*")].filter((e) => {
  const s = getComputedStyle(e);
  const longest = (durations) => Math.max(...durations.split(",").map(parseFloat));
  return longest(s.transitionDuration) > 0.001
    || (s.animationName !== "none" && longest(s.animationDuration) > 0.001);
}).length"""


def test_every_page_is_outlined_and_its_text_contrasts_and_stays_still(
    page: Page, context: BrowserContext, srv: Server
) -> None:
    """Every page has one h1, no skipped heading level, a header and a main, `lang`, a title
    of its own and its navigation's link marked current; its text contrasts 4.5:1 with what is
    behind it (computed from the drawn colours) and nothing on it moves. The API docs (Swagger
    UI) wrote GET, POST, PUT, PATCH, DELETE, its versions, links, Authorize and Expand all at
    1.6 to 3.8:1 (12 colour pairs; the node's pages had none), and slid and faded for a reader
    who asked for less motion."""
    midhash = titled(srv, drop(srv, "Amber.Meridian.2012.mkv"), "Amber Meridian")
    signed_out = context.browser.new_context() if context.browser else None
    assert signed_out is not None
    outside = signed_out.new_page()
    outside.goto(srv.url + "/")
    assert outside.evaluate(LOW_CONTRAST) == [] and outside.evaluate(MOVING) == 0
    signed_out.close()
    nav = dict(ui.NAV)
    pages = {**PAGES, "record": f"/records/{midhash}", "not-found": "/records/x"}
    titles = set()
    for name, path in pages.items():
        page.goto(srv.url + path)
        if name == "record":
            page.get_by_role("button", name="Edit title").click()  # its field too
        outline = page.evaluate(OUTLINE)
        assert outline == {
            "h1": 1,
            "skips": False,
            "landmarks": ["header", "main"],
            "lang": "en",
            "current": [nav[path]] if path in nav else [],
        }, name
        titles.add(page.title())
        assert page.evaluate(LOW_CONTRAST) == [], name
        assert page.evaluate(MOVING) == 0, name
    assert len(titles) == len(pages)
    page.goto(srv.url + "/docs")
    expect(page.get_by_text("/api/claims").first).to_be_visible()
    assert page.evaluate(LOW_CONTRAST) == []
    page.get_by_role("banner").get_by_role("link", name="metanode").click()  # the way back
    expect(page.get_by_role("heading", name="Library")).to_be_visible()
    page.go_back()
    expect(page.get_by_text("/api/claims").first).to_be_visible()
    assert page.evaluate(MOVING) > 0  # Swagger UI's own motion, where none was asked away
    page.emulate_media(reduced_motion="reduce")
    assert page.evaluate(MOVING) == 0


def test_every_page_in_dark_colours_for_a_reader_who_asks_for_them(page: Page, srv: Server) -> None:
    """A browser set to dark (a media box is often looked at in a dark room) gets each page
    dark, at the same contrast as the light ones: text 4.5:1, a field's edge and the focus
    ring 3:1 against the page. The pages were white whatever the reader's setting."""
    midhash = titled(srv, drop(srv, "Dusk.Harbour.2016.mkv"), "Dusk Harbour")
    page.emulate_media(color_scheme="dark")
    for name, path in {**PAGES, "record": f"/records/{midhash}"}.items():
        page.goto(srv.url + path)
        if name == "record":
            page.get_by_role("button", name="Edit title").click()
        back = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
        assert contrast(back, WHITE) > 15, (name, back)  # near black, not white
        assert page.evaluate(LOW_CONTRAST) == [], name
        for field, colour in page.evaluate(EDGES):
            assert contrast(colour, back) >= 3, (name, field, colour)
    page.keyboard.press("Tab")
    _, _, ring = page.evaluate(FOCUSED_RING)
    assert contrast(ring, back) >= 3, ring
    page.emulate_media(color_scheme="light")
    assert page.evaluate("() => getComputedStyle(document.body).backgroundColor") == WHITE


def contrast(one: str, other: str) -> float:
    """WCAG's contrast ratio of two CSS `rgb(…)` colours."""

    def luminance(colour: str) -> float:
        red, green, blue = (int(c) / 255 for c in re.findall(r"\d+", colour)[:3])
        linear = [
            c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (red, green, blue)
        ]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    light, dark = sorted((luminance(one), luminance(other)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


# -- a phone: a narrow screen, a finger, an on-screen keyboard ---------------------------------

TOUCH_PHONE = {
    "viewport": COMMON_PHONE,
    "is_mobile": True,
    "has_touch": True,
    "device_scale_factor": 3,
}
# where the focused element is drawn, and what it is
FOCUSED_BOX = """() => { const e = document.activeElement, r = e.getBoundingClientRect();
    return {name: (e.getAttribute("aria-label") || e.textContent).trim(),
            top: r.top, bottom: r.bottom, left: r.left, right: r.right}; }"""


@pytest.fixture
def phone(browser: Browser, srv: Server) -> Iterator[Page]:
    """A signed-in page in a phone's browser: 360 px wide, touch (`pointer: coarse`), 3 device
    pixels a CSS pixel."""
    ctx = browser.new_context(**TOUCH_PHONE)
    ctx.set_default_timeout(WAIT_MS)
    p = ctx.new_page()
    sign_in(p, srv, srv.token)
    expect(p.get_by_role("heading", name="Library")).to_be_visible()
    yield p
    ctx.close()


def reading_order(boxes: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The pairs of `boxes` (in the keyboard's order) where the second is drawn before the
    first as a line is read: above it, or on its line but to its left."""
    wrong = []
    for one, other in itertools.pairwise(boxes):
        middle = (other["top"] + other["bottom"]) / 2
        same_line = one["top"] <= middle <= one["bottom"]
        if middle < one["top"] or (same_line and other["left"] < one["right"]):
            wrong.append((one["name"], other["name"]))
    return wrong


def test_the_keyboard_goes_through_the_header_in_the_order_it_is_drawn(
    page: Page, phone: Page, srv: Server
) -> None:
    """Tab reaches the name, the links and Sign out in the order they are drawn, at every
    width and on a touch screen: on a phone Sign out was drawn beside the name, above the
    links, and reached after them."""
    screens = [(page, v) for v in (DESKTOP, DESKTOP_ZOOMED, COMMON_PHONE, PHONE)]
    for tab, viewport in [*screens, (phone, COMMON_PHONE)]:
        tab.set_viewport_size(viewport)
        tab.goto(srv.url + "/files")
        tab.keyboard.press("Tab")  # the skip link, drawn over the header while focused
        boxes = []
        for _ in range(2 + len(ui.NAV)):  # the name, the links, Sign out
            tab.keyboard.press("Tab")
            boxes.append(tab.evaluate(FOCUSED_BOX))
        assert [b["name"] for b in boxes] == ["metanode", *dict(ui.NAV).values(), "Sign out"]
        assert reading_order(boxes) == [], viewport


# a finger's targets under 44 × 44 CSS px: every control (a checkbox with its label) and every
# link but one inside a sentence (WCAG 2.5.5's exception); the skip link once it is focused
SMALL_TARGETS = """() => [...document.querySelectorAll("a, button, input, select, textarea")]
  .concat([...document.querySelectorAll("summary")])
  .filter((e) => e.type !== "hidden" && e.checkVisibility())
  .filter((e) => !(e.tagName === "A" && e.parentElement.closest("p")
    && e.parentElement.closest("p").textContent.trim() !== e.textContent.trim()))
  .map((e) => [e, (["checkbox", "radio"].includes(e.type) ? e.closest("label") : e)
    .getBoundingClientRect()])
  .filter(([e, r]) => r.right > 0 && (r.width < 44 || r.height < 44))
  .map(([e, r]) => `${e.tagName} ${(e.textContent || e.id).trim().slice(0, 30)}: `
    + `${Math.round(r.width)} × ${Math.round(r.height)}`)"""


def test_every_target_on_a_phone_is_big_enough_for_a_finger(
    phone: Page, browser: Browser, srv: Server
) -> None:
    """On a touch screen every control and link (but one inside a sentence) is at least 44 × 44
    CSS px (WCAG 2.5.5): the navigation's links were 23 px tall, four apart, the buttons and
    fields 36, the library's checkbox 13 × 13, a record's or a file's link 19."""
    midhash = titled(srv, drop(srv, "Felt.Atlas.2011.mkv"), "Felt Atlas")
    drop(srv, "Felt.Atlas.2011.en.srt", b"1\n00:00:00,000 --> 00:00:01,000\nHi\n")
    older = [f"/?before={'z' * 26}"]  # a later page of the library: its pager's links
    folder = f"/files?prefix={quote(str(srv.media))}"
    for path in [*PAGES.values(), f"/records/{midhash}", "/records/x", folder, *older]:
        phone.goto(srv.url + path)
        phone.wait_for_load_state("networkidle")
        if path.startswith("/records/b"):
            phone.get_by_role("button", name="Edit title").click()  # its field and Save too
        assert phone.evaluate(SMALL_TARGETS) == [], path
    phone.keyboard.press("Tab")
    assert phone.evaluate(SMALL_TARGETS) == []  # the skip link, shown
    signed_out = browser.new_context(**TOUCH_PHONE)
    try:
        outside = signed_out.new_page()
        outside.goto(srv.url + "/")
        assert outside.evaluate(SMALL_TARGETS) == []
    finally:
        signed_out.close()


# the visible text drawn under 13 px (`small` is 13.3 at the default 16)
TINY_TEXT = """() => { const tiny = [];
  const texts = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let text = texts.nextNode(); text; text = texts.nextNode()) {
    const e = text.parentElement, size = parseFloat(getComputedStyle(e).fontSize);
    if (text.textContent.trim() && e.checkVisibility() && !e.closest(".visually-hidden")
        && size < 13) tiny.push(`${text.textContent.trim().slice(0, 20)}: ${size} px`);
  }
  return tiny; }"""


def test_every_text_on_a_phone_is_read_without_zooming(phone: Page, srv: Server) -> None:
    """No text on a phone is under 13 px: the CIDs, paths and code (in `monospace`, which a
    browser draws at its own smaller size) were 11.7 px, the signers' uids 9.75, the code
    point shown for a right-to-left override in a file name under its title 10."""
    midhash = titled(srv, drop(srv, "Cedar.Ledger.2004.mkv"), "Cedar Ledger")
    midhash_of(srv, drop(srv, "Cedar.Ledger.\u202emkv.exe.mkv"))  # on the library and Files
    for path in [*PAGES.values(), f"/records/{midhash}", "/records/x"]:
        phone.goto(srv.url + path)
        assert phone.evaluate(TINY_TEXT) == [], path


# what a field asks of a phone's on-screen keyboard and of the browser's memory of forms
KEYBOARD = """(e) => ({autocapitalize: e.autocapitalize, spellcheck: e.spellcheck,
    autocorrect: e.getAttribute("autocorrect"), autocomplete: e.autocomplete,
    enterkeyhint: e.enterKeyHint, type: e.type})"""
TYPED_AS_IS = {"autocapitalize": "none", "spellcheck": False, "autocorrect": "off"}


def test_a_phones_keyboard_leaves_a_key_and_a_search_as_typed(phone: Page, srv: Server) -> None:
    """A key is spelled as the claims spell it: a phone's keyboard capitalised its first letter
    and corrected it (`year` became the other key `Year`), as it corrected a search for a file
    name's words (`s01e02`); a value field offered what the browser kept of other keys'
    values, the search's Enter key said Go rather than Search."""
    midhash = titled(srv, drop(srv, "Reed.Almanac.2009.mkv"), "Reed Almanac")
    phone.goto(f"{srv.url}/records/{midhash}")
    new_key = phone.get_by_label("New key").evaluate(KEYBOARD)
    assert new_key == {**new_key, **TYPED_AS_IS, "autocomplete": "off"}
    phone.get_by_role("button", name="Edit title").click()
    for value in (phone.get_by_label("title", exact=True), phone.get_by_label("Value")):
        assert value.evaluate(KEYBOARD)["autocomplete"] == "off"
    phone.goto(srv.url + "/")
    search = phone.get_by_label("Search").evaluate(KEYBOARD)
    assert search == {**search, **TYPED_AS_IS, "enterkeyhint": "search", "type": "search"}
    phone.get_by_label("Search").fill("reed alm")
    phone.keyboard.press("Enter")
    expect(phone.get_by_role("link", name="Reed Almanac")).to_be_visible()


# each label of a form beside its field: [label, whether its middle is on the field's line and
# it ends left of the field]
BESIDE = """(form) => [...form.querySelectorAll("label[for]")].map((label) => {
  const l = label.getBoundingClientRect(), f = label.control.getBoundingClientRect();
  const middle = (l.top + l.bottom) / 2;
  return [label.textContent, f.top <= middle && middle <= f.bottom && l.right <= f.left]; })"""


def test_the_librarys_filters_keep_each_label_beside_its_field(page: Page, srv: Server) -> None:
    """At phone width each of the library's labels is on its field's line: the form wrapped as
    text does, so `Type` ended a line and its list began the next one, beside `Files`."""
    for viewport in (DESKTOP, COMMON_PHONE, PHONE):
        page.set_viewport_size(viewport)
        page.goto(srv.url + "/")
        labels = page.get_by_role("search").evaluate(BESIDE)
        assert labels == [[name, True] for name in ("Search", "Type", "Files")], viewport


LABEL_ASKS = 4  # metanode.js: the names Live asks at once


def test_live_asks_a_few_names_at_once_the_newest_rows_first(phone: Page, srv: Server) -> None:
    """Over a slow link Live asks at most LABEL_ASKS records' names at once, for the rows it
    still shows, the newest first: it asked one for every record that came by, all at once (a
    burst of 1,000 queued 1,000 asks, 800 for rows already dropped, the oldest first). The
    asks are held here, as a slow link holds them, and then let through."""
    asked: list[str] = []  # the rids asked, in order
    held: list[Route] = []  # the asks a slow link holds
    through = threading.Event()  # the link let through

    def ask(route: Route) -> None:
        asked.append(route.request.url.rsplit("/", 2)[-2])
        if through.is_set():
            route.continue_()
        else:
            held.append(route)

    phone.route("**/records/*/label", ask)
    phone.goto(srv.url + "/live")
    expect(phone.get_by_role("status")).to_have_text("connected")
    burst = Signer()
    srv.register(burst.uid, "burst", weight=1)
    at = now_ms()
    titles = [f"Burst {n}" for n in range(250)]
    post(
        srv,
        *(
            burst.claim(cids.midhash_bytes(t.encode()), "title", t, at + n)
            for n, t in enumerate(titles)
        ),
    )
    changes = phone.get_by_role("list", name="Changes")
    expect(changes.get_by_role("listitem").filter(has_text="title = Burst 249")).to_have_count(1)
    # the page's requests reach the handler as Playwright is called
    poll(lambda: phone.evaluate("() => true") if len(held) >= LABEL_ASKS else None, "the asks")
    assert len(held) == LABEL_ASKS  # the others wait: 250 were asked at once

    through.set()
    for route in held:
        route.continue_()
    by_rid = changes.get_by_role("link", name=re.compile(f"^[{rid.ALPHABET}]{{26}}$"))
    expect(by_rid).to_have_count(0)  # every row named
    expect(changes.get_by_role("link", name="Burst 249")).to_be_visible()
    shown = changes.get_by_role("link").evaluate_all("(links) => links.map((a) => a.dataset.rid)")
    then = asked[LABEL_ASKS:]
    assert then[0] == shown[0]  # once the first asks were answered, the newest row's
    assert set(then) <= set(shown)  # and none for a row gone
    assert len(asked) == len(set(asked))  # each once


# each plugin's row on the page: [how many lines its counts take, whether what it runs now is
# shown exactly when it runs something]
PLUGIN_ROWS = """() => [...document.querySelectorAll("#plugins tbody tr")].map((row) => {
  const lines = new Set([...row.querySelectorAll("td.count")]
    .map((td) => Math.round(td.getBoundingClientRect().top)));
  const running = row.querySelector(".running");
  return [lines.size, running.checkVisibility() === (running.textContent !== "")]; })"""


def test_a_plugins_counts_fit_two_lines_of_a_phone(phone: Page, srv: Server) -> None:
    """On a phone a plugin's version, weight and counts are side by side, two lines, and what
    it runs now is there while it runs something: a plugin was eight lines, the last one
    `running now:` with nothing after it, and five plugins a screen and a half."""
    phone.goto(srv.url + "/plugins")
    rows = phone.evaluate(PLUGIN_ROWS)
    assert len(rows) == 5 and all(lines <= 2 and shown for lines, shown in rows), rows


def test_the_api_docs_targets_and_text_fit_a_finger_and_an_eye(phone: Page, srv: Server) -> None:
    """On a touch screen Swagger UI's buttons, servers' list and links are 44 × 44 CSS px too,
    and no text of it is under 13 px: of its 194 targets under that, 142 were buttons (Expand
    all 62 × 16, a path's copy button 32 × 27, a lock 30 × 25), 52 links (the way back 91 × 19,
    the document's 77 × 15, a tag's 28 tall, an operation's path 15); 410 texts were 12 px (a
    phone's methods and paths, the examples, schemas, tabs) and 11 were 11.2 (media types)."""
    phone.goto(srv.url + "/docs")
    expect(phone.get_by_role("heading", name="records", level=3)).to_be_visible()
    phone.locator(".opblock-summary", has_text="/api/claims").first.click()
    phone.get_by_role("button", name="Try it out").click()
    expect(phone.get_by_role("button", name="Execute")).to_be_visible()
    phone.get_by_role("tab", name="Schema").first.click()
    assert phone.evaluate(SMALL_TARGETS) == []
    assert phone.evaluate(TINY_TEXT) == []
    assert phone.evaluate("document.documentElement.scrollWidth - innerWidth") <= 0


def test_a_short_name_in_code_is_never_split_between_lines(phone: Page, srv: Server) -> None:
    """A path, a route or a CID is broken between lines only when it is longer than a line:
    on a phone Live's `/api/events` read `/api/e` on one line and `vents` on the next."""
    for viewport in (COMMON_PHONE, PHONE):
        phone.set_viewport_size(viewport)
        phone.goto(srv.url + "/live")
        route = phone.locator("code", has_text="/api/events")
        assert route.evaluate("(code) => code.getClientRects().length") == 1, viewport
