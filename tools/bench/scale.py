"""Scale benchmark: GET /api/meta/{cid} latency at 1,000,000 claims against 10,000 claims.

Run: `.venv/bin/python tools/bench/scale.py [--claims 1000000] [--small 10000] [--requests 5000]`.

Two data directories are built directly, without HTTP (posting 1M claims through the API would
measure ingest, not lookups): one signer registered with `TruthStore.add_signer_sync`; records of
`--keys-per-record` claims (10 different keys, one fresh midhash CID per record), every claim
signed on its own (`claims.signing_bytes` + Ed25519, in `--workers` processes) and written with
`TruthStore.ingest_sync` in transactions of `--chunk` claims after `maintenance.open_store`;
then `maintenance.rebuild_cache` builds cache.db. A sample of the stored claims is
re-verified with `claims.verify`.

Then `metanode serve` runs on each (both at once, on their own ports) and one sequential client
(`http.client`, keep-alive, no concurrency: this is a latency test) asks each for random known
CIDs, alternating between the two servers request by request (in a random order per pair) so
machine noise lands on both alike. `--warmup` untimed pairs first. Every answer must be 200.
Reported: p50/p99/max per size, the ratio p99(large) / p99(small) (goal <= 1.5), truth.db +
cache.db bytes on disk and the server's VmRSS / VmHWM (/proc/<pid>/status) after the lookups.

`--work-dir DIR` keeps the built data directories in DIR and reuses them on the next run with
the same sizes (otherwise a temporary directory is used and removed).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import harness
import nacl.signing

from metanode import cid as cids
from metanode import claims, config, maintenance, rid, truth
from metanode.clock import now_ms

GOAL = 1.5
DB_FILES = ("truth.db", "cache.db")
MARKER = "bench-built.json"

Signed = tuple[str, str, str, bytes]  # cid, key, value, sig (uid and ts are shared)


def sign_chunk(job: tuple[bytes, str, int, int, int, int]) -> list[Signed]:
    """Worker: sign `records` records × `per` claims, each record about a fresh midhash CID."""
    seed, uid, first, records, per, ts = job
    key = nacl.signing.SigningKey(seed)
    out: list[Signed] = []
    for r in range(first, first + records):
        cid = cids.midhash_bytes(os.urandom(32))
        for name in harness.RECORD_KEYS[:per]:
            value = f"{name} of record {r}"
            sig = key.sign(claims.signing_bytes(uid, cid, name, value, ts)).signature
            out.append((cid, name, value, sig))
    return out


def log(message: str, start: float) -> None:
    print(f"[{time.monotonic() - start:6.1f} s] {message}", flush=True)


def build(
    data_dir: Path,
    n_claims: int,
    per: int,
    chunk: int,
    workers: int,
    start: float,
    storage: str = "sqlite",
) -> list[str]:
    """Build both stores (truth.db and cache.db, or on PostgreSQL the database `storage`) with
    `n_claims` signed claims; returns the records' CIDs."""
    settings = config.load(env={}, overrides={"data_dir": data_dir, "storage": storage})
    maintenance.open_store(settings)
    key = nacl.signing.SigningKey.generate()
    uid = claims.uid_of(bytes(key.verify_key))
    ts = now_ms()
    records = n_claims // per
    per_chunk = max(1, chunk // per)
    jobs = [
        (bytes(key), uid, first, min(per_chunk, records - first), per, ts)
        for first in range(0, records, per_chunk)
    ]
    known: list[str] = []
    sample: list[claims.Claim] = []
    with truth.TruthStore.configured(settings, lambda: ts) as store:
        store.add_signer_sync(uid, "bench", 1, False)
        minter, policy = rid.Minter(), truth.Policy()
        done, step = 0, max(1, len(jobs) // 10)
        with multiprocessing.Pool(workers) as pool:
            for i, part in enumerate(pool.imap(sign_chunk, jobs)):
                batch = [claims.Claim(uid, c, k, v, ts, s) for c, k, v, s in part]
                result = store.ingest_sync(batch, minter, policy, ts)
                if result.verdicts.count("accepted") != len(batch):
                    raise RuntimeError("a freshly signed claim was not accepted")
                known.extend(dict.fromkeys(c.cid for c in batch))
                sample.append(batch[0])
                done += len(batch)
                if (i + 1) % step == 0 or i + 1 == len(jobs):
                    log(f"  {done:,} claims signed and written to the truth", start)
    for claim in sample[:: max(1, len(sample) // 100)]:
        claims.verify(claim)  # raises BadSignature: the stored bytes are really signed
    log("  building the cache (maintenance.rebuild_cache) …", start)
    state = maintenance.rebuild_cache(settings)
    log(f"  cache built: epoch {state.epoch}, applied seq {state.applied_seq:,}", start)
    return known


def prepared(
    root: Path,
    name: str,
    n_claims: int,
    args: argparse.Namespace,
    start: float,
    storage: str = "sqlite",
    empty: Callable[[], None] | None = None,
) -> tuple[Path, list[str]]:
    """A built data directory for `n_claims` (reused from `root` if built before); its stores
    in `storage`, which `empty()` (if given) empties before a build (tools/bench/scale_out.py:
    a PostgreSQL database made anew)."""
    data_dir = root / name / "data"
    marker = root / name / MARKER
    if marker.exists():
        meta = json.loads(marker.read_text())
        if meta.get("claims") == n_claims and meta.get("per") == args.keys_per_record:
            log(f"reusing {data_dir} ({n_claims:,} claims)", start)
            return data_dir, meta["cids"]
    if data_dir.parent.exists():
        shutil.rmtree(data_dir.parent)
    data_dir.mkdir(parents=True)
    if empty is not None:
        empty()
    log(
        f"building {n_claims:,} claims ({n_claims // args.keys_per_record:,} records × "
        f"{args.keys_per_record}) in {data_dir} …",
        start,
    )
    known = build(
        data_dir, n_claims, args.keys_per_record, args.chunk, args.workers, start, storage
    )
    marker.write_text(json.dumps({"claims": n_claims, "per": args.keys_per_record, "cids": known}))
    return data_dir, known


@dataclass
class Latencies:
    name: str
    server: harness.ServerProc
    known: list[str]
    samples: list[float]
    conn: http.client.HTTPConnection | None = None

    def get(self, cid: str) -> float:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(harness.HOST, self.server.port, timeout=30)
        begin = time.perf_counter()
        self.conn.request("GET", f"/api/meta/{cid}")
        response = self.conn.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - begin
        if response.status != 200:
            raise RuntimeError(
                f"{self.name}: GET /api/meta/{cid} answered {response.status}: {body[:300]!r}"
            )
        return elapsed

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def measure(sides: list[Latencies], requests: int, warmup: int) -> None:
    rng = random.Random()
    for i in range(warmup + requests):
        order = sides[:]
        rng.shuffle(order)
        for side in order:
            elapsed = side.get(rng.choice(side.known))
            if i >= warmup:
                side.samples.append(elapsed)


def summary(side: Latencies) -> tuple[float, float, float]:
    """(p50, p99, max) in milliseconds."""
    ordered = sorted(side.samples)
    return (
        harness.percentile(ordered, 50) * 1e3,
        harness.percentile(ordered, 99) * 1e3,
        ordered[-1] * 1e3,
    )


@contextlib.contextmanager
def work_root(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="metanode-scale-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--claims",
        type=int,
        default=1_000_000,
        help="claims in the large data dir (default 1000000)",
    )
    parser.add_argument(
        "--small", type=int, default=10_000, help="claims in the small data dir (default 10000)"
    )
    parser.add_argument("--keys-per-record", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=5_000, help="claims per truth transaction")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 2,
        help="signing processes (default: one per core)",
    )
    parser.add_argument("--requests", type=int, default=5_000, help="timed lookups per size")
    parser.add_argument("--warmup", type=int, default=500, help="untimed lookups per size first")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep (and reuse) the built data directories here",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.keys_per_record <= len(harness.RECORD_KEYS):
        parser.error(f"--keys-per-record must be 1 to {len(harness.RECORD_KEYS)}")
    if not args.keys_per_record <= args.small <= args.claims or args.requests < 1:
        parser.error("need keys-per-record <= --small <= --claims and --requests >= 1")

    start = time.monotonic()
    with work_root(args.work_dir) as root:
        small_dir, small_cids = prepared(root, f"small-{args.small}", args.small, args, start)
        large_dir, large_cids = prepared(root, f"large-{args.claims}", args.claims, args, start)
        sizes = {d: harness.dir_size(d, DB_FILES) for d in (small_dir, large_dir)}
        log("starting both servers …", start)
        with (
            harness.metanode_server(small_dir) as small_srv,
            harness.metanode_server(large_dir) as large_srv,
        ):
            log(
                f"servers up; {args.warmup} + {args.requests:,} lookups per size, alternating …",
                start,
            )
            sides = [
                Latencies("small", small_srv, small_cids, []),
                Latencies("large", large_srv, large_cids, []),
            ]
            try:
                measure(sides, args.requests, args.warmup)
            finally:
                for side in sides:
                    side.close()
            rss = {
                side.name: (side.server.rss_mib("VmRSS"), side.server.rss_mib("VmHWM"))
                for side in sides
            }
        log("done", start)

    print(
        f"{'size':>30s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} {'db MiB':>8s} "
        f"{'RSS MiB':>8s} {'HWM MiB':>8s}"
    )
    for side, n, d in ((sides[0], args.small, small_dir), (sides[1], args.claims, large_dir)):
        p50, p99, top = summary(side)
        label = f"{n:,} claims ({len(side.known):,} rec)"
        print(
            f"{label:>30s} {p50:8.3f} {p99:8.3f} {top:8.2f} {sizes[d] / 2**20:8.1f} "
            f"{rss[side.name][0]:8.1f} {rss[side.name][1]:8.1f}"
        )
    ratio = summary(sides[1])[1] / summary(sides[0])[1]
    p50_ratio = summary(sides[1])[0] / summary(sides[0])[0]
    print(
        f"ratio p99({args.claims:,}) / p99({args.small:,}) = {ratio:.2f} (goal <= {GOAL}): "
        f"{'met' if ratio <= GOAL else 'NOT met'}; p50 ratio {p50_ratio:.2f}  "
        f"[{args.requests:,} sequential lookups per size, http.client keep-alive]"
    )
    print(f"total time {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
