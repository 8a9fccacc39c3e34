"""Soak: tens of thousands of operations against one real `metanode serve`, on SQLite or on a
PostgreSQL cluster of our own, with a SIGKILL of the node and a crash-restart of PostgreSQL
in the middle; then every acknowledged claim looked up, `metanode check` run, and the node's
resident memory by operations done (docs/operations.md, "Running for months").

    .venv/bin/python tools/bench/soak.py --storage postgresql --ops 40000 --root /tmp/soak

The load, all at once from one asyncio client: two posters (one claim, or a batch of 50, on
new CIDs, alternately; a refused or cut POST is sent again until acknowledged, as a client
should), two readers (`GET /api/meta` of an acknowledged CID and of an unknown one) and two
feed subscribers (`/api/events`, with and without `snapshot`, or `/api/events/meta`, read
for a moment and dropped). An operation is one claim posted, one read or one subscription.
`--kill-at` and `--pg-restart-at` are fractions of `--ops`: the node SIGKILLed and started
again on the same data (its in-flight POSTs are in doubt: sent again), and PostgreSQL stopped
`-m immediate` (a crash) and started again, for the node to recover from by itself.

Acknowledged (200 or 202) means stored: every such CID must come back with its title at the
end. The summary (JSON on stdout) has the counts, the answers by status and error slug, the
longest answer, what was missing, the check's verdict and VmRSS by operations done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
import nacl.signing
import pgcluster

from metanode import cid as cids
from metanode import claims

BATCH = 50  # claims of a batched POST
FEED_PATHS = ("/api/events", "/api/events?snapshot=1", "/api/events/meta")
RETRY_S = 0.5  # a refused POST is sent again after this


def cid_of(n: int) -> str:
    """The soak's n-th CID (a raw sha2-256 CID of a name of its own)."""
    return str(cids.encode(0x55, 0x12, hashlib.sha256(f"soak-{n}".encode()).digest()))


@dataclass
class Tally:
    """What the clients did and were answered."""

    target: int
    done: int = 0
    acked: list[tuple[str, int]] = field(default_factory=list)  # (CID, n) acknowledged
    answers: Counter[str] = field(default_factory=Counter)  # "POST 503 storage_unavailable"
    slowest: dict[str, float] = field(default_factory=dict)  # the longest answer by kind
    wrong: list[str] = field(default_factory=list)  # a read that gave another title
    rss: list[tuple[int, float]] = field(default_factory=list)  # (ops done, VmRSS MiB)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (ops done, what happened)

    @property
    def over(self) -> bool:
        return self.done >= self.target

    def note(self, kind: str, response: httpx.Response | None, took: float) -> None:
        slug = ""
        if response is not None and response.status_code >= 400:
            with contextlib.suppress(ValueError, AttributeError):
                slug = str(response.json().get("error", ""))
        status = "cut" if response is None else str(response.status_code)
        self.answers[f"{kind} {status} {slug}".strip()] += 1
        self.slowest[kind] = max(self.slowest.get(kind, 0.0), took)


