"""The HTTP edge (issue 13): what a hostile or careless client meets before and around the routes.

On a real `metanode serve`: a huge request head is refused (431) while other clients keep being
answered, a head or body that stalls is cut off (408), connections beyond `max_connections` get
503 `too_busy`, and unparseable HTTP gets the envelope too. In-process: 405 names the allowed
methods, body objects with unknown members are refused, and bodies are UTF-8 JSON only.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette

from metanode import cid as cids
from metanode.api import Direct, Edge, create_app
from metanode.bodies import parse_json
from metanode.errors import InvalidJson
from metanode.node import Node
from metanode.server import FrozenAfterStart
from tests.helpers.claims import Signer, register, without_owner
from tests.helpers.server import Server
from tests.helpers.wait import poll

OPENAPI = json.loads((Path(__file__).parents[1] / "schemas" / "openapi.json").read_text("utf-8"))
DEADLINE_S = 30.0  # generous: every wait below is for a condition, this only bounds a failure


@pytest.fixture
def edge_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """A real server; `@pytest.mark.parametrize("edge_server", [{env}], indirect=True)` sets
    its `METANODE_*` environment."""
    srv = Server(tmp_path / "data", env=getattr(request, "param", {})).start()
    yield srv
    srv.stop()
    srv.print_log()


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the timeout)."""
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def read_answer(sock: socket.socket) -> bytes:
    """One answer on a connection kept open: its head, then the `Content-Length` bytes it
    says (a server that closed the connection instead would free a descriptor)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        data = sock.recv(65536)
        assert data, f"closed before a whole head: {raw!r}"
        raw += data
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    said = re.search(r"\r\ncontent-length: (\d+)", head)
    assert said is not None, f"no Content-Length: {raw!r}"
    length = int(said[1])
    while len(raw) - len(head) - 4 < length:
        data = sock.recv(65536)
        assert data, f"closed before a whole body: {raw!r}"
        raw += data
    return raw


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """(status, lower-cased headers, JSON body) of one raw HTTP/1.1 response, whose headers
    each come once (a 408 once sent `connection: close` twice)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    pairs = [line.lower().split(": ", 1) for line in lines]
    headers = dict(pairs)
    assert len(headers) == len(pairs), f"a header named twice: {head!r}"
    return int(status_line.split()[1]), headers, json.loads(body)


def assert_envelope(raw: bytes, status: int, slug: str, retryable: bool) -> dict[str, str]:
    got_status, headers, body = parse_response(raw)
    assert (got_status, body["error"], body["retryable"]) == (status, slug, retryable), raw[:300]
    assert headers["content-type"] == "application/json"
    return headers


def readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


# -- request heads --------------------------------------------------------------------------------


def test_a_10_mb_header_is_refused_while_another_client_keeps_being_answered(
    server: Server,
) -> None:
    """The big header goes out 4 KiB at a time, and between two pieces the other client asks
    once: it must be answered every time, and the big sender must get 431 long before 10 MB
    (uvicorn's httptools parser alone buffered all of it, quadratically, and answered 200)."""
    piece, size, sent, answers = b"a" * 4096, 10 * 2**20, 0, 0
    with connect(server) as big, httpx.Client(base_url=server.url, timeout=DEADLINE_S) as other:
        big.sendall(b"GET /health HTTP/1.1\r\nHost: edge\r\nX-Big: ")
        while sent < size and not readable(big):
            try:
                big.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
            assert other.get("/health").status_code == 200
            answers += 1
        headers = assert_envelope(read_until_closed(big), 431, "headers_too_large", False)
        assert headers["connection"] == "close"
        assert other.get("/health").status_code == 200
    assert sent < 2**20, f"{sent} bytes of header were taken before the refusal"
    assert answers >= 10  # the other client was answered all along (64 KiB / 4 KiB pieces)


def one_request(server: Server, head: bytes, body: bytes = b"") -> bytes:
    """`head` (and `body`) sent in one `sendall`, and the answer up to the connection's close."""
    with connect(server) as sock:
        sock.sendall(head + b"Connection: close\r\n\r\n" + body)
        return read_until_closed(sock)


def test_a_long_head_that_arrives_in_one_read_is_refused_too(server: Server) -> None:
    """A head that ended within one read was never counted: 70–140 KB heads sent at once were
    answered 200, and a target over 65,535 bytes was uvicorn's 400 "Invalid HTTP request
    received." Both are 431 now; a long body behind a short head is no long head."""
    for head in (
        b"GET /health HTTP/1.1\r\nHost: edge\r\nX-Big: " + b"a" * 70_000 + b"\r\n",
        b"GET /health HTTP/1.1\r\nHost: edge\r\n" + b"X-Many: aaaa\r\n" * 9000,
        b"GET /health?" + b"q" * 140_000 + b" HTTP/1.1\r\nHost: edge\r\n",
    ):
        assert_envelope(one_request(server, head), 431, "headers_too_large", False)
    body = b'{"claims": []' + b" " * 200_000 + b"}"
    answer = one_request(
        server,
        b"POST /api/claims HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + server.token.encode() + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n",
        body,
    )
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


