"""Plugins in a real `metanode serve` (SPEC §7): the built-ins on dropped files, and an external
plugin written with `metanode.client.Client` — keygen, register, follow the feed, sign, post."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sqlite3
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import httpx
import pytest
from metanode_fullhash import hash_file

from metanode import cid as cids
from metanode import keys
from metanode import rid as rids
from metanode.client import Client, ClientError, Event, parse_frames
from tests.helpers.plugins import install_plugin
from tests.helpers.server import Server, plugins_server
from tests.helpers.wait import poll

MIB = 1 << 20
# Matroska's EBML magic with DocType "matroska", so fileinfo sniffs a video.
MKV_HEAD = bytes.fromhex(
    "1A45DFA3A34286810142F7810142F2810442F381084282886D6174726F736B6142878104428581 02".replace(
        " ", ""
    )
)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server with the built-in plugins on, shared by this module's tests (each test
    drops its own files)."""
    with plugins_server(tmp_path_factory.mktemp("plugins-server") / "data") as server:
        yield server


def media(srv: Server) -> Path:
    path = srv.data_dir.parent / "media"
    path.mkdir(exist_ok=True)
    return path


def drop(srv: Server, name: str, data: bytes) -> Path:
    """Write a file into the watched folder in one go (renamed in, so it is never seen half
    written)."""
    final = media(srv) / name
    part = final.with_name(final.name + ".part")  # the watcher ignores *.part
    part.write_bytes(data)
    part.rename(final)
    return final


def settled(srv: Server, midhash: str, *keys_: str) -> Callable[[], dict[str, Any] | None]:
    """The document of `midhash` once every key in `keys_` is in its metadata."""

    def fetch() -> dict[str, Any] | None:
        doc = srv.meta(midhash)
        return doc if doc is not None and all(k in doc["metadata"] for k in keys_) else None

    return fetch


def expected_cids(data: bytes, path: Path) -> tuple[str, str, str, str]:
    """(midhash, sha2-256, blake3, IPFS) of `data`, the first three computed here directly."""
    midhash = cids.midhash_bytes(data)
    sha = cids.encode(cids.RAW, cids.SHA2_256, hashlib.sha256(data).digest())
    b3 = cids.encode(cids.RAW, cids.BLAKE3, blake3.blake3(data).digest())
    ipfs = hash_file(str(path)).ipfs  # checked against vectors/ipfs.json in test_fullhash
    return midhash, sha, b3, ipfs


