"""Following between real servers: a peer token made on one box, given to another as a peer,
and what each box then holds and says of its peers."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx

from tests.helpers.server import Server

TIMEOUT_S = 120.0  # a bound on one request to a busy server, not a measurement


def peer_token(server: Server, name: str) -> str:
    """`metanode peers token create` on the server's data directory (it may be running)."""
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "peers", "token", "create", "--name", name,
         "--data-dir", str(server.data_dir)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={k: v for k, v in os.environ.items() if not k.startswith("METANODE_")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def follow(follower: Server, url: str, token: str, name: str) -> None:
    """`POST /api/peers`: `follower` follows the box at `url` as `name`; it must be taken."""
    response = httpx.post(
        f"{follower.url}/api/peers",
        json={"url": url, "token": token, "name": name},
        headers=follower.headers,
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 200, response.text


def peer_row(server: Server, name: str) -> dict[str, Any]:
    """The peer `name` as `GET /api/peers` shows it."""
    response = httpx.get(f"{server.url}/api/peers", headers=server.headers, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()["peers"]
    return next(row for row in rows if row["name"] == name)


def post_claims(server: Server, claims: list[dict[str, Any]]) -> None:
    """POST /api/claims in batches of 1,000; every batch must be taken."""
    for start in range(0, len(claims), 1000):
        response = httpx.post(
            f"{server.url}/api/claims",
            json={"claims": claims[start : start + 1000]},
            headers=server.headers,
            timeout=TIMEOUT_S,
        )
        assert response.status_code == 200, response.text


def stored_sigs(server: Server) -> list[str]:
    """The signature of every claim in the box's claim log, in its order (a claim stored twice
    would be listed twice)."""
    out: list[str] = []
    params = {"limit": "1000"}
    while True:
        response = httpx.get(
            f"{server.url}/api/claims/log", params=params, headers=server.headers,
            timeout=TIMEOUT_S,
        )  # fmt: skip
        assert response.status_code == 200, response.text
        page = response.json()
        out += [claim["sig"] for claim in page["claims"]]
        if not page["more"]:
            return out
        params["after"] = page["next"]