@pytest.mark.parametrize("edge_server", [{"METANODE_MAX_HEADER_BYTES": "262144"}], indirect=True)
def test_a_target_longer_than_httptools_parses_is_named_in_the_envelope(
    edge_server: Server,
) -> None:
    head = b"GET /health?" + b"q" * 70_000 + b" HTTP/1.1\r\nHost: edge\r\n"
    raw = one_request(edge_server, head)
    assert_envelope(raw, 400, "bad_request", False)
    assert b"the request target is over 65535 bytes" in raw
    assert httpx.get(f"{edge_server.url}/health", timeout=DEADLINE_S).status_code == 200


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_100_mb_header_sent_at_full_speed_costs_no_memory_and_stalls_nobody(
    server: Server,
) -> None:
    assert server.proc is not None
    before = vm_hwm_mib(server.proc.pid)
    outcome: list[bytes] = []

    def blast() -> None:
        with connect(server) as sock:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # cut off: fine
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: edge\r\nX-Big: " + b"a" * 100 * 2**20)
            outcome.append(read_until_closed(sock))

    sender = threading.Thread(target=blast)
    sender.start()
    answers = 0
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as other:
        while sender.is_alive() or answers < 20:
            assert other.get("/health").status_code == 200
            answers += 1
    sender.join()
    assert_envelope(outcome[0], 431, "headers_too_large", False)
    assert vm_hwm_mib(server.proc.pid) - before < 32  # was ≈ 200 MiB for 100 MB


@pytest.mark.parametrize("edge_server", [{"METANODE_HEADER_TIMEOUT_S": "1"}], indirect=True)
def test_a_head_that_stalls_is_answered_408_and_closed(edge_server: Server) -> None:
    with connect(edge_server) as loris, connect(edge_server) as silent:
        loris.sendall(b"GET /health HTTP/1.1\r\nHost: edge\r\nX-Slow: ")  # ... and nothing more
        assert httpx.get(f"{edge_server.url}/health", timeout=DEADLINE_S).status_code == 200
        headers = assert_envelope(read_until_closed(loris), 408, "request_timeout", True)
        assert headers["connection"] == "close"
        assert read_until_closed(silent) == b""  # opened, never wrote: closed without a word


