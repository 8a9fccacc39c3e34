"""What a large group costs a write into it: claims/s into a group of N CIDs ÷ claims/s into a
group of 1 CID, measured in the same run.

Run: `.venv/bin/python tools/bench/large_group.py [--sizes 1,100,500,2000] [--claims 200]
[--rounds 3] [--profile out.prof]`.

One started `Node` on a fresh data directory, in this process (as `lockstep.py`: no HTTP, the
write path behind the app: `Node.ingest_wire`, durable and applied before it answers). A
linker signer makes one group of each size: N-1 `cids/<cid>` votes on the group's first CID,
posted in bodies of 500, untimed. Then, a round at a time and the groups in turn within a round
(so machine drift lands on every size alike), a writer posts `--claims` one-claim requests
into each group back to back: the key `title` on one of its CIDs in turn, each a new value.
Reported per size: the median claims/s of the rounds and its ratio to the 1-CID group's,
1.0 when a write costs the same whatever the size of its group. `--profile`: cProfile of the
apply path (`cache.refresh`) of writes into the largest group, written to that file
(`python -m pstats` reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import harness
import nacl.signing

from metanode import cache, claims
from metanode import cid as cids
from metanode.clock import now_ms
from metanode.node import Node
from metanode.plan import Event

LINKS_A_BODY = 500


def new_cids(n: int) -> list[str]:
    """N fresh midhash CIDs."""
    return [cids.midhash_bytes(os.urandom(32)) for _ in range(n)]


async def make_group(node: Node, linker: nacl.signing.SigningKey, members: Sequence[str]) -> None:
    """Link `members` into one group: a `cids/` vote for each on the first, bodies of 500."""
    ts = now_ms()
    links = [claims.sign(linker, members[0], f"cids/{cid}", "true", ts) for cid in members[1:]]
    if not links:  # a group of one: a claim makes its record
        links = [claims.sign(linker, members[0], "genre", "bench", ts)]
    for start in range(0, len(links), LINKS_A_BODY):
        await node.ingest_wire([c.wire() for c in links[start : start + LINKS_A_BODY]])


async def write_into(
    node: Node, writer: nacl.signing.SigningKey, members: Sequence[str], n: int, tag: str
) -> float:
    """Claims/s of `n` one-claim requests into the group of `members`, one after another."""
    ts = now_ms()
    bodies: list[list[object]] = [
        [claims.sign(writer, members[i % len(members)], "title", f"{tag} {i}", ts + i).wire()]
        for i in range(n)
    ]
    start = time.perf_counter()
    for body in bodies:
        await node.ingest_wire(body)
    return n / (time.perf_counter() - start)


@contextmanager
def profiled(out: Path) -> Iterator[None]:
    """cProfile `cache.refresh`, the apply path's per-record work, on whichever thread runs it
    (the cache writer's: a profile started on the event loop's thread would not see it)."""
    prof = cProfile.Profile()
    original = cache.refresh

    def refresh(*args: Any) -> list[Event]:
        return prof.runcall(original, *args)

    setattr(cache, "refresh", refresh)  # noqa: B010  (mypy: a patch of another signature)
    try:
        yield
    finally:
        setattr(cache, "refresh", original)  # noqa: B010
        prof.dump_stats(out)


async def run(sizes: Sequence[int], n: int, rounds: int, profile: Path | None) -> None:
    linker, writer = nacl.signing.SigningKey.generate(), nacl.signing.SigningKey.generate()
    with tempfile.TemporaryDirectory(prefix="metanode-large-group-") as tmp:
        node = Node(harness.bench_settings(Path(tmp) / "data"))
        await node.start()
        try:
            for key, name, links in ((linker, "linker", True), (writer, "writer", False)):
                await node.add_signer(str(claims.uid_of(bytes(key.verify_key))), name, 1, links)
            groups = {size: new_cids(size) for size in sizes}
            for members in groups.values():
                await make_group(node, linker, members)
            rates: dict[int, list[float]] = {size: [] for size in sizes}
            for r in range(rounds):
                for size, members in groups.items():
                    rates[size].append(await write_into(node, writer, members, n, f"r{r}"))
            if profile is not None:
                with profiled(profile):
                    await write_into(node, writer, groups[max(sizes)], n, "profiled")
        finally:
            await node.stop()
    base = statistics.median(rates[min(sizes)])
    for size in sizes:
        rate = statistics.median(rates[size])
        print(f"group of {size:>5} CIDs: {rate:7.1f} claims/s  ratio {rate / base:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,100,500,2000", help="group sizes, smallest first")
    parser.add_argument("--claims", type=int, default=200, help="claims a group a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (medians reported)")
    parser.add_argument("--profile", type=Path, help="cProfile the largest group's writes here")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if sizes[0] < 1:
        parser.error("a group has at least 1 CID")
    asyncio.run(run(sizes, args.claims, args.rounds, args.profile))


if __name__ == "__main__":
    main()