def random_bytes(seed: str, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


# -- the built-ins on a dropped file ------------------------------------------------------------


def test_dropped_file_gets_four_cids_in_one_group_and_every_plugin_field(srv: Server) -> None:
    data = MKV_HEAD + random_bytes("matrix", 3 * MIB + 12_345)
    name = "The.Matrix.1999.1080p.BluRay.x264-GROUP.mkv"
    path = drop(srv, name, data)
    midhash, sha, b3, ipfs = expected_cids(data, path)
    assert ipfs.startswith("bafybei") and sha.startswith("bafkrei") and b3.startswith("bafkr4i")

    doc = poll(
        settled(
            srv,
            midhash,
            f"cids/{ipfs}",
            f"cids/{sha}",
            f"cids/{b3}",
            "fileType",
            "title",
            "sizeByte",
        ),
        "the plugins' claims",
    )
    assert doc["cids"] == [ipfs, sha, b3, midhash]  # best rank first: 40, 30, 29, 10
    assert doc["canonical_cid"] == ipfs
    meta = doc["metadata"]
    for member in (ipfs, sha, b3, midhash):
        assert meta[f"cids/{member}"] == "true"
    assert meta["sizeByte"] == meta["fileSize"] == str(len(data))
    assert meta["filePath"] == str(path) and doc["paths"] == [str(path)]
    # fileinfo
    assert meta["fileName"] == name
    assert meta["extension"] == "mkv"
    assert meta["mimeType"] == "video/x-matroska"
    assert meta["fileType"] == "video"
    # filename
    assert meta["title"] == "The Matrix"
    assert meta["year"] == meta["movieYear"] == "1999"
    assert meta["videoType"] == "movie"

    # Every CID of the group resolves to the same document.
    for member in (ipfs, sha, b3, midhash):
        other = srv.meta(member)
        assert other is not None
        assert other["cid"] == member
        assert other["cids"] == doc["cids"]
        assert other["canonical_cid"] == ipfs
        assert other["metadata"] == meta

    # The three built-ins signed with their own keys; fullhash alone may link.
    headers = srv.headers
    listed = httpx.get(f"{srv.url}/api/plugins", headers=headers, timeout=10).json()["plugins"]
    names = ["fileinfo", "filename", "fullhash", "mediainfo", "nfo"]
    assert [p["name"] for p in listed] == names
    assert {p["name"]: p["may_link"] for p in listed} == {
        "fileinfo": False,
        "filename": False,
        "fullhash": True,
        "mediainfo": False,
        "nfo": False,
    }
    claims = httpx.get(f"{srv.url}/api/meta/{ipfs}/claims", timeout=10).json()["claims"]
    # random bytes behind a Matroska head: ffprobe refuses them, and no .nfo is beside them
    uid_of = {p["name"]: p["uid"] for p in listed if p["name"] not in ("mediainfo", "nfo")}
    assert {c["uid"] for c in claims} == set(uid_of.values())
    by_uid = {c["key"]: c["uid"] for c in claims}
    assert by_uid[f"cids/{ipfs}"] == uid_of["fullhash"]
    assert by_uid["fileType"] == uid_of["fileinfo"]
    assert by_uid["title"] == uid_of["filename"]
    for plugin in listed:
        assert plugin["runs"]["failed"] == 0
    for name_ in uid_of:
        key_file = srv.data_dir / "keys" / f"{name_}.key"
        assert keys.uid_of_key(keys.load(key_file)) == uid_of[name_]


def test_same_middle_sample_different_size_stays_apart(srv: Server) -> None:
    """Same 1 MiB sample, sizes 3 MiB and 3 MiB + 2: the size prefix keeps the midhashes apart,
    and the content hashes keep the groups apart."""
    a = random_bytes("sample", 3 * MIB)
    b = b"<" + a + b">"
    start_a, start_b = cids.midhash_offset(len(a)), cids.midhash_offset(len(b))
    assert (start_a, start_b) == (MIB, MIB + 1)
    assert a[start_a : start_a + MIB] == b[start_b : start_b + MIB]  # the very same sample
    path_a = drop(srv, "sample-a.bin", a)
    path_b = drop(srv, "sample-b.bin", b)
    mid_a, sha_a, b3_a, ipfs_a = expected_cids(a, path_a)
    mid_b, sha_b, b3_b, ipfs_b = expected_cids(b, path_b)
    assert mid_a != mid_b

    doc_a = poll(settled(srv, mid_a, f"cids/{ipfs_a}", "sizeByte"), "group of a")
    doc_b = poll(settled(srv, mid_b, f"cids/{ipfs_b}", "sizeByte"), "group of b")
    assert doc_a["cids"] == [ipfs_a, sha_a, b3_a, mid_a]
    assert doc_b["cids"] == [ipfs_b, sha_b, b3_b, mid_b]
    assert not set(doc_a["cids"]) & set(doc_b["cids"])
    assert doc_a["metadata"]["sizeByte"] == str(3 * MIB)
    assert doc_b["metadata"]["sizeByte"] == str(3 * MIB + 2)
    assert doc_a["paths"] == [str(path_a)] and doc_b["paths"] == [str(path_b)]


# -- an external plugin -------------------------------------------------------------------------


def test_external_plugin_with_the_client(srv: Server, tmp_path: Path) -> None:
    key_path = tmp_path / "rater.key"
    uid = keys.create(key_path)
    answer = httpx.post(
        f"{srv.url}/api/signers",
        headers=srv.headers,
        timeout=10,
        json={"uid": uid, "name": "rater", "weight": 1, "may_link": False},
    )
    assert answer.status_code == 200, answer.text

    data = random_bytes("rated", 600_000)
    path = drop(srv, "Heat.1995.mkv", data)
    midhash, _, _, ipfs = expected_cids(data, path)
    poll(settled(srv, midhash, f"cids/{ipfs}"), "fullhash on the rated file")

    client = Client(srv.url, token=srv.token, key=keys.load(key_path))
    try:
        assert client.uid == uid
        rid = None
        for event in client.events(snapshot=True, prefix=["filePath"]):
            if event.kind == "set" and event.data["value"] == str(path):
                rid = event.data["rid"]
                break
            assert event.kind != "synced", "the snapshot ended without the file"
        assert rid is not None
        doc = client.meta_by_rid(rid)
        assert doc["hashId"] == rid
        assert doc["canonical_cid"] == ipfs and midhash in doc["cids"]

        claim = client.sign(doc["canonical_cid"], "rating", "5")
        assert claim["uid"] == uid and claim["cid"] == ipfs
        result = client.post([claim])
        assert result["accepted"] == 1 and result["applied"] is True
        assert client.post([claim])["duplicate"] == 1  # re-sending is safe

        seen = client.meta(midhash)
        assert seen is not None and seen["metadata"]["rating"] == "5"
        listed = httpx.get(
            f"{srv.url}/api/meta/{midhash}/claims", params={"uid": uid}, timeout=10
        ).json()["claims"]
        assert listed == [claim]
    finally:
        client.close()


def test_client_errors(srv: Server, tmp_path: Path) -> None:
    key_path = tmp_path / "stranger.key"
    keys.create(key_path)
    client = Client(srv.url, token=srv.token, key=keys.load(key_path))
    anonymous = Client(srv.url)
    keyless = Client(srv.url, token=srv.token)
    cid = cids.midhash_bytes(b"client errors")
    try:
        with pytest.raises(ClientError) as info:
            client.post([client.sign(cid, "filePath", "/etc/passwd")])
        assert info.value.status == 400
        assert info.value.slug == "invalid_batch"
        assert [item["error"] for item in info.value.body["items"]] == ["reserved_key"]

        with pytest.raises(ClientError) as info:  # not registered
            client.post([client.sign(cid, "title", "x")])
        assert (info.value.status, info.value.slug) == (403, "invalid_batch")
        assert info.value.body["items"][0]["error"] == "unknown_signer"

        with pytest.raises(ClientError) as info:
            anonymous.post([client.sign(cid, "title", "x")])
        assert (info.value.status, info.value.slug) == (401, "unauthorized")

        with pytest.raises(ClientError) as info:
            client.meta("not-a-cid")
        assert (info.value.status, info.value.slug) == (400, "invalid_cid")
        assert "400 invalid_cid" in str(info.value)

        assert client.meta(cid) is None  # a valid CID no record holds
        with pytest.raises(ClientError) as info:
            client.meta_by_rid(rids.Minter().mint())  # a well-formed rid nobody minted here
        assert (info.value.status, info.value.slug) == (404, "unknown_rid")
        with pytest.raises(ClientError) as info:
            client.meta_by_rid("01ARZ3NDEKTSV4RRFFQ69G5FAV")  # a ULID, not a UUIDv7
        assert (info.value.status, info.value.slug) == (400, "invalid_rid")

        with pytest.raises(ValueError):
            keyless.sign(cid, "title", "x")
        with pytest.raises(ValueError):
            _ = keyless.uid
    finally:
        for c in (client, anonymous, keyless):
            c.close()


# -- parse_frames (no server) -------------------------------------------------------------------


def test_parse_frames() -> None:
    lines = [
        ": keep-alive",
        "",
        "id: 17-1",
        "event: set",
        'data: {"rid": "R", "key": "title", "value": "x"}',
        "",
        "event: set",
        'data:{"rid": "R", "key": "year", "value": "1999"}',
        "",  # snapshot: no id
        "event: synced",
        'data: {"id": "17-1"}',
        "",
        "id: 17-2",
        "event: del",
        'data: {"rid": "R", "key": "title"}',
        "",
        'data: {"plain": true}',
        "",  # no event name: "message"
        "id: 17-3",
        "event: set",
        "",  # no data: not an event
        "event: gap",
        'data: {"requested": "0-0", "reason": "unknown epoch"}',  # no blank line
    ]
    assert list(parse_frames(lines)) == [
        Event("17-1", "set", {"rid": "R", "key": "title", "value": "x"}),
        Event(None, "set", {"rid": "R", "key": "year", "value": "1999"}),
        Event(None, "synced", {"id": "17-1"}),
        Event("17-2", "del", {"rid": "R", "key": "title"}),
        Event(None, "message", {"plain": True}),
    ]


def test_parse_frames_keeps_only_one_space_after_the_colon() -> None:
    frames = list(parse_frames(["event:  set", 'data: {"a": 1}', ""]))
    assert frames == [Event(None, " set", {"a": 1})]


# -- a plugin that ends the process -------------------------------------------------------------


def test_a_plugin_that_ends_the_process_on_a_file_fails_there_and_the_node_stays_up(
    tmp_path: Path,
) -> None:
    """`os._exit` in a plugin (as a crash in a C extension on a corrupt file) ends the node.
    Its run never finished, so it was pending again and ended every start after: the node
    never stayed up. The next start charges it the attempt it died in; at
    `plugin_max_attempts` it stays failed, saying why, and the node serves on."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(
        site,
        "crasher",
        "crasher",
        "if 'poison' in file.path:\n    os._exit(70)\nregister(file.cid, 'crasher', 'fine')",
    )
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "METANODE_PLUGIN_MAX_ATTEMPTS": "1"}
    with plugins_server(tmp_path / "data", **env) as server:
        poison = cids.midhash_bytes(b"poison" * 1000)
        drop(server, "poison.bin", b"poison" * 1000)
        assert server.proc is not None
        assert server.proc.wait(timeout=120) == 70  # the plugin ended the node
        server.start()  # charged its attempt, the run is not started again
        fine = drop(server, "fine.bin", b"fine" * 1000)
        doc = poll(settled(server, cids.midhash_bytes(fine.read_bytes()), "crasher"), "fine run")
        assert doc["metadata"]["crasher"] == "fine"
        listed = httpx.get(f"{server.url}/api/plugins", headers=server.headers, timeout=30)
        crasher = {p["name"]: p for p in listed.json()["plugins"]}["crasher"]
        assert crasher["runs"]["failed"] == 1, crasher
        assert [(f["cid"], f["error"]) for f in crasher["failures"]] == [
            (poison, "the node stopped during this run (the plugin ended the process: os._exit, "
             "a crash in a C extension, memory; or the node was killed)")
        ]  # fmt: skip
        assert "plugin crasher on " in server.log_text()
        assert server.proc.poll() is None


def test_a_node_killed_mid_backlog_ends_with_every_claim_once_and_redoes_only_its_runs_in_flight(
    tmp_path: Path,
) -> None:
    """SIGKILL with the plugins' backlog half done, then a start: every file ends with every
    plugin's claim, each run done once more at most if it was in flight at the kill (charged
    the attempt it died in), none of those done before it redone."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(
        site,
        "tagger",
        "tagger",
        "import pathlib, time\n"
        "gate = pathlib.Path(file.root).parent / 'gate'\n"
        "while 'late' in file.path and gate.exists():\n"
        "    time.sleep(0.05)\n"
        "register(file.cid, 'tagger', file.in_root)",
    )
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "METANODE_PLUGINS_DISABLED": "filename,fullhash,mediainfo"}
    gate = tmp_path / "gate"
    gate.write_text("holds the late files' runs")
    with plugins_server(tmp_path / "data", **env) as server:
        names = [f"early{n:02d}.bin" for n in range(30)] + [f"late{n}.bin" for n in range(5)]
        for name in names:
            drop(server, name, random_bytes(name, 2000))
        every = {"fileinfo": 35, "nfo": 35, "tagger": 35}
        held = {"fileinfo": 35, "nfo": 35}  # and a run of tagger's held on a late file
        poll(
            lambda: (running(server, "tagger") and held.items() <= done(server).items()) or None,
            "held",
        )
        before = plugin_runs(server)
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        gate.unlink()
        server.start()
        poll(lambda: done(server) == every or None, "every run done after the restart")
        claims = sqlite3.connect(f"file:{server.data_dir / 'truth.db'}?mode=ro", uri=True)
        tagged = dict(
            claims.execute(
                "SELECT c.value, count(*) FROM claims c JOIN signers s ON s.uid = c.uid "
                "WHERE s.name = 'plugin:tagger' GROUP BY c.value"
            ).fetchall()
        )
        claims.close()
        assert tagged == dict.fromkeys(names, 1)
        after = plugin_runs(server)
        assert {status for status, _ in after.values()} == {"done"}
        again = {run for run, (_, attempts) in after.items() if attempts > 1}
        assert len(again) == 1, again  # tagger's run in flight (plugin_workers 1)
        assert all(before[run][0] == "pending" for run in again)  # none done before the kill
        assert all(attempts == 1 for run, (_, attempts) in after.items() if run not in again)


