"""Peers soak: three real nodes following each other under load and churn, then checked.

Run: `.venv/bin/python tools/bench/peers_soak.py --dir /tmp/x [--minutes 4] [--cycles 1]
[--rate 40] [--cids 300]`.

Three `metanode serve` processes (SQLite, `--workers 1`, peers at their default settings), A,
B and C, each following the other two, every one of the six links through its own
`FaultProxy` (tests/helpers/faultproxy.py), so a link can be partitioned while the nodes run.
Six signers, registered with weight 1 on all three (two of them `may_link`), sign claims about a
pool of CIDs with four keys, posted in small batches to whichever nodes are up: overwrites
(newest per signer wins), tombstones, equivocations (the same slot and `ts` with two values,
each sent to another node) and `cids/<other cid>` votes that merge groups, each merge reaching
the other nodes in another order. Meanwhile (`CHURN`, spread over `--minutes`): A is SIGKILLed
and restarted, B is stopped for a while and brought back, C's links are partitioned, A's
follower of B is given an address nothing listens on and then its own again (its cursor
starts over: a reconciliation on a busy box), A is SIGKILLed again. A change-feed reader per
node resumes with `Last-Event-ID` across every restart.

Then the load stops and the soak measures how long the three take to hold the same claims and
serve the same `GET /api/meta/<cid>` for every CID, and checks: no acknowledged claim lost
(each slot holds the SPEC §2.3 winner of what was acknowledged, or a newer claim that was
sent), no claim stored twice (log seqs: each node's max `log_seq` is exactly what it accepted
from POSTs and from its peers), the same groups on every node with the oldest rid surviving
each merge, each feed gapless (dense seqs, no `gap`) and folding into exactly the node's
records, `metanode check` clean, and resident memory (VmRSS) over time. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
import nacl.signing

from metanode import cid as cids
from metanode import claims
from metanode.clock import now_ms

sys.path.insert(0, str(harness.REPO))
from tests.helpers.faultproxy import FaultProxy  # the repository's own link faults

NAMES = "abc"
KEYS = ("title", "year", "genre", "note")
SIGNERS = 6
LINKERS = 2  # the first signers may link groups
TIMEOUT_S = 60.0
CONVERGE_LIMIT_S = 600.0


@dataclass
class Node:
    """One node: its server process (restartable on the same port) and what was posted to it."""

    name: str
    data_dir: Path
    server: harness.ServerProc
    accepted: int = 0  # acknowledged `accepted` of POSTs
    unknown: int = 0  # claims posted without an answer (the node died meanwhile)
    up: bool = True
    starts: int = 1
    rss: list[tuple[float, float]] = field(default_factory=list)
    cpu_before: float = 0.0  # CPU seconds of its earlier processes

    def cpu_s(self) -> float:
        """CPU seconds of every process it has run so far."""
        return self.cpu_before + (harness.tree_cpu(self.server.pid) if self.up else 0.0)

    @property
    def headers(self) -> dict[str, str]:
        return harness.auth(self.data_dir)

    def start(self) -> None:
        self.server.start("/health", lambda body: bool(body.get("cache_ready")))
        self.up = True

    def stop(self, kill: bool) -> None:
        self.cpu_before = self.cpu_s()
        self.up = False
        proc = self.server.proc
        assert proc is not None
        if kill:
            proc.kill()
            proc.wait(timeout=harness.STOP_TIMEOUT_S)
        else:
            self.server.stop()


@dataclass
class Sent:
    """Every claim posted, and what became of it."""

    acked: dict[bytes, claims.Claim] = field(default_factory=dict)
    maybe: dict[bytes, claims.Claim] = field(default_factory=dict)  # no answer came
    refused: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def make_node(root: Path, name: str, port: int) -> Node:
    data_dir = root / name / "data"
    data_dir.parent.mkdir(parents=True)
    env = harness.clean_env(
        METANODE_WORKERS="1",
        METANODE_WATCH_ENABLED="false",
        METANODE_PLUGINS_ENABLED="false",
        MALLOC_ARENA_MAX="2",
    )
    server = harness.ServerProc(
        harness.metanode_argv(data_dir, port),
        port,
        env,
        cwd=data_dir.parent,
        log_path=data_dir.parent / "serve.log",
    )
    node = Node(name, data_dir, server)
    node.start()
    return node


def peer_token(node: Node, name: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "peers", "token", "create", "--name", name,
         "--data-dir", str(node.data_dir)],
        capture_output=True, text=True, check=True, env=harness.clean_env(),
    )  # fmt: skip
    return done.stdout.strip()


def follow(node: Node, name: str, url: str, token: str) -> None:
    body = {"url": url, "token": token, "name": name}
    r = httpx.post(f"{node.server.url}/api/peers", json=body, headers=node.headers, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"POST /api/peers on {node.name} answered {r.status_code}: {r.text}")


class Load:
    """Signs and posts claims to the nodes that are up, at about `rate` claims a second."""

    def __init__(self, nodes: dict[str, Node], pool: list[str], rate: float, seed: int) -> None:
        self.nodes = nodes
        self.pool = pool
        self.rate = rate
        self.rng = random.Random(seed)
        self.keys = [nacl.signing.SigningKey(self.rng.randbytes(32)) for _ in range(SIGNERS)]
        self.by_uid = {claims.uid_of(bytes(k.verify_key)): k for k in self.keys}
        self.sent = Sent()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="load", daemon=True)

    def register(self, node: Node) -> None:
        for i, key in enumerate(self.keys):
            body = {"uid": claims.uid_of(bytes(key.verify_key)), "name": f"soak{i}",
                    "weight": 1, "may_link": i < LINKERS}  # fmt: skip
            r = httpx.post(f"{node.server.url}/api/signers", json=body, headers=node.headers)
            if r.status_code != 200:
                raise RuntimeError(f"POST /api/signers answered {r.status_code}: {r.text}")

    def _ts(self) -> int:
        """Now, or a little before (an older claim arriving late is `stale`)."""
        return now_ms() - (self.rng.randrange(5000) if self.rng.random() < 0.1 else 0)

    def _claim(self) -> claims.Claim:
        rng = self.rng
        signer = rng.randrange(SIGNERS)
        cid = rng.choice(self.pool)
        if signer < LINKERS and rng.random() < 0.05:
            member = rng.choice(self.pool)
            if member != cid:
                value = None if rng.random() < 0.1 else "true"
                return claims.sign(self.keys[signer], cid, f"cids/{member}", value, self._ts())
        key = rng.choice(KEYS)
        value = None if rng.random() < 0.15 else f"{key} {rng.randrange(1000)}"
        return claims.sign(self.keys[signer], cid, key, value, self._ts())

    def _batch(self) -> dict[str, list[claims.Claim]]:
        """About a tenth of a second's claims, each to a node that is up; sometimes an
        equivocation: the same slot and ts with another value, to another node."""
        live = [n for n in self.nodes.values() if n.up]
        out: dict[str, list[claims.Claim]] = {n.name: [] for n in live}
        if not live:
            return out
        for _ in range(max(1, round(self.rate / 10))):
            made = self._claim()
            out[self.rng.choice(live).name].append(made)
            if len(live) > 1 and self.rng.random() < 0.02 and not made.is_link:
                value = f"twin {self.rng.randrange(1000)}"
                twin = claims.sign(self.by_uid[made.uid], made.cid, made.key, value, made.ts)
                out[self.rng.choice(live).name].append(twin)
        return out

    def _post(self, node: Node, batch: list[claims.Claim]) -> None:
        body = {"claims": [c.wire() for c in batch]}
        try:
            r = httpx.post(
                f"{node.server.url}/api/claims", json=body, headers=node.headers, timeout=30
            )
        except httpx.HTTPError:
            with self.sent.lock:
                self.sent.maybe.update((c.sig, c) for c in batch)
                node.unknown += len(batch)
            return
        with self.sent.lock:
            if r.status_code in (200, 202):
                self.sent.acked.update((c.sig, c) for c in batch)
                node.accepted += r.json()["accepted"]
            elif r.status_code == 503 or not node.up:  # starting or stopping: not taken
                self.sent.maybe.update((c.sig, c) for c in batch)
                node.unknown += len(batch)
            else:
                self.sent.refused.append(f"{node.name} {r.status_code} {r.text[:300]}")

    def _run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            posts = [
                threading.Thread(target=self._post, args=(self.nodes[name], batch))
                for name, batch in self._batch().items()
                if batch
            ]
            for post in posts:
                post.start()
            for post in posts:
                post.join()
            time.sleep(max(0.0, 0.1 - (time.monotonic() - started)))


class FeedReader:
    """Follows a node's `/api/events`, resuming with `Last-Event-ID` whenever it drops, and
    folds it into records: rid → key → value."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.last = ""
        self.records: dict[str, dict[str, str]] = {}
        self.events = 0
        self.gaps: list[str] = []
        self.holes: list[str] = []  # seqs not one after the last
        self.reconnects = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"feed-{node.name}", daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            headers = {**self.node.headers, "Last-Event-ID": self.last} if self.last else {}
            params = {} if self.last else {"snapshot": "1"}
            try:
                with httpx.stream(
                    "GET",
                    f"{self.node.server.url}/api/events",
                    headers=headers or self.node.headers,
                    params=params,
                    timeout=httpx.Timeout(5, read=30),
                ) as response:
                    if response.status_code == 200:
                        self._read(response)
            except httpx.HTTPError:
                pass
            self.reconnects += 1
            time.sleep(0.2)

    def _read(self, response: httpx.Response) -> None:
        event, data, ident = "", "", ""
        for line in response.iter_lines():
            if self.stopping.is_set():
                return
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
            elif line.startswith("id:"):
                ident = line[3:].strip()
            elif line == "" and event:
                self._take(event, json.loads(data) if data else {}, ident)
                event, data, ident = "", "", ""

    def _take(self, event: str, body: dict[str, Any], ident: str) -> None:
        if event == "gap":
            self.gaps.append(json.dumps(body))
            self.records.clear()  # a snapshot follows
        if event in ("set", "del"):
            self.events += 1
            if self.last and ident and "." not in ident:  # not inside a snapshot's state
                (epoch, seq), (was_epoch, was_seq) = position(ident), position(self.last)
                if epoch != was_epoch or seq != was_seq + 1:
                    self.holes.append(f"{self.last} → {ident}")
            record = self.records.setdefault(body["rid"], {})
            if event == "set":
                record[body["key"]] = body["value"]
            else:
                record.pop(body["key"], None)
                if not record:
                    del self.records[body["rid"]]
        if ident:
            self.last = ident


