"""The change feeds (SPEC §5): one shared reader per event table, and one subscription per client.

Delivery is a fan-out. A `Hub` reads each page of an event table once and keeps recent pages in
memory; each stream format (`Form`) frames a page's rows once, the first time one of its
subscribers asks; every subscriber takes the frames after its own position from there, as one
chunk per page (one socket write, not one per event). Two tables are served so: `feed` (to
`GET /api/events`, framed by `change_frame`, and to MetaMesh's `/api/events/meta`, framed its own
way in `compat`) and `file_feed` (MetaMesh's `/api/events/files`). A subscriber that lags reads
older pages through the same hub, so a slow one only lags: it never holds up ingest or other
subscribers, and never silently loses events. Whether a cursor can be resumed from is one rule
(`sse.resume_gap`, through `Hub.resume`), as is a lagging subscriber's loss (`Hub.after`). If
the events it needs were pruned (retention) or the cache was rebuilt (new epoch), it gets one
`gap` event and a snapshot of the current state (`Reading`: one read transaction together with
the seq it corresponds to, so the tail starts exactly after it: nothing lost, nothing doubled).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, overload

from metanode import cache, sse
from metanode.errors import StorageError

PAGE = 500
CACHE_BYTES = 16 << 20  # recent pages kept for the fan-out (`Page.size`); oldest-used go first
WaitFeed = Callable[[int, int, float], Awaitable[bool]]
STORE_RETRY_S = 1.0  # a stream whose read failed (the database away) tries it again after this
FeedRow = cache.FeedRow
FileFeedRow = cache.FileFeedRow
Reading = cache.Reading


class Sequenced(Protocol):
    """A row of an event table: it has its seq."""

    @property
    def seq(self) -> int: ...


R = TypeVar("R", bound=Sequenced)
Form = Callable[[int, R], bytes]  # a stream format: one row of an epoch as its SSE frame


def change_frame(epoch: int, row: FeedRow) -> bytes:
    """A feed row as `GET /api/events` sends it (`set` with the value, `del` without)."""
    return sse.change(epoch, row.seq, row.rid, row.op, row.key, row.value)


@dataclass(frozen=True)
class Table(Generic[R]):
    """An event table on a dense seq counter, as a `Hub` pages it."""

    # (the cache state, the rows with seqs in (after, upto]), read together
    page: Callable[[cache.CacheStore, int, int], tuple[cache.State, list[R]]]
    oldest: Callable[[cache.CacheStore], int | None]  # the oldest seq stored; None if empty
    head: Callable[[cache.State], int]  # the newest seq ever written, in a cache state


FEED: Table[FeedRow] = Table(
    cache.CacheStore.feed_page, cache.CacheStore.oldest_feed_seq, lambda s: s.feed_seq
)
FILE_FEED: Table[FileFeedRow] = Table(
    cache.CacheStore.file_feed_page,
    cache.CacheStore.oldest_file_feed_seq,
    lambda s: s.file_feed_seq,
)


class Page(Generic[R]):
    """Rows of one epoch with seqs in (index × PAGE, (index + 1) × PAGE]: a dense run from `first`.

    Rows are only ever appended, so a `Slice` of a page stays valid while the page grows. A page
    whose run starts after the page's own start had its earlier rows pruned before it was read.
    Each `Form` frames the rows once, when first asked. `size` counts what the page holds: its
    rows, their frames and the chunk of each form joined; counted over the frames alone, the
    pages kept held about five times `CACHE_BYTES` (the rows of short titles outweigh their
    frames three to one, and each joined chunk is the frames once more).
    """

    def __init__(self, index: int, epoch: int, first: int, rows: list[R]) -> None:
        self.index = index
        self.epoch = epoch
        self.first = first
        self.rows = rows
        self.size = held_bytes(rows)
        self._frames: dict[Form[R], list[bytes]] = {}
        self._joined: dict[Form[R], tuple[int, int, bytes]] = {}

    @property
    def upto(self) -> int:
        """The last seq read into this page."""
        return self.rows[-1].seq if self.rows else self.first - 1

    def extend(self, rows: list[R]) -> None:
        self.rows.extend(rows)
        self.size += held_bytes(rows)

    def frames(self, form: Form[R]) -> list[bytes]:
        """Every row framed by `form`: rows appended since the last call are framed now."""
        made = self._frames.setdefault(form, [])
        if len(made) < len(self.rows):
            new = [form(self.epoch, row) for row in self.rows[len(made) :]]
            made.extend(new)
            self.size += sum(map(len, new))
        return made

    def joined(self, form: Form[R], start: int, end: int) -> bytes:
        """The frames of rows[start:end] as one chunk; the last one of each form is kept, since
        subscribers that keep up all ask for the same rows."""
        kept = self._joined.get(form)
        if kept is None or kept[:2] != (start, end):
            self.size -= 0 if kept is None else len(kept[2])
            kept = self._joined[form] = (start, end, b"".join(self.frames(form)[start:end]))
            self.size += len(kept[2])
        return kept[2]


def held_bytes(rows: list[Any]) -> int:
    """About what `rows` (named tuples) hold in memory: each tuple and each of its fields."""
    return sum(sys.getsizeof(row) + sum(map(sys.getsizeof, row)) for row in rows)


@dataclass(frozen=True)
class Slice(Generic[R]):
    """The events of one page after a subscriber's position."""

    page: Page[R]
    start: int
    end: int

    @property
    def last(self) -> int:
        return self.page.rows[self.end - 1].seq

    def chunk(self, form: Form[R]) -> bytes:
        """Every event of the slice framed by `form`, as one chunk."""
        return self.page.joined(form, self.start, self.end)

    def frames(self: Slice[FeedRow], where: sse.Filter) -> bytes:
        """`GET /api/events`' frames that pass `where`, as one chunk (possibly empty)."""
        if where.everything:
            return self.chunk(change_frame)
        framed, rows = self.page.frames(change_frame), self.page.rows
        return b"".join(
            framed[i]
            for i in range(self.start, self.end)
            if where.matches(rows[i].rid, rows[i].key)
        )