class Soak:
    """The node (restarted after its SIGKILL), its cluster, and the clients' loops."""

    def __init__(self, args: argparse.Namespace, root: Path, storage: str) -> None:
        self.args = args
        self.data = root / "data"
        self.storage = storage
        self.tally = Tally(args.ops)
        self.key = nacl.signing.SigningKey.generate()
        self.uid = str(claims.uid_of(bytes(self.key.verify_key)))
        self.next_cid = 0
        self.server = self._server()
        self.headers: dict[str, str] = {}

    def _server(self) -> harness.ServerProc:
        env = harness.clean_env(
            METANODE_WORKERS="1", METANODE_STORAGE=self.storage, MALLOC_ARENA_MAX="2"
        )
        return harness.ServerProc(
            harness.metanode_argv(self.data, self.args.port),
            self.args.port,
            env,
            cwd=self.data.parent,
            log_path=self.data.parent / "serve.log",
        )

    def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        self.server.start("/health", lambda body: bool(body.get("cache_ready")))
        self.headers = harness.auth(self.data)

    def signed(self, count: int) -> tuple[bytes, list[tuple[str, int]]]:
        """A POST body of `count` claims on new CIDs (the n-th titled `t<n>`), and (CID, n)."""
        firsts = range(self.next_cid, self.next_cid + count)
        self.next_cid += count
        now = time.time_ns() // 1_000_000
        made = [claims.sign(self.key, cid_of(n), "title", f"t{n}", now) for n in firsts]
        return harness.claims_body(made), [(c.cid, n) for c, n in zip(made, firsts, strict=True)]

    async def poster(self, client: httpx.AsyncClient, batched: bool) -> None:
        single = True
        while not self.tally.over:
            count = BATCH if batched and not single else 1
            single = not single
            body, posted = self.signed(count)
            while not await self._post(client, body):
                await asyncio.sleep(RETRY_S)
            self.tally.acked += posted
            self.tally.done += count

    async def _post(self, client: httpx.AsyncClient, body: bytes) -> bool:
        """One POST of `body`: whether it was acknowledged (200, or 202 stored, not yet
        applied); a 503 or a cut connection (the node killed) is no acknowledgement."""
        began = time.monotonic()
        headers = {**self.headers, "Content-Type": "application/json"}
        try:
            response: httpx.Response | None = await client.post(
                "/api/claims", content=body, headers=headers
            )
        except httpx.TransportError:
            response = None
        self.tally.note("POST", response, time.monotonic() - began)
        return response is not None and response.status_code in (200, 202)

    async def reader(self, client: httpx.AsyncClient) -> None:
        while not self.tally.over:
            known = bool(self.tally.acked) and random.random() < 0.7
            cid, n = (
                random.choice(self.tally.acked)
                if known
                else (cid_of(-1 - random.randrange(1 << 30)), -1)
            )
            began = time.monotonic()
            try:
                response: httpx.Response | None = await client.get(f"/api/meta/{cid}")
            except httpx.TransportError:
                response = None
            self.tally.note("GET", response, time.monotonic() - began)
            if known and response is not None and response.status_code == 200:
                title = response.json()["metadata"].get("title")
                if title != f"t{n}":
                    self.tally.wrong.append(cid)
            self.tally.done += 1
            if response is None or response.status_code >= 500:
                await asyncio.sleep(RETRY_S)

    async def subscriber(self, client: httpx.AsyncClient) -> None:
        while not self.tally.over:
            path = random.choice(FEED_PATHS)
            began = time.monotonic()
            try:
                async with client.stream("GET", path, headers=self.headers) as response:
                    with contextlib.suppress(asyncio.TimeoutError, StopAsyncIteration):
                        await asyncio.wait_for(anext(response.aiter_bytes()), random.random())
                    self.tally.note("feed", response, time.monotonic() - began)
            except httpx.TransportError:
                self.tally.note("feed", None, time.monotonic() - began)
                await asyncio.sleep(RETRY_S)
            self.tally.done += 1

    async def events(self) -> None:
        """RSS samples, the node's SIGKILL and PostgreSQL's crash-restart at their points."""
        every = max(1, self.args.ops // 20)
        kill = int(self.args.kill_at * self.args.ops)
        crash = int(self.args.pg_restart_at * self.args.ops)
        sampled = 0
        while not self.tally.over:
            await asyncio.sleep(0.2)
            done = self.tally.done
            if done >= sampled + every:
                sampled = done
                self.tally.rss.append((done, round(self.server.rss_mib(), 1)))
            if kill and done >= kill:
                kill = 0
                self.tally.marks.append((done, "node SIGKILLed"))
                await asyncio.to_thread(self.restart)
            if crash and done >= crash and self.args.cluster is not None:
                crash = 0
                self.tally.marks.append((done, "PostgreSQL stopped -m immediate"))
                await asyncio.to_thread(self.args.cluster.pause)
                await asyncio.sleep(self.args.pg_down_s)
                await asyncio.to_thread(self.args.cluster.resume)
                self.tally.marks.append((self.tally.done, "PostgreSQL started"))
        self.tally.rss.append((self.tally.done, round(self.server.rss_mib(), 1)))

    def restart(self) -> None:
        assert self.server.proc is not None
        self.server.proc.kill()
        self.server.proc.wait()
        self.server = self._server()
        self.start()

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=120, limits=limits) as c:
            response = await c.post(
                "/api/signers",
                headers=self.headers,
                json={"uid": self.uid, "name": "soak", "weight": 1, "may_link": False},
            )
            response.raise_for_status()
            await asyncio.gather(
                self.poster(c, batched=False),
                self.poster(c, batched=True),
                self.reader(c),
                self.reader(c),
                self.subscriber(c),
                self.subscriber(c),
                self.events(),
            )

    def missing(self) -> list[str]:
        """The acknowledged CIDs whose claim the node does not serve (after it caught up)."""
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            while time.monotonic() < deadline:
                health = client.get("/health").json()
                if health.get("apply_lag") == 0 and health.get("status") == "ok":
                    break
                time.sleep(0.5)
            return [
                cid
                for cid, n in self.tally.acked
                if (doc := client.get(f"/api/meta/{cid}")).status_code != 200
                or doc.json()["metadata"].get("title") != f"t{n}"
            ]

    def check(self) -> tuple[int, str]:
        """`metanode check` on the stopped node's data: its exit code and last lines."""
        env = harness.clean_env(METANODE_STORAGE=self.storage)
        done = subprocess.run(
            [sys.executable, "-m", "metanode", "check", "--data-dir", str(self.data)],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        return done.returncode, "\n".join((done.stdout + done.stderr).splitlines()[-6:])


@contextlib.contextmanager
def cluster_of(args: argparse.Namespace, root: Path) -> Iterator[str]:
    """The `storage` setting: `sqlite`, or the DSN of a database of a durable cluster of our own
    in `root`/pg (stopped and removed at the end)."""
    args.cluster = None
    if args.storage == "sqlite":
        yield "sqlite"
        return
    (root / "pg").mkdir()
    cluster, why = pgcluster.start_cluster(root / "pg", args.pg_port, durable=True)
    if cluster is None:
        raise SystemExit(f"no PostgreSQL: {why}")
    args.cluster = cluster
    try:
        yield cluster.database("soak")
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--storage", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--ops", type=int, default=40_000)
    parser.add_argument("--root", type=Path, required=True, help="a new directory (removed first)")
    parser.add_argument("--port", type=int, default=harness.free_port())
    parser.add_argument("--pg-port", type=int, default=harness.free_port())
    parser.add_argument("--kill-at", type=float, default=0.4, help="0: never")
    parser.add_argument("--pg-restart-at", type=float, default=0.7, help="0: never")
    parser.add_argument("--pg-down-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True)
    args.root.chmod(0o755)  # the cluster's unprivileged user must reach root/pg
    began = time.monotonic()
    with cluster_of(args, args.root) as storage:
        soak = Soak(args, args.root, storage)
        soak.start()
        try:
            asyncio.run(soak.run())
            loaded = time.monotonic() - began
            missing = soak.missing()
        finally:
            soak.server.stop()
        code, verdict = soak.check()
    tally = soak.tally
    summary: dict[str, Any] = {
        "storage": args.storage,
        "ops": tally.done,
        "seconds": round(loaded, 1),
        "acked_claims": len(tally.acked),
        "missing": len(missing),
        "missing_first": missing[:5],
        "wrong_titles": len(tally.wrong),
        "answers": dict(sorted(tally.answers.items())),
        "slowest_s": {k: round(v, 2) for k, v in tally.slowest.items()},
        "marks": tally.marks,
        "rss_mib": tally.rss,
        "check_exit": code,
        "check": verdict,
    }
    print(json.dumps(summary, indent=1))
    return 0 if not missing and not tally.wrong and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
