"""`metanode serve --workers 2` on a real server: reads and writes through both workers,
read-your-writes across them, the same feed from either, one /metrics for all of them, a
SIGKILLed worker replaced, one that keeps dying restarted after growing delays, and a clean
shutdown (workers.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.mmap_dict import mmap_key
from prometheus_client.parser import text_string_to_metric_families

from metanode import cid as cids
from metanode import metrics, workers
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.feed import FrameParser
from tests.helpers.server import Server, role_pids

DEADLINE_S = 60.0
A, B, C = (cids.midhash_bytes(f"workers {n}".encode()) for n in "ABC")


OPENED: list[httpx.Client] = []  # closed after each test


pytestmark = pytest.mark.both_backends


@pytest.fixture
def server(tmp_path: Path, storage: str) -> Iterator[Server]:
    srv = Server(tmp_path / "data", workers=2, env={"METANODE_STORAGE": storage}).start()
    yield srv
    while OPENED:
        OPENED.pop().close()
    srv.stop()
    srv.print_log()


def pinned(srv: Server, headers: dict[str, str] | None = None) -> httpx.Client:
    """A client on one keep-alive connection, so on one worker (with the token unless
    `headers` says otherwise)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    given = srv.headers if headers is None else headers
    client = httpx.Client(base_url=srv.url, headers=given, limits=limits, timeout=30)
    OPENED.append(client)
    return client


def worker_of(client: httpx.Client) -> str:
    return client.get("/api/meta/" + A).headers["x-metanode-worker"]


def one_per_worker(srv: Server, headers: dict[str, str] | None = None) -> dict[str, httpx.Client]:
    """A pinned client on each worker (connections land where the kernel puts them: open new
    ones until both workers have one)."""
    found: dict[str, httpx.Client] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(found) < 2:
        assert time.monotonic() < deadline, f"only reached {sorted(found)}"
        client = pinned(srv, headers)
        found.setdefault(worker_of(client), client)
    assert sorted(found) == ["owner", "reader-1"]
    return found


def register(client: httpx.Client, signer: Signer) -> None:
    body = {"uid": signer.uid, "name": "test", "weight": 1, "may_link": True}
    assert client.post("/api/signers", json=body).status_code == 200


def title_of(client: httpx.Client, cid: str) -> str | None:
    response = client.get(f"/api/meta/{cid}")
    return response.json()["metadata"].get("title") if response.status_code == 200 else None


def test_writes_through_either_worker_are_read_at_once_from_both(server: Server) -> None:
    clients = one_per_worker(server)
    owner, reader = clients["owner"], clients["reader-1"]
    signer = Signer()
    forwarded = reader.post(
        "/api/signers", json={"uid": signer.uid, "name": "test", "weight": 1, "may_link": True}
    )
    # the worker that made the answer, once (the reader added itself a second time)
    assert forwarded.headers.get_list("x-metanode-worker") == ["owner"], forwarded.headers
    assert [s["uid"] for s in owner.get("/api/signers").json()["signers"]].count(signer.uid) == 1
    for writer, cid, title in ((reader, A, "via the reader"), (owner, B, "via the owner")):
        response = writer.post("/api/claims", json={"claims": [signer.claim(cid, "title", title)]})
        assert response.status_code == 200, response.text
        assert response.json()["accepted"] == 1
        # Answered only once the cache holds it: both workers read it at once.
        assert title_of(owner, cid) == title_of(reader, cid) == title
    viewer = reader.get(f"/api/meta/{A}", params={"as": signer.uid})
    assert viewer.json()["metadata"]["title"] == "via the reader"
    claims = reader.get(f"/api/meta/{A}/claims").json()["claims"]
    assert [c["value"] for c in claims] == ["via the reader"]
    second, third = Signer(), Signer()
    body = {"uid": second.uid, "name": "chunked", "weight": 1, "may_link": False}
    chunked = reader.post(  # a handed-over body of unknown length goes over chunked, as it came
        "/api/signers",
        content=iter([json.dumps(body)[:10].encode(), json.dumps(body)[10:].encode()]),
        headers={"Content-Type": "application/json"},
    )
    assert (chunked.status_code, chunked.json()["name"]) == (200, "chunked"), chunked.text
    expecting = reader.post(  # the reader answers the 100-continue; the owner never sees it
        "/api/signers",
        json={**body, "uid": third.uid, "name": "expecting"},
        headers={"Expect": "100-continue"},
    )
    assert expecting.status_code == 200, expecting.text
    for each in (second, third):  # both registered, so their claims are taken
        claim = each.claim(C, "title", "c")
        assert reader.post("/api/claims", json={"claims": [claim]}).json()["accepted"] == 1
    assert title_of(owner, C) == "c"
    head = reader.head("/health")  # handed over: the head only, the connection still usable
    assert (head.status_code, head.content) == (200, b"")
    assert reader.get("/health").json()["cache_ready"] is True
    bad = reader.post("/api/claims", json={"claims": [{"cid": A}]})
    assert (bad.status_code, bad.json()["error"]) == (400, "invalid_batch")
    refused = httpx.post(f"{server.url}/api/claims", json={"claims": []}, timeout=30)
    assert (refused.status_code, refused.json()["error"]) == (401, "unauthorized")


