"""What the signers a box knows cost its writes: the writers with many signers known ÷ with one.

Run: `.venv/bin/python tools/bench/signers.py [--claims 8000] [--group 8] [--known 1000 10000]`.

A box knows every signer that ever sent it a claim, its plugins' and its peers' signers
included, while one apply merges the votes of a few. For each count in `--known`, on a fresh
data directory: that many other signers registered (each its own real Ed25519 key), then
`--claims` new one-claim records of one signer committed and applied in transactions of
`--group` claims (`ingest.writer_costs`: the truth's transaction, then the cache's apply, one
after the other on their writer threads; 8 is what a transaction holds with 8 one-claim
clients). Baseline, same run: the same claims with no other signer known, measured before and
after the others (the faster is used), after an untimed quarter of the run to warm up. Ratio =
the baseline's µs a claim ÷ the figure's (truth and cache together): 1.0 when the signers a box
knows cost its writes nothing.
"""

from __future__ import annotations

import argparse

import ingest
import nacl.signing

from metanode import claims
from metanode.clock import now_ms


def cost(signed: list[claims.Claim], key: nacl.signing.SigningKey, group: int, known: int) -> float:
    """µs of wall time a claim, truth and cache, with `known` other signers registered."""
    others = [
        claims.uid_of(bytes(nacl.signing.SigningKey.generate().verify_key)) for _ in range(known)
    ]
    truth_cost, cache_cost = ingest.writer_costs(signed, key, group, now_ms(), others)
    return (truth_cost.wall + cache_cost.wall) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=8000)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--known", type=int, nargs="+", default=[1000, 10000])
    args = parser.parse_args(argv)
    key = nacl.signing.SigningKey.generate()
    signed = ingest.make_claims(key, args.claims, now_ms(), "signers")
    cost(signed[: len(signed) // 4], key, args.group, 0)  # warm up: imports, caches, the disk
    before = cost(signed, key, args.group, 0)
    figures = {known: cost(signed, key, args.group, known) for known in args.known}
    after = cost(signed, key, args.group, 0)
    base = min(before, after)
    print(
        f"no other signer known: {base:,.1f} µs a claim (truth + cache, groups of {args.group}; "
        f"before {before:,.1f}, after {after:,.1f}: the faster is used)"
    )
    for known, figure in figures.items():
        print(f"{known:,} other signers known: {figure:,.1f} µs a claim, ratio {base / figure:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