def position(ident: str) -> tuple[str, int]:
    """(epoch, seq) of a feed event id: `<epoch>-<seq>`, or `<epoch>-<seq>.<n>` for the n-th
    event of a snapshot of the state at seq (the live events after it go on from seq + 1)."""
    epoch, _, seq = ident.partition("-")
    return epoch, int(seq.partition(".")[0])


def links_of(nodes: dict[str, Node], base: int) -> dict[tuple[str, str], FaultProxy]:
    """A proxy per directed link (follower, followed), on ports from `base`."""
    out = {}
    for i, (f, t) in enumerate((f, t) for f in NAMES for t in NAMES if f != t):
        out[(f, t)] = FaultProxy(nodes[t].server.port, port=base + i).__enter__()
    return out


def claim_log(node: Node) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    params = {"limit": "1000"}
    with httpx.Client(base_url=node.server.url, headers=node.headers, timeout=TIMEOUT_S) as http:
        while True:
            page = http.get("/api/claims/log", params=params).json()
            out += page["claims"]
            if not page["more"]:
                return out
            params["after"] = page["next"]


def documents(node: Node, pool: list[str]) -> dict[str, Any]:
    with httpx.Client(base_url=node.server.url, timeout=TIMEOUT_S) as http:
        return {cid: http.get(f"/api/meta/{cid}").json() for cid in pool}