def test_under_a_root_path_a_reader_answers_its_reads_and_the_prefix_is_taken_off_once(
    tmp_path: Path,
) -> None:
    """`root_path`: a read under the prefix (a proxy that passes the path on whole) is still a
    reader's to answer, the rest the owner's, and a path is unprefixed once, by the worker that
    answers it (`/metanode/metanode/…` is no route)."""
    srv = Server(tmp_path / "data", workers=2, env={"METANODE_ROOT_PATH": "/metanode"}).start()
    try:
        reader = one_per_worker(srv)["reader-1"]
        read = reader.get(f"/metanode/api/meta/{A}")
        assert (read.status_code, read.json()["error"]) == (404, "unknown_cid")
        assert read.headers["x-metanode-worker"] == "reader-1"
        handed = reader.get("/metanode/health")
        assert (handed.status_code, handed.headers["x-metanode-worker"]) == (200, "owner")
        for twice in (f"/metanode/metanode/api/meta/{A}", "/metanode/metanode/health"):
            assert reader.get(twice).json()["error"] == "not_found", twice
    finally:
        while OPENED:
            OPENED.pop().close()
        srv.stop()
        srv.print_log()


def test_hot_documents_in_a_reader_never_answer_an_old_one_after_a_write(tmp_path: Path) -> None:
    """With `hot_documents` on, a reader keeps what it read in memory; the owner's commit
    empties it before the reader's next read (the owner bumps the `PublishedCount` the
    reader looks at; its follower polls only every 20 ms, far slower than the next request),
    so a write answered, by the owner or handed over by the reader, is read back at once."""
    srv = Server(tmp_path / "data", workers=2, env={"METANODE_HOT_DOCUMENTS": "64"}).start()
    try:
        clients = one_per_worker(srv)
        owner, reader = clients["owner"], clients["reader-1"]
        signer = Signer()
        register(owner, signer)
        for n in range(20):
            title = f"title {n}"
            posted = (owner if n % 2 else reader).post(
                "/api/claims", json={"claims": [signer.claim(A, "title", title, NOW_MS + n)]}
            )
            assert posted.status_code == 200, posted.text
            assert title_of(reader, A) == title_of(reader, A) == title  # the second is from memory
    finally:
        while OPENED:
            OPENED.pop().close()
        srv.stop()
        srv.print_log()


def events(client: httpx.Client, count: int) -> list[tuple[str | None, dict[str, Any]]]:
    """The first `count` events of `/api/events` on this client's worker, from the start of
    the feed."""
    got: list[tuple[str | None, dict[str, Any]]] = []
    parser = FrameParser()
    since = f"{client.get('/health').json()['epoch']}-0"
    with client.stream("GET", "/api/events", params={"since": since}) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            got += [(f.id, f.data) for f in parser.feed(chunk) if f.event == "set"]
            if len(got) >= count:
                return got[:count]
    raise AssertionError(f"the stream ended after {got}")


def test_the_feed_is_the_same_on_every_worker(server: Server) -> None:
    clients = one_per_worker(server)
    signer = Signer()
    register(clients["owner"], signer)
    batch = [signer.claim(cid, "title", f"title of {cid}") for cid in (A, B, C)]
    assert clients["reader-1"].post("/api/claims", json={"claims": batch}).status_code == 200
    seen = {name: events(client, 6) for name, client in clients.items()}  # a title, a cids/ each
    assert seen["owner"] == seen["reader-1"]
    titles = {data["value"] for _, data in seen["owner"] if data["key"] == "title"}
    assert titles == {f"title of {c}" for c in (A, B, C)}


