"""One subscriber of the change feed: replay, gap + snapshot, then live (SPEC §5).

Every subscriber reads the cache's `feed` table by seq at its own pace, so a slow one only lags:
it never holds up ingest or other subscribers, and never silently loses events. If the events it
needs were pruned (retention) or the cache was rebuilt (new epoch), it gets one `gap` event and a
snapshot of every current record, then `synced`, then the live tail. The snapshot is read in one
read transaction together with the feed seq it corresponds to, so the tail starts exactly after
it: nothing lost, nothing doubled.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from sse_starlette import ServerSentEvent

from metanode import cache, db, sse

PAGE = 500
WaitFeed = Callable[[int, int, float], Awaitable[bool]]


class Subscription:
    """The event stream of one client connection."""

    def __init__(self, reader: sqlite3.Connection, cache_path: Path,
                 state: Callable[[], cache.State], wait_feed: WaitFeed,
                 cursor: sse.Cursor | None, snapshot: bool, where: sse.Filter,
                 keep_alive_s: float) -> None:
        self._reader = reader
        self._cache_path = cache_path
        self._state = state
        self._wait_feed = wait_feed
        self._cursor = cursor
        self._want_snapshot = snapshot
        self._filter = where
        self._keep_alive_s = keep_alive_s
        current = state()
        self.epoch, self.position = current.epoch, current.feed_seq

    def _unusable(self, cursor: sse.Cursor) -> str | None:
        """Why a cursor cannot be resumed from, or None if every event after it is retained."""
        current = self._state()
        if cursor.epoch != current.epoch:
            return "unknown_epoch"
        if cursor.seq > current.feed_seq:
            return "future"
        oldest = self._reader.execute("SELECT min(seq) FROM feed").fetchone()[0]
        if cursor.seq < (current.feed_seq + 1 if oldest is None else oldest) - 1:
            return "too_old"
        return None

    async def stream(self) -> AsyncIterator[ServerSentEvent]:
        cursor = self._cursor
        if cursor is not None:
            reason = self._unusable(cursor)
            if reason is None:
                self.position = cursor.seq
                async for item in self._drain():
                    yield item
                yield self._synced()
            else:
                async for item in self._gap_and_snapshot(cursor.text, reason):
                    yield item
        elif self._want_snapshot:
            async for item in self._snapshot():
                yield item
        async for item in self._live():
            yield item

    def _synced(self) -> ServerSentEvent:
        return sse.event("synced", {"id": sse.event_id(self.epoch, self.position)})

    async def _gap_and_snapshot(self, requested: str | None,
                                reason: str) -> AsyncIterator[ServerSentEvent]:
        yield sse.event("gap", {"requested": requested, "reason": reason})
        async for item in self._snapshot():
            yield item

    async def _snapshot(self) -> AsyncIterator[ServerSentEvent]:
        """`set` for every key of every current record, then `synced`, from one read snapshot.

        Pages are fetched on a worker thread so a large cache never stalls the event loop.
        """
        conn = db.connect(self._cache_path, readonly=True)
        try:
            with db.snapshot(conn):
                state = cache.read_state(conn)
                rows = self._records(conn)
                while page := await asyncio.to_thread(rows.fetchmany, PAGE):
                    for rid, key, value in page:
                        if self._filter.matches(rid, key):
                            yield sse.event("set", {"rid": rid, "key": key, "value": value})
        finally:
            conn.close()
        self.epoch, self.position = state.epoch, state.feed_seq
        yield self._synced()

    def _records(self, conn: sqlite3.Connection) -> sqlite3.Cursor:
        if self._filter.rids:
            wanted = sorted(self._filter.rids)
            return conn.execute(
                "SELECT rid, key, value FROM records WHERE rid IN "
                f"({','.join('?' * len(wanted))}) ORDER BY rid, key", wanted)
        return conn.execute("SELECT rid, key, value FROM records ORDER BY rid, key")

    async def _drain(self) -> AsyncIterator[ServerSentEvent]:
        """Every feed event after `position`, page by page, until caught up.

        Seqs are dense, so a page that does not start at position + 1 means the events between
        were pruned while this subscriber lagged: it gets a gap and a snapshot instead.
        """
        while True:
            with db.snapshot(self._reader):  # the page and the epoch it belongs to, together
                stored = cache.read_state(self._reader)
                rows = self._reader.execute(
                    "SELECT seq, rid, op, key, value FROM feed WHERE seq > ? ORDER BY seq "
                    "LIMIT ?", (self.position, PAGE)).fetchall()
            if stored.epoch != self.epoch:  # rebuilt: these rows are another epoch's
                requested = sse.event_id(self.epoch, self.position)
                async for item in self._gap_and_snapshot(requested, "unknown_epoch"):
                    yield item
                continue
            lost = (rows and rows[0][0] != self.position + 1) or (
                not rows and stored.feed_seq > self.position)
            if lost:
                requested = sse.event_id(self.epoch, self.position)
                async for item in self._gap_and_snapshot(requested, "too_old"):
                    yield item
                continue
            if not rows:
                return
            for seq, rid, op, key, value in rows:
                self.position = seq
                if self._filter.matches(rid, key):
                    yield sse.change(self.epoch, seq, rid, op, key, value)

    async def _live(self) -> AsyncIterator[ServerSentEvent]:
        """The tail; a keep-alive after `keep_alive_s` in which this client got nothing (other
        events may have flowed past its filter meanwhile)."""
        quiet_since = time.monotonic()
        while True:
            async for item in self._drain():
                quiet_since = time.monotonic()
                yield item
            remaining = quiet_since + self._keep_alive_s - time.monotonic()
            if remaining <= 0:
                quiet_since = time.monotonic()
                yield sse.keep_alive()
                continue
            await self._wait_feed(self.position, self.epoch, remaining)
