"""Core benchmarks: claim validation and midhash256, each as a ratio against a same-run baseline.

Run: `.venv/bin/python tools/bench/core.py [--n 5000]`.

1. **Claim verify rate.** N distinct claims, signed by a few Ed25519 keys, each about its own
   midhash CID, are turned into wire dicts. We time `metanode.claims.validate(wire, now_ms)` over
   all of them: the full path a node runs on an incoming claim (field checks, CID decode and
   canonical check, sig decode, RFC 8785 signing bytes, Ed25519 verify). The CID parse cache is
   cleared before every timed pass, so each CID is really decoded (a node mostly sees new CIDs).
   The signer key cache stays warm: a node sees few signers and the bench uses only a few.
   The baseline is the floor any implementation pays: `nacl.signing.VerifyKey(pk).verify(...)` on
   the same claims with signing bytes and key bytes precomputed. Ratio = validate / raw (goal
   >= 0.9, i.e. everything except the signature check costs at most ~10%). A warm-cache ratio is
   printed too. Best of 3 rounds; each round runs validate (cold), raw, validate (warm) in turn so
   machine noise lands on both sides of a ratio. Then the same with every claim of a signer of
   its own and the signer key caches emptied before each pass: a box taking claims of more
   signers than those caches hold (4,096), as from peers, decodes each uid.

2. **Claim sign rate.** `metanode.claims.sign` (what a plugin's drafts, the node's own signer
   and `metanode.client` pay a claim: the uid, the RFC 8785 signing bytes, Ed25519 sign) over N
   drafts of one signer, against `nacl.signing.SigningKey.sign` of the same signing bytes,
   precomputed. Ratio = sign / raw; best of 3 rounds, the two passes in turn.

3. **midhash of a 10 GiB sparse file.** `metanode.watcher.midhash_file` (open, fstat, one 1 MiB
   pread from the middle, sha256, close) against one plain `os.pread(fd, 1 MiB, 0)` of a real,
   fsync'd 1 MiB file of random bytes, timed alternately in the same loop. Both reads are served
   from the page cache after the first iteration (the sparse file's hole reads as zero pages), so
   this compares CPU cost, not disk speed; it shows midhash costs about "one read", independent of
   the file's size (goal: ratio <= 3). Medians of 50 repeats. Interleaving is deliberate: both sides
   run in the same allocator state (glibc trims the 2 MiB midhash frees back to the OS, so each
   fresh 1 MiB buffer, the baseline's included, is page-faulted in again), as in a real process.

Every figure is a ratio against a baseline measured in the same run, so a slower or busier machine
moves both sides; absolute rates are printed only for context.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nacl.signing

from metanode import cid as cids
from metanode import claims, watcher
from metanode.clock import now_ms

REPEATS = 3
MIDHASH_REPEATS = 50
SIGNERS = 4
KEYS = ("title", "year", "genre", "description", "language")
SPARSE_SIZE = 10 << 30
READ_SIZE = 1 << 20


def timed(run: Callable[[], None]) -> float:
    """Wall time of one call of `run`."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def make_claims(n: int, now_ms: int, signers_n: int = SIGNERS) -> list[claims.Claim]:
    """N distinct signed claims of `signers_n` signers in turn, each about its own fresh
    midhash CID."""
    signers = [nacl.signing.SigningKey.generate() for _ in range(signers_n)]
    rng = random.Random()
    alphabet = string.ascii_letters + string.digits + " "
    out: list[claims.Claim] = []
    for i in range(n):
        value = "".join(rng.choices(alphabet, k=rng.randint(8, 64)))
        ts = now_ms - rng.randint(0, 60_000)
        cid = cids.midhash_bytes(os.urandom(64))
        out.append(claims.sign(signers[i % signers_n], cid, rng.choice(KEYS), value, ts))
    return out


def bench_verify(n: int, signers_n: int = SIGNERS) -> tuple[float, float, float]:
    """(validate rate with cold CID cache, raw nacl rate, validate rate with warm CID cache).
    With `signers_n` = `n`, each claim's signer is its own and the key caches are emptied
    before each validate pass too: a box taking claims of more signers than they hold."""
    now = now_ms()
    signed = make_claims(n, now, signers_n)
    wires: list[dict[str, Any]] = [c.wire() for c in signed]
    raw: list[tuple[bytes, bytes, bytes]] = [
        (claims.public_key(c.uid).encode(), c.signing_bytes(), c.sig) for c in signed
    ]

    def run_validate() -> None:
        for wire in wires:
            claims.validate(wire, now)

    def run_raw() -> None:
        for pk, msg, sig in raw:
            nacl.signing.VerifyKey(pk).verify(msg, sig)

    def uncached() -> None:
        if signers_n == n:
            claims._public_key.cache_clear()
            claims.uid_of.cache_clear()

    # Rounds interleave the three passes so that machine noise hits the sides of each ratio alike.
    cold = base = warm = float("inf")
    for _ in range(REPEATS):
        cids._parse.cache_clear()
        uncached()
        cold = min(cold, timed(run_validate))
        base = min(base, timed(run_raw))
        uncached()
        warm = min(warm, timed(run_validate))  # every CID was just parsed: the cache is warm
    return n / cold, n / base, n / warm


