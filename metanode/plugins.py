"""Plugins: the authoring API, discovery, the keystore and the host that runs them (SPEC §7).

Writing a plugin (the built-ins in `plugins/` are complete examples):

    class Plugin(metanode.plugins.Plugin):
        name = "myplugin"
        version = "1"

        def process(self, file, record, register):
            register(file.cid, "myKey", "a value")

and declare it in your package's `pyproject.toml`:

    [project.entry-points."metanode.plugins"]
    myplugin = "my_package:Plugin"

The host calls `process` on a worker thread for each local file (its midhash CID, path, size,
mtime, watch root and path relative to it) with `record(cid)`, a read of the current merged
metadata of any CID, and `register`, the callback that takes claim drafts `(cid, key, value)`. It
signs the drafts with the plugin's own key (created in `data/keys/` on first run, registered as a
signer) and ingests them exactly as `POST /api/claims` would. A plugin never sees a rid.

A run states everything the plugin says about its file: what an earlier run claimed about
`file.cid` and this run no longer yields is retracted (a tombstone), and unchanged claims are not
signed again. A plugin that reads the path (`path_dependent`) runs again when the paths of its
content change (a rename, a move); one that reads sidecar files (`sidecars`, extensions such as
`nfo` or `srt`) runs again on the files of a folder whenever such a file appears, changes or goes
in that folder or the one above it. `raise Skip(reason)` ends a run that cannot do its work (a
missing tool): what it registered is kept, nothing is retracted, and the reason is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import nacl.signing

from metanode import cache, claims, datadir, db, keys, merge
from metanode import cid as cids
from metanode.clock import Clock, now_ms
from metanode.errors import (
    ClockBehind,
    InvalidRequest,
    MetanodeError,
    NotFoundError,
    PluginFailed,
    StorageError,
    shown,
)

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "metanode.plugins"
T = TypeVar("T")


@dataclass(frozen=True)
class LocalFile:
    """What a plugin is told about the file it looks at."""

    cid: str  # the file's midhash256 CID: the subject of its claims
    path: str  # absolute
    size: int
    mtime_ns: int
    root: str = ""  # the watch root the path is below ("" if none)
    relative: str = ""  # the path relative to `root`: folders inform a release name

    @property
    def in_root(self) -> str:
        """The path relative to its watch root, or its last component outside any root."""
        return self.relative or os.path.basename(self.path)


def local_file(file: tuple[str, str, int, int], roots: Sequence[str]) -> LocalFile:
    """A plugin's view of a `local_file` row (midhash, path, size, mtime_ns), placed in the
    longest watch root holding it."""
    cid, path, size, mtime_ns = file
    for root in sorted(roots, key=len, reverse=True):
        stem = root.rstrip("/") + "/"
        if path.startswith(stem):
            return LocalFile(cid, path, size, mtime_ns, root, path[len(stem) :])
    return LocalFile(cid, path, size, mtime_ns)


class Skip(Exception):
    """Raised by `process` when it cannot do its work (a tool is missing, a sidecar refused):
    the run is done, its drafts so far are kept, nothing is retracted, the reason is recorded."""


Register = Callable[[str, str, str | None], None]  # register(cid, key, value)
RecordLookup = Callable[[str], dict[str, str] | None]  # merged metadata of any CID, or None


class Plugin:
    """Base class of every plugin: set `name` and `version`, implement `process`.

    Bump `version` whenever what the plugin claims changes: every file is then processed again.
    `may_link` lets its `cids/…` claims link groups (merges are permanent; grant it only to
    plugins that compute hashes of the same bytes). `weight` is its default signer weight.
    `path_dependent`: what it claims follows from the path, so a rename or move runs it again.
    `sidecars`: lower-case extensions (no dot) of files beside the file that it reads; one of
    them appearing, changing or going runs it again on the files of that folder (and of its
    sub-folders: a `tvshow.nfo` above `Season 01/`).
    """

    name: ClassVar[str]
    version: ClassVar[str]
    may_link: ClassVar[bool] = False
    weight: ClassVar[int] = 1
    path_dependent: ClassVar[bool] = False  # runs again when its content's paths change
    sidecars: ClassVar[frozenset[str]] = frozenset()  # extensions whose arrival re-runs it

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        raise NotImplementedError


FAILURES_SHOWN = 5  # the newest failed runs `describe` lists of each plugin
SKIPS_SHOWN = 3  # the commonest reasons to skip a file `describe` lists of each plugin
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")  # a plugin's name: its key file, its signer


@dataclass(frozen=True)
class NotLoaded:
    """An installed plugin that does not run, and why: GET /api/plugins lists it (`not_loaded`),
    so a broken package is seen where the running ones are, not only in the log."""

    entry_point: str  # its name in the `metanode.plugins` group (the package's choice)
    source: str  # `module:attribute`
    error: str


def discover(quiet: bool = False) -> tuple[list[Plugin], list[NotLoaded]]:
    """Every installed plugin of the `metanode.plugins` entry-point group, by name, and those
    that are installed but do not run.

    A plugin that fails to load is logged (unless `quiet`) and skipped: one broken package must
    not stop the node.
    So is one whose attributes are wrong (`attribute_problem`), and so are two that share a
    name, both: either would sign with the other's key and retract its claims.
    """
    found: dict[str, list[tuple[importlib.metadata.EntryPoint, Plugin]]] = {}
    not_loaded = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
            plugin = loaded() if isinstance(loaded, type) else loaded
            if not isinstance(plugin, Plugin):
                raise TypeError(f"{entry.value} is not a metanode.plugins.Plugin")
            problem = attribute_problem(plugin)
            if problem is not None:
                raise TypeError(f"{entry.value}: {problem}")
            name = plugin.name
        except Exception as exc:
            if not quiet:  # `plugins try` of another plugin: not this one's traceback
                log.exception("cannot load plugin %s", entry.name)
            not_loaded.append(NotLoaded(entry.name, entry.value, described(exc)))
            continue
        found.setdefault(name, []).append((entry, plugin))
    for name, same in sorted(found.items()):
        if len(same) > 1:
            sources = ", ".join(entry.value for entry, _ in same)
            why = (
                f"plugins {sources} are all named {name!r}: none of them runs until all but one "
                "are removed or renamed (each would sign with the others' key)"
            )
            if not quiet:
                log.error("%s", why)
            not_loaded += [NotLoaded(entry.name, entry.value, why) for entry, _ in same]
    running = [same[0][1] for _, same in sorted(found.items()) if len(same) == 1]
    return running, sorted(not_loaded, key=lambda each: (each.entry_point, each.source))


def attribute_problem(plugin: Plugin) -> str | None:
    """What is wrong with a loaded plugin's attributes, or None. Checked before it runs: a
    plugin without a `version`, or of a negative weight, stopped the node at every start; one
    of `version = 2` ran, but its runs were never counted as its version's."""
    name = getattr(plugin, "name", None)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return f"name {name!r} is not {NAME.pattern}"
    version = getattr(plugin, "version", None)
    if not isinstance(version, str) or not version.strip() or not version.isprintable():
        return f"version {version!r} is not a str such as '1' (bump it when its claims change)"
    weight = plugin.weight
    if type(weight) is not int or not 0 <= weight <= merge.MAX_WEIGHT:
        return f"weight {weight!r} is not an int from 0 to {merge.MAX_WEIGHT}"
    for flag in ("may_link", "path_dependent"):
        if type(getattr(plugin, flag)) is not bool:
            return f"{flag} {getattr(plugin, flag)!r} is not True or False"
    extensions = plugin.sidecars
    if not isinstance(extensions, set | frozenset) or not all(
        isinstance(e, str) and e and e == e.lower() and "." not in e for e in extensions
    ):
        return f"sidecars {extensions!r} is not a set of lower-case extensions without the dot"
    return process_problem(plugin)


