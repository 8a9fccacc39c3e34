"""A real `metanode serve` process (uvicorn): the HTTP round trip, shutdown and restart, and the
`metanode signers` command line working on the data directory while the server runs."""

from __future__ import annotations

import json
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from metanode import rid as rids
from tests.helpers.claims import Signer
from tests.helpers.server import Server

CID = cids.midhash_bytes(b"server round trip")


Track = Callable[[Server], Server]


def isolated(tmp_path: Path) -> dict[str, str]:
    """The watcher gets an empty folder of its own, not ./media of the working directory."""
    return {"METANODE_WATCH_ROOTS": str(tmp_path / "media")}


@pytest.fixture
def track() -> Iterator[Track]:
    """Register servers to be stopped at the end, whatever happens in the test."""
    started: list[Server] = []

    def add(srv: Server) -> Server:
        started.append(srv)
        return srv

    yield add
    for srv in started:
        if srv.proc is not None:
            srv.stop(signal.SIGKILL)
        srv.print_log()  # shown if the test failed


@pytest.fixture
def logged_server(tmp_path: Path, track: Track) -> Server:
    """A running server whose log is printed (shown on failure) at the end."""
    return track(Server(tmp_path / "data", env=isolated(tmp_path))).start()


def assert_envelope(response: httpx.Response, status: int, slug: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "message", "retryable"}, body
    assert body["error"] == slug
    assert isinstance(body["message"], str) and body["message"]
    assert body["retryable"] is False


def token_file(data_dir: Path) -> tuple[str, int]:
    path = data_dir / "api-token"
    return path.read_text(), stat.S_IMODE(path.stat().st_mode)


def truth_rid(data_dir: Path, cid: str) -> str:
    conn = sqlite3.connect(f"{(data_dir / 'truth.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT rid FROM cid_group WHERE cid = ?", (cid,)).fetchone()
    finally:
        conn.close()
    assert row is not None, f"{cid} is in no group"
    return str(row[0])


def test_round_trip_shutdown_and_restart(tmp_path: Path, track: Track) -> None:
    data = tmp_path / "data"
    srv = track(Server(data, env=isolated(tmp_path))).start()
    token_before = token_file(data)
    assert token_before[1] == 0o600
    assert token_before[0].strip() == srv.token and len(srv.token) >= 32

    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=10) as http:
        health = httpx.get(f"{srv.url}/health", timeout=10)  # public: no token
        assert health.status_code == 200
        assert health.json()["status"] == "ok" and health.json()["apply_lag"] == 0

        alice = Signer()
        response = http.post("/api/signers", json={"uid": alice.uid, "name": "alice"})
        assert response.status_code == 200, response.text
        assert {k: v for k, v in response.json().items() if k != "added_at"} == {
            "uid": alice.uid,
            "name": "alice",
            "weight": 1,
            "status": "active",
            "may_link": False,
        }

        batch = [alice.claim(CID, "title", "The Matrix"), alice.claim(CID, "year", "1999")]
        response = http.post("/api/claims", json={"claims": batch})
        assert response.status_code == 200, response.text
        assert response.json() == {
            "results": [{"status": "accepted"}] * 2,
            "accepted": 2,
            "duplicate": 0,
            "stale": 0,
            "applied": True,
        }
        response = http.post("/api/claims", json={"claims": batch})
        assert response.status_code == 200, response.text
        assert response.json() == {
            "results": [{"status": "duplicate"}] * 2,
            "accepted": 0,
            "duplicate": 2,
            "stale": 0,
            "applied": True,
        }

        doc = httpx.get(f"{srv.url}/api/meta/{CID}", timeout=10)  # public: no token
        assert doc.status_code == 200, doc.text
        expected_doc = {
            "cid": CID,
            "canonical_cid": CID,
            "cids": [CID],
            "paths": [],
            "metadata": {f"cids/{CID}": "true", "title": "The Matrix", "year": "1999"},
        }
        assert doc.json() == expected_doc

        assert_envelope(http.get("/api/meta/garbage"), 400, "invalid_cid")
        assert_envelope(http.get("/api/no-such-route"), 404, "not_found")
        assert_envelope(http.get("/api/claims"), 405, "method_not_allowed")

        rid = truth_rid(data, CID)
        assert rids.parse(rid) == rid
        response = http.get("/api/hash-ids")
        assert response.status_code == 200, response.text
        assert response.json() == {"hashIds": [rid], "next": None}

    rc = srv.stop(signal.SIGTERM)
    assert srv.log is not None
    log = srv.log.read_text()
    # A graceful stop: the lifespan shutdown (node.stop) ran to its end, and the exit is clean.
    assert "Application shutdown complete" in log, log
    assert rc == 0, log
    # a new node's first start makes its cache; it said "building … from the truth", a rebuild's
    assert "making the cache (first start)" in log and "building the cache again" not in log

    again = track(Server(data, env=isolated(tmp_path))).start()
    assert token_file(data) == token_before
    assert again.token == srv.token
    doc = httpx.get(f"{again.url}/api/meta/{CID}", timeout=10)
    assert doc.status_code == 200, doc.text
    assert doc.json() == expected_doc
    assert "did not stop cleanly" not in again.log_text()  # it did
    response = httpx.get(f"{again.url}/api/hash-ids", headers=again.headers, timeout=10)
    assert response.json() == {"hashIds": [rid], "next": None}
    assert httpx.get(f"{again.url}/health", timeout=10).json()["status"] == "ok"


