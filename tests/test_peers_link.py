"""Peers over a bad link (docs/peers.md, "Over a slow or breaking link"): real `metanode serve`
processes following each other through `FaultProxy`, which throttles, cuts, stalls and
partitions what passes. Every wait is on a condition (what a box holds, what it says of its
peer); the only clocks are the nodes' own `peer_timeout_s` and back-off."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from metanode import cid as cids
from tests.helpers.claims import NOW_MS, Signer, fast_claims
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.peering import follow, peer_row, peer_token, post_claims, stored_sigs
from tests.helpers.server import Server, free_port
from tests.helpers.wait import poll

# A page of 1,000 claims is ≈ 270 KB: over a 40 KB/s link it takes ≈ 7 s, well past 2 s.
ENV = {
    "METANODE_PEER_POLL_S": "0.2",
    "METANODE_PEER_RETRY_S": "0.2",
    "METANODE_PEER_MAX_BACKOFF_S": "1",
    "METANODE_PEER_TIMEOUT_S": "2",
    "METANODE_WATCH_ENABLED": "false",
}
SLOW_S = 240.0  # a bound on a hang over a throttled link, not a measurement


@pytest.fixture
def boxes(tmp_path: Path) -> Iterator[Callable[[str], Server]]:
    """Real servers made on demand by name, each with a signer of its own registered."""
    made: list[Server] = []

    def box(name: str) -> Server:
        (tmp_path / name).mkdir()
        server = Server(tmp_path / name / "data", env=dict(ENV)).start()
        made.append(server)
        return server

    yield box
    for server in made:
        server.stop()
        server.print_log()


def claims_of(server: Server, tag: str, count: int) -> list[dict[str, object]]:
    """`count` title claims by a signer registered on `server`, stored there."""
    signer = Signer()
    server.register(signer.uid, tag)
    made = fast_claims(
        signer,
        [(cids.midhash_bytes(f"{tag} {i}".encode()), "title", tag, NOW_MS) for i in range(count)],
    )
    post_claims(server, made)
    return made


def holds_all_of(follower: Server, followed: Server) -> bool:
    return set(stored_sigs(follower)) >= set(stored_sigs(followed))


def test_a_backlog_over_a_link_slower_than_a_page_per_timeout_gets_through(
    boxes: Callable[[str], Server],
) -> None:
    """At 40 KB/s no page of 1,000 claims comes within the 2 s `peer_timeout_s`: each was given
    up and asked again whole, for ever (20,000 claims at 5 KB/s: 586 KB read in 100 s, none
    stored). Halved at each answer that does not come whole, a page comes; every claim arrives,
    once, and `GET /api/peers` says how much is asked at once."""
    a, b = boxes("a"), boxes("b")
    claims_of(a, "backlog", 3000)
    with FaultProxy(a.port) as link:
        link.faults.down_bps = 40_000
        follow(b, link.url, peer_token(a, "b"), "a")
        poll(lambda: peer_row(b, "a")["page"] < 1000 or None, "the page to be made smaller")
        poll(lambda: holds_all_of(b, a) or None, "every claim over the slow link", SLOW_S)
        row = peer_row(b, "a")
        assert (row["accepted"], row["duplicate"]) == (3000, 0), row
        link.faults.down_bps = 0  # the link is fast again (how the page grows back, whose
        claims_of(a, "after", 2_000)  # pace is the machine's, test_peers.py checks without it)
        poll(lambda: holds_all_of(b, a) or None, "every claim over the fast link")


def test_connections_cut_mid_answer_cost_pages_not_claims(
    boxes: Callable[[str], Server],
) -> None:
    """A link that cuts every connection after 60 KB (≈ 220 claims) never carried a page of
    1,000, nor a reconciliation fetch of 1,000; smaller ones come. No claim is stored twice
    or skipped: a cut page is not applied at all (`duplicate` 0)."""
    a, b = boxes("a"), boxes("b")
    claims_of(a, "cut", 2000)
    claims_of(b, "own", 1)  # B holds a claim: its first sync reconciles and fetches
    with FaultProxy(a.port) as link:
        link.faults.cut_after = 60_000
        follow(b, link.url, peer_token(a, "b"), "a")
        poll(lambda: holds_all_of(b, a) or None, "every claim over the breaking link", SLOW_S)
        row = peer_row(b, "a")
        assert link.counts.cuts > 0
    assert (row["accepted"], row["duplicate"]) == (2000, 0), row
    assert row["last_sync"]["fetched"] == 2000, row


def test_three_boxes_partitioned_under_writes_converge_once_healed(
    boxes: Callable[[str], Server],
) -> None:
    """A follows B and C, B follows A and C, C follows A and B, each edge through its own link;
    C is cut off while all three take claims. Its peers say so (`last_error`, /health
    degraded, `lag_s`); healed, all three hold exactly the same claims, each once."""
    names = "abc"
    box = {name: boxes(name) for name in names}
    links = {(f, t): FaultProxy(box[t].port).__enter__() for f in names for t in names if f != t}
    try:
        for (f, t), link in links.items():
            follow(box[f], link.url, peer_token(box[t], f), t)
        for name in names:
            claims_of(box[name], f"before {name}", 100)
        poll(lambda: len({frozenset(stored_sigs(s)) for s in box.values()}) == 1 or None, "sync")
        for (f, t), link in links.items():
            link.faults.partition = "c" in (f, t)
        for name in names:
            claims_of(box[name], f"during {name}", 300)
        row = poll(lambda: ((r := peer_row(box["a"], "c"))["last_error"] and r) or None, "an error")
        assert "did not answer" in row["last_error"], row
        assert row["lag_s"] >= 2, row  # behind since the pull that failed began, not ended
        health = httpx.get(f"{box['a'].url}/health", timeout=60).json()
        assert health["status"] == "degraded", health
        assert any(p.startswith("peer c failed its last pull") for p in health["problems"])
        for link in links.values():
            link.faults.partition = False
        poll(
            lambda: len({frozenset(stored_sigs(s)) for s in box.values()}) == 1 or None,
            "the three boxes to hold the same claims",
            SLOW_S,
        )
    finally:
        for link in links.values():
            link.__exit__()
    for server in box.values():
        sigs = stored_sigs(server)
        assert len(sigs) == len(set(sigs)) == 3 * 400


def test_a_cycle_of_followers_stores_each_claim_once_and_echoes_it_once(
    boxes: Callable[[str], Server],
) -> None:
    """A follows B, B follows C, C follows A: a claim made on A goes round to C, then B, and
    comes back to A once, a duplicate that is not stored, so it goes no further; once all
    three hold everything, polls go on and nothing more is stored or counted."""
    box = {name: boxes(name) for name in "abc"}
    ring = {"a": "b", "b": "c", "c": "a"}
    links = {f: FaultProxy(box[t].port).__enter__() for f, t in ring.items()}
    try:
        for f, t in ring.items():
            follow(box[f], links[f].url, peer_token(box[t], f), t)
        for name in box:
            claims_of(box[name], f"ring {name}", 200)
        poll(
            lambda: all(len(stored_sigs(s)) == 600 for s in box.values()) or None,
            "every box to hold every claim",
        )
        for f, t in ring.items():  # its own 200 come back once, the other 400 are new
            poll(lambda f=f, t=t: _counts(box[f], t) == (400, 200) or None, f"{f}'s echo")
        asked = {f: link.counts.bytes_up for f, link in links.items()}
        poll(  # ≈ 10 more polls of every peer's log
            lambda: (
                all(link.counts.bytes_up > asked[f] + 2500 for f, link in links.items()) or None
            ),
            "more polls",
        )
        for f, t in ring.items():
            assert _counts(box[f], t) == (400, 200)
    finally:
        for link in links.values():
            link.__exit__()
    for server in box.values():
        sigs = stored_sigs(server)
        assert len(sigs) == len(set(sigs)) == 600


def _counts(follower: Server, name: str) -> tuple[int, int]:
    """(accepted, duplicate) of `follower`'s peer `name`."""
    row = peer_row(follower, name)
    return row["accepted"], row["duplicate"]


