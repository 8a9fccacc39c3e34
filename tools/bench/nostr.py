"""metanode's one-claim ingest vs nostr-relay's kind-1 events, 8 clients each, in one run.

Run: `.venv/bin/python tools/bench/nostr.py [--rounds 3] [--seconds 5] [--clients 8]
[--venv DIR]`.

nostr-relay (PyPI `nostr-relay`, a Python relay on uvicorn and SQLite, the reference issue 18
names) is installed with pip from the package registry into a throw-away venv in a temporary
directory (`--venv DIR` keeps and reuses one instead), and served with its default `serve`
(gunicorn, one uvicorn worker, its default SQLite storage in the temporary directory) on a
free 127.0.0.1 port. Both servers run one process.

Each round:
* metanode (first in the first round, which sets M; then the order alternates): a fresh data
  directory and `metanode serve` (harness.metanode_server, one process); `wrk` (one thread,
  `--clients` connections) posts pre-signed one-claim bodies of new records for `--seconds`
  (ingest.py's `--batch 1 --wrk`); M = the claims accepted, all 200.
* nostr-relay: a fresh database; as many kind-1 events as metanode's last round accepted (M)
  (a fresh key, each event its own content, signed with BIP-340 Schnorr before the clock
  starts) posted by `--clients` websocket connections, one `["EVENT", …]` message at a time,
  each answered
  `["OK", id, true, …]` before the connection sends its next (NIP-01/20); time = first send
  to last OK. The poster runs in the relay's venv (it needs the relay's `websockets` and
  `aionostr`/`coincurve`); its CPU is printed, as it shares the two cores with the server.

Ratio = metanode claims/s ÷ nostr-relay events/s (issue 18's goal: >= 3).
Different durability: metanode commits with `synchronous=FULL` (an fsync per transaction);
nostr-relay's SQLite runs `synchronous=normal` (no fsync per event).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import ingest
import nacl.signing

from metanode.clock import now_ms

GOAL = 3.0
RELAY = "nostr-relay>=1.14"
POSTER = """
import asyncio, json, os, sys, time
import websockets
from aionostr.event import Event
from aionostr.key import PrivateKey

url, count, clients = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
key = PrivateKey()
events = []
for n in range(count):
    event = Event(pubkey=key.public_key.hex(), content=f"note {n} {os.urandom(8).hex()}", kind=1)
    event.sign(key.hex())
    events.append(json.dumps(["EVENT", event.to_json_object()]))
queue = iter(events)
refused = []

async def client():
    async with websockets.connect(url, compression=None, max_queue=None) as ws:
        for message in queue:
            await ws.send(message)
            answer = json.loads(await ws.recv())
            if answer[0] != "OK" or answer[2] is not True:
                refused.append(answer)

async def main():
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start

cpu = sum(os.times()[:2])
elapsed = asyncio.run(main())
print(json.dumps({"seconds": elapsed, "refused": refused[:3], "nrefused": len(refused),
                  "cpu": sum(os.times()[:2]) - cpu}))
"""
CONFIG = """\
DEBUG: false
relay_name: bench relay
storage:
  sqlalchemy.url: sqlite+aiosqlite:///{db}
  num_concurrent_reqs: 10
  num_concurrent_adds: 2
  validators:
    - nostr_relay.validators.is_not_too_large
    - nostr_relay.validators.is_signed
    - nostr_relay.validators.is_recent
    - nostr_relay.validators.is_not_hellthread
verification:
  nip05_verification: disabled
gunicorn:
  bind: 127.0.0.1:{port}
  workers: 1
  loglevel: warning
  reload: false
authentication:
  enabled: false
