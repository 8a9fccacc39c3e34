"""The write path of one-claim requests in lockstep, in one process, without HTTP.

Run: `.venv/bin/python tools/bench/lockstep.py [--claims 8000] [--clients 8] [--rounds 3]
[--batch 1] [--app]`.

`ingest.py --batch 1 --clients 8` measures the whole server, whose rate moves by up to 1.6×
between rounds on this VM (wrk, uvicorn and the node share two cores). This measures what
stands behind the event loop's HTTP: a started `Node` on a fresh data directory (uvloop, as
`metanode serve` runs), `--clients` coroutines each calling `Node.ingest_wire` with one wire
claim at a time and waiting for its answer (durable and applied: read-your-writes), as the
goal's clients do, so one group commit holds one claim of each. Reported per round: claims/s,
the lockstep cycle (a group's wall time), the batches a truth transaction held, how many of
those transactions the cache applied while their COMMIT ran (`metanode_applied_ahead_total`), and
claims/s ÷ one core's raw PyNaCl verify measured in the same round, before and after it (the
mean of the two: this machine's speed drifts within a run), and this process's CPU a claim
(the verify processes that batches of 64 claims or more go to run beside it). With `--rounds`
> 1, medians. `--batch 100` (with `--claims 30000`) is the same for batch-100 ingest, whose
writers compete for the GIL.

`--app`: each request goes through the node's real ASGI app instead (`api.create_app`: `Edge`,
the perimeter with the API token, the body read and parsed, the JSON answer), a `POST
/api/claims` scope with its body handed to the app whole, as uvicorn hands it over; only
uvicorn and the sockets are left out. Every answer must be 200. Reported in both modes: the
event loop's thread's CPU a request (`loop µs a request`). The three figures side by side
(`lockstep.py`, `--app`, `ingest.py --wrk`) split the HTTP server's share of a cycle into the
app's layers and uvicorn's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import harness
import ingest
import nacl.signing
import uvloop  # uvicorn[standard]'s loop, which `metanode serve` runs on
from prometheus_client.parser import text_string_to_metric_families

from metanode import claims
from metanode.api import create_app
from metanode.clock import now_ms
from metanode.node import Node


async def write_gauges(node: Node) -> tuple[float, float]:
    """(truth transactions that committed ingest batches, those the cache applied during their
    COMMIT), as `GET /metrics` reports them (`Node.metrics_text`)."""
    text = (await node.metrics_text()).decode()
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return values["metanode_ingest_groups_total"], values["metanode_applied_ahead_total"]


Post = Callable[[list[object]], Awaitable[None]]


def through_node(node: Node) -> Post:
    """A request as `Node.ingest_wire` of its wire claims: the write path behind the app."""

    async def post(items: list[object]) -> None:
        await node.ingest_wire(items)

    return post


def through_app(node: Node) -> Post:
    """A request as a `POST /api/claims` to the node's ASGI app (`--app`), body whole."""
    app = create_app(node)  # not started by its lifespan: the node already runs
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {node.token}".encode()),
    ]

    async def post(items: list[object]) -> None:
        body = json.dumps({"claims": items}).encode()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/api/claims",
            "raw_path": b"/api/claims",
            "query_string": b"",
            "root_path": "",
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        statuses: list[int] = []

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(scope, receive, send)
        if statuses != [200]:
            raise SystemExit(f"POST /api/claims answered {statuses}, not 200")

    return post


async def one_round(n: int, clients: int, batch: int, app: bool) -> dict[str, float]:
    """One round on a fresh node: the figures the module docstring lists."""
    key = nacl.signing.SigningKey.generate()
    signed = ingest.make_claims(key, n, now_ms(), "lockstep")
    wires: list[object] = [c.wire() for c in signed]
    batches = iter([wires[start : start + batch] for start in range(0, n, batch)])
    with tempfile.TemporaryDirectory(prefix="metanode-lockstep-") as tmp:
        node = Node(harness.bench_settings(Path(tmp) / "data"))
        await node.start()
        try:
            await node.add_signer(str(claims.uid_of(bytes(key.verify_key))), "bench", 1, False)
            before = ingest.raw_verify_rate(key, signed[:3000])
            groups, ahead = await write_gauges(node)

            post = (through_app if app else through_node)(node)

            async def client() -> None:
                for items in batches:
                    await post(items)

            start, cpu, loop = time.perf_counter(), time.process_time(), time.thread_time()
            await asyncio.gather(*(client() for _ in range(clients)))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            loop = time.thread_time() - loop
            raw = (before + ingest.raw_verify_rate(key, signed[:3000])) / 2
            groups_after, ahead_after = await write_gauges(node)
            transactions = groups_after - groups
            return {
                "claims/s": n / wall,
                "cycle ms": wall / transactions * 1000,
                "batches a transaction": n / batch / transactions,
                "CPU µs a claim": cpu / n * 1e6,  # this process's: not the verify processes'
                "loop µs a request": loop / (n / batch) * 1e6,
                "applied ahead": (ahead_after - ahead) / transactions,
                "ratio": n / wall / raw,
            }
        finally:
            await node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=8000, help="claims a round (default 8000)")
    parser.add_argument("--clients", type=int, default=8, help="coroutines (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, medians (default 3)")
    parser.add_argument("--batch", type=int, default=1, help="claims a request (default 1)")
    parser.add_argument(
        "--app", action="store_true", help="each request through the node's ASGI app"
    )
    args = parser.parse_args()
    rounds = []
    for number in range(1, args.rounds + 1):
        figures = uvloop.run(one_round(args.claims, args.clients, args.batch, args.app))
        rounds.append(figures)
        print(f"round {number}: " + ", ".join(f"{k} {v:,.3f}" for k, v in figures.items()))
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print("median: " + ", ".join(f"{k} {v:,.3f}" for k, v in medians.items()))
    goal = 0.1 if args.batch == 1 else 0.5  # issue 18's, for batches of 1 and of 100
    print(f"ratio {medians['ratio']:.3f} of one core's raw verify (issue 18's goal: {goal})")


if __name__ == "__main__":
    main()
