"""A TCP proxy that makes a link bad on purpose: between a follower and its peer it adds latency,
throttles what the peer sends, cuts connections mid-answer, stalls, or partitions the two.

Peers are followed over home links and the Internet, not loopback: what a follower does when
an answer comes at 5 KB/s or stops halfway is only seen through such a link. The proxy runs its
own asyncio loop on a thread, so a synchronous test (real `metanode serve` processes) changes
its `faults` while traffic flows; each change holds from the next chunk forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Self

CHUNK = 1024  # bytes forwarded at a time: throttling and random cuts act on this grain


@dataclass
class Faults:
    """What the link does now (read at every chunk, so a test may change it any time)."""

    latency_s: float = 0.0  # added before each chunk, both ways
    down_bps: int = 0  # bytes a second from the peer to the follower (0: unlimited)
    cut_after: int = 0  # a connection is cut once this many bytes came down it (0: never)
    cut_chance: float = 0.0  # chance that each chunk coming down ends its connection instead
    stall: bool = False  # new connections are accepted and never answered
    partition: bool = False  # nothing passes either way, on old or new connections


@dataclass
class Counts:
    """What went through, for a test's figures."""

    connections: int = 0
    bytes_up: int = 0  # from the follower to the peer
    cuts: int = 0


@dataclass
class FaultProxy:
    """Listens on 127.0.0.1:`port` (0: any free one) and forwards to 127.0.0.1:`target`."""

    target: int
    port: int = 0
    faults: Faults = field(default_factory=Faults)
    counts: Counts = field(default_factory=Counts)
    seed: int = 0  # random cuts are reproducible
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        ready = threading.Event()
        self._random = random.Random(self.seed)
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the fault proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(30)

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", self.port)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One follower connection: held silent while stalled or partitioned, else joined to a
        connection of its own to the target, each way pumped until either side ends. Ended,
        both are reset, as a dropped NAT mapping or a modem gives."""
        self.counts.connections += 1
        sides = [writer]
        pumps: list[asyncio.Task[None]] = []
        try:
            while self.faults.stall or self.faults.partition:  # a stall holds it for good
                if self.faults.stall:
                    await asyncio.Event().wait()
                await asyncio.sleep(0.05)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
            sides.append(up_writer)
            pumps = [
                asyncio.ensure_future(self._pump(up_reader, writer, down=True)),
                asyncio.ensure_future(self._pump(reader, up_writer, down=False)),
            ]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except OSError:
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            for side in sides:
                side.transport.abort()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, down: bool
    ) -> None:
        sent = 0
        free_at = time.monotonic()  # when the throttled link may carry the next chunk
        while chunk := await source.read(CHUNK):
            faults = self.faults
            while self.faults.partition:
                await asyncio.sleep(0.05)
            if faults.latency_s:
                await asyncio.sleep(faults.latency_s)
            if down and self._cut(sent + len(chunk)):
                self.counts.cuts += 1
                return
            if down and faults.down_bps:  # a strict rate, no burst after an idle keep-alive
                free_at = max(free_at, time.monotonic()) + len(chunk) / faults.down_bps
                await asyncio.sleep(free_at - time.monotonic())
            sink.write(chunk)
            await sink.drain()
            sent += len(chunk)
            if not down:
                self.counts.bytes_up += len(chunk)
        while self.faults.partition:  # nor does an end: the other side never hears of it
            await asyncio.sleep(0.05)
        with contextlib.suppress(OSError):
            sink.write_eof()

    def _cut(self, sent: int) -> bool:
        faults = self.faults
        if faults.cut_after and sent > faults.cut_after:
            return True
        return bool(faults.cut_chance) and self._random.random() < faults.cut_chance
