"""Peers benchmark: an initial pull A → B against B's own POST ingest, and reconciliation.

Run: `.venv/bin/python tools/bench/peers.py [--n 100000] [--reconcile-n 1000000]`.

1. Pull vs post. Three real `metanode serve` processes on loopback (A, B-pull, B-post), one
   signer registered on each. N claims (each about its own fresh midhash CID) are posted to A,
   untimed. Timed: B-pull `peers add`s A (a fresh box: it follows A's claim log from the start,
   pages of 1,000) until its peer row counts N accepted; and, the baseline in the same run,
   another N claims posted to the fresh B-post with one client in batches of 1,000 (a follower
   is one sequential puller of 1,000-claim pages, so this is the like-for-like). Ratio = pull
   claims/s ÷ post claims/s (goal >= 0.9).
2. Reconciliation between real servers. B-pull now holds exactly A's N claims; the peer is
   removed, 0.05% new claims are posted to each side (0.1% differ in all), the peer is added
   again: B holds claims, so its first sync reconciles. Reported from `peers list`'s
   `last_sync`: rounds, bytes sent and received, seconds; against the bytes of A's whole claim
   log (a full transfer). Goals: under 5 s and under 1% of a full transfer.
3. The same reconciliation in memory at `--reconcile-n` ids (the pure module, through the JSON
   wire form), where building the servers' sets would take too long here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx
import nacl.signing

from metanode import cid as cids
from metanode import claims, reconcile
from metanode.clock import now_ms

PULL_GOAL = 0.9
RECONCILE_S_GOAL = 5.0
RECONCILE_SHARE_GOAL = 0.01


def make_claims(key: nacl.signing.SigningKey, n: int, ts: int, tag: str) -> list[claims.Claim]:
    return [
        claims.sign(key, cids.midhash_bytes(os.urandom(32)), "title", f"{tag} {i}", ts)
        for i in range(n)
    ]


def bodies(signed: list[claims.Claim]) -> list[bytes]:
    return [harness.claims_body(signed[i : i + 1000]) for i in range(0, len(signed), 1000)]


def peer_token(data_dir: Path) -> str:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "metanode", "peers", "token", "create", "--name", "bench",
         "--data-dir", str(data_dir)],
        capture_output=True, text=True, check=True, env=harness.clean_env(),
    )  # fmt: skip
    return done.stdout.strip()


def peer_row(server: harness.ServerProc, data_dir: Path) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/api/peers", headers=harness.auth(data_dir), timeout=30)
    rows: list[dict[str, Any]] = response.json()["peers"]
    return rows[0]


def wait_row(server: harness.ServerProc, data_dir: Path, done: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = peer_row(server, data_dir)
        if done(row):
            return row
        time.sleep(0.05)
    raise RuntimeError(f"the peer did not get there in {timeout} s: {peer_row(server, data_dir)}")


def add_peer(server: harness.ServerProc, data_dir: Path, url: str, token: str) -> None:
    body = {"url": url, "token": token, "name": "a"}
    r = httpx.post(f"{server.url}/api/peers", json=body, headers=harness.auth(data_dir))
    if r.status_code != 200:
        raise RuntimeError(f"POST /api/peers answered {r.status_code}: {r.text}")


def log_bytes(server: harness.ServerProc, token: str) -> int:
    """Bytes of A's whole claim log in pages of 1,000: what a full transfer sends."""
    total, params = 0, {"limit": "1000"}
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        while True:
            r = client.get("/api/claims/log", params=params)
            total += len(r.content)
            page = r.json()
            if not page["more"]:
                return total
            params["after"] = page["next"]


