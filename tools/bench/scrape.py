"""Scrape benchmark: what a `GET /metrics` does to the other requests of a large node.

Run: `.venv/bin/python tools/bench/scrape.py DATA_DIR [--scrapes 5] [--seconds 1]`, DATA_DIR a
data directory (e.g. one `scale.py --work-dir DIR --keys-per-record 1` built and kept:
`DIR/large-1000000/data`).

`metanode serve --workers 1` on DATA_DIR as it is (watcher and plugins off, so nothing is
written), one thread asking `GET /api/meta/{cid}` of one known CID one request after the other
for `--seconds` (the baseline), then on while the main thread scrapes `/metrics` `--scrapes`
times, half a second apart. Reported: each scrape's time, and the longest and the p99 time of
the reads in either phase with their ratio (during ÷ baseline). A scrape whose gauges scan the
tables on the event loop holds every read for the scan (at 1M records: reads of up to 562–680 ms
against 16–20 ms, docs/benchmarks.md "/metrics off the event loop").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import harness
import httpx


def some_cid(client: httpx.Client) -> str:
    """A CID the node holds a claim on, asked of its API (`GET /api/claims/log`)."""
    page = client.get("/api/claims/log", params={"limit": 1}).json()["claims"]
    if not page:
        sys.exit("the data directory holds no claim")
    return str(page[0]["cid"])


def reads_while(url: str, cid: str, busy: threading.Event, out: dict[bool, list[float]]) -> None:
    """GET the CID's document again and again, filing each time under whether `busy` was set
    (a scrape phase) when the read began; until `busy` is cleared after having been set."""
    seen_busy = False
    with httpx.Client(base_url=url, timeout=60) as client:
        while True:
            phase = busy.is_set()
            seen_busy |= phase
            if seen_busy and not phase:
                return
            started = time.perf_counter()
            assert client.get(f"/api/meta/{cid}").status_code == 200
            out[phase].append(time.perf_counter() - started)


def summary(times: list[float]) -> tuple[float, float]:
    """(longest, p99) in ms."""
    return max(times) * 1000, statistics.quantiles(times, n=100)[98] * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="the baseline's length")
    args = parser.parse_args(argv)
    env = {"METANODE_WATCH_ENABLED": "false", "METANODE_PLUGINS_ENABLED": "false"}
    with harness.metanode_server(args.data_dir, **env) as server:
        with httpx.Client(base_url=server.url, headers=harness.auth(args.data_dir)) as client:
            cid = some_cid(client)
        busy = threading.Event()
        times: dict[bool, list[float]] = {False: [], True: []}
        reader = threading.Thread(target=reads_while, args=(server.url, cid, busy, times))
        reader.start()
        time.sleep(args.seconds)
        took = []
        with httpx.Client(base_url=server.url, headers=harness.auth(args.data_dir)) as client:
            busy.set()
            for _ in range(args.scrapes):
                started = time.perf_counter()
                assert client.get("/metrics", timeout=120).status_code == 200
                took.append((time.perf_counter() - started) * 1000)
                time.sleep(0.5)
            busy.clear()
        reader.join()
    (base_max, base_p99), (max_ms, p99) = summary(times[False]), summary(times[True])
    print(f"scrapes: {', '.join(f'{ms:.0f}' for ms in took)} ms")
    print(f"reads, baseline: {len(times[False]):,}, longest {base_max:.1f} ms, p99 {base_p99:.1f}")
    print(f"reads, scraping: {len(times[True]):,}, longest {max_ms:.1f} ms, p99 {p99:.1f}")
    print(f"ratio during ÷ baseline: longest {max_ms / base_max:.2f}, p99 {p99 / base_p99:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