def bench_sign(n: int) -> tuple[float, float]:
    """(`claims.sign` rate, raw nacl sign rate) over the same N drafts, one signer, as a plugin
    or the node's own signer signs: every draft with the same key."""
    key = nacl.signing.SigningKey.generate()
    uid = claims.uid_of(bytes(key.verify_key))
    drafts = [(c.cid, c.key, c.value, c.ts) for c in make_claims(n, now_ms())]
    messages = [claims.signing_bytes(uid, cid, k, value, ts) for cid, k, value, ts in drafts]

    def run_sign() -> None:
        for cid, k, value, ts in drafts:
            claims.sign(key, cid, k, value, ts)

    def run_raw() -> None:
        for message in messages:
            key.sign(message)

    ours = base = float("inf")
    for _ in range(REPEATS):
        ours = min(ours, timed(run_sign))
        base = min(base, timed(run_raw))
    return n / ours, n / base


def bench_midhash() -> tuple[float, float, float, float]:
    """Median seconds of: midhash_file on a 10 GiB sparse file; one 1 MiB pread; that pread plus
    hashlib.sha256 of the bytes (the floor of any 1 MiB fingerprint); midhash_file of a 1 MiB
    file (the same work at 1/10,240 of the size: equal times show O(1) in the size)."""
    with tempfile.TemporaryDirectory() as tmp:
        sparse = Path(tmp) / "sparse.bin"
        with open(sparse, "wb") as f:
            f.truncate(SPARSE_SIZE)
        plain = Path(tmp) / "plain.bin"
        with open(plain, "wb") as f:
            f.write(os.urandom(READ_SIZE))
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(plain, os.O_RDONLY | os.O_CLOEXEC)
        try:
            hash_times: list[float] = []
            read_times: list[float] = []
            floor_times: list[float] = []
            small_times: list[float] = []
            for _ in range(MIDHASH_REPEATS):
                start = time.perf_counter()
                watcher.midhash_file(sparse)
                hash_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                data = os.pread(fd, READ_SIZE, 0)
                read_times.append(time.perf_counter() - start)
                if len(data) != READ_SIZE:
                    raise RuntimeError("short read of the 1 MiB baseline file")
                start = time.perf_counter()
                hashlib.sha256(os.pread(fd, READ_SIZE, 0)).digest()
                floor_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                watcher.midhash_file(plain)
                small_times.append(time.perf_counter() - start)
        finally:
            os.close(fd)
    return (
        statistics.median(hash_times),
        statistics.median(read_times),
        statistics.median(floor_times),
        statistics.median(small_times),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=5_000, help="claims to validate (default 5000)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be at least 1")

    cold, base, warm = bench_verify(args.n)
    print(
        f"verify: claims {cold:,.0f}/s  raw nacl {base:,.0f}/s  ratio {cold / base:.2f}"
        f" (goal >= 0.9)  [n={args.n:,}, cold CID cache, best of {REPEATS}]"
    )
    print(
        f"verify (warm CID cache): claims {warm:,.0f}/s  raw nacl {base:,.0f}/s"
        f"  ratio {warm / base:.2f}"
    )

    many, base, _ = bench_verify(args.n, args.n)
    print(
        f"verify, each claim of a signer of its own: claims {many:,.0f}/s  raw nacl {base:,.0f}/s"
        f"  ratio {many / base:.2f}  [n={args.n:,}, key caches emptied, cold CID cache]"
    )

    signed, raw_sign = bench_sign(args.n)
    print(
        f"sign: claims {signed:,.0f}/s  raw nacl sign {raw_sign:,.0f}/s"
        f"  ratio {signed / raw_sign:.2f}  [n={args.n:,}, one signer, best of {REPEATS}]"
    )

    hashed, read, floor, small = bench_midhash()
    print(
        f"midhash: 10 GiB sparse file {hashed * 1e3:.3f} ms  1 MiB pread {read * 1e3:.3f} ms"
        f"  ratio {hashed / read:.2f} (goal <= 3)  [median of {MIDHASH_REPEATS}, page cache]"
    )
    print(
        f"midhash vs 1 MiB pread + sha256 {floor * 1e3:.3f} ms: ratio {hashed / floor:.2f};"
        f"  vs midhash of a 1 MiB file {small * 1e3:.3f} ms: ratio {hashed / small:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
