"""The plugin host (SPEC §7), in-process with a started node, its watcher and real files.

Which plugins exist is chosen by replacing `metanode.plugins.discover` (entry points are for
installed packages); everything else — keys, signer registration, the run table, retries,
timeouts, signing and ingest — is the node's own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import stat
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metanode import cache, db, keys, plugins, truth
from metanode import cid as cids
from metanode.api import create_app
from metanode.errors import MetanodeError
from metanode.node import Node
from metanode.plugins import LocalFile, Plugin, RecordLookup, Register, Skip
from tests.helpers.plugins import Action, Probe, claim, install_plugin, probe
from tests.helpers.settings import settings_for

pytestmark = pytest.mark.both_backends  # the tests on a `node` run on both

RID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")  # a rid: 26 Crockford base32 characters, upper case


def raises(file: LocalFile, record: RecordLookup, register: Register) -> None:
    raise ValueError("boom")


async def until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll `check` until it holds; fail after `timeout` seconds (a bound, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


@dataclass(frozen=True)
class Run:
    status: str
    attempts: int
    error: str | None


def runs(node: Node) -> dict[tuple[str, str, str], Run]:
    """Every row of the plugin run table: (plugin, version, midhash) → status."""
    conn = db.connect(node.settings.cache_path, readonly=True)
    try:
        return {
            (p, v, m): Run(s, a, e)
            for p, v, m, s, a, e in conn.execute(
                "SELECT plugin, version, midhash, status, attempts, error FROM plugin_runs"
            )
        }
    finally:
        conn.close()


def run_of(node: Node, plugin: Plugin, midhash: str) -> Run | None:
    return runs(node).get((plugin.name, plugin.version, midhash))


def finished(node: Node, plugin: Plugin, midhash: str, status: str = "done") -> Callable[[], bool]:
    def check() -> bool:
        run = run_of(node, plugin, midhash)
        return run is not None and run.status == status

    return check


def metadata(node: Node, cid: str) -> dict[str, str]:
    doc = node.meta(cid)
    found: dict[str, str] = doc["metadata"]
    return found


async def counts(node: Node, name: str) -> dict[str, int]:
    described = (await node.plugins())["plugins"]
    for entry in described:
        if entry["name"] == name:
            found: dict[str, int] = entry["runs"]
            return found
    raise AssertionError(f"no plugin {name} in {described}")


@dataclass
class Harness:
    """Starts nodes on one data directory with chosen plugins; stops them and releases any
    blocked plugin threads at the end (while the event loop still runs)."""

    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    nodes: list[Node] = field(default_factory=list)
    gates: list[threading.Event] = field(default_factory=list)

    @property
    def media(self) -> Path:
        path = self.tmp / "media"
        path.mkdir(exist_ok=True)
        return path

    def drop(self, name: str, data: bytes) -> tuple[str, str]:
        """Write a file into the watched folder: (path, its midhash)."""
        path = self.media / name
        path.write_bytes(data)
        return str(path), cids.midhash_bytes(data)

    def gate(self) -> threading.Event:
        event = threading.Event()
        self.gates.append(event)
        return event

    async def start(
        self,
        found: list[Plugin],
        not_loaded: Sequence[plugins.NotLoaded] = (),
        **overrides: Any,
    ) -> Node:
        self.monkeypatch.setattr(plugins, "discover", lambda: (list(found), list(not_loaded)))
        options: dict[str, Any] = {
            "plugins_enabled": True,
            "watch_enabled": True,
            "watch_settle_s": 0.2,
            "plugin_retry_s": 0.1,
            "plugin_timeout_s": 1.0,
            "plugin_workers": 2,
            "plugin_max_attempts": 3,
            **overrides,
        }
        node = Node(settings_for(self.tmp / "data", **options))
        await node.start()
        self.nodes.append(node)
        assert await node.applier.wait_for(0, 10)
        return node

    async def stop(self, node: Node) -> None:
        self.nodes.remove(node)
        await node.stop()

    async def close(self) -> None:
        for node in list(self.nodes):
            await self.stop(node)
        for gate in self.gates:
            gate.set()
        for thread in threading.enumerate():
            if thread.name == "plugin":
                thread.join(10)


@pytest.fixture
async def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    h = Harness(tmp_path, monkeypatch)
    yield h
    await h.close()


def blocked_until(
    gate: threading.Event, then: Action | None = None, first_only: bool = False
) -> Action:
    """An action that waits for `gate` (at most 15 s), then does `then`."""
    state = {"calls": 0}

    def action(file: LocalFile, record: RecordLookup, register: Register) -> None:
        state["calls"] += 1
        if not first_only or state["calls"] == 1:
            gate.wait(15)
        if then is not None:
            then(file, record, register)

    return action


# -- units --------------------------------------------------------------------------------------


def test_backoff_grows_fourfold() -> None:
    assert [plugins.backoff_s(n, 0.5) for n in (1, 2, 3, 4)] == [0.5, 2.0, 8.0, 32.0]


def test_discover_finds_the_builtins_through_entry_points() -> None:
    found, not_loaded = plugins.discover()
    assert not_loaded == []
    assert [p.name for p in found] == ["fileinfo", "filename", "fullhash", "mediainfo", "nfo"]
    assert all(isinstance(p, Plugin) and p.version for p in found)
    assert {p.name: p.may_link for p in found} == {
        "fileinfo": False,
        "filename": False,
        "fullhash": True,
        "mediainfo": False,
        "nfo": False,
    }
    assert {p.name for p in found if p.path_dependent} == {"fileinfo", "filename", "nfo"}


def test_two_plugins_of_one_name_neither_runs_and_a_bad_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A second package naming its plugin as another's took its place, signed with its key and
    retracted its claims; a name is also the key's file name (`keys/<name>.key`). Each plugin
    that does not run is listed with why (it was only in the log)."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "sizeclass", "sizeclass")
    install_plugin(site, "impostor", "sizeclass")
    install_plugin(site, "escaper", "../owner")
    install_plugin(site, "fine", "fine")
    install_plugin(site, "needy", "needy")
    needy = site / "needy_plugin.py"
    needy.write_text("import not_installed_anywhere\n" + needy.read_text())
    install_plugin(site, "heavy", "heavy")  # its weight stopped the node at every start
    heavy = site / "heavy_plugin.py"
    heavy.write_text(heavy.read_text().replace("version = '1'", "version = '1'; weight = -5"))
    monkeypatch.syspath_prepend(str(site))
    found, not_loaded = plugins.discover()
    names = [p.name for p in found]
    assert "fine" in names and "sizeclass" not in names and "../owner" not in names
    said = caplog.text
    assert "impostor_plugin:P, sizeclass_plugin:P are all named 'sizeclass'" in said or (
        "sizeclass_plugin:P, impostor_plugin:P are all named 'sizeclass'" in said
    )
    assert "escaper_plugin:P: name '../owner' is not" in said
    why = {each.entry_point: (each.source, each.error) for each in not_loaded}
    assert sorted(why) == ["escaper", "heavy", "impostor", "needy", "sizeclass"]
    assert why["heavy"][1] == "TypeError: heavy_plugin:P: weight -5 is not an int from 0 to 1000000"
    assert why["escaper"][0] == "escaper_plugin:P"
    assert why["escaper"][1].startswith("TypeError: escaper_plugin:P: name '../owner' is not")
    assert why["needy"][1] == (
        f"ModuleNotFoundError: No module named 'not_installed_anywhere' (at {needy}:1 in <module>)"
        f": the node's Python ({sys.prefix}) has no 'not_installed_anywhere'; install the package "
        f"that provides it there ({sys.executable} -m pip install …) and list it in the plugin's "
        "dependencies"
    )
    assert why["impostor"][1] == why["sizeclass"][1]
    assert "are all named 'sizeclass': none of them runs" in why["sizeclass"][1]


class Attributes(Plugin):
    name = "attrs"
    version = "1"

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        pass


async def awaited(self: Plugin, file: LocalFile, record: RecordLookup, register: Register) -> None:
    register(file.cid, "never", "registered")


def yields(
    self: Plugin, file: LocalFile, record: RecordLookup, register: Register
) -> Iterator[Any]:
    yield (file.cid, "never", "registered")


def too_few(self: Plugin, file: LocalFile) -> None:
    pass


@pytest.mark.parametrize(
    ("attribute", "value", "problem"),
    [
        ("version", 2, "version 2 is not a str such as '1' (bump it when its claims change)"),
        ("version", " ", "version ' ' is not a str such as '1' (bump it when its claims change)"),
        ("weight", -5, "weight -5 is not an int from 0 to 1000000"),
        ("weight", 1_000_001, "weight 1000001 is not an int from 0 to 1000000"),
        ("weight", "3", "weight '3' is not an int from 0 to 1000000"),
        ("weight", True, "weight True is not an int from 0 to 1000000"),
        ("may_link", 1, "may_link 1 is not True or False"),
        ("path_dependent", "yes", "path_dependent 'yes' is not True or False"),
        ("sidecars", "nfo", "sidecars 'nfo' is not a set of lower-case extensions without the dot"),
        (
            "sidecars",
            frozenset({".nfo"}),
            "sidecars frozenset({'.nfo'}) is not a set of lower-case extensions without the dot",
        ),
        (
            "sidecars",
            {"NFO"},
            "sidecars {'NFO'} is not a set of lower-case extensions without the dot",
        ),
        ("name", "Upper", "name 'Upper' is not [a-z0-9][a-z0-9_.-]{0,63}"),
        (
            "process",
            awaited,
            "process is an async def: the host calls it on a thread of its own and never "
            "awaits it; make it a plain def",
        ),
        (
            "process",
            yields,
            "process is a generator (it yields): the host makes claims of its "
            "register(cid, key, value) calls alone; call register instead",
        ),
        (
            "process",
            too_few,
            "process(file: 'LocalFile') -> 'None' cannot be called as "
            "process(file, record, register)",
        ),
        ("process", Plugin.process, "it defines no process(self, file, record, register)"),
        ("process", None, "it defines no process(self, file, record, register)"),
    ],
)
def test_a_plugin_of_a_wrong_attribute_is_not_loaded(
    attribute: str, value: object, problem: str
) -> None:
    """`plugins try` took a plugin without a `version`, or of weight -5, that then stopped the
    node at every start; one of `version = 2` ran, its runs never counted as its version's. An
    `async def process` (or one that yields) ran, was `done` on every file and claimed nothing;
    one without `process`, or of other parameters, failed every run with an error that named
    no line of the plugin (`NotImplementedError: `)."""
    assert plugins.attribute_problem(Attributes()) is None
    assert plugins.attribute_problem(type("Odd", (Attributes,), {attribute: value})()) == problem
    unversioned = type("Unversioned", (Plugin,), {"name": "nover"})()
    assert plugins.attribute_problem(unversioned) == (
        "version None is not a str such as '1' (bump it when its claims change)"
    )


def test_plugin_key_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    first = plugins.plugin_key(tmp_path / "keys", "x")
    path = tmp_path / "keys" / "x.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert bytes(plugins.plugin_key(tmp_path / "keys", "x")) == bytes(first)


# -- the host in a node -------------------------------------------------------------------------


async def test_drafts_are_claims_signed_by_the_plugins_own_key(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    path, midhash = harness.drop("a.bin", b"signed by the plugin")
    tagger = probe("tagger", claim("tag", "x"), weight=3, version="2")
    with caplog.at_level(logging.INFO, logger="metanode.node"):
        node = await harness.start([tagger])
    # the start line said `tagger 2`: read as its weight, it contradicted the signers list
    assert "plugins: tagger (version 2, weight 3)" in caplog.messages
    await until(finished(node, tagger, midhash), "tagger done")

    key_file = node.settings.keys_dir / "tagger.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    uid = keys.uid_of_key(keys.load(key_file))
    [described] = (await node.plugins())["plugins"]
    assert described["uid"] == uid and described["name"] == "tagger"
    [signer] = [s for s in node.signers() if s["uid"] == uid]
    assert signer["name"] == "plugin:tagger"
    assert signer["weight"] == 3
    assert signer["may_link"] is False

    listed = node.meta_claims(midhash, key="tag", uid=None)["claims"]
    assert [(c["uid"], c["cid"], c["key"], c["value"]) for c in listed] == [
        (uid, midhash, "tag", "x")
    ]
    assert metadata(node, midhash)["tag"] == "x"
    assert metadata(node, midhash)["filePath"] == path


async def test_plugin_sees_the_local_file_and_metadata_never_a_rid(harness: Harness) -> None:
    data = b"what does a plugin see"
    path, midhash = harness.drop("seen.bin", data)
    looked: list[Any] = []

    def look(file: LocalFile, record: RecordLookup, register: Register) -> None:
        looked.append(record(file.cid))
        looked.append(record(cids.midhash_bytes(b"no such content")))
        register(file.cid, "seen", "yes")

    watcher = probe("looker", look)
    node = await harness.start([watcher])
    await until(finished(node, watcher, midhash), "looker done")

    [file] = watcher.calls
    info = os.stat(path)
    assert file == LocalFile(
        cid=midhash,
        path=path,
        size=len(data),
        mtime_ns=info.st_mtime_ns,
        root=os.path.dirname(path),
        relative="seen.bin",
    )
    assert file.in_root == "seen.bin"
    rid = node.files("", None, 10)["files"][0]["rid"]
    assert RID.fullmatch(rid)
    seen, unknown = looked
    assert unknown is None
    assert seen["filePath"] == path
    assert seen["fileSize"] == str(len(data))
    assert seen[f"cids/{midhash}"] == "true"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in seen.items())
    assert "hashId" not in seen and "rid" not in seen
    for text in (*watcher.arguments, repr(seen)):
        assert rid not in text
        assert RID.search(text) is None, text


async def test_a_raising_plugin_fails_its_run_only_retries_with_backoff_then_fails(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    path, midhash = harness.drop("r.bin", b"one plugin raises on this")
    good = probe("good", claim("good", "yes"))
    bad = probe("bad", raises)
    node = await harness.start([good, bad], plugin_max_attempts=3)
    await until(finished(node, bad, midhash, "failed"), "bad failed")
    await until(finished(node, good, midhash), "good done")

    assert len(bad.calls) == 3  # plugin_max_attempts
    assert len(good.calls) == 1
    run = run_of(node, bad, midhash)
    assert run is not None and run.attempts == 3
    # where in the plugin's code, as a traceback's last line would say
    assert run.error is not None and re.fullmatch(
        r"ValueError: boom \(at .*/tests/test_plugins\.py:\d+ in raises\)", run.error
    ), run.error
    # The retries waited their backoff: 0.1 s, then 0.4 s (next_at is a lower bound on the host's
    # own clock, which is the one read here).
    gaps = [b - a for a, b in zip(bad.called_at_ms, bad.called_at_ms[1:], strict=False)]
    assert gaps[0] >= 1000 * plugins.backoff_s(1, 0.1)
    assert gaps[1] >= 1000 * plugins.backoff_s(2, 0.1)
    assert await counts(node, "bad") == {"done": 0, "pending": 0, "failed": 1, "skipped": 0}
    assert await counts(node, "good") == {"done": 1, "pending": 0, "failed": 0, "skipped": 0}
    assert metadata(node, midhash)["good"] == "yes"
    # each failure's log line says what comes of it: the same line three times did not
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plugin bad on")]
    assert said == [
        f"plugin bad on {path}: {run.error} (attempt 1 of 3; tried again in 0.1 s)",
        f"plugin bad on {path}: {run.error} (attempt 2 of 3; tried again in 0.4 s)",
        f"plugin bad on {path}: {run.error} (attempt 3 of 3: failed; mend the plugin, restart "
        "the node, then `metanode plugins retry bad` runs it again)",
    ]


async def test_a_hanging_plugin_times_out_and_other_runs_continue(harness: Harness) -> None:
    gate = harness.gate()
    _, first = harness.drop("one.bin", b"a plugin hangs on this")
    refused: list[str] = []

    def late(file: LocalFile, record: RecordLookup, register: Register) -> None:
        try:
            register(file.cid, "late", "too late")
        except RuntimeError as exc:
            refused.append(str(exc))
            raise

    hang = probe("hang", blocked_until(gate, late))
    good = probe("good", claim("good", "yes"))
    node = await harness.start([hang, good], plugin_max_attempts=1, plugin_timeout_s=1.0)
    await until(finished(node, hang, first, "failed"), "hang timed out")
    run = run_of(node, hang, first)
    assert run is not None and run.error is not None and "timed out" in run.error
    await until(finished(node, good, first), "good done on the first file")

    # The host goes on: a new file is processed by the working plugin.
    _, second = harness.drop("two.bin", b"after the hang")
    await until(finished(node, good, second), "good done on the second file")
    assert metadata(node, second)["good"] == "yes"

    # The abandoned run wakes up: what it registers now is refused, never ingested.
    gate.set()
    await until(lambda: bool(refused), "the abandoned run's late register to be refused")
    assert refused == ["this run is over (it timed out)"]
    for thread in threading.enumerate():
        if thread.name == "plugin":
            thread.join(10)
    assert "late" not in metadata(node, first)
    assert (await counts(node, "hang"))["failed"] >= 1


async def test_going_back_to_an_older_version_runs_it_again(harness: Harness) -> None:
    """A rollback (2 → 1) found version 1's runs done and ran nothing: the records kept what
    version 2 said. A version whose runs are older than another version's runs again."""
    _, midhash = harness.drop("back.bin", b"versions back and forth")
    for version, value in (("1", "one"), ("2", "two"), ("1", "one again")):
        plugin = probe("ver", claim("ver", value), version=version)
        node = await harness.start([plugin])
        await until(says(node, midhash, value), f"version {version}'s {value!r} merged")
        assert len(plugin.calls) == 1
        await harness.stop(node)


