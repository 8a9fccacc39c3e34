"""Peers exchange signed claims (issue 19, docs/peers.md): the claim log, peer tokens, following
a peer between two real `metanode serve` processes, a hostile peer, a crash mid-sync, and the
set reconciliation (pure, against a naive set difference; and between two real servers)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from metanode import cid as cids
from metanode import maintenance, peers, reconcile
from metanode.api import create_app
from metanode.errors import InvalidRequest
from metanode.node import Node
from metanode.server import protocol_for
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.server import Server, free_port, metanode_check, wait_caught_up

pytestmark = pytest.mark.both_backends  # the tests on a `node` run on both

ENV = {
    "METANODE_PEER_POLL_S": "0.2",
    "METANODE_PEER_RETRY_S": "0.2",
    "METANODE_PEER_MAX_BACKOFF_S": "1",
    "METANODE_WATCH_ENABLED": "false",
}
DEADLINE_S = 60.0


# -- helpers ------------------------------------------------------------------------------------


def cid(tag: str) -> str:
    return cids.midhash_bytes(f"peers {tag}".encode())


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Poll `condition` until it is truthy (and return it), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "metanode", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("METANODE_")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def peer_token(server: Server, name: str) -> str:
    """`metanode peers token create` on the server's data directory (it is running)."""
    return cli("peers", "token", "create", "--name", name, "--data-dir", str(server.data_dir))


def add_peer(follower: Server, followed: Server, token: str, name: str = "a") -> dict[str, Any]:
    """`metanode peers add` against the running follower."""
    out = cli(
        "peers", "add", followed.url, "--token", token.strip(), "--name", name,
        "--url", follower.url, "--data-dir", str(follower.data_dir),
    )  # fmt: skip
    added: dict[str, Any] = json.loads(out)
    return added


def follow_url(server: Server, url: str, token: str = "t") -> None:
    """`POST /api/peers` of a fake peer's address (named `a`), which must be taken."""
    response = httpx.post(
        f"{server.url}/api/peers",
        json={"url": url, "token": token, "name": "a"},
        headers=server.headers,
        timeout=DEADLINE_S,
    )
    assert response.status_code == 200, response.text


def peer_status(server: Server, name: str = "a") -> dict[str, Any]:
    out = cli("peers", "list", "--url", server.url, "--data-dir", str(server.data_dir))
    rows = {row["name"]: row for row in map(json.loads, out.splitlines())}
    return rows[name]


