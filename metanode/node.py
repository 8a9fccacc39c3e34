"""The node: wires settings, databases, the applier and the operations the API and CLI call.

The only module that connects the pieces. Reads that the API makes run on the event loop with
read-only connections (microseconds each); writes go to the single writer thread of each
database; signature verification runs on a thread pool (PyNaCl releases the GIL).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from metanode import cache, claims, datadir, db, feed, merge, plugins, sse, truth, watcher
from metanode import cid as cids
from metanode import rid as rids
from metanode.bodies import refuse_unknown
from metanode.config import Settings
from metanode.errors import (
    BadSignature,
    CacheNotReady,
    InvalidBatch,
    InvalidRequest,
    InvalidUid,
    Merged,
    MetanodeError,
    TooLarge,
    UnknownCid,
    UnknownRid,
)
from metanode.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
STALL_S = 60.0  # /health reports degraded when the applier or the watcher stalls this long


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def ensure_token(path: Path) -> tuple[str, bool]:
    """The API token, created (mode 0600) on first start: (token, created now)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text(encoding="ascii").strip(), False
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token, True


def open_store(settings: Settings) -> None:
    """Create the data directory (or make an existing one private) and bring both schemas up
    to date."""
    datadir.secure(settings.data_dir)
    for path, migrations in ((settings.truth_path, truth.MIGRATIONS),
                             (settings.cache_path, cache.MIGRATIONS)):
        conn = db.connect(path)
        try:
            db.migrate(conn, migrations)
        finally:
            conn.close()


def cache_needs_build(state: cache.State, source: sqlite3.Connection) -> bool:
    """Whether only a rebuild can bring the cache in step with the truth: it was never built; it
    is ahead of the truth (the truth was restored from a backup); or it is behind the oldest
    outbox row still stored (an old copy of cache.db, after the rows it needs were pruned)."""
    newest = truth.max_seq(source)
    if state.epoch == 0 or state.applied_seq > newest:
        return True
    oldest = truth.min_seq(source)
    return state.applied_seq < newest and (oldest is None or oldest > state.applied_seq + 1)


class Applier:
    """Keeps cache.db in step with truth.db's outbox; wakes request handlers waiting for a seq."""

    def __init__(self, writer: db.Writer, truth_path: Path, poll_s: float) -> None:
        self._writer = writer
        # Used only inside the cache writer's jobs, i.e. only on that thread.
        self._source = db.connect(truth_path, readonly=True)
        self._poll_s = poll_s
        self._wake = asyncio.Event()
        self._published = asyncio.Event()  # set (and replaced) at every publish
        self.state = writer.run_sync(lambda conn: cache.read_state(conn))
        self.ready = False
        self.degraded = False
        self.progressed = time.monotonic()  # when applied_seq last moved, or nothing was due
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    @property
    def applied_seq(self) -> int:
        return self.state.applied_seq

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="applier")

    def wake(self) -> None:
        self._wake.set()

    async def _until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait until `done()` holds after a publish; False if `timeout` passed first.

        No lock: each publish sets the current event and replaces it, and a waiter only ever
        waits on an event. (An `asyncio.Condition` under `wait_for` on Python 3.11 could be left
        released by a non-holder when a subscriber's task was cancelled repeatedly, stalling
        every publisher and subscriber.) And `asyncio.timeout`, not `asyncio.wait_for`: on
        Python 3.11, wait_for can swallow a cancellation that arrives as the event is set, and
        a cancelled subscriber would then go on waiting and streaming.
        """
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):  # not wait_for: see the docstring
                    await self._published.wait()
        return True

    async def wait_for(self, seq: int, timeout: float) -> bool:
        """Wait until the cache has applied outbox `seq`; False if `timeout` passed first."""
        return await self._until(lambda: self.ready and self.applied_seq >= seq, timeout)

    async def wait_feed(self, position: int, epoch: int, timeout: float) -> bool:
        """Wait until the feed has an event after `position` (or a new epoch); False on timeout."""
        return await self._until(
            lambda: self.state.feed_seq > position or self.state.epoch != epoch, timeout)

    async def wait_files(self, position: int, epoch: int, timeout: float) -> bool:
        """`wait_feed` for the file events (`file_feed`)."""
        return await self._until(
            lambda: self.state.file_feed_seq > position or self.state.epoch != epoch, timeout)

    async def _run(self) -> None:
        await self._build_if_needed()
        backoff = 0.1
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                state = await self._writer.run(cache.apply_txn, self._source)
            except Exception:
                log.exception("applying truth changes to the cache failed; retrying")
                self.degraded = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                self._wake.set()
                continue
            self.degraded, backoff = False, 0.1
            await self._publish(state)

    async def _build_if_needed(self) -> None:
        if cache_needs_build(self.state, self._source):
            log.info("building the cache from the truth (outbox seq %d)",
                     truth.max_seq(self._source))
            self.state = await self._writer.run(cache.build_txn, self._source)
        self.ready = True
        await self._publish(self.state)

    async def _publish(self, state: cache.State) -> None:
        """Make a committed cache state visible; never step back (two transactions' answers may
        arrive out of order)."""
        mark = (state.epoch, state.feed_seq, state.applied_seq, state.file_feed_seq)
        if mark > (self.state.epoch, self.state.feed_seq, self.state.applied_seq,
                   self.state.file_feed_seq):
            self.state = state
        self.progressed = time.monotonic()
        published, self._published = self._published, asyncio.Event()
        published.set()

    async def apply_local(self, files: Sequence[merge.LocalFile], removals: Sequence[str]) -> None:
        """The watcher's results: local_file rows and local keys, in one cache transaction."""
        await self._publish(await self._writer.run(cache.local_txn, self._source, files, removals))

    async def stop(self) -> None:
        """Let the loop finish the apply it is in (its job holds `_source`) and end.

        A flag rather than a cancel: cancelling would leave the shielded job running on the
        writer thread while the connection it uses is closed under it.
        """
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), STALL_S)
            except TimeoutError:  # a build of a huge cache: the writer's close() waits for it
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def close(self) -> None:
        """Close the truth connection; only once the cache writer has drained every job."""
        self._source.close()