def records(node: Node) -> dict[str, dict[str, str]]:
    """Every active record's merged keys, by rid, as `GET /api/metadata/{rid}` gives them."""
    out: dict[str, dict[str, str]] = {}
    params: dict[str, str] = {"limit": "1000"}
    with httpx.Client(base_url=node.server.url, headers=node.headers, timeout=TIMEOUT_S) as http:
        while True:
            page = http.get("/api/hash-ids", params=params).json()
            for rid in page["hashIds"]:
                out[rid] = http.get(f"/api/metadata/{rid}").json()["metadata"]
            if page["next"] is None:
                return out
            params["after"] = page["next"]


def beats(a: dict[str, Any], b: claims.Claim) -> bool:
    """Whether stored wire claim `a` is `b` or wins its slot over it (SPEC §2.3)."""
    ts, sig = a["ts"], claims.decode_sig(a["sig"])
    return bool(ts > b.ts or (ts == b.ts and sig <= b.sig))


def check_claims(name: str, log: list[dict[str, Any]], sent: Sent) -> list[str]:
    """What lost or doubled claims the log shows: one claim per slot, each sent by the soak,
    none below an acknowledged one of its slot."""
    problems = []
    slots: dict[tuple[str, str, str], dict[str, Any]] = {}
    for wire in log:
        slot = (wire["uid"], wire["cid"], wire["key"])
        if slot in slots:
            problems.append(f"{name}: slot {slot} stored twice")
        slots[slot] = wire
        sig = claims.decode_sig(wire["sig"])
        if sig not in sent.acked and sig not in sent.maybe:
            problems.append(f"{name}: a claim never sent: {wire}")
    lost = [
        c for c in sent.acked.values()
        if (s := slots.get((c.uid, c.cid, c.key))) is None or not beats(s, c)
    ]  # fmt: skip
    problems += [f"{name}: acknowledged claim lost: {c.wire()}" for c in lost[:5]]
    if lost:
        problems.append(f"{name}: {len(lost)} acknowledged claims lost")
    return problems