class Hub(Generic[R]):
    """An event table (`feed` unless told), read once per page and shared by every subscriber
    of this process, whatever format each streams.

    Runs on the event loop with the cache store's loop reads: a page read is one indexed range
    query, done once per published change rather than once per subscriber.
    Cached pages belong to `epoch`; a read that finds another epoch drops them all.
    """

    @overload
    def __init__(
        self: Hub[FeedRow],
        store: cache.CacheStore,
        state: Callable[[], cache.State],
        cache_bytes: int = ...,
    ) -> None: ...

    @overload
    def __init__(
        self,
        store: cache.CacheStore,
        state: Callable[[], cache.State],
        cache_bytes: int = ...,
        *,
        table: Table[R],
    ) -> None: ...

    def __init__(
        self,
        store: cache.CacheStore,
        state: Callable[[], cache.State],
        cache_bytes: int = CACHE_BYTES,
        *,
        table: Table[Any] = FEED,
    ) -> None:
        self._store = store
        self._state = state
        self._cache_bytes = cache_bytes
        self.table: Table[R] = table
        self._pages: OrderedDict[int, Page[R]] = OrderedDict()
        self.epoch = state().epoch

    def oldest(self) -> int | None:
        """The oldest seq still stored, or None if the table is empty."""
        return self.table.oldest(self._store)

    def head(self) -> tuple[int, int]:
        """(epoch, newest seq) as last published: where a live-only subscriber starts."""
        published = self._state()
        return published.epoch, self.table.head(published)

    def resume(self, cursor: sse.Cursor) -> str | None:
        """Why the events after `cursor` cannot be replayed (`sse.resume_gap`), or None if
        every one of them is still stored."""
        epoch, head = self.head()
        return sse.resume_gap(cursor, epoch, head, self.oldest())

    def after(self, epoch: int, position: int) -> Slice[R] | str | None:
        """The events of `epoch` after `position`, up to the end of their page.

        None when there are none yet; the reason for a `gap` (`unknown_epoch`, `too_old`) when
        they cannot be had any more.
        """
        published = self._state()
        if epoch == published.epoch == self.epoch and position >= self.table.head(published):
            return None  # caught up: no read at all, however many subscribers wake
        wanted = position + 1
        index = (wanted - 1) // PAGE
        page = self._pages.get(index) if epoch == self.epoch else None
        if page is None or page.upto < wanted:
            page = self._read(index)
            if epoch != self.epoch:
                return sse.UNKNOWN_EPOCH
        self._pages.move_to_end(index)
        if wanted < page.first:
            return sse.TOO_OLD
        if wanted > page.upto:
            return None
        return Slice(page, wanted - page.first, len(page.rows))

    def _read(self, index: int) -> Page[R]:
        """Page `index` brought up to date from the database, its rows read in one transaction
        with the epoch they belong to."""
        while True:
            page = self._pages.get(index)
            after = index * PAGE if page is None else page.upto
            stored, rows = self.table.page(self._store, after, (index + 1) * PAGE)
            if stored.epoch == self.epoch:
                break
            self._pages.clear()
            self.epoch = stored.epoch
        head = self.table.head(stored)
        dense = rows[0].seq == after + 1 if rows else head <= after
        if page is not None and dense:
            page.extend(rows)
        else:  # new, or rows pruned since it was read: the run restarts at what is left
            first = rows[0].seq if rows else max(after, min(head, (index + 1) * PAGE)) + 1
            page = self._pages[index] = Page(index, self.epoch, first, rows)
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


