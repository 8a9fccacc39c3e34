"""The node: wires settings, databases, the applier, the watcher and the plugin host, and is
the typed API the edges (`api.py`, `compat.py`, `cli.py`'s `serve` and `scan`) call.

The only module that connects the pieces of a running node, and the only one that holds the
two stores (`truth.TruthStore`, `cache.CacheStore`); the applier is `applier.py`, the offline
maintenance of a data directory `maintenance.py`. Reads that the API makes run on the event loop
through the stores' read connections (microseconds each); writes go to the single writer thread
of each store; signature verification runs on a thread pool (PyNaCl releases the GIL).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar, get_args

from metanode import (
    cache,
    claims,
    datadir,
    feed,
    handoff,
    ignores,
    logs,
    maintenance,
    merge,
    peers,
    plugins,
    reconcile,
    signer,
    sse,
    truth,
    watcher,
    watchroots,
)
from metanode import cid as cids
from metanode import rid as rids
from metanode.applier import (
    PUBLISHED_NAME,
    STALL_S,
    Applier,
    Follower,
    HotDocuments,
    PublishedCount,
    Replica,
)
from metanode.bodies import refuse_unknown
from metanode.clock import Clock, iso, now_ms
from metanode.config import WATCHED_FOLDERS, Settings
from metanode.errors import (
    CacheNotReady,
    InvalidBatch,
    InvalidRequest,
    InvalidUid,
    Merged,
    MetanodeError,
    NotFoundError,
    StorageError,
    TooLarge,
    UnknownCid,
    UnknownPeer,
    UnknownRid,
    UnknownWatchRoot,
    WatchRootsFromSettings,
)
from metanode.metrics import Metrics
from metanode.verifier import Processes, Verifier

log = logging.getLogger(__name__)
T = TypeVar("T")
OWNER_NAME = maintenance.OWNER_NAME
LEGACY_NAME = "legacy-writer"  # signs MetaMesh `/meta` writes (compat.py)
# Batches of at most this many claims are validated on the truth writer's thread as their
# group is gathered (`TruthStore.ingest_wire`): one hop to a thread and back instead of two
# (the verifier's, then the writer's). A larger batch is validated on the verifier's threads
# or processes, in parallel and before its group, so the writer does not validate it alone.
WRITER_VALIDATES = 8
# The names /health lists of those the watcher left out as not UTF-8 (`ignores.is_text`),
# beside their count: a library copied from a Latin-1 share may hold thousands.
NOT_UTF8_SHOWN = 20
BEHIND_EVERY_S = 1.0  # `metanode_feed_behind_events` is measured at most this often as feeds send


def service(work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """The task of a service that runs as long as the node (retention, the watcher, the plugin
    host), its unforeseen end logged at once (`logs.said_if_failed`)."""
    task = asyncio.create_task(work, name=name)
    task.add_done_callback(logs.said_if_failed)
    return task


@dataclass(frozen=True)
class LibraryPage:
    """A page of the library, newest first, and the rids its links page on from: `older`,
    the `before` of the page below (None: none is), `newer`, the `after` of the page above."""

    rows: list[cache.LibraryRow]
    older: str | None
    newer: str | None


@dataclass(frozen=True)
class IngestAnswer:
    status: int
    body: dict[str, Any]


def answered(result: truth.IngestResult, applied: bool) -> IngestAnswer:
    """An ingest's answer: each claim's verdict, their counts, and whether the cache applied
    them in time (200) or not yet (202)."""
    body: dict[str, Any] = {"results": [{"status": v} for v in result.verdicts]}
    for verdict in get_args(merge.Verdict):
        body[verdict] = result.verdicts.count(verdict)
    body["applied"] = applied
    return IngestAnswer(200 if applied else 202, body)


def unset_clock(now: int) -> str:
    """What /health and the log say of a clock that reads before 2000: one that was never set
    (a box without a real-time clock, before network time), as no claim can be dated then."""
    return (
        f"the clock reads {iso(now)}, before 2000: it has not been set (no network time yet?); "
        "plugin runs and the owner's edits wait for it"
    )


class Node:
    """One metanode: its data directory, databases, applier and operations."""

    def __init__(
        self,
        settings: Settings,
        clock: Clock = now_ms,
        follower: bool = False,
        handoff_path: Path | None = None,
    ) -> None:
        """`clock` stamps everything the node writes (claims' "now", rids, rows, feed events).
        `follower`: a reader worker of `serve --workers N` (workers.py): it serves reads and
        feeds from the stores and follows the cache the owner worker applies; it runs no
        applier, retention, plugins or watcher. `handoff_path`: the owner worker's socket for
        the claims of `POST /api/claims` (handoff.py): a follower hands them over there, an
        owner listens on it."""
        self.settings = settings
        self.follower = follower
        self._handoff_path = handoff_path
        self._handoff: handoff.Client | None = None
        self._handoff_server: handoff.Server | None = None
        self.clock = clock
        self.limits = claims.Limits(settings.max_value_bytes, settings.max_skew_ms)
        self.policy = truth.Policy(settings.accept_unknown_signers)
        self.minter = rids.Minter(clock)
        self.token = ""
        self.instance = ""
        self.session_secret = ""  # signs the web page's session cookies (ui.py)
        jobs = os.cpu_count() or 2
        self._verify_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=jobs, thread_name_prefix="verify"
        )
        count = settings.verify_processes
        self._verify_processes = Processes(count) if count and not follower else None
        self.verifier = Verifier(self._verify_pool, jobs, self.limits, self._verify_processes)
        self.metrics = Metrics()
        self.streams: set[feed.Subscription[Any]] = set()  # the open feeds (`counted`)
        self._behind_due = 0.0  # when `_measure_behind` next measures (monotonic)
        self.owner = self._own_signer(OWNER_NAME, settings.owner_weight)
        # the watch roots as chosen now (`watch_roots`, or what the owner chose on the page:
        # `add_watch_root`), absolute; changed one at a time. A damaged list of the page's
        # refuses the node (`watch_roots_damaged`): no node watches the default in its place
        settings.require_roots()
        self.roots = [os.path.abspath(root) for root in settings.watch_roots]
        self._roots_lock = asyncio.Lock()
        # a reader worker follows the list the owner worker keeps (none when a setting holds it)
        chosen = follower and not settings.watch_roots_from
        self._followed = watchroots.Followed(settings.data_dir, self.roots) if chosen else None
        self._names = watchroots.Names(settings.data_dir)  # their WebDAV names, kept
        self.legacy = self._own_signer(LEGACY_NAME, settings.legacy_writer_weight)

    def _own_signer(self, name: str, weight: int) -> signer.OwnSigner:
        """A signer whose key file is `keys/<name>.key`, registered as `name`."""
        path = maintenance.own_key_path(self.settings, name)
        return signer.OwnSigner(path, name, weight, self, self.ingest_wire)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if (now := self.clock()) < claims.MIN_TS:
            log.warning("%s", unset_clock(now))
        datadir.secure(self.settings.data_dir)  # the stores migrate their schemas as they open
        self.token, _created = maintenance.ensure_token(self.settings.token_path)
        self.session_secret, _ = maintenance.ensure_token(self.settings.session_secret_path)
        # this data directory's name among boxes: its peers' followers know it by it, as a
        # backup's truth.db seeds another box with the same claim-log id (`peers.SELF_HEADER`)
        self.instance, _ = maintenance.ensure_token(self.settings.instance_path)
        self.truth = truth.TruthStore.configured(self.settings, self.clock).open()
        relaxed = not self.follower and not self.settings.cache_fsync  # the cache writer's
        self.cache = cache.CacheStore.configured(self.settings, self.clock, relaxed=relaxed).open()
        documents = self._hot_documents(self.settings.hot_documents)
        self._answer_meta = self._render_meta if documents is None else documents
        self.applier = self._make_applier(documents)
        self.feed_hub = feed.Hub(self.cache, lambda: self.applier.state)
        self.file_hub = feed.Hub(self.cache, lambda: self.applier.state, table=feed.FILE_FEED)
        self._pruner: asyncio.Task[None] | None = None
        self.plugin_host: plugins.Host | None = None
        self._plugins_not_loaded: list[plugins.NotLoaded] = []
        self.watcher: watcher.Watcher | None = None
        self.responder = peers.Responder(self.truth.log_head, self.truth.claim_ids)
        self.peers = peers.Peers(self, self._pull_config())  # followers pull nothing
        self.applier.start()
        self.truth.on_written(self.applier.apply_ahead)
        self.truth.writer.on_group = self.metrics.grouped
        self.applier.on_applied_ahead = self.metrics.applied_ahead.inc
        if self.follower:
            if self._handoff_path is not None:
                self._handoff = handoff.Client(self._handoff_path)
            return
        await asyncio.to_thread(self._keep_names)
        if self._handoff_path is not None:
            self._handoff_server = handoff.Server(self._handoff_path, self._ingest_handed)
            await self._handoff_server.start()
            self.truth.expect_stragglers()  # the readers' batches come just after its own
        # its key is made at `init`, or here on a first start; a truth of another owner key
        # (a replica given a fresh data directory) is refused before it is registered
        owner, _ = await asyncio.to_thread(maintenance.ensure_owner, self.settings)
        await self.truth.claim_owner(owner)
        await self.owner.register()
        if not isinstance(self.applier, Replica):
            await self._lead()

    def _make_applier(self, documents: HotDocuments | None) -> Applier:
        """A reader worker follows its owner worker; a node on PostgreSQL is one replica of
        perhaps several, applying only while it holds the applier lock (`Replica`, which calls
        `_lead` when it takes it); a node on SQLite is the only one and applies."""
        poll_s = self.settings.apply_poll_s
        if self.follower:
            return Follower(self.cache, self.truth, poll_s, documents)
        if self.settings.postgresql:
            return Replica(self.cache, self.truth, poll_s, self._lead, self._unlead, documents)
        return Applier(self.cache, self.truth, poll_s, documents)

    async def _lead(self) -> None:
        """Start what exactly one process of a node runs (retention, plugins, peer pulls, the
        watcher): at start on SQLite; on PostgreSQL in the replica that holds the applier lock,
        when it takes it (docs/scale-out.md), so no two replicas sign the same plugin claims,
        pull the same peers or watch the same folders."""
        self._pruner = service(self._retention(), "retention")
        if self.settings.plugins_enabled:
            self.plugin_host = await self._start_plugins()
        for row in self.truth.peers():
            self.peers.follow(row)
        if self.settings.watch_enabled:
            if self.settings.webdav_plugin_writes:  # private, as the data directory it is in
                self.settings.plugin_outputs.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.watcher = self._make_watcher(self.watched())
            self._watching = service(self.watcher.run(), "watcher")

    async def _unlead(self) -> None:
        """Stop what `_lead` started: at `stop`, and in a replica that lost the applier lock
        to another (which runs them now)."""
        await self.peers.stop()
        if self.watcher is not None:
            self.watcher.stop()
            await asyncio.gather(self._watching, return_exceptions=True)
            self.watcher = None
        if self.plugin_host is not None:
            self._plugins_task.cancel()
            await asyncio.gather(self._plugins_task, return_exceptions=True)
            self.plugin_host = None
        if self._pruner is not None:
            self._pruner.cancel()
            await asyncio.gather(self._pruner, return_exceptions=True)
            self._pruner = None

    def _hot_documents(self, size: int) -> HotDocuments | None:
        """The in-memory documents of `hot_documents` (None: off). Under `serve --workers N`
        a reader looks at the owner's `PublishedCount` at every read, since the owner's
        commits make its documents old, and the owner bumps it. None on PostgreSQL: there
        the look would be a round trip to the server, as the read is."""
        if not size or self.settings.postgresql:
            return None
        render, version = self._render_meta, self.cache.data_version
        if self._handoff_path is None:  # one process
            return HotDocuments(render, size, version, every_read=False)
        count = PublishedCount(self.settings.data_dir / PUBLISHED_NAME)
        if self.follower:
            return HotDocuments(render, size, count.read, every_read=True)
        return HotDocuments(render, size, version, every_read=False, changed=count.bump)

    def watched(self) -> list[str]:
        """The folders the watcher keeps now: the watch roots (`roots`), and the plugin
        outputs' folder when WebDAV writes are on (`Settings.watched`)."""
        if self.settings.webdav_plugin_writes:
            return [*self.roots, str(self.settings.plugin_outputs)]
        return list(self.roots)

    # -- the watch roots chosen on the page (docs/watcher.md, "Choosing the folders") -----------

    def current_roots(self) -> list[str]:
        """The watch roots as they are now, for what serves their files and names their paths
        (WebDAV's layout, the MetaMesh routes' `filePath` and file events): read at each
        request, never kept from the start, so a folder added or let go on the page
        (`add_watch_root`) shows there at once; in a reader worker, as the owner worker kept
        them in the data directory (`watchroots.Followed`)."""
        if self._followed is not None:
            self.roots = self._followed()
        return self.roots

    def named_roots(self) -> list[tuple[str, str]]:
        """(WebDAV name, root) for each watch root now (`current_roots`): the name each was
        given when it came, kept while it stays (`watchroots.Names`), so letting one folder go
        never renames another in WebDAV, `filePath` or the file events."""
        return self._names(self.current_roots())

    def _keep_names(self) -> None:
        """At start, name the roots as the last start did (a root new since then, or one whose
        name another took in a list edited by hand, is named anew) and keep them; a disk that
        refuses is logged: the roots are then named by the file as it is (or anew where it
        names none), in every worker alike (`watchroots.named`), until a change writes it."""
        try:
            self._names.keep(self.roots)
        except StorageError as exc:
            log.warning("the watch roots' WebDAV names are not kept: %s", exc.message)

    async def watch_roots(self) -> dict[str, Any]:
        """GET /api/watch-roots: the roots, each with its state (`Watcher.state_of`, or `off`
        where no watcher runs in this process: `watch_enabled` off, or a PostgreSQL replica
        that does not lead), and whether the owner may change them here (`set_in`: where
        `watch_roots` is set, which then holds them)."""
        running = self.watcher

        def states() -> list[dict[str, str]]:
            return [
                {"path": root, "state": "off" if running is None else running.state_of(root)}
                for root in self.roots
            ]

        return {
            "editable": not self.settings.watch_roots_from,
            "set_in": self.settings.watch_roots_from or None,
            "watcher": running is not None,
            "roots": await asyncio.to_thread(states),
        }

    def _editable(self) -> None:
        """409 `watch_roots_from_settings` when the config file or the environment sets
        `watch_roots`: a change here would be silently overridden there at the next start."""
        if self.settings.watch_roots_from:
            raise WatchRootsFromSettings(
                f"watch_roots is set in {self.settings.watch_roots_from}: change the folders "
                "there (and restart), or remove it there to choose them on the page"
            )

    async def add_watch_root(self, text: str) -> dict[str, Any]:
        """POST /api/watch-roots: check the folder (`watchroots.check_new`), keep the new list
        in the data directory, then watch it at once (the watcher reconciles it) and let the
        plugins place its files in it."""
        self._editable()
        async with self._roots_lock:
            s = self.settings
            outputs = s.plugin_outputs if s.webdav_plugin_writes else None
            path = await asyncio.to_thread(
                watchroots.check_new, text, self.roots, s.data_dir, outputs
            )
            # named first: a reader worker that sees the new list finds its name kept
            await asyncio.to_thread(self._names.keep, [*self.roots, path])
            await asyncio.to_thread(watchroots.save, self.settings.data_dir, [*self.roots, path])
            self.roots = [*self.roots, path]  # a new list: others read it from threads
            log.info("watching %s as well (chosen on the page)", path)
            if self.watcher is not None:
                self.watcher.add_root(path)
            self._roots_changed()
        return await self.watch_roots()

    async def remove_watch_root(self, text: str) -> dict[str, Any]:
        """DELETE /api/watch-roots: stop watching a root. Its files keep their records and
        paths, looked at again at each full reconciliation as any file below no root is (a
        file deleted then loses its path): the watcher's rule for a root taken out of
        `watch_roots` (docs/watcher.md)."""
        self._editable()
        async with self._roots_lock:
            real = os.path.realpath(os.path.abspath(text))
            found = next((r for r in self.roots if os.path.realpath(r) == real), None)
            if found is None:
                raise UnknownWatchRoot(f"{os.path.abspath(text)} is not a watched folder")
            rest = [root for root in self.roots if root != found]
            await asyncio.to_thread(self._names.keep, rest)  # its name given up, no other's
            await asyncio.to_thread(watchroots.save, self.settings.data_dir, rest)
            self.roots = rest
            log.info("no longer watching %s (chosen on the page); its files keep their rows", found)
            if self.watcher is not None:
                self.watcher.remove_root(found)
            self._roots_changed()
        return await self.watch_roots()

    def _roots_changed(self) -> None:
        """Tell the plugin host, which places files in their roots (`filename` reads the path
        below the root)."""
        if self.plugin_host is not None:
            self.plugin_host.set_roots([str(Path(root).resolve()) for root in self.watched()])

    def _make_watcher(self, roots: Sequence[str]) -> watcher.Watcher:
        s = self.settings
        return watcher.Watcher(
            roots,
            ignores.Rules(s.watch_ignore, s.watch_follow_symlinks, s.watch_min_size),
            s.watch_settle_s,
            s.watch_rescan_s,
            s.watch_hash_workers,
            self.ensure_groups,
            self.apply_local,
            self.cache.local_stats,
            self.cache.fill_ctimes,
            watcher.RootDevices(s.data_dir / watcher.DEVICES_FILE),
            self.cache.local_stats_outside,
            kept_missing=self._chosen_roots(),
        )

    def _chosen_roots(self) -> list[str]:
        """The watch roots when they are the owner's, chosen on the page (kept in
        `WATCHED_FOLDERS`, no setting naming them), else none. Each was a folder when chosen,
        so one missing at a start is a disk not mounted (a box restored on another machine)
        or a folder deleted: the watcher keeps it missing, never makes it empty in its place,
        which hid that under `watching`."""
        if self.settings.watch_roots_from:
            return []
        listed = self.settings.data_dir / WATCHED_FOLDERS
        return list(self.roots) if listed.exists() else []

    async def apply_local(self, files: Sequence[merge.LocalFile], removals: Sequence[str]) -> None:
        """The watcher's results reach the cache, then the plugins, then the owner's word
        follows content replaced at its path. A file hashed again to the content its path held
        (its ctime moved: a chmod, a new hard link; or only its mtime: a `touch`) is nothing new
        to the plugins: `chmod -R` over a library re-ran every path-dependent plugin on it."""
        before = self.cache.midhashes_at([f.path for f in files] + list(removals))
        await self.applier.apply_local(files, removals)
        same = {f.path for f in files if before.get(f.path) == f.midhash}
        files = [f for f in files if f.path not in same]
        before = {path: midhash for path, midhash in before.items() if path not in same}
        if self.plugin_host is not None:
            # the path-dependent runs first: queued after every plugin's, they made a new
            # file's run pending again once it had started, and it ran twice (37 of 40 files
            # scanned one at a time); a run they queue is left as it is by `files_changed`
            await self.plugin_host.paths_changed(
                sorted({f.midhash for f in files} | set(before.values())),
                sorted({f.path for f in files} | set(before)),
            )
            await self.plugin_host.files_changed(sorted({f.midhash for f in files}))
        if self.settings.owner_carry_over:
            for file in files:
                old = before.get(file.path)
                if old is not None and old != file.midhash:
                    await self._carry_owner_word(file.path, old, file.midhash)

    async def _carry_owner_word(self, path: str, old: str, new: str) -> None:
        """Content replaced at `path` (a tag edit, a remux, an upgrade): re-sign the owner's
        live claims about the old content about the new one, if the old content is gone from
        the disk. Only the owner's claims (plugins recompute theirs), only along one path."""
        if self.cache.file_of(old) is not None:
            return  # another copy of the old content is still here: it keeps its record
        rid = self.truth.group_of(old)
        if rid is None:
            return
        async with self.owner.lock:
            said = self.truth.group_claims(rid, uid=self.owner.uid)
            drafts = sorted({(new, c.key, c.value) for c in said if c.value is not None})
            if not drafts:
                return
            try:
                await self.owner.sign_and_ingest(drafts)
            except MetanodeError as exc:
                log.warning("cannot carry the owner's claims to %s: %s", path, exc.message)
                return
        log.info(
            "carried the owner's %d claim(s) (%s) from %s to %s at %s",
            len(drafts),
            ", ".join(key for _, key, _ in drafts),
            old,
            new,
            path,
        )

    async def _start_plugins(self) -> plugins.Host:
        """Discover plugins, register each as a signer with its own key, start the host."""
        s = self.settings
        weights = s.plugin_weight_map
        runners = []
        shown: list[str] = []  # the start line's words on each: its version is no weight
        found, self._plugins_not_loaded = plugins.discover()
        installed = {plugin.name for plugin in found}
        if strays := sorted((set(s.plugins_disabled) | set(weights)) - installed):
            log.warning(  # a typo would otherwise leave a plugin on, or at its own weight
                "plugins_disabled or plugin_weights name no installed plugin: %s (installed: %s)",
                ", ".join(strays),
                ", ".join(sorted(installed)) or "none",
            )
        for plugin in found:
            if plugin.name in s.plugins_disabled:
                continue
            key = plugins.plugin_key(s.keys_dir, plugin.name)
            runner = plugins.Runner(
                plugin,
                key,
                self.record_of,
                s.plugin_timeout_s,
                self.stamp_apart,
                self.said_by,
            )
            row = await self.truth.add_signer(
                runner.uid, f"plugin:{plugin.name}", self._plugin_weight(runner), plugin.may_link
            )
            runners.append(runner)
            shown.append(f"{plugin.name} (version {plugin.version}, weight {row.weight})")
        log.info("plugins: %s", ", ".join(shown) or "none")
        host = plugins.Host(
            runners,
            self.cache,
            self.ingest_together,
            s.plugin_workers,
            s.plugin_max_attempts,
            s.plugin_retry_s,
            self.clock,
            [str(Path(root).resolve()) for root in self.watched()],
            s.plugins_running_path,
        )
        self._plugins_task = service(host.run(), "the plugin host")
        return host

    def _plugin_weight(self, runner: plugins.Runner) -> int | None:
        """The weight a plugin's signer gets at start: `plugin_weights`' if it names the
        plugin, else the plugin's own the first time only; a weight set since (`signers add
        --weight`, POST /api/signers) is kept (None: left as it is)."""
        configured = self.settings.plugin_weight_map.get(runner.plugin.name)
        if configured is not None:
            return configured
        return runner.plugin.weight if self.truth.signer(runner.uid) is None else None

    def said_by(self, uid: str, cid: str) -> dict[str, str | None]:
        """key → value of `uid`'s live stored claims about exactly `cid`: what a plugin's new
        run replaces. On a read connection of its own: a plugin run's thread calls it."""
        return {c.key: c.value for c in self.truth.said_about(uid, cid)}

    def stamp_apart(self, uid: str, pairs: Sequence[tuple[str, str]]) -> int:
        """`stamp` on a read connection of its own, for a plugin run's thread (its claims, as
        many as it made, are read there, not on the event loop)."""
        newest = self.truth.newest_said_apart(uid, pairs) if pairs else None
        return claims.next_ts(self.clock(), newest, self.limits)

    def record_of(self, cid: str) -> dict[str, str] | None:
        """A plugin's read of the merged metadata of any CID (never a rid), from its threads."""
        return self.cache.record_of(cids.normalise(cid))

    async def ensure_groups(self, midhashes: Sequence[str]) -> None:
        """Mint groups for midhashes the truth has not seen (the watcher, before `apply_local`)."""
        await self.truth.ensure_groups(midhashes, self.minter)
        self.applier.wake()

    async def scan(
        self, roots: Sequence[str], progress: watcher.Progress | None = None
    ) -> watcher.Summary:
        """`metanode scan`: one reconciliation of `roots`, without settling, then wait for the
        cache."""
        summary = await self._make_watcher(roots).reconcile(roots, settle=False, progress=progress)
        await self._settled()
        return summary

    async def stop(self) -> None:
        """Stop taking handed-over claims, pulling and watching, finish queued writes, stop the
        applier, close everything."""
        if self._handoff_server is not None:
            await self._handoff_server.stop()
        if self._handoff is not None:
            self._handoff.close()
        if isinstance(self.applier, Replica):
            self.applier.retire()
        await self._unlead()
        await asyncio.to_thread(self.truth.stop_writes)
        await self.applier.stop()
        await asyncio.to_thread(self.cache.close)  # drains the jobs reading truth snapshots
        self.truth.close()
        self._verify_pool.shutdown()
        if self._verify_processes is not None:
            self._verify_processes.shutdown()

    async def _retention(self) -> None:
        """From start and then every `feed_prune_s`: `retain`. A failure is tried again at the
        next turn: the storage's (a full disk) in one line, anything else with its traceback."""
        while True:
            try:
                await self.retain()
            except StorageError as exc:
                log.warning("retention failed (%s: %s); will retry", exc.slug, exc.message)
            except Exception:
                log.exception("retention failed; will retry")
            await asyncio.sleep(self.settings.feed_prune_s)

    async def retain(self) -> None:
        """One turn of retention: the feed events beyond `feed_retention_events` or older than
        `feed_retention_days`, and the outbox rows the cache has applied, are dropped. With
        nothing to drop it writes nothing (no page changes, so SQLite's COMMIT appends nothing
        to the WAL): an idle node's data directory stays as it is, as an SD card wants."""
        keep = self.settings.feed_retention_events
        window_ms = int(self.settings.feed_retention_days * 86_400_000)
        await self.cache.prune_feed(keep, self.clock() - window_ms)
        if self.applier.ready:
            await self.truth.prune_changes(self.applier.applied_seq)

    # -- feed -----------------------------------------------------------------------------------

    def subscribe(
        self, cursor: str | None, snapshot: bool, where: sse.Filter
    ) -> AsyncGenerator[bytes, None]:
        """A feed subscription from a `Last-Event-ID`/`?since=` cursor (SPEC §5)."""
        self.require_ready()
        framing = feed.RecordFraming(self.cache, where)
        subscription = feed.Subscription(
            self.meta_feed(), framing, sse.parse_cursor(cursor), snapshot
        )
        return self.counted(subscription)

    @property
    def subscribers(self) -> int:
        """The feeds open in this process."""
        return len(self.streams)

    def meta_feed(self) -> feed.Feed[feed.FeedRow]:
        """The records' feed table (`/api/events`, MetaMesh's `/api/events/meta`): the shared
        hub, and a snapshot of every record."""
        return feed.Feed(
            self.feed_hub,
            self.applier.wait_feed,
            lambda: self.cache.records_reading((), feed.PAGE),
            self.settings.feed_keep_alive_s,
        )

    def files_feed(self) -> feed.Feed[feed.FileFeedRow]:
        """The file events (MetaMesh's `/api/events/files`): their shared hub, and a snapshot
        of every local file."""
        return feed.Feed(
            self.file_hub,
            self.applier.wait_files,
            lambda: self.cache.files_reading(feed.PAGE),
            self.settings.feed_keep_alive_s,
        )

    async def counted(self, subscription: feed.Subscription[Any]) -> AsyncGenerator[bytes, None]:
        """The subscription's stream, counted in `streams` while it is open; closed with this
        wrapper, so a client that leaves releases what the stream holds at once, not at
        garbage collection. How far behind the feeds are is measured as they send."""
        self.streams.add(subscription)
        self.metrics.subscribers.inc()
        try:
            async with contextlib.aclosing(subscription.stream()) as stream:
                async for chunk in stream:
                    yield chunk
                    self._measure_behind(time.monotonic())
        finally:
            self.streams.discard(subscription)
            self.metrics.subscribers.dec()
            self._measure_behind()

    def _measure_behind(self, now: float | None = None) -> None:
        """`metanode_feed_behind_events`: the most events an open feed of this process has not
        been sent yet. Measured at most once every `BEHIND_EVERY_S` as feeds send (`now`), and
        at once (no `now`) when one closes and at a scrape; a stuck feed sends nothing, so it
        is measured as the others send, or their keep-alives."""
        if now is not None:
            if now < self._behind_due:
                return
            self._behind_due = now + BEHIND_EVERY_S
        behind = max((each.behind() for each in self.streams), default=0)
        self.metrics.feed_behind.set(behind)

    # -- ingest ---------------------------------------------------------------------------------

    def _batch_items(self, payload: object) -> list[object]:
        if not isinstance(payload, dict) or not isinstance(payload.get("claims"), list):
            raise InvalidRequest('the body must be {"claims": [wire claims…]}')
        refuse_unknown(payload, ("claims",))
        items: list[object] = payload["claims"]
        if len(items) > self.settings.max_batch_claims:
            raise TooLarge(
                f"{len(items)} claims; at most {self.settings.max_batch_claims} per batch"
            )
        return items

    async def _validate(self, items: list[object], now: int) -> list[claims.Claim]:
        """Validate every claim off the loop (`verifier.Verifier`: concurrent requests' claims
        share the pool's jobs); all errors or all claims."""
        valid, errors = await self.verifier.validate(items, now)
        if errors:
            raise InvalidBatch(errors)
        return valid

    async def ingest(self, payload: object) -> IngestAnswer:
        """POST /api/claims: validate all, commit all in one transaction, wait for the cache."""
        started = time.perf_counter()
        try:
            answer = await self.ingest_wire(self._batch_items(payload))
        except MetanodeError as exc:
            self.metrics.refused(exc)
            raise
        self.metrics.ingest_seconds.observe(time.perf_counter() - started)
        for verdict, counter in self.metrics.verdicts.items():
            counter.inc(answer.body[verdict])
        return answer

    async def ingest_wire(self, items: list[object]) -> IngestAnswer:
        """A batch of wire claims through validation, the truth and the cache (plugins too); a
        reader worker's handed to the owner worker, which does that (handoff.py)."""
        if self._handoff is not None:
            return IngestAnswer(*await self._handoff.ingest(items))
        now = self.clock()
        if len(items) <= WRITER_VALIDATES:
            result = await self.truth.ingest_wire(
                items, self.verifier.limits, self.minter, self.policy, now
            )
        else:
            batch = await self._validate(items, now)
            result = await self.truth.ingest(batch, self.minter, self.policy, now)
        self.applier.hand(result)
        applied = await self.applier.wait_for(result.seq, self.settings.apply_wait_s)
        return answered(result, applied)

    async def ingest_together(
        self, batches: Sequence[list[object]]
    ) -> list[IngestAnswer | BaseException]:
        """Batches of wire claims (plugin runs that ended close together), each taken as
        `ingest_wire` takes one (a small batch validated on the truth writer's thread, a large
        one first on the verifier's) and committed in ONE truth transaction and one cache apply
        (`TruthStore.ingest_together`): a batch refused (a claim, its signer's policy) fails
        alone, its exception in its place; each is answered once its claims are durable and
        applied (or after `apply_wait_s`, `"applied": false`). All on the verifier's threads, a
        turn of the plugin host's runs spent a third of its time handing them there and back."""
        now = self.clock()
        large = [items for items in batches if len(items) > WRITER_VALIDATES]
        validated = iter(
            await asyncio.gather(
                *(self._validate(items, now) for items in large), return_exceptions=True
            )
        )
        checked: list[tuple[Sequence[object], bool] | BaseException] = [
            (items, False) if len(items) <= WRITER_VALIDATES else self._checked(next(validated))
            for items in batches
        ]
        taken = [each for each in checked if not isinstance(each, BaseException)]
        stored = iter(
            await self.truth.ingest_together(
                taken, self.verifier.limits, self.minter, self.policy, now
            )
        )
        results = [each if isinstance(each, BaseException) else next(stored) for each in checked]
        seq = 0
        for result in results:
            if isinstance(result, truth.IngestResult):
                self.applier.hand(result)
                seq = max(seq, result.seq)
        applied = await self.applier.wait_for(seq, self.settings.apply_wait_s)
        return [r if isinstance(r, BaseException) else answered(r, applied) for r in results]

    @staticmethod
    def _checked(
        valid: list[claims.Claim] | BaseException,
    ) -> tuple[Sequence[object], bool] | BaseException:
        """A large batch as `ingest_together` takes it: validated, or why not."""
        return valid if isinstance(valid, BaseException) else (valid, True)

    async def _ingest_handed(self, items: list[object]) -> tuple[int, dict[str, Any]]:
        """Wire claims a reader worker handed over (handoff.py): taken as this worker's own
        requests' are; counted in the reader's metrics, where the request was answered."""
        answer = await self.ingest_wire(items)
        return answer.status, answer.body

    # -- peers (docs/peers.md) ------------------------------------------------------------------

    def _pull_config(self) -> peers.PullConfig:
        s = self.settings
        return peers.PullConfig(
            s.peer_page_claims,
            s.peer_poll_s,
            s.peer_retry_s,
            s.peer_max_backoff_s,
            s.peer_timeout_s,
        )

    def claims_log(self, after: str | None, limit: int, uid: str | None) -> dict[str, Any]:
        """GET /api/claims/log: the stored claims in the order this box stored them."""
        if uid is not None:
            claims.public_key(uid)
        page = self.truth.claims_log(after, limit, uid)
        return {
            "claims": [c.wire() for c in page.claims],
            "next": page.next,
            "more": page.more,
            "signers": self._signer_names(page.claims),
        }

    def _signer_names(self, listed: Sequence[claims.Claim]) -> dict[str, str]:
        """What this box calls the signers of `listed` (a peer names the ones it learns so:
        `filename (via a)`); a few primary-key reads, one a signer."""
        rows = (self.truth.signer(uid) for uid in {c.uid for c in listed})
        return {row.uid: row.name for row in rows if row is not None}

    def peer_token_name(self, token: str) -> str | None:
        """The name of the peer token `token` is, or None (kept hashed in the truth)."""
        return self.truth.peer_token_named(hashlib.sha256(token.encode()).hexdigest())

    async def reconcile_answer(self, payload: object) -> dict[str, Any]:
        """POST /api/claims/reconcile: a round of reconciliation (`{"ranges"}`), or the claims
        of some identities (`{"fetch"}`)."""
        if (
            not isinstance(payload, dict)
            or len(payload) != 1
            or not ({"ranges", "fetch"} & set(payload))
        ):
            raise InvalidRequest('the body must be {"ranges": [...]} or {"fetch": [ids…]}')
        if "fetch" in payload:
            wanted = payload["fetch"]
            if not isinstance(wanted, list) or len(wanted) > peers.FETCH_CHUNK:
                raise InvalidRequest(f"fetch must be an array of at most {peers.FETCH_CHUNK} ids")
            ids = [reconcile.decode_id(i, truth.ID_BYTES) for i in wanted]
            found = await asyncio.to_thread(self.truth.claims_by_ids, ids)
            return {"claims": [c.wire() for c in found], "signers": self._signer_names(found)}
        message = reconcile.decode_fingerprints(payload["ranges"])  # bounded: MAX_RANGES
        head, items = await self.responder.items()
        # Pure CPU in proportion to the ranges asked (≈ 0.1 s for the most a request may ask):
        # on a thread, so that the loop answers everyone else meanwhile.
        answer = await asyncio.to_thread(reconcile.answer, items, message)
        return {"ranges": answer, "head": head}

    async def own_items(self) -> reconcile.Items:
        """This box's claim identities (a peer's reconciliation, the initiator's side)."""
        _, items = await self.responder.items()
        return items

    def claim_count(self) -> int:
        return self.truth.claim_count()

    def peer(self, name: str) -> truth.PeerRow | None:
        return self.truth.peer(name)

    async def apply_peer_page(
        self, name: str, items: list[object], cursor: str | None, names: Mapping[str, str]
    ) -> peers.PageCounts:
        """A page pulled from peer `name`: every claim verified as POST /api/claims verifies
        it; the valid ones stored with the cursor in one transaction; the rest counted, and
        logged (the count alone never said why)."""
        row = self.truth.peer(name)
        if row is None:
            raise UnknownPeer(f"no peer is named {name!r}")
        now = self.clock()
        valid, errors = await self.verifier.validate(items, now)
        page = truth.PeerCursor(name, cursor, len(errors), names)
        result, refused = await self.truth.ingest_peer(valid, page, row.weight, self.minter, now)
        self.applier.hand(result)  # like any ingest: the apply need not read it back
        await self.applier.wait_for(result.seq, self.settings.apply_wait_s)
        for item in errors:
            self.metrics.rejected.labels(item["error"]).inc()
        said = [f"{e['error']}: {e['message']}" for e in errors] + [
            f"{error.slug}: {error.message} ({claim.key} of {claim.cid})"
            for claim, error in refused
        ]
        if said:
            log.warning("peer %s: %d claim(s) of a page refused, e.g. %s", name, len(said), said[0])
        return peers.PageCounts(
            result.verdicts.count("accepted"),
            result.verdicts.count("duplicate"),
            result.verdicts.count("stale"),
            len(said),
            self._valid_from(items, errors),
            said[0] if said else "",
        )

    def _valid_from(self, items: list[object], errors: list[dict[str, Any]]) -> int | None:
        """The clock reading from which the first of the claims refused as dated too far ahead
        is no longer (None: none was): the follower then reconciles to fetch them."""
        ahead: list[int] = []
        for error in errors:
            item = items[error["index"]]
            if error["error"] == "ts_in_future" and isinstance(item, dict):
                ahead.append(int(item["ts"]))  # checked an integer before it was found ahead
        if not ahead:
            return None
        return min(ahead) - self.settings.max_skew_ms

    async def add_peer(self, url: str, token: str, weight: int, name: str) -> dict[str, Any]:
        """Follow a peer: the first sync reconciles if this box already holds claims. The
        answer waits (at most `apply_wait_s`) for the first pull, so a peer that does not
        answer, or refuses the token, is said in its `last_error` at once; one that did not
        answer the first question within that time is said so without waiting again (its
        follower's own request times out only after `peer_timeout_s`: `peers add` took twice
        `apply_wait_s` and answered no error)."""
        wait = self.settings.apply_wait_s
        answered = await self.peers.probe(url, token, wait)
        if answered == self.instance:
            raise InvalidRequest(  # followed, it was polled at the back-off cap for ever
                f"{url} is this box itself (it answers with this box's instance id): a box "
                "follows other boxes"
            )
        twin = self.peers.following(answered, name) if answered else None
        if twin is not None:  # `localhost` and `127.0.0.1`: every claim travelled twice
            raise InvalidRequest(
                f"{url} is the box followed already as the peer {twin!r} (it answers with that "
                "box's instance id): add it again under that name to change its address, token "
                "or weight, or remove that one first"
            )
        row = await self.truth.add_peer(name, url, token, weight)
        first_sync = row.cursor == "" and self.truth.claim_count() > 0
        self.peers.follow(row, first_sync)
        if answered is not None:
            await self.peers.first_try(name, wait)
        status = self.peers.status(self.truth.peer(name) or row)
        if answered is None and not status["last_error"]:
            status["last_error"] = (
                f"peer_failed: {url} did not answer within {wait:g} s; it is asked again, and "
                f"waited for up to {self.settings.peer_timeout_s:g} s (peer_timeout_s)"
            )
        return status

    async def remove_peer(self, name: str) -> None:
        await self.peers.forget(name)
        if not await self.truth.remove_peer(name):
            raise UnknownPeer(f"no peer is named {name!r}")

    def list_peers(self) -> list[dict[str, Any]]:
        return [self.peers.status(row) for row in self.truth.peers()]

    async def sync_peer(self, name: str) -> dict[str, Any]:
        """`metanode peers sync NAME`: reconcile with the peer now and fetch what is missing."""
        report = await self.peers.follower(name).sync()
        return report.as_json()

    # -- signers --------------------------------------------------------------------------------

    async def _settled(self) -> None:
        """Wait (bounded) until the cache reflects the truth, the signers' replans done:
        read-your-writes for signer edits. A replan longer than `apply_wait_s` goes on after
        the answer, a step at a time (`cache.replan_step`), the node taking writes meanwhile."""
        self.applier.wake()
        await self.applier.wait_replanned(self.truth.max_seq(), self.settings.apply_wait_s)

    async def add_signer(
        self, uid: str, name: str | None, weight: int | None, may_link: bool | None
    ) -> dict[str, Any]:
        """Register `uid`, or update what is given of it (None keeps a known signer's own)."""
        claims.public_key(uid)
        maintenance.refuse_owner_change(self.owner.uid, uid)
        row = await self.register_signer(uid, name, weight, may_link)
        await self._settled()
        return row.as_json()

    async def set_signer_status(self, uid: str, status: str) -> dict[str, Any]:
        claims.public_key(uid)  # a uid that is none is `invalid_uid`, not an unknown signer
        maintenance.refuse_owner_change(self.owner.uid, uid, status)
        row = await self.truth.set_signer_status(uid, status)
        await self._settled()
        return row.as_json()

    def signers(self) -> list[dict[str, Any]]:
        return [row.as_json() for row in self.truth.signers()]

    # -- the cache ------------------------------------------------------------------------------

    async def rebuild_cache(self) -> dict[str, Any]:
        """POST /api/cache/rebuild, what `metanode rebuild-cache` asks of the node serving its
        data directory: a rebuild in place (`cache.start_rebuild_txn`), which the applier takes
        `cache.REBUILD_CHUNK` records a transaction, the writes applied between two steps.
        Answered once it has started; /health's `rebuilding` says while it goes on. Beside a
        serving node, one transaction of the whole cache held every write behind it (37 s at
        500,000 claims), and past SQLite's busy wait failed them."""
        state = await self.cache.start_rebuild()
        self.applier.started(state)
        return {"rebuilding": True, "epoch": state.epoch, "applied_seq": state.applied_seq}

    async def register_signer(
        self, uid: str, name: str | None, weight: int | None, may_link: bool | None
    ) -> truth.SignerRow:
        """Register (or re-weigh) a signer the node itself holds the key of, without waiting
        for the cache; the applier is woken, as a new weight re-merges what it signed."""
        row = await self.truth.add_signer(uid, name, weight, may_link)
        self.applier.wake()
        return row

    async def owner_says(self, drafts: Sequence[signer.Draft]) -> IngestAnswer:
        """Sign `drafts` (cid, key, value or None to revert) with the box owner's key and ingest
        them as one batch: what a person fixes on the web page, outranking the plugins."""
        answer: IngestAnswer = await self.owner.say(drafts)
        return answer

    def stamp(self, uid: str, pairs: Sequence[tuple[str, str]]) -> int:
        """The ts of a new word of `uid`, a signer whose key this node holds (the owner, the
        legacy writer, a plugin), on these (cid, key) pairs: now, or just after its newest word
        on those keys in those groups, so that it counts whatever the clock did since
        (`claims.next_ts`); raises `ClockBehind`."""
        return claims.next_ts(self.clock(), self.truth.newest_said(uid, pairs), self.limits)

    # -- reads ----------------------------------------------------------------------------------

    def require_ready(self) -> None:
        """503 `cache_not_ready` until the cache has been built (reads need it)."""
        if not self.applier.ready:
            raise CacheNotReady("the cache is being built from the truth; retry shortly")

    @staticmethod
    def _match(text: str, lookup: Callable[[str], T | None]) -> tuple[str, str, T | None]:
        """(asked CID in canonical spelling, the spelling `lookup` found something under, what
        it found), trying the alias spelling on a miss (SPEC §1.1); (asked, asked, None) if
        neither spelling finds anything. The one home of the alias-spelling retry.

        `text` itself is looked up first, before any parse: the stores hold canonical
        spellings only (a claim's CID and link member must be canonical, the watcher and the
        migration tool store canonical ones), so a hit is already the canonical spelling. A
        read of a known CID then skips the parse, whose cache a large library overflows
        (docs/benchmarks.md, "Reads at 1M claims")."""
        found = lookup(text) if text.startswith("b") else None
        if found is not None:
            return text, text, found
        asked = cids.normalise(text)
        for candidate in cids.spellings(asked):
            found = None if candidate == text else lookup(candidate)  # `text` missed above
            if found is not None:
                return asked, candidate, found
        return asked, asked, None

    def _find(self, text: str, lookup: Callable[[str], T | None]) -> tuple[str, T]:
        """(asked CID in canonical spelling, what `lookup` found for it); 404 `unknown_cid`."""
        asked, _, found = self._match(text, lookup)
        if found is None:
            raise UnknownCid(f"no record holds {asked}")
        return asked, found

    def grouped_spelling(self, text: str) -> tuple[str, str | None]:
        """(the spelling of CID `text` the truth has grouped, else its canonical spelling; that
        group's rid, or None): a write about either spelling joins the record that exists."""
        _, spelling, rid = self._match(text, self.truth.group_of)
        return spelling, rid

    def resolve_cid(self, text: str) -> tuple[str, str]:
        """(asked CID in canonical spelling, the rid of the cached record holding it)."""
        return self._find(text, self.cache.lookup)

    def _seen_by(self, group: cache.Group, viewer: str | None) -> dict[str, str]:
        """`?as=<uid>`: the group's record as the viewer sees it (`merge.seen_by`), from the
        viewer's own votes only."""
        if viewer is None:
            return group.record
        if not isinstance(viewer, str) or not viewer:
            raise InvalidUid("as= needs a uid")
        claims.public_key(viewer)
        votes, signers = self.truth.votes_of(group.rid, viewer)
        return merge.seen_by(group.record, votes, signers, viewer)

    def meta(self, text: str, viewer: str | None = None) -> dict[str, Any]:
        """GET /api/meta/{cid}: the merged document of the group holding any spelling of cid."""
        self.require_ready()
        asked, group = self._find(text, self.cache.group_by_cid)
        return cache.document(group, asked, self._seen_by(group, viewer))

    def meta_bytes(self, text: str) -> bytes:
        """GET /api/meta/{cid} without a viewer, as JSON bytes: the document the cache
        rendered when it wrote the record (one primary-key read), with the asked CID spliced
        in; the same bytes `meta` renders to. From memory if it is hot (`hot_documents`)."""
        self.require_ready()
        return self._answer_meta(text)

    def _render_meta(self, text: str) -> bytes:
        asked, rest = self._find(text, self.cache.rendered)
        return cache.splice(asked, rest)

    def active_rid(self, text: str) -> str:
        """The rid `text` names, if active; 404 `merged` (with the survivor) or `unknown_rid`."""
        rid = rids.parse(text)
        info = self.truth.rid_info(rid)
        if info is None:
            raise UnknownRid(f"no record is named {rid}")
        if info.status == "merged":
            survivor = self.truth.survivor(rid)
            raise Merged(f"{rid} was merged into {survivor}", survivor=survivor)
        return rid

    def metadata(self, text: str) -> dict[str, Any]:
        """GET /api/metadata/{rid}."""
        self.require_ready()
        rid = self.active_rid(text)
        group = self.cache.group_by_rid(rid)
        if group is None:
            raise CacheNotReady(f"{rid} is not in the cache yet; retry shortly")
        return {"hashId": rid, **cache.document(group, None)}

    def group_claims(self, rid: str, key: str | None, uid: str | None) -> dict[str, Any]:
        """The claims listing of a group: every live claim, all signers, optionally filtered
        (a `uid` that is none is `invalid_uid`, not an empty listing)."""
        if uid is not None:
            claims.public_key(uid)
        members, listed = self.truth.listing(rid, None if key is None else [key], uid)
        return {"rid": rid, "cids": cids.by_rank(members), "claims": [c.wire() for c in listed]}

    def meta_claims(self, text: str, key: str | None, uid: str | None) -> dict[str, Any]:
        _, rid = self._find(text, self.truth.group_of)
        return self.group_claims(rid, key, uid)

    def metadata_claims(self, text: str, key: str | None, uid: str | None) -> dict[str, Any]:
        return self.group_claims(self.active_rid(text), key, uid)

    # the MetaMesh routes' reads (compat.py): by rid, of the cache unless it says the truth

    async def list_rids(self) -> list[str]:
        """Every record's rid, in order, unpaginated (MetaMesh's `GET /meta`): read on a thread,
        so that a library's every rid holds no other request."""
        return await asyncio.to_thread(self.cache.all_rids)

    def record_rows(self, rid: str) -> dict[str, str]:
        """The merged record of `rid` (empty if the cache does not hold it yet)."""
        return self.cache.record_rows(rid)

    def record_value(self, rid: str, key: str) -> str | None:
        return self.cache.record_value(rid, key)

    def local_copies(self, rid: str) -> tuple[list[merge.LocalFile], str | None]:
        """The local files holding group `rid`'s content by path, and its `mimeType`."""
        return self.cache.local_copies(rid)

    def group_of(self, cid: str) -> str | None:
        """The truth's group of this exact CID spelling, or None."""
        return self.truth.group_of(cid)

    def group_cids(self, rid: str) -> list[str]:
        """The CIDs of group `rid`, as the truth holds them."""
        return self.truth.group_cids(rid)

    def survivor(self, rid: str) -> str:
        """The active rid `rid` is now part of (itself if active)."""
        return self.truth.survivor(rid)

    def live_claims(self, rid: str, keys: list[str] | None, uid: str) -> list[claims.Claim]:
        """`uid`'s live claims on `keys` (None: every key) over every CID of group `rid`."""
        return self.truth.group_claims(rid, keys=keys, uid=uid)

    def votes(self, rid: str) -> list[claims.Claim]:
        """Every live claim on group `rid`, over all its CIDs (the web page's provenance)."""
        return self.truth.group_claims(rid)

    def hash_ids(self, after: str | None, limit: int) -> dict[str, Any]:
        self.require_ready()
        start = rids.parse(after) if after else ""
        page = self.cache.hash_ids(start, limit)
        return {"hashIds": page, "next": page[-1] if len(page) == limit else None}

    def files(self, prefix: str, after: str | None, limit: int) -> dict[str, Any]:
        """GET /api/files: local files in path order, with their midhash and rid."""
        page = self.cache.files(prefix, after or "", limit)
        return {"files": page, "next": page[-1]["path"] if len(page) == limit else None}

    # the web page's reads (ui.py)

    async def subfolders(self, folder: str, after: str, limit: int) -> tuple[list[str], bool]:
        """The Files page's folders directly in `folder` that hold files: their names after
        `after`, at most `limit`, and whether there are more; read on a thread."""
        return await asyncio.to_thread(self.cache.subfolders, folder, after, limit)

    def library(
        self,
        text: str,
        kind: str,
        held: bool | None,
        limit: int,
        *,
        before: str | None = None,
        after: str | None = None,
        sidecars: bool = False,
    ) -> LibraryPage:
        """A page of `limit` records of the library, newest first: every record, or those
        matching words of their title or file name (the cache's full-text index), of one type,
        held in a local file or not (`held`); those below rid `before`, or just above rid
        `after`, or the newest. Subtitles, nfos and artwork only with `sidecars` or when `kind`
        names theirs (`labels.kind`).

        One row past the page says whether there is a page beyond it; the other way a page
        opened from a link has one unless what it held is gone, and one row there says so."""
        self.require_ready()

        def rows(bound: str, count: int, newer: bool) -> list[cache.LibraryRow]:
            return self.cache.library_page(
                text, kind, held, bound, count, sidecars=sidecars, newer=newer
            )

        if after:
            found = rows(rids.parse(after), limit + 1, True)
            shown = found[-limit:]
            newer, older = len(found) > limit, bool(shown and rows(shown[-1].rid, 1, False))
        else:
            found = rows(rids.parse(before) if before else cache.NEWEST, limit + 1, False)
            shown = found[:limit]
            newer = bool(before and shown and rows(shown[0].rid, 1, True))
            older = len(found) > limit
        return LibraryPage(shown, shown[-1].rid if older else None, shown[0].rid if newer else None)

    def library_types(self) -> list[str]:
        """The record types the library holds (its type filter)."""
        return self.cache.library_types()

    def duplicates(self, limit: int) -> list[tuple[str, list[str]]]:
        """Contents held at several local paths: (midhash, the paths)."""
        return self.cache.duplicates(limit)

    async def missing_files(self, after: str | None, limit: int) -> dict[str, Any]:
        """GET /api/files?missing=1: records that hold a midhash but no local file any more,
        read on a thread."""
        self.require_ready()
        page = await asyncio.to_thread(self.cache.missing, after or "", limit)
        return {"files": page, "next": page[-1]["midhash"] if len(page) == limit else None}

    async def metrics_text(self) -> bytes:
        """GET /metrics. The gauges that count rows (groups, merges, records, local files,
        plugin runs) are scans, 0.4 s together at 1M records, which on the event loop held
        every other request as long (docs/benchmarks.md, "/metrics off the event loop"): they
        are read on a thread, on connections of their own; the rest, cheap, on the loop."""
        statuses, counts = await asyncio.to_thread(self._scanned)
        self._measure_behind()
        return self.metrics.render(self._gauges(statuses, counts))

    def _scanned(self) -> tuple[dict[str, int], cache.ScrapeCounts]:
        return self.truth.rid_status_counts(), self.cache.scrape_counts()

    def _gauges(self, statuses: dict[str, int], counts: cache.ScrapeCounts) -> dict[str, Any]:
        """The scrape-time numbers of /metrics, from the scans' results and the node's state."""
        runs = {
            (plugin, status): n
            for (plugin, _version), by_status in counts.runs.items()
            for status, n in by_status.items()
        }
        health = self.health()
        return {
            "records": counts.records,
            "groups": statuses.get("active", 0),
            "merges": statuses.get("merged", 0),
            "apply_lag": health["apply_lag"],
            "health_problems": len(health["problems"]),
            "health_warnings": len(health["warnings"]),
            "peers": {
                name: (follower.lag_s(), bool(follower.failing()))
                for name, follower in self.peers.followers.items()
            },
            "replans": self.applier.state.replans,
            "watcher_queue": len(self.watcher.pending) if self.watcher else 0,
            "watcher_files": counts.local_files,
            "plugin_runs": runs,
        }

    async def plugins(self) -> dict[str, Any]:
        """GET /api/plugins: the running plugins, and those installed that do not run."""
        if self.plugin_host is None:
            return {"plugins": [], "not_loaded": []}
        weights = {s["uid"]: s["weight"] for s in self.signers()}
        return {
            "plugins": await self.plugin_host.describe(weights),
            "not_loaded": [asdict(each) for each in self._plugins_not_loaded],
        }

    async def retry_plugin(self, name: str) -> dict[str, Any]:
        """POST /api/plugins/{name}/retry: its failed and skipped runs queued again."""
        if self.plugin_host is None:
            why = "plugins_enabled is off" if not self.settings.plugins_enabled else "not leading"
            raise NotFoundError(f"no plugin runs in this process ({why})")
        if name not in self.plugin_host.runners:
            raise NotFoundError(
                plugins.not_running(
                    name,
                    sorted(self.plugin_host.runners),
                    self.settings.plugins_disabled,
                    self._plugins_not_loaded,
                )
            )
        retried = await self.plugin_host.retry(name)
        return {"name": name, "requeued": sum(retried), **retried._asdict()}

    @property
    def applies(self) -> bool:
        """Whether this process applies truth changes to the cache: a node on SQLite (not a
        reader worker), or the replica holding the applier lock on PostgreSQL."""
        if isinstance(self.applier, Replica):
            return self.applier.leading
        return not isinstance(self.applier, Follower)

    def health(self) -> dict[str, Any]:
        truth_seq = self.truth.max_seq()
        state = self.applier.state
        lag = max(0, truth_seq - state.applied_seq)
        problems = []
        if not self.applier.ready:
            problems.append("the cache is being built")
        if self.applier.degraded:
            problems.append("applying truth changes to the cache is failing")
        if why := self.applier.services_failing:
            problems.append(
                f"the node's services (watcher, plugins, peer pulls, retention) wait for the "
                f"database to start ({why})"
            )
        for store in (self.truth, self.cache):
            if store.failure is not None:
                problems.append(
                    f"writes to {store.path.name} are failing "
                    f"({store.failure.slug}: {store.failure.message})"
                )
        if lag and time.monotonic() - self.applier.progressed > STALL_S:
            problems.append(f"the cache has not caught up for {STALL_S:.0f} s")
        if (now := self.clock()) < claims.MIN_TS:
            problems.append(unset_clock(now))
        problems += self._service_problems()
        body: dict[str, Any] = {
            "status": "degraded" if problems else "ok",
            "problems": problems,
            "warnings": self._plugin_warnings(),
            "applied_seq": state.applied_seq,
            "truth_seq": truth_seq,
            "apply_lag": lag,
            "epoch": state.epoch,
            "cache_ready": self.applier.ready,
            "replans": state.replans,
            "rebuilding": state.rebuilding,
            "applier": self.applies,
            "writes": {store.path.name: self._backlog(store) for store in (self.truth, self.cache)},
        }
        if self.watcher is not None:
            body["watcher"] = {
                "roots": self.watcher.roots,
                "scanning": self.watcher.scanning,
                "scan": None if (scan := self.watcher.scan) is None else asdict(scan),
                "pending": len(self.watcher.pending),
                "unlisted": self.watcher.unlisted,
                "watches_full": self.watcher.watches_full,
                "not_utf8": self.not_utf8(),
            }
        return body

    def _plugin_warnings(self) -> list[str]:
        """What /health warns of the plugins, its status staying `ok`: an installed plugin
        that does not load (its package fails to import, a bad attribute) and one whose runs
        failed for good since the start. The node serves and the other plugins run, and a
        restart mends neither: `degraded` would fail the container's HEALTHCHECK, and a
        supervisor that restarts unhealthy containers would restart it for ever. Before, a
        plugin that did not load was in the log and `GET /api/plugins` alone, /health `ok`."""
        warnings = [
            f"plugin {each.entry_point} ({each.source}) does not load: {each.error}; mend or "
            "remove it, then restart the node (`metanode plugins list` lists it)"
            for each in self._plugins_not_loaded
        ]
        gave_up = self.plugin_host.gave_up if self.plugin_host is not None else {}
        warnings += [
            f"plugin {name}: {count} run(s) failed for good since the start (the newest "
            f"{why}); mend the plugin, restart the node, then `metanode plugins retry {name}`"
            for name, (count, why) in sorted(gave_up.items())
        ]
        return warnings

    def not_utf8(self) -> dict[str, Any]:
        """The names the watcher's last full reconciliation left out as not UTF-8
        (`ignores.is_text`): how many, and the first `NOT_UTF8_SHOWN`, for /health and the
        Files page."""
        names = self.watcher.not_text if self.watcher is not None else []
        return {"count": len(names), "paths": names[:NOT_UTF8_SHOWN]}

    @staticmethod
    def _backlog(store: truth.TruthStore | cache.CacheStore) -> dict[str, Any]:
        """/health's `writes` of one database: the transactions not yet committed and how long
        the oldest has waited, in seconds."""
        queued, waited = store.writer.backlog()
        return {"queued": queued, "waiting_s": round(waited, 3)}

    def _service_problems(self) -> list[str]:
        """What /health says of the plugin host, the watcher and the peers, where they run."""
        problems = []
        if self.plugin_host is not None:
            if self._plugins_task.done():
                problems.append("the plugin host has stopped")
            elif self.plugin_host.failing is not None:
                problems.append(f"plugin runs are held: {self.plugin_host.failing}")
        if self.watcher is not None:
            if self._watching.done() or time.monotonic() - self.watcher.heartbeat > STALL_S:
                problems.append("the watcher has stopped")
            if self.watcher.failing is not None:
                problems.append(f"{self.watcher.failing}; retrying")
            if self.watcher.watches_full:
                problems.append(self.watcher.watch_limit_problem())
            if self.watcher.out_of_files is not None:
                problems.append(self.watcher.out_of_files)
            if unlisted := self.watcher.unlisted:
                problems.append(
                    f"cannot read {len(unlisted)} watched folder(s) (a root missing is a disk "
                    f"not mounted?), their files kept as they were: {', '.join(unlisted[:3])}"
                )
        for name, follower in sorted(self.peers.followers.items()):  # once only in `peers list`
            if why := follower.failing():
                done = follower.task is not None and follower.task.done()
                state = "is not followed" if done else "failed its last pull (retrying)"
                problems.append(f"peer {name} {state}: {why}")
        return problems