def truth_facts(node: Node) -> dict[str, Any]:
    """From truth.db and cache.db (read only): the highest log seq, the groups, and whether each
    merge kept the older rid and the cache's index agrees with the truth's groups."""
    truth = sqlite3.connect(f"file:{node.data_dir / 'truth.db'}?mode=ro", uri=True)
    cache = sqlite3.connect(f"file:{node.data_dir / 'cache.db'}?mode=ro", uri=True)
    try:
        (max_seq,) = truth.execute("SELECT max(log_seq) FROM claims").fetchone()
        group_of = dict(truth.execute("SELECT cid, rid FROM cid_group").fetchall())
        merged = truth.execute("SELECT rid, merged_into FROM rids WHERE status = 'merged'")
        younger_survivors = [r for r, into in merged if into >= r]
        index = dict(cache.execute("SELECT cid, rid FROM cid_index").fetchall())
    finally:
        truth.close()
        cache.close()
    groups: dict[str, set[str]] = {}
    for cid, rid in group_of.items():
        groups.setdefault(rid, set()).add(cid)
    return {
        "max_seq": max_seq or 0,
        "groups": {frozenset(g) for g in groups.values()},
        "younger_survivors": younger_survivors,
        "index_differs": sum(1 for c, r in group_of.items() if index.get(c) != r),
    }


def peer_rows(node: Node) -> list[dict[str, Any]]:
    r = httpx.get(f"{node.server.url}/api/peers", headers=node.headers, timeout=TIMEOUT_S)
    rows: list[dict[str, Any]] = r.json()["peers"]
    return rows


def peer_accepted(node: Node) -> int:
    return sum(row["accepted"] for row in peer_rows(node))


def unsettled(node: Node) -> list[str]:
    """What the node still says is wrong once converged: its /health problems, and each peer
    with an error or a lag."""
    health = httpx.get(f"{node.server.url}/health", timeout=TIMEOUT_S).json()
    out = [f"{node.name}: /health {health['status']}: {health.get('problems')}"]
    out = out if health["status"] != "ok" else []
    return out + [
        f"{node.name}: peer {row['name']} lag {row['lag_s']} s, last error {row['last_error']!r}"
        for row in peer_rows(node)
        if row["last_error"] or row["lag_s"]
    ]