Event = tuple[str, dict[str, Any]]  # (kind, data) of one frame
StateEvents = Callable[[list[Any]], list[Event]]  # a page of a reading's rows as state events


def record_events(where: sse.Filter) -> StateEvents:
    """`GET /api/events`' full state: a `set` with the value for every key that passes `where`."""

    def events(rows: list[Any]) -> list[Event]:
        return [
            ("set", {"rid": rid, "key": key, "value": value})
            for rid, key, value in rows
            if where.matches(rid, key)
        ]

    return events


def synced(position: str) -> Event:
    """`GET /api/events`' `synced`: the end of a replay or a full state, the position reached."""
    return "synced", {"id": position}


class Snapshot:
    """A full state, one `cache.Reading` framed a page at a time, for every stream: the events
    of `start`, then those of each page of rows, then `end`'s event, if any.

    The state reflects seq `head`, so its events are numbered: the n-th carries the id
    `<epoch>-<head>.<n>` (`sse.state_id`), a cursor that resumes right after it while the
    state is still the one at `head` (`sse.resume_gap`). The end of the state (`end`'s event,
    else the last event) carries `<epoch>-<head>` (`end_id`), which resumes with the events
    after the state. Each page's last event is held back until the next page shows whether it
    is the last of all. A client resuming inside this state gets only what it does not have
    yet (`gap`).
    """

    def __init__(
        self,
        reading: Reading,
        head: int,
        events: StateEvents,
        start: list[Event] | None = None,
        end: Callable[[str], Event] | None = None,
    ) -> None:
        self._reading = reading
        self._events = events
        self._end = end
        self.epoch, self.head = reading.state.epoch, head
        self._held: list[Event] = list(start or [])
        self._numbered = 0  # events numbered so far, sent or left out
        self._skip = 0
        self._done = False

    @classmethod
    async def open(cls, store: cache.CacheStore, where: sse.Filter) -> Snapshot:
        """The records' state as `GET /api/events` sends it."""
        reading = await store.records_reading(where.rids, PAGE)
        return cls(reading, reading.state.feed_seq, record_events(where), end=synced)

    @property
    def start_id(self) -> str:
        """The cursor of this state's start: resuming from it sends the state whole."""
        return sse.state_id(self.epoch, self.head, 0)

    @property
    def end_id(self) -> str:
        """The cursor of this state's end: resuming from it continues with the events after."""
        return sse.event_id(self.epoch, self.head)

    def gap(
        self,
        cursor: sse.Cursor | None,
        reason: str | None,
        names: Mapping[str, str] | None = None,
    ) -> bytes:
        """The `gap` frame that goes before this state (`sse.gap`, `reason` as `names` calls it),
        or nothing. `reason`: the client's `cursor` could not be continued. Without one, a
        cursor from inside a full state continues here if it is this very state (its first
        `cursor.state` events are then left out), else it gets a gap too; no cursor at all
        (`?snapshot=1`) gets the state without one."""
        if reason is None and cursor is not None:
            reason = sse.resume_gap(cursor, self.epoch, self.head, None)
            if reason is None:
                self._skip = cursor.state or 0
        if reason is None or cursor is None:
            return b""
        name = reason if names is None else names[reason]
        return sse.gap(cursor.text, name, self.start_id).encode()

    async def page(self) -> bytes | None:
        """The next page's frames (possibly empty); None once the last page was given."""
        if self._done:
            return None
        rows = await self._reading.rows()
        self._held += self._events(rows)
        self._done = not rows
        ready = self._held if self._done else self._held[:-1]
        self._held = self._held[len(ready) :]
        final = len(ready) - 1 if self._done and self._end is None else -1
        frames = [self._frame(*item, last=i == final) for i, item in enumerate(ready)]
        if self._done and self._end is not None:
            frames.append(sse.event(*self._end(self.end_id), self.end_id).encode())
        return b"".join(frames)

    def _frame(self, kind: str, data: dict[str, Any], last: bool) -> bytes:
        """One state event with its id, or nothing if the client has it already."""
        self._numbered += 1
        if self._numbered <= self._skip:
            return b""
        name = self.end_id if last else sse.state_id(self.epoch, self.head, self._numbered)
        return sse.event(kind, data, name).encode()

    async def close(self) -> None:
        await self._reading.close()