def says(node: Node, midhash: str, value: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return metadata(node, midhash).get("ver") == value
        except MetanodeError:  # no record yet
            return False

    return check


async def test_a_plugin_that_calls_sys_exit_fails_its_run_and_the_node_goes_on(
    harness: Harness,
) -> None:
    """A wrapped argparse or click tool exits on bad input: the node exited with it (status 2),
    and again at every start, the run still pending."""

    def exits(file: LocalFile, record: RecordLookup, register: Register) -> None:
        sys.exit(2)

    error = await fails_alone(harness, probe("leaver", exits))
    where = r" \(at .*/test_plugins\.py:\d+ in exits\)"  # the plugin's line, as a traceback's
    assert re.fullmatch("Aborted: SystemExit: 2" + where, error), error


async def fails_alone(harness: Harness, bad: Probe) -> str:
    """`bad`'s run on a file fails, and the node goes on: the plugin beside it runs on the
    next file, and /health is ok. The failed run's error."""
    _, first = harness.drop(f"{bad.name}.bin", f"{bad.name} fails on this".encode())
    good = probe("good", claim("good", "yes"))
    node = await harness.start([bad, good], plugin_max_attempts=1)
    await until(finished(node, bad, first, "failed"), f"{bad.name}'s run to fail")
    _, second = harness.drop("next.bin", b"the next file")
    await until(finished(node, good, second), "the host to go on with the next file")
    assert node.health()["status"] == "ok"
    run = run_of(node, bad, first)
    assert run is not None and run.error is not None
    return run.error


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (lambda f: (f, "k", "v"), "TypeError: register(cid, key, value): cid and key are str"),
        (lambda f: (f.cid, "k", 5), "TypeError: register(cid, key, value): value is a str or"),
        (lambda f: (f.cid, "k", "\ud800"), "cannot sign what it registered"),
    ],
    ids=["file-for-cid", "int-value", "lone-surrogate"],
)
async def test_a_register_call_the_node_cannot_sign_fails_that_run_only(
    harness: Harness, arguments: Callable[[LocalFile], tuple[Any, Any, Any]], error: str
) -> None:
    """`register(file, …)` (the file for its CID) raised in the host, outside any run: the
    plugin task ended, silently, and no plugin ran again until a restart."""

    def wrong(file: LocalFile, record: RecordLookup, register: Register) -> None:
        register(*arguments(file))

    assert error in await fails_alone(harness, probe("bad", wrong))