def done(server: Server) -> dict[str, int]:
    """Each plugin's runs done, as `GET /api/plugins` counts them."""
    listed = httpx.get(f"{server.url}/api/plugins", headers=server.headers, timeout=30)
    return {p["name"]: p["runs"]["done"] for p in listed.json()["plugins"]}


def running(server: Server, name: str) -> bool:
    """Whether a run of plugin `name` is going on now."""
    listed = httpx.get(f"{server.url}/api/plugins", headers=server.headers, timeout=30)
    return bool({p["name"]: p for p in listed.json()["plugins"]}[name]["running"])


def plugin_runs(server: Server) -> dict[tuple[str, str], tuple[str, int]]:
    """(plugin, midhash) → (status, attempts) of every run in cache.db."""
    conn = sqlite3.connect(f"file:{server.data_dir / 'cache.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT plugin, midhash, status, attempts FROM plugin_runs")
        return {(plugin, midhash): (status, attempts) for plugin, midhash, status, attempts in rows}
    finally:
        conn.close()


def waiting_for_a_reader(pid: int) -> bool:
    """Whether a thread of process `pid` is blocked opening a FIFO no one reads (Linux names
    the kernel function it waits in, `wait_for_partner`, in /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    return any((task / "wchan").read_text() == "wait_for_partner" for task in tasks.iterdir())


def test_a_run_starts_once_it_is_named_and_the_naming_never_holds_the_node(
    tmp_path: Path,
) -> None:
    """`plugins-running` names each run before it starts (so a run that ends the process is
    charged). Its write waits for the disk, and on a slow one (an SD card busy with the
    databases) it held the event loop for seconds: every request waited. A FIFO in place of
    the file's partial copy makes that write wait for as long as no one reads it: meanwhile the
    node answers, and the plugin does not run."""
    data = tmp_path / "data"
    with plugins_server(data, METANODE_PLUGINS_DISABLED="fileinfo,fullhash,mediainfo,nfo") as srv:
        assert srv.proc is not None
        pid = srv.proc.pid
        os.mkfifo(data / "plugins-running.partial")
        content = b"Show.S01E02.Pilot.mkv " * 100
        midhash = cids.midhash_bytes(content)
        drop(srv, "Show.S01E02.Pilot.mkv", content)
        poll(lambda: waiting_for_a_reader(pid) or None, "the run's naming waits")
        for _ in range(3):
            assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        doc = srv.meta(midhash)
        assert doc is not None and "title" not in doc["metadata"]  # the run has not started
        named = (data / "plugins-running.partial").read_text()  # lets the write go on
        assert [(run[0], run[2]) for run in map(json.loads, named.splitlines())] == [
            ("filename", midhash)
        ]
        poll(settled(srv, midhash, "title"), "the run done once named")


# -- what /health says of plugins ----------------------------------------------------------------


def health_warning(server: Server, words: str) -> dict[str, Any] | None:
    """/health once one of its warnings holds `words` (it must answer 200 `ok` throughout: a
    broken plugin is no reason to take the node out)."""
    answer = httpx.get(f"{server.url}/health", timeout=30)
    assert answer.status_code == 200 and answer.json()["status"] == "ok", answer.text
    body: dict[str, Any] = answer.json()
    return body if any(words in warning for warning in body["warnings"]) else None


def test_health_warns_of_a_plugin_that_does_not_load_and_of_one_that_always_fails(
    tmp_path: Path,
) -> None:
    """A plugin whose package fails to import, and one that raises on every file, were in the
    log and `GET /api/plugins` alone: /health said `ok` with nothing more. Each is a warning
    now, naming the plugin, why and what to do; the status stays `ok` (the container's
    HEALTHCHECK passes: the node serves, and a restart would mend neither), and a retry of the
    mended plugin clears its warning."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "broken", "broken")
    module = site / "broken_plugin.py"
    module.write_text("import not_installed_anywhere\n" + module.read_text())
    failing = site / "failing"  # the raiser raises while this file is there
    failing.touch()
    install_plugin(
        site,
        "raiser",
        "raiser",
        f"if os.path.exists({str(failing)!r}):\n    raise ValueError('boom')\n"
        "register(file.cid, 'ran', 'yes')",
    )
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    builtins = "fullhash,fileinfo,filename,mediainfo,nfo"
    env = {"PYTHONPATH": path, "METANODE_PLUGIN_MAX_ATTEMPTS": "1"}
    with plugins_server(tmp_path / "data", METANODE_PLUGINS_DISABLED=builtins, **env) as server:
        health = poll(lambda: health_warning(server, "broken"), "the broken plugin's warning")
        assert health["warnings"] == [
            "plugin broken (broken_plugin:P) does not load: ModuleNotFoundError: No module "
            f"named 'not_installed_anywhere' (at {module}:1 in <module>): the node's Python "
            f"({sys.prefix}) has no 'not_installed_anywhere'; install the package that "
            f"provides it there ({sys.executable} -m pip install …) and list it in the "
            "plugin's dependencies; mend or remove it, then restart the node (`metanode "
            "plugins list` lists it)"
        ]
        scrape = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
        assert "\nmetanode_health_warnings 1.0\n" in scrape  # for an alert
        with httpx.Client(base_url=server.url, timeout=30) as page:  # the Health page says it too
            assert page.post("/signin", data={"token": server.token}).status_code == 303
            assert "plugin broken (broken_plugin:P) does not load" in page.get("/status").text
        dropped = drop(server, "a.bin", b"a" * 5000)
        health = poll(lambda: health_warning(server, "raiser"), "the failing plugin's warning")
        assert health["warnings"][1] == (
            f"plugin raiser: 1 run(s) failed for good since the start (the newest on {dropped}: "
            f"ValueError: boom (at {site / 'raiser_plugin.py'}:8 in process)); mend the plugin, "
            "restart the node, then `metanode plugins retry raiser`"
        )
        failing.unlink()  # mended
        retried = httpx.post(
            f"{server.url}/api/plugins/raiser/retry", headers=server.headers, timeout=30
        )
        assert retried.status_code == 200, retried.text
        doc = poll(settled(server, cids.midhash_bytes(dropped.read_bytes()), "ran"), "the rerun")
        assert doc["metadata"]["ran"] == "yes"
        assert not any("raiser" in w for w in httpx.get(f"{server.url}/health").json()["warnings"])