@dataclass(frozen=True)
class Feed(Generic[R]):
    """One event table as a stream over it needs it: the shared hub, a wait for news
    (`WaitFeed`), a snapshot of what the events describe, the keep-alive."""

    hub: Hub[R]
    wait: WaitFeed
    snapshot: Callable[[], Awaitable[Reading]]
    keep_alive_s: float

    async def full_state(self, events: StateEvents, start: list[Event] | None = None) -> Snapshot:
        """The full state of what the events describe, `events` framing its rows."""
        reading = await self.snapshot()
        return Snapshot(reading, self.hub.table.head(reading.state), events, start)


async def held(quiet_since: float, keep_alive_s: float) -> bytes:
    """What a stream sends while its store fails the read it needs (PostgreSQL restarting or
    away, a disk error): nothing for `STORE_RETRY_S`, then the caller tries the read again; a
    `: keep-alive` when one is due, so that proxies keep the connection. The stream stays open
    and goes on where it was once the read works: its client sees a quiet feed, not a cut one
    (a stream cut mid-response, with a traceback in the log, was each subscriber's lot at every
    restart of the database, and a browser's EventSource does not come back after the 503 its
    reconnection would get while the database is away)."""
    remaining = quiet_since + keep_alive_s - time.monotonic()
    if remaining <= 0:
        return sse.keep_alive().encode()
    await asyncio.sleep(min(STORE_RETRY_S, remaining))
    return b""


class Framing(ABC, Generic[R]):
    """How one stream frames an event table: its live events, its full state, the names of its
    `gap` reasons and what ends a replay. `Subscription` runs every stream by the one resume
    rule; a framing says only how it looks (`RecordFraming` for `/api/events`,
    `compat.MetaFollow` and `compat.FilesFollow` for MetaMesh's streams)."""

    gap_names: Mapping[str, str] | None = None  # None: the reasons as `sse` names them

    @abstractmethod
    def live(self, got: Slice[R]) -> bytes:
        """The frames of one page's events after the subscriber's position, as one chunk."""

    @abstractmethod
    async def full_state(self) -> Snapshot:
        """A new full state of what the events describe, opened (it holds a read transaction)."""

    def replayed(self, position: str) -> bytes:
        """What is sent once a replayed cursor has caught up (nothing, unless told)."""
        return b""


@dataclass(frozen=True)
class RecordFraming(Framing[FeedRow]):
    """`GET /api/events`: `change_frame`s that pass `where`; the records' state (`Snapshot.open`)
    and a replay each end in `synced`."""

    store: cache.CacheStore
    where: sse.Filter

    def live(self, got: Slice[FeedRow]) -> bytes:
        return got.frames(self.where)

    async def full_state(self) -> Snapshot:
        return await Snapshot.open(self.store, self.where)

    def replayed(self, position: str) -> bytes:
        """The end of a replay, with its position as the frame's `id` too: a client that keeps
        the last id it saw (EventSource) resumes from here, not from the last event that passed
        its filter, which may be old enough to be pruned by then (a needless `gap`)."""
        return sse.event(*synced(position), position).encode()