message_timeout: 1800
subscription_limit: 32
max_limit: 6000
hellthread_limit: 100
"""


def relay_venv(where: Path) -> Path:
    """A venv at `where` with nostr-relay installed from the package registry (kept if it is
    there already); its python."""
    python = where / "bin" / "python"
    if not (where / "bin" / "nostr-relay").exists():
        print(f"installing {RELAY} into {where} …", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", RELAY], check=True, timeout=900
        )
    return python


def metanode_round(seconds: float, clients: int) -> tuple[int, float, float]:
    """(claims accepted, claims/s, server CPU seconds) of one-claim requests of new records."""
    key = nacl.signing.SigningKey.generate()
    ts = now_ms()
    signed = ingest.make_claims(key, int(seconds * 3000) + 1000, ts, "note")
    bodies = [harness.claims_body([c]) for c in signed]
    with tempfile.TemporaryDirectory(prefix="metanode-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        with harness.metanode_server(data_dir) as server:
            harness.register_signer(server, data_dir, key)
            harness.post_all(server, data_dir, bodies[-100:])  # warm-up, untimed
            before = harness.tree_cpu(server.pid)
            sent, elapsed = ingest.wrk_ingest(server, data_dir, bodies[:-100], clients, seconds)
            cpu = harness.tree_cpu(server.pid) - before
    return sent, sent / elapsed, cpu


def relay_round(python: Path, count: int, clients: int) -> tuple[float, float, float]:
    """(events/s, server CPU seconds, poster CPU seconds) for `count` kind-1 events."""
    with tempfile.TemporaryDirectory(prefix="nostr-bench-") as tmp:
        port = harness.free_port()
        config = Path(tmp) / "config.yaml"
        config.write_text(CONFIG.format(db=Path(tmp) / "nostr.sqlite3", port=port))
        poster = Path(tmp) / "poster.py"
        poster.write_text(POSTER)
        relay = harness.ServerProc(
            [str(python.with_name("nostr-relay")), "-c", str(config), "serve"],
            port,
            cwd=Path(tmp),
            log_path=Path(tmp) / "relay.log",
        )
        relay.start("/")
        try:
            before = harness.tree_cpu(relay.pid)
            done = subprocess.run(
                [str(python), str(poster), f"ws://127.0.0.1:{port}/", str(count), str(clients)],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            cpu = harness.tree_cpu(relay.pid) - before
        finally:
            relay.stop()
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["nrefused"]:
        raise RuntimeError(f"nostr-relay refused {result['nrefused']} events: {result['refused']}")
    return count / result["seconds"], cpu, result["cpu"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both (default 3)")
    parser.add_argument("--seconds", type=float, default=5.0, help="metanode's wrk time")
    parser.add_argument("--clients", type=int, default=8, help="connections each (default 8)")
    parser.add_argument("--venv", type=Path, default=None, help="keep nostr-relay's venv here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.clients < 1 or args.seconds < 1:
        parser.error("need --rounds >= 1, --clients >= 1, --seconds >= 1")
    with tempfile.TemporaryDirectory(prefix="nostr-venv-") as scratch:
        python = relay_venv(args.venv or Path(scratch) / "venv")
        ratios, count = [], 0
        for round_ in range(args.rounds):
            order = ("metanode", "nostr") if round_ % 2 == 0 or not count else ("nostr", "metanode")
            results: dict[str, tuple[float, float, int]] = {}
            for side in order:
                if side == "metanode":
                    count, rate, cpu = metanode_round(args.seconds, args.clients)
                    results[side] = (rate, cpu, count)
                else:  # as many events as metanode's last round accepted claims
                    rate, cpu, client_cpu = relay_round(python, count, args.clients)
                    results[side] = (rate, cpu, count)
            ratio = results["metanode"][0] / results["nostr"][0]
            ratios.append(ratio)
            print(
                f"round {round_ + 1} ({' then '.join(order)}): metanode "
                f"{results['metanode'][0]:,.0f} claims/s ({results['metanode'][2]:,}, server "
                f"CPU {results['metanode'][1]:.2f} s), nostr-relay {results['nostr'][0]:,.0f} "
                f"events/s ({results['nostr'][2]:,}, server CPU {results['nostr'][1]:.2f} s, "
                f"poster {client_cpu:.2f} s): ratio {ratio:.2f}",
                flush=True,
            )
    median = statistics.median(ratios)
    print(f"ratio metanode ÷ nostr-relay (median of {len(ratios)}): {median:.2f} (goal >= {GOAL})")
    print(f"load average {os.getloadavg()[0]:.2f} at {time.strftime('%H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