def process_problem(plugin: Plugin) -> str | None:
    """What is wrong with a plugin's `process`, or None. The host calls it on a thread with
    (file, record, register) and makes its claims of the `register` calls alone: an `async def`
    or a generator ran nothing (its coroutine or generator was dropped, the run `done` with no
    claims), and a missing `process` or one of other parameters failed every run with an error
    that named no line of the plugin."""
    process = getattr(plugin, "process", None)
    if getattr(type(plugin), "process", None) is Plugin.process or not callable(process):
        return "it defines no process(self, file, record, register)"
    if inspect.iscoroutinefunction(process) or inspect.isasyncgenfunction(process):
        return (
            "process is an async def: the host calls it on a thread of its own and never "
            "awaits it; make it a plain def"
        )
    if inspect.isgeneratorfunction(process):
        return (
            "process is a generator (it yields): the host makes claims of its "
            "register(cid, key, value) calls alone; call register instead"
        )
    try:
        inspect.signature(process).bind(None, None, None)
    except TypeError:
        signature = inspect.signature(process)
        return f"process{signature} cannot be called as process(file, record, register)"
    except ValueError:  # no signature to read (a builtin): let it run
        pass
    return None


def not_running(
    name: str, running: Sequence[str], disabled: Sequence[str], not_loaded: Sequence[NotLoaded]
) -> str:
    """Why no running plugin is named `name` (a retry's 404): disabled, installed but not
    loaded (and why), or which ones run; it said only `no running plugin is named 'filename'`
    while another package of that name kept the built-in from running."""
    if name in disabled:
        return f"plugin {shown(name)} is disabled (plugins_disabled)"
    for broken in not_loaded:
        if broken.entry_point == name:
            return f"plugin {shown(name)} does not load: {broken.error}"
    return f"no running plugin is named {shown(name)} (running: {', '.join(running) or 'none'})"


def plugin_key(keys_dir: Path, name: str) -> nacl.signing.SigningKey:
    """The plugin's own signing key, created (mode 0600) on first use."""
    return keys.load_or_create(keys_dir / f"{name}.key")