def test_a_reader_answers_claims_itself_as_the_owner_would(server: Server) -> None:
    """A reader takes `POST /api/claims` up to the write and hands the owner the claims
    (handoff.py): its answers, refusals included, are the owner's to the byte, and /metrics
    counts each claim once, in the worker that answered it."""
    clients = one_per_worker(server)
    owner, reader = clients["owner"], clients["reader-1"]
    signer, stranger = Signer(), Signer()
    register(owner, signer)
    tampered = {**signer.claim(B, "title", "t"), "value": "not what was signed"}
    for n, claim in enumerate(
        (signer.claim(A, "title", "t"), stranger.claim(A, "title", "t"), tampered)
    ):
        answers = [
            client.post("/api/claims", json={"claims": [claim]}) for client in (reader, owner)
        ]
        assert [a.headers["x-metanode-worker"] for a in answers] == ["reader-1", "owner"]
        (first, second) = answers
        if n == 0:  # the second post of one claim is a duplicate, wherever it lands
            assert (first.status_code, first.json()["accepted"]) == (200, 1), first.text
            assert second.json()["duplicate"] == 1 and title_of(reader, A) == "t"
        else:
            assert first.status_code == second.status_code and first.json() == second.json()
    errors = [a.json()["items"][0]["error"] for a in answers]
    assert errors == ["bad_signature", "bad_signature"]
    assert scrape(owner, "metanode_claims_total", verdict="accepted") == 1
    assert scrape(owner, "metanode_claims_total", verdict="duplicate") == 1
    for slug in ("unknown_signer", "bad_signature"):
        assert scrape(owner, "metanode_claims_rejected_total", slug=slug) == 2


def test_an_owner_killed_under_a_readers_writes_never_leaves_a_false_ok(server: Server) -> None:
    """Posting through the reader while the owner is SIGKILLed: each answer is a 200 for
    claims that are stored, or a 503 the client may retry; after the restart every
    acknowledged claim is read back."""
    reader = one_per_worker(server)["reader-1"]
    signer = Signer()
    register(reader, signer)
    acknowledged, refused, n = [], [], 0
    killed, deadline = False, time.monotonic() + DEADLINE_S
    while len(acknowledged) < 40 or not killed:
        if len(acknowledged) == 20 and not killed:
            os.kill(role_pids(server)["owner"], signal.SIGKILL)
            killed = True
        claim = signer.claim(cids.midhash_bytes(f"kill {n}".encode()), "title", f"kill {n}")
        n += 1
        response = reader.post("/api/claims", json={"claims": [claim]})
        if response.status_code == 200:
            acknowledged.append(claim)
        else:
            assert response.status_code == 503, response.text
            assert response.json()["error"] == "unavailable", response.text
            refused.append(claim)
            time.sleep(0.05)  # while the supervisor restarts the owner
        assert time.monotonic() < deadline, "the owner never came back"
    assert refused, "no request met the killed owner"
    for claim in acknowledged:
        assert title_of(reader, claim["cid"]) == claim["value"]


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def serves(server: Server, claim: dict[str, Any]) -> bool:
    """Whether a new connection takes a write and reads what was written before."""
    try:
        client = pinned(server)
        posted = client.post("/api/claims", json={"claims": [claim]})
        return posted.status_code == 200 and title_of(client, A) == "a"
    except httpx.TransportError:
        return False