@pytest.mark.parametrize("edge_server", [{"METANODE_HEADER_TIMEOUT_S": "1"}], indirect=True)
def test_a_body_dripped_after_the_answer_does_not_hold_the_connection(edge_server: Server) -> None:
    """GET /health answers without reading the declared body; a client that keeps dripping it
    (each byte would reset uvicorn's 5 s keep-alive timer) is closed after the head deadline."""
    with connect(edge_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: edge\r\nContent-Length: 100000\r\n\r\nx")
        deadline = time.monotonic() + DEADLINE_S
        answered = b""
        while time.monotonic() < deadline:
            if select.select([sock], [], [], 0.2)[0]:
                data = sock.recv(65536)
                if not data:
                    break  # closed by the server
                answered += data
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
        else:
            pytest.fail(f"still open after {DEADLINE_S} s of dripping")
    assert answered.startswith(b"HTTP/1.1 200 "), answered[:100]


def test_unparseable_http_gets_the_envelope(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\x00\r\n\r\n")
        assert_envelope(read_until_closed(sock), 400, "bad_request", False)


@pytest.mark.parametrize(
    "framing",
    [b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", b"Transfer-Encoding: gzip\r\n\r\nabc"],
)
def test_a_body_the_parser_cannot_read_gets_the_envelope(server: Server, framing: bytes) -> None:
    """The parser fails in the body, after the app has its request: the connection was closed
    without an answer. The 400 is its answer, the app's (never sent) is dropped, nothing is
    written, and the log holds no traceback of the app told the client left."""
    with connect(server) as sock:
        sock.sendall(
            b"POST /api/signers HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + server.token.encode() + b"\r\n" + framing
        )
        headers = assert_envelope(read_until_closed(sock), 400, "bad_request", False)
        assert headers["connection"] == "close"
    listed = httpx.get(f"{server.url}/api/signers", headers=server.headers, timeout=DEADLINE_S)
    assert without_owner(listed.json()["signers"]) == []
    assert "Traceback" not in server.log_text()


# -- request bodies -------------------------------------------------------------------------------


@pytest.mark.parametrize("edge_server", [{"METANODE_BODY_TIMEOUT_S": "1"}], indirect=True)
def test_a_body_that_stalls_is_answered_408_and_closed(edge_server: Server) -> None:
    with connect(edge_server) as sock:
        sock.sendall(
            b"POST /api/signers HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json"
            b"\r\nAuthorization: Bearer "
            + edge_server.token.encode()
            + b'\r\nContent-Length: 100\r\n\r\n{"uid": '
        )  # 8 of the 100 bytes
        headers = assert_envelope(read_until_closed(sock), 408, "request_timeout", True)
        assert headers["connection"] == "close"
    listed = httpx.get(
        f"{edge_server.url}/api/signers", headers=edge_server.headers, timeout=DEADLINE_S
    ).json()["signers"]
    assert without_owner(listed) == []


# -- connections ----------------------------------------------------------------------------------


def poll_status(url: str, wanted: int) -> httpx.Response:
    """GET /health on a fresh connection until it answers `wanted` (bounded)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        response = httpx.get(f"{url}/health", timeout=DEADLINE_S)
        if response.status_code == wanted or time.monotonic() > deadline:
            return response


@pytest.mark.parametrize("edge_server", [{"METANODE_MAX_CONNECTIONS": "3"}], indirect=True)
def test_connections_beyond_max_connections_get_503_too_busy(edge_server: Server) -> None:
    idle = [connect(edge_server) for _ in range(3)]
    try:
        response = poll_status(edge_server.url, 503)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "too_busy" and response.json()["retryable"] is True
        assert response.headers["retry-after"] == "1"
        idle.pop().close()  # 2 idle + this request's connection = 3: served again
        assert poll_status(edge_server.url, 200).status_code == 200
    finally:
        for sock in idle:
            sock.close()


def open_files_limit(pid: int) -> tuple[int, int]:
    """The (soft, hard) open-file limit of process `pid`, as /proc shows it."""
    line = next(
        ln for ln in Path(f"/proc/{pid}/limits").read_text().splitlines() if "open files" in ln
    )
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


@pytest.mark.parametrize("hard", [4096, 300])
def test_the_open_file_limit_is_raised_so_connections_past_the_limit_get_too_busy(
    tmp_path: Path, hard: int
) -> None:
    """A soft `ulimit -n` below `max_connections` (systemd's services and containerd 2's
    containers start at 1,024, `max_connections` is 1,024): the descriptors ran out first, so a
    request past them got no 503 `too_busy` but a reset connection (`/health` too). The start
    raises the soft limit within the hard one; a hard limit too low is said in the log."""
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to set the open-file limit")
    env = {"METANODE_MAX_CONNECTIONS": "300", "METANODE_MAX_CLIENT_CONNECTIONS": "2000"}
    srv = Server(tmp_path / "data", env=env, prefix=("prlimit", f"--nofile=256:{hard}", "--"))
    srv.start()
    idle: list[socket.socket] = []
    try:
        assert srv.proc is not None
        if hard < 300 + 128:
            assert "the open-file limit (ulimit -n) is 300, below the 428" in srv.log_text()
            assert open_files_limit(srv.proc.pid) == (hard, hard)
            return
        idle += [connect(srv) for _ in range(400)]  # past the soft limit the node started with
        response = poll_status(srv.url, 503)
        assert response.json()["error"] == "too_busy", response.text
        assert open_files_limit(srv.proc.pid) == (hard, hard)
    finally:
        for sock in idle:
            sock.close()
        srv.stop()
        srv.print_log()
    assert "open-file limit" not in srv.log_text()


def sockets_of(descriptors: Path) -> set[str]:
    """The sockets among a process's descriptors (its `/proc/<pid>/fd`), by inode: a new one is
    a connection accepted, whatever files it opens and closes meanwhile."""
    found = set()
    for name in os.listdir(descriptors):
        with contextlib.suppress(OSError):  # closed since it was listed
            target = os.readlink(descriptors / name)
            if target.startswith("socket:"):
                found.add(target)
    return found


def scanned_server(
    tmp_path: Path, content: bytes, env: dict[str, str], prefix: tuple[str, ...] = ()
) -> Server:
    """A server (not started) whose `media/film.mkv` holds `content`, fingerprinted by
    `metanode scan` before the start; its watcher off, so nothing else opens files."""
    env = {"METANODE_WATCH_ENABLED": "0", **env}
    srv = Server(tmp_path / "data", env=env, prefix=prefix)
    srv.media.mkdir(parents=True)
    (srv.media / "film.mkv").write_bytes(content)
    scan = [sys.executable, "-m", "metanode", "scan", str(srv.media)]
    scanned = subprocess.run(
        [*scan, "--data-dir", str(srv.data_dir)],
        env={**srv.base_env(), **env},
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert scanned.returncode == 0, scanned.stderr
    return srv


def test_a_file_served_holds_one_descriptor_of_it(tmp_path: Path) -> None:
    """`/file/{cid}` reads the descriptor it opened and checked (`compat.OpenedFile`): Starlette
    opened `/proc/self/fd/N` again once the head was sent, a second descriptor per client
    streaming a film, and a 200 cut short if none was left by then. Seen mid-answer: the
    client reads its head and first bytes, then stops reading, so the server waits to send."""
    content = os.urandom(8 * 1024 * 1024)  # far more than the sockets' buffers hold
    srv = scanned_server(tmp_path, content, {})
    srv.start()
    try:
        assert srv.proc is not None
        film = str(srv.media / "film.mkv")
        with connect(srv) as sock:
            cid = cids.midhash_bytes(content)
            ask = f"GET /file/{cid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.token}"
            sock.sendall(f"{ask}\r\n\r\n".encode())
            got = b""
            while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < 65536:
                data = sock.recv(65536)
                assert data, got[:300]
                got += data
            assert got.startswith(b"HTTP/1.1 200 "), got[:300]
            assert content.startswith(got.partition(b"\r\n\r\n")[2][:65536])
            held = [
                name
                for name in os.listdir(f"/proc/{srv.proc.pid}/fd")
                if readlink(f"/proc/{srv.proc.pid}/fd/{name}") == film
            ]
            assert len(held) == 1, held
    finally:
        srv.stop()
        srv.print_log()


def readlink(path: str) -> str | None:
    """Where a `/proc/<pid>/fd` entry points, or None once it is closed."""
    try:
        return os.readlink(path)
    except OSError:
        return None


def test_a_request_met_with_every_descriptor_held_is_too_many_open_files_then_served(
    tmp_path: Path,
) -> None:
    """Requests that must open a file while the process holds every file descriptor its limit
    allows (connections past `ulimit -n`, a hard limit too low to raise) are answered 503
    `too_many_open_files` in the envelope, naming the limit, never a 500: a read on a database
    connection of its own (SQLite says only "unable to open database file": `db.out_of_files`)
    and `/file/{cid}`, which answered 404, no local copy, a client's word for a missing file
    (`compat.open_hashed`); and a WebDAV GET of that file, which answered 500 in WsgiDAV's HTML
    (`webdav.OutOfFilesAnswered`). Once the connections are gone all are served. Their own
    connections are accepted first, their heads finished once every descriptor is held, and
    kept open after their answers: a connection closed frees a descriptor, for the next. The
    watcher is off (its reads would leave the database connections the read takes kept open);
    the file was fingerprinted by `metanode scan` before the start."""
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to lower the open-file limit")
    limit = 96
    env = {"METANODE_HEADER_TIMEOUT_S": "600"}
    content = os.urandom(5000)
    cid = cids.midhash_bytes(content)
    srv = scanned_server(tmp_path, content, env, prefix=("prlimit", f"--nofile={limit}", "--"))
    srv.start()
    try:
        assert srv.proc is not None
        descriptors = Path(f"/proc/{srv.proc.pid}/fd")
        routes = [
            (b"/api/files?missing=1", "data directory failed"),  # the read's own connection
            (f"/file/{cid}".encode(), "film.mkv"),
            (b"/webdav/media/film.mkv", "film.mkv"),
        ]
        before = sockets_of(descriptors)
        asking = [connect(srv) for _ in routes]
        for sock, (route, _) in zip(asking, routes, strict=True):
            sock.sendall(b"GET " + route + b" HTTP/1.1\r\nHost: x\r\n")  # the head unfinished
        poll(lambda: len(sockets_of(descriptors) - before) >= len(routes) or None, "all accepted")
        # more than the limit: a descriptor the node frees goes to the next connection waiting
        held = [connect(srv) for _ in range(limit + 32)]
        try:
            poll(lambda: len(os.listdir(descriptors)) >= limit or None, "every descriptor held")
            end = f"Authorization: Bearer {srv.token}\r\n\r\n".encode()
            for sock in asking:
                sock.sendall(end)
            answers = [read_answer(sock) for sock in asking]
        finally:
            for sock in held + asking:
                sock.close()
        for raw, (_, where) in zip(answers, routes, strict=True):
            headers = assert_envelope(raw, 503, "too_many_open_files", True)
            assert headers["retry-after"] == "5"
            said = parse_response(raw)[2]["message"]
            assert f"open-file limit allows ({limit}; hard limit {limit})" in said, said
            assert where in said, said

        def served(route: str) -> httpx.Response | None:
            answer = httpx.get(srv.url + route, headers=srv.headers, timeout=DEADLINE_S)
            return answer if answer.status_code == 200 else None

        assert "files" in poll(lambda: served("/api/files?missing=1"), "the read").json()
        assert poll(lambda: served(f"/file/{cid}"), "the file").content == content
        assert poll(lambda: served("/webdav/media/film.mkv"), "the WebDAV file").content == content
        assert poll_status(srv.url, 200).json()["status"] == "ok"
    finally:
        srv.stop()
        srv.print_log()
    assert "Traceback" not in srv.log_text()


def connect_from(server: Server, address: str) -> socket.socket:
    """A connection to the server from another loopback address (all of 127/8 is this host)."""
    sock = socket.socket()
    sock.settimeout(DEADLINE_S)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", server.port))
    return sock


@pytest.mark.parametrize(
    "edge_server",
    [{"METANODE_MAX_CONNECTIONS": "8", "METANODE_MAX_CLIENT_CONNECTIONS": "3"}],
    indirect=True,
)
def test_one_client_cannot_hold_every_connection(edge_server: Server) -> None:
    """One address opening connections that never finish their heads (each opened again as
    the head deadline closes it) had every other client answered 503 `too_busy`, the box's own
    page too. Past `max_client_connections` its next connection is refused at once; the others
    are served; once it closes one, it is served again."""
    held = [connect_from(edge_server, "127.0.0.2") for _ in range(3)]
    for sock in held:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head never finished
    try:
        over = connect_from(edge_server, "127.0.0.2")
        status, headers, body = parse_response(read_until_closed(over))
        assert (status, body["error"], headers["retry-after"]) == (503, "too_busy", "1"), body
        over.close()
        assert httpx.get(f"{edge_server.url}/health", timeout=DEADLINE_S).status_code == 200
        held.pop().close()

        def served_again() -> bool | None:  # once the server has seen that close
            with connect_from(edge_server, "127.0.0.2") as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                return read_until_closed(sock).startswith(b"HTTP/1.1 200") or None

        poll(served_again, "the address under its limit served again")
    finally:
        for sock in held:
            sock.close()
    assert edge_server.log_text().count("127.0.0.2 is over max_client_connections (3)") == 1


def test_the_token_s_scheme_is_any_case_a_401_names_it_and_no_route_redirects(
    server: Server,
) -> None:
    """`bearer` is `Bearer` (RFC 9110: schemes are case-insensitive); a 401 says which scheme it
    wants (`WWW-Authenticate`); a trailing slash is an unknown route, never a 307 to a
    `Location` built from the request's own `Host` header."""
    token = server.token
    for scheme in ("Bearer", "bearer", "BEARER"):
        response = httpx.get(
            f"{server.url}/api/signers", headers={"Authorization": f"{scheme} {token}"}
        )
        assert response.status_code == 200, (scheme, response.text)
    for sent in ({}, {"Authorization": f"Basic {token}"}, {"Authorization": "Bearer"}):
        response = httpx.get(f"{server.url}/api/signers", headers=sent)
        assert response.status_code == 401, (sent, response.text)
        assert response.headers["www-authenticate"] == 'Bearer realm="metanode"'
        assert response.json()["error"] == "unauthorized"
    for method, path in (("POST", "/api/claims/"), ("GET", "/api/signers/"), ("GET", "/health/")):
        response = httpx.request(
            method, f"{server.url}{path}", headers={**server.headers, "Host": "evil.example"}
        )
        assert response.status_code == 404, (path, response.status_code, response.headers)
        assert "location" not in response.headers
        assert response.json()["error"] == "not_found"


# -- the contract (in-process) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("DELETE", "/api/claims", "POST"),
        ("PUT", "/api/signers", "GET, HEAD, POST"),
        ("POST", "/api/meta/bafkqaaa", "GET, HEAD"),
        ("PATCH", "/meta/x/title", "DELETE, GET, HEAD, PUT"),
    ],
)
async def test_405_names_the_allowed_methods(
    client: httpx.AsyncClient, method: str, path: str, allow: str
) -> None:
    response = await client.request(method, path)
    assert response.status_code == 405
    assert response.json()["error"] == "method_not_allowed"
    assert response.headers["allow"] == allow


async def test_unknown_members_are_refused_and_named(client: httpx.AsyncClient) -> None:
    signer = Signer()
    response = await client.post("/api/signers", json={"uid": signer.uid, "may_Link": True})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_request"
    assert "'may_Link'" in response.json()["message"]
    listed = (await client.get("/api/signers")).json()["signers"]
    assert without_owner(listed) == []  # nothing written

    claim = signer.claim("bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy", "t", "v")
    response = await client.post("/api/claims", json={"claims": [claim], "atomic": True})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_request"
    assert "'atomic'" in response.json()["message"]


async def test_a_query_value_that_is_none_of_its_kind_is_refused_not_ignored(
    client: httpx.AsyncClient,
) -> None:
    """`?uid=xyz` listed nothing, `?snapshot=yes` was read as no, and a block of a uid that is
    none said the signer was unknown: each is now bad input, named."""
    signer = Signer()
    await client.post("/api/signers", json={"uid": signer.uid, "name": "s"})
    cid = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
    await client.post("/api/claims", json={"claims": [signer.claim(cid, "t", "v")]})
    for method, path, slug in (
        ("GET", f"/api/meta/{cid}/claims?uid=xyz", "invalid_uid"),
        ("GET", "/api/events?snapshot=yes", "invalid_request"),
        ("GET", "/api/files?missing=yes", "invalid_request"),
        ("POST", "/api/signers/garbage/block", "invalid_uid"),
    ):
        response = await client.request(method, path)
        assert (response.status_code, response.json()["error"]) == (400, slug), path
    listed = await client.get(f"/api/meta/{cid}/claims", params={"uid": signer.uid})
    assert [c["uid"] for c in listed.json()["claims"]] == [signer.uid]


async def test_a_path_or_query_that_is_not_utf8_is_refused_on_every_route(
    client: httpx.AsyncClient,
) -> None:
    """`PUT /meta/$M/rv%FFkey` stored the key `rv\ufffdkey` (uvicorn and Starlette decode
    with `errors="replace"`): 400 `invalid_request` before any route, nothing written; a real
    U+FFFD, escaped as its UTF-8, is still a key like any other."""
    cid = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
    for method, target in (
        ("PUT", f"/meta/{cid}/rv%FFkey"),
        ("POST", f"/meta/{cid}/_add/t%C3"),
        ("PATCH", "/meta/%FF"),
        ("GET", "/api/meta/%FF"),
        ("POST", "/api/signers/%80/block"),
        ("DELETE", "/api/peers/%FE"),
        ("GET", f"/api/meta/{cid}/claims?key=%FF"),
    ):
        response = await client.request(method, target, json={"value": "v"})
        assert (response.status_code, response.json()["error"]) == (400, "invalid_request"), target
        assert "not UTF-8" in response.json()["message"], target
    assert (await client.get("/meta")).json()["count"] == 0  # nothing was written
    stored = await client.put(f"/meta/{cid}/rv%EF%BF%BDkey", json={"value": "v"})
    assert stored.status_code == 200, stored.text
    assert (await client.get(f"/meta/{cid}/rv\ufffdkey")).text == "v"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig"])
async def test_a_body_in_another_encoding_is_invalid_json(
    client: httpx.AsyncClient, encoding: str
) -> None:
    body = json.dumps({"uid": Signer().uid}).encode(encoding)
    response = await client.post(
        "/api/signers", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_json"
    assert without_owner((await client.get("/api/signers")).json()["signers"]) == []


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)  # JSON has neither
    | st.text(st.characters(exclude_categories=["Cs"])),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(st.characters(exclude_categories=["Cs"])), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(
    JSON_VALUES,
    st.sampled_from(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"]),
)
def test_parse_json_takes_utf8_and_nothing_else(value: Any, encoding: str) -> None:
    text = json.dumps(value, ensure_ascii=False)
    assert parse_json(text.encode("utf-8")) == value
    with pytest.raises(InvalidJson):
        parse_json(text.encode(encoding))


@given(JSON_VALUES.filter(lambda v: isinstance(v, dict) and bool(v)), st.data())
def test_an_object_naming_a_member_twice_is_invalid_json_wherever_it_is(
    value: dict[str, Any], data: st.DataObject
) -> None:
    """One parser keeps the first of two same-named members, another the last: the node reads
    neither (RFC 8259 §4 leaves it open), at the top or nested."""
    text = json.dumps(value, ensure_ascii=False)
    name = data.draw(st.sampled_from(sorted(value)))
    doubled = f"{text[:-1]}, {json.dumps(name, ensure_ascii=False)}: null}}"
    for body in (doubled, f"[1, {doubled}]", f'{{"claims": {doubled}}}'):
        with pytest.raises(InvalidJson, match="given twice"):
            parse_json(body.encode("utf-8"))


CID = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
JSON_BODY_ROUTES = [  # every route that reads a JSON body, with a body holding `{constant}`
    ("POST", "/api/claims", '{{"claims": [{{"uid": {constant}}}]}}'),
    ("POST", "/api/signers", '{{"uid": "x", "weight": {constant}}}'),
    ("POST", "/api/peers", '{{"url": "http://p", "token": "t", "weight": {constant}}}'),
    ("POST", "/api/claims/reconcile", '{{"ranges": [{{"count": {constant}}}]}}'),
    ("PATCH", f"/meta/{CID}", '{{"title": {constant}}}'),
    ("PUT", f"/meta/{CID}/title", '{{"value": {constant}}}'),
    ("POST", f"/meta/{CID}/_add/tags", '{{"value": {constant}}}'),
    ("POST", "/file/cid", '{{"path": {constant}}}'),
]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
async def test_nan_and_the_infinities_are_not_json_on_any_route(
    client: httpx.AsyncClient, constant: str
) -> None:
    """Python's parser takes them (`{"claims":[{"uid":NaN}]}` was an `invalid_claim`); RFC
    8259 has no such numbers."""
    for method, path, body in JSON_BODY_ROUTES:
        response = await client.request(
            method,
            path,
            content=body.format(constant=constant).encode(),
            headers={"Content-Type": "application/json"},
        )
        assert (response.status_code, response.json()["error"]) == (400, "invalid_json"), path
        assert f"{constant} is not a JSON number" in response.json()["message"]


async def test_a_claim_whose_value_is_given_twice_is_refused_and_nothing_written(
    client: httpx.AsyncClient,
) -> None:
    """A claim signed over one `value` and carrying a second one: Python's json keeps the last
    (the signed one), a proxy or a log reader may show the first. Refused as a whole."""
    signer = Signer()
    await client.post("/api/signers", json={"uid": signer.uid, "name": "s"})
    claim = signer.claim("bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy", "t", "v")
    members = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in claim.items()]
    smuggled = '{"value": "EVIL", ' + ", ".join(members) + "}"
    response = await client.post(
        "/api/claims",
        content=f'{{"claims": [{smuggled}]}}'.encode(),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_json"
    assert "'value' is given twice" in response.json()["message"]
    ok = await client.post("/api/claims", json={"claims": [claim]})
    assert ok.json()["accepted"] == 1, ok.text  # the same claim, once: nothing was written before


# -- the OpenAPI document --------------------------------------------------------------------------


def operations() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in OPENAPI["paths"].items():
        for method, operation in item.items():
            yield method, path, operation


def test_identifier_path_parameters_are_typed() -> None:
    """cid, rid, uid and hash name a shared schema with a pattern, not a bare string."""
    seen = set()
    for method, path, operation in operations():
        for param in operation.get("parameters", []):
            if param["in"] == "path" and param["name"] in ("cid", "rid", "uid", "hash"):
                refs = [s["$ref"] for s in param["schema"].get("anyOf", [param["schema"]])]
                assert all(ref.startswith("#/components/schemas/Common/$defs/") for ref in refs), (
                    method,
                    path,
                    param,
                )
                seen.add(param["name"])
    assert seen == {"cid", "rid", "uid", "hash"}


def test_event_streams_are_described_as_sse_frames() -> None:
    streams = [
        (path, op["responses"]["200"]["content"]["text/event-stream"])
        for _method, path, op in operations()
        if "text/event-stream" in op["responses"].get("200", {}).get("content", {})
    ]
    assert {path for path, _ in streams} == {"/api/events", "/api/events/meta", "/api/events/files"}
    for path, media in streams:
        assert media["schema"]["contentMediaType"] == "text/event-stream", path
        name = media["x-sse-frame"]["$ref"].removeprefix("#/components/schemas/")
        schema = OPENAPI["components"]["schemas"][name.split("/")[0]]
        for part in name.split("/")[1:]:
            schema = schema[part]  # the frame schema resolves
        assert schema["type"] == "object", path


def _edge_of(app: Starlette) -> Edge:
    """The app's `Edge` (its middleware stack is built at the first request)."""
    layer: Any = app.middleware_stack
    while not isinstance(layer, Edge):
        layer = layer.app
    return layer


Answer = tuple[int, Any, str]


def _token_client(app: Starlette, node: Node) -> httpx.AsyncClient:
    """A client of `app` in process, with the node's API token."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://node",
        headers={"Authorization": f"Bearer {node.token}"},
    )


async def _direct_then_routed(
    app: Starlette, ask: Callable[[str], Awaitable[list[Answer]]]
) -> tuple[list[Answer], list[str]]:
    """The answers `ask(tag)` collects with `Edge` calling its direct routes, then with none
    (so the router answers every request): they must be equal. Returned with the paths the
    router was asked for while the direct routes were on."""
    router = app.router.middleware_stack
    reached: list[str] = []

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await router(scope, receive, send)

    app.router.middleware_stack = counting
    direct = await ask("direct")
    routed_while_direct = list(reached)
    _edge_of(app).direct = Direct(())
    assert await ask("routed") == direct
    assert len(reached) - len(routed_while_direct) == len(direct)  # all routed now
    return direct, routed_while_direct


async def test_post_claims_called_by_the_edge_answers_as_the_router_would(node: Node) -> None:
    """`Edge` calls `POST /api/claims` itself, past Starlette's router and exception
    middleware: every answer (refusals included) is the one the routed app gives, and the
    router is never reached on that route while it is direct."""
    app = create_app(node)
    signer, stranger = Signer(), Signer()
    async with _token_client(app, node) as client:
        await register(client, signer)

        async def answers(tag: str) -> list[Answer]:
            good = signer.claim(cids.midhash_bytes(tag.encode()), "title", "t")
            # the same both times: its refusal carries the bytes it was checked against
            forged = signer.claim(cids.midhash_bytes(b"forged"), "title", "t", 1_796_000_000_000)
            bodies = [
                b"{",
                b"[]",
                json.dumps({"claims": [good], "atomic": True}).encode(),
                json.dumps({"claims": [{**forged, "sig": "A" * 86}]}).encode(),
                json.dumps({"claims": [stranger.claim(good["cid"], "title", "t")]}).encode(),
                b" " * (node.settings.max_batch_bytes + 1),
                json.dumps({"claims": [good]}).encode(),
            ]
            seen = []
            for body in bodies:
                r = await client.post("/api/claims", content=body)
                seen.append((r.status_code, r.json(), r.headers["content-type"]))
            return seen

        direct, routed = await _direct_then_routed(app, answers)
    assert routed == []
    assert [status for status, _, _ in direct] == [400, 400, 400, 400, 403, 413, 200]


async def test_get_meta_called_by_the_edge_answers_as_the_router_would(node: Node) -> None:
    """`Edge` calls `GET /api/meta/{cid}` itself too (a route ending in a parameter): a
    document, with `?as=` or without, an unknown and an invalid CID, HEAD, and
    what is not that route (another method, a longer path) answer as the router does."""
    app = create_app(node)
    signer = Signer()
    known = cids.midhash_bytes(b"direct meta")
    async with _token_client(app, node) as client:
        await register(client, signer)
        posted = await client.post(
            "/api/claims", json={"claims": [signer.claim(known, "title", "t")]}
        )
        assert posted.status_code == 200, posted.text
        requests = [
            ("GET", f"/api/meta/{known}"),
            ("GET", f"/api/meta/{known}?as={signer.uid}"),
            ("GET", f"/api/meta/{known}?as=nobody"),
            ("GET", f"/api/meta/{known}?other=1"),
            ("GET", f"/api/meta/{cids.midhash_bytes(b'never claimed')}"),
            ("GET", "/api/meta/not-a-cid"),
            ("HEAD", f"/api/meta/{known}"),
            ("POST", f"/api/meta/{known}"),
            ("GET", f"/api/meta/{known}/claims"),
        ]

        async def answers(tag: str) -> list[Answer]:
            seen = []
            for method, path in requests:
                r = await client.request(method, path)
                body = r.json() if r.content else None
                if isinstance(body, dict) and "request_id" in body:
                    body = {k: v for k, v in body.items() if k != "request_id"}
                seen.append((r.status_code, body, r.headers.get("content-type", "")))
            return seen

        direct, routed = await _direct_then_routed(app, answers)
    assert routed == [f"/api/meta/{known}", f"/api/meta/{known}/claims"]  # POST; a longer path
    assert [status for status, _, _ in direct] == [200, 200, 400, 200, 404, 400, 200, 405, 200]


async def test_what_the_start_made_is_frozen_once_the_server_started() -> None:
    """`server.FrozenAfterStart`: the objects there are once uvicorn has started (lifespan
    and sockets) leave the collector's reach (`gc.freeze`), not before."""
    before = gc.get_freeze_count()
    during: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        while (await receive())["type"] != "lifespan.shutdown":
            during.append(gc.get_freeze_count())  # the start, not yet frozen
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    server = FrozenAfterStart(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)  # polls the condition, bounded by the test's timeout
        assert server.started
        assert during == [before] and gc.get_freeze_count() > before
    finally:
        server.should_exit = True
        await serving
        gc.unfreeze()
