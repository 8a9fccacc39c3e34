"""`metanode serve --workers N`: N processes serve one port, so reads use every core.

One Python process serves one core's worth of requests; SQLite readers in separate processes do
not block each other (WAL), so more processes read more. Writes stay single: exactly one worker,
the **owner**, holds the writer threads, the applier, retention, the plugins and the watcher,
as `--workers 1` does. The others, **readers**, run a follower `Node` (`Node(follower=True)`:
the same stores, read connections only, an `applier.Follower` that publishes the states the
owner's applier commits) and answer the reads themselves (`READS`). `POST /api/claims` they
take up to the write (body, perimeter, JSON) and hand the owner its wire claims as values
(handoff.py, over `handoff.sock`), so the owner does not parse and route every write a second
time. Every other request (the other writes, the web page, WebDAV, file bytes, `/health`,
`/metrics`, anything with a cookie) is handed to the owner whole over a Unix socket in the
data directory (`Forward`), and its answer streamed back. So a write answered by any worker
was answered by the owner after its cache commit, and the next read, in any worker, sees it
(read-your-writes); the feed is the same on every worker (each reads cache.db's feed tables,
woken by its follower).

Handing writes over, not taking SQLite's write lock in turn: the group commit (db.Writer)
coalesces only what one process queues, and the applier must be one (it owns `applied_seq`);
a write is a few hundred microseconds of work against ≈ 100 µs for the extra hop
(docs/benchmarks.md, "Every core" and "Writes handed to the owner as values").

The **supervisor** (`supervise`, the `serve` process itself) holds the data directory's lock,
binds the listening socket once and hands it to each worker (`pass_fds`: the kernel spreads
the connections among the processes that accept on it), restarts a worker that died, and on
SIGTERM/SIGINT/SIGHUP stops them all. Workers die with it (`PR_SET_PDEATHSIG`), so a SIGKILL of
the supervisor ends the node as it ends a single-process one. A worker that keeps dying is
restarted after growing delays (`Backoff`), each restart logged with the exit status and the
delay and counted in the owner's /metrics (`Restarts`, from `workers.json` the supervisor
writes). The workers' metrics are summed across processes (metrics.py, multiprocess mode, in
a folder in memory that the data directory's `metrics` links to: `MetricFolder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httptools
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import mark_process_dead
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metanode.api import create_app, error_response
from metanode.config import Settings, below_root
from metanode.errors import UnavailableError
from metanode.metrics import MULTIPROCESS_ENV, fold_dead
from metanode.node import Node
from metanode.verifier import die_with_parent

log = logging.getLogger(__name__)
OWNER = "owner"
READER = "reader"
SOCKET_NAME = "owner.sock"  # in the data directory (mode 0700): the owner's private door
HANDOFF_NAME = "handoff.sock"  # ...and its door for claims a reader validated (handoff.py)
METRICS_NAME = "metrics"  # in the data directory: every worker's metric files (metrics.py),
# or a link to their folder in memory (`MetricFolder`)
FOLDER_PREFIX = "metanode-metrics-"  # then the pid namespace, the supervisor's pid (`_prefix`)
STATUS_NAME = "workers.json"  # in the data directory: the supervisor's restart counts
CLIENT_HEADER = b"x-metanode-client"  # the client address a reader saw, for the owner's perimeter
WORKER_HEADER = b"x-metanode-worker"  # which worker answered (tests, debugging)
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer"}
SERVERS_OWN = {*HOP_BY_HOP, b"date", b"server"}  # the reader's uvicorn sends its own
# Not passed on to the owner: `Expect: 100-continue` was answered by the reader's uvicorn (the
# owner's interim 100 would end the answer being parsed), and a client's own X-Metanode-Client.
NOT_PASSED_ON = {*HOP_BY_HOP, b"expect", CLIENT_HEADER}
# A worker that died is restarted after FIRST_S, doubling for each death in a row up to CAP_S;
# one that ran STEADY_S or more before dying starts the count again.
FIRST_S, CAP_S, STEADY_S = 0.5, 30.0, 60.0
STOP_S = 15.0  # what stopping may take before the supervisor kills a worker

# The reads a reader answers itself (GET/HEAD, by exact path or by a prefix ending in "/");
# everything else goes to the owner.
READS = (
    "/api/meta/",
    "/api/metadata/",
    "/api/hash-ids",
    "/api/files",
    "/api/events",
    "/api/events/",
    "/api/signers",
    "/openapi.json",
    "/meta",
    "/meta/",
)
CLAIMS = "/api/claims"  # the one write a reader answers itself, up to handing the claims over


def socket_path(settings: Settings) -> Path:
    return settings.data_dir / SOCKET_NAME


def handoff_path(settings: Settings) -> Path:
    return settings.data_dir / HANDOFF_NAME


def metrics_path(settings: Settings) -> Path:
    return settings.data_dir / METRICS_NAME


def status_path(settings: Settings) -> Path:
    return settings.data_dir / STATUS_NAME


def worker_name(role: str, index: int) -> str:
    """A worker's name in `X-Metanode-Worker`, the logs and /metrics."""
    return OWNER if role == OWNER else f"{READER}-{index}"