def scrape(client: httpx.Client, name: str, **labels: str) -> float | None:
    """One sample of /metrics (through whichever worker `client` is on), None if absent."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def test_one_scrape_counts_the_requests_answered_by_every_worker(server: Server) -> None:
    clients = one_per_worker(server)
    for name, count in (("owner", 3), ("reader-1", 5)):
        for _ in range(count):
            response = clients[name].get("/api/signers")
            assert (response.status_code, response.headers["x-metanode-worker"]) == (200, name)
    labels = {"route": "/api/signers", "method": "GET", "status": "200"}
    for client in clients.values():  # the reader hands /metrics to the owner: the same sums
        assert scrape(client, "metanode_request_seconds_count", **labels) == 3 + 5 + 1  # start
    with clients["reader-1"].stream("GET", "/api/events"):  # a feed held open on the reader
        owner = clients["owner"]
        wait_for(lambda: scrape(owner, "metanode_feed_subscribers") == 1, "the reader's feed")
    wait_for(lambda: scrape(owner, "metanode_feed_subscribers") == 0, "the feed closed")
    assert restarts_of(owner) == 0


def test_a_stream_handed_to_the_owner_ends_there_when_its_client_leaves(server: Server) -> None:
    """The web page's feed through a reader, handed to the owner for its cookie (the sessions
    live there): when the browser leaves, the owner's feed ends too (it was relayed to nobody
    for good, an open feed and a connection on the owner for each Live page left)."""
    owner = one_per_worker(server)["owner"]
    page = one_per_worker(server, headers={})["reader-1"]
    signed_in = page.post("/signin", data={"token": server.token, "then": "/"})
    assert signed_in.status_code == 303, signed_in.text
    with page.stream("GET", "/api/events") as feed:
        assert (feed.status_code, feed.headers["x-metanode-worker"]) == (200, "owner")
        wait_for(lambda: scrape(owner, "metanode_feed_subscribers") == 1, "the page's feed")
    wait_for(lambda: scrape(owner, "metanode_feed_subscribers") == 0, "the page's feed ended")


def test_a_killed_worker_is_replaced_and_nothing_acknowledged_is_lost(server: Server) -> None:
    signer = Signer()
    first = pinned(server)
    register(first, signer)
    assert first.post("/api/claims", json={"claims": [signer.claim(A, "title", "a")]}).is_success
    for ts, role in enumerate(("reader", "owner"), NOW_MS + 1):
        killed = role_pids(server)[role]
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: role_pids(server).get(role) not in (None, killed), f"a new {role}")  # noqa: B023
        claim = signer.claim(B, "title", f"after the {role}", ts)
        wait_for(lambda: serves(server, claim), f"serving again after the {role}")  # noqa: B023
    assert (server.meta(B) or {})["metadata"]["title"] == "after the owner"


def test_every_counter_keeps_its_count_when_the_owner_is_killed(server: Server) -> None:
    """A counter that goes back to 0 at a worker's restart makes Prometheus's rate() see a
    reset, and it misses the counts made before the next scrape: the group-commit counters,
    read from the owner's state at scrape time, did (8 -> 0). Every `_total` and histogram
    count of the scrape before the owner is SIGKILLed is in the one after, at least."""
    signer = Signer()
    client = pinned(server)
    register(client, signer)
    for cid in (A, C, cids.midhash_bytes(b"kept")):
        claim = signer.claim(cid, "title", "a")
        assert client.post("/api/claims", json={"claims": [claim]}).status_code == 200
    before = counts(client)
    assert before[("metanode_ingest_groups_total", ())] >= 3, before
    if server.storage == "sqlite":  # PostgreSQL's replicas apply after the COMMIT: 0
        assert before[("metanode_applied_ahead_total", ())] >= 1, before
    killed = role_pids(server)["owner"]
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: role_pids(server).get("owner") not in (None, killed), "a new owner")
    claim = signer.claim(B, "title", "after the owner")
    wait_for(lambda: serves(server, claim), "serving again after the owner")
    after = counts(pinned(server))
    went_back = {k: (v, after.get(k)) for k, v in before.items() if after.get(k, 0.0) < v}
    assert not went_back, went_back


def counts(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter's and histogram count's sample of one scrape, by name and labels."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        if family.type in ("counter", "histogram")
        for sample in family.samples
        if not sample.name.endswith("_sum")
    }


def test_shutdown_stops_every_worker_cleanly(server: Server) -> None:
    pids = role_pids(server)
    assert sorted(pids) == ["owner", "reader"]
    assert server.stop(signal.SIGTERM) == 0
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert not (server.data_dir / "owner.sock").exists()
    assert not (server.data_dir / "handoff.sock").exists()
    assert "Finished server process" in server.log_text()


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_serve_on_one_core_of_several_serves_in_one_process(tmp_path: Path) -> None:
    """`workers = 0` counts the cores `serve` may run on: under `taskset` on one core it is
    one process (no supervisor, no reader), not a worker for every core of the machine."""
    core = str(min(os.sched_getaffinity(0)))
    srv = Server(tmp_path / "data", workers=0, prefix=("taskset", "-c", core)).start()
    try:
        assert role_pids(srv) == {}
        assert httpx.get(f"{srv.url}/health", timeout=10).headers.get("x-metanode-worker") is None
        assert "workers: 1)" in srv.log_text()
    finally:
        assert srv.stop() == 0


def test_the_metric_files_live_in_memory_and_a_killed_supervisors_are_removed(
    tmp_path: Path,
) -> None:
    """The workers' metric files are memory-mapped and change at every request: on the data
    directory's disk the kernel wrote them back every 30 s. They live in the runtime folder
    (`$XDG_RUNTIME_DIR`, else /dev/shm: memory), linked as `<data dir>/metrics`; a stop removes
    them, and the next start removes what a supervisor killed first left, this data
    directory's and any other's."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now: a supervisor killed long ago
    namespace = os.stat("/proc/self/ns/pid").st_ino
    stale = runtime / f"metanode-metrics-{namespace}.{gone.pid}-x"
    elsewhere = runtime / f"metanode-metrics-{namespace + 1}.{gone.pid}-x"  # another namespace's
    elsewhere.mkdir()
    stale.mkdir()
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    srv = Server(tmp_path / "data", workers=2, env=env).start()
    link = srv.data_dir / "metrics"
    first = link.resolve()
    assert link.is_symlink() and first.parent == runtime
    assert {f.name.split("_")[0] for f in first.iterdir()} >= {"counter", "histogram"}
    assert not stale.exists() and elsewhere.exists()
    elsewhere.rmdir()
    assert srv.proc is not None
    srv.proc.kill()  # no stop: the folder stays, the workers die with the supervisor
    srv.proc.wait()
    assert first.exists()
    srv.start()
    try:
        assert not first.exists() and link.resolve().parent == runtime
    finally:
        assert srv.stop() == 0
    assert not link.exists() and list(runtime.iterdir()) == []