def post(server: Server, claims: list[dict[str, Any]]) -> dict[str, Any]:
    for start in range(0, len(claims), 1000):
        response = httpx.post(
            f"{server.url}/api/claims",
            json={"claims": claims[start : start + 1000]},
            headers=server.headers,
            timeout=120,
        )
        assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def log_of(url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """Every claim of a box's claim log, page by page."""
    out: list[dict[str, Any]] = []
    params: dict[str, str] = {"limit": "1000"}
    while True:
        response = httpx.get(f"{url}/api/claims/log", params=params, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        page = response.json()
        out.extend(page["claims"])
        if not page["more"]:
            return out
        params["after"] = page["next"]


def claim_set(server: Server, but: frozenset[str] | set[str] = frozenset()) -> set[str]:
    """The signatures of a box's stored claims, less those of signers in `but`."""
    return {c["sig"] for c in log_of(server.url, server.headers) if c["uid"] not in but}


def two_sets(
    pair: tuple[Server, Server], tag: str, shared: int, only_a: int
) -> tuple[Signer, list[dict[str, Any]], list[dict[str, Any]]]:
    """A signer registered on both boxes, and its title claims: `shared` of them meant for
    both, `only_a` for A alone (tagged `tag`, so tests do not meet)."""
    signer = Signer()
    for srv in pair:
        srv.register(signer.uid, "t")
    both = fast_claims(signer, [(cid(f"{tag}{i}"), "title", f"{i}", NOW_MS) for i in range(shared)])
    mine = fast_claims(signer, [(cid(f"{tag}a{i}"), "title", "a", NOW_MS) for i in range(only_a)])
    return signer, both, mine


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    """Two real servers, A and B, on loopback."""
    servers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        servers.append(Server(tmp_path / name / "data", env=dict(ENV)).start())
    yield servers[0], servers[1]
    for srv in servers:
        srv.stop()
        srv.print_log()


# -- following a peer ---------------------------------------------------------------------------


def test_b_follows_a_and_ends_with_a_s_documents_live_and_through_tombstones(
    pair: tuple[Server, Server],
) -> None:
    a, b = pair
    s1, s2, s3, stranger = Signer(), Signer(), Signer(), Signer()
    for srv in (a, b):  # B trusts these three as A does
        srv.register(s1.uid, "t", weight=2, may_link=True)
        srv.register(s2.uid, "t")
        srv.register(s3.uid, "t", may_link=True)
    a.register(stranger.uid, "t", may_link=True)  # only A knows this one
    c = [cid(f"c{i}") for i in range(8)]
    post(a, [s1.claim(c[i], "title", f"one {i}") for i in range(8)])
    post(a, [s2.claim(c[i], "title", f"two {i}") for i in range(0, 8, 2)])
    post(a, [s3.claim(c[i], "year", str(1990 + i)) for i in range(8)])
    post(a, [s1.claim(c[0], f"cids/{c[1]}", "true"), s3.claim(c[2], f"cids/{c[3]}", "true")])
    post(a, [s2.claim(c[4], "title", None, ts=NOW_MS + 1)])  # a tombstone replaces a vote
    s = [cid(f"stranger{i}") for i in range(2)]
    post(a, [stranger.claim(s[0], "title", "theirs"), stranger.claim(s[0], f"cids/{s[1]}", "true")])

    add_peer(b, a, peer_token(a, "b"))
    theirs = {stranger.uid}
    wait_for(lambda: claim_set(b, theirs) == claim_set(a, theirs), "B to hold A's claims")
    wait_caught_up(b.url)
    for x in c:
        assert b.meta(x) == a.meta(x), x
    assert b.meta(c[0])["cids"] == a.meta(c[1])["cids"]  # the link merged B's groups too

    # the stranger: learnt from the peer at its weight (0), listed, not counted, may not link
    learned = {s["uid"]: s for s in httpx.get(f"{b.url}/api/signers", headers=b.headers).json()[
        "signers"
    ]}[stranger.uid]  # fmt: skip
    assert (learned["learned_from"], learned["weight"], learned["may_link"]) == ("a", 0, False)
    assert learned["name"] == "t (via a)"  # A's own name for it, and through which peer
    listing = httpx.get(f"{b.url}/api/meta/{s[0]}/claims").json()
    assert [cl["value"] for cl in listing["claims"]] == ["theirs"]
    assert "title" not in b.meta(s[0])["metadata"]
    assert b.meta(s[1]) is None  # its link was refused
    status = peer_status(b)
    assert (status["accepted"], status["rejected"], status["duplicate"]) == (
        len(claim_set(a)) - 1,
        1,
        0,
    )
    assert status["last_rejected"] == (  # the refused link says why, and which claim
        f"link_not_permitted: signer {stranger.uid} may not link groups (may_link is off) "
        f"(cids/{s[1]} of {s[0]})"
    ), status

    # live: a later claim on A reaches B; a tombstone on A retracts it on B
    post(a, [s2.claim(c[5], "genre", "noir")])
    wait_for(lambda: b.meta(c[5])["metadata"].get("genre") == "noir", "the new claim on B")
    post(a, [s2.claim(c[5], "genre", None, ts=NOW_MS + 1)])
    wait_for(lambda: "genre" not in b.meta(c[5])["metadata"], "the tombstone on B")
    wait_caught_up(b.url)
    assert b.meta(c[5]) == a.meta(c[5])
    assert peer_status(b)["last_error"] == ""

    # A stops answering: B says so, and no longer counts itself caught up with it
    logged = len(b.log_text())
    a.stop()
    wait_for(lambda: peer_status(b)["last_error"].startswith("peer_failed"), "B to see A fail")
    wait_for(lambda: peer_status(b)["lag_s"] > 0, "B's lag behind the silent A to grow")
    health = httpx.get(f"{b.url}/health", timeout=10).json()  # it said ok: only `peers list` knew
    assert health["status"] == "degraded"
    said = "peer a failed its last pull (retrying): peer_failed: "  # a peer down: followed on
    assert any(p.startswith(said) for p in health["problems"]), health
    # tried again and again (back-off capped at 1 s here), said once in the log, not each time
    wait_for(lambda: peer_status(b)["lag_s"] > 4, "B to try the silent A a few times")
    since = b.log_text()[logged:]  # one line for the outage, however it is worded: a pull
    assert since.count("peer a: ") == 1, since  # failed earlier words it "again and again"
    a.start()
    wait_for(lambda: peer_status(b)["last_error"] == "", "B to reach A again")
    assert "peer a answers again" in b.log_text()


def test_a_box_followed_already_is_refused_under_another_address(
    pair: tuple[Server, Server],
) -> None:
    """`localhost` and `127.0.0.1` are two addresses of one box: followed under both, every
    claim travelled twice. The box is known by the instance id it answers with."""
    a, b = pair
    signer = Signer()
    a.register(signer.uid, "t")
    post(a, [signer.claim(cid("twice"), "title", "once")])
    token = peer_token(a, "b")
    add_peer(b, a, token)
    wait_for(lambda: peer_status(b)["cursor"], "B's first page of A's log")
    other = a.url.replace("127.0.0.1", "localhost")
    body = {"url": other, "token": token.strip(), "name": "a2"}
    twice = httpx.post(f"{b.url}/api/peers", json=body, headers=b.headers, timeout=DEADLINE_S)
    assert (twice.status_code, twice.json()["error"]) == (400, "invalid_request"), twice.text
    assert f"{other} is the box followed already as the peer 'a'" in twice.json()["message"]
    moved = httpx.post(  # under its own name, the address may change
        f"{b.url}/api/peers", json={**body, "name": "a"}, headers=b.headers, timeout=DEADLINE_S
    )
    assert (moved.status_code, moved.json()["url"]) == (200, other), moved.text
    assert [
        p["name"] for p in httpx.get(f"{b.url}/api/peers", headers=b.headers).json()["peers"]
    ] == ["a"]


def test_a_box_restored_from_a_backup_is_followed_on_without_a_gap(
    pair: tuple[Server, Server], tmp_path: Path
) -> None:
    """A review restored A from a backup while B followed it: A gave the seqs after the
    backup's end again to new claims, B's cursor (taken in the longer log) was a place in the
    new one, and B skipped the new claims below it, showing no error. Now a restore gives the
    log a new id: B's cursor is refused, and B reconciles by itself and reads on."""
    a, b = pair
    signer, kept, lost = two_sets(pair, "restore", 50, 50)
    post(a, kept)
    token = peer_token(a, "b")  # before the backup: a token made after it is gone with the rest
    backup = cli("backup", str(tmp_path / "bk"), "--data-dir", str(a.data_dir)).strip()
    post(a, lost)
    add_peer(b, a, token)
    wait_for(lambda: claim_set(b) >= claim_set(a), "B to hold A's claims")
    a.stop()
    cli("restore", backup, "--data-dir", str(a.data_dir))
    a.start()
    fresh = fast_claims(signer, [(cid(f"restored{i}"), "year", str(i), NOW_MS) for i in range(80)])
    post(a, fresh)  # more than `lost`: A's log now runs past B's old cursor
    wait_for(lambda: claim_set(b) >= claim_set(a), "B to hold every claim of the restored A")
    assert {c["sig"] for c in lost} <= claim_set(b)  # what A lost, B keeps
    wait_for(lambda: peer_status(b)["last_error"] == "", "B to follow A without an error")


def test_a_follower_killed_mid_sync_ends_with_exactly_the_peer_s_claims(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Server(tmp_path / "a" / "data", env=dict(ENV)).start()
    b = Server(tmp_path / "b" / "data", env={**ENV, "METANODE_PEER_PAGE_CLAIMS": "10"}).start()
    try:
        signer = Signer()
        a.register(signer.uid, "t")
        b.register(signer.uid, "t")
        total = 3000
        post(
            a, fast_claims(signer, [(cid(f"k{i}"), "title", f"t{i}", NOW_MS) for i in range(total)])
        )
        add_peer(b, a, peer_token(a, "b"))
        wait_for(lambda: peer_status(b)["accepted"] > 0, "the first pages on B", timeout=120)
        b.stop(9)  # SIGKILL, mid-sync
        b.start()
        at_restart = peer_status(b)["accepted"]
        assert at_restart > 0, at_restart
        want = claim_set(a)
        wait_for(lambda: claim_set(b) == want, "B to hold exactly A's claims", timeout=120)
        status = peer_status(b)
        # every claim was applied once: the counts moved in the pages' transactions
        assert (status["accepted"], status["duplicate"], status["rejected"]) == (total, 0, 0)
        wait_caught_up(b.url)
    finally:
        b.stop()
        a.stop()
    metanode_check(b.data_dir)


def unpadded(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class FakePeer:
    """A tiny Starlette app on uvicorn in a thread: a claim log serving one fixed page; with
    `splits`, a reconciliation that never ends (every range asked split in 16 that disagree)."""

    def __init__(
        self, page: list[dict[str, Any]], refuse_cursors: bool = False, splits: bool = False
    ) -> None:
        self.page = page
        self.asked: list[str | None] = []
        self.rounds = 0

        async def log(request: Request) -> JSONResponse:
            after = request.query_params.get("after")
            self.asked.append(after)
            if after is None:
                return JSONResponse({"claims": self.page, "next": "fake.3", "more": False})
            if refuse_cursors:  # as a box whose log is another than the cursor's
                error = {"error": "invalid_cursor", "message": "another log", "retryable": False}
                return JSONResponse(error, status_code=400)
            return JSONResponse({"claims": [], "next": after, "more": False})

        async def split(request: Request) -> JSONResponse:
            self.rounds += 1
            ranges = [
                {"lower": reconcile.encode_id(low), "upper": reconcile.encode_id(low + b"\x01"),
                 "fp": reconcile.encode_id(os.urandom(16)), "count": 99}
                for asked in (await request.json())["ranges"]
                for n in range(16)
                if (low := unpadded(asked["lower"]) + bytes([16 * n + 1]))
            ]  # fmt: skip
            return JSONResponse({"ranges": ranges, "head": "fake.3"})

        routes = [Route("/api/claims/log", log)]
        if splits:
            routes.append(Route("/api/claims/reconcile", split, methods=["POST"]))
        app = Starlette(routes=routes)
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakePeer:
        self.thread.start()
        wait_for(lambda: self.server.started, "the fake peer to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_a_forged_and_a_replayed_claim_from_a_peer_are_counted_and_only_the_valid_lands(
    server: Server,
) -> None:
    b = server
    signer = Signer()
    b.register(signer.uid, "t")
    here, forged_cid, valid_cid = cid("here"), cid("forged"), cid("valid")
    post(b, [signer.claim(here, "title", "newer", ts=NOW_MS + 10)])
    forged = {**signer.claim(forged_cid, "title", "x"), "value": "forged"}
    replayed = signer.claim(here, "title", "older", ts=NOW_MS)
    valid = signer.claim(valid_cid, "title", "valid")
    with FakePeer([forged, replayed, valid]) as fake:
        follow_url(b, fake.url, "whatever")
        status = wait_for(
            lambda: (
                (row := peer_status(b))["accepted"] + row["rejected"] + row["stale"] == 3 and row
            ),
            "the fake page on B",
        )
        assert (status["accepted"], status["rejected"], status["stale"]) == (1, 1, 1)
        assert status["last_rejected"].startswith("bad_signature: "), status
        assert status["cursor"] == "fake.3"
    wait_caught_up(b.url)
    assert b.meta(forged_cid) is None
    assert b.meta(here)["metadata"]["title"] == "newer"
    assert b.meta(valid_cid)["metadata"]["title"] == "valid"


def test_a_peer_that_refuses_every_cursor_is_read_from_its_start_not_hammered(
    server: Server,
) -> None:
    """A refused cursor sends the follower back to reconciling; a peer that cannot reconcile
    (an older version: 404) was then asked with the same refused cursor again, at once, for
    ever (600 requests a second in a review). The refused cursor is dropped and the log read
    from its start; a refusal of the next cursor too is a failure, said and backed off."""
    signer = Signer()
    server.register(signer.uid, "t")
    with FakePeer([signer.claim(cid("refusing"), "title", "x")], refuse_cursors=True) as fake:
        follow_url(server, fake.url, "whatever")
        asked = wait_for(lambda: len(fake.asked) >= 6 and list(fake.asked), "six log reads")
        status = wait_for(lambda: (row := peer_status(server))["last_error"] and row, "a failure")
    # the first: `peers add` asking whether the address is this box itself
    assert asked[:6] == [None, None, "fake.3", None, "fake.3", "fake.3"], asked
    assert status["last_error"] == "peer_failed: /api/claims/log answered 400 invalid_cursor"


# -- the claim log and peer tokens (in process) -------------------------------------------------


async def test_the_claim_log_orders_stored_claims_and_refuses_foreign_cursors(
    node: Node, client: httpx.AsyncClient
) -> None:
    one, two = Signer(), Signer()
    for signer in (one, two):
        await node.add_signer(signer.uid, "t", 1, False)
    first = [one.claim(cid("l1"), "title", "a"), two.claim(cid("l2"), "title", "b")]
    newer = one.claim(cid("l1"), "title", "c", ts=NOW_MS + 1)
    for batch in (first, [newer]):
        assert (await client.post("/api/claims", json={"claims": batch})).status_code == 200
    page = (await client.get("/api/claims/log")).json()
    assert [c["value"] for c in page["claims"]] == ["b", "c"]  # "a" was superseded
    assert page["more"] is False
    small = (await client.get("/api/claims/log", params={"limit": 1})).json()
    assert (len(small["claims"]), small["more"]) == (1, True)
    rest = (await client.get("/api/claims/log", params={"after": small["next"]})).json()
    assert [c["value"] for c in rest["claims"]] == ["c"]
    mine = (await client.get("/api/claims/log", params={"signer": two.uid})).json()
    assert [c["value"] for c in mine["claims"]] == ["b"]
    end = (await client.get("/api/claims/log", params={"after": page["next"]})).json()
    assert (end["claims"], end["next"]) == ([], page["next"])
    log_id, _, seq = page["next"].partition(".")
    for bad in ("garbage", f"{log_id}.x", f"0000000000000000.{seq}", f"{log_id}.{int(seq) + 5}"):
        response = await client.get("/api/claims/log", params={"after": bad})
        assert (response.status_code, response.json()["error"]) == (400, "invalid_cursor"), bad


async def test_peer_tokens_read_the_log_and_reconcile_and_nothing_else(
    node: Node, client: httpx.AsyncClient
) -> None:
    token = maintenance.create_peer_token(node.settings, "friend")
    peer = {"Authorization": f"Bearer {token}"}
    assert (await client.get("/api/claims/log", headers=peer)).status_code == 200
    opening = reconcile.encode(reconcile.Session(reconcile.Items([])).start())
    answer = await client.post("/api/claims/reconcile", json={"ranges": opening}, headers=peer)
    assert answer.status_code == 200, answer.text
    assert (await client.get(f"/api/meta/{cid('none')}", headers=peer)).status_code == 404
    for method, path in (
        ("POST", "/api/claims"),
        ("GET", "/api/signers"),
        ("GET", "/api/peers"),
        ("GET", "/api/hash-ids"),
        ("GET", "/metrics"),
    ):
        response = await client.request(method, path, headers=peer, json={"claims": []})
        assert (response.status_code, response.json()["error"]) == (403, "peer_token_scope"), path
    wrong = {"Authorization": "Bearer not-a-token"}
    assert (await client.get("/api/claims/log", headers=wrong)).status_code == 401
    assert [row.name for row in maintenance.peer_tokens(node.settings)] == ["friend"]
    maintenance.revoke_peer_token(node.settings, "friend")
    assert (await client.get("/api/claims/log", headers=peer)).status_code == 401


async def test_a_peer_url_that_does_not_even_split_is_named_not_a_500(
    client: httpx.AsyncClient,
) -> None:
    """`http://[::1` made urlsplit raise ValueError (500 `internal_error`)."""
    response = await client.post("/api/peers", json={"url": "http://[::1", "token": "x"})
    assert (response.status_code, response.json()["error"]) == (400, "invalid_request")
    assert "'http://[::1' is not a node's address" in response.json()["message"]
    assert (await client.get("/api/peers")).json()["peers"] == []


async def test_an_address_followed_under_one_name_is_refused_under_another(
    client: httpx.AsyncClient,
) -> None:
    """The same box added as `c` and again as the default `host:port` name was followed twice:
    every claim travelled twice, each name's counts held half of them."""
    nobody = f"http://127.0.0.1:{free_port()}"
    first = await client.post("/api/peers", json={"url": nobody, "token": "x", "name": "c"})
    assert first.status_code == 200, first.text
    twice = await client.post("/api/peers", json={"url": nobody + "/", "token": "y", "name": "d"})
    assert (twice.status_code, twice.json()["error"]) == (400, "invalid_request")
    assert "is followed already, as the peer 'c'" in twice.json()["message"]
    again = await client.post("/api/peers", json={"url": nobody, "token": "y", "name": "c"})
    assert again.status_code == 200, again.text  # the same name: its token changes
    assert [p["name"] for p in (await client.get("/api/peers")).json()["peers"]] == ["c"]


# -- reconciliation -----------------------------------------------------------------------------


def _over_json(items: reconcile.Items) -> Callable[[list[reconcile.Fingerprint]], Any]:
    """A responder holding `items`, reached through the JSON wire form both ways."""

    def answer(message: list[reconcile.Fingerprint]) -> list[reconcile.Entry]:
        asked = reconcile.decode_fingerprints(json.loads(json.dumps(reconcile.encode(message))))
        reply = reconcile.respond(items, asked)
        return reconcile.decode_reply(json.loads(json.dumps(reconcile.encode(reply))), 16)

    return answer


ids16 = st.binary(min_size=16, max_size=16)


@settings(max_examples=200, deadline=None)
@given(
    shared=st.sets(ids16, max_size=300),
    mine=st.sets(ids16, max_size=40),
    theirs=st.sets(ids16, max_size=40),
    leaf=st.integers(1, 20),
    branches=st.integers(2, 20),
)
def test_reconciliation_finds_exactly_the_naive_set_difference(
    shared: set[bytes], mine: set[bytes], theirs: set[bytes], leaf: int, branches: int
) -> None:
    local, remote = shared | mine, shared | theirs
    responder = reconcile.Items(remote)
    session = reconcile.run(
        reconcile.Items(local), lambda m: reconcile.respond(responder, m, leaf, branches)
    )
    assert session.need == remote - local
    assert session.have == local - remote


@settings(max_examples=50, deadline=None)
@given(shared=st.sets(ids16, max_size=200), theirs=st.sets(ids16, max_size=20))
def test_reconciliation_over_the_wire_form_agrees(shared: set[bytes], theirs: set[bytes]) -> None:
    session = reconcile.run(reconcile.Items(shared), _over_json(reconcile.Items(shared | theirs)))
    assert (session.need, session.have) == (theirs - shared, set())


def test_reconciling_100000_shared_and_100_differing_sends_only_what_differs() -> None:
    rng = __import__("random").Random(19)
    shared = [rng.randbytes(16) for _ in range(100_000)]
    only_mine = {rng.randbytes(16) for _ in range(50)}
    only_theirs = {rng.randbytes(16) for _ in range(50)}
    session = reconcile.run(
        reconcile.Items([*shared, *only_mine]),
        _over_json(reconcile.Items([*shared, *only_theirs])),
    )
    assert (session.need, session.have) == (only_theirs, only_mine)
    # each of the 100 differences opens at most one leaf of at most LEAF ids per round it is
    # in, and at most BRANCHES fingerprints per differing range: nothing near 100,000
    assert session.ids_received <= 100 * reconcile.LEAF
    assert session.fingerprints_received <= session.rounds * 100 * reconcile.BRANCHES
    assert session.fingerprints_sent <= session.fingerprints_received + 1


def test_a_round_of_more_than_max_ranges_goes_in_requests_a_responder_takes() -> None:
    """A box lacking nearly all of another's 6,000 ids reaches a round of ≈ 4,096 differing
    ranges; each request of it holds at most `REQUEST_RANGES`, and the replies joined settle
    it as one reply would."""
    rng = __import__("random").Random(7)
    theirs = {rng.randbytes(16) for _ in range(6000)}
    mine = {rng.randbytes(16) for _ in range(20)}
    over_json = _over_json(reconcile.Items(theirs))
    asked: list[int] = []

    def answer(message: list[reconcile.Fingerprint]) -> list[reconcile.Entry]:
        asked.append(len(message))
        return over_json(message)

    session = reconcile.run(reconcile.Items(mine), answer)
    assert (session.need, session.have) == (theirs, mine)
    assert max(asked) == reconcile.REQUEST_RANGES  # a round was split
    assert session.fingerprints_sent > 2 * reconcile.REQUEST_RANGES


async def test_a_reconciliation_asking_more_than_max_ranges_is_refused_before_any_work(
    node: Node, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100,000 ranges (7.4 MB, a peer token's) took 19 s and answered 114 MB: one over the
    bound is 413 `too_large`, the responder not even asked for its ids. A round an older
    follower sends whole, thousands of ranges, is answered: refused, it asked for ever."""
    token = maintenance.create_peer_token(node.settings, "friend")
    opening = reconcile.encode(reconcile.Session(reconcile.Items([])).start())
    whole = await client.post(
        "/api/claims/reconcile",
        json={"ranges": opening * 3200},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert whole.status_code == 200 and whole.json()["ranges"] == [], whole.text  # all settled
    built: list[object] = []
    monkeypatch.setattr(node.responder, "items", lambda: built.append(1))
    response = await client.post(
        "/api/claims/reconcile",
        json={"ranges": opening * (reconcile.MAX_RANGES + 1)},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert (response.status_code, response.json()["error"]) == (413, "too_large"), response.text
    assert f"at most {reconcile.MAX_RANGES}" in response.json()["message"]
    assert built == []


@contextlib.asynccontextmanager
async def served(node: Node) -> AsyncIterator[str]:
    """`node`'s app on a real uvicorn server in this event loop (the node's), with the
    protocol `serve` uses; its URL."""
    config = uvicorn.Config(
        create_app(node),
        host="127.0.0.1",
        port=0,
        log_config=None,
        lifespan="off",  # the node is started already
        http=protocol_for(node.settings),
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)  # polls the condition, bounded by the test's timeout
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving


async def test_the_loop_answers_others_while_a_reconciliation_is_worked_out(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The responder's work is held until /health has answered: on the event loop (as it
    was: a concurrent /health waited 17.7 s) /health could not answer first."""
    working, released, worked = threading.Event(), threading.Event(), threading.Event()
    respond = reconcile.respond

    def held(items: reconcile.Items, message: Any) -> list[reconcile.Entry]:
        working.set()
        released.wait(10)  # bounds the failure: on the loop nothing else runs meanwhile
        worked.set()
        return respond(items, message)

    monkeypatch.setattr(reconcile, "respond", held)
    opening = reconcile.encode(reconcile.Session(reconcile.Items([])).start())
    headers = {"Authorization": f"Bearer {node.token}"}
    async with served(node) as url:
        reconciling = asyncio.create_task(
            asyncio.to_thread(
                httpx.post,
                f"{url}/api/claims/reconcile",
                json={"ranges": opening},
                headers=headers,
                timeout=DEADLINE_S,
            )
        )
        assert await asyncio.to_thread(working.wait, DEADLINE_S)
        health = await asyncio.to_thread(httpx.get, f"{url}/health", timeout=DEADLINE_S)
        answered_first = not worked.is_set()
        released.set()
        assert health.status_code == 200
        assert answered_first, "/health waited for the reconciliation"
        assert (await reconciling).status_code == 200


def test_peers_add_on_a_box_sharing_most_claims_fetches_only_the_difference(
    pair: tuple[Server, Server],
) -> None:
    a, b = pair
    signer, shared, only_a = two_sets(pair, "s", 2000, 20)
    only_b = fast_claims(signer, [(cid(f"b{i}"), "title", "b", NOW_MS) for i in range(20)])
    post(a, shared + only_a)
    post(b, shared + only_b)
    add_peer(b, a, peer_token(a, "b"))
    want = {c["sig"] for c in shared + only_a + only_b}
    wait_for(lambda: claim_set(b) == want, "B to hold the union")
    status = wait_for(lambda: (row := peer_status(b))["cursor"] and row, "the cursor at A's head")
    # only the 20 claims B lacked travelled: the log was followed from A's head onwards
    assert (status["accepted"], status["duplicate"], status["stale"]) == (20, 0, 0)
    report = httpx.post(f"{b.url}/api/peers/a/sync", headers=b.headers, timeout=60).json()
    assert (report["fetched"], report["have"]) == (0, 20)
    assert report["ids_received"] <= 20 * reconcile.LEAF


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A CLI command whatever its exit code."""
    return subprocess.run(
        [sys.executable, "-m", "metanode", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("METANODE_")},
    )


def test_a_follower_lacking_most_of_a_peer_s_claims_reconciles_within_the_bound(
    pair: tuple[Server, Server],
) -> None:
    """B holds 20 claims A lacks and lacks A's 6,000: a round of ≈ 4,096 ranges, which B's
    follower sends in requests of at most `REQUEST_RANGES`, their answers joined."""
    a, b = pair
    signer, only_a, _ = two_sets(pair, "m", 6000, 0)
    only_b = fast_claims(signer, [(cid(f"mb{i}"), "title", "b", NOW_MS) for i in range(20)])
    post(a, only_a)
    post(b, only_b)
    add_peer(b, a, peer_token(a, "b"))
    want = {c["sig"] for c in only_a + only_b}
    wait_for(lambda: claim_set(b) == want, "B to hold the union")
    report = httpx.post(f"{b.url}/api/peers/a/sync", headers=b.headers, timeout=60).json()
    assert (report["fetched"], report["have"]) == (0, 20), report
    assert peer_status(b)["last_error"] == ""


def test_peers_add_says_at_once_when_a_peer_cannot_be_followed(
    pair: tuple[Server, Server],
) -> None:
    """`peers add` of a peer that refuses the token answers with the first pull's failure and
    a warning (it was exit 0 with `last_error: ""`); an address or a name that can never work
    is refused before anything is stored, and the box's own address once it answers."""
    a, b = pair
    via_b = ("--url", b.url, "--data-dir", str(b.data_dir))
    wrong = run_cli("peers", "add", a.url, "--token", "not-a-token", "--name", "a", *via_b)
    assert wrong.returncode == 0, wrong.stderr
    assert "401 unauthorized" in json.loads(wrong.stdout)["last_error"]
    assert wrong.stderr.startswith("warning: peer a: peer_failed: "), wrong.stderr
    itself = run_cli("peers", "add", b.url, "--token", peer_token(b, "me").strip(), "--name",
                     "me", *via_b)  # fmt: skip
    assert itself.returncode == 2, itself.stdout  # it was kept, and retried for ever
    assert itself.stderr.startswith(f"error: invalid_request: {b.url} is this box itself")
    unknown_token = run_cli("peers", "add", b.url, "--token", "not-a-token", "--name", "me", *via_b)
    assert unknown_token.returncode == 2, unknown_token.stdout  # its 401 says which box it is
    assert unknown_token.stderr.startswith(f"error: invalid_request: {b.url} is this box itself")
    renamed = run_cli("peers", "add", b.url, "--token", peer_token(b, "me2").strip(), "--name",
                      "a", *via_b)  # fmt: skip
    assert renamed.returncode == 2, renamed.stdout  # a known peer's name: that peer is kept
    for url in ("http://127.0.0.1:94011", "http://127.0.0.1 :9", "http://u:p@127.0.0.1:9"):
        refused = run_cli("peers", "add", url, "--token", "t", "--name", "x", *via_b)
        assert refused.returncode == 2, (url, refused.stdout)
        assert refused.stderr.startswith("error: invalid_request: "), refused.stderr
    slashed = run_cli("peers", "add", a.url, "--token", "t", "--name", "x/y", *via_b)
    assert slashed.stderr.startswith("error: invalid_request: name must be"), slashed.stderr
    listed = cli("peers", "list", *via_b)
    assert sorted(json.loads(line)["name"] for line in listed.splitlines()) == ["a"]


def test_a_first_sync_that_fails_is_tried_again_not_replaced_by_the_whole_log(
    pair: tuple[Server, Server],
) -> None:
    """B, holding most of A's claims, adds A while A is down: the reconciliation is tried again
    once A is back, so only what B lacks travels (it fell back to reading A's whole log:
    every shared claim came back as a duplicate)."""
    a, b = pair
    _, shared, only_a = two_sets(pair, "d", 300, 7)
    post(a, shared + only_a)
    post(b, shared)
    token = peer_token(a, "b")
    port = a.port
    a.stop()
    added = add_peer(b, a, token)
    assert added["last_error"].startswith("peer_failed: "), added
    a.start()
    assert a.port == port, "A came back on another port (taken meanwhile): the test cannot go on"
    want = {c["sig"] for c in shared + only_a}
    wait_for(lambda: claim_set(b) == want, "B to hold A's claims")
    status = wait_for(lambda: (row := peer_status(b))["cursor"] and row, "the cursor at A's head")
    assert (status["accepted"], status["duplicate"], status["stale"]) == (7, 0, 0), status


def test_a_box_seeded_from_another_s_backup_follows_it(tmp_path: Path) -> None:
    """A second box made from A's backup holds a truth with A's claim-log id; it is another
    box all the same (its own data directory, its own instance id), and follows A."""
    (tmp_path / "a").mkdir()
    a = Server(tmp_path / "a" / "data", env=dict(ENV)).start()
    b: Server | None = None
    try:
        signer = Signer()
        a.register(signer.uid, "t")
        post(a, [signer.claim(cid("seed"), "title", "seed")])
        copy = cli("backup", str(tmp_path / "bk"), "--data-dir", str(a.data_dir)).strip()
        (tmp_path / "b" / "data").mkdir(parents=True)
        os.replace(copy, tmp_path / "b" / "data" / "truth.db")
        # another box: its own owner (the copy records A's, and a start would be refused)
        cli("init", "--new-owner", "--data-dir", str(tmp_path / "b" / "data"))
        b = Server(tmp_path / "b" / "data", env=dict(ENV)).start()
        post(a, [signer.claim(cid("later"), "title", "later")])
        added = add_peer(b, a, peer_token(a, "b"))
        assert "itself" not in added["last_error"], added
        wait_for(lambda: claim_set(b) == claim_set(a), "B to hold A's claims")
    finally:
        for srv in (a, b):
            if srv is not None:
                srv.stop()
                srv.print_log()


# -- careless and hostile peers: what a follower reads, and for how long --------------------------


Answer = Callable[[socket.socket, threading.Event], None]


class RawPeer:
    """A "peer" answering at the socket level, as no HTTP framework would: `answer(sock, stop)`
    writes what it likes after each request (nothing, a byte at a time, a stream without end)
    until `stop` is set. One request a connection (each answer says `Connection: close`)."""

    def __init__(self, answer: Answer) -> None:
        self.stop = threading.Event()
        self.requests: list[str] = []
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = self.request.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")),
                    0,
                )  # fmt: skip
                while len(body) < length:  # read whole: closed unread, it is reset
                    body += self.request.recv(65536)
                outer.requests.append(head.split(b"\r\n")[0].decode())
                with contextlib.suppress(OSError):
                    answer(self.request, outer.stop)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def log_reads(self) -> int:
        return sum(line.startswith("GET /api/claims/log") for line in self.requests)

    def __enter__(self) -> RawPeer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def http_answer(body: bytes, status: str = "200 OK", headers: str = "") -> Answer:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\n"
        head += headers
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)

    return answer


def silent(sock: socket.socket, stop: threading.Event) -> None:
    stop.wait()  # the connection accepted, and nothing said


def dripping(sock: socket.socket, stop: threading.Event) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n")
    sock.sendall(b"Content-Length: 100000\r\n\r\n")
    while not stop.wait(0.2):  # a byte well within each read's timeout, for ever
        sock.sendall(b" ")


def endless(sock: socket.socket, stop: threading.Event) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    sock.sendall(b'{"claims": [')
    chunk = b'"' + b"x" * (1 << 20) + b'",'
    while not stop.is_set():  # no length said: only the reader can stop it
        sock.sendall(chunk)


def page(claims: int, more: bool, cursor: str = "raw.1") -> bytes:
    item = {"uid": "x", "cid": "y", "key": "k", "value": "v", "ts": 1, "sig": "s"}
    return json.dumps({"claims": [item] * claims, "next": cursor, "more": more}).encode()


@pytest.fixture
def impatient(tmp_path: Path) -> Iterator[Server]:
    """A real server with no claims that waits 1 s for a peer at `peers add` and 2 s for any
    answer of a peer."""
    env = {**ENV, "METANODE_APPLY_WAIT_S": "1", "METANODE_PEER_TIMEOUT_S": "2"}
    srv = Server(tmp_path / "data", env=env).start()
    yield srv
    srv.stop()
    srv.print_log()


def test_peers_add_says_at_once_that_a_peer_accepts_and_never_answers(impatient: Server) -> None:
    """A peer that accepts the connection and says nothing (a port forwarded to a dead box)
    made `peers add` wait twice `apply_wait_s` and answer no error, no warning; /health stayed
    ok until the follower's own request timed out."""
    via = ("--url", impatient.url, "--data-dir", str(impatient.data_dir))
    with RawPeer(silent) as peer:
        added = run_cli("peers", "add", peer.url, "--token", "t", "--name", "a", *via)
        assert added.returncode == 0, added.stderr
        said = f"peer_failed: {peer.url} did not answer within 1 s; it is asked again"
        assert json.loads(added.stdout)["last_error"].startswith(said), added.stdout
        assert added.stderr.startswith(f"warning: peer a: {said}"), added.stderr
        status = wait_for(
            lambda: (row := peer_status(impatient))["last_error"] and row, "a failure"
        )
    assert (
        status["last_error"]
        == f"peer_failed: {peer.url} did not answer within 2 s (peer_timeout_s)"
    )


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (dripping, "did not answer within 2 s (peer_timeout_s)"),  # it was held for ever
        (endless, "/api/claims/log answered over 16777216 bytes; read no more"),  # 6 GB of RSS
        # a page's length and cursor: pulled again at once, for ever, each page validated
        (http_answer(page(1001, more=False)), "the log page holds 1001 claims; 1000 were asked"),
        (http_answer(page(0, more=True, cursor="")), "its next cursor is the one asked"),
        # the parser's RecursionError ended the follower: no error, /health ok, never retried
        (http_answer(b"[" * 100_000 + b"]" * 100_000), "/api/claims/log answered 200, not JSON"),
        # 15 MB of empty objects, ≈ 400 MB parsed: counted, not parsed
        (
            http_answer(b"[" + b"{}," * 5_000_000 + b"{}]"),
            "/api/claims/log answered 5000002 JSON objects and arrays; at most 100000 parsed",
        ),
        (
            http_answer(b"", "301 Moved", "Location: https://a.example/api/claims/log\r\n"),
            "a redirect to 'https://a.example/api/claims/log': a peer's address is where",
        ),
    ],
    ids=[
        "dripping",
        "endless",
        "page-too-long",
        "cursor-stuck",
        "nested-deep",
        "empty-objects",
        "redirect",
    ],
)
def test_a_peer_answering_nonsense_is_a_failure_said_and_tried_again(
    impatient: Server, answer: Answer, said: str
) -> None:
    with RawPeer(answer) as peer:
        follow_url(impatient, peer.url)
        status = wait_for(
            lambda: (row := peer_status(impatient))["last_error"] and row, "a failure"
        )
        assert said in status["last_error"], status
        wait_for(lambda: peer.log_reads() >= 3, "the follower to ask again")  # it goes on
        health = httpx.get(f"{impatient.url}/health", timeout=DEADLINE_S).json()
        assert health["status"] == "degraded", health


def test_claims_with_large_values_travel_in_pages_and_fetches_under_the_answer_bound(
    pair: tuple[Server, Server],
) -> None:
    """300 claims with 64 KiB values make a log page or a fetch of ≈ 20 MB, over what a
    follower reads of one answer: asked again smaller, they all arrive, by reconciliation (B
    holds a claim of its own) and then by the log."""
    a, b = pair
    signer = Signer()
    for srv in pair:
        srv.register(signer.uid, "t")
    big = "v" * 65_536

    def claims(tag: str) -> list[dict[str, Any]]:
        return [signer.claim(cid(f"{tag}{i}"), "note", big) for i in range(300)]

    def post_small(server: Server, batch: list[dict[str, Any]]) -> None:
        for start in range(0, len(batch), 50):  # 50 × 64 KiB: under a batch's 4 MiB
            post(server, batch[start : start + 50])

    post_small(a, claims("big-reconciled"))
    post(b, [signer.claim(cid("b's own"), "title", "b")])
    add_peer(b, a, peer_token(a, "b"))
    wait_for(lambda: claim_set(b) >= claim_set(a), "B to fetch A's large claims", timeout=120)
    post_small(a, claims("big-logged"))
    wait_for(lambda: claim_set(b) >= claim_set(a), "B to read A's large claims", timeout=120)
    status = peer_status(b)
    assert (status["accepted"], status["rejected"], status["last_error"]) == (600, 0, ""), status


def test_a_claim_refused_as_dated_ahead_is_fetched_once_its_time_has_come(
    tmp_path: Path,
) -> None:
    """B's clock is behind A's (here: B allows no skew, A 5 min): A's claim dated 10 s ahead is
    refused on B. The log was read past it, so it was lost for good, though valid on B 10 s
    later; the refusal was not even logged."""
    servers = []
    for name, skew in (("a", "300000"), ("b", "0")):
        (tmp_path / name).mkdir()
        env = {**ENV, "METANODE_MAX_SKEW_MS": skew}
        servers.append(Server(tmp_path / name / "data", env=env).start())
    a, b = servers
    try:
        signer = Signer()
        for srv in servers:
            srv.register(signer.uid, "t", weight=1)
        add_peer(b, a, peer_token(a, "b"))  # B polls A's log every 0.2 s from now on
        ahead = signer.claim(
            cid("ahead"), "title", "ahead", ts=time.time_ns() // 1_000_000 + 10_000
        )
        post(a, [ahead])
        wait_for(lambda: peer_status(b)["rejected"] == 1, "B to refuse the claim dated ahead")
        assert "peer a: 1 claim(s) of a page refused, e.g. ts_in_future: " in b.log_text()
        wait_for(lambda: ahead["sig"] in claim_set(b), "B to fetch the claim once it is valid")
    finally:
        for srv in servers:
            srv.stop()
            srv.print_log()


def test_a_claim_dated_ahead_from_a_peer_that_cannot_reconcile_is_given_up_once(
    tmp_path: Path,
) -> None:
    """The reconciliation due for a claim once dated ahead fails for good at a peer without
    the route (an older version): it is said once, and the log followed on as before."""
    (tmp_path / "b").mkdir()
    b = Server(tmp_path / "b" / "data", env={**ENV, "METANODE_MAX_SKEW_MS": "0"}).start()
    try:
        signer = Signer()
        ahead = signer.claim(cid("old"), "title", "x", ts=time.time_ns() // 1_000_000 + 5000)
        with FakePeer([ahead]) as fake:  # its log only
            follow_url(b, fake.url)
            said = "claims refused earlier stay lacking"
            wait_for(lambda: said in b.log_text(), "the reconciliation to be given up")
            reads = len(fake.asked)
            wait_for(lambda: len(fake.asked) >= reads + 3, "the log to be followed on")
        assert b.log_text().count(said) == 1  # asked again at once, it was for ever
        assert peer_status(b)["rejected"] == 1
    finally:
        b.stop()
        b.print_log()


async def test_a_learned_signer_is_named_by_the_peer_unless_the_owner_named_it(
    node: Node,
) -> None:
    """A peer's answers name their signers (`signers`); a learned signer was `peer:a`, its
    plugins and its owner alike. One learned from an older peer (no names) is named once a
    page names it; a name the owner gave here stays; a name that cannot be shown is not taken."""
    await node.truth.add_peer("a", "http://127.0.0.1:9", "t", 0)
    old, renamed, odd = Signer(), Signer(), Signer()
    page = [s.claim(cid(f"named{i}"), "title", "x") for i, s in enumerate((old, renamed, odd))]
    await node.apply_peer_page("a", page, None, {})  # an older peer: no names
    names = {s["uid"]: s["name"] for s in node.signers()}
    assert [names[s.uid] for s in (old, renamed, odd)] == ["peer:a"] * 3
    await node.add_signer(renamed.uid, "my friend's laptop", None, None)
    given = {old.uid: "filename", renamed.uid: "owner", odd.uid: "x" * 65}
    again = [
        s.claim(cid(f"named{i}"), "title", "y", ts=NOW_MS + 1)
        for i, s in enumerate((old, renamed, odd))
    ]
    await node.apply_peer_page("a", again, None, peers.signer_names({"signers": given}))
    names = {s["uid"]: s["name"] for s in node.signers()}
    assert [names[s.uid] for s in (old, renamed, odd)] == [
        "filename (via a)",
        "my friend's laptop",
        "peer:a",
    ]
    logged = node.claims_log(None, 10, None)["signers"]  # as this box calls them
    assert logged == {s.uid: names[s.uid] for s in (old, renamed, odd)}


async def test_a_follower_ended_by_an_unexpected_error_is_said_not_silent(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception no one expected (a parser's RecursionError, as it was) ended the follower's
    task without a word: `last_error` empty, its lag growing, /health ok."""

    async def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(node, "apply_peer_page", broken)
    with FakePeer([]) as fake:
        await node.add_peer(fake.url, "t", 0, "a")
        follower = node.peers.follower("a")
        assert follower.task is not None
        await asyncio.wait([follower.task], timeout=DEADLINE_S)
    (row,) = node.list_peers()
    assert row["last_error"] == "its follower stopped: RuntimeError('a bug')", row
    health = node.health()
    assert "peer a is not followed: its follower stopped: RuntimeError('a bug')" in str(health)


def test_a_reconciliation_that_never_ends_is_given_up_for_the_peer_s_log(
    server: Server,
) -> None:
    """A responder splitting every range asked into 16 that never agree grew the follower's
    round 16-fold each time (750 MB of RSS in 30 s, without end): past an honest bound the
    follower reads the peer's log instead, as for a peer that cannot reconcile."""
    signer = Signer()
    server.register(signer.uid, "t")
    post(server, [signer.claim(cid("own"), "title", "own")])  # so the first sync reconciles
    theirs = signer.claim(cid("theirs"), "title", "theirs")
    with FakePeer([theirs], splits=True) as fake:
        follow_url(server, fake.url)
        wait_for(lambda: theirs["sig"] in claim_set(server), "the peer's log to be read")
    assert fake.rounds >= 5, fake.rounds  # split until a round would ask too much
    assert "a round would ask about over 131072 ranges; reading its log" in server.log_text()


def answering_as(instance: str, after_s: float) -> Answer:
    """A peer that answers its claim log's head `after_s` seconds late, as the box `instance`."""

    def answer(sock: socket.socket, stop: threading.Event) -> None:
        if not stop.wait(after_s):
            http_answer(page(0, more=False), headers=f"X-Metanode-Instance: {instance}\r\n")(
                sock, stop
            )

    return answer


@pytest.mark.parametrize("node", [{"apply_wait_s": 8.0}], indirect=True)
async def test_peers_add_waits_the_whole_apply_wait_s_for_its_first_question(node: Node) -> None:
    """`peers add` asks the address whether it is this box, waiting `apply_wait_s` for the
    answer: httpx's own 5 s default gave up first, so a box answering in 6 s was followed as
    a peer that had not answered ("did not answer within 8 s"), though it was this very box."""
    with (
        RawPeer(answering_as(node.instance, after_s=6.0)) as peer,
        pytest.raises(InvalidRequest, match="is this box itself"),
    ):
        await node.add_peer(peer.url, "t", 0, "a")
    assert node.list_peers() == []


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 10), st.booleans()), max_size=40))
def test_what_a_follower_asks_halves_on_a_failure_and_doubles_back_after_full_quick_answers(
    steps: list[tuple[bool, float, bool]],
) -> None:
    """`Asking`: halved at each answer that did not come whole, never below one; doubled back,
    never above `most`, only after a full answer (all that was asked) within a quarter of the
    timeout, so that a slow link is not asked the size it just failed to carry."""
    asking = peers.Asking(1000)
    for failed, seconds, full in steps:
        before = asking.now
        if failed:
            assert asking.shrink() == (before > 1)
            assert asking.now == max(1, before // 2)
        else:
            asking.took(seconds, 2.0, before if full else before - 1)
            grew = full and seconds < 0.5
            assert asking.now == (min(1000, before * 2) if grew else before)
        assert 1 <= asking.now <= 1000