def cli(data_dir: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "metanode", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == code, done.stdout + done.stderr
    return done


def cli_json(data_dir: Path, *args: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cli(data_dir, *args).stdout.splitlines() if line]


def wait_for_doc(
    url: str, want: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30.0
) -> dict[str, Any]:
    """Poll GET /api/meta/{CID} until `want(metadata)`; the applier polls the truth every 1 s."""
    deadline = time.monotonic() + timeout
    metadata: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = httpx.get(f"{url}/api/meta/{CID}", timeout=5)
        assert response.status_code == 200, response.text
        metadata = response.json()["metadata"]
        if want(metadata):
            return metadata
        time.sleep(0.1)
    raise AssertionError(f"within {timeout} s the record never showed {what}: {metadata}")


def test_signers_cli_while_the_server_runs(logged_server: Server) -> None:
    server = logged_server
    alice, bob = Signer(), Signer()
    added = cli_json(
        server.data_dir, "signers", "add", alice.uid, "--name", "alice", "--weight", "2"
    )
    assert len(added) == 1
    assert (added[0]["uid"], added[0]["weight"], added[0]["status"]) == (alice.uid, 2, "active")
    response = httpx.post(
        f"{server.url}/api/signers",
        headers=server.headers,
        timeout=10,
        json={"uid": bob.uid, "name": "bob"},
    )
    assert response.status_code == 200, response.text
    # (The node also registers a signer of its own for each built-in plugin.)
    listed = {row["uid"]: row for row in cli_json(server.data_dir, "signers", "list")}
    assert {alice.uid, bob.uid} <= set(listed)
    assert (listed[alice.uid]["name"], listed[bob.uid]["name"]) == ("alice", "bob")

    # alice (weight 2) outvotes bob on title; only alice claims year.
    batch = [
        alice.claim(CID, "title", "Alpha"),
        alice.claim(CID, "year", "1999"),
        bob.claim(CID, "title", "Beta"),
    ]
    response = httpx.post(
        f"{server.url}/api/claims", headers=server.headers, timeout=10, json={"claims": batch}
    )
    assert response.status_code == 200 and response.json()["accepted"] == 3, response.text
    doc = httpx.get(f"{server.url}/api/meta/{CID}", timeout=10).json()
    assert (doc["metadata"]["title"], doc["metadata"]["year"]) == ("Alpha", "1999")

    blocked = cli_json(server.data_dir, "signers", "block", alice.uid)
    assert blocked[0]["status"] == "blocked"
    wait_for_doc(
        server.url,
        lambda m: m.get("title") == "Beta" and "year" not in m,
        "alice's votes gone (title Beta, no year)",
    )
    signers = httpx.get(f"{server.url}/api/signers", headers=server.headers, timeout=10).json()
    status = {s["uid"]: s["status"] for s in signers["signers"]}
    assert (status[alice.uid], status[bob.uid]) == ("blocked", "active")
    response = httpx.post(
        f"{server.url}/api/claims",
        headers=server.headers,
        timeout=10,
        json={"claims": [alice.claim(CID, "genre", "SF")]},
    )
    assert response.status_code == 403, response.text
    assert response.json()["items"][0]["error"] == "blocked_signer"

    unblocked = cli_json(server.data_dir, "signers", "unblock", alice.uid)
    assert unblocked[0]["status"] == "active"
    wait_for_doc(
        server.url,
        lambda m: m.get("title") == "Alpha" and m.get("year") == "1999",
        "alice's votes back (title Alpha, year 1999)",
    )

    failed = cli(server.data_dir, "signers", "block", Signer().uid, code=2)
    assert failed.stderr.startswith("error: unknown_signer"), failed.stderr


def test_a_signer_posted_again_changes_only_what_is_given_and_the_owner_is_never_blocked(
    logged_server: Server,
) -> None:
    """POST /api/signers of a known signer keeps what the body leaves out (renaming never takes
    a weight or a link permission away, as `signers add` does); an explicit null is bad input;
    the box owner's key is refused a block or a new weight through the API and the CLI alike
    (`owner_key`), since every edit of the page would be refused or outweighed after."""
    server, alice = logged_server, Signer()

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{server.url}/api/signers", headers=server.headers, timeout=10, json=body
        )

    def row(body: dict[str, Any]) -> tuple[str, int, bool]:
        response = post(body)
        assert response.status_code == 200, response.text
        got = response.json()
        return got["name"], got["weight"], got["may_link"]

    assert row({"uid": alice.uid}) == ("", 1, False)
    assert row({"uid": alice.uid, "name": "alice", "weight": 7, "may_link": True}) == (
        "alice",
        7,
        True,
    )
    assert row({"uid": alice.uid, "name": "renamed"}) == ("renamed", 7, True)
    assert row({"uid": alice.uid, "weight": 0}) == ("renamed", 0, True)
    assert row({"uid": alice.uid, "may_link": False}) == ("renamed", 0, False)
    for bad in ({"weight": None}, {"name": None}, {"may_link": None}):
        assert_envelope(post({"uid": alice.uid, **bad}), 400, "invalid_request")

    signers = httpx.get(f"{server.url}/api/signers", headers=server.headers, timeout=10).json()
    owner = next(s["uid"] for s in signers["signers"] if s["name"] == "owner")
    refused = httpx.post(
        f"{server.url}/api/signers/{owner}/block", headers=server.headers, timeout=10
    )
    assert_envelope(refused, 403, "owner_key")
    assert_envelope(post({"uid": owner, "weight": 0}), 403, "owner_key")  # silenced as surely
    for args in (("block", owner), ("add", owner, "--weight", "0")):
        failed = cli(server.data_dir, "signers", *args, code=2)
        assert failed.stderr.startswith("error: owner_key: "), failed.stderr
    unblocked = httpx.post(
        f"{server.url}/api/signers/{owner}/unblock", headers=server.headers, timeout=10
    )
    assert unblocked.status_code == 200, unblocked.text
    signers = httpx.get(f"{server.url}/api/signers", headers=server.headers, timeout=10).json()
    assert next(s["status"] for s in signers["signers"] if s["uid"] == owner) == "active"
