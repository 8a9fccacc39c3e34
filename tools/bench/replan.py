"""What blocking a signer of many records costs everybody else's writes: one-claim write
latency while the node replans that signer's records ÷ the same writes' latency before.

Run: `.venv/bin/python tools/bench/replan.py [--records 50000] [--seconds 2]`.

A real `metanode serve` on a fresh data directory; two signers registered through
`POST /api/signers`: a spammer with `--records` one-claim records (posted in bodies of 500,
untimed) and a writer. Baseline, same run: the writer posts one-claim requests (each a new
record) back to back with one keep-alive client for `--seconds`, each latency recorded. Then
`POST /api/signers/{spammer}/block` is sent from a thread while the writer goes on posting,
until the block has been answered and `GET /health` reports no replan under way; the figures
are the latencies of the writes posted meanwhile. Ratio = the baseline's p50 (and max) ÷ the
same during the replan: 1.0 when a block costs the other writers nothing. Before replans went
a step at a time (`cache.REPLAN_CHUNK` claims a transaction) every write waited for the whole
replan, one cache transaction of ≈ 47 µs a record.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import harness
import httpx
import ingest
import nacl.signing

from metanode.clock import now_ms

POPULATE_BATCH = 500
WRITES = 20_000  # one-claim bodies signed for the writer up front: more than a run posts


def post_for(client: httpx.Client, bodies: Iterator[bytes], until: threading.Event) -> list[float]:
    """Post one body after another until `until` is set; each answer's latency in ms."""
    latencies = []
    while not until.is_set():
        body = next(bodies)
        start = time.perf_counter()
        answer = client.post("/api/claims", content=body)
        latencies.append((time.perf_counter() - start) * 1e3)
        if answer.status_code != 200:
            raise RuntimeError(f"POST /api/claims answered {answer.status_code}: {answer.text}")
    return latencies


def replanned(client: httpx.Client) -> bool:
    """Whether no replan is under way (a build from before replans has no such field)."""
    return not client.get("/health").json().get("replans", 0)


def block_and_wait(
    client: httpx.Client, uid: str, done: threading.Event, took: list[float]
) -> None:
    """Block `uid`, then wait until no replan is under way; the time in `took`. `done` is set
    however it ends, so the writer stops posting (`took` stays empty if the block failed)."""
    start = time.perf_counter()
    try:
        answer = client.post(f"/api/signers/{uid}/block", timeout=600)
        if answer.status_code != 200:
            raise RuntimeError(f"block answered {answer.status_code}: {answer.text}")
        while not replanned(client):
            time.sleep(0.01)  # a benchmark's poll, not a test's wait
        took.append(time.perf_counter() - start)
    finally:
        done.set()


def summary(latencies: list[float]) -> str:
    return (
        f"{len(latencies):,} writes, p50 {statistics.median(latencies):.1f} ms, "
        f"p99 {harness.percentile(sorted(latencies), 99):.1f} ms, max {max(latencies):.1f} ms"
    )


def run(records: int, seconds: float) -> None:
    spammer, writer = nacl.signing.SigningKey.generate(), nacl.signing.SigningKey.generate()
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        with harness.metanode_server(data_dir) as server:
            spammer_uid = harness.register_signer(server, data_dir, spammer)
            harness.register_signer(server, data_dir, writer)
            signed = ingest.make_claims(spammer, records, now_ms(), "spam")
            harness.post_all(
                server,
                data_dir,
                [
                    harness.claims_body(signed[i : i + POPULATE_BATCH])
                    for i in range(0, records, POPULATE_BATCH)
                ],
            )
            headers = {**harness.auth(data_dir), "Content-Type": "application/json"}
            with (
                httpx.Client(base_url=server.url, headers=headers, timeout=600) as client,
                httpx.Client(base_url=server.url, headers=headers, timeout=600) as blocker,
            ):
                writes = ingest.make_claims(writer, WRITES, now_ms(), "write")
                bodies = iter([harness.claims_body([claim]) for claim in writes])
                stop = threading.Event()
                threading.Timer(seconds, stop.set).start()
                before = post_for(client, bodies, stop)
                done, took = threading.Event(), list[float]()
                thread = threading.Thread(
                    target=block_and_wait, args=(blocker, spammer_uid, done, took)
                )
                thread.start()
                during = post_for(client, bodies, done)
                thread.join()
    if not took:
        raise RuntimeError("the block did not complete (its thread's error is above)")
    print(f"{records:,} records of the blocked signer, replanned in {took[0]:.2f} s")
    print(f"before the block: {summary(before)}")
    print(f"during the replan: {summary(during)}")
    print(
        f"ratio p50 {statistics.median(before) / statistics.median(during):.3f}, "
        f"max {max(before) / max(during):.3f} (1.0: the block costs the other writers nothing)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    run(args.records, args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