async def test_a_run_s_claims_are_signed_off_the_event_loop(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin that registers many claims a file (an album's tracks, a subtitle index) had
    them signed on the event loop, ≈ 60 to 120 µs each, and its earlier claims read there
    twice (what the run replaces, and the newest to date it after): a run of 50,000 held
    every request of the node for 4.3 s, then 1.8 s. The host does both on threads; each
    claim is still signed and read (spies around the real functions say on which thread)."""
    signed_on: list[threading.Thread] = []

    def spy(module: Any, name: str) -> None:
        real = getattr(module, name)

        def spied(*args: Any, **kwargs: Any) -> Any:
            signed_on.append(threading.current_thread())
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spied)

    spy(plugins.claims, "sign")
    spy(truth, "said_about")
    spy(truth, "newest_said")
    _, midhash = harness.drop("tracks.flac", b"an album of many tracks")

    def tracks(file: LocalFile, record: RecordLookup, register: Register) -> None:
        for n in range(300):
            register(file.cid, f"tracks/{n}", f"track {n}")

    lister = probe("lister", tracks)
    node = await harness.start([lister])
    await until(finished(node, lister, midhash), "lister done")
    assert metadata(node, midhash)["tracks/299"] == "track 299"
    assert len(signed_on) >= 302 and threading.current_thread() not in signed_on


class Returns(Probe):
    """Returns its claims, as if the host took them so."""

    name = "returner"
    version = "1"

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> Any:
        super().process(file, record, register)
        return {"genre": "Sci-Fi"}


async def test_a_process_that_returns_its_claims_fails_its_run(harness: Harness) -> None:
    """A `process` returning `{"genre": "Sci-Fi"}` was `done`, its return dropped without a
    word: the plugin claimed nothing and nothing said why."""
    error = await fails_alone(harness, Returns(claim("fine", "x")))
    assert re.fullmatch(
        r"TypeError: process returned \{'genre': 'Sci-Fi'\}, not None: the host takes only "
        r"what it passes to register\(cid, key, value\), one claim a call "
        r"\(at .*/tests/test_plugins\.py:\d+ in process\)",
        error,
    ), error


def test_a_key_registered_twice_in_a_run_takes_the_last_value() -> None:
    """Both drafts were signed at one timestamp: the node stored the one of the smaller
    signature (either), and the next run, finding it said, signed the other: the value
    flipped from run to run."""

    def twice(file: LocalFile, record: RecordLookup, register: Register) -> None:
        register(file.cid, "title", "a guess")
        register(file.cid, "year", "1999")
        register(file.cid, "title", "The Matrix")

    cid = cids.midhash_bytes(b"registered twice")
    file = LocalFile(cid, "/media/m.mkv", 1, 0)
    drafts, skipped = plugins.collect(
        probe("twice", twice), file, lambda _cid: None, threading.Event()
    )
    assert (drafts, skipped) == ([(cid, "year", "1999"), (cid, "title", "The Matrix")], None)


async def test_a_key_registered_twice_is_claimed_once_with_the_last_value(
    harness: Harness,
) -> None:
    _, midhash = harness.drop("twice.bin", b"registered twice")

    def twice(file: LocalFile, record: RecordLookup, register: Register) -> None:
        for value in ("first", "second", "third"):
            register(file.cid, "twice", value)

    plugin = probe("twice", twice)
    node = await harness.start([plugin])
    await until(finished(node, plugin, midhash), "the run")
    listed = node.meta_claims(midhash, key="twice", uid=None)["claims"]
    assert [c["value"] for c in listed] == ["third"]
    assert metadata(node, midhash)["twice"] == "third"


async def test_a_hung_plugin_holds_up_only_its_own_runs(harness: Harness) -> None:
    """With one run at a time (the default), the host ran a batch of runs and waited for all
    of them: one hung plugin held every other plugin, built-ins included, until it timed out."""
    gate = harness.gate()
    _, first = harness.drop("a.bin", b"the hung plugin holds this")
    hang = probe("hang", blocked_until(gate))
    good = probe("good", claim("good", "yes"))
    node = await harness.start([hang, good], plugin_workers=1, plugin_timeout_s=60.0)
    await until(lambda: len(hang.calls) == 1, "the plugin to hang")
    later = [harness.drop(f"later{i}.bin", f"later {i}".encode())[1] for i in range(3)]
    for midhash in [first, *later]:
        await until(finished(node, good, midhash), "the other plugin on every file meanwhile")
    assert len(hang.calls) == 1 and run_of(node, hang, first) == Run("pending", 0, None)
    gate.set()
    await until(finished(node, hang, later[-1]), "the hung plugin's own runs once it returns")


def test_the_due_runs_of_a_plugin_cost_the_same_however_many_runs_wait(tmp_path: Path) -> None:
    """The host asks for one plugin's next runs each time a run ends. That read must not grow
    with the other plugins' pending runs, its own finished ones, or its own not yet due: it
    read and sorted every pending run, so 5,000 new files kept the event loop busy, at a few
    runs a second. Counted in SQLite's virtual machine steps, not in time."""
    conn = db.connect_file(tmp_path / "cache.db")
    db.migrate(conn, cache.MIGRATIONS)
    now = 1_000_000

    def add(plugin: str, status: str, count: int, next_at: int = 0) -> None:
        conn.executemany(
            "INSERT INTO plugin_runs (plugin, version, midhash, status, next_at, updated_at) "
            "VALUES (?, '1', ?, ?, ?, 1)",
            [(plugin, f"{status}{next_at}-{i:05}", status, next_at) for i in range(count)],
        )

    def steps() -> int:
        count = 0

        def tick() -> int:
            nonlocal count
            count += 1
            return 0

        conn.set_progress_handler(tick, 1)
        try:
            due = cache.due_runs(conn, "nfo", "1", now, 4)
        finally:
            conn.set_progress_handler(None, 1)
        assert [run.midhash for run in due] == [f"pending0-{i:05}" for i in range(4)]
        return count

    add("nfo", "pending", 6)
    alone = steps()
    for plugin in ("fileinfo", "filename", "fullhash", "mediainfo", "zzz"):
        add(plugin, "pending", 4000)
    add("nfo", "done", 4000)
    add("nfo", "pending", 4000, next_at=now + 5000)  # a retry, later
    assert steps() == alone
    conn.close()


async def test_a_new_version_reruns_existing_files(harness: Harness) -> None:
    _, midhash = harness.drop("v.bin", b"versioned")
    v1 = probe("ver", claim("ver", "one"), version="1")
    node = await harness.start([v1])
    await until(finished(node, v1, midhash), "v1 done")
    assert metadata(node, midhash)["ver"] == "one"
    await harness.stop(node)

    v2 = probe("ver", claim("ver", "two"), version="2")
    node = await harness.start([v2])
    await until(finished(node, v2, midhash), "v2 done")
    await until(lambda: metadata(node, midhash).get("ver") == "two", "v2's value merged")
    assert len(v1.calls) == 1 and len(v2.calls) == 1
    on_loop: list[str] = []  # the run counts scan every run: never on the loop's connection
    node.cache.conn.set_trace_callback(on_loop.append)
    try:
        [described] = (await node.plugins())["plugins"]
    finally:
        node.cache.conn.set_trace_callback(None)
    assert not [sql for sql in on_loop if "plugin_runs" in sql], on_loop
    assert described["version"] == "2"
    assert described["runs"] == {"done": 1, "pending": 0, "failed": 0, "skipped": 0}
    # Same name, same key file: the same signer, whose newer claim replaced the old one.
    claims_listed = node.meta_claims(midhash, key="ver", uid=None)["claims"]
    assert [c["value"] for c in claims_listed] == ["two"]


async def test_a_file_hashed_again_to_the_same_content_runs_no_plugin_again(
    harness: Harness,
) -> None:
    """A chmod moves a file's ctime, so the watcher hashes it again (docs/watcher.md): the same
    midhash at the same path is nothing new to a plugin, even one that reads the path. Every
    path-dependent plugin ran again on it (`chmod -R` over a library: on every file); a rename
    still runs it again."""
    reader = probe("reader", claim("read", "yes"))
    type(reader).path_dependent = True
    node = await harness.start([reader], watch_enabled=False)
    path, midhash = harness.drop("film.mkv", b"some film")
    await node.scan([str(harness.media)])

    async def idle() -> bool:
        [described] = (await node.plugins())["plugins"]
        return described["running"] == [] and described["runs"]["pending"] == 0

    await until(finished(node, reader, midhash), "the first run")
    while not await idle():
        await asyncio.sleep(0.05)
    calls = len(reader.calls)
    os.chmod(path, 0o600)
    assert (await node.scan([str(harness.media)])).hashed == 1
    assert run_of(node, reader, midhash) == Run("done", 1, None)  # not queued again
    assert len(reader.calls) == calls
    os.rename(path, harness.media / "renamed.mkv")
    await node.scan([str(harness.media)])
    await until(lambda: len(reader.calls) == calls + 1, "the run after the rename")


async def test_a_new_file_runs_a_path_dependent_plugin_once(harness: Harness) -> None:
    """A new file's runs were queued twice over: every plugin's (`files_changed`), then the
    path-dependent ones' again (`paths_changed`, its path being new); a run started between
    the two was made pending again by the second, and ran twice."""
    reader = probe("reader", claim("read", "yes"))
    type(reader).path_dependent = True
    node = await harness.start([reader], watch_enabled=False)
    dropped = []
    for n in range(40):  # one new file a batch, as the watcher hands a file settled alone
        dropped.append(harness.drop(f"film{n}.mkv", b"film %d" % n))
        await node.scan([str(harness.media)])
    await until(
        lambda: all(finished(node, reader, midhash)() for _, midhash in dropped), "every run"
    )
    described = (await node.plugins())["plugins"][0]
    assert described["runs"]["pending"] == 0 and described["running"] == []
    assert sorted(file.path for file in reader.calls) == sorted(path for path, _ in dropped)


async def test_the_plugin_list_says_why_files_were_skipped(harness: Harness) -> None:
    """mediainfo without ffprobe skips every video: the Plugins page said 0 done, 0 failed,
    and not why. The commonest reasons are listed with their runs, most first."""

    def skipping(file: LocalFile, record: RecordLookup, register: Register) -> None:
        if not file.path.endswith(".ok"):
            raise plugins.Skip("ffprobe not found" if file.path.endswith(".a") else "too short")
        register(file.cid, "seen", "yes")

    dropped = [harness.drop(name, name.encode()) for name in ("1.a", "2.a", "3.b", "4.ok")]
    skipper = probe("skipper", skipping)
    node = await harness.start([skipper])
    for _, midhash in dropped:
        await until(finished(node, skipper, midhash), "every file run")
    [described] = (await node.plugins())["plugins"]
    assert described["runs"] == {"done": 1, "pending": 0, "failed": 0, "skipped": 3}
    assert described["skips"] == [
        {"reason": "ffprobe not found", "runs": 2},
        {"reason": "too short", "runs": 1},
    ]


async def test_a_restart_resumes_pending_runs_and_skips_done_ones(harness: Harness) -> None:
    gate = harness.gate()
    _, midhash = harness.drop("p.bin", b"interrupted")
    quick = probe("quick", claim("quick", "yes"))
    slow = probe("slow", blocked_until(gate, claim("slow", "yes")))
    node = await harness.start([quick, slow], plugin_timeout_s=60.0)
    await until(finished(node, quick, midhash), "quick done")
    await until(lambda: len(slow.calls) == 1, "slow running")
    await harness.stop(node)  # slow's run is still in flight
    gate.set()
    for thread in threading.enumerate():
        if thread.name == "plugin":
            thread.join(10)
    # The run did not finish: it is still pending, no attempt counted.
    assert run_of(node, slow, midhash) == Run("pending", 0, None)

    quick2 = probe("quick", claim("quick", "again"))
    slow2 = probe("slow", claim("slow", "resumed"))
    node = await harness.start([quick2, slow2], plugin_timeout_s=60.0)
    await until(finished(node, slow2, midhash), "slow resumed and done")
    assert len(slow2.calls) == 1
    assert quick2.calls == []  # done before the restart: not redone
    assert await counts(node, "quick") == {"done": 1, "pending": 0, "failed": 0, "skipped": 0}
    assert metadata(node, midhash)["quick"] == "yes"
    assert metadata(node, midhash)["slow"] == "resumed"


async def test_a_run_the_process_ended_during_is_charged_its_attempt_at_the_next_start(
    harness: Harness,
) -> None:
    """A plugin that ends the process (`os._exit`, a crash in a C extension) left its run
    pending, started again first thing at every start: the node never stayed up. The runs in
    flight are named in `plugins-running`; a clean stop leaves it empty, a process that died
    leaves them, and the next start charges each the attempt it died in."""
    gate = harness.gate()
    _, midhash = harness.drop("p.bin", b"crashing")
    slow = probe("slow", blocked_until(gate, claim("slow", "yes")))
    node = await harness.start([slow], plugin_timeout_s=60.0)
    await until(lambda: len(slow.calls) == 1, "slow running")
    flight = node.settings.plugins_running_path
    assert flight.stat().st_mode & 0o777 == 0o600  # private, as the whole data directory
    left = flight.read_text()  # as a process that died now would leave it
    assert stat.S_IMODE(flight.stat().st_mode) == 0o600  # the next start has nothing to tighten
    assert [json.loads(line)[:4] for line in left.splitlines()] == [["slow", "1", midhash, 0]]
    await harness.stop(node)
    assert flight.read_text() == ""  # a clean stop: nothing to charge
    gate.set()
    for thread in threading.enumerate():
        if thread.name == "plugin":
            thread.join(10)

    flight.write_text(left + "torn line\n")  # a line cut short is skipped
    again = probe("slow", blocked_until(harness.gate()))  # the next attempt hangs: seen pending
    node = await harness.start([again], plugin_timeout_s=60.0, plugin_retry_s=0.0)
    await until(lambda: len(again.calls) == 1, "the charged run due again at once")
    charged = run_of(node, again, midhash)
    assert charged == Run("pending", 1, plugins.INTERRUPTED), charged

    await harness.stop(node)
    flight.write_text(left)  # the same run, as picked before its charge: charged once only
    node = await harness.start([probe("slow", claim("slow", "done"))])
    await until(finished(node, again, midhash), "the run done")
    assert run_of(node, again, midhash) == Run("done", 2, None)


async def test_a_backlog_writes_the_running_file_once_a_run(harness: Harness) -> None:
    """`plugins-running` was written (a file and a rename, on a thread) as each run started
    and again as it ended: two writes a run, for a run's end that the next start's write says
    anyway. It is written as a run starts, and once no run is left."""
    files = 30
    midhashes = [harness.drop(f"f{n}.bin", f"file {n}".encode())[1] for n in range(files)]
    quick = probe("quick", claim("quick", "yes"))
    node = await harness.start([quick], plugin_workers=1)
    for midhash in midhashes:
        await until(finished(node, quick, midhash), f"quick done on {midhash}")
    assert node.plugin_host is not None
    flight = node.settings.plugins_running_path
    await until(lambda: flight.read_text() == "", "no run named once none is left")
    writes = node.plugin_host._in_flight.writes
    assert len(quick.calls) == files
    # one a run, one at the start (the charge of runs interrupted), and one each time the
    # queue ran dry while the watcher's batches came in: 2 × files + 1 before
    assert files < writes <= files + 6, writes


async def test_a_running_file_naming_a_run_that_ended_charges_nothing(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """The file names a run that ended until the next one starts: a process that dies then
    leaves it naming a run done. The next start neither charges it nor says it was
    interrupted."""
    _, midhash = harness.drop("p.bin", b"done before the end")
    quick = probe("quick", claim("quick", "yes"))
    node = await harness.start([quick])
    await until(finished(node, quick, midhash), "quick done")
    await harness.stop(node)
    flight = node.settings.plugins_running_path
    flight.write_text(json.dumps(["quick", "1", midhash, 0, 1]) + "\n")  # as it was picked
    with caplog.at_level(logging.WARNING, logger="metanode.plugins"):
        node = await harness.start([probe("quick", claim("quick", "again"))])
        await until(lambda: flight.read_text() == "", "the file read and emptied")
    assert run_of(node, quick, midhash) == Run("done", 1, None)
    assert plugins.INTERRUPTED not in caplog.text
    assert metadata(node, midhash)["quick"] == "yes"


@pytest.mark.parametrize(
    ("key", "slug"),
    [
        ("filePath", "reserved_key"),
        ("cid_anything", "reserved_key"),
        ("cids/" + cids.encode(cids.RAW, cids.SHA2_256, bytes(32)), "link_not_permitted"),
        ("bad//key", "invalid_key"),
    ],
)
async def test_a_rejected_draft_fails_the_run_with_its_slug(
    harness: Harness, key: str, slug: str, caplog: pytest.LogCaptureFixture
) -> None:
    _, midhash = harness.drop("x.bin", b"rejected drafts")

    def action(file: LocalFile, record: RecordLookup, register: Register) -> None:
        register(file.cid, "fine", "ok")
        register(file.cid, key, "/somewhere/else")

    sloppy = probe("sloppy", action)
    node = await harness.start([sloppy], plugin_max_attempts=3)
    await until(finished(node, sloppy, midhash, "failed"), "sloppy failed")
    run = run_of(node, sloppy, midhash)
    assert run is not None and run.error is not None
    assert slug in run.error
    assert run.error.startswith("invalid_batch")
    assert f"invalid_batch: {key!r}: {slug}: " in run.error  # by its key, not by an index
    # the node would refuse the same drafts again: failed at once, not retried twice
    assert run.attempts == 1 and len(sloppy.calls) == 1
    assert f"{run.error} (not tried again: the node would refuse the same claims; " in caplog.text
    # The batch is atomic: the good draft of the same run was not written either.
    assert "fine" not in metadata(node, midhash)
    assert node.meta_claims(midhash, key=None, uid=None)["claims"] == []


async def test_get_api_plugins(harness: Harness) -> None:
    _, midhash = harness.drop("api.bin", b"listed")
    good = probe("good", claim("good", "yes"))
    bad = probe("bad", raises, version="7", may_link=True)
    node = await harness.start([good, bad], plugin_max_attempts=1)
    await until(finished(node, bad, midhash, "failed"), "bad failed")
    await until(finished(node, good, midhash), "good done")
    transport = httpx.ASGITransport(app=create_app(node))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
        assert (await http.get("/api/plugins")).status_code == 401
        answer = await http.get("/api/plugins", headers={"Authorization": f"Bearer {node.token}"})
    assert answer.status_code == 200
    listed = answer.json()["plugins"]
    uids = {s["name"]: s["uid"] for s in node.signers()}
    [failure] = listed[0].pop("failures")
    assert failure["cid"] == midhash and failure["error"].startswith("ValueError: boom (at ")
    assert failure["path"] == str(harness.media / "api.bin") and failure["at"] > 0
    assert listed == [
        {
            "name": "bad",
            "version": "7",
            "uid": uids["plugin:bad"],
            "may_link": True,
            "weight": 1,
            "runs": {"done": 0, "pending": 0, "failed": 1, "skipped": 0},
            "skips": [],
            "running": [],
        },
        {
            "name": "good",
            "version": "1",
            "uid": uids["plugin:good"],
            "may_link": False,
            "weight": 1,
            "runs": {"done": 1, "pending": 0, "failed": 0, "skipped": 0},
            "skips": [],
            "failures": [],
            "running": [],
        },
    ]


async def test_get_api_plugins_names_the_runs_going_on(harness: Harness) -> None:
    """A plugin that takes 30 s a file showed only `pending`: whether it worked or hung, and
    on which file, nothing said. `running` names each run going on, with when it started."""
    gate = harness.gate()
    path, midhash = harness.drop("slow.bin", b"a slow plugin's file")
    slow = probe("slow", blocked_until(gate, claim("slow", "yes")))
    node = await harness.start([slow], plugin_timeout_s=60.0)
    await until(lambda: len(slow.calls) == 1, "slow running")
    [described] = (await node.plugins())["plugins"]
    assert described["running"] == [
        {"cid": midhash, "path": path, "since": described["running"][0]["since"]}
    ]
    assert slow.called_at_ms[0] >= described["running"][0]["since"] > 0
    assert described["runs"]["pending"] == 1  # still pending: it is counted there too
    gate.set()
    await until(finished(node, slow, midhash), "slow done")
    assert (await node.plugins())["plugins"][0]["running"] == []


async def test_failed_and_skipped_runs_are_retried_on_request(harness: Harness) -> None:
    """A plugin that failed for want of something outside it (a tool not installed yet) stayed
    failed for good: only a new version ran it again. `POST /api/plugins/{name}/retry` queues
    its failed runs again, and its skipped ones (mediainfo skips every video while ffprobe is
    missing: installed, its files were never run again), and only those."""
    _, failing = harness.drop("needs-tool.bin", b"fails until the tool is there")
    _, skipping = harness.drop("skips.bin", b"skipped until the tool is there")
    _, fine = harness.drop("fine.bin", b"never failed")
    tool = {"installed": False}

    def needs_tool(file: LocalFile, record: RecordLookup, register: Register) -> None:
        if file.cid == failing and not tool["installed"]:
            raise RuntimeError("the tool is not installed")
        if file.cid == skipping and not tool["installed"]:
            raise Skip("the tool is not installed")
        register(file.cid, "tooled", "yes")

    plugin = probe("tooled", needs_tool)
    node = await harness.start([plugin], plugin_max_attempts=1)
    await until(finished(node, plugin, failing, "failed"), "the run to fail")
    await until(finished(node, plugin, skipping), "the run to skip")
    await until(finished(node, plugin, fine), "the other file's run")
    tool["installed"] = True
    transport = httpx.ASGITransport(app=create_app(node))
    headers = {"Authorization": f"Bearer {node.token}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
        unknown = await http.post("/api/plugins/nope/retry", headers=headers)
        assert (unknown.status_code, unknown.json()["error"]) == (404, "not_found")
        answer = await http.post("/api/plugins/tooled/retry", headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"name": "tooled", "requeued": 2, "failed": 1, "skipped": 1}
    await until(finished(node, plugin, failing), "the retried run to succeed")

    def ran_again() -> bool:
        run = run_of(node, plugin, skipping)
        return run is not None and run.status == "done" and run.error is None

    await until(ran_again, "the skipped run to run again and claim")
    assert metadata(node, failing)["tooled"] == metadata(node, skipping)["tooled"] == "yes"
    assert [f.cid for f in plugin.calls].count(fine) == 1  # a done run is not run again


async def test_a_retry_of_a_plugin_that_does_not_run_says_why(harness: Harness) -> None:
    """`plugins retry filename`, with a second package of that name keeping the built-in from
    running, said `no running plugin is named 'filename'` and no more: why it does not run,
    that it is disabled, or which ones do."""
    clash = plugins.NotLoaded(
        "filename",
        "metanode_filename:FileName",
        "plugins metanode_filename:FileName, other:P are all named 'filename': none of them runs",
    )
    found = [probe("on", claim("on", "yes")), probe("off", claim("off", "yes"))]
    node = await harness.start(found, not_loaded=[clash], plugins_disabled=("off",))
    transport = httpx.ASGITransport(app=create_app(node))
    headers = {"Authorization": f"Bearer {node.token}"}
    said = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
        for name in ("filename", "off", "nope"):
            answer = await http.post(f"/api/plugins/{name}/retry", headers=headers)
            assert (answer.status_code, answer.json()["error"]) == (404, "not_found")
            said[name] = answer.json()["message"]
    assert said == {
        "filename": f"plugin 'filename' does not load: {clash.error}",
        "off": "plugin 'off' is disabled (plugins_disabled)",
        "nope": "no running plugin is named 'nope' (running: on)",
    }


async def test_disabled_plugins_and_weights(harness: Harness) -> None:
    _, midhash = harness.drop("w.bin", b"weights")
    on = probe("on", claim("on", "yes"), weight=2)
    off = probe("off", claim("off", "yes"))
    node = await harness.start([on, off], plugins_disabled=("off",), plugin_weights=("on=7",))
    await until(finished(node, on, midhash), "on done")
    assert [p["name"] for p in (await node.plugins())["plugins"]] == ["on"]
    signers = {s["name"]: s for s in node.signers()}
    assert signers["plugin:on"]["weight"] == 7  # the setting beats the class default (2)
    assert "plugin:off" not in signers
    assert not (node.settings.keys_dir / "off.key").exists()
    assert off.calls == []
    assert all(plugin == "on" for plugin, _, _ in runs(node))


async def test_a_setting_naming_no_installed_plugin_is_said(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """`plugins_disabled = ["fulhash"]` left the real one on without a word."""
    await harness.start(
        [probe("on", claim("on", "yes"))], plugins_disabled=("of",), plugin_weights=("onn=3",)
    )
    said = [r.getMessage() for r in caplog.records if "name no installed plugin" in r.getMessage()]
    assert said == [
        "plugins_disabled or plugin_weights name no installed plugin: of, onn (installed: on)"
    ]


async def test_without_weight_setting_the_class_weight_is_used(harness: Harness) -> None:
    node = await harness.start([probe("heavy", claim("k", "v"), weight=4)])
    [signer] = [s for s in node.signers() if s["name"] == "plugin:heavy"]
    assert signer["weight"] == 4


async def test_a_weight_set_by_hand_stays_unless_plugin_weights_names_the_plugin(
    harness: Harness,
) -> None:
    """`signers add <plugin uid> --weight 7` lasted until the next start, which set the class
    weight again without a word."""
    heavy = probe("heavy", claim("k", "v"), weight=4)
    node = await harness.start([heavy])
    [signer] = [s for s in node.signers() if s["name"] == "plugin:heavy"]
    await node.truth.add_signer(signer["uid"], None, 7, None)
    await harness.stop(node)
    node = await harness.start([heavy])
    assert {s["name"]: s["weight"] for s in node.signers()}["plugin:heavy"] == 7
    await harness.stop(node)
    node = await harness.start([heavy], plugin_weights=("heavy=2",))
    assert {s["name"]: s["weight"] for s in node.signers()}["plugin:heavy"] == 2


async def test_stale_pending_runs_do_not_starve_current_ones(harness: Harness) -> None:
    total = 70
    midhashes = [harness.drop(f"f{i:03}.bin", f"file {i}".encode())[1] for i in range(total)]
    gate = harness.gate()
    v1 = probe("slow", blocked_until(gate, claim("v", "1"), first_only=True), version="1")
    node = await harness.start([v1], plugin_workers=1, plugin_timeout_s=60.0)
    await until(lambda: len(runs(node)) == total and len(v1.calls) == 1, "v1 queued")
    await harness.stop(node)  # a backlog of v1 runs, all pending, then a new version ships
    gate.set()

    v2 = probe("slow", claim("v", "2"), version="2")
    node = await harness.start([v2], plugin_workers=4, plugin_timeout_s=60.0)

    def done() -> int:
        return sum(
            1
            for (_, version, _), run in runs(node).items()
            if version == "2" and run.status == "done"
        )

    await until(
        lambda: done() == total,  # a starved run never starts: the bound is generous
        f"every one of the {total} runs of the current version to finish",
        timeout=120,
    )
    assert {f.cid for f in v2.calls} == set(midhashes)


def test_a_run_ending_after_its_loop_closed_is_quiet() -> None:
    errors: list[BaseException | None] = []
    release = threading.Event()
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:

        async def main() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(plugins.run_in_thread(lambda: release.wait(10)), 0.05)

        asyncio.run(main())
        release.set()
        for thread in threading.enumerate():
            if thread.name == "plugin":
                thread.join(10)
    finally:
        threading.excepthook = previous
    assert errors == []


# -- the counted runs (cache schema 10) ----------------------------------------------------------

VERSIONS = (("a", "1"), ("a", "2"), ("b", "1"))
RUN_OPS = st.lists(
    st.tuples(
        st.sampled_from(("enqueue", "finish", "requeue", "retry", "drop")),
        st.sampled_from(VERSIONS),
        st.lists(st.sampled_from(("m1", "m2", "m3", "m4")), min_size=1, max_size=3),
        st.sampled_from(("done", "failed", "skipped: no tool", "skipped: too big")),
    ),
    max_size=25,
)
# What `cache.run_counts` read before schema 10: a scan of every run.
SCANNED = (
    "SELECT plugin, version, CASE WHEN status = 'done' AND error IS NOT NULL THEN 'skipped' "
    "ELSE status END AS shown, CASE WHEN status = 'done' THEN error END AS reason, count(*) "
    "FROM plugin_runs GROUP BY plugin, version, shown, reason"
)


def write_runs(conn: db.Connection, ops: list[tuple[str, tuple[str, str], list[str], str]]) -> None:
    """Each of the plugin host's writes of runs, in the order hypothesis drew."""
    for at, (op, (plugin, version), midhashes, outcome) in enumerate(ops, start=1):
        if op == "enqueue":
            cache.enqueue_runs_txn(conn, [(plugin, version)], midhashes, at)
        elif op == "requeue":
            cache.requeue_runs_txn(conn, [(plugin, version)], midhashes, at)
        elif op == "retry":
            cache.retry_txn(conn, plugin, version, at)
        elif op == "drop":
            cache.drop_run_txn(conn, plugin, version, midhashes[0])
        else:
            row = conn.execute(
                "SELECT updated_at FROM plugin_runs WHERE plugin = ? AND version = ? "
                "AND midhash = ?",
                (plugin, version, midhashes[0]),
            ).fetchone()
            if row is not None:
                run = cache.PluginRun(plugin, version, midhashes[0], 1, row[0])
                status, error = (
                    ("done", outcome) if outcome.startswith("skipped") else (outcome, None)
                )
                cache.finish_run_txn(conn, run, status, 1, 0, error, at)


@pytest.mark.both_backends
def test_the_counted_runs_are_the_runs_whatever_was_written(tmp_path: Path, storage: str) -> None:
    """`GET /api/plugins` and `/metrics` read the counts the triggers keep, not the runs: after
    any sequence of the host's writes (queued, finished, skipped, failed, queued again, retried,
    dropped) they are what a scan of the runs counts."""
    with cache.CacheStore.configured(settings_for(tmp_path, storage=storage)) as store:

        @settings(max_examples=60 if storage == "sqlite" else 15, deadline=None)
        @given(ops=RUN_OPS)
        def check(ops: list[tuple[str, tuple[str, str], list[str], str]]) -> None:
            def txn(conn: db.Connection) -> None:
                conn.execute("DELETE FROM plugin_runs")
                assert conn.execute("SELECT count(*) FROM plugin_run_counts").fetchone()[0] == 0
                write_runs(conn, ops)
                reasons: dict[tuple[str, str], list[tuple[str, int]]] = {}
                for plugin, version, _, reason, n in conn.execute(SCANNED):
                    if reason is not None:
                        said = reason.removeprefix(cache.SKIPPED)
                        reasons.setdefault((plugin, version), []).append((said, n))
                counts, skips = cache.run_counts(conn, 10)
                assert counts == scanned_counts(conn) and cache.run_count_drift(conn) == []
                assert {k: sorted(v) for k, v in skips.items()} == {
                    k: sorted(v) for k, v in reasons.items()
                }

            store.writer.run_sync(txn)

        check()


def scanned_counts(conn: db.Connection) -> dict[tuple[str, str], dict[str, int]]:
    """The runs by (plugin, version) and status as shown, counted by a scan of the runs."""
    scanned: dict[tuple[str, str], dict[str, int]] = {}
    for plugin, version, shown, _, n in conn.execute(SCANNED):
        zero = {"done": 0, "pending": 0, "failed": 0, "skipped": 0}
        scanned.setdefault((plugin, version), zero)[shown] += n
    return scanned


OLDER_RUNS = [
    ("a", "1", "m1", "done", None),
    ("a", "1", "m2", "done", "skipped: no tool"),
    ("a", "1", "m3", "failed", "boom"),
    ("b", "2", "m1", "pending", None),
]


def test_an_older_cache_has_its_runs_counted_by_the_migration(tmp_path: Path) -> None:
    conn = db.connect(tmp_path / "cache.db")
    try:
        db.migrate(conn, cache.MIGRATIONS[:9])
        conn.executemany(
            "INSERT INTO plugin_runs (plugin, version, midhash, status, error, updated_at) "
            "VALUES (?, ?, ?, ?, ?, 1)",
            OLDER_RUNS,
        )
        assert db.migrate(conn, cache.MIGRATIONS) == len(cache.MIGRATIONS)
        counts, skips = cache.run_counts(conn, 3)
        assert counts == scanned_counts(conn) and counts[("a", "1")]["skipped"] == 1
        assert skips == {("a", "1"): [("no tool", 1)]}
        assert cache.run_count_drift(conn) == []
        conn.execute("UPDATE plugin_run_counts SET runs = runs + 1 WHERE shown = 'failed'")
        assert cache.run_count_drift(conn) == [  # what `metanode check` says of a drift
            "plugin_run_counts: kept ('a', '1', 'failed', '', 2), not in the runs",
            "plugin_run_counts: not kept ('a', '1', 'failed', '', 1), in the runs",
        ]
    finally:
        conn.close()


async def test_runs_that_end_together_share_one_truth_commit_and_a_refused_claim_fails_alone(
    harness: Harness,
) -> None:
    """Runs that end while the last ones' claims commit wait, and are then committed together:
    one truth transaction (the writer's group count, /metrics' `metanode_ingest_groups`) and
    one record of their outcomes. Each is done only once its claims are durable, and the run
    whose claim the node refuses fails alone."""
    files = 16
    midhashes = [harness.drop(f"f{n:02d}.bin", f"file {n}".encode())[1] for n in range(files)]
    refused = midhashes[7]
    go = harness.gate()

    def action(file: LocalFile, record: RecordLookup, register: Register) -> None:
        go.wait(30)
        register(file.cid, "cid_x" if file.cid == refused else "quick", "yes")

    quick = probe("quick", action)
    # up to 16 runs wait for their commit (`AHEAD_MAX` a slot): every run can end
    node = await harness.start([quick], plugin_workers=8, plugin_timeout_s=60.0)
    host = node.plugin_host
    assert host is not None
    await until(lambda: len(quick.calls) >= 1, "the first runs at work")
    await until(lambda: runs(node).keys() >= {("quick", "1", m) for m in midhashes}, "queued")
    held, entered = harness.gate(), threading.Event()

    def hold(conn: object) -> None:
        entered.set()
        held.wait(30)

    holding = node.truth.writer.submit(hold)  # the truth's writer busy, as with a slow disk
    await until(entered.is_set, "the truth writer held")
    groups, grouped, recorded = node.truth.writer.groups, node.truth.writer.grouped, host.recorded
    go.set()
    await until(lambda: len(quick.calls) == files and not host._since, "every run ended")
    assert (await counts(node, "quick"))["done"] == 0, "none done before its claims commit"
    held.set()
    await asyncio.wrap_future(holding)

    def all_recorded() -> bool:
        return all(runs(node)[("quick", "1", m)].status != "pending" for m in midhashes)

    await until(all_recorded, "every run recorded")
    transactions = node.truth.writer.groups - groups
    assert node.truth.writer.grouped - grouped == files - 1  # every run's claims but one
    assert 1 <= transactions <= 2, transactions  # the first to end, then all the others
    assert host.recorded - recorded <= 3

    for midhash in midhashes:
        run = run_of(node, quick, midhash)
        assert run is not None
        if midhash == refused:
            assert (run.status, run.attempts) == ("failed", 1)
            assert run.error is not None and "reserved_key" in run.error
            assert "cid_x" not in metadata(node, midhash)
        else:
            assert run == Run("done", 1, None)
            assert metadata(node, midhash)["quick"] == "yes"