def in_memory(n: int, differing: int) -> dict[str, float]:
    """Reconciliation of `n` shared ids with `differing` split over both sides, in memory."""
    rng = random.Random(19)
    shared = [rng.randbytes(16) for _ in range(n)]
    mine = [rng.randbytes(16) for _ in range(differing // 2)]
    theirs = [rng.randbytes(16) for _ in range(differing - differing // 2)]
    started = time.perf_counter()
    local, remote = reconcile.Items(shared + mine), reconcile.Items(shared + theirs)
    built = time.perf_counter()
    sent = [0]

    def answer(message: list[reconcile.Fingerprint]) -> list[reconcile.Entry]:
        asked = json.dumps({"ranges": reconcile.encode(message)})
        reply = reconcile.respond(
            remote, reconcile.decode_fingerprints(json.loads(asked)["ranges"])
        )
        told = json.dumps({"ranges": reconcile.encode(reply)})
        sent[0] += len(asked) + len(told)
        return reconcile.decode_reply(json.loads(told)["ranges"], 16)

    session = reconcile.run(local, answer)
    done = time.perf_counter()
    assert session.need == set(theirs) and session.have == set(mine)
    return {"build_s": built - started, "run_s": done - built, "bytes": sent[0],
            "rounds": session.rounds}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=100_000, help="claims on A (default 100000)")
    parser.add_argument("--reconcile-n", type=int, default=1_000_000, help="in-memory ids")
    args = parser.parse_args(argv)
    key = nacl.signing.SigningKey.generate()
    ts = now_ms()
    print(f"signing {2 * args.n:,} claims …", flush=True)
    on_a, on_b = make_claims(key, args.n, ts, "a"), make_claims(key, args.n, ts, "b")
    diff = max(2, args.n // 1000)
    extra_a = make_claims(key, diff // 2, ts, "extra a")
    extra_b = make_claims(key, diff - diff // 2, ts, "extra b")
    ok = True
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        dirs = [Path(tmp) / name / "data" for name in ("a", "pull", "post")]
        for d in dirs:
            d.parent.mkdir()
        env = {"METANODE_PEER_POLL_S": "0.05", "METANODE_WATCH_ENABLED": "false"}
        with (
            harness.metanode_server(dirs[0], **env) as a,
            harness.metanode_server(dirs[1], **env) as pull,
            harness.metanode_server(dirs[2], **env) as post,
        ):
            for server, d in ((a, dirs[0]), (pull, dirs[1]), (post, dirs[2])):
                harness.register_signer(server, d, key)
            harness.post_all(a, dirs[0], bodies(on_a))
            token = peer_token(dirs[0])
            print(f"pulling {args.n:,} claims A → B …", flush=True)
            started = time.perf_counter()
            add_peer(pull, dirs[1], a.url, token)
            wait_row(pull, dirs[1], lambda row: row["accepted"] >= args.n, 3600)
            pull_rate = args.n / (time.perf_counter() - started)
            print(f"posting {args.n:,} claims to B's twin …", flush=True)
            headers = {**harness.auth(dirs[2]), "Content-Type": "application/json"}
            posted = bodies(on_b)
            elapsed = asyncio.run(
                harness.post_batches(post.url, headers, posted, [1000] * len(posted), 1)
            )
            post_rate = args.n / elapsed
            ratio = pull_rate / post_rate
            ok &= ratio >= PULL_GOAL
            print(f"pull {pull_rate:,.0f} claims/s, POST {post_rate:,.0f} claims/s (1 client, "
                  f"batches of 1,000): ratio {ratio:.2f} (goal >= {PULL_GOAL})")  # fmt: skip

            r = httpx.delete(f"{pull.url}/api/peers/a", headers=harness.auth(dirs[1]))
            assert r.status_code == 200, r.text
            harness.post_all(a, dirs[0], bodies(extra_a))
            harness.post_all(pull, dirs[1], bodies(extra_b))
            add_peer(pull, dirs[1], a.url, token)
            row = wait_row(pull, dirs[1], lambda row: row["last_sync"] is not None, 600)
            sync = row["last_sync"]
            full = log_bytes(a, token)
            moved = sync["bytes_sent"] + sync["bytes_received"]
            share = moved / full
            ok &= sync["seconds"] < RECONCILE_S_GOAL and share < RECONCILE_SHARE_GOAL
            print(f"reconcile {args.n + diff // 2:,} vs {args.n + diff - diff // 2:,} claims "
                  f"({diff} differ): {sync['rounds']} rounds, {sync['seconds']:.2f} s, "
                  f"{moved:,} bytes ({share:.3%} of the full log, {full:,} bytes); fetched "
                  f"{sync['fetched']}, B-only {sync['have']}")  # fmt: skip
    memory = in_memory(args.reconcile_n, args.reconcile_n // 1000)
    print(f"in memory, {args.reconcile_n:,} ids with 0.1% differing: sets built in "
          f"{memory['build_s']:.2f} s, reconciled in {memory['run_s']:.2f} s over "
          f"{memory['rounds']} rounds, {memory['bytes']:,.0f} bytes of JSON")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