def converge(
    nodes: dict[str, Node], pool: list[str], started: float
) -> tuple[float, float, list[dict[str, Any]]]:
    """Seconds from `started` until the three hold the same claims, then until they serve the
    same documents for every CID (each as of when the read that found it began; a round of
    reads takes seconds itself, said in its line); and the common log."""
    claims_at = 0.0
    while (began := time.monotonic() - started) < CONVERGE_LIMIT_S:
        try:
            logs = {n: claim_log(node) for n, node in nodes.items()}
        except httpx.HTTPError as exc:  # said, and asked again: a node must answer its reads
            alive = {
                n: node.server.proc and node.server.proc.poll() is None for n, node in nodes.items()
            }
            print(f"a read failed: {exc!r} ({exc.request.url}); processes alive: {alive}")
            time.sleep(0.5)
            continue
        sets = {frozenset(c["sig"] for c in log) for log in logs.values()}
        print(f"  {began:5.1f} s: {sorted(len(s) for s in sets)} claims", flush=True)
        if len(sets) == 1:
            claims_at = claims_at or began
            docs_began = time.monotonic() - started
            docs = [documents(node, pool) for node in nodes.values()]
            if docs[0] == docs[1] == docs[2]:
                return claims_at, docs_began, logs["a"]
        time.sleep(0.5)
    raise RuntimeError(f"the nodes did not converge within {CONVERGE_LIMIT_S:.0f} s")


@dataclass
class Soak:
    nodes: dict[str, Node]
    links: dict[tuple[str, str], FaultProxy]
    load: Load
    tokens: dict[tuple[str, str], str]
    journal: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def say(self, what: str) -> None:
        line = f"{time.monotonic() - self.t0:7.1f} s  {what}"
        self.journal.append(line)
        print(line, flush=True)

    def sample_rss(self) -> None:
        for node in self.nodes.values():
            if node.up:
                node.rss.append((time.monotonic() - self.t0, node.server.rss_mib()))

    def restart(self, name: str, kill: bool, down_s: float) -> None:
        node = self.nodes[name]
        self.say(f"{'SIGKILL' if kill else 'SIGTERM'} {name}, down {down_s:.0f} s")
        node.stop(kill)
        self.wait(down_s)
        node.start()
        node.starts += 1
        self.say(f"{name} back")

    def partition(self, name: str, down_s: float) -> None:
        self.say(f"partition {name}'s links for {down_s:.0f} s")
        for (f, t), link in self.links.items():
            link.faults.partition = name in (f, t)
        self.wait(down_s)
        for link in self.links.values():
            link.faults.partition = False
        self.say(f"{name}'s links healed")

    def unreachable(self, follower: str, followed: str, down_s: float, dead_port: int) -> None:
        self.say(f"{follower} follows {followed} at a dead address for {down_s:.0f} s")
        node = self.nodes[follower]
        follow(node, followed, f"http://127.0.0.1:{dead_port}", self.tokens[(follower, followed)])
        self.wait(down_s)
        url = self.links[(follower, followed)].url
        follow(node, followed, url, self.tokens[(follower, followed)])
        self.say(f"{follower} follows {followed} at its address again")

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample_rss()
            time.sleep(min(5.0, max(0.0, end - time.monotonic())))


def churn(soak: Soak, minutes: float, dead_port: int) -> None:
    """The churn, its steps spread over `minutes`; it ends as C's partition heals, and the
    load stops then, so the convergence measured is the churn's."""
    unit = minutes * 60 / 9
    soak.wait(unit)
    soak.restart("a", kill=True, down_s=unit / 4)
    soak.wait(unit / 2)
    soak.restart("b", kill=False, down_s=1.5 * unit)
    soak.wait(unit / 2)
    soak.unreachable("a", "b", unit, dead_port)  # back at its address: a reconciliation …
    for _ in range(3):  # … that the first of these SIGKILLs interrupts
        soak.wait(1)
        soak.restart("a", kill=True, down_s=0)
        soak.wait(unit / 4)
    soak.wait(unit)
    soak.partition("c", 2 * unit)
    soak.say(f"{len(soak.load.sent.acked):,} claims acknowledged so far")


