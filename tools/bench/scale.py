"""Scale benchmark: GET /api/meta/{cid} latency at 1,000,000 claims against 10,000 claims.

Run: `.venv/bin/python tools/bench/scale.py [--claims 1000000] [--small 10000] [--requests 5000]
[--mix uniform,zipf] [--zipf-s 1.0] [--hot-documents 0,10000]`.

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
cache.db bytes on disk and the server's VmRSS / VmHWM (/proc/<pid>/status) after the lookups;
and the read rate at the large size ÷ at the small one (the p50 latency ratio's inverse; issue
18's goal >= 0.95), with the mean latency's beside it. The p50, because the mean moves with a
few stalls of a shared machine: the same data served twice (`--claims 10000 --small 10000`)
gave a p50 "ratio" of 0.98–1.01 but a mean one of 0.85.

Both sizes are measured once per lookup mix (`--mix`), with each `hot_documents` setting of
`--hot-documents` (a list; each setting's servers get their own copy of the two data
directories, so all of them run at once and the one client alternates among them all, request
by request; the on ÷ off read rate at each size is printed too): `uniform` asks every record
alike; `zipf` asks the record of rank k (a random
ranking) with probability ∝ 1 / k^s (`--zipf-s`, default 1.0), the skew of real lookups,
where a few records are most of the reads.

`--work-dir DIR` keeps the built data directories in DIR and reuses them on the next run with
the same sizes (otherwise a temporary directory is used and removed).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import multiprocessing
import os
import random
import shutil
import statistics
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

GOAL = 1.5  # p99 at the large size ÷ at the small one, at most
RATE_GOAL = 0.95  # read rate at the large size ÷ at the small one, at least (issue 18)
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
    state = maintenance.rebuild_cache(settings).state
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


Draw = Callable[[random.Random], str]


def drawing(known: list[str], mix: str, s: float) -> Draw:
    """How a mix picks the next CID to ask for from `known`."""
    if mix == "uniform":
        return lambda rng: rng.choice(known)
    ranked = random.Random(len(known)).sample(known, len(known))
    cumulative = list(itertools.accumulate(1 / (k + 1) ** s for k in range(len(ranked))))
    return lambda rng: rng.choices(ranked, cum_weights=cumulative)[0]


@dataclass
class Latencies:
    name: str
    server: harness.ServerProc
    draw: Draw
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
            elapsed = side.get(side.draw(rng))
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


@dataclass
class Row:
    mix: str
    hot: int
    small: Latencies
    large: Latencies
    small_rss: tuple[float, float]  # VmRSS, VmHWM in MiB
    large_rss: tuple[float, float]


def copy_for(data_dir: Path, hot: int) -> Path:
    """A copy of a built data directory for the servers of another `hot_documents` setting
    (one directory, one node); made once, reused with the built one."""
    copy = data_dir.parent.with_name(f"{data_dir.parent.name}-hot{hot}") / "data"
    built = (data_dir / "truth.db").stat().st_mtime
    if not copy.exists() or (copy / "truth.db").stat().st_mtime != built:
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(data_dir, copy)
    return copy


def run(
    dirs: dict[str, tuple[Path, list[str]]],
    mix: str,
    hots: list[int],
    args: argparse.Namespace,
    start: float,
) -> list[Row]:
    """Both sizes (`dirs`: name → data dir, CIDs) for every `hot_documents` setting in `hots`,
    all served at once and asked alternately, request by request, in `mix`."""
    log(f"{mix}: starting {len(dirs) * len(hots)} servers (hot_documents {hots}) …", start)
    with contextlib.ExitStack() as stack:
        sides: dict[tuple[int, str], Latencies] = {}
        for n, hot in enumerate(hots):
            for name, (data_dir, known) in dirs.items():
                served = data_dir if n == 0 else copy_for(data_dir, hot)
                env = {"METANODE_HOT_DOCUMENTS": str(hot)}
                server = stack.enter_context(harness.metanode_server(served, **env))
                draw = drawing(known, mix, args.zipf_s)
                sides[hot, name] = Latencies(f"{name}, hot {hot}", server, draw, [])
                stack.callback(sides[hot, name].close)
        log(f"servers up; {args.warmup} + {args.requests:,} lookups each, alternating …", start)
        measure(list(sides.values()), args.requests, args.warmup)
        rss = {
            key: (side.server.rss_mib("VmRSS"), side.server.rss_mib("VmHWM"))
            for key, side in sides.items()
        }
    return [
        Row(
            mix, hot, sides[hot, "small"], sides[hot, "large"], rss[hot, "small"], rss[hot, "large"]
        )
        for hot in hots
    ]


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
    parser.add_argument("--mix", default="uniform,zipf", help="lookup mixes: uniform, zipf")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="the zipf mix's exponent")
    parser.add_argument(
        "--hot-documents",
        default="0,10000",
        help="hot_documents settings to measure, each with both sizes (default 0,10000)",
    )
    args = parser.parse_args(argv)
    if not set(args.mix.split(",")) <= {"uniform", "zipf"}:
        parser.error("--mix takes uniform and/or zipf")
    if not 1 <= args.keys_per_record <= len(harness.RECORD_KEYS):
        parser.error(f"--keys-per-record must be 1 to {len(harness.RECORD_KEYS)}")
    if not args.keys_per_record <= args.small <= args.claims or args.requests < 1:
        parser.error("need keys-per-record <= --small <= --claims and --requests >= 1")

    start = time.monotonic()
    with work_root(args.work_dir) as root:
        small_dir, small_cids = prepared(root, f"small-{args.small}", args.small, args, start)
        large_dir, large_cids = prepared(root, f"large-{args.claims}", args.claims, args, start)
        sizes = {d: harness.dir_size(d, DB_FILES) for d in (small_dir, large_dir)}
        dirs = {"small": (small_dir, small_cids), "large": (large_dir, large_cids)}
        hots = [int(h) for h in args.hot_documents.split(",")]
        rows = [row for mix in args.mix.split(",") for row in run(dirs, mix, hots, args, start)]
        log("done", start)

    print(
        f"{'mix':>8s} {'hot':>6s} {'size':>30s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} "
        f"{'mean ms':>8s} {'db MiB':>8s} {'RSS MiB':>8s} {'HWM MiB':>8s}"
    )
    for row in rows:
        for side, n, d, rss in (
            (row.small, args.small, small_dir, row.small_rss),
            (row.large, args.claims, large_dir, row.large_rss),
        ):
            p50, p99, top = summary(side)
            label = f"{n:,} claims ({len(small_cids if side is row.small else large_cids):,} rec)"
            print(
                f"{row.mix:>8s} {row.hot:6d} {label:>30s} {p50:8.3f} {p99:8.3f} {top:8.2f} "
                f"{statistics.fmean(side.samples) * 1e3:8.3f} {sizes[d] / 2**20:8.1f} "
                f"{rss[0]:8.1f} {rss[1]:8.1f}"
            )
    for row in rows:
        ratio = summary(row.large)[1] / summary(row.small)[1]
        p50_ratio = summary(row.large)[0] / summary(row.small)[0]
        rate = 1 / p50_ratio
        mean = statistics.fmean(row.small.samples) / statistics.fmean(row.large.samples)
        print(
            f"{row.mix}, hot_documents {row.hot}: read rate {args.claims:,} ÷ {args.small:,} = "
            f"{rate:.2f} (goal >= {RATE_GOAL}: {'met' if rate >= RATE_GOAL else 'NOT met'}; "
            f"by the mean {mean:.2f}); p99 ratio {ratio:.2f} (goal <= {GOAL}: "
            f"{'met' if ratio <= GOAL else 'NOT met'})  [{args.requests:,} sequential lookups "
            "per server, http.client keep-alive]"
        )
    base = {row.mix: row for row in rows if row.hot == hots[0]}
    for row in rows:
        if row.hot != hots[0]:
            for size in ("small", "large"):
                off, on = getattr(base[row.mix], size), getattr(row, size)
                mean = statistics.fmean(off.samples) / statistics.fmean(on.samples)
                print(
                    f"{row.mix}, {size}: read rate with hot_documents {row.hot} ÷ {hots[0]} = "
                    f"{summary(off)[0] / summary(on)[0]:.3f} (by the mean {mean:.3f})"
                )
    print(f"total time {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
