"""The applier: keeps cache.db in step with truth.db's outbox, and tells waiters when it has.

One asyncio task per node. It wakes on a write (or every `apply_poll_s`, for writes other
processes made), runs `CacheStore.apply` (on the cache's single writer thread, reading the truth
through `TruthStore.snapshot`), and publishes each committed cache state; request handlers
(read-your-writes) and feed subscribers wait on that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import mmap
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from metanode import cache, merge, truth
from metanode.errors import NotCommitted, StorageError
from metanode.view import Written

log = logging.getLogger(__name__)
HELD_MAX = 10_000  # ingests' `Written` kept for the next apply at most
# Bytes of hot documents kept at most, whatever their count: a group's document lists each of its
# CIDs twice, and they are kept by the CID as asked, so reading every CID of one group of 600
# kept 600 copies of an 80 KB document (50 MB; groups merged by peers' link votes reached 523
# CIDs in the peers soak). At ≈ 1 KB a document, `hot_documents`' 10,000 fit well within it.
HOT_BYTES = 16 * 1024 * 1024
STALL_S = 60.0  # /health reports degraded when the applier or the watcher stalls this long


def cache_needs_build(state: cache.State, source: truth.TruthStore) -> bool:
    """Whether only a rebuild can bring the cache in step with the truth: it was never built; it
    may have lost commits to a restart of the machine (`cache.CacheStore`'s relaxed commits);
    it is ahead of the truth (the truth was restored from a backup); or it is behind the
    oldest outbox row still stored (an old copy of cache.db, after the rows it needs were
    pruned)."""
    newest = source.max_seq()
    if state.epoch == 0 or state.lost or state.applied_seq > newest:
        return True
    oldest = source.min_seq()
    return state.applied_seq < newest and (oldest is None or oldest > state.applied_seq + 1)


COUNT = struct.Struct("<Q")
PUBLISHED_NAME = "published"  # in the data directory, under `serve --workers N`: `PublishedCount`


class PublishedCount:
    """A counter in a small file every worker of `serve --workers N` maps into memory: the
    owner bumps it as it publishes a cache state in which cache.db changed, before any waiter
    wakes (`HotDocuments.published`), and a reader's hot documents compare it at every read
    instead of asking SQLite (`PRAGMA data_version` is a read transaction of its own, the WAL
    lock's two `fcntl` with it: most of what a hit saves; benchmarks.md, "Session 25"). Only
    ever counts up, from what the file holds, so a restarted owner never brings it back to a
    value a reader saw before its documents went old. Whoever opens it first creates it, its
    block allocated (`posix_fallocate`, not `ftruncate`'s hole): a store through the map into a
    hole the full disk has no block for is SIGBUS, where this is a `storage_full` at start."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, COUNT.size)
            self._map = mmap.mmap(fd, COUNT.size)
        finally:
            os.close(fd)

    def read(self) -> int:
        return int(COUNT.unpack_from(self._map)[0])

    def bump(self) -> None:
        COUNT.pack_into(self._map, 0, self.read() + 1)


class HotDocuments:
    """The `hot_documents` setting: the most recently answered `GET /api/meta` documents (the
    bytes `load` answers, by the CID text as asked) kept in this process's memory, so a read of
    a hot one skips the CID's parse, its cache.db lookup and the splice. What `load` raises (an
    unknown or invalid CID) is not kept: junk CIDs cannot push the hot ones out.

    Emptied whole whenever cache.db changed, which `version` (its `PRAGMA data_version` on the
    loop connection) tells: moved by every commit of another connection, the cache writer's
    included. The applier asks in the step that publishes a state (`published`), before any
    waiter wakes, so the answer to a write is never followed by an old document; a publish
    with nothing committed (the applier's idle poll) keeps them. A reader worker asks at every
    read too (`every_read`), its `version` the owner's `PublishedCount`: the owner's commit
    reaches this process's reads before its `Follower` polls. Emptied whole rather than by
    CID: a follower does not know which CIDs the owner's commit touched, and a hot document is
    read back at its next miss. At most `size` documents and `HOT_BYTES` bytes are kept, the
    least recently read given up first."""

    def __init__(
        self,
        load: Callable[[str], bytes],
        size: int,
        version: Callable[[], int],
        every_read: bool,
        changed: Callable[[], None] | None = None,
    ) -> None:
        self._load = load
        self._size = size
        self._kept: OrderedDict[str, bytes] = OrderedDict()  # the least recently read first
        self._bytes = 0  # of the documents kept
        self._version = version
        self._every_read = every_read
        self._changed = changed
        self._seen: int | None = None

    def __call__(self, cid: str) -> bytes:
        if self._every_read:
            self.published()
        found = self._kept.get(cid)
        if found is not None:
            self._kept.move_to_end(cid)
            return found
        found = self._load(cid)  # what it raises is not kept
        self._keep(cid, found)
        return found

    def _keep(self, cid: str, document: bytes) -> None:
        """Keep `document`, giving up the least recently read ones over `size` or `HOT_BYTES`."""
        self._kept[cid] = document
        self._bytes += len(document)
        while len(self._kept) > self._size or self._bytes > HOT_BYTES:
            _, given_up = self._kept.popitem(last=False)
            self._bytes -= len(given_up)

    def published(self) -> None:
        """Empty them if cache.db changed since they were last checked (and then call
        `changed`: the owner's bump of the readers' `PublishedCount`)."""
        seen = self._version()
        if seen != self._seen:
            self._seen = seen
            self._kept.clear()
            self._bytes = 0
            if self._changed is not None:
                self._changed()


def _nothing() -> None:
    """An applier's `on_applied_ahead` until the node gives it its counter."""


class Applier:
    """Keeps cache.db in step with truth.db's outbox; wakes request handlers waiting for a seq;
    at each publish, empties the hot documents (if any) if cache.db changed."""

    def __init__(
        self,
        store: cache.CacheStore,
        source: truth.TruthStore,
        poll_s: float,
        documents: HotDocuments | None = None,
    ) -> None:
        self._store = store
        self._source = source
        self._poll_s = poll_s
        self._documents = documents
        self._wake = asyncio.Event()
        self._published = asyncio.Event()  # set (and replaced) at every publish
        self.state = store.state()
        self.ready = False
        self.degraded = False
        # why the node's services (`Replica`'s `lead`) could not be started yet, or None
        self.services_failing: str | None = None
        self.progressed = time.monotonic()  # when applied_seq last moved, or nothing was due
        self._written: list[Written] = []  # handed by ingests, not yet applied
        self._ahead_upto = 0  # the newest outbox seq an apply ahead was queued for
        # told of each group of ingests applied ahead of its COMMIT (the node's /metrics counter)
        self.on_applied_ahead: Callable[[], None] = _nothing
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    @property
    def applied_seq(self) -> int:
        return self.state.applied_seq

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="applier")

    def wake(self) -> None:
        self._wake.set()

    def hand(self, result: truth.IngestResult) -> None:
        """What an ingest transaction wrote, so the next apply need not read it back from the
        truth; then wake. (A restart has none of it and reads the outbox, as ever.) Nothing,
        if an apply ahead of its COMMIT took it already (`apply_ahead`)."""
        if result.seq <= self._ahead_upto:
            return
        if len(self._written) >= HELD_MAX:  # applies keep failing: read back when they work
            self._written.clear()
        if result.written.changes:
            self._written.append(result.written)
        self.wake()

    def apply_ahead(self, written: Sequence[Written], committed: Callable[[], None]) -> None:
        """On the truth writer's thread, before the COMMIT of a group of ingests (what they
        wrote: `TruthStore.on_written`): queue the cache's apply of it at once
        (`CacheStore.apply_ahead`), so it runs while that COMMIT's fsync does and commits right
        after it, with no turn of the event loop between the two transactions; its state is
        published as it commits (`_applied_ahead`). Not before the cache is ready (its build
        comes first), nor once stopping; a failure is left to the next apply, which reads the
        outbox back (docs/architecture.md, "The apply path")."""
        if not self.ready or self._stopping or self._loop is None:
            return
        loop = self._loop
        future = self._store.apply_ahead(self._source, written, committed)
        self._ahead_upto = max(self._ahead_upto, max(w.last for w in written))
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._applied_ahead, done))

    def _applied_ahead(self, done: concurrent.futures.Future[cache.State]) -> None:
        exc = done.exception()
        if exc is None:
            state = done.result()
            self._written = [w for w in self._written if w.last > state.applied_seq]
            self.on_applied_ahead()
            self._publish(state)
            return
        if not isinstance(exc, NotCommitted):
            log.warning("applying a group ahead of its COMMIT failed (%s); reading it back", exc)
        self.wake()

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

    async def wait_replanned(self, seq: int, timeout: float) -> bool:
        """`wait_for`, and until no signer's replan is under way (`cache.replan_step`)."""
        return await self._until(
            lambda: self.ready and self.applied_seq >= seq and not self.state.replans, timeout
        )

    async def wait_feed(self, position: int, epoch: int, timeout: float) -> bool:
        """Wait until the feed has an event after `position` (or a new epoch); False on timeout."""
        return await self._until(
            lambda: self.state.feed_seq > position or self.state.epoch != epoch, timeout
        )

    async def wait_files(self, position: int, epoch: int, timeout: float) -> bool:
        """`wait_feed` for the file events (`file_feed`)."""
        return await self._until(
            lambda: self.state.file_feed_seq > position or self.state.epoch != epoch, timeout
        )

    async def _run(self) -> None:
        await self._retrying(self._build_if_needed, "building the cache from the truth")
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._ending():
                return
            await self._retrying(self._apply, "applying truth changes to the cache")

    def _ending(self) -> bool:
        """Whether the apply loop ends: the applier stops."""
        return self._stopping

    async def _retrying(self, step: Callable[[], Awaitable[None]], what: str) -> None:
        """Run `step` until it succeeds (or the applier stops): `degraded` meanwhile (so
        `/health` says so), with a backoff of 0.1 s doubling to 10 s; one line per retry (a
        full disk fails every retry), the first with its traceback unless the failure is the
        storage's (a full disk, a read-only mount: expected, its typed error says it all)."""
        backoff = 0.1
        while not self._ending():
            try:
                await step()
            except Exception as exc:
                if self.degraded:
                    log.warning("%s still fails (%s); retrying in %.1f s", what, exc, backoff)
                elif isinstance(exc, StorageError):
                    log.warning("%s failed (%s: %s); retrying", what, exc.slug, exc.message)
                else:
                    log.exception("%s failed; retrying", what)
                self.degraded = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            self.degraded = False
            return

    async def _apply(self) -> None:
        """Apply what is due and take a replan step (`_publish` brings the loop straight back
        while one is under way; the writes queued meanwhile are applied between two steps)."""
        state = await self._store.apply(self._source, tuple(self._written))
        self._written = [w for w in self._written if w.last > state.applied_seq]
        self._publish(state)

    async def _build_if_needed(self) -> None:
        if cache_needs_build(self.state, self._source):
            if self.state.lost:
                log.warning(
                    "the machine restarted while metanode ran: the cache's last commits may "
                    "be lost, so it is rebuilt (a new feed epoch)"
                )
            if self.state.epoch == 0 and not self._source.max_seq():  # a new node's first start
                log.info("making the cache (first start)")
            elif self.state.epoch == 0:  # a truth without its cache: restored, or cache.db gone
                seq = self._source.max_seq()
                log.info("making the cache from the truth (outbox seq %d): there was none", seq)
            else:
                seq = self._source.max_seq()
                log.info("building the cache again from the truth (outbox seq %d)", seq)
            self.state = await self._store.build(self._source)
        elif behind := self._source.max_seq() - self.state.applied_seq:  # a stop before applying
            log.info("the cache is %d truth change(s) behind: applying them", behind)
        self.ready = True
        self._publish(self.state)

    def started(self, state: cache.State) -> None:
        """Publish the state a rebuild in place started in (`cache.start_rebuild_txn`): its
        steps begin, and /health says `rebuilding` from now on."""
        self._publish(state)

    def _publish(self, state: cache.State) -> None:
        """Make a committed cache state visible; never step back (two transactions' answers may
        arrive out of order)."""
        if state.mark > self.state.mark:
            self.state = state
        if state.replans or state.rebuilding:  # whichever apply started it: take the steps
            self.wake()
        if self._documents is not None:
            self._documents.published()
        self.progressed = time.monotonic()
        published, self._published = self._published, asyncio.Event()
        published.set()

    async def apply_local(self, files: Sequence[merge.LocalFile], removals: Sequence[str]) -> None:
        """The watcher's results: local_file rows and local keys, in one cache transaction."""
        self._publish(await self._store.apply_local(self._source, files, removals))

    async def stop(self) -> None:
        """Let the loop finish the apply it is in (its job reads a truth snapshot) and end.

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


FOLLOW_POLL_S = 0.02  # how often a follower looks for another process's commits


class Follower(Applier):
    """An applier that applies nothing: in a reader worker of `metanode serve --workers N`
    (workers.py), it watches the cache that the owner worker's applier writes and publishes
    each state it sees, so this process's feed hubs and waiters move as the owner's do.

    It polls `PRAGMA data_version` (`CacheStore.data_version`, a counter of other connections'
    commits: about a microsecond, on the loop) every `FOLLOW_POLL_S` and reads the state only
    when it moved. Nothing is handed to it (the owner's ingests hand their writes to the
    owner's applier).
    """

    async def _run(self) -> None:
        await self._follow(_never)

    def apply_ahead(self, written: Sequence[Written], committed: Callable[[], None]) -> None:
        """Nothing: a follower applies nothing; nor does a PostgreSQL replica apply ahead of
        the truth's COMMIT, where other replicas' transactions commit beside its own (it
        applies after the COMMIT, as `Applier._apply` does)."""

    async def _follow(self, leave: Callable[[], Awaitable[bool]]) -> None:
        """Publish each cache state another process commits, until stopped or `leave()` (asked
        every turn) says to stop following."""
        seen, failing = -1, False
        while not self._stopping and not await leave():
            try:
                version = self._store.data_version()
                if version != seen:
                    seen = version
                    state = self._store.state()
                    self.ready = state.epoch != 0
                    self._publish(state)
                if failing:
                    log.info("following the cache works again")
                self.degraded = failing = False
            except Exception as exc:  # said once, when it begins, not every FOLLOW_POLL_S
                if failing:
                    pass
                elif isinstance(exc, StorageError):  # the database away: its words say it all
                    log.warning(
                        "following the cache failed (%s: %s); retrying", exc.slug, exc.message
                    )
                else:
                    log.exception("following the cache failed; retrying")
                self.degraded = failing = True
            await asyncio.sleep(FOLLOW_POLL_S)


async def _never() -> bool:
    return False


LEAD_TRY_S = 0.5  # how often a following replica tries the applier lock, and the leader checks it
# A leader whose lock session has sent nothing for this long (it checks it every LEAD_TRY_S) is
# a process that does not run (SIGSTOP, a frozen host): a follower ends its session and leads.
LEAD_STALE_S = 10.0
# A leader applies only while it saw its lock held this recently: one that resumes after being
# stopped longer checks its lock (and steps down if it was taken) before it writes the cache.
LEAD_FRESH_S = 4 * LEAD_TRY_S


class Replica(Follower):
    """The applier of one replica of several `metanode serve` sharing a PostgreSQL database
    (docs/scale-out.md, "Replicas"): exactly one of them applies at a time.

    Each replica tries a session-level advisory lock (`CacheStore.applier_lock`, a connection
    of its own) every `LEAD_TRY_S`, following meanwhile as a `Follower` does (on PostgreSQL,
    `data_version` is a hash of the current snapshot, which moves at every commit). The one
    that gets it builds the cache if need be, starts the node's single services (`lead`:
    retention, peer pulls, plugins, the watcher) and applies, as `Applier` does; besides its
    own ingests' wake-ups it polls the truth's newest outbox seq every `FOLLOW_POLL_S`, which
    is how the claims other replicas commit wake it. When its process dies, its session ends
    and the lock frees; the next replica to try it takes over from the cache state stored.

    A leader whose lock session was cut (a restart of the server, a network cut) takes the
    lock again; if another replica took it meanwhile, it steps down (`unlead`: its services
    stop) and follows again, so two replicas never run the watcher, the plugins or the peer
    pulls at once. Two appliers for the moment between would cost only work: each apply reads
    `applied_seq` inside its cache transaction, and the cache's write transactions serialise
    on their own lock, so the second applies nothing twice.
    """

    def __init__(
        self,
        store: cache.CacheStore,
        source: truth.TruthStore,
        poll_s: float,
        lead: Callable[[], Awaitable[None]],
        unlead: Callable[[], Awaitable[None]],
        documents: HotDocuments | None = None,
    ) -> None:
        super().__init__(store, source, poll_s, documents)
        lock = store.applier_lock()
        assert lock is not None, "replicas share a PostgreSQL cache"
        self._lock = lock
        self._lead = lead
        self._unlead = unlead
        self.leading = False
        self._lost = False  # another replica holds the lock now: step down
        self._retiring = False  # the node stops: never lead again (`retire`)
        self._tried = 0.0
        self._trying_fails = False
        self._watching: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None  # `_start_services`
        self._confirmed = 0.0  # when the lock was last seen held (`_watch_truth`)
        self._held_back = False  # an apply waits for the lock to be seen held (`_apply`)

    def hand(self, result: truth.IngestResult) -> None:
        """Kept only by the leader: a follower's ingests are applied by another process (which
        reads them back from the outbox)."""
        if self.leading:
            super().hand(result)

    async def _run(self) -> None:
        """Follow until this replica takes the lock, lead until it is lost to another, then
        follow again."""
        while not self._stopping:
            await self._follow(self._took_lead)
            if self._stopping:
                return
            await self._leading()
            if self._stopping:
                return
            self._lost = False
            log.warning(
                "another replica took the applier lock: this one stops applying and its "
                "services (watcher, plugins, peer pulls), and follows"
            )
            await self._watched_stop()
            await self._unlead()
            self.leading = False  # only now: its services are stopped

    async def _leading(self) -> None:
        """Start the node's services and apply, until this replica stops or loses the lock."""
        self.leading = True
        self._confirmed = time.monotonic()
        log.info("this replica holds the applier lock: it applies and runs the node's services")
        self._watching = asyncio.create_task(self._watch_truth(), name="applier-poll")
        self._starting = asyncio.create_task(self._start_services(), name="services-start")
        await Applier._run(self)

    async def _start_services(self) -> None:
        """`lead()`, again until it works if the database fails it, beside the applying (which
        must not wait for them): a replica takes the lock when the previous applier's session
        ended, often in an outage or a restart of the server, and the services' start reads
        and writes the truth (the plugins' signers, the peers). What a failed start began is
        stopped (`unlead`), and it is tried again after 0.5 s, doubling to 10 s,
        `services_failing` saying why in /health meanwhile. Such a replica used to apply
        without its watcher, plugins, peer pulls and retention until it was restarted, its
        /health `ok`. Any other failure is a bug: said with its traceback, and the replica
        applies without them."""
        backoff = 0.5
        while not (self._ending() or self._retiring):  # retiring: the node stops them itself
            try:
                await self._lead()
            except StorageError as exc:
                if self.services_failing is None:
                    log.warning(
                        "starting the node's services failed (%s: %s); trying again until "
                        "they start",
                        exc.slug,
                        exc.message,
                    )
                self.services_failing = f"{exc.slug}: {exc.message}"
                await self._unlead()
                await self._pause(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            except Exception:  # a service that would not start must not stop the applying too
                log.exception("starting the node's services failed; applying without them")
            if self.services_failing is not None:
                log.info("the node's services started")
            self.services_failing = None
            return

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less if the replica stops or loses the lock meanwhile."""
        until = time.monotonic() + seconds
        while not (self._ending() or self._retiring) and (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.1))

    def _ending(self) -> bool:
        return self._stopping or self._lost

    async def _apply(self) -> None:
        """Apply, if the lock was seen held within `LEAD_FRESH_S`. A leader stopped for longer
        (SIGSTOP, a frozen host) may have lost the lock to a follower meanwhile
        (`LEAD_STALE_S`); when it runs again, its apply loop may come before its check of the
        lock, so the apply waits for that check (`_watch_truth`, within `LEAD_TRY_S`), which
        either sees the lock still held or steps this replica down: it never applies as a
        second applier. (Two would still be correct, the cache's write lock serialising them,
        only wasteful.)"""
        if time.monotonic() - self._confirmed > LEAD_FRESH_S:
            self._held_back = True  # `_watch_truth` wakes the loop again after its check
            return
        await super()._apply()

    async def _watched_stop(self) -> None:
        """Stop watching the truth and the lock (`_watch_truth`), and starting the services
        (`_start_services`: the caller stops what it started)."""
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
            self._starting = None
        self.services_failing = None  # a follower runs none
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
            self._watching = None

    def retire(self) -> None:
        """Never take the lead again: the node stops its services (`Node.stop`), which a lead
        taken meanwhile would start again, with nothing left to stop them."""
        self._retiring = True
        if self._starting is not None:  # a start under way or waiting to be tried again
            self._starting.cancel()

    async def _took_lead(self) -> bool:
        """Try the lock, at most every `LEAD_TRY_S`; whether this replica holds it now."""
        if self._retiring or time.monotonic() - self._tried < LEAD_TRY_S:
            return False
        self._tried = time.monotonic()
        try:
            taken = await asyncio.to_thread(self._lock.acquire)
            if not taken:
                self._say_ended(await asyncio.to_thread(self._lock.end_stale, LEAD_STALE_S))
        except Exception as exc:  # the server is away: keep following, try again later
            if not self._trying_fails:  # said once, not twice a second for the whole outage
                log.warning("trying the applier lock failed (%s); will retry", exc)
            self._trying_fails = True
            return False
        if self._trying_fails:
            log.info("the applier lock can be tried again")
        self._trying_fails = False
        return taken

    @staticmethod
    def _say_ended(sessions: list[str]) -> None:
        for session in sessions:
            log.warning(
                "the applier lock's holder has not checked its session for %s: its process "
                "is stopped or cut off; its session was ended and this replica takes the lock",
                session,
            )

    async def _watch_truth(self) -> None:
        """Wake the apply when the truth's outbox moved past what was applied (other replicas'
        ingests), and take the lock again if its session was lost (a cut connection): if
        another replica holds it by then, this one steps down (`_lost`).

        Each failure is said once, when it starts (the server is away: the apply reports it
        in /health): the poll's and the lock's apart, so that a poll that works while the lock
        cannot be taken again (the server full, `max_connections`) did not say both again
        every `LEAD_TRY_S`, 1,300 lines each in 12 minutes."""
        checked, failing = time.monotonic(), False
        retaking, retake_fails = False, False  # the session was lost; taking the lock failed
        while not self._stopping:
            try:
                if await asyncio.to_thread(self._source.max_seq_apart) > self.state.applied_seq:
                    self.wake()
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("polling the truth failed (%s); will retry", exc)
                failing = True
            if time.monotonic() - checked >= LEAD_TRY_S:
                checked = time.monotonic()
                try:
                    if not retaking and not await asyncio.to_thread(self._lock.held):
                        log.warning("the applier lock's session was lost; taking it again")
                        retaking = True
                    if retaking:
                        taken = await asyncio.to_thread(self._lock.acquire)
                        if retake_fails:
                            log.info("the applier lock can be tried again")
                        retaking = retake_fails = False
                        if not taken:
                            self._lost = True
                            self.wake()
                            return
                    self._confirmed = time.monotonic()
                    if self._held_back:  # an apply held back for want of this check goes on
                        self._held_back = False
                        self.wake()
                except Exception as exc:  # the server is away: try again at the next turn
                    if not retake_fails:
                        log.warning("taking the applier lock again failed (%s); will retry", exc)
                    retake_fails = True
            await asyncio.sleep(FOLLOW_POLL_S)

    async def stop(self) -> None:
        """Stop applying (or following), then end the lock's session: the lock frees for the
        next replica only after the last apply committed."""
        await super().stop()
        await self._watched_stop()
        await asyncio.to_thread(self._lock.close)
