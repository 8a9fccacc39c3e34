"""Read benchmark: GET /api/meta/{cid} req/s of `metanode serve` against a bare Starlette app.

Run: `.venv/bin/python tools/bench/read.py [--records 2000] [--duration 5] [--rounds 3]`.

A fresh data directory in a temporary directory; `metanode serve` (uvicorn) on a free loopback
port; one signer registered through the API; `--records` records created by posting signed
claims (`--keys` claims per record: title, year, genre, …, each record about its own midhash
CID). The baseline is `tools/bench/bare_app.py`: one Starlette route `/api/meta/{cid}` answering
a small constant dict, run by uvicorn exactly as `metanode serve` runs its app (same uvicorn
version and arguments: loop/http "auto" = uvloop + httptools here, uvicorn's access log off,
the same logging set-up and log level; see that file). metanode writes its own access log line
per request at level info; `--log-level` sets both servers (default: metanode's own default,
info; `warning` silences metanode's access log). Both servers' output goes to a file in the
temporary directory.

Load client, the same for both servers: `wrk` if installed (`-t1 -c8 -dNs` and a Lua script
that asks for a random known CID on every request; the bare app gets the same paths), else an
asyncio httpx client with 8 connections for a fixed number of requests. Each round runs a 1 s
warm-up and then the timed run against each server (the order alternates between rounds); every
response must be 2xx. Reported: req/s of each (median over rounds), the ratio metanode / bare
(median of the per-round ratios; goal >= 0.6) and metanode's p50/p99 latency under that load
(median over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import httpx
import nacl.signing
from starlette.types import ASGIApp, Message, Scope

from metanode import cid as cids
from metanode import claims, config
from metanode.clock import now_ms

GOAL = 0.6
BARE_APP = Path(__file__).with_name("bare_app.py")

LUA = """
local cids = {%s}
math.randomseed(%d)
request = function()
  return wrk.format("GET", "/api/meta/" .. cids[math.random(#cids)])
end
""" + harness.WRK_DONE.replace("%", "%%")
Run = harness.Run


def populate(server: harness.ServerProc, data_dir: Path, records: int, keys: int) -> list[str]:
    """Register a signer and post `records` × `keys` signed claims; returns the records' CIDs."""
    key = nacl.signing.SigningKey.generate()
    harness.register_signer(server, data_dir, key)
    ts = now_ms()
    known = [cids.midhash_bytes(os.urandom(32)) for _ in range(records)]
    signed = [
        claims.sign(key, cid, name, f"{name} of record {i}", ts)
        for i, cid in enumerate(known)
        for name in harness.RECORD_KEYS[:keys]
    ]
    harness.post_all(
        server,
        data_dir,
        [harness.claims_body(signed[i : i + 1000]) for i in range(0, len(signed), 1000)],
    )
    return known


def write_lua(path: Path, known: list[str]) -> None:
    table = ",".join(f'"{c}"' for c in known)
    path.write_text(LUA % (table, random.randrange(1 << 30)), encoding="utf-8")


run_wrk = harness.run_wrk


async def _httpx_load(url: str, paths: list[str], connections: int) -> Run:
    latencies: list[float] = []
    failures: list[int] = []
    work = iter(paths)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as client:

        async def worker() -> None:
            for path in work:
                start = time.perf_counter()
                r = await client.get(path)
                latencies.append(time.perf_counter() - start)
                if r.status_code != 200:
                    failures.append(r.status_code)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"{len(failures)} non-200 answers, e.g. {failures[0]}")
    latencies.sort()
    return Run(
        len(paths) / elapsed,
        harness.percentile(latencies, 50) * 1e3,
        harness.percentile(latencies, 99) * 1e3,
        len(paths),
    )


def run_httpx(url: str, known: list[str], requests: int, connections: int) -> Run:
    rng = random.Random()
    paths = [f"/api/meta/{rng.choice(known)}" for _ in range(requests)]
    return asyncio.run(_httpx_load(url, paths, connections))


async def _asgi_get(app: ASGIApp, path: str) -> None:
    """One GET through an ASGI app in-process (no socket, no uvicorn); must answer 200."""
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    status: list[int] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"GET {path} answered {status}")


async def _breakdown(
    data_dir: Path, known: list[str], n: int, log_level: str
) -> list[tuple[str, float]]:
    """µs per request of the parts of GET /api/meta, in-process on the populated data dir.

    Logging is set up as `metanode serve` does it (JSON lines at `log_level`), into /dev/null.
    """
    import bare_app
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from metanode import cache, logs, ui
    from metanode.api import Edge, create_app
    from metanode.node import Node

    devnull = open(os.devnull, "w")  # noqa: SIM115  # closed in the finally below
    with contextlib.redirect_stderr(devnull):
        logs.configure(log_level, json_lines=True)  # its handler keeps the stream: /dev/null

    # The request path only: no watcher (it would watch ./media of the working directory) and
    # no plugins.
    node = Node(
        config.load(
            env={},
            overrides={"data_dir": data_dir, "watch_enabled": False, "plugins_enabled": False},
        )
    )
    await node.start()
    try:
        if not await node.applier.wait_for(0, 60):
            raise RuntimeError("the cache did not become ready")
        rng = random.Random()
        picks = [rng.choice(known) for _ in range(n)]
        resolved = {c: cids.normalise(c) for c in known}  # the spelling the cache holds

        def document_of(c: str) -> dict[str, Any]:
            group = node.cache.group_by_cid(resolved[c])
            assert group is not None, c
            return cache.document(group, c)

        docs = {c: node.meta(c) for c in known}
        app = create_app(node)

        async def meta_only(request: Request) -> Response:
            return JSONResponse(node.meta(request.path_params["cid"]))

        bare_meta = Starlette(routes=[Route("/api/meta/{cid}", meta_only)])
        bare_observe = Starlette(
            routes=[Route("/api/meta/{cid}", bare_app.meta)],
            middleware=[Middleware(Edge, node=node, sessions=ui.Sessions(node))],
        )
        bare_cors = Starlette(
            routes=[Route("/api/meta/{cid}", bare_app.meta)],
            middleware=[Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET"])],
        )
        sync_parts: list[tuple[str, Callable[[str], object]]] = [
            ("node.meta_bytes(cid) (the stored rendering, spliced)", node.meta_bytes),
            ("node.meta(cid)", node.meta),
            ("  node.resolve_cid (normalise, alias, lookup)", node.resolve_cid),
            ("    cid.alias alone (computed even on a hit)", cids.alias),
            ("  cache.group_by_cid + cache.document (one SELECT, rank)", document_of),
            ("JSONResponse(document)", lambda c: JSONResponse(docs[c])),
            ("JSONResponse(bare constant)", lambda c: JSONResponse(bare_app.BODY)),
        ]
        asgi_parts: list[tuple[str, ASGIApp]] = [
            ("metanode app, whole request in-process (ASGI)", app),
            ("bare app, whole request in-process (ASGI)", bare_app.app),
            ("bare app, route body = JSONResponse(node.meta(cid)) (ASGI)", bare_meta),
            ("bare app + CORSMiddleware (ASGI)", bare_cors),
            (
                f"bare app + metanode's Edge (access log at {log_level}, histogram) (ASGI)",
                bare_observe,
            ),
        ]
        best: dict[str, float] = {}
        for _ in range(3):  # passes interleave the parts; best of 3 each
            for label, fn in sync_parts:
                start = time.perf_counter()
                for c in picks:
                    fn(c)
                best[label] = min(best.get(label, math.inf), time.perf_counter() - start)
            for label, asgi in asgi_parts:
                start = time.perf_counter()
                for c in picks:
                    await _asgi_get(asgi, "/api/meta/" + c)
                best[label] = min(best.get(label, math.inf), time.perf_counter() - start)
        order = [label for label, _ in asgi_parts] + [label for label, _ in sync_parts]
        return [(label, best[label] / n * 1e6) for label in order]
    finally:
        await node.stop()
        logging.getLogger().handlers.clear()
        devnull.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=2_000, help="records (default 2000)")
    parser.add_argument("--keys", type=int, default=3, help="claims per record (default 3)")
    parser.add_argument("--client", choices=("auto", "wrk", "httpx"), default="auto")
    parser.add_argument("--duration", type=float, default=5.0, help="wrk seconds per run")
    parser.add_argument("--requests", type=int, default=20_000, help="httpx requests per run")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--log-level",
        default=config.Settings().log_level,
        help="log level of both servers (default: metanode's default)",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="OUT",
        help="after the rounds, one extra (unreported) metanode run sampled "
        "with py-spy; raw output to OUT",
    )
    harness.add_hot_documents(parser)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="afterwards, time the parts of a request in-process (no network)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.keys <= len(harness.RECORD_KEYS) or args.records < 1 or args.rounds < 1:
        parser.error(
            f"need --records >= 1, 1 <= --keys <= {len(harness.RECORD_KEYS)}, --rounds >= 1"
        )
    client = args.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "httpx"
    if client == "wrk" and not shutil.which("wrk"):
        parser.error("wrk is not installed (apt-get install wrk), use --client httpx")

    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        script = Path(tmp) / "paths.lua"
        bare_port = harness.free_port()
        bare = harness.ServerProc(
            [
                sys.executable,
                str(BARE_APP),
                "--port",
                str(bare_port),
                "--log-level",
                args.log_level,
            ],
            bare_port,
            cwd=Path(tmp),
            log_path=Path(tmp) / f"bare-{bare_port}.log",
        )
        with harness.metanode_server(
            data_dir,
            METANODE_LOG_LEVEL=args.log_level,
            METANODE_HOT_DOCUMENTS=str(args.hot_documents),
        ) as node:
            print(f"populating {args.records:,} records × {args.keys} claims …", flush=True)
            known = populate(node, data_dir, args.records, args.keys)
            doc = httpx.get(f"{node.url}/api/meta/{known[0]}", timeout=10)
            if doc.status_code != 200 or "title" not in doc.json()["metadata"]:
                raise RuntimeError(f"GET /api/meta answered {doc.status_code}: {doc.text[:300]}")
            write_lua(script, known)
            try:
                bare.start("/api/meta/x")

                def measure(url: str, seconds: float) -> Run:
                    if client == "wrk":
                        return run_wrk(url, script, seconds, args.connections, 1)
                    count = args.requests if seconds > 1 else args.requests // 5
                    return run_httpx(url, known, count, args.connections)

                runs: dict[str, list[Run]] = {"metanode": [], "bare": []}
                urls = {"metanode": node.url, "bare": bare.url}
                for r in range(args.rounds):
                    order = ["bare", "metanode"] if r % 2 == 0 else ["metanode", "bare"]
                    for name in order:
                        measure(urls[name], 1)  # warm-up, not recorded
                        runs[name].append(measure(urls[name], args.duration))
                        last = runs[name][-1]
                        print(
                            f"round {r + 1} {name:8s} {last.rate:9,.0f} req/s  "
                            f"p50 {last.p50_ms:.2f} ms  p99 {last.p99_ms:.2f} ms  "
                            f"({last.requests:,} requests)",
                            flush=True,
                        )
                if args.py_spy is not None:
                    with harness.py_spy(node.pid, args.py_spy):
                        measure(node.url, args.duration)
            finally:
                bare.stop()
        parts = (
            asyncio.run(_breakdown(data_dir, known, 10_000, args.log_level))
            if args.breakdown
            else []
        )

    def med(name: str, attr: str) -> float:
        return float(statistics.median(getattr(run, attr) for run in runs[name]))

    ratios = [m.rate / b.rate for m, b in zip(runs["metanode"], runs["bare"], strict=True)]
    ratio = statistics.median(ratios)
    how = (
        f"wrk -t1 -c{args.connections} -d{round(args.duration)}s"
        if client == "wrk"
        else f"httpx, {args.connections} connections, {args.requests:,} requests"
    )
    print(
        f"metanode GET /api/meta/{{cid}}: {med('metanode', 'rate'):,.0f} req/s  "
        f"p50 {med('metanode', 'p50_ms'):.2f} ms  p99 {med('metanode', 'p99_ms'):.2f} ms"
    )
    print(
        f"bare Starlette JSON endpoint: {med('bare', 'rate'):,.0f} req/s  "
        f"p50 {med('bare', 'p50_ms'):.2f} ms  p99 {med('bare', 'p99_ms'):.2f} ms"
    )
    print(
        f"ratio {ratio:.2f} (goal >= {GOAL}): {'met' if ratio >= GOAL else 'NOT met'}  "
        f"[per round: {', '.join(f'{r:.2f}' for r in ratios)}; {how}, median of "
        f"{args.rounds} rounds, {args.records:,} records, "
        f"log level {args.log_level}]"
    )
    if parts:
        print("in-process breakdown, µs per request (best of 3 passes of 10,000):")
        for label, micros in parts:
            print(f"  {micros:7.1f}  {label}")
    if args.py_spy is not None:
        print(f"server profile ({args.py_spy}):\n{harness.profile_summary(args.py_spy)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