@dataclass(frozen=True)
class IngestAnswer:
    status: int
    body: dict[str, Any]


class Node:
    """One metanode: its data directory, databases, applier and operations."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limits = claims.Limits(settings.max_value_bytes, settings.max_skew_ms)
        self.policy = truth.Policy(settings.accept_unknown_signers)
        self.minter = rids.Minter()
        self.token = ""
        self.token_created = False
        self._verify_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=os.cpu_count() or 2, thread_name_prefix="verify")
        self.metrics = Metrics(self._gauges)
        self.subscribers = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        open_store(self.settings)
        self.token, self.token_created = ensure_token(self.settings.token_path)
        self.truth_writer = db.Writer(self.settings.truth_path, "truth")
        self.cache_writer = db.Writer(self.settings.cache_path, "cache")
        self.truth_reader = db.connect(self.settings.truth_path, readonly=True)
        self.cache_reader = db.connect(self.settings.cache_path, readonly=True)
        self.applier = Applier(self.cache_writer, self.settings.truth_path,
                               self.settings.apply_poll_s)
        self.feed_hub = feed.Hub(self.cache_reader, lambda: self.applier.state)
        self.file_hub = feed.Hub(self.cache_reader, lambda: self.applier.state,
                                 table=feed.FILE_FEED)
        self.applier.start()
        self._pruner = asyncio.create_task(self._retention(), name="retention")
        self.plugin_host: plugins.Host | None = None
        if self.settings.plugins_enabled:
            self.plugin_host = await self._start_plugins()
        self.watcher: watcher.Watcher | None = None
        if self.settings.watch_enabled:
            self.watcher = self._make_watcher(self.settings.watch_roots)
            self._watching = asyncio.create_task(self.watcher.run(), name="watcher")

    def _make_watcher(self, roots: Sequence[str]) -> watcher.Watcher:
        s = self.settings
        return watcher.Watcher(
            roots, watcher.Rules(s.watch_ignore, s.watch_follow_symlinks), s.watch_settle_s,
            s.watch_rescan_s, s.watch_hash_workers, self.ensure_groups, self.apply_local,
            lambda under: cache.local_stats(self.cache_reader, under))

    async def apply_local(self, files: Sequence[merge.LocalFile], removals: Sequence[str]) -> None:
        """The watcher's results reach the cache, then the plugins."""
        await self.applier.apply_local(files, removals)
        if self.plugin_host is not None:
            await self.plugin_host.files_changed(sorted({f.midhash for f in files}))

    async def _start_plugins(self) -> plugins.Host:
        """Discover plugins, register each as a signer with its own key, start the host."""
        s = self.settings
        weights = plugins.parse_weights(s.plugin_weights)
        runners = []
        for plugin in plugins.discover():
            if plugin.name in s.plugins_disabled:
                continue
            key = plugins.plugin_key(s.keys_dir, plugin.name)
            runner = plugins.Runner(plugin, key, self.record_of, self.ingest_wire,
                                    s.plugin_timeout_s)
            await self.truth_writer.run(
                truth.add_signer_txn, runner.uid, f"plugin:{plugin.name}",
                weights.get(plugin.name, plugin.weight), plugin.may_link, now_ms())
            runners.append(runner)
        host = plugins.Host(runners, self.cache_writer, self.cache_reader, s.plugin_workers,
                            s.plugin_max_attempts, s.plugin_retry_s)
        self._plugins_task = asyncio.create_task(host.run(), name="plugins")
        return host

    def record_of(self, cid: str) -> dict[str, str] | None:
        """A plugin's read of the merged metadata of any CID (never a rid); own connection,
        because plugins call it from their threads."""
        conn = db.connect(self.settings.cache_path, readonly=True)
        try:
            group = cache.group_by_cid(conn, cids.normalise(cid))
            return None if group is None else dict(sorted(group.record.items()))
        finally:
            conn.close()

    async def ensure_groups(self, midhashes: Sequence[str]) -> None:
        """Mint groups for midhashes the truth has not seen (the watcher, before `apply_local`)."""
        await self.truth_writer.run(truth.ensure_groups_txn, midhashes, self.minter, now_ms())
        self.applier.wake()

    async def scan(self, roots: Sequence[str],
                   progress: watcher.Progress | None = None) -> watcher.Summary:
        """`metanode scan`: one reconciliation of `roots`, without settling, then wait for the
        cache."""
        summary = await self._make_watcher(roots).reconcile(roots, settle=False,
                                                             progress=progress)
        await self._settled()
        return summary

    async def stop(self) -> None:
        """Stop watching, finish queued writes, stop the applier, close everything."""
        if self.watcher is not None:
            self.watcher.stop()
            await asyncio.gather(self._watching, return_exceptions=True)
        if self.plugin_host is not None:
            self._plugins_task.cancel()
            await asyncio.gather(self._plugins_task, return_exceptions=True)
        self._pruner.cancel()
        await asyncio.gather(self._pruner, return_exceptions=True)
        await asyncio.to_thread(self.truth_writer.close)
        await self.applier.stop()
        await asyncio.to_thread(self.cache_writer.close)
        self.applier.close()
        self.truth_reader.close()
        self.cache_reader.close()
        self._verify_pool.shutdown()

    async def _retention(self) -> None:
        """From start and then periodically: enforce feed retention, and drop the outbox rows
        the cache has applied."""
        keep = self.settings.feed_retention_events
        window_ms = int(self.settings.feed_retention_days * 86_400_000)
        while True:
            try:
                await self.cache_writer.run(cache.prune_feed_txn, keep, now_ms() - window_ms)
                if self.applier.ready:
                    await self.truth_writer.run(truth.prune_changes_txn,
                                                self.applier.applied_seq)
            except Exception:
                log.exception("retention failed; will retry")
            await asyncio.sleep(self.settings.feed_prune_s)

    # -- feed -----------------------------------------------------------------------------------

    def subscribe(self, cursor: str | None, snapshot: bool,
                  where: sse.Filter) -> AsyncIterator[bytes]:
        """A feed subscription from a `Last-Event-ID`/`?since=` cursor (SPEC §5)."""
        self.require_ready()
        subscription = feed.Subscription(
            self.feed_hub, self.settings.cache_path, lambda: self.applier.state,
            self.applier.wait_feed, sse.parse_cursor(cursor), snapshot, where,
            self.settings.feed_keep_alive_s)
        return self.counted(subscription.stream())

    def meta_feed(self) -> feed.Feed[feed.FeedRow]:
        """The feed table for streams of their own format (MetaMesh's `/api/events/meta`):
        the shared hub, and a snapshot of every record."""
        return feed.Feed(self.feed_hub, lambda: self.applier.state, self.applier.wait_feed,
                         lambda: feed.Reading(self.settings.cache_path, cache.records_in_order),
                         self.settings.feed_keep_alive_s)

    def files_feed(self) -> feed.Feed[feed.FileFeedRow]:
        """The file events (MetaMesh's `/api/events/files`): their shared hub, and a snapshot
        of every local file."""
        return feed.Feed(self.file_hub, lambda: self.applier.state, self.applier.wait_files,
                         lambda: feed.Reading(self.settings.cache_path,
                                              cache.local_files_in_order),
                         self.settings.feed_keep_alive_s)

    async def counted(self, stream: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """The stream, counted in `subscribers` while it is open; closed with this wrapper, so
        a client that leaves releases what the stream holds at once, not at garbage collection."""
        self.subscribers += 1
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    yield chunk
        finally:
            self.subscribers -= 1

    # -- ingest ---------------------------------------------------------------------------------

    def _batch_items(self, payload: object) -> list[object]:
        if not isinstance(payload, dict) or not isinstance(payload.get("claims"), list):
            raise InvalidRequest('the body must be {"claims": [wire claims…]}')
        refuse_unknown(payload, ("claims",))
        items: list[object] = payload["claims"]
        if len(items) > self.settings.max_batch_claims:
            raise TooLarge(f"{len(items)} claims; at most {self.settings.max_batch_claims} "
                           "per batch")
        return items

    async def _validate(self, items: list[object], now: int) -> list[claims.Claim]:
        """Validate every claim, signatures on the thread pool; all errors or all claims."""
        loop = asyncio.get_running_loop()
        step = max(1, -(-len(items) // (os.cpu_count() or 2)))
        parts = await asyncio.gather(*(
            loop.run_in_executor(self._verify_pool, claims.validate_items, items[i:i + step], i,
                                 now, self.limits)
            for i in range(0, len(items), step)))
        errors = [error for _, part_errors in parts for error in part_errors]
        if errors:
            raise InvalidBatch(errors)
        return [claim for part, _ in parts for claim in part]

    async def ingest(self, payload: object) -> IngestAnswer:
        """POST /api/claims: validate all, commit all in one transaction, wait for the cache."""
        started = time.perf_counter()
        try:
            answer = await self.ingest_wire(self._batch_items(payload))
        except InvalidBatch as exc:
            for item in exc.items:
                self.metrics.rejected.labels(item["error"]).inc()
            raise
        except MetanodeError as exc:
            self.metrics.rejected.labels(exc.slug).inc()
            raise
        self.metrics.ingest_seconds.observe(time.perf_counter() - started)
        for verdict in ("accepted", "duplicate", "stale"):
            self.metrics.claims.labels(verdict).inc(answer.body[verdict])
        return answer

    async def ingest_wire(self, items: list[object]) -> IngestAnswer:
        """A batch of wire claims through validation, the truth and the cache (plugins too)."""
        now = now_ms()
        batch = await self._validate(items, now)
        result = await self.truth_writer.run(truth.ingest_txn, batch, self.minter, self.policy,
                                             now)
        if self.settings.test_fault == "crash_after_truth_commit":
            os._exit(99)  # test-only: the crash window between truth commit and cache apply
        self.applier.wake()
        applied = await self.applier.wait_for(result.seq, self.settings.apply_wait_s)
        body: dict[str, Any] = {"results": [{"status": v} for v in result.verdicts]}
        for verdict in ("accepted", "duplicate", "stale"):
            body[verdict] = result.verdicts.count(verdict)
        body["applied"] = applied
        return IngestAnswer(200 if applied else 202, body)

    # -- signers --------------------------------------------------------------------------------

    async def _settled(self) -> None:
        """Wait (bounded) until the cache reflects the truth: read-your-writes for signer edits."""
        self.applier.wake()
        await self.applier.wait_for(truth.max_seq(self.truth_reader), self.settings.apply_wait_s)

    async def add_signer(self, uid: str, name: str, weight: int, may_link: bool) -> dict[str, Any]:
        claims.public_key(uid)
        row = await self.register_signer(uid, name, weight, may_link)
        await self._settled()
        return row.as_json()

    async def set_signer_status(self, uid: str, status: str) -> dict[str, Any]:
        row = await self.truth_writer.run(truth.set_signer_status_txn, uid, status, now_ms())
        await self._settled()
        return row.as_json()

    def signers(self) -> list[dict[str, Any]]:
        return [row.as_json() for row in truth.signers(self.truth_reader)]

    async def register_signer(self, uid: str, name: str, weight: int,
                              may_link: bool) -> truth.SignerRow:
        """Register (or re-weigh) a signer the node itself holds the key of, without waiting
        for the cache; the applier is woken, as a new weight re-merges what it signed."""
        row = await self.truth_writer.run(truth.add_signer_txn, uid, name, weight, may_link,
                                          now_ms())
        self.applier.wake()
        return row

    def newest_ts(self, uid: str) -> int:
        """The newest ts of any claim stored from `uid` (0: none)."""
        return truth.newest_ts(self.truth_reader, uid)

    # -- reads ----------------------------------------------------------------------------------

    def require_ready(self) -> None:
        """503 `cache_not_ready` until the cache has been built (reads need it)."""
        if not self.applier.ready:
            raise CacheNotReady("the cache is being built from the truth; retry shortly")

    def _find(self, text: str, lookup: Callable[[str], T | None]) -> tuple[str, T]:
        """(asked CID in canonical spelling, what `lookup` found for it), trying the alias
        spelling on a miss."""
        asked = cids.normalise(text)
        for candidate in cids.spellings(asked):
            found = lookup(candidate)
            if found is not None:
                return asked, found
        raise UnknownCid(f"no record holds {asked}")

    def resolve_cid(self, text: str) -> tuple[str, str]:
        """(asked CID in canonical spelling, the rid of the cached record holding it)."""
        return self._find(text, lambda cid: cache.lookup(self.cache_reader, cid))

    def _viewer_overrides(self, rid: str, viewer: str | None) -> dict[str, str]:
        """`?as=<uid>`: the viewer's own live votes, which win on their keys (SPEC §2.5 rule 4)."""
        if viewer is None:
            return {}
        if not isinstance(viewer, str) or not viewer:
            raise InvalidUid("as= needs a uid")
        claims.public_key(viewer)
        with db.snapshot(self.truth_reader):
            group = truth.survivor(self.truth_reader, rid)
            votes = truth.group_claims(self.truth_reader, group, uid=viewer)
            signers = truth.merge_signers(self.truth_reader)
        return merge.merge_record(votes, signers)

    def meta(self, text: str, viewer: str | None = None) -> dict[str, Any]:
        """GET /api/meta/{cid}: the merged document of the group holding any spelling of cid."""
        self.require_ready()
        asked, group = self._find(text, lambda cid: cache.group_by_cid(self.cache_reader, cid))
        return cache.document(group, asked, self._viewer_overrides(group.rid, viewer))

    def active_rid(self, text: str) -> str:
        """The rid `text` names, if active; 404 `merged` (with the survivor) or `unknown_rid`."""
        rid = rids.parse(text)
        info = truth.rid_info(self.truth_reader, rid)
        if info is None:
            raise UnknownRid(f"no record is named {rid}")
        if info.status == "merged":
            survivor = truth.survivor(self.truth_reader, rid)
            raise Merged(f"{rid} was merged into {survivor}", survivor=survivor)
        return rid

    def metadata(self, text: str) -> dict[str, Any]:
        """GET /api/metadata/{rid}."""
        self.require_ready()
        rid = self.active_rid(text)
        group = cache.group_by_rid(self.cache_reader, rid)
        if group is None:
            raise CacheNotReady(f"{rid} is not in the cache yet; retry shortly")
        return {"hashId": rid, **cache.document(group, None)}

    def group_claims(self, rid: str, key: str | None, uid: str | None) -> dict[str, Any]:
        """The claims listing of a group: every live claim, all signers, optionally filtered."""
        with db.snapshot(self.truth_reader):
            members = truth.group_cids(self.truth_reader, rid)
            listed = truth.group_claims(self.truth_reader, rid,
                                        keys=None if key is None else [key], uid=uid)
        return {"rid": rid, "cids": cids.by_rank(members), "claims": [c.wire() for c in listed]}

    def meta_claims(self, text: str, key: str | None, uid: str | None) -> dict[str, Any]:
        _, rid = self._find(text, lambda cid: truth.group_of(self.truth_reader, cid))
        return self.group_claims(rid, key, uid)

    def metadata_claims(self, text: str, key: str | None, uid: str | None) -> dict[str, Any]:
        return self.group_claims(self.active_rid(text), key, uid)

    # the MetaMesh routes' reads (compat.py): by rid, of the cache unless it says the truth

    def list_rids(self) -> list[str]:
        """Every record's rid, in order, unpaginated."""
        return cache.all_rids(self.cache_reader)

    def record_rows(self, rid: str) -> dict[str, str]:
        """The merged record of `rid` (empty if the cache does not hold it yet)."""
        return cache.record_rows(self.cache_reader, rid)  # one statement: one snapshot

    def record_value(self, rid: str, key: str) -> str | None:
        return cache.record_value(self.cache_reader, rid, key)

    def local_copies(self, rid: str) -> tuple[list[merge.LocalFile], str | None]:
        """The local files holding group `rid`'s content by path, and its `mimeType`."""
        return cache.local_copies(self.cache_reader, rid)

    def group_of(self, cid: str) -> str | None:
        """The truth's group of this exact CID spelling, or None."""
        return truth.group_of(self.truth_reader, cid)

    def group_cids(self, rid: str) -> list[str]:
        """The CIDs of group `rid`, as the truth holds them."""
        return truth.group_cids(self.truth_reader, rid)

    def survivor(self, rid: str) -> str:
        """The active rid `rid` is now part of (itself if active)."""
        return truth.survivor(self.truth_reader, rid)

    def live_claims(self, rid: str, keys: list[str], uid: str) -> list[claims.Claim]:
        """`uid`'s live claims on `keys` over every CID of group `rid`."""
        return truth.group_claims(self.truth_reader, rid, keys=keys, uid=uid)

    def hash_ids(self, after: str | None, limit: int) -> dict[str, Any]:
        self.require_ready()
        start = rids.parse(after) if after else ""
        page = cache.hash_ids(self.cache_reader, start, limit)
        return {"hashIds": page, "next": page[-1] if len(page) == limit else None}

    def files(self, prefix: str, after: str | None, limit: int) -> dict[str, Any]:
        """GET /api/files: local files in path order, with their midhash and rid."""
        page = cache.files(self.cache_reader, prefix, after or "", limit)
        return {"files": page, "next": page[-1]["path"] if len(page) == limit else None}

    def _gauges(self) -> dict[str, Any]:
        """The scrape-time numbers of /metrics."""
        statuses = dict(self.truth_reader.execute(
            "SELECT status, count(*) FROM rids GROUP BY status").fetchall())
        runs = {(plugin, status): n for (plugin, _version), counts
                in cache.run_counts(self.cache_reader).items() for status, n in counts.items()}
        return {
            "records": self.cache_reader.execute(
                "SELECT count(DISTINCT rid) FROM cid_index").fetchone()[0],
            "groups": statuses.get("active", 0), "merges": statuses.get("merged", 0),
            "apply_lag": self.health()["apply_lag"], "feed_subscribers": self.subscribers,
            "watcher_queue": len(self.watcher.pending) if self.watcher else 0,
            "watcher_files": self.cache_reader.execute(
                "SELECT count(*) FROM local_file").fetchone()[0],
            "plugin_runs": runs,
        }

    def plugins(self) -> list[dict[str, Any]]:
        return [] if self.plugin_host is None else self.plugin_host.describe()

    def health(self) -> dict[str, Any]:
        truth_seq = truth.max_seq(self.truth_reader)
        state = self.applier.state
        lag = max(0, truth_seq - state.applied_seq)
        problems = []
        if not self.applier.ready:
            problems.append("the cache is being built")
        if self.applier.degraded:
            problems.append("applying truth changes to the cache is failing")
        for writer in (self.truth_writer, self.cache_writer):
            if writer.failure is not None:
                problems.append(f"writes to {writer.path.name} are failing "
                                f"({writer.failure.slug}: {writer.failure.message})")
        if lag and time.monotonic() - self.applier.progressed > STALL_S:
            problems.append(f"the cache has not caught up for {STALL_S:.0f} s")
        body: dict[str, Any] = {
            "status": "degraded" if problems else "ok", "problems": problems,
            "applied_seq": state.applied_seq, "truth_seq": truth_seq, "apply_lag": lag,
            "epoch": state.epoch, "cache_ready": self.applier.ready}
        if self.watcher is not None:
            if self._watching.done() or time.monotonic() - self.watcher.heartbeat > STALL_S:
                problems.append("the watcher has stopped")
                body["status"] = "degraded"
            body["watcher"] = {"roots": self.watcher.roots, "scanning": self.watcher.scanning,
                               "pending": len(self.watcher.pending)}
        return body


def rebuild_cache(settings: Settings) -> cache.State:
    """`metanode rebuild-cache`: recompute cache.db from truth.db, keeping local files."""
    open_store(settings)
    conn = db.connect(settings.cache_path)
    source = db.connect(settings.truth_path, readonly=True)
    try:
        return db.run_txn(conn, cache.build_txn, source)
    finally:
        conn.close()
        source.close()


@dataclass(frozen=True)
class CheckReport:
    differences: list[str]
    bad_signatures: list[str]
    claims_checked: int

    @property
    def clean(self) -> bool:
        return not self.differences and not self.bad_signatures


def check(settings: Settings, scratch: Path) -> CheckReport:
    """`metanode check`: the live cache against a fresh rebuild, and every stored signature."""
    source = db.connect(settings.truth_path, readonly=True)
    live = db.connect(settings.cache_path, readonly=True)
    fresh = db.connect(scratch)
    try:
        db.migrate(fresh, cache.MIGRATIONS)
        with db.snapshot(live):
            rows = live.execute(
                "SELECT path, midhash, size, mtime_ns, ino FROM local_file").fetchall()
            applied = cache.read_state(live).applied_seq
        differences = []
        truth_seq = truth.max_seq(source)
        if applied != truth_seq:
            differences.append(f"cache applied seq {applied} != truth seq {truth_seq}")

        def build(conn: sqlite3.Connection) -> cache.State:
            conn.executemany("INSERT INTO local_file (path, midhash, size, mtime_ns, ino) "
                             "VALUES (?, ?, ?, ?, ?)", rows)
            return cache.build_txn(conn, source)

        db.run_txn(fresh, build)
        differences += cache.diff(live, fresh)
        bad, count = [], 0
        for claim in truth.all_claims(source):
            count += 1
            try:
                claims.verify(claim)
            except BadSignature:
                bad.append(f"{claim.uid} {claim.cid} {claim.key}")
        return CheckReport(differences, bad, count)
    finally:
        for conn in (source, live, fresh):
            conn.close()


def backup(settings: Settings, target: Path) -> Path:
    """`metanode backup DIR`: an online copy of truth.db (consistent while the node writes),
    checked, plus the node's keys. The cache is not backed up: it is rebuilt from the truth.
    Private like the data directory: a new TARGET is 0700, the copy 0600 (the keys keep theirs)."""
    target.mkdir(mode=datadir.DIR_MODE, parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    copy = target / f"truth-{stamp}.db"
    source = db.connect(settings.truth_path, readonly=True)
    os.close(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, datadir.FILE_MODE))
    dest = sqlite3.connect(copy)
    try:
        source.backup(dest)
        verdict = dest.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        dest.close()
        source.close()
    if verdict != "ok":
        raise RuntimeError(f"the backup {copy} failed its integrity check: {verdict}")
    if settings.keys_dir.is_dir():
        shutil.copytree(settings.keys_dir, target / f"keys-{stamp}")
    return copy


def export_claims(settings: Settings, uid: str | None) -> tuple[int, Iterator[dict[str, Any]]]:
    """Every stored claim (tombstones too) as wire dicts, optionally of one signer: (count, it)."""
    conn = db.connect(settings.truth_path, readonly=True)
    where, params = ("", ()) if uid is None else (" WHERE uid = ?", (uid,))
    total = int(conn.execute("SELECT count(*) FROM claims" + where, params).fetchone()[0])

    def rows() -> Iterator[dict[str, Any]]:
        try:
            with db.snapshot(conn):
                for claim in truth.all_claims(conn, uid):
                    yield claim.wire()
        finally:
            conn.close()

    return total, rows()


IMPORT_BATCH = 1000
IMPORT_ERRORS_KEPT = 100  # a file of 10 million bad claims must not fill memory with errors
Numbered = tuple[int, object]  # (where in its file, a wire claim): `jsonl.read`'s items


def _numbered_chunks(items: Iterable[Numbered]) -> Iterator[list[Numbered]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, IMPORT_BATCH)):
        yield chunk


def _placed(positions: Sequence[int], future: concurrent.futures.Future[
        tuple[list[claims.Claim], list[dict[str, Any]]]]
            ) -> tuple[list[tuple[int, claims.Claim]], list[dict[str, Any]]]:
    """A chunk's `validate_items` answer with file positions: `position` for `index`."""
    valid, errors = future.result()
    failed = {error["index"] for error in errors}
    kept = [p for i, p in enumerate(positions) if i not in failed]
    placed = [{"position": positions[e["index"]], **{k: v for k, v in e.items() if k != "index"}}
              for e in errors]
    return list(zip(kept, valid, strict=True)), placed


def _verified_chunks(items: Iterable[Numbered], limits: claims.Limits
                     ) -> Iterator[tuple[list[tuple[int, claims.Claim]], list[dict[str, Any]]]]:
    """The items verified `IMPORT_BATCH` at a time on a thread pool, in order: per chunk, the
    valid claims and the errors, each with its position. Only a few chunks are in flight, so
    memory stays flat however many items there are."""
    now, workers = now_ms(), os.cpu_count() or 2
    with concurrent.futures.ThreadPoolExecutor(workers, "import-verify") as pool:
        pending: collections.deque[tuple[list[int], concurrent.futures.Future[
            tuple[list[claims.Claim], list[dict[str, Any]]]]]] = collections.deque()
        for chunk in _numbered_chunks(items):
            wires = [wire for _, wire in chunk]
            pending.append(([p for p, _ in chunk],
                            pool.submit(claims.validate_items, wires, 0, now, limits)))
            if len(pending) > workers:
                yield _placed(*pending.popleft())
        while pending:
            yield _placed(*pending.popleft())


@contextlib.contextmanager
def _signer_rows(settings: Settings) -> Iterator[Callable[[str], truth.SignerRow | None]]:
    """Signer rows as the truth holds them now, cached. There are none without a truth.db: an
    import into a new data directory creates nothing until every claim has passed."""
    if not settings.truth_path.exists():
        yield lambda uid: None
        return
    open_store(settings)
    conn = db.connect(settings.truth_path, readonly=True)

    @functools.cache
    def row(uid: str) -> truth.SignerRow | None:
        return truth.signer(conn, uid)

    try:
        yield row
    finally:
        conn.close()


@dataclass
class ImportCheck:
    """What pass 1 of an import keeps of a file of any size: counts and the signers."""

    claims: int = 0
    signers: set[str] = field(default_factory=set)


def validate_import(items: Iterable[Numbered], settings: Settings, register_signers: bool,
                    progress: Callable[[int], None]) -> ImportCheck:
    """Pass 1 of `metanode import`: verify every claim, and its signer's policy against the
    truth as it is now, writing nothing. Raises `InvalidBatch` with the first
    `IMPORT_ERRORS_KEPT` failures (each with its `position`) and the count of all of them.
    With `register_signers`, unknown signers pass: they are registered (may link) first."""
    check, failed = ImportCheck(), 0
    errors: list[dict[str, Any]] = []
    limits = claims.Limits(settings.max_value_bytes, settings.max_skew_ms)
    policy = truth.Policy(settings.accept_unknown_signers)
    with _signer_rows(settings) as row_of:
        for valid, chunk_errors in _verified_chunks(items, limits):
            check.claims += len(valid) + len(chunk_errors)
            for position, claim in valid:
                check.signers.add(claim.uid)
                row = row_of(claim.uid)
                error = (None if row is None and register_signers
                         else truth.policy_error(row, claim, policy))
                if error is not None:
                    chunk_errors.append({"position": position, "error": error.slug,
                                         "message": error.message})
            chunk_errors.sort(key=lambda e: int(e["position"]))
            errors.extend(chunk_errors[:IMPORT_ERRORS_KEPT - len(errors)])
            failed += len(chunk_errors)
            progress(len(valid))
    if failed:
        raise InvalidBatch(errors, total=failed)
    return check


def import_claims(settings: Settings, items: Iterable[Numbered], check: ImportCheck,
                  register_signers: bool, progress: Callable[[int], None]) -> dict[str, int]:
    """Pass 2 of `metanode import`, after `validate_import` passed on the same items: ingest
    them through the normal transaction `IMPORT_BATCH` at a time, the cache brought up to date
    after each. `register_signers` trusts the file's signers (weight 1, may link); otherwise they
    must be registered already.

    The items are verified again as they are written (on the thread pool, beside the writes):
    the file is read a second time, and only what the writing pass verified may reach the
    truth. Should the file change between the passes, the import stops at the first claim that
    no longer verifies, with the (verified) claims before it written."""
    open_store(settings)
    policy = truth.Policy(settings.accept_unknown_signers)
    limits = claims.Limits(settings.max_value_bytes, settings.max_skew_ms)
    conn = db.connect(settings.truth_path)
    try:
        if register_signers:
            for uid in sorted(check.signers):
                if truth.signer(conn, uid) is None:
                    db.run_txn(conn, truth.add_signer_txn, uid, "imported", 1, True, now_ms())
        with cache_catcher(settings) as catch_up:
            return _ingest_chunks(conn, items, limits, policy, progress, catch_up)
    finally:
        conn.close()


def _ingest_chunks(conn: sqlite3.Connection, items: Iterable[Numbered], limits: claims.Limits,
                   policy: truth.Policy, progress: Callable[[int], None],
                   catch_up: Callable[[], cache.State]) -> dict[str, int]:
    """Pass 2's loop: per chunk, verify, ingest, count the verdicts and bring the cache up to
    date (memory stays flat: the cache never has more than a chunk's changes to apply)."""
    minter = rids.Minter()
    counts = {"accepted": 0, "duplicate": 0, "stale": 0}
    for valid, errors in _verified_chunks(items, limits):
        if errors:
            raise InvalidRequest(f"claim {errors[0]['position']} no longer verifies "
                                 f"({errors[0]['error']}): the file changed during the "
                                 "import; the claims before it were imported")
        batch = [claim for _, claim in valid]
        result = db.run_txn(conn, truth.ingest_txn, batch, minter, policy, now_ms())
        for verdict in result.verdicts:
            counts[verdict] += 1
        catch_up()
        progress(len(batch))
    return counts


@contextlib.contextmanager
def cache_catcher(settings: Settings) -> Iterator[Callable[[], cache.State]]:
    """A function applying the truth's outbox to the cache now (the CLI's writes, when no
    server runs), its connections open for as many calls as the block makes: a long import
    calls it after every chunk, so no one transaction holds a whole file's changes."""
    conn = db.connect(settings.cache_path)
    source = db.connect(settings.truth_path, readonly=True)

    def catch_up() -> cache.State:
        state = cache.read_state(conn)
        if cache_needs_build(state, source):
            return db.run_txn(conn, cache.build_txn, source)
        return db.run_txn(conn, cache.apply_txn, source)

    try:
        yield catch_up
    finally:
        conn.close()
        source.close()


def catch_up_cache(settings: Settings) -> cache.State:
    """Apply the truth's outbox to the cache now (the CLI's writes, when no server runs)."""
    with cache_catcher(settings) as catch_up:
        return catch_up()
