"""PostgreSQL plumbing: the stores' statements run here unchanged (docs/scale-out.md).

`truth.py` and `cache.py` hold ONE copy of their statements, written for SQLite and called on
a connection. For a PostgreSQL target (`Target`: a DSN and the schema the store lives in) they
get a `Connection` instead: the sqlite3 subset they use (`execute`, `executemany`,
`in_transaction`, `close`), over a psycopg 3 connection in autocommit mode, so that every
transaction is explicit as it is on SQLite. Each statement text is translated once (`translate`,
cached): `?` and `:name` placeholders become psycopg's, and the few SQLite-only fragments the
stores use become their PostgreSQL equivalents (`REWRITES`, one line each). The transaction
statements keep their SQLite meaning:
* `BEGIN IMMEDIATE` (a write transaction, `db.run_txn`) is `BEGIN` (READ COMMITTED) followed by
  `pg_advisory_xact_lock(<the store's key>)`: writers serialise on one lock per store, across
  processes, exactly as SQLite's write lock makes them; the lock ends with the transaction.
  READ COMMITTED, not REPEATABLE READ: each statement then sees every transaction committed
  before it, including the one that held the lock just before (a REPEATABLE READ snapshot
  would be taken at the lock statement, before the lock was granted);
* `BEGIN` on a read connection (`db.snapshot`) is a `REPEATABLE READ, READ ONLY` transaction:
  one snapshot for every statement inside, as SQLite's read transaction gives.

A connection whose server went away reconnects at its next statement outside a transaction, so
a writer thread recovers by itself once the server is back (its probe is such a statement).
A server that stops answering without closing anything (frozen) is found by a connection's
`Watchdog` and known to every connection of the process (`Server`) until a probe finds it
answering again.
Failures are typed by SQLSTATE (`storage_error`): an unreachable server or a connection lost is
`StorageUnavailable` (retryable, 503), never a 500.

psycopg is an optional dependency (`pip install metanode[postgresql]`): it is imported on first
use, so `import metanode` and the SQLite default never need it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from metanode.config import POSTGRESQL_SCHEMES, dsn_shown
from metanode.errors import (
    InvalidRequest,
    StorageError,
    StorageFull,
    StorageIOError,
    StorageLocked,
    StorageReadOnly,
    StorageRefused,
    StorageUnavailable,
    TooComplex,
    ToolMissing,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5  # `pg_connect_timeout_s`: whole seconds, at least 2 (libpq's rule)
POOL_MAX = 8  # read connections of their own (long reads, plugin threads, snapshots) per store
LOCK_TIMEOUT_MS = 30_000  # a lock held longer fails `storage_locked`, as SQLite's busy timeout
RECONNECT_S = 1.0  # after a failed reconnection, the next is tried no sooner than this
STALL_S = 5.0  # `pg_stall_s`: a statement unanswered this long is looked into (`Watchdog`)
RECONNECT_WAIT_S = 0.25  # what the loop waits for its new connection at most (`_reconnected`)
IDLE_CHECK_S = 2.0  # a connection idle this long is checked before its next use (`_checked`)
STREAM_ROWS = 2_000  # rows a streaming connection fetches at a time (`Connection`, `stream`)
# A statement holding this is planned for its own parameters each time, never prepared: the
# library's search (`cache.library_query`). Prepared, psycopg's fifth run on a connection on,
# the server may keep one plan for any words, which guesses how many rows match: for a word
# none had it read every row by rid, making the query again for each (260 ms at 100,000
# records, 2.7 s for 50 words), where a plan for the words reads the word index (2.5 ms).
UNPREPARED = "fts_match("


def is_dsn(storage: str) -> bool:
    return storage.startswith(POSTGRESQL_SCHEMES)


@dataclass(frozen=True)
class Target:
    """A store's PostgreSQL home: the database (`dsn`) and the schema of its tables, and how
    long its connections wait for the server: to connect (`connect_timeout_s`, also the wait
    for a pooled connection) and for a statement's answer before they look into it
    (`stall_s`, `Watchdog`); the settings `pg_connect_timeout_s` and `pg_stall_s`."""

    dsn: str
    schema: str
    stall_s: float = STALL_S
    connect_timeout_s: int = CONNECT_TIMEOUT_S

    @property
    def lock_key(self) -> int:
        """The advisory lock its write transactions take: one per store (schema), the same
        number in every process."""
        return zlib.crc32(f"metanode.{self.schema}".encode())

    @property
    def name(self) -> str:
        """What messages call it (as a SQLite store's file name)."""
        return f"the PostgreSQL schema {self.schema}"

    @property
    def dsn_shown(self) -> str:
        return dsn_shown(self.dsn)

    def __str__(self) -> str:
        return f"{self.dsn_shown} (schema {self.schema})"


def driver() -> ModuleType:
    """psycopg, imported on first use; a clear error where it is not installed."""
    try:
        import psycopg
    except ImportError:
        raise InvalidRequest(
            "setting storage: PostgreSQL needs psycopg; install metanode[postgresql] (in the "
            "checkout: make postgresql)"
        ) from None
    return psycopg


# -- statements -----------------------------------------------------------------------------


# SQLite-only fragments of the stores' statements and what PostgreSQL says instead, applied to
# a statement's text in this order (`translate`).
REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    # A list parameter: `json_each(?)` of an array of scalars gives their text; of an array of
    # arrays (read with `json_extract(value, '$[i]')`), the JSON elements.
    (re.compile(r"json_extract\(value, '\$\[(\d+)\]'\)"), r"(value->>\1)"),
    (re.compile(r"(\(value->>\d+\).*)json_each\(\?\)", re.S), r"\1json_elements(?)"),
    (re.compile(r"json_each\(\?\)"), "json_array_elements_text(CAST(? AS json))"),
    (re.compile(r"json_elements\(\?\)"), "json_array_elements(CAST(? AS json))"),
    # AUTOINCREMENT's counter: PostgreSQL's `sequences` table, kept by a trigger (truth.py).
    (
        re.compile(r"SELECT seq FROM sqlite_sequence WHERE name = '(\w+)'"),
        r"SELECT seq FROM sequences WHERE name = '\1'",
    ),
    (
        re.compile(r"UPDATE sqlite_sequence SET seq = \? WHERE name = '(\w+)'"),
        r"UPDATE sequences SET seq = ? WHERE name = '\1'",
    ),
    (re.compile(r"PRAGMA user_version=(\d+)"), r"UPDATE schema_version SET version = \1"),
    (re.compile(r"PRAGMA user_version"), "SELECT version FROM schema_version"),
    # Changes whenever any transaction commits (`applier.Follower` polls it, as SQLite's counter
    # of other connections' commits): the current snapshot (xmin:xmax:running xids) differs
    # after every commit, since a committed xid never runs again and xmax only grows. Its
    # xmax alone would move when a transaction starts writing, not when it commits.
    (re.compile(r"PRAGMA data_version"), "SELECT hashtext(CAST(pg_current_snapshot() AS text))"),
    # The web page's full-text search (cache.library_query): `library.search`, a tsvector kept
    # by a trigger, matched by the same query text (`fts_match` reads FTS5's `"word"*` list).
    (re.compile(r"library_fts f CROSS JOIN library l ON l\.id = f\.rowid"), "library l"),
    (re.compile(r"library_fts MATCH :match"), "l.search @@ fts_match(:match)"),
    (re.compile(r"^EXPLAIN QUERY PLAN "), "EXPLAIN "),
)
_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@functools.lru_cache(maxsize=1024)
def translate(sql: str, params: bool) -> str:
    """A store's statement as PostgreSQL takes it (cached: the stores' texts are few). With
    `params`, `%` is escaped and the placeholders become psycopg's: every `?` and `:name` is a
    placeholder (the stores' statements hold neither inside a string literal)."""
    for pattern, replacement in REWRITES:
        sql = pattern.sub(replacement, sql)
    if params:
        sql = _NAMED.sub(r"%(\1)s", sql.replace("%", "%%")).replace("?", "%s")
    return sql