def answers_itself(scope: Scope, root: str = "") -> bool:
    """Whether a reader answers this request itself: a GET or HEAD of a read route, or a
    `POST /api/claims` (validated here, the claims handed to the owner: handoff.py), without a
    cookie (the web page's sessions live in the owner). A path under the `root_path` prefix
    `root` is its route's (`api.unroot`, in the app that answers it, takes the prefix off)."""
    if any(name == b"cookie" for name, _ in scope["headers"]):
        return False
    path: str = scope["path"]
    if root:
        path = below_root(path, root) or path
    if scope["method"] == "POST":
        return path == CLAIMS
    if scope["method"] not in ("GET", "HEAD"):
        return False
    return any(path == read or (read.endswith("/") and path.startswith(read)) for read in READS)


class Tagged:
    """Names the worker in each answer's `X-Metanode-Worker`: the one that made it, so an
    answer a reader forwarded from the owner keeps the owner's name (and only that)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.name = name.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == WORKER_HEADER for name, _ in headers):
                    message["headers"] = [*headers, (WORKER_HEADER, self.name)]
            await send(message)

        await self.app(scope, receive, tagged)


class FromReader:
    """The owner's side of the Unix socket: a request a reader handed over keeps the client
    address the reader saw (`X-Metanode-Client`), so the perimeter decides on it. Only on the
    Unix socket (whose scope has no port), never on the TCP one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] is None:
            headers = [(k, v) for k, v in scope["headers"] if k != CLIENT_HEADER]
            given = dict(scope["headers"]).get(CLIENT_HEADER, b"").decode("latin-1")
            host, _, port = given.rpartition(":")
            scope = {**scope, "headers": headers, "client": (host, int(port)) if host else None}
        await self.app(scope, receive, send)


