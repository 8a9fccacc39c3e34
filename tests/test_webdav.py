"""WebDAV at `/webdav/` (metanode/webdav.py, docs/compat.md "WebDAV") against a real
`metanode serve`, spoken to as meta-fuse and meta-sort speak to meta-core's: PROPFIND to list,
HEAD for the size and mtime, Range GETs for the bytes, the midhash recomputed over Range reads
(meta-sort's check), and the record's `filePath` appended to `/urls`' `webdavUrl`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from urllib.parse import quote

import defusedxml.ElementTree as SafeET
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metanode import cid as cids
from metanode import compat, config
from metanode.errors import InvalidRequest
from metanode.watchroots import named
from metanode.webdav import PLUGIN, Roots
from tests.helpers.dav import DAV, propfind
from tests.helpers.server import Server, serve_refused
from tests.helpers.wait import poll

WAIT_S = 60.0
# Over 1 MiB, so the midhash samples the middle of the file, not all of it.
CONTENT = bytes(range(256)) * (5 * 4096) + b"tail"
WRITES = ("PUT", "DELETE", "MKCOL", "PROPPATCH", "LOCK")


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start a server on `tmp_path/data` (watching `tmp_path/media`) with extra settings."""
    started: list[Server] = []

    def start(**env: str) -> Server:
        server = Server(tmp_path / "data", env={"METANODE_WATCH_SETTLE_S": "0.2", **env})
        started.append(server.start())
        return server

    yield start
    for server in started:
        server.stop()
        server.print_log()