def test_a_link_that_breaks_again_and_again_is_summed_up_in_the_log(
    boxes: Callable[[str], Server],
) -> None:
    """A link cut every few seconds (Wi-Fi, a modem) wrote two lines per cut, a failure and
    `answers again` (each cut's error differs, so none was a repeat): 45 lines a minute. The
    first failure and recovery are said; a failure again soon after is an unsteady link, said
    once, its failures then summed up at most every ten longest back-offs (10 s here), and a
    line when it has worked that long; after which a failure is said as the first was."""
    a, b = boxes("a"), boxes("b")
    claims_of(a, "flaky", 1)
    cycles = 8
    with FaultProxy(a.port) as link:
        follow(b, link.url, peer_token(a, "b"), "a")
        poll(lambda: holds_all_of(b, a) or None, "the first claim")

        def cut(on: bool) -> None:
            link.faults.cut_after = 1 if on else 0  # every answer cut after its first byte
            poll(lambda: bool(peer_row(b, "a")["last_error"]) == on or None, f"cut: {on}")

        for _ in range(cycles):
            cut(True)
            cut(False)
        said = [m for m in b.log_messages() if m.startswith("peer a")]
        assert said[0].startswith("peer a: peer_failed: ") and said[0].endswith(
            " (tried again with back-off)"
        )
        assert said[1] == "peer a answers again"
        assert said[2].startswith("peer a: the link fails again and again (again ")
        assert all(m.startswith("peer a: unsteady link: ") for m in said[3:]), said
        assert len(said) < cycles, said  # two a cycle before

        def steady() -> list[str] | None:
            lines = [m for m in b.log_messages() if m.startswith("peer a")]
            return lines if lines[-1].endswith("steady again: it has worked 10 s") else None

        assert poll(steady, "steady again")[-1].startswith("peer a: unsteady link: ")
        before = len(b.log_messages())
        cut(True)  # steady: a failure is said again
        assert next(m for m in b.log_messages()[before:] if m.startswith("peer a")).endswith(
            " (tried again with back-off)"
        )


