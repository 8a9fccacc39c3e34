"""HTTP-edge benchmark: what one huge request head does to everybody else.

Run: `.venv/bin/python tools/bench/edge.py [--mib 100]`.

A real `metanode serve` (watcher and plugins off) on a fresh data directory. One raw socket
sends `GET /health` with a single `X-Big` header of `--mib` MiB, as fast as loopback takes it,
then reads whatever answer comes. Meanwhile a second client (one keep-alive httpx connection)
asks `GET /health` back to back until the big sender is done. Reported: how the big request
ended (its status line, or the send cut off by the server closing), how many answers the other
client got while it ran and their latency (p50, max), and the server's peak RSS (VmHWM) before
and after. Run it with the `.venv` of an older checkout to measure the code before a change:
the script only needs `harness` next to it.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness
import httpx

CHUNK = 64 * 1024


@dataclass
class BigSender:
    """The hostile connection: one request head of `size` bytes."""

    port: int
    size: int
    outcome: str = "?"
    sent: int = 0
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        started = time.monotonic()
        try:
            with socket.create_connection((harness.HOST, self.port), timeout=120) as sock:
                self.outcome = self._send(sock)
        finally:
            self.seconds = time.monotonic() - started
            self.done.set()

    def _send(self, sock: socket.socket) -> str:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nX-Big: ")
        filler = b"a" * CHUNK
        try:
            while self.sent < self.size:
                sock.sendall(filler)
                self.sent += CHUNK
            sock.sendall(b"\r\n\r\n")
        except OSError as exc:  # the server closed on us: read what it said first
            answer = _read_answer(sock)
            return f"cut off after {self.sent / 2**20:.1f} MiB ({type(exc).__name__}): {answer}"
        return f"sent whole: {_read_answer(sock)}"


def _read_answer(sock: socket.socket) -> str:
    try:
        data = sock.recv(4096)
    except OSError as exc:
        return f"no answer ({type(exc).__name__})"
    return data.split(b"\r\n", 1)[0].decode("latin-1") if data else "closed, no answer"


def other_client(url: str, done: threading.Event, least: int = 20) -> list[float]:
    """Latencies (s) of back-to-back GET /health until `done` is set (at least `least`)."""
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        while not done.is_set() or len(latencies) < least:
            started = time.monotonic()
            if client.get("/health").status_code != 200:
                raise RuntimeError("GET /health did not answer 200")
            latencies.append(time.monotonic() - started)
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mib", type=int, default=100, help="size of the big header, MiB")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="metanode-edge-") as tmp:
        data_dir = Path(tmp) / "data"
        with harness.metanode_server(
            data_dir, METANODE_WATCH_ENABLED="false", METANODE_PLUGINS_ENABLED="false"
        ) as server:
            before = server.rss_mib("VmHWM")
            sender = BigSender(server.port, args.mib * 2**20)
            thread = threading.Thread(target=sender.run, daemon=True)
            thread.start()
            latencies = other_client(server.url, sender.done)
            thread.join()
            after = server.rss_mib("VmHWM")
    latencies.sort()
    print(f"big header ({args.mib} MiB): {sender.outcome}, {sender.seconds:.2f} s")
    p50, worst = statistics.median(latencies) * 1000, latencies[-1] * 1000
    print(
        f"other client: {len(latencies)} answers (at least 20, and until the big sender "
        f"was done), p50 {p50:.1f} ms, max {worst:.1f} ms"
    )
    print(f"server peak RSS: {before:.0f} MiB before, {after:.0f} MiB after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