def test_a_plugin_that_fails_on_every_file_writes_twenty_lines_then_sums_up(
    tmp_path: Path,
) -> None:
    """A plugin raising on every file wrote a line per attempt (300 for 100 files at three
    attempts: 300,000 for a library). A plugin's first 20 lines of a 10-minute window are
    written; the rest are counted and summed up once it has no run going on."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "raiser", "raiser", "raise ValueError('boom')")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    builtins = "fullhash,fileinfo,filename,mediainfo,nfo"
    env = {"PYTHONPATH": path, "METANODE_PLUGIN_MAX_ATTEMPTS": "1"}
    with plugins_server(tmp_path / "data", METANODE_PLUGINS_DISABLED=builtins, **env) as server:
        for n in range(30):
            drop(server, f"{n}.bin", f"file {n}".encode() * 1000)

        def summed() -> list[str] | None:
            said = [m for m in server.log_messages() if m.startswith("plugin raiser")]
            sums = [m for m in said if m.startswith("plugin raiser: ")]
            held = sum(int(m.split()[2]) for m in sums)
            return said if held + len(said) - len(sums) == 30 else None

        said = poll(summed, "every failure said or counted")
    one_by_one = [m for m in said if m.startswith("plugin raiser on ")]
    assert len(one_by_one) == 20 and all("ValueError: boom" in m for m in one_by_one)
    assert (
        said[20].startswith("plugin raiser: ")
        and " more failed or skipped attempt(s) in " in (said[20])
    )
    assert said[-1].endswith("runs it again)"), said[-1]  # the newest failure's own words