def restarts_of(owner: httpx.Client) -> float | None:
    return scrape(owner, "metanode_worker_restarts_total", worker="reader-1")


def restarted(server: Server, killed: int) -> int:
    """The pid of the reader started after `killed` died (waits for it)."""
    wait_for(lambda: role_pids(server).get("reader") not in (None, killed), "a new reader")
    return role_pids(server)["reader"]


def test_a_worker_that_keeps_dying_is_restarted_after_growing_delays(server: Server) -> None:
    """The reader is killed as soon as each new one appears: each restart waits twice as long
    as the one before (read from the supervisor's log and /metrics, never timed), and the
    owner serves throughout."""
    clients = one_per_worker(server)
    owner, reader = clients["owner"], role_pids(server)["reader"]
    with clients["reader-1"].stream("GET", "/api/events"):  # a feed on the reader that dies
        wait_for(lambda: scrape(owner, "metanode_feed_subscribers") == 1, "the reader's feed")
        for restarts in range(1, 5):
            os.kill(reader, signal.SIGKILL)
            wait_for(lambda: restarts_of(owner) == restarts, f"restart {restarts} counted")  # noqa: B023
            assert owner.get("/api/meta/" + A).headers["x-metanode-worker"] == "owner"
            reader = restarted(server, reader)
    delays = [
        line.split("restarting in ")[1].split(" s")[0]
        for line in server.log_text().splitlines()
        if "(reader, pid" in line and "restarting in" in line
    ]
    assert delays == ["0.5", "1.0", "2.0", "4.0"], delays
    assert "exited (SIGKILL)" in server.log_text()
    delay = scrape(owner, "metanode_worker_restart_delay_seconds", worker="reader-1")
    assert delay == 4.0
    assert scrape(owner, "metanode_feed_subscribers") == 0  # the dead readers' feeds are gone
    assert sorted(one_per_worker(server)) == ["owner", "reader-1"]  # and it serves again
    live = {str(pid) for pid in role_pids(server).values()}
    left = {f.name for f in (server.data_dir / "metrics").iterdir()}
    assert {name.split("_")[-1][:-3] for name in left if name.endswith(".db")} <= live | {"archive"}