class _Answer:
    """httptools callbacks collecting one response: its status, headers and body pieces."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.pieces: list[bytes] = []
        self.head_done = False
        self.sent = False  # the answer's start went to the client
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class Forward:
    """A reader's way to the owner: the request, its body streamed, over a pool of keep-alive
    connections to the owner's Unix socket; the answer streamed back as it comes (httptools
    parses it). Plain asyncio streams, not an HTTP client library: httpx's async client cost
    ≈ 1 ms a request here (docs/benchmarks.md, "Every core"). No owner answering (it is
    restarting): 503 `unavailable`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """(reader, writer, whether it was pooled): a pooled one the owner has not closed."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.open_unix_connection(str(self.path))
        return reader, writer, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head, body = self._head(scope), _has_body(scope)
        for attempt in range(2):
            answer, writer, pooled = _Answer(), None, False
            try:
                reader, writer, pooled = await self._connection()
                writer.write(head)
                if body:
                    await self._send_body(receive, writer, scope)
                await writer.drain()
                parser = httptools.HttpResponseParser(answer)
                if not await self._relay_while_heard(reader, parser, answer, scope, receive, send):
                    writer.close()  # the client left mid-answer: the owner's end closes too
                    return
            except (OSError, EOFError, httptools.HttpParserError):
                if writer is not None:
                    writer.close()
                if answer.sent:
                    raise  # the answer has begun: only closing the client's connection is left
                if attempt == 0 and pooled and not body:
                    continue  # a keep-alive connection the owner closed as it was reused
                refusal = UnavailableError("the owner worker is not answering (restarting?); retry")
                await error_response(refusal)(scope, receive, send)
                return
            if answer.done and scope["method"] != "HEAD" and parser.should_keep_alive():
                self.idle.append((reader, writer))
            else:
                writer.close()
            return

    async def _relay_while_heard(
        self,
        reader: asyncio.StreamReader,
        parser: httptools.HttpResponseParser,
        answer: _Answer,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> bool:
        """`_relay` until the answer is done (True) or the client has left (False). uvicorn
        drops without a word what is sent to a client that has gone, so an answer that never
        ends (the web page's change feed, handed to the owner for its cookie) was relayed to
        nobody for good: an open feed on the owner, its connection and a Unix socket each."""
        relay = asyncio.ensure_future(self._relay(reader, parser, answer, scope, send))
        left = asyncio.ensure_future(_client_left(receive))
        try:
            await asyncio.wait((relay, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not relay.done():
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
        if relay.cancelled():
            return False
        relay.result()  # its errors, as `_relay`'s own
        return True

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        parser: httptools.HttpResponseParser,
        answer: _Answer,
        scope: Scope,
        send: Send,
    ) -> None:
        """Read the owner's answer and send it on as it comes."""
        while not answer.done:
            data = await reader.read(65_536)
            if not data:
                raise EOFError("the owner closed the connection")
            parser.feed_data(data)
            if answer.head_done and not answer.sent:
                headers = [(k, v) for k, v in answer.headers if k not in SERVERS_OWN]
                status = parser.get_status_code()
                await send({"type": "http.response.start", "status": status, "headers": headers})
                answer.sent = True
                if scope["method"] == "HEAD":
                    break
            if answer.pieces:
                chunk, answer.pieces = b"".join(answer.pieces), []
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _head(scope: Scope) -> bytes:
        target = scope["raw_path"] + (
            b"?" + scope["query_string"] if scope["query_string"] else b""
        )
        lines = [scope["method"].encode("latin-1") + b" " + target + b" HTTP/1.1"]
        lines += [k + b": " + v for k, v in scope["headers"] if k not in NOT_PASSED_ON]
        client = scope.get("client")
        if client:
            lines.append(CLIENT_HEADER + f": {client[0]}:{client[1]}".encode("latin-1"))
        if b"transfer-encoding" in dict(scope["headers"]):
            lines.append(b"transfer-encoding: chunked")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    @staticmethod
    async def _send_body(receive: Receive, writer: asyncio.StreamWriter, scope: Scope) -> None:
        """The request body as it arrives: as is under its `Content-Length`, else chunked."""
        chunked = b"content-length" not in dict(scope["headers"])
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionError("the client left")
            piece = message.get("body", b"")
            if chunked and piece:
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            elif piece:
                writer.write(piece)
            await writer.drain()
            if not message.get("more_body", False):
                break
        if chunked:
            writer.write(b"0\r\n\r\n")


async def _client_left(receive: Receive) -> None:
    """Returns once the client has gone (or its answer is complete: uvicorn says
    `http.disconnect` then too); the request's body was read before, or it had none."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _has_body(scope: Scope) -> bool:
    headers = dict(scope["headers"])
    return b"content-length" in headers or b"transfer-encoding" in headers


class Reader:
    """A reader worker's app: the reads by its follower node's app, the rest to the owner."""

    def __init__(self, local: ASGIApp, owner: Forward, root: str = "") -> None:
        self.local = local
        self.owner = owner
        self.root = root  # `root_path`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not answers_itself(scope, self.root):
            await self.owner(scope, receive, send)
        else:
            await self.local(scope, receive, send)  # and the lifespan: the follower node's


def worker_app(settings: Settings, role: str, index: int) -> ASGIApp:
    """The ASGI app of worker `index` in `role`."""
    name = worker_name(role, index)
    if role == OWNER:
        node = Node(settings, handoff_path=handoff_path(settings))
        node.metrics.register(Restarts(status_path(settings)))
        return Tagged(FromReader(create_app(node)), name)
    local = create_app(Node(settings, follower=True, handoff_path=handoff_path(settings)))
    return Tagged(Reader(local, Forward(socket_path(settings)), settings.root_path), name)


class Restarts(Collector):
    """The supervisor's restarts of each worker, read from its status file at scrape time (the
    supervisor serves nothing; the owner answers /metrics)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        try:
            status: dict[str, dict[str, float]] = json.loads(self.path.read_text())
        except FileNotFoundError:
            status = {}
        restarts = CounterMetricFamily(
            "metanode_worker_restarts",
            "Workers the supervisor restarted since serve started, by worker",
            labels=["worker"],
        )
        delay = GaugeMetricFamily(
            "metanode_worker_restart_delay_seconds",
            "The delay before each worker's latest restart (it grows while a worker keeps dying)",
            labels=["worker"],
        )
        for name, worker in sorted(status.items()):
            restarts.add_metric([name], worker["restarts"])
            delay.add_metric([name], worker["delay_s"])
        yield restarts
        yield delay


def owner_socket(settings: Settings) -> socket.socket:
    """The owner's Unix socket, a stale one from a killed owner replaced."""
    path = socket_path(settings)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    return sock