def peer_metrics(server: Server) -> dict[str, float]:
    """The `metanode_peer_*` samples of the server's /metrics, by name and labels."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=60).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("metanode_peer_")
    }


def test_metrics_say_a_peer_fails_and_how_far_behind_it_is(
    boxes: Callable[[str], Server],
) -> None:
    """A peer that stopped answering was in /health and `peers list` alone: Prometheus had
    nothing to alert on. `metanode_peer_failing` is 1 while its pulls fail, and
    `metanode_peer_lag_seconds` grows from the first failed pull; both back to 0 once healed."""
    a, b = boxes("a"), boxes("b")
    claims_of(a, "watched", 1)
    failing, lag = 'metanode_peer_failing{peer="a"}', 'metanode_peer_lag_seconds{peer="a"}'
    with FaultProxy(a.port) as link:
        follow(b, link.url, peer_token(a, "b"), "a")
        poll(lambda: holds_all_of(b, a) or None, "the first claim")
        assert peer_metrics(b) == {failing: 0.0, lag: 0.0}
        link.faults.partition = True

        def failed() -> dict[str, float] | None:
            now = peer_metrics(b)
            return now if now[failing] == 1 and now[lag] > 0 else None

        down = poll(failed, "the peer's pulls failing")
        assert down[lag] >= 2.0  # from the first failed pull's start: peer_timeout_s at least
        link.faults.partition = False
        poll(lambda: peer_metrics(b) == {failing: 0.0, lag: 0.0} or None, "healed")


def test_a_peer_that_cannot_be_reached_says_why(boxes: Callable[[str], Server]) -> None:
    """A peer whose box is off and one whose name is mistyped both said `did not answer:
    ConnectError('All connection attempts failed')` or the like, in the log, /health and
    `peers list`: the cause httpx wraps is named now, with what to look at."""
    b = boxes("b")
    off = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for url, name in ((off, "off"), ("http://no-such-box.invalid:9000", "typo")):
        answer = httpx.post(
            f"{b.url}/api/peers",
            json={"url": url, "token": "t", "name": name},
            headers=b.headers,
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    assert peer_row(b, "off")["last_error"] == (
        f"peer_failed: {off} did not answer: connection refused: nothing listens there (is "
        "metanode running on that box, on that port?)"
    )
    typo = peer_row(b, "typo")["last_error"]
    assert typo.startswith("peer_failed: http://no-such-box.invalid:9000 did not answer: its ")
    assert typo.endswith(": a typo in the address, or a name this box's DNS does not know)")
    problems = httpx.get(f"{b.url}/health", timeout=60).json()["problems"]
    assert any("peer off failed its last pull" in p and "connection refused" in p for p in problems)