def summary(soak: Soak, readers: dict[str, FeedReader], logs: list[dict[str, Any]]) -> list[str]:
    sent = soak.load.sent
    problems = [f"refused: {r}" for r in sent.refused[:5]]
    facts = {}
    for name, node in soak.nodes.items():
        facts[name] = truth_facts(node)
        problems += check_claims(name, logs, sent)
        reader = readers[name]
        problems += [f"{name}: feed gap {g}" for g in reader.gaps]
        problems += [f"{name}: feed hole {h}" for h in reader.holes[:5]]
        if reader.records != records(node):
            problems.append(f"{name}: the feed folds into other records than the node serves")
        fact = facts[name]
        if fact["younger_survivors"]:
            problems.append(f"{name}: merges kept the younger rid: {fact['younger_survivors']}")
        if fact["index_differs"]:
            problems.append(f"{name}: {fact['index_differs']} cids indexed under another rid")
        problems += unsettled(node)
        took = node.accepted + peer_accepted(node)
        if not took <= fact["max_seq"] <= took + node.unknown:
            problems.append(f"{name}: max log_seq {fact['max_seq']}, accepted {took} "
                            f"(+ up to {node.unknown} unanswered)")  # fmt: skip
    if len({frozenset(f["groups"]) for f in facts.values()}) != 1:
        problems.append("the nodes group the CIDs differently")
    print(f"claims sent {len(sent.acked) + len(sent.maybe):,} ({len(sent.maybe)} unanswered), "
          f"stored {len(logs):,}; groups {len(facts['a']['groups'])} "
          f"(largest {max(len(g) for g in facts['a']['groups'])} CIDs)")  # fmt: skip
    for name, node in soak.nodes.items():
        reader = readers[name]
        rss = node.rss
        print(f"{name}: {node.starts} start(s), POST accepted {node.accepted:,}, from peers "
              f"{peer_accepted(node):,}, max log_seq {facts[name]['max_seq']:,}; feed "
              f"{reader.events:,} events, {reader.reconnects} reconnects; CPU "
              f"{node.cpu_s():.0f} s; RSS MiB "
              + ", ".join(f"{t:.0f}s:{m:.0f}" for t, m in rss[:: max(1, len(rss) // 8)])
              + f", last {rss[-1][1]:.0f}")  # fmt: skip
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=4.0, help="of load and churn a cycle")
    parser.add_argument("--cycles", type=int, default=1, help="of the churn (default 1)")
    parser.add_argument("--rate", type=float, default=40.0, help="claims a second, all nodes")
    parser.add_argument("--cids", type=int, default=300, help="CIDs the claims are about")
    parser.add_argument("--port", type=int, default=18600, help="first of 16 ports used")
    parser.add_argument("--dir", type=Path, required=True, help="an empty folder for the nodes")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=False)
    nodes = {n: make_node(args.dir, n, args.port + 1 + i) for i, n in enumerate(NAMES)}
    links: dict[tuple[str, str], FaultProxy] = {}
    readers: dict[str, FeedReader] = {}
    try:
        rng = random.Random(args.seed)
        pool = [cids.midhash_bytes(rng.randbytes(32)) for _ in range(args.cids)]
        load = Load(nodes, pool, args.rate, args.seed)
        links = links_of(nodes, args.port + 10)
        tokens = {(f, t): peer_token(nodes[t], f) for (f, t) in links}
        for node in nodes.values():
            load.register(node)
        for (f, t), link in links.items():
            follow(nodes[f], t, link.url, tokens[(f, t)])
        soak = Soak(nodes, links, load, tokens)
        readers = {n: FeedReader(node) for n, node in nodes.items()}
        for reader in readers.values():
            reader.thread.start()
        load.thread.start()
        for _ in range(args.cycles):
            churn(soak, args.minutes, args.port + 99)
        load.stopping.set()
        load.thread.join()
        soak.say("load and churn over; waiting for convergence")
        claims_s, docs_s, logs = converge(nodes, pool, time.monotonic())
        soak.say(f"same claims after {claims_s:.1f} s, same documents after {docs_s:.1f} s")
        time.sleep(2)  # the feeds' last events
        soak.sample_rss()
        problems = summary(soak, readers, logs)
    finally:
        for reader in readers.values():
            reader.stopping.set()
        for node in nodes.values():
            node.server.stop()
        for link in links.values():
            link.__exit__()
    for node in nodes.values():
        done = subprocess.run(
            [sys.executable, "-m", "metanode", "check", "--data-dir", str(node.data_dir)],
            capture_output=True, text=True, env=harness.clean_env(),
        )  # fmt: skip
        if done.returncode != 0:
            problems.append(f"{node.name}: `metanode check`: {done.stdout[-500:]}")
    print("\n".join(problems) if problems else "every check passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
