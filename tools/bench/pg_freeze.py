"""The first answers of a node whose PostgreSQL was just frozen (docs/benchmarks.md, "A frozen
PostgreSQL").

A throw-away cluster and a real `metanode serve` on it (the default `pg_stall_s` and
`pg_connect_timeout_s`, 5 s each); a claim stored, the cluster stopped (SIGSTOP), then, one
after the other, a read (`GET /api/meta/{cid}`), `/health`, a POST of a new claim, and the same
three again: each one's status and seconds from the freeze. Then the three at once, on a
fresh freeze, and the seconds until a read works after SIGCONT. Run it with the code to
measure first on PYTHONPATH:

    PYTHONPATH=<checkout> .venv/bin/python tools/bench/pg_freeze.py [--port 19200]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pgcluster  # beside this script

from tests.helpers.claims import Signer
from tests.helpers.feed import new_cid_claims
from tests.helpers.server import Server, free_port


def timed(since: float, call: Any, *args: Any, **kwargs: Any) -> str:
    """`call`'s status and its answer's seconds since `since`."""
    response = call(*args, **kwargs)
    return f"{response.status_code} at {time.monotonic() - since:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="the node's; PostgreSQL's is the next")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="metanode-pgfreeze-"))
    port = args.port or free_port()
    pg_port = port + 1 if args.port else free_port()
    cluster, why = pgcluster.start_cluster(Path(tempfile.mkdtemp()), pg_port)
    if cluster is None:
        sys.exit(why)
    server = Server(root / "data", port=port)
    server.env["METANODE_STORAGE"] = cluster.database()
    server.start()
    try:
        signer = Signer()
        server.register(signer.uid, "bench")
        client = httpx.Client(base_url=server.url, headers=server.headers, timeout=120)
        stored = new_cid_claims(signer, "stored", 1)
        client.post("/api/claims", json={"claims": stored}).raise_for_status()
        read = f"/api/meta/{stored[0]['cid']}"
        for n, tag in enumerate(("in turn", "at once")):
            fresh = new_cid_claims(signer, f"frozen{n}", 1)
            calls = [
                ("read", client.get, (read,), {}),
                ("/health", client.get, ("/health",), {}),
                ("POST", client.post, ("/api/claims",), {"json": {"claims": fresh}}),
            ]
            cluster.freeze()
            since = time.monotonic()
            if tag == "in turn":
                for name, call, a, kw in calls + calls:
                    print(f"{tag}: {name} {timed(since, call, *a, **kw)}", flush=True)
            else:
                with ThreadPoolExecutor(3) as pool:
                    futures = [(n, pool.submit(timed, since, c, *a, **kw)) for n, c, a, kw in calls]
                    for name, future in futures:
                        print(f"{tag}: {name} {future.result()}", flush=True)
                    time.sleep(1)
            cluster.thaw()
            thawed = time.monotonic()
            while client.get(read).status_code != 200:
                time.sleep(0.05)
            print(f"{tag}: a read works {time.monotonic() - thawed:.2f} s after SIGCONT")
    finally:
        cluster.thaw()
        server.stop(9)
        cluster.stop()


if __name__ == "__main__":
    main()
