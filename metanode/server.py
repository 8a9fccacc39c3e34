"""The HTTP server: uvicorn, bounded so that one client cannot stall or exhaust the node.

uvicorn's httptools parser has no limit on a request head: a 100 MB header is buffered whole
(httptools joins the pieces of a header value with `bytes +=`, quadratic in its length) and held
the event loop for ≈ 10 s. Nor does uvicorn time out a head that never ends, and its over-limit
answer is plain text. `BoundedHttpTools` adds, per connection:

* a head limit: once more than `max_header_bytes` of a request line and headers arrived without
  their end, the answer is 431 `headers_too_large` and the connection is closed; a head that
  ended within one read is measured when it ends (`_head_refusal`), so a long one sent at once
  is refused the same (and a target over the 65,535 bytes httptools parses is named in the
  envelope);
* a head deadline: a head must be complete within `header_timeout_s` of the connection opening
  (or of the read that started it); else 408 `request_timeout` (or, if nothing was sent yet, a
  plain close). The same deadline closes a connection still dripping the body of a request
  that was already answered;
* `max_connections`: uvicorn's own `limit_concurrency` check (open connections, or requests in
  progress), answered in the error envelope (503 `too_busy`) instead of plain text;
* `max_client_connections`: the connections of one client address (a trusted proxy's
  excepted), counted as they open: one over it is answered 503 `too_busy` at once and closed.
  Without it one address opening ≈ 1,100 connections that never finish their heads, each
  opened again as the head deadline closed it, had every other client (the box's own web page
  too) answered 503.

* a stall deadline for the change feeds (`watch_stalls`, which a feed's answer asks for
  through the scope extension `metrics.STALL_WATCH`): a client that takes no byte of its
  stream for `feed_stall_s` while the stream has bytes waiting for it (its socket's buffers
  full) is disconnected, with a reset that frees them at once. A feed never ends by itself,
  so without it a consumer that stopped reading held its connection, 3.9 MB of kernel
  socket queue on loopback and the stream's own buffer, for as long as its host lived; the
  feed is resumable, so the client, when it comes back, continues from its last id.

Bodies have their own deadline, `body_timeout_s`, in `bodies.read_body`. h11, uvicorn's other
parser, has a head limit built in but cost a measurable share of the read rate
(docs/benchmarks.md, "HTTP edge"); the httptools subclass did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import ipaddress
import logging
import resource
import signal
import socket
import struct
import termios
import typing
from collections import Counter
from types import FrameType
from typing import Any, ClassVar

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from metanode.api import error_response
from metanode.config import Network, Settings
from metanode.errors import HeadersTooLarge, MetanodeError, RequestError, RequestTimeout, TooBusy
from metanode.metrics import STALL_WATCH

log = logging.getLogger(__name__)
# The longest request target httptools parses (`parse_url` keeps offsets in 16 bits): uvicorn
# answered a longer one "Invalid HTTP request received."
MAX_TARGET = 65_535
STARTUP_FAILURE = 3  # the status `uvicorn.run` exits with when the server did not start
STALL_CHECKS = 4  # a stalled stream is looked at this often within `feed_stall_s`
RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets and drops what is queued


class Stalls(typing.Protocol):
    """Told of a watched response's stalls (`metrics.FeedStalls`)."""

    def stalled(self) -> None: ...

    def cleared(self) -> None: ...

    def cut(self) -> None: ...


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head size limit, a head deadline and enveloped
    refusals. The limits are class attributes, set by `protocol_for`."""

    max_header_bytes: ClassVar[int]
    header_timeout_s: ClassVar[float]
    max_connections: ClassVar[int]
    max_client_connections: ClassVar[int]
    feed_stall_s: ClassVar[float]
    proxies: ClassVar[tuple[Network, ...]]  # their connections carry many clients: not counted
    per_client: ClassVar[Counter[str]]  # the open connections of each client address
    over: ClassVar[set[str]]  # the addresses refused since they last had none open (logged once)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # checked by `on_headers_complete`, answered as envelope
        self.node_app = self.app
        self.in_head = False  # between a request's first byte and the end of its headers
        self.head_bytes = 0
        self.head_start = 0  # length of the read the head began in
        self.reading = 0  # length of the read being parsed (see `on_message_begin`)
        self.head_timer: asyncio.TimerHandle | None = None
        self.counted: str | None = None  # the client address this connection counts for
        self.stalls: Stalls | None = None  # the watched response's (`watch_stalls`)
        self.stall_timer: asyncio.TimerHandle | None = None  # set while it is stalled
        self.buffered = 0  # bytes waiting for the client at the last look (`_look`)
        self.moved_at = 0.0  # when the client last took any (loop time)
        self.extensions = {STALL_WATCH: self.watch_stalls}  # every request's, one dict

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else None  # None: a Unix socket (`--workers`)
        if host is not None and not self._proxy(host):
            self.counted = host
            self.per_client[host] += 1
            if self.per_client[host] > self.max_client_connections:
                self._too_many(host)
                return
        self._arm()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstalled()
        if self.counted is not None:
            self.per_client[self.counted] -= 1
            if not self.per_client[self.counted]:
                del self.per_client[self.counted]
                self.over.discard(self.counted)
        super().connection_lost(exc)

    def _proxy(self, host: str) -> bool:
        if not self.proxies:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.proxies)

    def _too_many(self, host: str) -> None:
        """A connection over `max_client_connections`: 503 `too_busy` before its request (it
        may never send one), closed; said once until that address has none open."""
        if host not in self.over:
            self.over.add(host)
            log.warning(
                "%s is over max_client_connections (%d): its further connections answered 503",
                host,
                self.max_client_connections,
            )
        self.transport.write(self._raw(TOO_BUSY))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        """Parse, then count the read if the head is still incomplete. Counting after the
        parse buffers at most one read (≤ 256 KiB) past the limit. A head that ends within the
        read is measured by `on_headers_complete` instead, which holds it whole."""
        if self.transport.is_closing():
            return
        self.reading = len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.in_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.max_header_bytes:
                self._refuse(
                    HeadersTooLarge(
                        f"request line and headers are over {self.max_header_bytes} bytes"
                    )
                )
                return
        if self.head_timer is None and (self.in_head or self._draining()):
            self._arm()

    def _draining(self) -> bool:
        """The rest of a body nobody reads any more (the answer is out): each byte of it would
        cancel uvicorn's keep-alive timer, so a drip could hold the connection forever."""
        return self.cycle is not None and self.cycle.response_complete and self.cycle.more_body

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = self.extensions  # type: ignore[typeddict-item]
        self.in_head = True
        # The read that starts a head may end the previous request too: count only from the
        # next read, so a pipelined request is never refused for its predecessor's bytes.
        self.head_bytes = -self.reading
        self.head_start = self.reading

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._disarm()
        refusal = self._head_refusal()
        # `connections` counts this one, `tasks` the requests already running.
        busy = (
            len(self.connections) > self.max_connections or len(self.tasks) >= self.max_connections
        )
        if refusal is not None:
            log.warning("refused a request head: %s: %s", refusal.slug, refusal.message)
            self.url = b"/"  # uvicorn parses it next, and refuses a target over 65,535 bytes
            self.app = refusing(refusal)
        elif busy:
            log.warning("over max_connections (%d): answered 503", self.max_connections)
            self.app = too_busy
        else:
            self.app = self.node_app
        super().on_headers_complete()

    def _head_refusal(self) -> MetanodeError | None:
        """431 for a head over `max_header_bytes` that ended within a read (uncounted by
        `data_received`, so 70–140 KB heads arriving in one read were answered 200), or 400 for
        a target over `MAX_TARGET`. Free for an ordinary request: the head is at most as long
        as the reads it arrived in (the one it began in, those counted since and this one),
        and only when those pass a limit is the head itself measured."""
        arrived = self.head_start + self.head_bytes + self.reading
        if arrived <= min(self.max_header_bytes, MAX_TARGET):
            return None
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_header_bytes:
            return HeadersTooLarge(
                f"request line and headers are over {self.max_header_bytes} bytes"
            )
        if len(self.url) > MAX_TARGET:
            return RequestError(f"the request target is over {MAX_TARGET} bytes")
        return None

    def send_400_response(self, msg: str) -> None:
        """A request the parser cannot read: the envelope instead of uvicorn's plain text.

        When what it cannot read is the body of the request the app is answering (a chunk
        size `zz`, a `Transfer-Encoding: gzip`), the app has begun but answered nothing yet:
        the 400 is that request's answer (the connection had been closed without a word), and
        the app is told the client left, so its `receive` ends and whatever it sends is
        dropped. Not while an earlier pipelined response is still to be written."""
        cycle = self.cycle
        in_body = (
            cycle is not None
            and not self.in_head
            and not cycle.response_started
            and not self.pipeline
        )
        if cycle is not None and in_body:
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(RequestError(msg), answer=in_body)

    def _arm(self) -> None:
        self.head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.in_head:
            self._refuse(
                RequestTimeout(f"request headers not complete within {self.header_timeout_s:g} s")
            )
        elif (self.cycle is None or self._draining()) and not self.transport.is_closing():
            self.transport.close()  # never sent a byte, or answered already: nothing to say

    def watch_stalls(self, stalls: Stalls) -> None:
        """Watch the response being sent (a change feed's, which never ends by itself) until
        it completes: `stalls` is told when its writes wait for the client and when they go
        on; a client that takes no byte for `feed_stall_s` meanwhile is cut (`_cut`)."""
        self.stalls = stalls
        if self.flow.write_paused:
            self._stalled(stalls)

    def on_response_complete(self) -> None:
        self._unstalled()
        self.stalls = None
        super().on_response_complete()

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client is not keeping up."""
        super().pause_writing()
        if self.stalls is not None and self.stall_timer is None:
            self._stalled(self.stalls)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstalled()

    def _stalled(self, stalls: Stalls) -> None:
        stalls.stalled()
        self.buffered = self._waiting()
        self.moved_at = self.loop.time()
        self.stall_timer = self.loop.call_later(self.feed_stall_s / STALL_CHECKS, self._look)

    def _unstalled(self) -> None:
        if self.stall_timer is not None and self.stalls is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
            self.stalls.cleared()

    def _look(self) -> None:
        """A stalled stream's check: the client took some bytes since the last (what waits
        for it only shrinks while the stream's writes wait), or it is cut once it took none
        for `feed_stall_s`. A slow reader is not stuck: what it reads opens its TCP window,
        the kernel sends and the peer acknowledges, so the socket's queue shrinks (`unsent`)
        long before the kernel takes more of the transport's buffer."""
        waiting = self._waiting()
        now = self.loop.time()
        if waiting < self.buffered:
            self.buffered, self.moved_at = waiting, now
        elif now - self.moved_at >= self.feed_stall_s:
            self._cut(now - self.moved_at)
            return
        self.stall_timer = self.loop.call_later(self.feed_stall_s / STALL_CHECKS, self._look)

    def _waiting(self) -> int:
        """The bytes sent that the client has not taken: the transport's buffer and the
        socket's kernel queue."""
        return self.transport.get_write_buffer_size() + unsent(self.transport)

    def _cut(self, still_s: float) -> None:
        """Disconnect a client that stopped reading: a reset (`SO_LINGER` 0), so the kernel
        drops its queue at once; a plain close would wait, forever, to send it first. Whatever
        the client did not read it gets again when it resumes from its last id."""
        stalls = self.stalls
        self._unstalled()
        if stalls is not None:
            stalls.cut()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a local client"
        log.warning(
            "cut the change feed of %s: it took no byte for %.1f s (feed_stall_s %g); it "
            "resumes from its last id when it comes back",
            client,
            still_s,
            self.feed_stall_s,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
        self.transport.abort()

    def _refuse(self, exc: MetanodeError, answer: bool = False) -> None:
        """Answer `exc` in the envelope and close, unless a response of an earlier (pipelined)
        request is still being written (and `answer` does not say it was taken over): then
        only close."""
        self._disarm()
        self.in_head = False
        if answer or self.cycle is None or self.cycle.response_complete:
            log.warning("refused a request head: %s: %s", exc.slug, exc.message)
            self.transport.write(self._raw(exc))
        self.transport.close()

    def _raw(self, exc: MetanodeError) -> bytes:
        """`exc` as a complete HTTP/1.1 response with `Connection: close`."""
        response = error_response(exc)
        headers = [*self.server_state.default_headers, *response.raw_headers]
        if (b"connection", b"close") not in headers:  # a 408 says it already
            headers.append((b"connection", b"close"))
        lines = [
            STATUS_LINE[exc.status],
            *(name + b": " + value + b"\r\n" for name, value in headers),
        ]
        return b"".join([*lines, b"\r\n", response.body])


def unsent(transport: asyncio.Transport) -> int:
    """The bytes in the kernel's send queue of the transport's socket, not yet acknowledged by
    the peer (Linux's `SIOCOUTQ`); 0 where that cannot be asked."""
    sock = transport.get_extra_info("socket")
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (AttributeError, OSError):
        return 0
    return int(struct.unpack("i", queued)[0])


def refusing(exc: MetanodeError) -> ASGIApp:
    """The ASGI app that answers `exc` in the envelope and closes the connection."""

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(exc)
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    return refuse


# The refusal of a request over `max_connections` (logged where it is chosen), and its app.
TOO_BUSY = TooBusy("too many connections or requests at once; retry")
too_busy = refusing(TOO_BUSY)


def protocol_for(settings: Settings) -> type[BoundedHttpTools]:
    """`BoundedHttpTools` with the limits of `settings` (uvicorn builds it from the class)."""

    class Protocol(BoundedHttpTools):
        max_header_bytes = settings.max_header_bytes
        header_timeout_s = settings.header_timeout_s
        max_connections = settings.max_connections
        max_client_connections = settings.max_client_connections
        feed_stall_s = settings.feed_stall_s
        proxies = settings.proxies
        per_client: ClassVar[Counter[str]] = Counter()
        over: ClassVar[set[str]] = set()

    return Protocol


def hung_up(server: uvicorn.Server, frame: FrameType | None) -> None:
    """SIGHUP (the terminal `serve` ran in closed, a `kill -HUP` meant as "reload"): a clean
    stop, as for SIGTERM, said in the log. uvicorn handles only SIGINT and SIGTERM, so SIGHUP
    killed the node outright: no line in the log, feeds cut, MetaMesh's lock file left."""
    log.warning(HUNG_UP)
    server.handle_exit(signal.SIGTERM, frame)


HUNG_UP = "SIGHUP: stopping as for SIGTERM (settings are read at start: start again for new ones)"


class FrozenAfterStart(uvicorn.Server):
    """uvicorn's server, with what its start made moved out of the garbage collector's reach
    (`gc.freeze`) once it started (the lifespan's startup, the sockets): the modules, routes
    and stores live as long as the process, and a full collection walked all of them again,
    ≈ 80,000 objects, 28–48 ms with every request waiting, about twice a minute under read
    load; after the freeze ≈ 1 ms (docs/benchmarks.md, "Session 25"). Garbage is collected
    first, so nothing that is garbage now is kept; no request pays for it."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            gc.collect()
            gc.freeze()


# The descriptors a process needs besides its connections: truth.db and cache.db with their
# -wal and -shm, the readers' connections, inotify, the files being hashed, plugins, peers.
SPARE_FILES = 128
# The open-file limit `raise_open_files` asks for, within the hard limit: connections over
# `max_connections` are open descriptors too until they are answered 503 or time out.
OPEN_FILES = 1 << 16


def raise_open_files(max_connections: int) -> None:
    """Raise this process's open-file limit (the soft `ulimit -n`, which its workers inherit)
    to `OPEN_FILES` within the hard limit, as Go's runtime does; warn if even that is below
    what `max_connections` needs.

    systemd's services and containerd 2's containers start with a soft limit of 1,024 (and a
    hard one far above), below `max_connections` (1,024) and the databases: the descriptors
    ran out first, so a new connection got no 503 `too_busy` but waited unanswered or was
    reset, `/health` too, and the watcher could neither open files nor inotify
    (docs/operations.md, "Connections and slow clients")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    need = max_connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning(
            "the open-file limit (ulimit -n) is %d, below the %d that max_connections (%d) "
            "needs: past about %d connections new ones wait unanswered and the watcher cannot "
            "open files; raise the hard limit (systemd's LimitNOFILE, docker's --ulimit "
            "nofile) or lower max_connections",
            soft,
            need,
            max_connections,
            max(soft - SPARE_FILES, 0),
        )


def run(app: ASGIApp, settings: Settings, sockets: list[socket.socket] | None = None) -> None:
    """Serve `app` until SIGINT/SIGTERM/SIGHUP, on `sockets` if given (the one `serve` bound
    before it said it serves, or a worker's, workers.py); exit like `uvicorn.run` if the server
    never started."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=10,
        access_log=False,
        log_config=None,
        http=protocol_for(settings),
        # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: a local client could then
        # claim any address, trusted ones included. Only the configured proxies are believed.
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=[str(network) for network in settings.proxies],
    )
    server = FrozenAfterStart(config)
    signal.signal(signal.SIGHUP, lambda signum, frame: hung_up(server, frame))
    server.run(sockets=sockets)
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