def drop(path: Path, data: bytes = CONTENT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def hashed(server: Server, path: Path) -> str:
    """The midhash of `path` once the watcher has it in the records (polled, no timer race)."""
    cid = cids.midhash_bytes(path.read_bytes())
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if httpx.get(f"{server.url}/api/file/{cid}/info", timeout=10).json()["exists"]:
            return cid
        time.sleep(0.1)
    raise AssertionError(f"the watcher did not hash {path} in {WAIT_S} s")


def test_propfind_lists_the_root_and_a_folder(launch: Callable[..., Server]) -> None:
    server = launch()
    film = drop(server.media / "films" / "one film.mkv")
    top = f"{server.url}/webdav/"
    assert propfind(top, "0") == {
        "/webdav/": {"collection": True, "length": None, "modified": None}
    }
    assert propfind(top, "1").keys() == {"/webdav/", "/webdav/media/"}
    assert PLUGIN not in str(propfind(top, "1"))  # plugin writes are off by default
    listed = propfind(f"{top}media/films/", "1")
    assert listed.keys() == {"/webdav/media/films/", "/webdav/media/films/one film.mkv"}
    entry = listed["/webdav/media/films/one film.mkv"]
    assert (entry["collection"], entry["length"]) == (False, len(CONTENT))
    assert parsedate_to_datetime(entry["modified"]).timestamp() == int(film.stat().st_mtime)
    missing = httpx.request("PROPFIND", f"{top}media/nothing", headers={"Depth": "0"})
    assert missing.status_code == 404


def test_head_and_range_reads(launch: Callable[..., Server]) -> None:
    server = launch()
    film = drop(server.media / "films" / "film.mkv")
    url = f"{server.url}/webdav/media/films/film.mkv"
    head = httpx.head(url, timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["Content-Length"]) == len(CONTENT)
    modified = parsedate_to_datetime(head.headers["Last-Modified"])
    assert modified.timestamp() == int(film.stat().st_mtime)
    assert head.headers["Accept-Ranges"] == "bytes"
    size = len(CONTENT)
    for wanted, start, end in (
        ("bytes=0-0", 0, 0),
        ("bytes=1000-1999", 1000, 1999),
        (f"bytes={size - 4}-", size - 4, size - 1),
        ("bytes=-7", size - 7, size - 1),
        (f"bytes=5-{size * 2}", 5, size - 1),  # clipped to the file
    ):
        part = httpx.get(url, headers={"Range": wanted}, timeout=30)
        assert part.status_code == 206, (wanted, part.status_code)
        assert part.headers["Content-Range"] == f"bytes {start}-{end}/{size}", wanted
        assert part.content == CONTENT[start : end + 1], wanted
    whole = httpx.get(url, timeout=30)
    assert (whole.status_code, whole.content) == (200, CONTENT)


def test_odd_names_ranges_and_dot_segments_are_answered_not_failed(
    launch: Callable[..., Server],
) -> None:
    """A name that is not UTF-8 made its folder's every listing a 500 (meta-fuse lost the
    folder); a name with a line feed was listed but never served; two ranges got the last one
    alone as a 206; a `..` segment got a 400 whose body never came (and a traceback logged)."""
    server = launch()
    film = drop(server.media / "films" / "film.mkv")
    folder = os.fsencode(server.media / "films")
    for odd in (b"Caf\xe9.2020.mkv", b"New\nLine.mkv"):
        fd = os.open(folder + b"/" + odd, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"odd")
        os.close(fd)
    spaced = drop(server.media / "films" / "映画\u3000Two\u00a0Film.mkv")  # odd spaces: names
    top = f"{server.url}/webdav/"
    assert propfind(f"{top}media/films/", "1").keys() == {
        "/webdav/media/films/",
        "/webdav/media/films/film.mkv",
        f"/webdav/media/films/{spaced.name}",
    }
    for method in ("GET", "PROPFIND", "OPTIONS"):  # `/webdav` itself, as a client first asks
        moved = httpx.request(method, f"{server.url}/webdav", headers={"Depth": "0"})
        assert (moved.status_code, moved.headers["location"]) == (307, "/webdav/"), method
    url = f"{top}media/films/film.mkv"
    both = httpx.get(url, headers={"Range": "bytes=0-1,10-11"}, timeout=30)
    assert (both.status_code, both.content) == (200, film.read_bytes())
    plain = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # keeps the dots
    plain.request("GET", "/webdav/media/../../etc/passwd")
    dotted = plain.getresponse()
    assert dotted.status == 400 and json.loads(dotted.read())["error"] == "invalid_request"
    plain.close()


def test_a_folder_is_listed_a_level_at_a_time(launch: Callable[..., Server]) -> None:
    """`Depth: infinity` of a folder (or no `Depth`, read as infinity) made WsgiDAV build the
    whole tree's answer in memory: a 50,000-file root took 19 s and ≈ 50 MB a listing, eight
    at once 2 GB. It is 403 with RFC 4918's `propfind-finite-depth`; a file's own entry and
    `Depth: 1` are listed as before."""
    server = launch()
    drop(server.media / "films" / "deep" / "film.mkv")
    top = f"{server.url}/webdav/"
    for url, headers in (
        (top, {"Depth": "infinity"}),
        (f"{top}media/films/", {"Depth": "Infinity"}),
        (f"{top}media/", {}),  # no Depth: infinity
    ):
        refused = httpx.request("PROPFIND", url, headers=headers, timeout=30)
        assert refused.status_code == 403, (url, headers)
        condition = SafeET.fromstring(refused.content)
        assert condition.tag == f"{DAV}error", refused.text
        assert condition.find(f"{DAV}propfind-finite-depth") is not None, refused.text
    assert propfind(f"{top}media/films/deep/film.mkv", "infinity").keys() == {
        "/webdav/media/films/deep/film.mkv"
    }
    assert propfind(f"{top}media/films/", "1").keys() == {
        "/webdav/media/films/",
        "/webdav/media/films/deep/",
    }


def test_a_body_too_long_or_too_slow_is_refused_and_holds_no_webdav_thread(
    launch: Callable[..., Server],
) -> None:
    """WsgiDAV read any request body it was told of, on one of its threads, with no bound: an
    800 MB PROPFIND body grew the node by 800 MB, and 64 bodies that never came held every
    WebDAV thread for good (every other PROPFIND, HEAD and GET waited). A body but a PUT's is
    read first, at most 64 KiB within `body_timeout_s`."""
    server = launch(METANODE_BODY_TIMEOUT_S="2")
    drop(server.media / "films" / "film.mkv")
    top = f"{server.url}/webdav/"
    too_long = b"<" * (64 * 1024 + 1)
    declared = httpx.request("PROPFIND", top, headers={"Depth": "0"}, content=too_long)
    chunked = httpx.request("PROPFIND", top, headers={"Depth": "0"}, content=iter([too_long]))
    for answer in (declared, chunked):
        assert answer.status_code == 413 and answer.json()["error"] == "too_large", answer.text
    stalled = []
    for _ in range(70):  # more than WebDAV's threads
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        sock.sendall(
            b"PROPFIND /webdav/ HTTP/1.1\r\nHost: 127.0.0.1\r\nDepth: 0\r\n"
            b"Content-Length: 100\r\n\r\n<"
        )
        stalled.append(sock)
    try:
        assert propfind(f"{top}media/films/", "1").keys() == {
            "/webdav/media/films/",
            "/webdav/media/films/film.mkv",
        }
        assert httpx.head(f"{top}media/films/film.mkv", timeout=30).status_code == 200
        answer = stalled[0].makefile("rb").read()  # the server closes after its answer
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(body)["error"] == "request_timeout"
    finally:
        for sock in stalled:
            sock.close()
    small = (
        b'<?xml version="1.0"?><propfind xmlns="DAV:"><prop><getcontentlength/></prop></propfind>'
    )
    asked = httpx.request(
        "PROPFIND", f"{top}media/films/film.mkv", headers={"Depth": "0"}, content=small
    )
    assert asked.status_code == 207 and b"<ns0:getcontentlength>" in asked.content, asked.text


def test_every_answer_has_one_date_header(launch: Callable[..., Server]) -> None:
    """WsgiDAV dates its answers and so does uvicorn; a second `Date` is invalid (RFC 9110
    §5.3: a singleton field), so only the server's is kept."""
    server = launch()
    drop(server.media / "films" / "film.mkv")
    top = f"{server.url}/webdav/"
    for method, path, headers in (
        ("HEAD", "media/films/film.mkv", {}),
        ("GET", "media/films/film.mkv", {"Range": "bytes=0-9"}),
        ("PROPFIND", "media/", {"Depth": "1"}),
        ("GET", "media/nothing", {}),
        ("PUT", "media/new.mkv", {}),
    ):
        answer = httpx.request(method, top + path, headers=headers, timeout=30)
        assert len(answer.headers.get_list("date")) == 1, (method, path, answer.headers)


def test_every_answer_is_a_document_that_runs_no_script(launch: Callable[..., Server]) -> None:
    """A file of the media is no page of the node: whatever it is (an HTML page, an SVG drawing
    that came with a download), WebDAV's answers are sandboxed documents of a type the browser
    takes as said, so no script of theirs runs on the web page's origin; so are its error
    pages (which quote the path) and the property values of `/meta/{hash}/{key}`."""
    server = launch()
    drop(server.media / "films" / "readme.html", b"<script>alert(1)</script>")
    top = f"{server.url}/webdav/media/films/"
    answers = [
        httpx.get(f"{top}readme.html", timeout=30),
        httpx.head(f"{top}readme.html", timeout=30),
        httpx.get(f"{top}%3Cscript%3Ealert(1)%3C%2Fscript%3E.html", timeout=30),  # a 404 page
        httpx.request("PROPFIND", top, headers={"Depth": "1"}, timeout=30),
        httpx.put(f"{top}readme.html", content=b"x", timeout=30),  # 405
        httpx.get(f"{top}%00", timeout=30),  # the mount's own 400 envelope
    ]
    assert [a.status_code for a in answers] == [200, 200, 404, 207, 405, 400]
    assert answers[0].headers["content-type"].startswith("text/html")
    for answer in answers:
        assert answer.headers["content-security-policy"] == "sandbox allow-same-origin"
        assert answer.headers["x-content-type-options"] == "nosniff"
    film = drop(server.media / "films" / "film.mkv")
    cid = hashed(server, film)
    written = httpx.put(f"{server.url}/meta/{cid}/note", content=b"<b>bold</b>", timeout=30)
    assert written.status_code == 200, written.text
    value = httpx.get(f"{server.url}/meta/{cid}/note", timeout=30)
    assert value.text == "<b>bold</b>" and value.headers["x-content-type-options"] == "nosniff"
    assert value.headers["content-security-policy"] == "sandbox allow-same-origin"


def test_file_path_is_the_webdav_path_and_the_midhash_over_range_reads_is_the_cid(
    launch: Callable[..., Server],
) -> None:
    """meta-sort's check: HEAD for the size, a Range read of the midhash sample, the CID; and
    the compat record's `filePath` is the consumers' files folder, then the WebDAV path (the
    file events' and `info`'s path), as meta-sort writes and compares it. The native record
    keeps the absolute path (docs/api.md)."""
    server = launch()
    film = drop(server.media / "films" / "a film (1999).mkv")
    cid = hashed(server, film)
    urls = httpx.get(f"{server.url}/urls", timeout=10).json()
    record = httpx.get(f"{server.url}/meta/{cid}", timeout=10).json()["metadata"]
    assert record["filePath"] == "/files/media/films/a film (1999).mkv"
    assert httpx.get(f"{server.url}/meta/{cid}/filePath").text == record["filePath"]
    info = httpx.get(f"{server.url}/api/file/{cid}/info", timeout=10).json()
    assert info["filePath"] == "media/films/a film (1999).mkv"  # as the file events' `path`
    native = httpx.get(f"{server.url}/api/meta/{cid}", timeout=10).json()
    assert native["filePath"] == native["metadata"]["filePath"] == str(film.resolve())

    url = f"{urls['webdavUrl']}/{info['filePath']}"
    size = int(httpx.head(url, timeout=30).headers["Content-Length"])
    start = cids.midhash_offset(size)
    end = min(size, start + cids.MIDHASH_SAMPLE) - 1
    sample = httpx.get(url, headers={"Range": f"bytes={start}-{end}"}, timeout=30)
    assert sample.status_code == 206 and len(sample.content) == end - start + 1
    assert cids.midhash_cid(cids.midhash_digest(size, sample.content)) == cid
    assert httpx.get(url, timeout=30).content == film.read_bytes()


def test_a_name_with_a_tab_is_read_by_the_name_the_record_gives(
    launch: Callable[..., Server],
) -> None:
    """The watcher fingerprints a file whose name holds a tab (a title pasted from a web page),
    and its record's `filePath` and the file events name it; WebDAV refused that path (400
    `invalid_request`) and left the name out of listings, so meta-sort failed on the file and
    meta-fuse listed it and could not read it. A tab routes and is XML: it is served."""
    server = launch()
    film = drop(server.media / "films" / "The\tFilm (2001).mkv")
    cid = hashed(server, film)
    path = httpx.get(f"{server.url}/meta/{cid}/filePath", timeout=10).text
    assert path == "/files/media/films/The\tFilm (2001).mkv"
    segments = path.removeprefix("/files").split("/")  # as the consumers encode it
    url = f"{server.url}/webdav" + "/".join(quote(s, safe="-_.!~*'()") for s in segments)
    assert int(httpx.head(url, timeout=30).headers["Content-Length"]) == len(CONTENT)
    part = httpx.get(url, headers={"Range": "bytes=1000-1999"}, timeout=30)
    assert (part.status_code, part.content) == (206, CONTENT[1000:2000])
    assert f"/webdav/media/films/{film.name}" in propfind(f"{server.url}/webdav/media/films/", "1")


def test_writes_are_refused(launch: Callable[..., Server]) -> None:
    server = launch()
    film = drop(server.media / "film.mkv")
    before = sorted(p.name for p in server.media.iterdir())
    for target in ("film.mkv", "new.mkv", "folder/"):
        url = f"{server.url}/webdav/media/{target}"
        for method in WRITES:
            answer = httpx.request(method, url, content=b"overwritten", timeout=30)
            assert answer.status_code == 405, (method, target, answer.status_code)
        for method in ("MOVE", "COPY"):
            moved = {"Destination": f"{server.url}/webdav/media/moved.mkv"}
            answer = httpx.request(method, url, headers=moved, timeout=30)
            assert answer.status_code == 405, (method, target)
    options = httpx.request("OPTIONS", f"{server.url}/webdav/media/film.mkv", timeout=30)
    assert options.headers["Allow"] == "OPTIONS, HEAD, GET, PROPFIND"
    assert sorted(p.name for p in server.media.iterdir()) == before
    assert film.read_bytes() == CONTENT


def test_urls_name_the_webdav_root(launch: Callable[..., Server]) -> None:
    server = launch()
    urls = httpx.get(f"{server.url}/urls", timeout=10).json()
    assert urls["webdavUrl"] == f"{server.url}/webdav"  # the URL the request reached
    assert urls["webdavUrlInternal"] == f"http://127.0.0.1:{server.port}/webdav"  # bound there
    assert httpx.request("PROPFIND", urls["webdavUrl"] + "/", headers={"Depth": "0"}).is_success


def test_under_a_root_path_every_href_and_url_carries_it(launch: Callable[..., Server]) -> None:
    """`root_path` (a proxy's sub-path): the listings' hrefs and `/urls` are under it, and the
    node answers both under it and without it (a proxy that strips it, and a client beside the
    node that follows an href on the node's own port); a MOVE's `Destination` may be named
    either way too."""
    server = launch(METANODE_ROOT_PATH="/home/metanode", METANODE_WEBDAV_PLUGIN_WRITES="true")
    drop(server.media / "films" / "one film.mkv")
    for top in (f"{server.url}/webdav/", f"{server.url}/home/metanode/webdav/"):
        assert propfind(top, "1").keys() == {
            "/home/metanode/webdav/",
            "/home/metanode/webdav/media/",
            "/home/metanode/webdav/plugin/",
        }
    listed = propfind(f"{server.url}/home/metanode/webdav/media/films/", "1")
    assert "/home/metanode/webdav/media/films/one film.mkv" in listed
    to_root = httpx.request("PROPFIND", f"{server.url}/webdav", headers={"Depth": "0"})
    assert (to_root.status_code, to_root.headers["location"]) == (307, "/home/metanode/webdav/")
    urls = httpx.get(f"{server.url}/home/metanode/urls", timeout=10).json()
    assert urls["baseUrl"] == urls["apiUrl"] == f"{server.url}/home/metanode"
    assert urls["webdavUrl"] == f"{server.url}/home/metanode/webdav"
    assert urls["webdavUrlInternal"] == f"http://127.0.0.1:{server.port}/home/metanode/webdav"
    assert httpx.get(f"{server.url}/urls", timeout=10).json() == urls  # the same without it

    base = f"{server.url}/home/metanode/webdav/{PLUGIN}"
    assert httpx.put(f"{base}/a.jpg", content=b"a", timeout=30).status_code == 201
    for name, destination in (
        ("b.jpg", f"{base}/b.jpg"),  # as a listing names it
        ("c.jpg", f"{server.url}/webdav/{PLUGIN}/c.jpg"),  # on the node's port, without it
    ):
        source = next(server.data_dir.joinpath("plugin").iterdir()).name
        moved = httpx.request(
            "MOVE", f"{base}/{source}", headers={"Destination": destination}, timeout=30
        )
        assert moved.status_code == 201, moved.text
        assert [p.name for p in server.data_dir.joinpath("plugin").iterdir()] == [name]
    # the guards read the Destination without the prefix: the outputs' folder itself is refused
    itself = {"Destination": f"{server.url}/home/metanode/webdav/{PLUGIN}/"}
    assert httpx.request("MOVE", f"{base}/c.jpg", headers=itself).status_code == 403
    assert httpx.get(f"{base}/c.jpg", timeout=30).content == b"a"


def test_the_internal_url_is_the_host_name_when_listening_everywhere() -> None:
    for host in ("0.0.0.0", "::"):
        settings = config.Settings(host=host, port=9123)
        assert compat.internal_url(settings) == f"http://{socket.gethostname()}:9123"
    assert compat.internal_url(config.Settings(host="10.1.2.3")) == "http://10.1.2.3:9000"


def escapes(tmp_path: Path, media: Path) -> list[str]:
    """Links from the root to a file and a folder outside it; the paths that use them."""
    outside = drop(tmp_path / "outside" / "secret.txt", b"not for the network")
    media.mkdir(parents=True, exist_ok=True)
    (media / "secret.txt").symlink_to(outside)
    (media / "out").symlink_to(outside.parent, target_is_directory=True)
    return ["secret.txt", "out/secret.txt"]


def test_symlinks_do_not_escape_a_root(tmp_path: Path, launch: Callable[..., Server]) -> None:
    server = launch()
    paths = escapes(tmp_path, server.media)
    drop(server.media / "inside.mkv")
    (server.media / "alias.mkv").symlink_to(server.media / "inside.mkv")  # a link, even inside
    for path in [*paths, "alias.mkv"]:
        for method in ("GET", "HEAD", "PROPFIND"):
            answer = httpx.request(method, f"{server.url}/webdav/media/{path}", timeout=30)
            assert answer.status_code == 403, (method, path, answer.status_code)
            assert b"not for the network" not in answer.content
    listed = propfind(f"{server.url}/webdav/media/", "1")
    assert listed.keys() == {"/webdav/media/", "/webdav/media/inside.mkv"}  # links left out


def test_what_the_watcher_ignores_is_neither_listed_nor_served(
    launch: Callable[..., Server],
) -> None:
    """WebDAV served every file of a root, what the watcher leaves out too: a dot-file or a
    dot-folder (`.ssh/id_ed25519` in a root that is a home folder, `.env`), a download in
    progress, a `watch_ignore` glob, to every trusted address without the token, though no
    record names them and no consumer asks for them. Now each is 404 (and `POST /file/cid` of
    it too) and left out of listings; the library's files are served as before."""
    server = launch(METANODE_WATCH_IGNORE="*.secret,private/*")
    film = drop(server.media / "films" / "film.mkv")
    hidden = ["films/.env", ".ssh/id_ed25519", "films/next.mkv.part", "a.secret", "private/b.mkv"]
    for path in hidden:
        drop(server.media / path, b"not for the network")
    base = f"{server.url}/webdav/media"
    for path in hidden:
        for method in ("GET", "HEAD", "PROPFIND"):
            answer = httpx.request(method, f"{base}/{path}", headers={"Depth": "0"}, timeout=30)
            assert answer.status_code == 404, (method, path, answer.status_code)
            assert b"not for the network" not in answer.content
        asked = httpx.post(f"{server.url}/file/cid", json={"path": f"media/{path}"}, timeout=30)
        assert asked.status_code == 404, (path, asked.text)
    folders = {"/webdav/media/", "/webdav/media/films/", "/webdav/media/private/"}
    assert propfind(f"{base}/", "1").keys() == folders  # `private/*` leaves the folder listed
    assert propfind(f"{base}/private/", "1").keys() == {"/webdav/media/private/"}
    assert propfind(f"{base}/films/", "1").keys() == {
        "/webdav/media/films/",
        "/webdav/media/films/film.mkv",
    }
    assert httpx.get(f"{base}/films/film.mkv", timeout=30).content == film.read_bytes()
    assert httpx.post(f"{server.url}/file/cid", json={"path": "media/films/film.mkv"}).is_success


def test_symlinks_are_followed_when_the_watcher_follows_them(
    tmp_path: Path, launch: Callable[..., Server]
) -> None:
    server = launch(METANODE_WATCH_FOLLOW_SYMLINKS="true")
    for path in escapes(tmp_path, server.media):
        answer = httpx.get(f"{server.url}/webdav/media/{path}", timeout=30)
        assert (answer.status_code, answer.content) == (200, b"not for the network"), path


def test_several_roots_are_top_level_collections(
    tmp_path: Path, launch: Callable[..., Server]
) -> None:
    """Two roots named `media` and one named `plugin`: `media`, `media-2`, `plugin-2`; each
    record's `filePath` is its file's WebDAV path (after the consumers' files folder, here
    another than the default)."""
    roots = [tmp_path / "media", tmp_path / "b" / "media", tmp_path / "plugin"]
    server = launch(
        METANODE_WATCH_ROOTS=":".join(map(str, roots)), METANODE_METAMESH_FILES_PATH="/mnt/x/"
    )
    films = [
        drop(root / "film.mkv", CONTENT + bytes(n)) for n, root in enumerate(roots)
    ]  # sizes differ
    top = propfind(f"{server.url}/webdav/", "1")
    assert top.keys() == {"/webdav/", "/webdav/media/", "/webdav/media-2/", "/webdav/plugin-2/"}
    for film, name in zip(films, ("media", "media-2", "plugin-2"), strict=True):
        cid = hashed(server, film)
        path = httpx.get(f"{server.url}/meta/{cid}/filePath", timeout=10).text
        assert path == f"/mnt/x/{name}/film.mkv"
        path = path.removeprefix("/mnt/x/")
        assert httpx.get(f"{server.url}/webdav/{path}", timeout=30).content == film.read_bytes()


def test_a_root_taken_out_of_the_settings_renames_no_other_at_the_restart(tmp_path: Path) -> None:
    """`watch_roots` of two folders called `media`: `media` and `media-2`. The first taken out
    of the setting, the second was `media` after the restart (every saved path of a player,
    every meta-fuse mount, pointing at nothing): it keeps `media-2` now (`webdav-names.json`),
    in WebDAV and in `filePath`; a root the setting adds is named beside the names held."""
    roots = [tmp_path / "media", tmp_path / "b" / "media"]
    film = drop(roots[1] / "film.mkv")
    server = Server(tmp_path / "data", env={"METANODE_WATCH_ROOTS": ":".join(map(str, roots))})
    try:
        server.start()
        assert set(propfind(f"{server.url}/webdav/", "1")) >= {"/webdav/media-2/"}
        cid = hashed(server, film)
        server.stop()
        roots = [roots[1], tmp_path / "c" / "media"]
        server.env["METANODE_WATCH_ROOTS"] = ":".join(map(str, roots))
        server.start()
        top = propfind(f"{server.url}/webdav/", "1")
        assert top.keys() == {"/webdav/", "/webdav/media-2/", "/webdav/media/"}
        info = httpx.get(f"{server.url}/api/file/{cid}/info", timeout=10).json()
        assert info["filePath"] == "media-2/film.mkv"
        read = httpx.get(f"{server.url}/webdav/media-2/film.mkv", timeout=30)
        assert read.content == film.read_bytes()
        names = json.loads((server.data_dir / "webdav-names.json").read_text())["names"]
        assert names == {str(roots[0]): "media-2", str(roots[1]): "media"}
    finally:
        server.stop()
        server.print_log()


def test_plugin_outputs_are_writable_when_enabled(launch: Callable[..., Server]) -> None:
    server = launch(METANODE_WEBDAV_PLUGIN_WRITES="true")
    drop(server.media / "film.mkv")
    base = f"{server.url}/webdav/{PLUGIN}"
    assert httpx.request("MKCOL", f"{base}/tmdb/", timeout=30).status_code == 201
    put = httpx.put(f"{base}/tmdb/poster.jpg", content=b"jpeg bytes", timeout=30)
    assert put.status_code in (201, 204), put.text
    stored = server.data_dir / "plugin" / "tmdb" / "poster.jpg"
    assert stored.read_bytes() == b"jpeg bytes"
    assert httpx.get(f"{base}/tmdb/poster.jpg", timeout=30).content == b"jpeg bytes"
    assert "/webdav/plugin/" in propfind(f"{server.url}/webdav/", "1")
    moved = {"Destination": f"{base}/tmdb/cover.jpg"}
    assert httpx.request("MOVE", f"{base}/tmdb/poster.jpg", headers=moved).status_code == 201
    assert httpx.delete(f"{base}/tmdb/cover.jpg", timeout=30).status_code == 204
    assert list(stored.parent.iterdir()) == []
    # MetaMesh's plugins PUT into folders no one made (meta-core's nginx made them): 409 was
    # their first poster; a folder made so never lies outside the outputs (a link out is not
    # followed)
    deep = httpx.put(f"{base}/fanart/ab/cd/poster.jpg", content=b"deep", timeout=30)
    assert deep.status_code == 201, deep.text
    assert (server.data_dir / "plugin" / "fanart" / "ab" / "cd" / "poster.jpg").exists()
    elsewhere = server.data_dir.parent / "elsewhere"
    elsewhere.mkdir()
    (server.data_dir / "plugin" / "out").symlink_to(elsewhere)
    assert httpx.put(f"{base}/out/deep/a.jpg", content=b"x", timeout=30).status_code >= 400
    assert list(elsewhere.iterdir()) == []
    # the media stay read-only, and a write cannot be moved into them
    assert httpx.put(f"{server.url}/webdav/media/x.mkv", content=b"x").status_code == 405
    httpx.put(f"{base}/tmdb/a.jpg", content=b"a", timeout=30)
    into = {"Destination": f"{server.url}/webdav/media/a.jpg"}
    assert httpx.request("MOVE", f"{base}/tmdb/a.jpg", headers=into).status_code >= 400
    assert sorted(p.name for p in server.media.iterdir()) == ["film.mkv"]


def uploads(folder: Path) -> list[Path]:
    """The `.part` files of the bodies being uploaded into `folder` (`webdav.WholeFile`)."""
    return sorted(p for p in folder.iterdir() if p.suffix == ".part")


def put_raw(server: Server, path: str, head: bytes, body: bytes) -> socket.socket:
    """A PUT of `path` whose head ends with `head` (its length or its chunking), `body` sent
    after it, the socket left open."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + head + b"\r\n" + body)
    return sock


def test_a_put_over_its_limit_or_cut_short_leaves_no_file(launch: Callable[..., Server]) -> None:
    """A PUT's body had no bound: 1 GB sent chunked was written whole (2.7 s), and an endless
    one would fill the disk. And WsgiDAV kept what came as the whole file when the client left
    or stalled (1,000 bytes of a declared 1,000,000: a file the watcher fingerprinted). Now a
    body over `webdav_put_max_bytes` is 413 `too_large` (at once when declared), one that
    stands still 408 `request_timeout`, and nothing of either, or of a client that left, is
    kept: a file it was to replace stays as it was (a body goes into a hidden `.part` file,
    renamed over the file once whole). Memory stays flat: the body streams to the disk."""
    server = launch(
        METANODE_WEBDAV_PLUGIN_WRITES="true",
        METANODE_WEBDAV_PUT_MAX_BYTES=str(1024 * 1024),
        METANODE_BODY_TIMEOUT_S="2",
    )
    base, outputs = f"{server.url}/webdav/{PLUGIN}", server.data_dir / "plugin"
    whole = httpx.put(f"{base}/a/exact.jpg", content=b"x" * 1024 * 1024, timeout=WAIT_S)
    assert whole.status_code == 201 and (outputs / "a" / "exact.jpg").stat().st_size == 1024**2
    declared = httpx.put(f"{base}/a/declared.jpg", content=b"x" * (1024 * 1024 + 1))
    chunked = httpx.put(f"{base}/a/chunked.jpg", content=iter([b"x" * 65536] * 64), timeout=WAIT_S)
    for answer in (declared, chunked):
        assert answer.status_code == 413 and answer.headers["connection"] == "close"
        assert answer.json()["error"] == "too_large", answer.text
        assert "webdav_put_max_bytes" in answer.json()["message"]
    stalled = put_raw(server, "/webdav/plugin/a/stalled.jpg", b"Content-Length: 5000\r\n", b"a")
    answer = stalled.makefile("rb").read()  # the server closes after its answer
    stalled.close()
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408") and b"request_timeout" in body, answer
    left = put_raw(server, "/webdav/plugin/a/left.jpg", b"Content-Length: 5000\r\n", b"a" * 1000)

    made = poll(lambda: next(iter(uploads(outputs / "a")), None), "the body's .part on the disk")
    left.close()
    poll(lambda: (not made.exists()) or None, "the .part of a client that left removed")
    assert not (outputs / "a" / "left.jpg").exists()  # never made: its body did not come whole
    over = httpx.put(f"{base}/a/exact.jpg", content=iter([b"y" * 65536] * 17), timeout=WAIT_S)
    assert over.status_code == 413  # over a file: the file stays as it was
    assert (outputs / "a" / "exact.jpg").read_bytes() == b"x" * 1024 * 1024
    assert sorted(p.name for p in (outputs / "a").iterdir()) == ["exact.jpg"]  # no `.part` left
    replaced = httpx.put(f"{base}/a/exact.jpg", content=b"<nfo/>", timeout=WAIT_S)
    assert replaced.status_code == 204 and (outputs / "a" / "exact.jpg").read_bytes() == b"<nfo/>"


def held_body(whole: threading.Event) -> Iterator[bytes]:
    """A PUT's body whose first 64 KiB come at once and its last byte once `whole` is set:
    an upload in progress for as long as the test looks at it."""
    yield b"x" * 65536
    whole.wait(WAIT_S)
    yield b"y"


def test_an_upload_in_progress_is_neither_listed_nor_served(launch: Callable[..., Server]) -> None:
    """While a PUT's body came, its hidden `.part` was listed by PROPFIND beside the file it
    was to replace (a client mirroring `plugin/` copied half an upload) and served by GET, and
    a new file was listed empty. Now neither is there until the body is whole: the `.part` is
    404 to every read and its name is no client's to write; a file replaced keeps its old
    bytes meanwhile."""
    server = launch(METANODE_WEBDAV_PLUGIN_WRITES="true")
    base, outputs = f"{server.url}/webdav/{PLUGIN}", server.data_dir / "plugin"
    assert httpx.put(f"{base}/a/poster.jpg", content=b"old", timeout=WAIT_S).status_code == 201
    whole = threading.Event()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        puts = [
            pool.submit(httpx.put, f"{base}/a/{name}", content=held_body(whole), timeout=WAIT_S)
            for name in ("poster.jpg", "fanart.jpg")  # a file replaced, a new one
        ]
        try:
            # the second `.part`'s name, once both are there
            name = poll(lambda: uploads(outputs / "a")[1:] or None, "both bodies' .part")[0].name
            assert set(propfind(f"{base}/a/", "1")) == {
                "/webdav/plugin/a/",
                "/webdav/plugin/a/poster.jpg",
            }
            for method in ("GET", "HEAD", "PROPFIND"):
                for path in (name, "fanart.jpg"):
                    answer = httpx.request(method, f"{base}/a/{path}", timeout=WAIT_S)
                    assert answer.status_code == 404, (method, path)
            moved = {"Destination": f"{base}/a/{name}"}
            for method, path, content in (
                ("PUT", f"a/{name}", b"z"),
                ("PUT", f"a/{name}/x.jpg", b"z"),  # its folder would be hidden too
                ("DELETE", f"a/{name}", b""),
                ("MOVE", "a/poster.jpg", b""),  # to it
            ):
                answer = httpx.request(
                    method, f"{base}/{path}", content=content, headers=moved, timeout=WAIT_S
                )
                assert (answer.status_code, answer.json()["error"]) == (403, "forbidden"), path
            assert httpx.get(f"{base}/a/poster.jpg", timeout=WAIT_S).content == b"old"
        finally:
            whole.set()
        assert [put.result().status_code for put in puts] == [204, 201]
    for name in ("poster.jpg", "fanart.jpg"):
        answer = httpx.get(f"{base}/a/{name}", timeout=WAIT_S)
        assert answer.content == b"x" * 65536 + b"y", name
    assert sorted(p.name for p in (outputs / "a").iterdir()) == ["fanart.jpg", "poster.jpg"]


def test_an_upload_in_progress_is_neither_moved_nor_deleted_nor_replaced(
    launch: Callable[..., Server],
) -> None:
    """A MOVE of the folder an upload went into took its hidden `.part` along (201); the PUT
    then found no `.part` to rename, answered 500, and the `.part` stayed in the new folder
    for good; a DELETE of the folder, the same 500. Now a MOVE or DELETE of a file whose body
    is still coming, or of a folder above one, and a MOVE or COPY onto one, is 423
    `upload_in_progress`, nothing done; asked again once the PUT is answered, it is done. A
    COPY of such a folder copies what is there (the old file, no `.part`)."""
    server = launch(METANODE_WEBDAV_PLUGIN_WRITES="true")
    base, outputs = f"{server.url}/webdav/{PLUGIN}", server.data_dir / "plugin"
    for path in ("a/poster.jpg", "c/other.jpg"):
        assert httpx.put(f"{base}/{path}", content=b"old", timeout=WAIT_S).status_code == 201
    whole = threading.Event()

    def dav(method: str, path: str, to: str | None = None) -> httpx.Response:
        moved = {"Destination": f"{base}/{to}", "Overwrite": "T"} if to else {}
        return httpx.request(method, f"{base}/{path}", headers=moved, timeout=WAIT_S)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        puts = [
            pool.submit(httpx.put, f"{base}/a/{name}", content=held_body(whole), timeout=WAIT_S)
            for name in ("poster.jpg", "fanart.jpg")  # a file replaced, a new one
        ]
        try:
            poll(lambda: uploads(outputs / "a")[1:] or None, "both bodies' .part")
            for method, path, to in (
                ("MOVE", "a/", "b/"),
                ("DELETE", "a/", None),
                ("MOVE", "a/poster.jpg", "a/cover.jpg"),
                ("MOVE", "a/fanart.jpg", "a/cover.jpg"),  # not on the disk yet
                ("DELETE", "a/fanart.jpg", None),
                ("COPY", "c/other.jpg", "a/poster.jpg"),  # onto one
                ("MOVE", "c/", "a/"),
            ):
                answer = dav(method, path, to)
                assert answer.status_code == 423, (method, path, answer.text)
                assert answer.json()["error"] == "upload_in_progress" and answer.json()["retryable"]
                assert f"/webdav/{PLUGIN}/a/" in answer.json()["message"]
            assert dav("COPY", "a/", "d/").status_code == 201
            assert sorted(p.name for p in (outputs / "d").iterdir()) == ["poster.jpg"]
            assert (outputs / "d" / "poster.jpg").read_bytes() == b"old"
            assert dav("MOVE", "c/other.jpg", "c/moved.jpg").status_code == 201  # elsewhere
            assert len(uploads(outputs / "a")) == 2 and (outputs / "c" / "moved.jpg").exists()
        finally:
            whole.set()
        assert [put.result().status_code for put in puts] == [204, 201]
    assert dav("MOVE", "a/", "b/").status_code == 201
    for name in ("poster.jpg", "fanart.jpg"):
        assert (outputs / "b" / name).read_bytes() == b"x" * 65536 + b"y", name
    assert not (outputs / "a").exists()
    assert [p for p in outputs.rglob("*") if p.suffix == ".part"] == []


def test_a_plugin_output_is_found_by_its_cid_as_the_media_are(
    launch: Callable[..., Server],
) -> None:
    """meta-stremio serves a record's poster by the CID a plugin claimed for the image it wrote
    over WebDAV (`/api/file/{cid}/info`, then the bytes): the outputs' folder was not watched,
    so no CID found it. It is watched while writes are on, its files at `plugin/…`."""
    server = launch(METANODE_WEBDAV_PLUGIN_WRITES="true")
    base = f"{server.url}/webdav/{PLUGIN}"
    poster = b"\xff\xd8 a poster " * 500
    httpx.request("MKCOL", f"{base}/tmdb/", timeout=30)
    assert httpx.put(f"{base}/tmdb/poster.jpg", content=poster, timeout=30).status_code == 201
    cid = hashed(server, server.data_dir / "plugin" / "tmdb" / "poster.jpg")
    info = httpx.get(f"{server.url}/api/file/{cid}/info", timeout=10).json()
    assert (info["filePath"], info["size"]) == ("plugin/tmdb/poster.jpg", len(poster))
    assert httpx.get(f"{server.url}/file/{cid}", timeout=30).content == poster
    path = httpx.get(f"{server.url}/meta/{cid}/filePath", timeout=10).text
    assert path == "/files/plugin/tmdb/poster.jpg"
    assert httpx.get(f"{server.url}/webdav/{info['filePath']}", timeout=30).content == poster


def test_streaming_reads_beyond_eight_leave_webdav_answering(
    launch: Callable[..., Server],
) -> None:
    """A GET holds a WebDAV thread while it streams (a player, a transcode): with 8 threads,
    eight players held meta-sort's HEADs and meta-fuse's reads until one ended."""
    server = launch()
    film = server.media / "long.mkv"
    film.parent.mkdir(parents=True, exist_ok=True)
    with film.open("wb") as out:
        out.truncate(64 << 20)  # more than the sockets hold: an unread GET keeps its thread
    hashed(server, film)
    url = f"{server.url}/webdav/media/long.mkv"
    with contextlib.ExitStack() as streams:
        for _ in range(12):
            client = streams.enter_context(httpx.Client(timeout=120))
            reading = streams.enter_context(client.stream("GET", url))
            assert reading.status_code == 200  # headers in, the body left unread
        head = httpx.head(url, timeout=120)
    assert head.status_code == 200 and head.headers["Content-Length"] == str(64 << 20)


def test_plugin_outputs_are_refused_when_disabled(launch: Callable[..., Server]) -> None:
    server = launch()
    base = f"{server.url}/webdav/{PLUGIN}"
    assert httpx.request("MKCOL", f"{base}/", timeout=30).status_code == 405
    assert httpx.request("MKCOL", f"{base}/tmdb/", timeout=30).status_code == 405
    assert httpx.put(f"{base}/tmdb/poster.jpg", content=b"jpeg", timeout=30).status_code == 405
    assert not (server.data_dir / "plugin").exists()


def test_plugin_outputs_may_not_overlap_a_watch_root(tmp_path: Path) -> None:
    media = tmp_path / "media"
    for outputs in (media, media / "plugin", tmp_path):
        with pytest.raises(InvalidRequest, match="webdav_plugin_dir"):
            config.Settings(
                watch_roots=(str(media),),
                webdav_plugin_writes=True,
                webdav_plugin_dir=str(outputs),
            )
    config.Settings(watch_roots=(str(media),), webdav_plugin_dir=str(media))  # writes off: unused


@pytest.mark.parametrize("root", [".", "..", "data"])
def test_a_data_directory_inside_a_watch_root_is_refused(tmp_path: Path, root: str) -> None:
    """The data directory inside a watch root (`watch_roots = ["/srv"]`, `data_dir =
    "/srv/metanode"`): WebDAV served `/webdav/<root>/data/api-token` and `keys/owner.key` to
    every trusted address without the token, and the watcher made records of them (so
    `/file/{cid}` served them too). `serve` now refuses to start; a root inside the data
    directory is no danger (it holds none of it)."""
    (tmp_path / "data").mkdir()
    env = {**Server(tmp_path / "data").base_env(), "METANODE_WATCH_ROOTS": root}
    done = serve_refused(tmp_path, env, "--data-dir", "data")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        f"error: invalid_request: setting data_dir: 'data' lies inside the watch root {root!r}"
    )
    assert not (tmp_path / "data" / "api-token").exists()
    config.Settings(data_dir=tmp_path / "data", watch_roots=(str(tmp_path / "data" / "media"),))


NAMES_OF = ["media", "plugin", "tv", "media-2", "films"]
NAMES = st.sampled_from(NAMES_OF)


@given(
    st.lists(st.tuples(st.sampled_from(["/srv", "/srv/x", "/mnt"]), NAMES), max_size=6, unique=True)
)
def test_the_layout_names_every_root_once(roots: list[tuple[str, str]]) -> None:
    """Whatever the roots (each a folder once: `watchroots.check_new`, `Settings`): one distinct
    name each, never `plugin`; a file of a root maps to
    `<its name>/<path below the root>` (the deepest root holding it)."""
    paths = [f"/nonexistent-webdav-test{parent}/{name}" for parent, name in roots]
    layout = Roots.of(named(paths, {}))
    names = [name for name, _ in layout.collections]
    assert len(set(names)) == len(names) == len(paths) and PLUGIN not in names
    for (name, real), path in zip(layout.collections, paths, strict=True):
        assert real == os.path.realpath(path) and name.startswith(os.path.basename(path))
        deepest = max((r for _, r in layout.collections if f"{real}/".startswith(f"{r}/")), key=len)
        owner = next(n for n, r in layout.collections if r == deepest)
        assert layout.relative(f"{real}/a/b.mkv") == f"{owner}/a/b.mkv"
    assert layout.relative("/elsewhere/c.mkv") == "elsewhere/c.mkv"


FOLDERS = st.sampled_from([f"/nonexistent-webdav-test/{p}/{n}" for p in "ab" for n in NAMES_OF])


@given(st.lists(st.tuples(st.booleans(), FOLDERS), max_size=12))
def test_a_root_keeps_its_name_while_it_stays_whatever_comes_and_goes(
    changes: list[tuple[bool, str]],
) -> None:
    """Roots added and let go in any order, the names kept between changes as `Names.keep`
    keeps them, and those of roots let go as their former ones: a root's name never changes
    while it stays, no two roots share one, none is `plugin`, and a root named anew takes the
    name it had before if none holds it, else its basename or the first free `-N` of it."""
    roots: list[str] = []
    kept: dict[str, str] = {}
    former: dict[str, str] = {}
    for add, folder in changes:
        if add and folder not in roots:
            roots.append(folder)
        elif not add and folder in roots:
            roots.remove(folder)
            former[folder] = kept[folder]
        names = dict((root, name) for name, root in named(roots, kept, former))
        for root, name in kept.items():
            assert root not in roots or names[root] == name, (root, name, names[root])
        assert len(set(names.values())) == len(roots) and PLUGIN not in names.values()
        for root in set(roots) - kept.keys():
            base = os.path.basename(root)
            held = set(names.values()) - {names[root]} | {PLUGIN}
            free = next(n for n in [base, *(f"{base}-{i}" for i in range(2, 99))] if n not in held)
            back = former.get(root)
            assert names[root] == (back if back is not None and back not in held else free)
        kept = names


def raw_request(
    server: Server, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[http.client.HTTPResponse, bytes]:
    """`method` of `path` exactly as written (httpx would mend its percent-escapes and dots)."""
    plain = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        plain.request(method, path, body=b"x" if method == "PUT" else None, headers=headers or {})
        answer = plain.getresponse()
        return answer, answer.read()
    finally:
        plain.close()


def test_a_path_not_utf8_or_with_a_control_character_is_400_never_a_500(
    launch: Callable[..., Server],
) -> None:
    """NUL in a path failed the open: a 500 page quoting `ValueError('embedded null byte')`; a
    byte that is not UTF-8 (or a lone surrogate) became U+FFFD, a name a PUT then created."""
    server = launch(METANODE_WEBDAV_PLUGIN_WRITES="true")
    drop(server.media / "small.txt", b"0123456789abcdefghijkl")
    odd = ("small.txt%00", "%00", "%FF", "a%ED%A0%80b", "Esc%1B.mkv", "%7F", "%C0%AE%C0%AE")
    for method in ("GET", "HEAD", "PROPFIND", "PUT", "MKCOL", "DELETE"):
        for top in ("media", f"{PLUGIN}/p1"):
            for name in odd:
                answer, body = raw_request(server, method, f"/webdav/{top}/{name}")
                assert answer.status == 400, (method, top, name, answer.status, body[:300])
                if method != "HEAD":
                    assert json.loads(body)["error"] == "invalid_request", (method, name)
    httpx.put(f"{server.url}/webdav/{PLUGIN}/p1/ok.txt", content=b"ok", timeout=30)
    for name in odd:
        moved = {"Destination": f"{server.url}/webdav/{PLUGIN}/p1/{name}"}
        for method in ("MOVE", "COPY"):
            answer, body = raw_request(server, method, f"/webdav/{PLUGIN}/p1/ok.txt", moved)
            assert answer.status == 400, (method, name, answer.status, body[:300])
    assert [p.name for p in (server.data_dir / "plugin" / "p1").iterdir()] == ["ok.txt"]
    assert "embedded null byte" not in server.log_text()


def test_plugin_writes_that_cannot_be_done_are_refused_never_a_500(
    launch: Callable[..., Server],
) -> None:
    """Each was a 500: a PUT below a file (its folders could not be made), a name longer than
    the file system takes, 2,000 levels (a RecursionError, and a 3.2 MB log line), a write of
    the outputs' folder itself, a copy of it into itself, a move onto it."""
    server = launch(METANODE_WEBDAV_PLUGIN_WRITES="true")
    base, outputs = f"/webdav/{PLUGIN}", server.data_dir / "plugin"
    assert httpx.put(f"{server.url}{base}/p1/ok.txt", content=b"ok", timeout=30).is_success
    assert raw_request(server, "PUT", f"{base}/p1/ok.txt/sub")[0].status == 409
    assert raw_request(server, "MKCOL", f"{base}/p1/ok.txt/sub/")[0].status == 409
    for path, levels in ((f"p1/{'a' * 300}.txt", 2), ("d/" * 2000 + "f.txt", 2001)):
        answer, body = raw_request(server, "PUT", f"{base}/{path}")
        assert (answer.status, json.loads(body)["error"]) == (414, "path_too_long"), levels
    assert raw_request(server, "PUT", f"{base}/{'d/' * 32}f.txt")[0].status == 414
    assert raw_request(server, "PUT", f"{base}/{'d/' * 31}f.txt")[0].status == 201  # 32 levels
    assert raw_request(server, "PUT", f"{base}/p1/{'a' * 251}.txt")[0].status == 201
    for path in (base, f"{base}/"):
        for method in ("PUT", "DELETE", "MKCOL", "PROPPATCH", "LOCK"):
            answer, body = raw_request(server, method, path)
            assert answer.status == 405, (method, path, answer.status, body[:300])
            assert answer.getheader("Allow") == "OPTIONS, HEAD, GET, PROPFIND", (method, path)
            assert json.loads(body)["error"] == "method_not_allowed"
        assert propfind(f"{server.url}{path}", "0")  # still listed
    httpx.request("MKCOL", f"{server.url}{base}/p1/sub/", timeout=30)
    for method, path, destination in (
        ("COPY", f"{base}/", f"{base}/p1/loop/"),
        ("MOVE", f"{base}/", f"{base}/p1/loop/"),
        ("MOVE", f"{base}/p1/sub/", f"{base}/"),
        ("COPY", f"{base}/p1/sub/", base),
        ("COPY", f"{base}/p1/", f"{base}/p1/loop/"),  # WsgiDAV's own refusal
    ):
        moved = {"Destination": f"{server.url}{destination}"}
        answer, body = raw_request(server, method, path, moved)
        assert answer.status == 403, (method, path, destination, answer.status, body[:300])
    for method in ("MOVE", "GET"):  # a Destination that is no URL failed every method: a 500
        unclosed = {"Destination": "http://[::1/webdav/x"}
        answer, body = raw_request(server, method, f"{base}/p1/ok.txt", unclosed)
        assert answer.status == (400 if method == "MOVE" else 200), (method, body[:300])
    assert sorted(p.name for p in (outputs / "p1").iterdir()) == [
        "a" * 251 + ".txt",
        "ok.txt",
        "sub",
    ]
    assert max(map(len, server.log_text().splitlines())) < 10_000


def test_a_range_that_is_not_a_byte_range_is_ignored_and_one_past_the_end_is_416(
    launch: Callable[..., Server],
) -> None:
    """WsgiDAV's own parser answered each of these 206 with wrong or impossible bytes
    (`bytes=5-2`: the last two, `Content-Range: bytes 20-21/22`; `bytes=-0`: `bytes 22-21/22`),
    and the native route's parser took `+5`, `1_0` and an Arabic-Indic digit for numbers.
    RFC 9110: not a byte range, ignored (200, the whole file); well formed but past the end,
    416 `bytes */22`; read as the native `/file/{cid}` reads them."""
    server = launch()
    data = b"0123456789abcdefghijkl"
    drop(server.media / "small.txt", data)
    url = f"{server.url}/webdav/media/small.txt"
    for wanted in (
        *("bytes=5-2", "items=0-5", "bytes=1-2-3", "bytes=x-3", "bytes", "bytes=0-1,4-5"),
        *("bytes=+5-10", "bytes=1_0-12", "bytes=\u0663-5"),  # numbers to `int`, not to RFC 9110
    ):
        for method in ("GET", "HEAD"):
            answer = httpx.request(method, url, headers={"Range": wanted.encode()}, timeout=30)
            assert answer.status_code == 200, (method, wanted, answer.status_code)
            assert "content-range" not in answer.headers, wanted
            assert answer.headers["content-length"] == str(len(data)), wanted
            assert answer.content == (data if method == "GET" else b""), wanted
    for wanted in ("bytes=-0", "bytes=22-", "bytes=30-40"):
        answer = httpx.get(url, headers={"Range": wanted}, timeout=30)
        assert answer.status_code == 416, (wanted, answer.status_code)
        assert answer.headers["content-range"] == "bytes */22", wanted
    stale = {"Range": "bytes=30-", "If-Range": '"an-old-etag"'}  # the whole file, as before
    assert httpx.get(url, headers=stale, timeout=30).content == data
    for wanted, start, end in (("bytes=5-", 5, 21), ("bytes=-3", 19, 21), ("bytes=2-4", 2, 4)):
        answer = httpx.get(url, headers={"Range": wanted}, timeout=30)
        assert answer.status_code == 206, wanted
        assert answer.headers["content-range"] == f"bytes {start}-{end}/22", wanted
        assert answer.content == data[start : end + 1], wanted


def test_every_405_names_what_is_allowed(launch: Callable[..., Server]) -> None:
    """RFC 9110 §15.5.6: a 405 carries `Allow`; WsgiDAV's carried none. It is what OPTIONS of the
    same path answers."""
    server = launch(METANODE_WEBDAV_PLUGIN_WRITES="true")
    drop(server.media / "films" / "film.mkv")
    httpx.put(f"{server.url}/webdav/{PLUGIN}/p1/ok.txt", content=b"ok", timeout=30)
    for path in ("media/films/film.mkv", "media/films/", "media/films/new.mkv", f"{PLUGIN}/p1/"):
        url = f"{server.url}/webdav/{path}"
        allowed = httpx.request("OPTIONS", url, timeout=30).headers["Allow"]
        methods = ("PUT", "TRACE", "LOCK", "MKCOL", "DELETE", "PROPPATCH", "MOVE", "COPY", "POST")
        for method in methods if not path.startswith(PLUGIN) else ("MKCOL", "POST", "TRACE"):
            moved = {"Destination": f"{server.url}/webdav/media/moved.mkv"}
            answer = httpx.request(method, url, headers=moved, timeout=30)
            assert answer.status_code == 405, (method, path, answer.status_code)
            assert answer.headers.get("Allow") == allowed, (method, path, answer.headers)
    assert allowed.startswith("OPTIONS, HEAD, GET, PROPFIND, DELETE")  # a folder of plugin/
    file = httpx.request("OPTIONS", f"{server.url}/webdav/media/films/film.mkv", timeout=30)
    assert file.headers["Allow"] == "OPTIONS, HEAD, GET, PROPFIND"