# -- the supervisor -------------------------------------------------------------------------------


def listen(settings: Settings) -> socket.socket:
    """The one listening socket every worker accepts on."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.create_server((settings.host, settings.port), family=family, backlog=2048)
    sock.set_inheritable(True)
    return sock


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies, however it dies; files it
    creates (its metric files) private like the rest of the data directory."""
    die_with_parent()
    os.umask(0o077)


class Backoff:
    """The delays before restarting one worker: FIRST_S, doubling for each death in a row up to
    CAP_S, so a worker that fails at once does not spin; back to FIRST_S once it ran STEADY_S."""

    def __init__(self) -> None:
        self.deaths = 0  # in a row, each after less than STEADY_S

    def after(self, ran_s: float) -> float:
        """The delay before restarting a worker that died after running `ran_s` seconds."""
        if ran_s >= STEADY_S:
            self.deaths = 0
        delay = min(CAP_S, FIRST_S * (1 << min(self.deaths, 16)))
        self.deaths += 1
        return delay


def exit_text(code: int) -> str:
    """A child's exit as a person reads it: `status 3`, or `SIGKILL`."""
    return signal.Signals(-code).name if code < 0 else f"status {code}"


class MetricFolder:
    """Where the workers' metric files live while `serve --workers N` runs: a folder of its own
    in memory (a tmpfs: `$XDG_RUNTIME_DIR`, else `/dev/shm`), which `<data dir>/metrics` links
    to; the data directory itself where there is no such folder. The files are memory-mapped
    and every request a worker answers changes them, so on the data directory's disk the
    kernel wrote a page of them back every 30 s or so: ≈ 285 write requests an hour to an SD
    card for a container's HEALTHCHECK alone, on a node that otherwise wrote nothing (docs/
    operations.md, "Small boxes"). The counts need not outlive `serve` (each start empties
    them), so memory is where they belong. `make` also removes what supervisors killed before
    their `remove` left: the folder the link names, and those of supervisors gone."""

    def __init__(self, link: Path) -> None:
        self.link = link
        self.folder = link  # where the files are, once made

    def make(self) -> None:
        """Remove the last run's folder and make this run's."""
        self._remove()
        _sweep()
        for base in _runtime_folders():
            try:
                made = Path(tempfile.mkdtemp(prefix=f"{_prefix()}{os.getpid()}-", dir=base))
            except OSError:
                continue
            try:
                self.link.symlink_to(made)
            except OSError:
                shutil.rmtree(made, ignore_errors=True)
                break
            self.folder = made
            return
        self.link.mkdir(mode=0o700)

    def remove(self) -> None:
        """At stop: the folder in memory and the link to it (the files of a folder in the data
        directory stay until the next start, as they always did)."""
        if self.folder != self.link:
            self._remove()

    def _remove(self) -> None:
        if self.link.is_symlink():
            _remove_ours(Path(os.readlink(self.link)))
            self.link.unlink()
        else:
            shutil.rmtree(self.link, ignore_errors=True)


def _runtime_folders() -> list[Path]:
    """The folders in memory a metric folder may be made in, in order of preference: the
    user's runtime folder (systemd's /run/user/<uid>), then the machine's shared memory."""
    named = (os.environ.get("XDG_RUNTIME_DIR", ""), "/dev/shm")
    return [Path(path) for path in named if path and os.path.isdir(path)]


def _prefix() -> str:
    """The start of this pid namespace's metric folders' names, the supervisor's pid next:
    `/dev/shm` may be shared with another namespace (`docker run --ipc=host`), whose pids are
    not ours to look up."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{FOLDER_PREFIX}{namespace}."


def _remove_ours(folder: Path) -> None:
    """Remove `folder` if it is one of our metric folders (a real folder of this user, of our
    name), whatever a link to it says."""
    try:
        st = folder.lstat()
    except OSError:
        return
    ours = folder.name.startswith(FOLDER_PREFIX) and st.st_uid == os.geteuid()
    if ours and stat.S_ISDIR(st.st_mode):
        shutil.rmtree(folder, ignore_errors=True)


def _sweep() -> None:
    """Remove the metric folders of this pid namespace's supervisors that are gone."""
    prefix = _prefix()
    for base in _runtime_folders():
        with contextlib.suppress(OSError):
            for folder in base.glob(f"{prefix}*-*"):
                pid = folder.name[len(prefix) :].split("-")[0]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    _remove_ours(folder)