# -- errors ---------------------------------------------------------------------------------


_SQLSTATE: tuple[tuple[str, type[StorageError]], ...] = (
    ("53100", StorageFull),  # disk_full
    ("53", StorageUnavailable),  # insufficient resources: too many connections, out of memory
    ("08", StorageUnavailable),  # connection exception
    ("57P", StorageUnavailable),  # admin shutdown, crash shutdown, cannot connect now
    ("57014", StorageUnavailable),  # query canceled: `statement_timeout`, pg_cancel_backend
    ("40", StorageLocked),  # serialization failure, deadlock
    ("55P03", StorageLocked),  # lock not available
    ("25P03", StorageUnavailable),  # `idle_in_transaction_session_timeout` ended the session
    ("25P04", StorageUnavailable),  # `transaction_timeout` (PostgreSQL 17) ended the session
    ("25006", StorageReadOnly),  # read-only transaction (a standby)
    ("42501", StorageReadOnly),  # insufficient privilege: the DSN's user may not write there
    ("58", StorageIOError),  # system error (I/O)
    ("XX001", StorageIOError),  # data corrupted
)


def is_driver_error(exc: BaseException) -> bool:
    """Whether `exc` comes from psycopg or its pool (without importing either)."""
    return type(exc).__module__.startswith(("psycopg", "psycopg_pool"))


def storage_error(exc: BaseException, where: object = None) -> StorageError | None:
    """The typed error of a PostgreSQL failure, or None for one that is no storage failure (a
    constraint, a syntax error: a bug, not an outage). A failure with no SQLSTATE (the server
    refused the connection, the pool waited in vain) is the server being unavailable."""
    if not is_driver_error(exc):
        return None
    state = getattr(exc, "sqlstate", None) or ""
    kind = next((k for prefix, k in _SQLSTATE if state.startswith(prefix)), None)
    if kind is None and not state and _operational(exc):
        kind = StorageRefused if _login_refused(str(exc)) else StorageUnavailable
    if kind is None:
        return None
    text = first_line(exc)
    hint = LOGIN_HINT if kind is StorageRefused else REFUSAL_HINTS.get(state, slots_hint(text))
    return kind(f"the database failed: {f'{where}: ' if where else ''}{text}{hint}")


def limit_error(exc: BaseException) -> TooComplex | None:
    """The typed error of a statement past one of the server's program limits (SQLSTATE class
    54: too complex, too many columns or arguments), or None. The statement is the request's
    (its size comes from what was asked), so this is the request's error, not the storage's."""
    if not is_driver_error(exc):
        return None
    state = getattr(exc, "sqlstate", None) or ""
    if not state.startswith("54"):
        return None
    return TooComplex(
        f"the database cannot run what this request asks as one statement ({first_line(exc)}; "
        f"SQLSTATE {state}): ask for less (a shorter search)"
    )


