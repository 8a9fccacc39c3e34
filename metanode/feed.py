"""The change feed (SPEC §5): one shared reader of the feed table, and one subscription per client.

Delivery is a fan-out. The `Hub` reads each page of feed rows once, frames every event once, and
keeps the frames of recent pages in memory; every subscriber takes the frames after its own
position from there, as one chunk per page (one socket write, not one per event). A subscriber
that lags reads older pages through the same hub, so a slow one only lags: it never holds up
ingest or other subscribers, and never silently loses events. If the events it needs were pruned
(retention) or the cache was rebuilt (new epoch), it gets one `gap` event and a snapshot of every
current record, then `synced`, then the live tail. The snapshot is read in one read transaction
together with the feed seq it corresponds to, so the tail starts exactly after it: nothing lost,
nothing doubled.
"""

from __future__ import annotations

import sqlite3
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from metanode import cache, db, sse

PAGE = 500
CACHE_BYTES = 16 << 20  # frames of recent pages kept for the fan-out; oldest-used pages go first
WaitFeed = Callable[[int, int, float], Awaitable[bool]]


@dataclass(frozen=True)
class Row:
    """One feed event, framed once for every subscriber."""

    seq: int
    rid: str
    key: str
    frame: bytes


class Page:
    """Feed rows with seqs in (index × PAGE, (index + 1) × PAGE]: a dense run from `first`.

    Rows are only ever appended, so a `Slice` of a page stays valid while the page grows. A page
    whose run starts after the page's own start had its earlier rows pruned before it was read.
    """

    def __init__(self, index: int, first: int, rows: list[Row]) -> None:
        self.index = index
        self.first = first
        self.rows = rows
        self.size = sum(len(row.frame) for row in rows)
        self._joined: tuple[int, int, bytes] = (0, 0, b"")

    @property
    def upto(self) -> int:
        """The last seq read into this page."""
        return self.rows[-1].seq if self.rows else self.first - 1

    def extend(self, rows: list[Row]) -> None:
        self.rows.extend(rows)
        self.size += sum(len(row.frame) for row in rows)

    def joined(self, start: int, end: int) -> bytes:
        """The frames of rows[start:end] as one chunk; the last one is kept, since subscribers
        that keep up all ask for the same rows."""
        if self._joined[:2] != (start, end):
            self._joined = (start, end, b"".join(row.frame for row in self.rows[start:end]))
        return self._joined[2]


@dataclass(frozen=True)
class Slice:
    """The events of one page after a subscriber's position."""

    page: Page
    start: int
    end: int

    @property
    def last(self) -> int:
        return self.page.rows[self.end - 1].seq

    def frames(self, where: sse.Filter) -> bytes:
        """The frames that pass `where`, as one chunk (possibly empty)."""
        if where.everything:
            return self.page.joined(self.start, self.end)
        return b"".join(row.frame for row in self.page.rows[self.start:self.end]
                        if where.matches(row.rid, row.key))


class Hub:
    """The feed table, read once per page and shared by every subscriber of this process.

    Runs on the event loop with the node's read-only cache connection: a page read is one
    indexed range query, done once per published change rather than once per subscriber.
    Cached pages belong to `epoch`; a read that finds another epoch drops them all.
    """

    def __init__(self, reader: sqlite3.Connection, state: Callable[[], cache.State],
                 cache_bytes: int = CACHE_BYTES) -> None:
        self._reader = reader
        self._state = state
        self._cache_bytes = cache_bytes
        self._pages: OrderedDict[int, Page] = OrderedDict()
        self.epoch = state().epoch

    def oldest(self) -> int | None:
        """The oldest seq still stored, or None if the feed table is empty."""
        value: int | None = self._reader.execute("SELECT min(seq) FROM feed").fetchone()[0]
        return value

    def after(self, epoch: int, position: int) -> Slice | str | None:
        """The events of `epoch` after `position`, up to the end of their page.

        None when there are none yet; the reason for a `gap` (`unknown_epoch`, `too_old`) when
        they cannot be had any more.
        """
        published = self._state()
        if epoch == published.epoch == self.epoch and position >= published.feed_seq:
            return None  # caught up: no read at all, however many subscribers wake
        wanted = position + 1
        index = (wanted - 1) // PAGE
        page = self._pages.get(index) if epoch == self.epoch else None
        if page is None or page.upto < wanted:
            page = self._read(index)
            if epoch != self.epoch:
                return "unknown_epoch"
        self._pages.move_to_end(index)
        if wanted < page.first:
            return "too_old"
        if wanted > page.upto:
            return None
        return Slice(page, wanted - page.first, len(page.rows))

    def _read(self, index: int) -> Page:
        """Page `index` brought up to date from the database, its rows read in one transaction
        with the epoch they belong to."""
        while True:
            page = self._pages.get(index)
            after = index * PAGE if page is None else page.upto
            with db.snapshot(self._reader):
                stored = cache.read_state(self._reader)
                rows = [Row(seq, rid, key, sse.change(stored.epoch, seq, rid, op, key,
                                                      value).encode())
                        for seq, rid, op, key, value in self._reader.execute(
                            "SELECT seq, rid, op, key, value FROM feed WHERE seq > ? AND seq <= ?"
                            " ORDER BY seq", (after, (index + 1) * PAGE))]
            if stored.epoch == self.epoch:
                break
            self._pages.clear()
            self.epoch = stored.epoch
        dense = rows[0].seq == after + 1 if rows else stored.feed_seq <= after
        if page is not None and dense:
            page.extend(rows)
        else:  # new, or rows pruned since it was read: the run restarts at what is left
            head = min(stored.feed_seq, (index + 1) * PAGE)
            first = rows[0].seq if rows else max(after, head) + 1
            page = self._pages[index] = Page(index, first, rows)
        self._evict(keep=index)
        return page

    def _evict(self, keep: int) -> None:
        """Drop the least recently used pages beyond the memory bound (never `keep`)."""
        total = sum(page.size for page in self._pages.values())
        for index in list(self._pages):
            if total <= self._cache_bytes:
                return
            if index != keep:
                total -= self._pages.pop(index).size