class Supervisor:
    """Runs the workers (`argv(role, index, fd)` is a worker's command line) until a stop
    signal; restarts any that exits meanwhile, after its `Backoff` delay. `metrics` is the
    workers' metric folder (emptied at start), `status` the file its restart counts go to."""

    def __init__(
        self,
        workers: int,
        sock: socket.socket,
        argv: Callable[[str, int, int], Sequence[str]],
        metrics: Path,
        status: Path,
    ) -> None:
        self.roles = [(OWNER if i == 0 else READER, i) for i in range(workers)]
        self.sock = sock
        self.argv = argv
        self.metrics = metrics
        self.status = status
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, float] = {}  # monotonic start of each worker
        self.due: dict[int, float] = {}  # monotonic time a dead worker is restarted at
        self.backoffs = {index: Backoff() for _, index in self.roles}
        self.restarts = {index: (0, 0.0) for _, index in self.roles}  # (count, latest delay)
        self.stopping = False

    def _spawn(self, role: str, index: int) -> None:
        fd = self.sock.fileno()
        self.procs[index] = subprocess.Popen(
            self.argv(role, index, fd),
            pass_fds=(fd,),
            preexec_fn=_die_with_parent,
            env={**os.environ, MULTIPROCESS_ENV: str(self.metrics)},
        )
        self.started[index] = time.monotonic()
        log.info("worker %d (%s) started: pid %d", index, role, self.procs[index].pid)

    def _stop(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:  # as one process does (server.hung_up)
            log.warning("SIGHUP: stopping every worker as for SIGTERM")
        self.stopping = True

    def run(self) -> None:
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: server.hung_up
            signal.signal(stop, self._stop)
        folder = MetricFolder(self.metrics)
        folder.make()  # counts start at zero, as with one process
        try:
            self._write_status()
            for role, index in self.roles:
                self._spawn(role, index)
            while not self.stopping:
                for role, index in self.roles:
                    self._tend(role, index, time.monotonic())
                time.sleep(0.1)
            self._stop_all()
        finally:
            folder.remove()

    def _tend(self, role: str, index: int, now: float) -> None:
        """Note a worker that exited and when to restart it; restart it once that is due."""
        due = self.due.get(index)
        if due is not None:
            if now >= due and not self.stopping:
                del self.due[index]
                self._spawn(role, index)
            return
        proc = self.procs[index]
        code = proc.poll()
        if code is None or self.stopping:
            return
        # Its open-feed count ends with it.
        mark_process_dead(proc.pid, str(self.metrics))  # type: ignore[no-untyped-call]
        fold_dead(str(self.metrics), proc.pid)  # its counts kept, its files gone
        delay = self.backoffs[index].after(now - self.started[index])
        self.due[index] = now + delay
        self.restarts[index] = (self.restarts[index][0] + 1, delay)
        self._write_status()
        log.warning(
            "worker %d (%s, pid %d) exited (%s) after %.1f s; restarting in %.1f s",
            index,
            role,
            proc.pid,
            exit_text(code),
            now - self.started[index],
            delay,
        )

    def _write_status(self) -> None:
        """The restart counts for the owner's /metrics (`Restarts`), replaced whole. A file
        that cannot be written (the data directory's disk full: the very failure a worker may
        have died of) leaves the counts /metrics shows as they were, said in the log; the
        supervisor, and with it every worker, must not end over it."""
        status = {}
        for role, index in self.roles:
            count, delay = self.restarts[index]
            status[worker_name(role, index)] = {"restarts": count, "delay_s": delay}
        partial = self.status.with_suffix(".tmp")
        try:
            partial.touch(mode=0o600)  # private like the rest of the data directory
            partial.write_text(json.dumps(status))
            partial.replace(self.status)
        except OSError as exc:
            log.warning("cannot write %s (%s): /metrics shows older restart counts", partial, exc)

    def _stop_all(self) -> None:
        """SIGTERM to every worker (readers first: they hand requests to the owner), then wait;
        SIGKILL what is still running after `STOP_S`."""
        order = sorted(self.procs, reverse=True)
        for index in order:
            with contextlib.suppress(ProcessLookupError):
                self.procs[index].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for index in order:
            try:
                self.procs[index].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop in %.0f s: killed", index, STOP_S)
                self.procs[index].kill()
                self.procs[index].wait()


def worker_command(base: Sequence[str]) -> Callable[[str, int, int], list[str]]:
    """A worker's command line: `metanode serve` with the supervisor's own options (`base`)."""

    def argv(role: str, index: int, fd: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "metanode",
            "serve",
            *base,
            "--worker",
            f"{role}:{index}:{fd}",
        ]

    return argv