def first_line(exc: BaseException | None) -> str:
    """An error's first line (psycopg's go on with hints and the server's detail), or its
    type's name if it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# The server's words when every connection slot is taken: `max_connections` reached, or only
# the slots reserved for superusers left (psycopg gives a refused connection no SQLSTATE).
_SLOTS_FULL = re.compile(r"too many clients|remaining connection slots are reserved")
SLOTS_HINT = (
    "; every connection slot of the server is taken (`max_connections`): other clients hold "
    "them, or the server needs more for the replicas (each holds 7 connections, up to 23 "
    "with its read pools full, and one more per feed snapshot being read; docs/scale-out.md)"
)


def slots_hint(text: str) -> str:
    """`SLOTS_HINT` if `text` is the server refusing a connection for want of a slot."""
    return SLOTS_HINT if _SLOTS_FULL.search(text) else ""


# A refused login has no SQLSTATE in psycopg (libpq fails the connection before a result):
# it is known by the server's words, in its default (English) messages. A server set to
# another `lc_messages` gives other words: such a refusal stays `StorageUnavailable`.
_LOGIN_REFUSALS = re.compile(
    r"FATAL:\s+(password authentication failed|role .* does not exist|database .* does not "
    r"exist|no pg_hba\.conf entry|permission denied for database)"
)
LOGIN_HINT = "; check the user, password and database the DSN names (docs/scale-out.md)"
# What an operator does about the refusals only they can mend (the server's words say what
# was refused, not why or what to do).
REFUSAL_HINTS = {
    "42501": "; the user of the DSN needs to own the database (`CREATE` on it) and the schemas "
    "and tables metanode made there (createdb --owner, docs/scale-out.md; a REVOKE or an ALTER "
    "… OWNER since takes them away)",
    # a standby, or a primary whose database or user is set read-only (some hosted servers
    # do so themselves when their disk is nearly full): the server's words do not tell which
    "25006": "; the server takes no writes here: a standby (give the DSN of the primary), or "
    "a database or user set read-only (`default_transaction_read_only`)",
    # the server's statement_timeout (set on the database or the user, or in the server's
    # configuration), or an administrator's pg_cancel_backend
    # the server's session timeouts: a session ended by them is made again at its next use
    "25P03": "; the server ended the session while its transaction waited between two "
    "statements: an `idle_in_transaction_session_timeout` set on the server, the database or "
    "the user shorter than metanode's transactions wait (on a busy machine, up to seconds; "
    "raise it, or lift it for the node: ALTER ROLE … SET idle_in_transaction_session_timeout "
    "= 0)",
    "25P04": "; the server ended the session for the length of its transaction: a "
    "`transaction_timeout` set on the server, the database or the user shorter than "
    "metanode's transactions take (lift it for the node: ALTER ROLE … SET "
    "transaction_timeout = 0)",
    "57014": "; the server cancelled the statement: a `statement_timeout` set on the database "
    "or the user shorter than metanode's statements take (lift it: ALTER ROLE … RESET "
    "statement_timeout), or pg_cancel_backend",
}
# Settings a session keeps from its start (`ALTER DATABASE|ROLE … SET`): a connection that
# failed for one of them is made again before its next transaction, so the node takes the
# setting lifted without a restart (`Connection._stale`).
SESSION_SETTINGS = ("25006", "57014")


def _login_refused(text: str) -> bool:
    return _LOGIN_REFUSALS.search(text) is not None


def _operational(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"OperationalError", "InterfaceError", "PoolTimeout", "PoolClosed"})


# -- connections ----------------------------------------------------------------------------


class Cursor:
    """The sqlite3 cursor subset the stores read results through. `guard` (a server-side
    cursor's: each page is a round trip of its own) runs each fetch under the connection's
    `Watchdog`, so an export's next page from a frozen server is cut off as a statement is."""

    def __init__(self, raw: Any, guard: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        self._raw = raw
        self._guard = guard if guard is not None else _unguarded

    @property
    def rowcount(self) -> int:
        return int(self._raw.rowcount)

    @property
    def description(self) -> Any:
        return self._raw.description

    def fetchone(self) -> Any:
        return self._guard(self._raw.fetchone) if self._raw.description is not None else None

    def fetchall(self) -> list[Any]:
        if self._raw.description is None:
            return []
        return list(self._guard(self._raw.fetchall))

    def fetchmany(self, size: int) -> list[Any]:
        return list(self._guard(lambda: self._raw.fetchmany(size)))

    def __iter__(self) -> Iterator[Any]:
        """The rows; a server-side cursor's a page (`STREAM_ROWS`) at a time."""
        if self._raw.description is None:
            return
        while page := self.fetchmany(STREAM_ROWS):
            yield from page

    def close(self) -> None:
        self._raw.close()


def _unguarded(call: Callable[[], Any]) -> Any:
    return call()


def _options(target: Target) -> str:
    """Every connection's settings: the store's schema first on the path, UTF-8, the longest
    wait for a lock (a writer's advisory lock held by a stuck process fails as SQLite's busy
    timeout does, instead of waiting for ever), and no JIT: the statements are short lookups,
    and a plan the planner over-estimates (a watcher batch's paths as a JSON list: 100 rows
    guessed) paid ≈ 4 ms of compiling for a statement of less than one."""
    return (
        f"-c search_path={target.schema} -c client_encoding=UTF8 "
        f"-c lock_timeout={LOCK_TIMEOUT_MS} -c jit=off"
    )


def _application_name(target: Target) -> str:
    """How `pg_stat_activity` names a connection (unless the DSN names it): the process and
    the store, so the replicas sharing a database, and a feed's reader, are told apart."""
    return f"metanode pid {os.getpid()} {target.schema}"


def _connect_raw(target: Target) -> Any:
    """A psycopg connection in autocommit mode with the store's schema first on the path."""
    psycopg = driver()
    return psycopg.connect(
        target.dsn,
        autocommit=True,
        connect_timeout=target.connect_timeout_s,
        options=_options(target),
        fallback_application_name=_application_name(target),
    )


_IN_TRANSACTION = (1, 2, 3)  # psycopg.pq.TransactionStatus ACTIVE, INTRANS, INERROR
_ACTIVE = 1  # psycopg.pq.TransactionStatus: a command sent whose results were not all read


def _wedged(raw: Any) -> bool:
    """Whether a connection whose statement just failed is left unusable though open: still
    in pipeline mode (psycopg's `executemany` runs in one, and a session ended by the server
    mid-batch, an idle-in-transaction timeout, could leave it so) or with a command's results
    unread. It then counts as in a transaction for ever, so it was never made again, and
    every later statement failed (`cannot exit pipeline mode while busy`): the applier of a
    replica failed every apply for 5 minutes after a low `idle_in_transaction_session_timeout`
    was lifted, until it was restarted."""
    if raw.closed:
        return False
    return bool(raw.pgconn.pipeline_status) or int(raw.info.transaction_status) == _ACTIVE


def _cut(fd: int) -> None:
    """Shut down the socket `fd` (both ways): a statement waiting on it fails at once, as on a
    connection the server dropped. Through a duplicate, so the fd stays its owner's to close."""
    # OSError: already shut down, or not connected any more
    with socket.socket(fileno=os.dup(fd)) as duplicate, contextlib.suppress(OSError):
        duplicate.shutdown(socket.SHUT_RDWR)


def answers(target: Target) -> bool:
    """Whether the server answers a new connection within `connect_timeout_s`: made (then
    closed at once), or refused in its own words (its slots full, a login refused). A server
    that is stopped (SIGSTOP), frozen or cut off does not: its kernel may accept the TCP
    connection, but nothing answers the startup packet."""
    try:
        _connect_raw(target).close()
    except Exception as exc:
        text = str(exc)
        return bool(slots_hint(text)) or _login_refused(text)
    return True


class Server:
    """This process's verdict on one PostgreSQL server (its DSN), shared by every connection
    of the process to it (both stores', the loop's, the writers', the pools', the feeds'):
    each used to find a frozen server on its own, each holding its caller `stall_s` first,
    and the event loop's every one of them (after a SIGSTOP the node's first answers took
    5.6 s, 11.5 s and 16.8 s).

    `suspect` (a statement of the event loop's got no answer in `stall_s`) makes the loop's
    connections fail at once, since the loop must never wait; `stalled` (the server did not
    answer a new connection within `connect_timeout_s`, `answers`) makes every connection
    fail at once and cuts the statements waiting on it (`Watchdog`). Either starts a probe
    thread that asks `answers` every `RECONNECT_S` and clears both as soon as it does: a
    server only slow is cleared by the first probe, in milliseconds, and a write waiting on
    it is never cut; a resumed one (SIGCONT) within a second."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.suspect = False
        self.stalled = False
        self._lock = threading.Lock()
        self._probing = False

    def suspected(self) -> None:
        """A statement of the event loop's got no answer in `stall_s`."""
        self.suspect = True
        self._probe()

    def found_silent(self) -> None:
        """The server did not answer a new connection (`answers`)."""
        self.suspect = self.stalled = True
        self._probe()

    def refuse(self, on_loop: bool) -> None:
        """Raise `StorageUnavailable` if a statement must not be sent now: the server is
        stalled, or suspect and the caller is the event loop."""
        if not (self.stalled or (on_loop and self.suspect)):
            return
        found = f"a statement in {self.target.stall_s:g} s (`pg_stall_s`)"
        if self.stalled:
            found += f" nor a new connection in {self.target.connect_timeout_s} s"
        raise StorageUnavailable(
            f"the database failed: {self.target.dsn_shown}: the server answered neither "
            f"{found}: it is stopped, frozen or cut off; nothing is sent to it until it "
            "answers again"
        )

    def _probe(self) -> None:
        with self._lock:
            if self._probing:
                return
            self._probing = True
        threading.Thread(target=self._until_answered, name="metanode-pg-probe", daemon=True).start()

    def _until_answered(self) -> None:
        """Ask `answers` until the server does, then clear the verdict."""
        while not answers(self.target):
            self.suspect = self.stalled = True
            time.sleep(RECONNECT_S)
        with self._lock:
            self.suspect = self.stalled = False
            self._probing = False
        log.info("PostgreSQL at %s answers again", self.target.dsn_shown)


_SERVERS: dict[str, Server] = {}
_SERVERS_LOCK = threading.Lock()


def server_of(target: Target) -> Server:
    """The process's one `Server` of `target`'s DSN."""
    with _SERVERS_LOCK:
        return _SERVERS.setdefault(target.dsn, Server(target))


class Watchdog:
    """Cuts off a statement of a connection whose caller must not wait for ever on a server
    that stopped answering without closing the connection (a frozen host, a stopped process,
    a network that drops packets): such a server holds a statement's reply for ever, and its
    caller with it. The TCP keepalive does not help when the peer's kernel still answers it.

    A thread of its own looks every `limit / 4` seconds whether the statement in progress
    started longer than `limit` ago and, if so, shuts the connection's socket down
    (`_cut`): the statement fails as a dropped connection does (`StorageUnavailable`,
    `fired` set), and the connection reconnects (`Connection`). With `alive` (a writer's:
    a write may rightly wait longer, for the store's write lock up to `LOCK_TIMEOUT_MS`, or
    run long, a rebuild) it first asks whether the server still answers (`answers`, up to
    the connect timeout): if it does, the statement is slow, not stalled, and is looked at
    again `limit` later. The event loop's has none: its reads are point reads, and the loop
    must never wait. `start` and `stop` are two assignments under a lock no one else holds
    for long: no thread is woken per statement."""

    def __init__(
        self, limit: float, server: Server, alive: Callable[[], bool] | None = None
    ) -> None:
        self.limit = limit
        self.fired = False  # the last statement was cut off by this
        self._server = server
        self._alive = alive
        self._lock = threading.Lock()
        self._fd = -1
        self._since: float | None = None  # when the statement in progress started
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="metanode-pg-watchdog", daemon=True).start()

    def start(self, fd: int) -> None:
        with self._lock:
            self._fd, self._since, self.fired = fd, time.monotonic(), False

    def stop(self) -> None:
        with self._lock:
            self._since = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(min(self.limit / 4, RECONNECT_S)):
            since = self._since
            if since is None:
                continue
            silent = self._server.stalled  # found by another connection: cut at once
            if not silent and time.monotonic() - since <= self.limit:
                continue
            alive = not silent and self._alive is not None and self._alive()
            with self._lock:
                if self._since != since:  # that statement ended meanwhile
                    continue
                if alive:
                    self._since = time.monotonic()
                    continue
                _cut(self._fd)
                self._since, self.fired = None, True
            self._tell(silent)

    def _tell(self, silent: bool) -> None:
        """Give the server's verdict what this cut found: a writer's or a pool's asked
        `answers` in vain, the loop's only waited `limit`."""
        if silent:
            return
        if self._alive is None:
            self._server.suspected()
        else:
            self._server.found_silent()


def _watchdog_for(target: Target, on_loop: bool) -> Watchdog:
    """The event loop's connection's `Watchdog` (cuts at `stall_s`), or any other's (a
    writer's, a pool's read of its own: cuts at `stall_s` once the server is found not to
    answer, so a write or an export only slow goes on)."""
    server = server_of(target)
    if on_loop:
        return Watchdog(target.stall_s, server)
    return Watchdog(target.stall_s, server, functools.partial(answers, target))


class Connection:
    """A store connection on PostgreSQL with the sqlite3 surface the statements use.

    `readonly`: its `BEGIN` opens a REPEATABLE READ, READ ONLY snapshot and it is never written
    through. `stream` (a read connection of its own, `Store.reading`: export, `check`, the
    reconciliation's reads): a query inside its snapshot runs on a server-side cursor, so a
    result of millions of rows comes a page at a time instead of whole into memory, as SQLite
    steps a statement. `release`: what `close()` does with the psycopg connection (a pooled one
    goes back to its pool). `on_loop` (the event loop's read connection, `db.Store`): a
    statement is cut off after `Target.stall_s` (`Watchdog`), and a dropped connection is
    made again on a thread of its own, never on the loop (`_reconnected`): a server that does
    not answer stalls the node's requests for at most that long once, not for ever. Any
    other connection (the stores' writers, the pool's reads) has the same, its statement cut
    off once the server is found not to answer (`Watchdog`'s `alive`): a write sent to a
    frozen server fails `storage_unavailable` within `stall_s` and a connect timeout. What
    one connection finds, every connection of the process to that server knows (`Server`):
    a statement outside a transaction is refused before it is sent while the server is
    stalled (the loop's while it is merely suspect), so a freeze is found once, not once
    per connection."""

    def __init__(
        self,
        target: Target,
        readonly: bool,
        raw: Any = None,
        release: Any = None,
        stream: bool = False,
        on_loop: bool = False,
    ) -> None:
        self.target = target
        self.readonly = readonly
        self._raw = raw if raw is not None else _connect_raw(target)
        self._release = release
        self._stream = stream and readonly
        self._cursors: list[Any] = []  # the server-side cursors of the current snapshot
        self._retry_at = 0.0  # no reconnection before this (`time.monotonic`), after a failed one
        self._why = ""  # what the last failed reconnection was told (`_unreachable`)
        self._on_loop = on_loop
        self._server = server_of(target)
        self._watchdog = _watchdog_for(target, on_loop)
        self._pending: Future[Any] | None = None  # a reconnection under way on its thread
        self._closed = False
        self._used = time.monotonic()  # when its last statement ended
        self._stale = False  # failed for a setting its session keeps (`SESSION_SETTINGS`)
        self._writing = False  # in a write transaction (`BEGIN IMMEDIATE`)

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open (psycopg's ACTIVE, INTRANS, INERROR); a connection the
        server dropped (UNKNOWN) has none left to roll back, and reconnects at its next use."""
        return int(self._raw.info.transaction_status) in _IN_TRANSACTION

    def _live(self) -> Any:
        """The psycopg connection; a new one first if the server dropped this one (only ever
        outside a transaction, so nothing of a transaction is silently lost). After a failed
        attempt the next waits `RECONNECT_S`: meanwhile a statement fails at once, so the
        event loop's reads do not each wait for a server that is not there."""
        if self._stale and self._release is None:  # a pool's connection goes back as it is
            self._stale = False
            self._raw.close()
        if not (self._raw.closed or self._raw.broken):
            return self._raw
        return self._reconnected()

    def _connect_failed(self, exc: BaseException | None) -> None:
        self._retry_at = time.monotonic() + RECONNECT_S
        self._why = first_line(exc)

    def _unreachable(self) -> StorageUnavailable:
        """What a statement fails with while no new connection is tried: the last attempt's
        words, so that /health and the answers say why (the server down, starting up, its
        connection slots full); a bare `not reachable` said none of that."""
        why = f" (the last attempt: {self._why}{slots_hint(self._why)})" if self._why else ""
        if self._pending is not None:
            why = " (a new connection is being tried)"
        return StorageUnavailable(f"the database failed: {self.target}: not reachable{why}")

    def _reconnected(self) -> Any:
        """The loop's connection made again on a thread of its own (`_connect_into`). The read
        that starts an attempt waits for it at most `RECONNECT_WAIT_S` (a server that answers
        connects in milliseconds: the read goes on as if nothing happened); while an attempt
        runs on (one may take `Target.connect_timeout_s`) and for `RECONNECT_S` after one failed,
        reads fail `storage_unavailable` at once instead of waiting on the loop."""
        if self._pending is None and time.monotonic() >= self._retry_at:
            self._pending = Future()
            threading.Thread(  # a daemon: an attempt hung on a frozen server never holds an exit
                target=self._connect_into,
                args=(self._pending,),
                name="metanode-pg-reconnect",
                daemon=True,
            ).start()
            with contextlib.suppress(TimeoutError):
                self._pending.exception(timeout=RECONNECT_WAIT_S)
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            if pending.exception() is None:
                self._raw.close()
                self._raw = pending.result()
                return self._raw
            self._connect_failed(pending.exception())
        raise self._unreachable()

    def _connect_into(self, pending: Future[Any]) -> None:
        """Make a new psycopg connection into `pending` (on its own thread). Published first,
        then closed if this connection was closed meanwhile: `close()` sets `_closed` first,
        then closes what `pending` holds, so one of the two closes it, whatever the order."""
        try:
            raw = _connect_raw(self.target)
        except BaseException as exc:
            pending.set_exception(exc)
            return
        pending.set_result(raw)
        if self._closed:
            raw.close()

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> Cursor:
        raw = self._raw if self.in_transaction else self._checked()
        try:
            if sql == "BEGIN IMMEDIATE":
                return self._begin_writing(raw)
            if sql == "BEGIN" and self.readonly:
                return Cursor(raw.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
            text = translate(sql, bool(params))
            if self._stream and self.in_transaction and text.startswith(("SELECT", "WITH")):
                cursor = self._guarded(raw, lambda: self._server_cursor(raw, text, params))
                return Cursor(cursor, functools.partial(self._guarded, raw))
            try:
                return Cursor(self._watched(raw, text, params))
            finally:
                if sql in ("COMMIT", "ROLLBACK"):
                    self._close_cursors()
        except Exception as exc:
            self._failed(sql, raw, exc)
            raise
        finally:
            if sql in ("COMMIT", "ROLLBACK"):
                self._writing = False
            self._used = time.monotonic()

    def _failed(self, sql: str, raw: Any, exc: Exception) -> None:
        """What a failed statement means for this connection. One refused for a setting its
        session keeps from its start (`SESSION_SETTINGS`: the database or user set read-only,
        a `statement_timeout`) is made again before its next transaction, so that lifting the
        setting is enough: the session would refuse for as long as it lives, which for a
        writer is for ever, each of its probes failing with it. A write transaction whose
        connection was lost during its COMMIT may have committed or not (the server may have
        committed it before the connection went): said so, instead of `the database failed`,
        which reads as nothing stored. One left busy (`_wedged`) is closed: made again at its
        next use."""
        if getattr(exc, "sqlstate", None) in SESSION_SETTINGS:
            self._stale = True
        if _wedged(raw):
            raw.close()
        if sql == "COMMIT" and self._writing and _operational(exc) and (raw.closed or raw.broken):
            first = first_line(exc)
            raise StorageUnavailable(
                f"the database failed: {self.target}: the connection was lost during COMMIT "
                f"({first}), so the write may or may not be stored: send it again (claims "
                "already stored come back `duplicate`)"
            ) from exc
        if self._watchdog.fired:
            raise self._stalled() from exc

    def _stalled(self) -> StorageUnavailable:
        """What a statement cut off by the `Watchdog` fails with: the bound it met, by its
        setting, rather than psycopg's words for the socket shut down under it."""
        waited = f"{self.target.stall_s:g} s (`pg_stall_s`)"
        if not self._on_loop:  # the server was asked first (`answers`)
            waited += (
                f", nor a new connection in {self.target.connect_timeout_s} s "
                "(`pg_connect_timeout_s`)"
            )
        return StorageUnavailable(
            f"the database failed: {self.target}: no answer in {waited}: the server is "
            "stopped, frozen or cut off; the statement was given up"
        )

    def _checked(self) -> Any:
        """`_live()`, and for a connection idle `IDLE_CHECK_S` or more, checked first with an
        empty statement: a server restarted meanwhile closed it, which psycopg learns only
        when it next talks, and that would be the next unit of work's first statement, failed
        for nothing (a watcher's batch, a request's read: 503 once after every restart). A
        failed check is that dropped connection: made again, before anything was sent."""
        self._server.refuse(self._on_loop)
        raw = self._live()
        if time.monotonic() - self._used < IDLE_CHECK_S:
            return raw
        try:
            self._watched(raw, "", None)
        except Exception as exc:
            if not (_operational(exc) and (raw.closed or raw.broken)):
                raise
            if self._watchdog.fired:  # not dropped: no answer
                raise self._stalled() from exc
            return self._live()
        return raw

    def _watched(self, raw: Any, text: str, params: Any) -> Any:
        """`raw.execute`, under the watchdog if this connection has one; a statement of
        `UNPREPARED` never prepared."""
        prepare = False if UNPREPARED in text else None
        return self._guarded(raw, lambda: raw.execute(text, params or None, prepare=prepare))

    def _guarded(self, raw: Any, call: Callable[[], Any]) -> Any:
        """`call()` (a statement on `raw`) under the watchdog."""
        self._watchdog.start(raw.fileno())
        try:
            return call()
        finally:
            self._watchdog.stop()

    def _begin_writing(self, raw: Any) -> Cursor:
        """`BEGIN` and the store's advisory lock, as one statement is on SQLite: if the lock
        is not had (`lock_timeout`, a lost connection) no transaction is left open. A lock
        not had within `lock_timeout` because its holder's transaction has waited on its
        client as long (`end_stale_holders`: a process stopped, SIGSTOP or a frozen host,
        inside a write) has that holder's session ended, so the next try gets it: the
        server keeps such a session, and the lock, for as long as the process does not run,
        and every writer of every replica failed `storage_locked` meanwhile."""
        self._watched(raw, "BEGIN", None)
        self._writing = True
        try:
            lock = "SELECT pg_advisory_xact_lock(%s)"
            return Cursor(self._watched(raw, lock, (self.target.lock_key,)))
        except BaseException as exc:
            self._writing = False
            if self.in_transaction:
                with contextlib.suppress(Exception):  # the lock's failure is the one to report
                    raw.execute("ROLLBACK")
            if getattr(exc, "sqlstate", None) == "55P03":
                self._end_stuck_writer(raw)
            raise

    def _end_stuck_writer(self, raw: Any) -> None:
        """`end_stale_holders` of this store's write lock, said in the log."""
        waited_s = LOCK_TIMEOUT_MS / 1000
        try:
            ended = end_stale_holders(raw, self.target.lock_key, IN_TRANSACTION, waited_s)
        except Exception as exc:  # no right to end it: the lock's failure is the one to report
            log.warning("could not end the session holding %s's write lock: %s", self.target, exc)
            return
        for session in ended:
            log.warning(
                "the write lock of %s was held by a transaction idle for %s: its process "
                "is stopped or cut off; its session was ended so that writes go on",
                self.target,
                session,
            )

    def _server_cursor(self, raw: Any, text: str, params: Any) -> Any:
        cursor = raw.cursor(name=f"stream{len(self._cursors)}")
        self._cursors.append(cursor)
        cursor.itersize = STREAM_ROWS
        cursor.execute(text, params or None)
        return cursor

    def _close_cursors(self) -> None:
        """Forget the snapshot's server-side cursors (the transaction's end closed them on the
        server already: psycopg sends nothing)."""
        for cursor in self._cursors:
            cursor.close()
        self._cursors = []

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Cursor:
        cursor = self._raw.cursor()
        try:
            text, listed = translate(sql, True), list(rows)
            self._guarded(self._raw, lambda: cursor.executemany(text, listed))
        except Exception as exc:
            self._failed(sql, self._raw, exc)
            raise
        return Cursor(cursor)

    def close(self) -> None:
        self._closed = True
        self._close_cursors()
        self._watchdog.close()
        if self._pending is not None and self._pending.done() and not self._pending.exception():
            self._pending.result().close()
        if self._release is not None:
            self._release(self._raw)
        else:
            self._raw.close()


class Pool:
    """Read connections of a store's own (the long reads off the loop, plugin threads), from a
    psycopg_pool: opened once, lent and given back, instead of a connection per call."""

    def __init__(self, target: Target) -> None:
        driver()
        from psycopg_pool import ConnectionPool

        self.target = target
        self._lock = threading.Lock()
        self._pool = ConnectionPool(
            target.dsn,
            min_size=0,
            max_size=POOL_MAX,
            kwargs={
                "autocommit": True,
                "connect_timeout": target.connect_timeout_s,
                "options": _options(target),
            },
            open=True,
            timeout=target.connect_timeout_s,
            check=self._check,  # a connection the server dropped: a new one
            name=f"metanode-{target.schema}",
        )

    def _check(self, raw: Any) -> None:
        """psycopg_pool's check of a connection before it is lent (an empty statement),
        under a `Watchdog`: on a frozen server it waited for ever, its reader with it."""
        dog = _watchdog_for(self.target, False)
        dog.start(raw.fileno())
        try:
            type(self._pool).check_connection(raw)
        finally:
            dog.stop()
            dog.close()

    def connection(self) -> Connection:
        """A read-only, streaming connection of the pool; `close()` gives it back. None is
        asked for while the server is found stalled (`Server`): the read fails at once."""
        server_of(self.target).refuse(False)
        return Connection(self.target, True, self._pool.getconn(), self._pool.putconn, True)

    def close(self) -> None:
        self._pool.close()


def ensure_schema(target: Target) -> None:
    """The store's schema and its `schema_version` row (version 0), made once: what the
    migrations (`db.migrate`, reading and writing the version through `REWRITES`) start from.
    Under the store's advisory lock, so processes starting at once do not race."""
    conn = Connection(target, False)
    try:
        conn.execute("BEGIN IMMEDIATE")
        raw = conn._raw
        raw.execute(f'CREATE SCHEMA IF NOT EXISTS "{target.schema}"'.encode())
        raw.execute(b"CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        raw.execute(
            b"INSERT INTO schema_version (version) SELECT 0 "
            b"WHERE NOT EXISTS (SELECT 1 FROM schema_version)"
        )
        raw.execute(b"COMMIT")
    finally:
        conn.close()


_TEXT_COLUMN = re.compile(r"^(    \w+ TEXT)\b", re.M)


def executescript(conn: Connection, script: str) -> None:
    """A multi-statement DDL script (function bodies and all) in the current transaction: sent
    as one text with no parameters, which PostgreSQL runs statement by statement. Every TEXT
    column is made `COLLATE "C"`: text then compares and sorts by code point as SQLite's
    BINARY does, whatever the database's locale (the path ranges of `cache.local_stats` and the
    rid order depend on it)."""
    conn.execute(_TEXT_COLUMN.sub(r'\1 COLLATE "C"', script))


# -- long reads off the loop (feed snapshots) -------------------------------------------------


class AsyncReader:
    """A read-only asyncio psycopg connection with the aiosqlite subset `cache.Reading` uses:
    `execute_fetchall`, `execute` (a server-side cursor, paged with `fetchmany`), `close`."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._cursors = 0

    @classmethod
    async def open(cls, target: Target) -> AsyncReader:
        """Its connection; refused at once while the server is suspect or stalled (`Server`):
        its connecting would wait the connect timeout for nothing."""
        server_of(target).refuse(True)
        psycopg = driver()
        raw = await psycopg.AsyncConnection.connect(
            target.dsn,
            autocommit=True,
            connect_timeout=target.connect_timeout_s,
            options=_options(target),
            fallback_application_name=_application_name(target),
        )
        return cls(raw)

    async def execute_fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        if sql == "BEGIN":
            sql = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
        cursor = await self._raw.execute(translate(sql, bool(params)), params or None)
        return list(await cursor.fetchall()) if cursor.description is not None else []

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """A named (server-side) cursor: its rows come a page at a time, never all at once."""
        self._cursors += 1
        cursor = self._raw.cursor(name=f"reading{self._cursors}")
        await cursor.execute(translate(sql, bool(params)), params or None)
        return cursor

    async def close(self) -> None:
        await self._raw.close()


# -- the one applier of several replicas ------------------------------------------------------


IDLE = ("idle",)
IN_TRANSACTION = ("idle in transaction", "idle in transaction (aborted)")
_STALE_HOLDERS = """
SELECT a.pid, a.application_name, host(a.client_addr),
       round(extract(epoch FROM clock_timestamp() - a.state_change)::numeric, 1),
       pg_terminate_backend(a.pid)
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0 AND l.objsubid = 1
  AND l.objid::bigint = %(key)s AND a.pid <> pg_backend_pid() AND a.state = ANY(%(states)s)
  AND a.state_change < clock_timestamp() - make_interval(secs => %(stale)s)
"""


def end_stale_holders(raw: Any, key: int, states: Sequence[str], stale_s: float) -> list[str]:
    """End (`pg_terminate_backend`) the sessions holding the advisory lock `key` whose state
    is one of `states` and has not changed for `stale_s` seconds: sessions whose client has
    not sent a statement for that long, by the server's clock. Such a client is a process that
    does not run (SIGSTOP, a frozen host or VM) or a machine cut off while the server still
    sees its connection: the server would keep the session, and the lock, for as long as the
    process does not run (a network cut, until TCP gives up: minutes to hours). What each
    ended session was, for the log. Needs the right to end them: the same user, or one
    granted `pg_signal_backend`; another user's sessions are not even seen."""
    rows = raw.execute(
        _STALE_HOLDERS, {"key": key, "states": list(states), "stale": stale_s}
    ).fetchall()
    return [
        f"{idle} s (backend pid {pid}, {name or 'no application_name'}, from "
        f"{addr or 'a local socket'})"
        for pid, name, addr, idle, _ in rows
    ]


class SessionLock:
    """A session-level advisory lock on a connection of its own: held for as long as that
    session lives, so a replica that dies (SIGKILL, a lost machine) frees it with its session,
    and another replica's next `acquire` gets it (docs/scale-out.md, "Replicas").

    Used from one thread at a time (the applier's `asyncio.to_thread` calls)."""

    def __init__(self, target: Target, name: str) -> None:
        self.target = target
        self.key = zlib.crc32(f"metanode.{target.schema}.{name}".encode())
        self._raw: Any = None

    def acquire(self) -> bool:
        """Whether this session holds the lock now (taken now or before); never waits for it.
        A lost session is reconnected first: whatever it held went with it."""
        with self._typed():
            if self._raw is None or self._raw.closed or self._raw.broken:
                self._raw = _connect_raw(self.target)
            row = self._raw.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
        return bool(row[0])

    @contextlib.contextmanager
    def _typed(self) -> Iterator[None]:
        """A failure of the server as its typed `StorageError`: one line for the log, with
        the hint (full slots, a setting) that psycopg's several lines lack."""
        try:
            yield
        except Exception as exc:
            typed = storage_error(exc, self.target)
            if typed is None:
                raise
            raise typed from exc

    def end_stale(self, stale_s: float) -> list[str]:
        """End the session holding this lock if it has been idle `stale_s` or more
        (`end_stale_holders`): its holder checks its session every `LEAD_TRY_S`
        (`applier.Replica`), so one idle that long is a process that does not run (stopped,
        frozen) but whose session the server keeps, with the lock, for ever. Call after an
        `acquire` that did not get it; the next `acquire` then does."""
        with self._typed():
            return end_stale_holders(self._raw, self.key, IDLE, stale_s)

    def held(self) -> bool:
        """Whether the session that took the lock is still alive (a round trip), so the lock
        is still ours; a session lost meanwhile means another replica may hold it."""
        if self._raw is None or self._raw.closed or self._raw.broken:
            return False
        try:
            self._raw.execute("SELECT 1")
        except Exception as exc:
            if storage_error(exc) is None:
                raise
            return False
        return True

    def close(self) -> None:
        """End the session, and so free the lock."""
        if self._raw is not None:
            self._raw.close()


# -- backup ---------------------------------------------------------------------------------


PG_DUMP = "pg_dump"


def dump(target: Target, file: Path) -> None:
    """`pg_dump --format=custom` of the whole database of `target` (both stores' schemas)
    into `file` (`metanode backup`; restored with `pg_restore`, docs/scale-out.md). The
    password goes to pg_dump in its environment (`PGPASSWORD`), never on its command line,
    where any user's `ps` would show it."""
    tool = shutil.which(PG_DUMP)
    if tool is None:
        raise ToolMissing(
            f"backup on PostgreSQL runs `{PG_DUMP} --format=custom`, which is not installed "
            "(Debian: apt-get install postgresql-client)"
        )
    parts = urlsplit(target.dsn)
    env = dict(os.environ)
    if parts.password is not None:
        env["PGPASSWORD"] = unquote(parts.password)
    host = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}@" if parts.username else ""
    dsn = urlunsplit(parts._replace(netloc=f"{user}{host}"))
    command = [tool, "--format=custom", "--no-owner", "--no-privileges", "--file", str(file)]
    done = subprocess.run([*command, "--dbname", dsn], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        why = dump_failure(done.stderr) or f"exit {done.returncode}"
        raise StorageUnavailable(f"the database failed: {PG_DUMP} of {target.dsn_shown}: {why}")


def dump_failure(stderr: str) -> str:
    """What pg_dump said went wrong: its first `error:` line and what follows it (the detail
    and hint lines), on one line. Its last line alone was often the hint only (`Is the server
    running on that host and accepting TCP/IP connections?`), the failure itself dropped."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    start = next((n for n, line in enumerate(lines) if f"{PG_DUMP}: error:" in line), 0)
    return " ".join(lines[start : start + 4])
