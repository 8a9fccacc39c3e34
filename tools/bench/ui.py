"""Web page benchmark: the library page (50 records) and search at 100,000 records, against
`GET /api/meta/{cid}` measured in the same run.

Run: `.venv/bin/python tools/bench/ui.py [--records 100000] [--requests 2000]`.

The data directory is built directly, without HTTP (as `scale.py` does): one signer; each
record a fresh midhash CID with a `title` of two words from a vocabulary of 2,000 made-up words
and the record's number, a `year` and a `videoType` (movie or episode), every claim signed
(Ed25519, in `--workers` processes) and written with `TruthStore.ingest_sync`; then
`maintenance.rebuild_cache` builds cache.db, its library table and full-text index with it.

Then one `metanode serve`, a session cookie from `POST /signin`, and one sequential keep-alive
client (`http.client`: a latency test) asking, round-robin in a random order per round:
the baseline `GET /api/meta/<random cid>`; the library's first page; a page deep in the
library (`before=` a rid in the middle); the movies (a type filter); a search for one word
(≈100 records match); a search for one record's number (one match); a search for two words.
Every answer must be 200 with at least one record. Reported per kind: p50/p99 in ms and the
ratio of its p50 to the baseline's; then each statement's `EXPLAIN QUERY PLAN`, which must
show index lookups only (no `SCAN library`).
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import random
import re
import tempfile
import time
import urllib.parse
from pathlib import Path

import harness
import nacl.signing

from metanode import cache, claims, config, db, maintenance, rid, truth
from metanode import cid as cids
from metanode.clock import now_ms

VOCABULARY = 2000
Signed = tuple[str, str, str, bytes]


def word(n: int) -> str:
    """The n-th made-up word: letters only, so the full-text index sees one token."""
    letters = "bcdfghjklmnprstvz"
    vowels = "aeiou"
    out = ""
    for _ in range(3):
        out += letters[n % len(letters)] + vowels[(n // len(letters)) % len(vowels)]
        n //= len(letters) * len(vowels)
        n += 7
    return out


def title_of(r: int) -> str:
    return f"{word(r % VOCABULARY).title()} {word((r * 7919) % VOCABULARY)} {r}"


def sign_chunk(job: tuple[bytes, str, int, int, int]) -> list[Signed]:
    """Worker: sign `records` records, three claims each, each about a fresh midhash CID."""
    seed, uid, first, records, ts = job
    key = nacl.signing.SigningKey(seed)
    out: list[Signed] = []
    for r in range(first, first + records):
        cid = cids.midhash_bytes(os.urandom(32))
        values = {
            "title": title_of(r),
            "year": str(1950 + r % 75),
            "videoType": "movie" if r % 3 else "episode",
        }
        for name, value in values.items():
            sig = key.sign(claims.signing_bytes(uid, cid, name, value, ts)).signature
            out.append((cid, name, value, sig))
    return out


def build(data_dir: Path, records: int, workers: int) -> list[str]:
    """truth.db and cache.db with `records` records; returns their CIDs."""
    settings = config.load(env={}, overrides={"data_dir": data_dir})
    maintenance.open_store(settings)
    key = nacl.signing.SigningKey.generate()
    uid = claims.uid_of(bytes(key.verify_key))
    ts = now_ms()
    step = 2000
    jobs = [
        (bytes(key), uid, first, min(step, records - first), ts)
        for first in range(0, records, step)
    ]
    known: list[str] = []
    with truth.TruthStore(settings.truth_path, lambda: ts) as store:
        store.add_signer_sync(uid, "bench", 1, False)
        minter, policy = rid.Minter(), truth.Policy()
        with multiprocessing.Pool(workers) as pool:
            for part in pool.imap(sign_chunk, jobs):
                batch = [claims.Claim(uid, c, k, v, ts, s) for c, k, v, s in part]
                store.ingest_sync(batch, minter, policy, ts)
                known.extend(dict.fromkeys(c.cid for c in batch))
    started = time.perf_counter()
    maintenance.rebuild_cache(settings)
    print(f"cache.db built in {time.perf_counter() - started:.1f} s", flush=True)
    return known


class Client:
    """One keep-alive connection with the session cookie."""

    def __init__(self, port: int, token: str) -> None:
        self.conn = http.client.HTTPConnection(harness.HOST, port, timeout=60)
        body = urllib.parse.urlencode({"token": token})
        self.conn.request(
            "POST",
            "/signin",
            body,
            {"Content-Type": "application/x-www-form-urlencoded"},
        )
        response = self.conn.getresponse()
        response.read()
        cookie = response.getheader("set-cookie") or ""
        if response.status != 303 or "metanode_session=" not in cookie:
            raise RuntimeError(f"sign-in answered {response.status}")
        self.cookie = cookie.split(";", 1)[0]

    def get(self, path: str) -> tuple[float, bytes]:
        begin = time.perf_counter()
        self.conn.request("GET", path, headers={"Cookie": self.cookie})
        response = self.conn.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - begin
        if response.status != 200:
            raise RuntimeError(f"GET {path} answered {response.status}: {body[:300]!r}")
        return elapsed, body


def kinds(known: list[str], middle_rid: str, records: int) -> dict[str, object]:
    """Each kind of request: a path, or a function of a random generator to a path."""
    one = random.Random(1).randrange(records)
    return {
        "GET /api/meta/<cid> (baseline)": lambda rng: f"/api/meta/{rng.choice(known)}",
        "library, first page": "/",
        "library, a page in the middle": f"/?before={middle_rid}",
        "library, type=movie": "/?type=movie",
        "search: one word (~100 match)": lambda rng: f"/?q={word(rng.randrange(VOCABULARY))}",
        "search: a record's number (1 match)": lambda rng: f"/?q={rng.randrange(records)}",
        "search: two words": f"/?q={urllib.parse.quote(title_of(one).rsplit(' ', 1)[0])}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="metanode-ui-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        print(f"building {args.records:,} records …", flush=True)
        known = build(data_dir, args.records, args.workers)
        conn = db.connect(data_dir / "cache.db", readonly=True)
        try:
            rids = cache.hash_ids(conn, "", args.records)
            plans = {
                "library": cache.library_plan(conn, "", "", None),
                "library, type=movie": cache.library_plan(conn, "", "movie", None),
                "search": cache.library_plan(conn, word(5), "", None),
                "search with a type": cache.library_plan(conn, word(5), "movie", None),
                "types (the filter's list)": [
                    str(r[3])
                    for r in conn.execute(
                        "EXPLAIN QUERY PLAN SELECT min(type) FROM library WHERE type > ''"
                    )
                ],
            }
        finally:
            conn.close()
        with harness.metanode_server(data_dir) as server:
            client = Client(server.port, harness.token(data_dir))
            paths = kinds(known, rids[len(rids) // 2], args.records)
            samples: dict[str, list[float]] = {name: [] for name in paths}
            rng = random.Random()
            for i in range(args.warmup + args.requests):
                order = list(paths.items())
                rng.shuffle(order)
                for name, path in order:
                    target = path(rng) if callable(path) else str(path)
                    elapsed, body = client.get(target)
                    if not name.startswith("GET") and not re.search(rb"/records/", body):
                        raise RuntimeError(f"{target} listed no record")
                    if i >= args.warmup:
                        samples[name].append(elapsed)
    base = sorted(samples["GET /api/meta/<cid> (baseline)"])
    base_p50 = harness.percentile(base, 50)
    print(f"\n{args.records:,} records, {args.requests:,} requests of each kind, sequential")
    print(f"{'request':40} {'p50 ms':>8} {'p99 ms':>8} {'p50 / baseline':>15}")
    for name, values in samples.items():
        ordered = sorted(values)
        p50, p99 = harness.percentile(ordered, 50), harness.percentile(ordered, 99)
        print(f"{name:40} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {p50 / base_p50:14.1f}×")
    print("\nEXPLAIN QUERY PLAN")
    scans = []
    for name, plan in plans.items():
        print(f"  {name}:")
        for line in plan:
            print(f"    {line}")
            if line.startswith("SCAN library") or line.startswith("SCAN l "):
                scans.append(name)
    if scans:
        print(f"a table scan in: {', '.join(scans)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