def run_in_thread(fn: Callable[[], T]) -> Awaitable[T]:
    """Run `fn` on its own daemon thread and await its result.

    Not the default executor: a plugin that hangs would occupy one of its threads for good. A
    timed-out run's thread is abandoned; being a daemon, it never blocks shutdown.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)  # type: ignore[arg-type]
        else:
            future.set_exception(error)

    def body() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(), None)
        except Exception as exc:
            outcome = (None, exc)
        except BaseException as exc:  # `sys.exit()` in a plugin: awaited, it would stop the node
            aborted = Aborted(f"{type(exc).__name__}: {exc}").with_traceback(exc.__traceback__)
            outcome = (None, aborted)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits this run
            loop.call_soon_threadsafe(deliver, *outcome)

    threading.Thread(target=body, name="plugin", daemon=True).start()
    return future


async def collect_bounded(
    plugin: Plugin, file: LocalFile, record: RecordLookup, timeout_s: float
) -> tuple[list[Draft], str | None]:
    """`collect` on a thread of its own for at most `timeout_s` (the host's run, and `plugins
    try`'s): `RunTimedOut` after that, and the run's `register` raises from then on."""
    closed = threading.Event()
    try:
        async with asyncio.timeout(timeout_s):  # wait_for may swallow a cancel (3.11)
            return await run_in_thread(lambda: collect(plugin, file, record, closed))
    except TimeoutError:
        closed.set()
        raise RunTimedOut(
            f"timed out after {timeout_s} s (plugin_timeout_s; its thread is left to end on "
            "its own)"
        ) from None


class RunTimedOut(Exception):
    """A plugin's `process` ran longer than `plugin_timeout_s`."""


class Aborted(Exception):
    """A plugin's code raised what is no `Exception` (`SystemExit`, `KeyboardInterrupt`): the
    run fails, as for any error; asyncio would let it stop the whole node."""


@dataclass(frozen=True)
class Outcome:
    status: str  # "done" | "failed" | "pending" (waits for the clock: `due_at`)
    error: str | None = None  # why it failed or waits, or why a done run was skipped
    final: bool = False  # failed for good: the node would refuse the same drafts again
    due_at: int = 0  # a pending run's clock reading to run again at (`ClockBehind.valid_from`)


def waiting(exc: ClockBehind) -> Outcome:
    """A run the clock cannot date now: pending until it can, no attempt spent (the clock is
    no fault of the plugin's, and a run failed for it would stay failed once it is set)."""
    return Outcome("pending", f"waits for the clock: {exc.message}", due_at=exc.extra["valid_from"])


def described(exc: BaseException) -> str:
    """A plugin's exception as its run's error: its type and message, and where in the
    plugin's code (the deepest frame outside this module: `register` raises for its caller;
    and outside the import machinery: a missing module is raised in `<frozen importlib…>` for
    the plugin's `import` line), as a traceback's last line would say."""
    frames: list[traceback.FrameSummary] = list(traceback.extract_tb(exc.__traceback__))
    # A run's exception, awaited, carries the frames that awaited it (asyncio's) before the
    # run's own: only what `collect` called is the plugin's (an error raised by this module for
    # the plugin, with none of its frames below, was placed in `asyncio/base_events.py`).
    calls = [i for i, f in enumerate(frames) if f.filename == __file__ and f.name == "collect"]
    below = frames[calls[-1] + 1 :] if calls else frames
    frames = [f for f in below if f.filename != __file__ and not f.filename.startswith("<frozen ")]
    where = (
        f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    )
    return f"{type(exc).__name__}: {exc}{where}{missing_package(exc)}"


def missing_package(exc: BaseException) -> str:
    """For an import of a package the node's Python lacks, where it goes: a plugin's author
    read `No module named 'langdetect'` and installed it into the Python on their `PATH`, or
    forgot it in the plugin's `dependencies`. Nothing for a module of a package that is there
    (a plugin's own misspelt sub-module: no install mends that)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    top = exc.name.partition(".")[0]
    try:
        if importlib.util.find_spec(top) is not None:
            return ""
    except (ImportError, ValueError):  # a broken package of that name: it is there
        return ""
    return (
        f": the node's Python ({sys.prefix}) has no {top!r}; install the package that "
        f"provides it there ({sys.executable} -m pip install …) and list it in the plugin's "
        "dependencies"
    )


# `Node.ingest_together`: batches of wire claims in one transaction, each one's answer or the
# exception it failed with, in order
IngestTogether = Callable[[Sequence[list[Any]]], Awaitable[Sequence[object]]]
Said = Callable[[str, str], dict[str, str | None]]  # said(uid, cid): its claims on cid, by key
Stamp = Callable[[str, Sequence[tuple[str, str]]], int]  # `Node.stamp_apart`: raises ClockBehind
Draft = tuple[str, str, str | None]


def replacing(
    drafts: Sequence[Draft], subject: str, said: dict[str, str | None], whole: bool
) -> list[Draft]:
    """The drafts worth signing: not those equal to what was said already and, for a `whole`
    run, a tombstone for each key said about `subject` that the run no longer yields."""
    out = [d for d in drafts if d[0] != subject or d[1] not in said or said[d[1]] != d[2]]
    if whole:
        yielded = {key for cid, key, _ in drafts if cid == subject}
        out += [
            (subject, key, None)
            for key, value in sorted(said.items())
            if value is not None and key not in yielded and not key.startswith("cids/")
        ]
    return out


def collect(
    plugin: Plugin, file: LocalFile, record: RecordLookup, closed: threading.Event
) -> tuple[list[Draft], str | None]:
    """`plugin.process` on `file`: (the drafts registered, the reason if the plugin skipped).
    A key of a CID registered again replaces what the run registered for it before (the last
    call wins: signed at one timestamp, both were stored as an equivocation, the smaller
    signature winning, and the next run's unchanged value flipped it). A `register` after
    `closed` is set (the run timed out), or of the wrong types, raises in the plugin's code; a
    `process` that returns something (its claims, thinking they were taken so) fails the run."""
    drafts: dict[tuple[str, str], str | None] = {}

    def register(cid: str, key: str, value: str | None) -> None:
        if closed.is_set():
            raise RuntimeError("this run is over (it timed out)")
        if not (isinstance(cid, str) and isinstance(key, str)):
            raise TypeError(f"register(cid, key, value): cid and key are str, not {cid!r}")
        if value is not None and not isinstance(value, str):
            raise TypeError(f"register(cid, key, value): value is a str or None, not {value!r}")
        drafts.pop((cid, key), None)  # the last call's place, as its value
        drafts[(cid, key)] = value

    try:
        returned: object = plugin.process(file, record, register)  # type: ignore[func-returns-value]
    except Skip as skip:
        return [(c, k, v) for (c, k), v in drafts.items()], f"{cache.SKIPPED}{skip}"
    if returned is not None:
        code = getattr(getattr(plugin.process, "__func__", plugin.process), "__code__", None)
        where = f" (at {code.co_filename}:{code.co_firstlineno} in process)" if code else ""
        raise TypeError(
            f"process returned {shown(returned)}, not None: the host takes only what it "
            f"passes to register(cid, key, value), one claim a call{where}"
        )
    return [(c, k, v) for (c, k), v in drafts.items()], None


@dataclass(frozen=True)
class Trial:
    """What one plugin made of one file, run by hand (`metanode plugins try`), no node asked."""

    file: LocalFile
    drafts: list[Draft]  # those the node would take
    skipped: str | None
    refusals: list[str]  # why the node would refuse each of the others, one line each


def trial(
    name: str,
    row: tuple[str, str, int, int],
    roots: Sequence[str],
    limits: claims.Limits,
    min_size: int,
    timeout_s: float,
    running: Callable[[LocalFile, float], None] = lambda file, elapsed: None,
) -> Trial:
    """Run the installed plugin `name` on the file of `row` (midhash, real path, size,
    mtime_ns; placed in the longest of `roots` holding it) as the host would, without a node:
    on a thread of its own for at most `timeout_s`, its record lookup answering None for
    every CID, nothing signed or stored. What it registered is checked as the node checks a
    plugin's claim: its CID, key and value, and a link only from a plugin that `may_link`.
    `InvalidRequest` for a file smaller than `min_size` (the watcher's: no plugin ever runs on
    it), `NotFoundError` for a plugin that is not installed or does not load; `PluginFailed`
    when `process` raises (`sys.exit()` too) or runs out of time. `running(file, seconds)` is
    called as the run starts (0) and every `TICK_S` while it goes on."""
    if row[2] < min_size:
        raise InvalidRequest(
            f"{row[1]} is {row[2]} bytes: the watcher fingerprints files of at least "
            f"watch_min_size ({min_size}) bytes, so no plugin runs on it"
        )
    found, not_loaded = discover(quiet=True)
    plugin = next((p for p in found if p.name == name), None)
    if plugin is None:
        for broken in not_loaded:
            if broken.entry_point == name:
                raise NotFoundError(f"plugin {shown(name)} does not load: {broken.error}")
        installed = ", ".join(p.name for p in found) or "none"
        raise NotFoundError(
            f"no installed plugin is named {shown(name)} (installed: {installed}): plugins are "
            f"the {ENTRY_POINT_GROUP!r} entry points of the packages installed in the node's "
            f"Python ({sys.prefix}); install yours there ({sys.executable} -m pip install -e "
            "<its folder>)"
        )
    file = local_file(row, roots)
    try:
        run = collect_bounded(plugin, file, lambda _cid: None, timeout_s)
        drafts, skipped = asyncio.run(ticking(run, lambda elapsed: running(file, elapsed)))
    except Exception as exc:
        why = str(exc) if isinstance(exc, RunTimedOut) else described(exc)
        raise PluginFailed(f"{name} {plugin.version} on {file.path}: {why}") from None
    checked = [(draft, refusal(draft, limits, plugin.may_link)) for draft in drafts]
    taken = [draft for draft, why in checked if why is None]
    return Trial(file, taken, skipped, [why for _, why in checked if why is not None])


TICK_S = 10.0  # how often `plugins try` says a run is still going on


async def ticking(work: Awaitable[T], tick: Callable[[float], None]) -> T:
    """Await `work`, calling `tick` with the seconds it has taken at its start and every
    `TICK_S` until it ends: `plugins try` of a slow plugin said nothing until it was done,
    up to `plugin_timeout_s` (10 minutes) of a silent terminal."""
    task = asyncio.ensure_future(work)
    started = time.monotonic()
    tick(0.0)
    while not (await asyncio.wait({task}, timeout=TICK_S))[0]:
        tick(time.monotonic() - started)
    return task.result()


def refusal(draft: Draft, limits: claims.Limits, may_link: bool) -> str | None:
    """Why the node would refuse to take `draft` from a plugin as a claim (its CID, key or
    value; a `cids/…` link from a plugin that may not link), or None."""
    cid, key, value = draft
    try:
        cids.require_canonical(cid)
        claims.check_key(key)
        claims.check_value(value, limits)
    except MetanodeError as exc:
        return f"{key!r}: {exc.slug}: {exc.message}"
    if key.startswith(claims.LINK_PREFIX) and not may_link:
        return f"{key!r}: link_not_permitted: the plugin does not declare may_link"
    return None


@dataclass(frozen=True)
class Made:
    """A run whose plugin is done and whose drafts are signed: its claims wait to be committed
    (`Host`, with those of the runs that ended beside it), then it has its `outcome`."""

    plugin: str
    drafts: list[Draft]
    wire: list[dict[str, Any]]
    skipped: str | None  # the reason, if the plugin skipped the file

    def outcome(self, answer: object) -> Outcome:
        """The run's outcome once its claims were ingested (`answer`) or refused (the
        exception): a refused draft fails this run only. `StorageError` is raised: the disk's
        fault, not the plugin's, so no attempt is spent."""
        if isinstance(answer, StorageError):
            raise answer
        if isinstance(answer, MetanodeError):
            return refused(answer, self.drafts)
        if isinstance(answer, Exception):  # a fault of the node's: this run fails, with its trace
            log.error("ingesting plugin %s's claims failed", self.plugin, exc_info=answer)
            return Outcome("failed", f"{type(answer).__name__}: {answer}")
        if isinstance(answer, BaseException):  # a cancel: no outcome of the run's
            raise answer
        return Outcome("done", self.skipped)


class Runner:
    """Runs one plugin on one file and signs what it registered with the plugin's key."""

    def __init__(
        self,
        plugin: Plugin,
        key: nacl.signing.SigningKey,
        record: RecordLookup,
        timeout_s: float,
        stamp: Stamp,
        said: Said = lambda uid, cid: {},
    ) -> None:
        self.plugin = plugin
        self.key = key
        self.uid = claims.uid_of(bytes(key.verify_key))
        self._record = record
        self._timeout_s = timeout_s
        self._stamp = stamp
        self._said = said

    async def run(self, file: LocalFile) -> Outcome | Made:
        """One run up to its claims: its outcome if it has none to commit, else what it made
        (`Made`), to ingest. A raise or a timeout fails this run only. A clock that cannot date
        its claims (`ClockBehind`) makes it wait, before the plugin runs if the clock reads
        before 2000, else once the drafts name their keys."""
        try:
            self._stamp(self.uid, ())
        except ClockBehind as exc:
            return waiting(exc)
        try:
            drafts, skipped = await collect_bounded(
                self.plugin, file, self._record, self._timeout_s
            )
        except RunTimedOut as exc:
            return Outcome("failed", str(exc))
        except Exception as exc:
            return Outcome("failed", described(exc))
        # its earlier claims are read, the drafts dated and signed on one thread, in one hop:
        # on the event loop a run of 50,000 held every request for 4.3 s, and three hops a run
        # (a read, the date, the signing) each waited for the GIL behind the plugins' threads
        prepared = await asyncio.to_thread(self._prepared, file.cid, drafts, skipped is None)
        if isinstance(prepared, Outcome):
            return prepared
        drafts, wire = prepared
        if not drafts:
            return Outcome("done", skipped)
        return Made(self.plugin.name, drafts, wire, skipped)

    def _prepared(
        self, subject: str, drafts: list[Draft], whole: bool
    ) -> Outcome | tuple[list[Draft], list[dict[str, Any]]]:
        """The drafts worth signing (`replacing` what this plugin said of `subject`) and their
        wire claims, dated after its newest word on their keys (a re-run replaces it); or the
        run's outcome if the clock cannot date them (`waiting`) or they cannot be signed."""
        drafts = replacing(drafts, subject, self._said(self.uid, subject), whole)
        if not drafts:
            return drafts, []
        try:
            now = self._stamp(self.uid, [(cid, key) for cid, key, _ in drafts])
        except ClockBehind as exc:
            return waiting(exc)
        try:  # text JCS cannot encode (a lone surrogate) fails this run, not the host
            return drafts, self._signed(drafts, now)
        except Exception as exc:
            return Outcome("failed", f"cannot sign what it registered: {exc}")

    def _signed(self, drafts: Sequence[Draft], now: int) -> list[dict[str, Any]]:
        """The drafts as wire claims signed at `now`, made on a thread: a claim takes ≈ 60 to
        120 µs to encode and sign, and a run of 50,000 claims signed on the event loop held
        every request of the node for 4.3 s (a plugin listing an album's tracks, a subtitle
        index: hundreds a file)."""
        return [claims.sign(self.key, cid, key, value, now).wire() for cid, key, value in drafts]


def refused(exc: MetanodeError, drafts: Sequence[Draft]) -> Outcome:
    """The outcome of a run whose drafts the node refused: each refused item named by its key
    (its index counts the drafts as signed, which is no order the plugin knows), and failed for
    good unless the refusal is one to retry (the same drafts would be refused again)."""
    said = [
        f"{drafts[item['index']][1]!r}: {item.get('error')}: {item.get('message')}"
        if isinstance(item.get("index"), int) and 0 <= item["index"] < len(drafts)
        else f"{item.get('error')}: {item.get('message')}"
        for item in exc.extra.get("items", ())
    ]  # as `plugins try` says them (`refusal`), not a list's repr
    why = "; ".join(said) or exc.message
    return Outcome("failed", f"{exc.slug}: {why}", final=not exc.retryable)


def backoff_s(attempts: int, base_s: float) -> float:
    """Delay before retry number `attempts` (1, 2, …): base, 4× base, 16× base…"""
    return float(base_s * 4 ** (attempts - 1))


def sidecar_folders(sidecars: frozenset[str], paths: Sequence[str]) -> list[str]:
    """The folders of the paths that have one of these extensions."""
    return sorted(
        {os.path.dirname(p) for p in paths if os.path.splitext(p)[1][1:].lower() in sidecars}
    )


INTERRUPTED = (
    "the node stopped during this run (the plugin ended the process: os._exit, a crash in a C "
    "extension, memory; or the node was killed)"
)


class InFlight:
    """The runs going on now, named in a file of the data directory (`plugins-running`),
    rewritten as each starts and once none is left (a run that ended is named until the next
    start's write: one write a run, not two, each a file and a rename; the next start skips
    such a run, `still_pending`). A plugin that ends the whole process (`os._exit`, a
    crash in a C extension reading a corrupt file) left its run pending, started again first
    thing at every start: the node never stayed up. The file outlives the process (it is not
    fsync'd: a power cut may take it, and with it only the charge of that attempt), so the
    next start charges each run it names the attempt it died in (`Host._charge_interrupted`).

    Written off the event loop (`write`, on a thread): the write and the rename that puts it
    in place wait for the disk, and on a slow one (an SD card, a USB stick busy with the
    databases' writes) they held the event loop, and every request, for seconds at a time.
    `note` sets what the file is to say; `flush` writes the newest noted list if the file does
    not say it yet, under a lock, so writes that overtake one another still end with it."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._failed = False  # a write failed (a full disk): said once
        self._lock = threading.Lock()
        self._noted: tuple[tuple[Any, ...], ...] = ()
        self._version = 0  # of `_noted`
        self._written = 0  # the version the file says
        self.writes = 0  # files written: one a run started, and one each time none is left

    def left(self) -> list[cache.PluginRun]:
        """The runs the last process had going when it ended (none after a clean stop)."""
        try:
            text = self._path.read_text("utf-8") if self._path else ""
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read %s (runs interrupted are not charged): %s", self._path, exc)
            return []
        runs = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError, TypeError):  # a torn line: that charge only
                plugin, version, midhash, attempts, updated_at = json.loads(line)
                runs.append(cache.PluginRun(plugin, version, midhash, attempts, updated_at))
        return runs

    @property
    def stale(self) -> bool:
        """Whether the file does not say the newest noted list yet."""
        return self._version != self._written

    def note(self, runs: Iterable[cache.PluginRun]) -> None:
        """What the file is to say from now on (on the loop: no I/O)."""
        self._noted = tuple(astuple(run) for run in runs)
        self._version += 1

    async def write(self, runs: Iterable[cache.PluginRun]) -> None:
        """`note` `runs`, and return once the file says them (or newer), written on a thread."""
        self.note(runs)
        await asyncio.to_thread(self.flush)

    def flush(self) -> None:
        """Write the newest noted list, if the file does not say it yet (atomically: a reader
        sees the old list or this)."""
        with self._lock:
            version, noted = self._version, self._noted
            if self._path is None or version == self._written:
                return
            partial = self._path.with_name(self._path.name + ".partial")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            try:
                # private as the data directory is: made with the umask's 0644, every start
                # after a run warned `tightened …/plugins-running from 644 to 600`
                with open(os.open(partial, flags, datadir.FILE_MODE), "w", encoding="utf-8") as f:
                    f.write("".join(json.dumps(run) + "\n" for run in noted))
                os.replace(partial, self._path)
            except OSError as exc:
                if not self._failed:
                    log.warning("cannot write %s (a crash would not be charged): %s", partial, exc)
                self._failed = True
            else:
                self._failed = False
                self._written = version
                self.writes += 1


LINES_PER_WINDOW = 20  # lines on failed or skipped runs a plugin may write per `LINES_WINDOW_S`
LINES_WINDOW_S = 600.0


class RunLog:
    """The log's lines on the runs of each plugin that failed or skipped: the first
    `LINES_PER_WINDOW` of a plugin every `LINES_WINDOW_S` one by one, the rest counted and
    summed up in one line (the newest's words) once the plugin has no run going on or the
    window is over. A plugin that raised on every file wrote a line per attempt: 300 for 100
    files, 300,000 for a library of 100,000 (mediainfo without ffprobe a line per video),
    burying everything else; `plugins list` and /health have the counts and newest failures."""

    def __init__(self) -> None:
        self._opened: dict[str, float] = {}  # per plugin, when its window opened
        self._said: dict[str, int] = {}  # lines it wrote in that window
        # lines held back since its last sum: how many, the newest, when the first was
        self._held: dict[str, tuple[int, str, float]] = {}

    def say(self, plugin: str, level: int, line: str) -> None:
        now = time.monotonic()
        if now - self._opened.get(plugin, -LINES_WINDOW_S) >= LINES_WINDOW_S:
            self._opened[plugin], self._said[plugin] = now, 0
        if self._said[plugin] < LINES_PER_WINDOW:
            self._said[plugin] += 1
            log.log(level, "%s", line)
            return
        held, _, first = self._held.get(plugin, (0, "", now))
        self._held[plugin] = (held + 1, line, first)

    def sum_up(self, idle: Callable[[str], bool]) -> None:
        """Say what was held back of each plugin that is `idle` or whose window is over."""
        now = time.monotonic()
        for plugin, (held, newest, first) in list(self._held.items()):
            if idle(plugin) or now - self._opened[plugin] >= LINES_WINDOW_S:
                del self._held[plugin]
                log.warning(
                    "plugin %s: %d more failed or skipped attempt(s) in %.0f s, not "
                    "logged one by one (`metanode plugins list` lists its failures); the newest: "
                    "%s",
                    plugin,
                    held,
                    now - first,
                    newest,
                )


RECORD_MAX = 256  # runs whose claims and outcomes one turn of `Host._record` commits at most
# runs of one plugin ended and waiting for their commit at most, a `plugin_workers` slot: 64
# let the quick plugins race ahead of the slow one and the watcher (a first scan of 3,100 files
# took 29 s instead of 7, and the backlog went 20 % slower: docs/benchmarks.md, "Plugin runs
# committed together"); 2 measured best, 8 in between
AHEAD_MAX = 2


@dataclass
class Ended:
    """A run whose plugin is done (its outcome, or what it made to commit), waiting for its
    claims to be committed and its outcome recorded (`Host._record`)."""

    run: cache.PluginRun
    path: str
    made: Outcome | Made
    recorded: asyncio.Future[None]


class Host:
    """Schedules plugin runs: one per (plugin, version, midhash), kept in cache.db.

    Runs survive restarts (pending rows are picked up again), failures retry with backoff and
    then stay `failed`, and a new plugin version means new rows, so every file is processed again.

    Runs that end close together are committed together: what ended while the last turn
    committed is ingested in ONE truth transaction and one cache apply (`Node.ingest_together`,
    the group commit of `POST /api/claims`), then their outcomes in one cache.db transaction
    (`_record`): two fsync'd commits a run were the backlog's writers' fifth of the GIL. A run's
    claims are durable before it is recorded done, and a refused claim fails its run alone.
    """

    def __init__(
        self,
        runners: Sequence[Runner],
        store: cache.CacheStore,
        ingest: IngestTogether,
        workers: int,
        max_attempts: int,
        retry_s: float,
        clock: Clock = now_ms,
        roots: Sequence[str] = (),
        in_flight: Path | None = None,
    ) -> None:
        self.runners = {runner.plugin.name: runner for runner in runners}
        self._ingest = ingest
        # waiting for the next turn of `_record`: runs with claims to commit (True), and those
        # with none, whose turns need no truth transaction and do not wait for one
        self._ended: dict[bool, list[Ended]] = {True: [], False: []}
        self._recording: dict[bool, asyncio.Task[None]] = {}
        self.recorded = 0  # turns of `_record`: each one truth transaction and one of cache.db
        self._in_flight = InFlight(in_flight)
        self._roots = list(roots)
        self._store = store
        self._workers = max(1, workers)
        self._max_attempts = max_attempts
        self._retry_s = retry_s
        self._clock = clock
        self._wake = asyncio.Event()
        self._versions = [(r.plugin.name, r.plugin.version) for r in runners]
        self._running: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        self._runs: dict[tuple[str, str, str], cache.PluginRun] = {}  # as picked, for `InFlight`
        self._since: dict[tuple[str, str, str], int] = {}  # when each run going on started
        self._held_until = 0.0  # monotonic: no run starts before (the store failed)
        self.failing: str | None = None  # why the host cannot go on now (/health), or None
        self._waiting: set[str] = set()  # plugins whose runs wait for the clock (logged once)
        # per plugin, its runs failed for good since the start or its last retry, and the
        # newest one's error: /health's warnings (a plugin that raises on every file)
        self.gave_up: dict[str, tuple[int, str]] = {}
        self._log = RunLog()

    def set_roots(self, roots: Sequence[str]) -> None:
        """The watch roots changed (the owner chose a folder on the page): the runs from now
        on place each file in them (`local_file`)."""
        self._roots = list(roots)

    async def files_changed(self, midhashes: Sequence[str]) -> None:
        """New local content: queue a run of every plugin for each midhash."""
        if self._versions and midhashes:
            await self._store.enqueue_runs(self._versions, list(midhashes))
            self._wake.set()

    async def paths_changed(self, midhashes: Sequence[str], paths: Sequence[str]) -> None:
        """The paths of these midhashes changed (a rename, a move, a copy gone), and files
        appeared, changed or went at `paths`: run the plugins that read paths again on those
        midhashes, and those that read sidecars again on the files near a sidecar that moved."""
        by_path = [
            (r.plugin.name, r.plugin.version)
            for r in self.runners.values()
            if r.plugin.path_dependent
        ]
        if by_path and midhashes:
            await self._store.requeue_runs(by_path, list(midhashes))
        for runner in self.runners.values():
            folders = sidecar_folders(runner.plugin.sidecars, paths)
            if folders:
                near = self._store.midhashes_near(folders)
                await self._store.requeue_runs([(runner.plugin.name, runner.plugin.version)], near)
        self._wake.set()

    async def run(self) -> None:
        """Queue every known file for the current versions, then keep each plugin's runs going
        on its own: at most `workers` runs of one plugin at once, the next started as one ends,
        so a slow or hung plugin holds up only its own runs. Ends only when cancelled: a store
        that fails (a database outage, a full disk) holds new runs a probe period and is tried
        again, its runs left pending as they were."""
        queued = False
        try:
            while True:
                wait = self._held_until - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    if not queued:
                        await self._charge_interrupted()
                        await self._store.enqueue_runs(self._versions, None)
                        queued = True
                    self._start_due()
                except Exception as exc:
                    self._hold(exc)
                    continue
                if not self._running and self._in_flight.stale:  # none started: none is named
                    await self._in_flight.write(())
                await self._next_event()
        finally:
            tasks = [*self._running.values(), *self._recording.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._in_flight.flush()  # stopping: the file says no run, even if a write was cut

    def _start_due(self) -> None:
        """Start the due runs of each plugin that has a free slot: fewer than `workers` of its
        runs at work, and fewer than `AHEAD_MAX` a slot ended and waiting for their commit (its
        runs already going are still pending in the store, so they are asked for too and left
        out)."""
        for name, version in self._versions:
            busy = sum(1 for plugin, _, _ in self._runs if plugin == name)
            going = sum(1 for plugin, _, _ in self._running if plugin == name)
            if busy >= self._workers or going - busy >= AHEAD_MAX * self._workers:
                continue
            for run in self._store.due_runs(name, version, self._workers + going):
                ident = (run.plugin, run.version, run.midhash)
                if ident not in self._running and busy < self._workers:
                    self._runs[ident], self._since[ident] = run, self._clock()
                    self._running[ident] = asyncio.create_task(self._guarded(run, ident))
                    busy += 1
        self._log.sum_up(lambda plugin: not any(p == plugin for p, _, _ in self._running))
        if not self._running:  # nothing to run, and the store answered: nothing held
            self._went_on()

    async def _next_event(self) -> None:
        """Until a run ends, work is queued (`_wake`), or a second passes (a retry falls due)."""
        woken = asyncio.create_task(self._wake.wait())
        try:
            waits = [woken, *self._running.values()]
            await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        self._wake.clear()

    async def _guarded(self, run: cache.PluginRun, ident: tuple[str, str, str]) -> None:
        """One run, once `InFlight` names it (before it can end the process); a failure of
        the store holds every run (it stays pending as it was)."""
        try:
            await self._in_flight.write(self._runs.values())
            await self._run_one(run, ident)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._hold(exc)
        else:
            self._went_on()
        finally:
            self._at_rest(ident)
            del self._running[ident]

    def _at_rest(self, ident: tuple[str, str, str]) -> None:
        """The plugin's part of a run is over: its slot is free for the next run (`_wake`) while
        this one waits for its commit, and `InFlight` no longer names it (a kill before that
        commit leaves it pending, run again at the next start and charged nothing: its plugin
        did not end the process). Written by the next start, or `run`."""
        if self._runs.pop(ident, None) is not None:
            del self._since[ident]
            self._in_flight.note(self._runs.values())
            self._wake.set()

    def _went_on(self) -> None:
        """A run finished (or none was due): the store works again, if it failed."""
        if self.failing is not None:
            log.info("plugin runs go on")
            self.failing = None

    def _hold(self, failure: Exception) -> None:
        """No run starts for a probe period (no busy loop while the disk is full or the
        database away); said once, and in /health, until runs start again."""
        self._held_until = time.monotonic() + db.PROBE_S
        why = f"{type(failure).__name__}: {failure}"
        if self.failing is None:
            if isinstance(failure, StorageError):
                log.warning("plugin runs wait for the store: %s", why)
            else:
                log.error("plugin runs failed; trying again", exc_info=failure)
        self.failing = why

    async def _run_one(self, run: cache.PluginRun, ident: tuple[str, str, str]) -> None:
        """Run the plugin, then wait for the run's claims to be committed and its outcome
        recorded with those of the runs that ended beside it (`_record`)."""
        file = self._store.file_of(run.midhash)
        if file is None:  # no local copy left: forget the run; a new copy queues it again
            await self._store.drop_run(run)
            return
        made = await self.runners[run.plugin].run(local_file(file, self._roots))
        self._at_rest(ident)
        ended = Ended(run, file[1], made, asyncio.get_running_loop().create_future())
        with_claims = isinstance(made, Made)
        self._ended[with_claims].append(ended)
        if with_claims not in self._recording:
            self._recording[with_claims] = asyncio.create_task(self._recorder(with_claims))
        await ended.recorded

    async def _recorder(self, with_claims: bool) -> None:
        """Record what ended with claims (or without), a turn at a time (`_record`), until
        nothing waits: the runs that end while a turn commits are the next turn's. No wait for
        more: a lone run pays nothing for the grouping. Runs without claims have turns of their
        own: a quick plugin's run that found nothing to say waited for the others' truth
        transaction and apply (all plugins' runs a second 15 % fewer)."""
        waiting = self._ended[with_claims]
        try:
            while waiting:
                turn = waiting[:RECORD_MAX]
                del waiting[:RECORD_MAX]
                try:
                    await self._record(turn)
                except Exception as exc:  # the store failed: every run of the turn is held
                    for ended in turn:
                        if not ended.recorded.done():
                            ended.recorded.set_exception(exc)
                finally:  # cancelled (the host stops): they stay pending, as they were
                    for ended in turn:
                        ended.recorded.cancel()
        finally:
            del self._recording[with_claims]

    async def _record(self, turn: Sequence[Ended]) -> None:
        """Ingest the claims of the runs of `turn` in one transaction, then record each one's
        outcome in one cache.db transaction: a run is recorded done only once its claims are
        durable. A run whose claims the store could not take (`StorageError`) is not recorded:
        it stays pending as it was, and its `_guarded` holds the runs."""
        made = [(ended, ended.made) for ended in turn if isinstance(ended.made, Made)]
        answers = await self._ingest([each.wire for _, each in made]) if made else []
        answer_of = {id(ended): answer for (ended, _), answer in zip(made, answers, strict=True)}
        rows: list[tuple[cache.PluginRun, str, int, int, str | None]] = []
        recorded: list[Ended] = []
        for ended in turn:
            try:
                outcome = (
                    ended.made.outcome(answer_of[id(ended)])
                    if isinstance(ended.made, Made)
                    else ended.made
                )
            except Exception as exc:
                ended.recorded.set_exception(exc)
                continue
            rows.append(self._finished(ended.run, ended.path, outcome))
            recorded.append(ended)
        await self._store.finish_runs(rows)
        self.recorded += 1
        for ended, (run, status, _, _, error) in zip(recorded, rows, strict=True):
            if status == "failed":
                self._gave_up(run.plugin, f"on {ended.path}: {error}")
            if not ended.recorded.done():
                ended.recorded.set_result(None)

    def _finished(
        self, run: cache.PluginRun, path: str, outcome: Outcome
    ) -> tuple[cache.PluginRun, str, int, int, str | None]:
        """The row `finish_runs` records of a run's `outcome` (status, attempts, next_at,
        error), said in the log if it failed or skipped. A run the clock could not date:
        pending until `due_at`, its attempts as they were; said once per plugin until one of
        its runs gets on."""
        if outcome.status == "pending":
            if run.plugin not in self._waiting:
                log.warning("plugin %s on %s %s", run.plugin, path, outcome.error)
                self._waiting.add(run.plugin)
            return run, "pending", run.attempts, outcome.due_at, outcome.error
        self._waiting.discard(run.plugin)
        attempts = run.attempts + 1
        status, next_at = outcome.status, 0
        if status == "failed" and not outcome.final:
            status, next_at = self._after_failure(attempts)
        if outcome.error:
            level = logging.INFO if status == "done" else logging.WARNING
            after = self._what_next(run.plugin, status, attempts, outcome.final)
            self._log.say(
                run.plugin, level, f"plugin {run.plugin} on {path}: {outcome.error}{after}"
            )
        return run, status, attempts, next_at, outcome.error

    def _gave_up(self, plugin: str, why: str) -> None:
        """Count a run of `plugin` failed for good (`gave_up`, which /health warns of)."""
        count, _ = self.gave_up.get(plugin, (0, ""))
        self.gave_up[plugin] = (count + 1, why)

    def _what_next(self, plugin: str, status: str, attempts: int, final: bool) -> str:
        """What becomes of a run that failed, for its log line: the same warning came three
        times, none saying whether the node would try again, when, or that it had given up
        (and how to have it try again once the plugin is mended)."""
        if status == "pending":
            delay = backoff_s(attempts, self._retry_s)
            return f" (attempt {attempts} of {self._max_attempts}; tried again in {delay:g} s)"
        if status != "failed":
            return ""
        if final:
            why = "not tried again: the node would refuse the same claims"
        else:
            why = f"attempt {attempts} of {self._max_attempts}: failed"
        return (
            f" ({why}; mend the plugin, restart the node, then `metanode plugins retry {plugin}`"
            " runs it again)"
        )

    def _after_failure(self, attempts: int) -> tuple[str, int]:
        """(status, next_at) of a run that failed its `attempts`th attempt: due again after
        its back-off, or failed for good once `plugin_max_attempts` are spent."""
        if attempts >= self._max_attempts:
            return "failed", 0
        return "pending", self._clock() + int(1000 * backoff_s(attempts, self._retry_s))

    async def _charge_interrupted(self) -> None:
        """Charge the runs the last process had going when it ended their attempt (`InFlight`):
        a plugin that ends the process on a file fails there after `plugin_max_attempts`
        starts, instead of ending every start. A run finished or queued again since is left as
        it is, unsaid (`still_pending`: the file names a run that ended until the next starts)."""
        for run in self._in_flight.left():
            if not self._store.still_pending(run):  # it ended before the file was written again
                continue
            attempts = run.attempts + 1
            status, next_at = self._after_failure(attempts)
            file = self._store.file_of(run.midhash)
            log.warning(
                "plugin %s on %s: %s (attempt %d of %d)",
                run.plugin,
                file[1] if file else run.midhash,
                INTERRUPTED,
                attempts,
                self._max_attempts,
            )
            await self._store.finish_run(run, status, attempts, next_at, INTERRUPTED)
            if status == "failed":
                self._gave_up(run.plugin, f"on {file[1] if file else run.midhash}: {INTERRUPTED}")
        await self._in_flight.write(())

    async def describe(self, weights: Mapping[str, int]) -> list[dict[str, Any]]:
        """GET /api/plugins' `plugins`: each plugin with its uid, version, signer weight
        (`weights`, by uid), run counts and newest failures (scans of the runs, on a thread)."""
        report = await asyncio.to_thread(self._store.run_report, FAILURES_SHOWN, SKIPS_SHOWN)
        listed = []
        for name, r in sorted(self.runners.items()):
            listed.append(
                {
                    "name": name,
                    "version": r.plugin.version,
                    "uid": r.uid,
                    "may_link": r.plugin.may_link,
                    "weight": weights.get(r.uid, r.plugin.weight),
                    "runs": report.counts.get(
                        (name, r.plugin.version),
                        {"done": 0, "pending": 0, "failed": 0, "skipped": 0},
                    ),
                    "skips": [
                        {"reason": reason, "runs": runs}
                        for reason, runs in report.skips.get((name, r.plugin.version), [])
                    ],
                    "failures": [
                        {"cid": cid, "path": path, "error": error, "at": at}
                        for cid, path, error, at in report.failures.get(
                            (name, r.plugin.version), []
                        )
                    ],
                    "running": self._running_now(name),
                }
            )
        return listed

    def _running_now(self, name: str) -> list[dict[str, Any]]:
        """The runs of plugin `name` going on now, oldest first, each with its content, a local
        path of it (or None) and when it started (Unix ms): of a plugin that takes 30 s a file,
        `pending` alone did not say whether it worked or hung, nor on which file."""
        running = sorted(
            (since, midhash)
            for (plugin, _, midhash), since in self._since.items()
            if plugin == name
        )
        listed = []
        for since, midhash in running:
            file = self._store.file_of(midhash)
            listed.append({"cid": midhash, "path": file[1] if file else None, "since": since})
        return listed

    async def retry(self, name: str) -> cache.Retried:
        """Queue the failed and skipped runs of plugin `name` again (a tool it needs is
        installed now): how many of each. `NotFoundError` for a plugin that is not running."""
        runner = self.runners.get(name)
        if runner is None:
            raise NotFoundError(f"no running plugin is named {shown(name)}")
        retried = await self._store.retry(name, runner.plugin.version)
        self.gave_up.pop(name, None)  # the operator mended it: a new failure counts anew
        self._wake.set()
        return retried