def sums(folder: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a scrape of the metric files in `folder` sums, by sample name and labels."""
    collected = metrics.FoldedCollector(None, str(folder)).collect()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for m in collected for s in m.samples
    }


def test_a_dead_workers_metric_files_are_folded_into_the_archive(tmp_path: Path) -> None:
    """Each worker that died left its counter and histogram files (64 KiB each, in memory)
    until `serve` stopped, read by every scrape: folded into one archive a kind instead, the
    sums a scrape gives unchanged, whichever order they die in."""
    key = mmap_key("m_total", "m_total", ["route"], ["/a"], "m")
    bucket = mmap_key("h", "h_bucket", ["le"], ["1.0"], "h")
    for pid, count in ((11, 3.0), (12, 4.0), (13, 5.0)):
        for kind, name in (("counter", key), ("histogram", bucket)):
            file = metrics.AllocatedFile(str(tmp_path / f"{kind}_{pid}.db"))
            file.write_value(name, count, 0.0)
            file.close()  # type: ignore[no-untyped-call]
    before = sums(tmp_path)
    assert before[("m_total", (("route", "/a"),))] == 12.0
    for pid in (12, 11):
        metrics.fold_dead(str(tmp_path), pid)
        assert sums(tmp_path) == before
    names = {f.name for f in tmp_path.glob("*.db")}
    assert names == {f"{k}_{n}.db" for k in ("counter", "histogram") for n in ("13", "archive")}


@given(st.lists(st.floats(0, 2 * workers.STEADY_S), max_size=40))
def test_restart_delays_double_to_the_cap_and_start_again_after_a_steady_run(
    runs: list[float],
) -> None:
    backoff, expected = workers.Backoff(), workers.FIRST_S
    for ran_s in runs:
        if ran_s >= workers.STEADY_S:
            expected = workers.FIRST_S
        assert backoff.after(ran_s) == expected
        expected = min(workers.CAP_S, expected * 2)


def test_a_record_s_etag_is_the_same_on_both_workers_so_either_answers_304(
    server: Server,
) -> None:
    """`GET /api/meta/{cid}`'s `ETag` is of the document's bytes, not of a worker's memory: a
    copy fetched from one worker is revalidated (304, no body) by the other, and a change
    made through either gives both the new tag."""
    clients = one_per_worker(server)
    owner, reader = clients["owner"], clients["reader-1"]
    signer = Signer()
    register(owner, signer)
    posted = reader.post("/api/claims", json={"claims": [signer.claim(A, "title", "one")]})
    assert posted.status_code == 200, posted.text
    tags = {name: client.get(f"/api/meta/{A}").headers["etag"] for name, client in clients.items()}
    assert tags["owner"] == tags["reader-1"], tags
    for name, client in clients.items():
        again = client.get(f"/api/meta/{A}", headers={"If-None-Match": tags["owner"]})
        assert (again.status_code, again.content) == (304, b""), name
        assert again.headers["etag"] == tags["owner"] and again.headers["x-metanode-worker"] == name
    changed = signer.claim(A, "title", "two", ts=NOW_MS + 1)
    assert owner.post("/api/claims", json={"claims": [changed]}).status_code == 200
    for client in clients.values():
        fresh = client.get(f"/api/meta/{A}", headers={"If-None-Match": tags["owner"]})
        assert fresh.status_code == 200 and fresh.json()["metadata"]["title"] == "two"
        assert fresh.headers["etag"] != tags["owner"]


def test_wrong_tokens_at_sign_in_are_counted_for_every_worker(tmp_path: Path) -> None:
    """A client could try tokens at the sign-in as fast as the node answered. Now, past
    `signin_free_attempts` wrong ones, it waits (429 `too_many_attempts`, `Retry-After`), the
    right token included; the count is the owner's, which every sign-in reaches with the
    client's address, whichever worker took the connection. Another address is not held up."""
    env = {"METANODE_SIGNIN_FREE_ATTEMPTS": "3", "METANODE_SIGNIN_BACKOFF_S": "600"}
    srv = Server(tmp_path / "data", workers=2, env=env).start()
    try:
        clients = one_per_worker(srv, headers={})
        for name in ("reader-1", "owner", "reader-1"):
            wrong = clients[name].post("/signin", data={"token": "guess", "then": "/live"})
            assert wrong.status_code == 401, name
        for name, client in clients.items():
            right = client.post("/signin", data={"token": srv.token, "then": "/live"})
            assert right.status_code == 429 and 1 <= int(right.headers["retry-after"]) <= 600
            assert 'data-error="too_many_attempts"' in right.text, name
            assert right.headers["cache-control"] == "no-store" and not client.cookies
        elsewhere = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=srv.url, transport=elsewhere, timeout=30) as other:
            signed_in = other.post("/signin", data={"token": srv.token, "then": "/live"})
            assert signed_in.status_code == 303 and "metanode_session" in other.cookies
    finally:
        while OPENED:
            OPENED.pop().close()
        srv.stop()
        srv.print_log()