class Subscription(Generic[R]):
    """The event stream of one client connection, as chunks of whole SSE frames: replay after
    a cursor, or gap + full state (or, with no cursor and `whole_first`, the full state); then
    the live tail, with a `: keep-alive` after each silence of the feed's `keep_alive_s`.

    One generator (`stream`) over a small state machine (`_next`), so that whatever stops the
    stream (the client leaving, cancellation, the server shutting down) runs its one `finally`
    and releases an open snapshot at once.

    A read the store fails (`StorageError`) is tried again (`held`), the stream kept open;
    except inside a full state, whose read transaction is lost with it: the stream ends there,
    cleanly, and the client resumes from the last id it got, inside that state (SPEC §5).
    """

    def __init__(
        self,
        source: Feed[R],
        framing: Framing[R],
        cursor: sse.Cursor | None,
        whole_first: bool,
    ) -> None:
        self._hub = source.hub
        self._wait_feed = source.wait
        self._keep_alive_s = source.keep_alive_s
        self._framing = framing
        self._cursor = cursor
        self._whole_first = whole_first
        self.epoch, self.position = source.hub.head()
        self.written = self.epoch, self.position  # what its connection was handed, up to where
        self._snapshot: Snapshot | None = None
        self._replaying = False  # a usable cursor: `Framing.replayed` once caught up
        self._quiet_since = time.monotonic()

    def behind(self) -> int:
        """The events of its table not handed to its connection yet: the newest seq less the
        position of the last chunk whose send returned (a client that stopped reading holds
        the next send, so what comes after counts); the whole table when it is of another
        epoch now (a full state is what the client gets next)."""
        epoch, head = self._hub.head()
        written_epoch, written = self.written
        return head - written if epoch == written_epoch else head

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """Replay, or gap + full state, or full state; then the live tail."""
        begun = False
        try:
            while True:
                try:
                    chunk = await (self._next() if begun else self._begin())
                    begun = True
                except StorageError:
                    if self._snapshot is not None:
                        return  # the client resumes inside the state from its last id
                    chunk = await held(self._quiet_since, self._keep_alive_s)
                if chunk:
                    self._quiet_since = time.monotonic()
                    yield chunk
                self.written = self.epoch, self.position
        finally:
            if self._snapshot is not None:
                with contextlib.suppress(StorageError):  # its connection went with the server
                    await self._snapshot.close()

    async def _begin(self) -> bytes:
        cursor = self._cursor
        if cursor is None:
            return await self._full_state(None, None) if self._whole_first else b""
        reason = self._hub.resume(cursor)
        if reason is None and cursor.state is None:
            self.position, self._replaying = cursor.seq, True
            return b""
        return await self._full_state(cursor, reason)

    async def _full_state(self, cursor: sse.Cursor | None, reason: str | None) -> bytes:
        """Open the full state that comes next; the `gap` frame before it, if one is due."""
        self._replaying = False  # the state ends as the framing ends it
        self._snapshot = snapshot = await self._framing.full_state()
        return snapshot.gap(cursor, reason, self._framing.gap_names)

    async def _next(self) -> bytes:
        """The next chunk to send; empty when there was nothing for this client (yet)."""
        if self._snapshot is not None:
            return await self._snapshot_page(self._snapshot)
        got = self._hub.after(self.epoch, self.position)
        if isinstance(got, str):  # pruned while lagging, or the cache was rebuilt
            return await self._full_state(sse.Cursor.at(self.epoch, self.position), got)
        if got is not None:
            self.position = got.last
            return self._framing.live(got)
        if self._replaying:
            self._replaying = False
            return self._framing.replayed(sse.event_id(self.epoch, self.position))
        remaining = self._quiet_since + self._keep_alive_s - time.monotonic()
        if remaining <= 0:  # silence for this client, though others' events may have flowed
            return sse.keep_alive().encode()
        await self._wait_feed(self.position, self.epoch, remaining)
        return b""

    async def _snapshot_page(self, snapshot: Snapshot) -> bytes:
        chunk = await snapshot.page()
        if chunk is not None:
            return chunk
        self._snapshot = None  # before the await: a cancelled close is not closed twice
        await snapshot.close()
        self.epoch, self.position = snapshot.epoch, snapshot.head
        return b""  # its last page ended it (`synced`, or the last event with the end id)
