"""Change-feed benchmark: delivery latency with 1, 10 and 100 subscribers, and what subscribers
cost ingest.

Run: `.venv/bin/python tools/bench/feed.py [--rate 1000] [--duration 5] [--subscribers 1,10,100]
[--throughput-claims 30000] [--rounds 5] [--stalled 10] [--stream events|meta] [--workers N]`.

`--workers N` (default 1) runs every server as `metanode serve --workers N`: the subscribers'
connections land on whichever worker the kernel gives them (readers serve the feed from their
follower, workers.py), the POSTs too (a reader hands them to the owner); server CPU is then the
supervisor's and all its workers'.

Every measurement uses a fresh data directory in a temporary directory and a real
`metanode serve` (uvicorn) on a free loopback port, started through `harness.metanode_server`
(watcher and plugins off: they would idle anyway). One signer is registered through the API and
`--records` (default 1,000) records are created untimed, each by a `title` claim on its own
midhash CID. Every timed claim then sets `title` on one of those records to a new, unique value
(`v0000042`) with a newer ts, so each accepted claim is exactly one `set` event, recognisable by
its value. All claims are signed and serialised before anything is timed.

Subscribers are raw asyncio TCP connections (HTTP/1.1 `GET /api/events`, live only, no filter;
with `--stream meta`, MetaMesh's `GET /api/events/meta` instead, docs/compat.md)
in a separate process, so their reading does not share an event loop or a GIL with the poster;
each connection records, per value, the `time.perf_counter()` (CLOCK_MONOTONIC, the same clock
in both processes) at which the bytes holding that event arrived (a regex over the received
bytes, no full SSE parse, to keep the readers cheap). The meta stream carries no value, so there
the i-th `set` event is the i-th timed claim: batches are posted one after another, each applied
before the next is sent, so each event is matched to its own claim's batch. Every subscriber must
receive every event.

1. **Latency** (per subscriber count): the poster paces batches of `--batch` (default 20) claims
   every `batch / rate` seconds (20 every 20 ms = 1,000 claims/s) for `--duration` seconds,
   one POST at a time on one keep-alive connection; a batch that comes back late makes the next
   start late, so the achieved rate is printed too. Latency of one claim at one subscriber =
   time the event arrived - time the POST answered 200 (the claim acknowledged). It can be
   negative: the feed is published when the cache commits, just before the POST's answer. Also
   printed: event arrival - POST sent. p50/p99/max over every (claim, subscriber) pair.
2. **Ingest throughput with 100 subscribers ÷ with none** (goal ≥ 0.8): `--throughput-claims`
   (default 30,000) claims in batches of 500 posted back to back by two clients (as `ingest.py`
   does), once with no subscriber and once with `--throughput-subscribers` (default 100)
   connected and reading every event. Here each subscriber only counts the `event: set` markers
   it receives, so that the subscribers' process, on the same CPUs, takes as little as it can
   from the server it measures. Fresh servers; the order rotates over `--rounds` (default 5)
   rounds; the ratio is the median of the per-round ratios. Every POST must answer 200 with all
   claims accepted, and every subscriber must count every event.
3. **Ingest throughput with stalled subscribers ÷ with none** (goal ≥ 0.8, the allowance the
   feed tests refer to): the same, once more per round, with `--stalled` (default 10)
   subscribers that send their request and then never read (a 4 KiB receive buffer), so the
   server's writes to them block after a few hundred KB.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.synchronize
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import httpx
import nacl.signing

from metanode import cid as cids
from metanode import claims
from metanode.clock import now_ms

GOAL = 0.8
VALUE = re.compile(rb'"value":"v([0-9]{7})"')
SET_MARK = b"\nevent: set\n"
STREAMS = {"events": "/api/events", "meta": "/api/events/meta"}
SERVER_ENV = {"METANODE_WATCH_ENABLED": "false", "METANODE_PLUGINS_ENABLED": "false"}
SUBSCRIBE_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 120.0


# -- claims ---------------------------------------------------------------------------------


@dataclass
class Workload:
    """Pre-signed bodies: the records to create, then the timed updates (one event each)."""

    setup: list[bytes]
    bodies: list[bytes]  # timed batches, in order
    sizes: list[int]


def sign_updates(
    key: nacl.signing.SigningKey, records: int, count: int, batch: int, ts: int
) -> Workload:
    uid = claims.uid_of(bytes(key.verify_key))
    pool = [cids.midhash_bytes(f"feed bench {i}".encode()) for i in range(records)]

    def signed(cid: str, value: str, when: int) -> claims.Claim:
        sig = key.sign(claims.signing_bytes(uid, cid, "title", value, when)).signature
        return claims.Claim(uid, cid, "title", value, when, sig)

    made = [signed(cid, "initial", ts) for cid in pool]
    setup = [harness.claims_body(made[i : i + 500]) for i in range(0, len(made), 500)]
    updates = [signed(pool[i % records], f"v{i:07d}", ts + 1 + i // records) for i in range(count)]
    bodies = [harness.claims_body(updates[i : i + batch]) for i in range(0, count, batch)]
    sizes = [len(updates[i : i + batch]) for i in range(0, count, batch)]
    return Workload(setup, bodies, sizes)


# -- subscribers (a separate process) -------------------------------------------------------


def _request(path: str, token: str) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: {harness.HOST}\r\n"
        f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()


async def _subscribe(
    port: int, token: str, path: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(harness.HOST, port)
    writer.write(_request(path, token))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"GET {path} answered {head[:200]!r}")
    return reader, writer


async def _read(
    reader: asyncio.StreamReader, times: list[float], total: int, done: asyncio.Event
) -> None:
    """Record when each value first arrives; the bytes after the last complete frame are kept
    for the next read (each HTTP chunk holds whole frames, so no chunk header is inside one)."""
    clock = time.perf_counter
    pending = b""
    received = 0
    while received < total:
        data = await reader.read(1 << 16)
        if not data:
            raise RuntimeError("the server closed a feed stream")
        now = clock()
        pending += data
        cut = pending.rfind(b"\n\n") + 2
        for match in VALUE.finditer(pending, 0, cut):
            index = int(match.group(1))
            if index < total and times[index] != times[index]:  # NaN: first arrival
                times[index] = now
                received += 1
        pending = pending[cut:]
    done.set()


async def _read_in_order(
    reader: asyncio.StreamReader, times: list[float], total: int, done: asyncio.Event
) -> None:
    """`_read` for the meta stream, which carries no value: the i-th `set` event is the i-th
    timed claim (see the module docstring)."""
    clock = time.perf_counter
    tail, received = b"", 0
    while received < total:
        data = await reader.read(1 << 16)
        if not data:
            raise RuntimeError("the server closed a feed stream")
        now = clock()
        window = tail + data
        arrived = min(window.count(SET_MARK), total - received)
        times[received : received + arrived] = [now] * arrived
        received += arrived
        tail = window[1 - len(SET_MARK) :]
    done.set()


async def _count(
    reader: asyncio.StreamReader, times: list[float], total: int, done: asyncio.Event
) -> None:
    """Count `set` events until `total` have arrived; the last one's arrival goes in `times`.

    For the throughput runs: far cheaper than `_read`, so the subscribers' process (on the same
    CPUs) takes less from the server it measures. A marker split across two reads is counted
    once: the carried tail is one byte shorter than the marker.
    """
    tail, received = b"", 0
    while received < total:
        data = await reader.read(1 << 16)
        if not data:
            raise RuntimeError("the server closed a feed stream")
        window = tail + data
        received += window.count(SET_MARK)
        tail = window[1 - len(SET_MARK) :]
    times[-1] = time.perf_counter()
    done.set()


async def _run_subscribers(
    port: int,
    token: str,
    path: str,
    count: int,
    total: int,
    timed: bool,
    ready: multiprocessing.synchronize.Event,
    posted: multiprocessing.synchronize.Event,
) -> list[list[float]]:
    streams = [await _subscribe(port, token, path) for _ in range(count)]
    times = [[float("nan")] * total for _ in range(count)]
    flags = [asyncio.Event() for _ in range(count)]
    read = (_read if path == STREAMS["events"] else _read_in_order) if timed else _count
    tasks = [
        asyncio.create_task(read(r, t, total, f))
        for (r, _), t, f in zip(streams, times, flags, strict=True)
    ]
    ready.set()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, posted.wait)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_TIMEOUT_S)
    except TimeoutError:
        missing = sum(1 for flag in flags if not flag.is_set())
        raise RuntimeError(
            f"{missing} subscribers still miss events {DRAIN_TIMEOUT_S:.0f} s after the last post"
        ) from None
    for _, writer in streams:
        writer.close()
    return times


def subscriber_process(
    port: int,
    token: str,
    path: str,
    count: int,
    total: int,
    timed: bool,
    ready: multiprocessing.synchronize.Event,
    posted: multiprocessing.synchronize.Event,
    out: Any,
) -> None:
    """Entry point of the subscriber process: its arrival times (or an error) go to `out`."""
    try:
        out.put(
            (
                "ok",
                asyncio.run(
                    _run_subscribers(port, token, path, count, total, timed, ready, posted)
                ),
            )
        )
    except BaseException as exc:  # reported by the parent
        ready.set()
        out.put(("error", repr(exc)))


class Subscribers:
    """`count` subscribers in their own process, connected before the poster starts; `timed`:
    each records every event's arrival, else each only counts events."""

    def __init__(
        self,
        server: harness.ServerProc,
        data_dir: Path,
        path: str,
        count: int,
        total: int,
        timed: bool,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready, self.posted = ctx.Event(), ctx.Event()
        self.out = ctx.Queue()
        self.proc = ctx.Process(
            target=subscriber_process,
            daemon=True,
            args=(
                server.port,
                harness.token(data_dir),
                path,
                count,
                total,
                timed,
                self.ready,
                self.posted,
                self.out,
            ),
        )
        self.proc.start()
        if not self.ready.wait(SUBSCRIBE_TIMEOUT_S):
            self.proc.kill()
            raise RuntimeError(f"{count} subscribers did not connect in {SUBSCRIBE_TIMEOUT_S} s")

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def finish(self) -> list[list[float]]:
        """Tell them everything was posted; their arrival times once each has every event."""
        self.posted.set()
        try:
            status, payload = self.out.get(timeout=DRAIN_TIMEOUT_S + 30)
        finally:
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()
        if status != "ok":
            raise RuntimeError(f"subscriber process failed: {payload}")
        result: list[list[float]] = payload
        return result


@contextmanager
def stalled_subscribers(port: int, token: str, path: str, count: int) -> Iterator[None]:
    """`count` connections that subscribe (live, no filter) and then never read."""
    request = _request(path, token)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((harness.HOST, port))
            sock.sendall(request)
        yield
    finally:
        for sock in sockets:
            sock.close()


# -- posting --------------------------------------------------------------------------------


async def post_paced(
    url: str,
    headers: dict[str, str],
    bodies: Sequence[bytes],
    sizes: Sequence[int],
    interval: float,
) -> tuple[list[float], list[float], float]:
    """One POST per `interval` (or later, if the previous one is late); (sent, acked, wall)."""
    sent, acked = [], []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        await client.get("/health")
        start = time.perf_counter()
        for n, (body, size) in enumerate(zip(bodies, sizes, strict=True)):
            delay = start + n * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent.append(time.perf_counter())
            r = await client.post("/api/claims", content=body)
            acked.append(time.perf_counter())
            if r.status_code != 200 or r.json().get("accepted") != size:
                raise RuntimeError(f"POST /api/claims: {r.status_code} {r.text[:300]}")
        wall = time.perf_counter() - start
    return sent, acked, wall


@contextmanager
def prepared_server(
    tmp: Path, name: str, key: nacl.signing.SigningKey, work: Workload, workers: int
) -> Iterator[tuple[harness.ServerProc, Path]]:
    """A fresh server of `workers` processes with the signer registered and the records
    created (untimed)."""
    data_dir = tmp / name / "data"
    data_dir.parent.mkdir(parents=True)
    env = {**SERVER_ENV, "METANODE_WORKERS": str(workers)}
    with harness.metanode_server(data_dir, **env) as server:
        harness.register_signer(server, data_dir, key)
        harness.post_all(server, data_dir, work.setup)
        yield server, data_dir


# -- the two measurements -------------------------------------------------------------------


@dataclass
class Latency:
    subscribers: int
    claims: int
    achieved_rate: float
    ack_ms: list[float]  # sorted
    sent_ms: list[float]  # sorted
    cpu: str

    def row(self) -> str:
        def p(values: list[float], pct: float) -> str:
            return f"{harness.percentile(values, pct):.1f}"

        return (
            f"| {self.subscribers} | {self.achieved_rate:,.0f}/s | "
            f"{p(self.ack_ms, 50)} | {p(self.ack_ms, 99)} | {self.ack_ms[-1]:.1f} | "
            f"{p(self.sent_ms, 50)} | {p(self.sent_ms, 99)} | {self.cpu} |"
        )


def measure_latency(
    tmp: Path,
    key: nacl.signing.SigningKey,
    work: Workload,
    path: str,
    subscribers: int,
    interval: float,
    workers: int,
) -> Latency:
    total = sum(work.sizes)
    with prepared_server(tmp, f"latency-{subscribers}", key, work, workers) as (srv, data_dir):
        readers = Subscribers(srv, data_dir, path, subscribers, total, timed=True)
        headers = {**harness.auth(data_dir), "Content-Type": "application/json"}
        with (
            harness.CpuMeter(srv.pid, tree=True) as meter,
            harness.CpuMeter(readers.pid) as reading,
        ):
            sent, acked, wall = asyncio.run(
                post_paced(srv.url, headers, work.bodies, work.sizes, interval)
            )
        times = readers.finish()
    index_batch = [b for b, size in enumerate(work.sizes) for _ in range(size)]
    ack_ms, sent_ms = [], []
    for per_sub in times:
        for index, arrived in enumerate(per_sub):
            batch = index_batch[index]
            ack_ms.append((arrived - acked[batch]) * 1e3)
            sent_ms.append((arrived - sent[batch]) * 1e3)
    cpu = (
        f"{meter.total / meter.wall:.2f} cores (subscribers' process "
        f"{reading.total / reading.wall:.2f})"
    )
    return Latency(subscribers, total, total / wall, sorted(ack_ms), sorted(sent_ms), cpu)


@dataclass
class Throughput:
    rate: float  # claims/s
    server_cores: float
    reader_cores: float  # the subscribers' process, over the same time


def measure_throughput(
    tmp: Path,
    key: nacl.signing.SigningKey,
    work: Workload,
    path: str,
    name: str,
    subscribers: int,
    stalled: int,
    workers: int,
    profile: Path | None = None,
) -> Throughput:
    total = sum(work.sizes)
    with (
        prepared_server(tmp, name, key, work, workers) as (srv, data_dir),
        stalled_subscribers(srv.port, harness.token(data_dir), path, stalled),
    ):
        readers = (
            Subscribers(srv, data_dir, path, subscribers, total, timed=False)
            if subscribers
            else None
        )
        headers = {**harness.auth(data_dir), "Content-Type": "application/json"}
        with (
            harness.py_spy(srv.pid, profile),
            harness.CpuMeter(srv.pid, tree=True) as meter,
            harness.CpuMeter(readers.pid if readers else os.getpid()) as reading,
        ):
            elapsed = asyncio.run(
                harness.post_batches(srv.url, headers, work.bodies, work.sizes, clients=2)
            )
        if readers is not None:
            readers.finish()  # every subscriber got every event
    return Throughput(
        total / elapsed, meter.total / meter.wall, reading.total / reading.wall if readers else 0.0
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rate", type=float, default=1_000.0, help="claims/s (default 1000)")
    parser.add_argument("--batch", type=int, default=20, help="claims per paced POST (20)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of paced posting")
    parser.add_argument("--subscribers", default="1,10,100", help="counts (default 1,10,100)")
    parser.add_argument("--records", type=int, default=1_000, help="records updated (1000)")
    parser.add_argument("--throughput-claims", type=int, default=30_000)
    parser.add_argument("--throughput-subscribers", type=int, default=100)
    parser.add_argument(
        "--stalled",
        type=int,
        default=10,
        help="subscribers that never read, for the third measurement (10)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds (default 5)")
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="OUT",
        help="sample the server of the last run with subscribers (py-spy raw "
        "output to OUT) and print where its time went",
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument(
        "--workers", type=int, default=1, help="serve --workers N for every server (default 1)"
    )
    parser.add_argument(
        "--stream",
        choices=sorted(STREAMS),
        default="events",
        help="the stream subscribed to: /api/events (default) or MetaMesh's /api/events/meta",
    )
    args = parser.parse_args(argv)
    path = STREAMS[args.stream]

    key = nacl.signing.SigningKey.generate()
    ts = now_ms()
    paced = sign_updates(key, args.records, int(args.rate * args.duration), args.batch, ts)
    flat = sign_updates(key, args.records, args.throughput_claims, 500, ts)
    print(
        f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; "
        f"load average {os.getloadavg()[0]:.2f}; subscribers on {path}; "
        f"serve --workers {args.workers}"
    )
    with tempfile.TemporaryDirectory(prefix="metanode-bench-feed-") as tmp_name:
        tmp = Path(tmp_name)
        print(
            f"\nlatency, claim acknowledged -> event received, {args.batch} claims every "
            f"{args.batch / args.rate * 1e3:.0f} ms for {args.duration:g} s "
            f"({sum(paced.sizes):,} claims, one set event each):"
        )
        print(
            "| subscribers | achieved rate | p50 ms | p99 ms | max ms | sent->received p50 ms"
            " | p99 ms | server CPU |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
        for count in [] if args.skip_latency else [int(c) for c in args.subscribers.split(",")]:
            print(
                measure_latency(
                    tmp, key, paced, path, count, args.batch / args.rate, args.workers
                ).row(),
                flush=True,
            )

        print(
            f"\ningest throughput, {args.throughput_claims:,} claims in batches of 500, "
            f"2 clients: {args.throughput_subscribers} reading subscribers, and "
            f"{args.stalled} stalled ones, each vs none:"
        )
        reading, stalling = [], []
        for round_no in range(args.rounds):
            kinds = {
                "none": (0, 0),
                "reading": (args.throughput_subscribers, 0),
                "stalled": (0, args.stalled),
            }
            order = list(kinds)[round_no % 3 :] + list(kinds)[: round_no % 3]
            last = round_no == args.rounds - 1
            runs = {
                kind: measure_throughput(
                    tmp,
                    key,
                    flat,
                    path,
                    f"tp-{round_no}-{kind}",
                    *kinds[kind],
                    args.workers,
                    profile=args.py_spy if kind == "reading" and last else None,
                )
                for kind in order
            }
            none, some, stuck = runs["none"], runs["reading"], runs["stalled"]
            reading.append(some.rate / none.rate)
            stalling.append(stuck.rate / none.rate)
            print(
                f"round {round_no + 1}: none {none.rate:,.0f} claims/s (server "
                f"{none.server_cores:.2f} cores); {args.throughput_subscribers} reading "
                f"{some.rate:,.0f} claims/s (server {some.server_cores:.2f} cores, "
                f"subscribers' process {some.reader_cores:.2f}), ratio {reading[-1]:.2f}; "
                f"{args.stalled} stalled {stuck.rate:,.0f} claims/s, ratio {stalling[-1]:.2f}",
                flush=True,
            )
        if args.py_spy is not None:
            print(harness.profile_summary(args.py_spy))
        for what, ratios in (("reading subscribers", reading), ("stalled subscribers", stalling)):
            median = statistics.median(ratios)
            print(
                f"ratio with {what} (median): {median:.2f} (goal >= {GOAL}): "
                f"{'met' if median >= GOAL else 'NOT met'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