class Snapshot:
    """An open read transaction over the records: `set` frames a page at a time, then the feed
    position they correspond to. Holds a connection until `close()`."""

    def __init__(self, cache_path: Path, where: sse.Filter) -> None:
        self._filter = where
        self._conn = db.connect(cache_path, readonly=True)
        try:
            self._conn.execute("BEGIN")
            self.state = cache.read_state(self._conn)
            self._rows = self._records()
        except BaseException:
            self._conn.close()
            raise

    def _records(self) -> sqlite3.Cursor:
        if self._filter.rids:
            wanted = sorted(self._filter.rids)
            return self._conn.execute(
                "SELECT rid, key, value FROM records WHERE rid IN "
                f"({','.join('?' * len(wanted))}) ORDER BY rid, key", wanted)
        return self._conn.execute("SELECT rid, key, value FROM records ORDER BY rid, key")

    async def page(self) -> bytes | None:
        """The next page's frames (possibly empty, if the filter passed none); None at the end.

        Fetched on a worker thread so a large cache never stalls the event loop.
        """
        rows = await db.off_loop(self._rows.fetchmany, PAGE)
        if not rows:
            return None
        return b"".join(sse.event("set", {"rid": rid, "key": key, "value": value}).encode()
                        for rid, key, value in rows if self._filter.matches(rid, key))

    def close(self) -> None:
        """End the read transaction and free the file: the cursor first, since a connection
        closed while a cursor still holds a statement keeps its file open until that cursor is
        garbage. (`page` never leaves a fetch running when it returns or is cancelled.)"""
        self._rows.close()
        self._conn.close()


class Subscription:
    """The event stream of one client connection, as chunks of whole SSE frames.

    One generator (`stream`) over a small state machine (`_next`), so that whatever stops the
    stream (the client leaving, cancellation, the server shutting down) runs its one `finally`
    and releases an open snapshot at once.
    """

    def __init__(self, hub: Hub, cache_path: Path, state: Callable[[], cache.State],
                 wait_feed: WaitFeed, cursor: sse.Cursor | None, snapshot: bool,
                 where: sse.Filter, keep_alive_s: float) -> None:
        self._hub = hub
        self._cache_path = cache_path
        self._state = state
        self._wait_feed = wait_feed
        self._cursor = cursor
        self._want_snapshot = snapshot
        self._filter = where
        self._keep_alive_s = keep_alive_s
        current = state()
        self.epoch, self.position = current.epoch, current.feed_seq
        self._snapshot: Snapshot | None = None
        self._replaying = False  # a usable cursor: `synced` once caught up
        self._quiet_since = time.monotonic()

    def _unusable(self, cursor: sse.Cursor) -> str | None:
        """Why a cursor cannot be resumed from, or None if every event after it is retained."""
        current = self._state()
        if cursor.epoch != current.epoch:
            return "unknown_epoch"
        if cursor.seq > current.feed_seq:
            return "future"
        oldest = self._hub.oldest()
        if cursor.seq < (current.feed_seq + 1 if oldest is None else oldest) - 1:
            return "too_old"
        return None

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """Replay, or gap + snapshot, or snapshot; then `synced` and the live tail."""
        try:
            first = self._begin()
            if first:
                yield first
            while True:
                if chunk := await self._next():
                    self._quiet_since = time.monotonic()
                    yield chunk
        finally:
            if self._snapshot is not None:
                self._snapshot.close()

    def _begin(self) -> bytes:
        cursor = self._cursor
        if cursor is not None:
            reason = self._unusable(cursor)
            if reason is None:
                self.position, self._replaying = cursor.seq, True
                return b""
            return self._gap(cursor.text, reason)
        if self._want_snapshot:
            self._snapshot = Snapshot(self._cache_path, self._filter)
        return b""

    def _gap(self, requested: str | None, reason: str) -> bytes:
        """The `gap` frame; the snapshot that must follow it is opened here."""
        self._replaying = False  # the snapshot ends in its own `synced`
        self._snapshot = Snapshot(self._cache_path, self._filter)
        return sse.event("gap", {"requested": requested, "reason": reason}).encode()

    def _synced(self) -> bytes:
        return sse.event("synced", {"id": sse.event_id(self.epoch, self.position)}).encode()

    async def _next(self) -> bytes:
        """The next chunk to send; empty when there was nothing for this client (yet)."""
        if self._snapshot is not None:
            return await self._snapshot_page(self._snapshot)
        got = self._hub.after(self.epoch, self.position)
        if isinstance(got, str):  # pruned while lagging, or the cache was rebuilt
            return self._gap(sse.event_id(self.epoch, self.position), got)
        if got is not None:
            self.position = got.last
            return got.frames(self._filter)
        if self._replaying:
            self._replaying = False
            return self._synced()
        remaining = self._quiet_since + self._keep_alive_s - time.monotonic()
        if remaining <= 0:  # silence for this client, though others' events may have flowed
            return sse.keep_alive().encode()
        await self._wait_feed(self.position, self.epoch, remaining)
        return b""

    async def _snapshot_page(self, snapshot: Snapshot) -> bytes:
        chunk = await snapshot.page()
        if chunk is not None:
            return chunk
        snapshot.close()
        self._snapshot = None
        self.epoch, self.position = snapshot.state.epoch, snapshot.state.feed_seq
        return self._synced()
