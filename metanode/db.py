"""Store plumbing: connections, one writer thread per database, and schema migrations.

A store's database is a `Target`: a SQLite file (a `Path`, the embedded default) or a schema of
a PostgreSQL database (a `pg.Target`, the `storage` setting). Everything here takes either: a
PostgreSQL connection (`pg.Connection`) speaks the sqlite3 subset the statements use, so the
stores hold one copy of their statements, the writer thread, group commit and the migrations
work unchanged on both (docs/scale-out.md). SQLite-only upkeep (WAL, incremental vacuum,
the backup API) is a no-op or refused on PostgreSQL.

Three paths, each where the benchmark puts it (docs/architecture.md, "Which path is which"):
* writes: a writer thread rather than aiosqlite. A write transaction in metanode is one
  synchronous function (`*_txn`) that runs start to finish under `BEGIN IMMEDIATE` on the only
  write connection, as datasette's `execute_write_fn` does. Two coroutines' statements can then
  never interleave, and a transaction never waits on the event loop while holding the write lock;
* the API's primary-key reads: a plain read-only connection on the event loop (`connect`). A
  lookup there costs microseconds, less than the thread hop aiosqlite adds to each call;
* long reads (the feed's snapshots): aiosqlite (`connect_reader`), a connection whose every call
  runs on its own thread, in order, so a cancelled caller's cleanup is queued behind the call it
  abandoned and never runs under it.

Storage failures (a full disk, a read-only mount, an I/O error, a lock held too long) are turned
into the typed `StorageError`s here, where connections open and transactions run, so every write
path reports them the same way; each `Writer` remembers its last one and probes until writes
work again (`Writer.failure`, read by `/health`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import errno
import fcntl
import functools
import logging
import os
import queue
import resource
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, closing, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, ParamSpec, Protocol, Self, TypeVar

import aiosqlite

from metanode import pg
from metanode.clock import Clock, now_ms
from metanode.config import Settings
from metanode.errors import (
    OUT_OF_FILES,
    InvalidRequest,
    MetanodeError,
    NotCommitted,
    OutOfFiles,
    SchemaTooNew,
    ShuttingDown,
    StorageCorrupt,
    StorageError,
    StorageFull,
    StorageIOError,
    StorageLocked,
    StorageReadOnly,
    out_of_files_hint,
)
from metanode.errors import storage_error as file_error

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
Txn = Callable[..., T]
Target = Path | pg.Target  # where a store's database is: a SQLite file or a PostgreSQL schema


class Cursor(Protocol):
    """What the statements read results through: a `sqlite3.Cursor` or a `pg.Cursor`."""

    @property
    def rowcount(self) -> int: ...

    @property
    def description(self) -> Any: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def fetchmany(self, size: int, /) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...

    def close(self) -> None: ...


class Connection(Protocol):
    """What the statements run on: a `sqlite3.Connection` or a `pg.Connection`."""

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, parameters: Any = ..., /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Any, /) -> Any: ...

    def close(self) -> None: ...


BUSY_TIMEOUT_MS = 30_000
# The WAL a checkpoint has emptied is cut back to this when writing starts over at its head.
# Without a limit it kept the size of the largest transaction for as long as the node ran: after
# an upgrade, the first retention run (which returns the old tables' pages) left a 206 MB
# truth.db-wal beside a truth.db shrunk from 176 to 52 MB, the data directory larger than before
# the upgrade (docs/operations.md, "Upgrading"). Four times the automatic checkpoint's 1,000
# pages: ordinary transactions never reach it, so it costs nothing but after a large one.
WAL_LIMIT_BYTES = 16 << 20
PRAGMAS = (
    f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}",
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
    f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}",
)  # every connection's, writers' and readers' alike
PROBE_S = 1.0  # while a writer's writes fail, it probes this often whether they work again
PROBE_FREE_BYTES = 1 << 20  # ...and needs this much free space: a tiny write may fit in the WAL


_SQLITE_STORAGE: tuple[tuple[str, type[StorageError]], ...] = (
    ("SQLITE_FULL", StorageFull),
    ("SQLITE_READONLY", StorageReadOnly),
    # unless the process is out of file descriptors (`OutOfFiles`), which SQLite does not say
    ("SQLITE_CANTOPEN", StorageReadOnly),
    # the WAL's index (`-shm`) could not grow: a full disk, which said `storage_io_error` (an
    # upgrade whose first start filled the disk failed so, with no word of space)
    ("SQLITE_IOERR_SHMSIZE", StorageFull),
    ("SQLITE_IOERR", StorageIOError),
    ("SQLITE_BUSY", StorageLocked),
    ("SQLITE_LOCKED", StorageLocked),
    ("SQLITE_CORRUPT", StorageCorrupt),
    ("SQLITE_NOTADB", StorageCorrupt),
)


FAILED = "the data directory failed: "  # how every storage error's message begins


def out_of_files() -> int | None:
    """EMFILE or ENFILE if this process is out of file descriptors now, else None: for the
    failures that do not say why (SQLite's "unable to open database file"). Out when the
    descriptors it holds leave fewer than a database in WAL mode opens (`SQLITE_FILES`:
    failing at its `-shm`, SQLite closes the two it had opened, so a single free one proved
    nothing), or when it cannot even list them. Asked after the failure: descriptors freed
    meanwhile make it None, and the failure keeps its other name."""
    try:
        held = len(os.listdir(OPEN_FILES)) - 1  # the listing's own descriptor is closed again
    except OSError as exc:  # none to list with, or no /proc (not Linux): then it cannot tell
        return exc.errno if exc.errno in OUT_OF_FILES else None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and held + SQLITE_FILES > soft:
        return errno.EMFILE
    return None


OPEN_FILES = "/proc/self/fd"  # one entry per descriptor this process holds
SQLITE_FILES = 3  # what opening a database in WAL mode takes: the file, its `-wal`, its `-shm`


def typed_error(exc: BaseException, where: object = None) -> MetanodeError | None:
    """A database failure as what a caller is told: a storage failure (`storage_error`), or a
    statement too large for the server to run (`pg.limit_error`: the request's error, a 400)."""
    return storage_error(exc, where) or pg.limit_error(exc)


def storage_error(exc: BaseException, where: object = None) -> StorageError | None:
    """The typed error for a storage failure (by SQLite's error name, extended names included,
    by PostgreSQL's SQLSTATE, or by errno), or None when `exc` is something else (a constraint,
    a bug) that must not be mistaken for a full disk. `where` names the file when the error
    itself does not."""
    if pg.is_driver_error(exc):
        return pg.storage_error(exc, where)
    if not isinstance(exc, sqlite3.Error):
        return file_error(exc, where)
    name = getattr(exc, "sqlite_errorname", "") or ""
    kind = next((k for prefix, k in _SQLITE_STORAGE if name.startswith(prefix)), None)
    if kind is None:
        return None
    hint = CORRUPT_HINT if kind is StorageCorrupt else ""
    if kind is StorageLocked and isinstance(where, Path) and (who := holder(where)):
        hint = f"; {who} holds it: wait for it to end, or stop it (Ctrl-C rolls it back)"
    if name.startswith("SQLITE_CANTOPEN") and (code := out_of_files()) is not None:
        kind, hint = OutOfFiles, f" ({os.strerror(code)}){out_of_files_hint(code)}"
    return kind(f"{FAILED}{f'{where}: ' if where else ''}{exc} ({name}){hint}")


HOLDER_SUFFIX = "-holder"  # beside a database: who holds its write lock for long (`Holding`)


class Holding:
    """The marker `<database>-holder`, naming who holds the database's write lock for long
    (`metanode rebuild-cache`: one transaction, 30 s on a large box), `flock`ed while it does:
    a `storage_locked` met meanwhile names it (`holder`), where it said only `database is
    locked` after the 30 s of `BUSY_TIMEOUT_MS`; a second holder is refused at once. The
    kernel drops the lock with the process, however it ends: a marker a killed one left
    names no one."""

    def __init__(self, path: Path, who: str) -> None:
        self.marker = marker_of(path)
        self.path = path
        self.who = who
        self._fd: int | None = None

    def __enter__(self) -> Self:
        with storage_errors(self.marker):
            fd = os.open(self.marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise held_by(self.path, holder(self.path) or "another process") from None
        os.ftruncate(fd, 0)
        os.write(fd, self.who.encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        self.marker.unlink(missing_ok=True)
        os.close(self._fd)  # the lock goes with the descriptor


def held_by(path: Path, who: str) -> StorageLocked:
    """The `storage_locked` of the database at `path` while `who` holds it (`Holding`)."""
    return StorageLocked(
        f"{FAILED}{path}: {who} holds it: wait for it to end, or stop it (Ctrl-C rolls it back)"
    )


def marker_of(path: Path) -> Path:
    """`Holding`'s marker of the database at `path`."""
    return path.with_name(path.name + HOLDER_SUFFIX)


def holder(path: Path) -> str | None:
    """Who `Holding` says holds the database at `path` now, or None (no marker, or one whose
    process has ended)."""
    try:
        fd = os.open(marker_of(path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # no one holds it
    except BlockingIOError:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)


CORRUPT_HINT = (
    "; cache.db is rebuilt from the truth by `metanode rebuild-cache`, a damaged truth.db is put "
    "back from a backup by `metanode restore` after saving the claims it still holds "
    "(docs/operations.md, 'A damaged or lost file')"
)


def damage(path: Path) -> str | None:
    """What SQLite's `quick_check` finds wrong with the database file `path` (its first lines,
    or the error that stopped it reading: a file that is no database), or None for a sound one
    or none at all (missing, or empty: a database not made yet). A read of every page: for the
    commands that mend a data directory (`rebuild-cache`, `check`), which must tell a damaged
    file from a sound one before they trust it. A file it cannot read at all (permissions, a
    failing disk) is that typed error."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        # read-only: `check` of a data directory it may not write read it before this
        with storage_errors(path), closing(connect_file(path, readonly=True)) as conn:
            rows = conn.execute("PRAGMA quick_check(5)").fetchall()
    except StorageCorrupt as exc:
        return str(exc.__cause__ or exc)
    said = [line for row in rows for line in str(row[0]).splitlines() if "***" not in line]
    return None if said == ["ok"] else "; ".join(said)  # one line, as every error is


def mapped(method: Callable[P, T]) -> Callable[P, T]:
    """A store's read method that raises a database failure as its typed error (`typed_error`):
    a try/except around the call (not a context manager), as cheap as the primary-key reads on
    the event loop it wraps."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(*args, **kwargs)
        except Exception as exc:  # only database failures are typed; the rest is raised as is
            typed = typed_error(exc)
            if typed is None:
                raise
            raise typed from exc

    return wrapper


@contextmanager
def storage_errors(where: object = None) -> Iterator[None]:
    """Raise a storage failure (`sqlite3.Error`, `OSError`, psycopg's) as its typed
    `StorageError`, naming the file `where` if the error does not, and a statement too large for
    the server as `TooComplex` (`typed_error`); let anything else through unchanged."""
    try:
        yield
    except Exception as exc:
        typed = typed_error(exc, where)
        if typed is None:
            raise
        raise typed from exc


def connect(
    target: Target, *, readonly: bool = False, stream: bool = False, on_loop: bool = False
) -> Connection:
    """A connection to the store's database: SQLite's (`connect_file`) or PostgreSQL's
    (`stream`: its snapshots' queries on server-side cursors; `on_loop`: the event loop's,
    whose statements a server that stops answering cannot hold for ever; `pg.Connection`). A
    SQLite file answers from this machine's disk: `on_loop` changes nothing there."""
    if isinstance(target, pg.Target):
        with storage_errors(target):
            return pg.Connection(target, readonly, stream=stream, on_loop=on_loop)
    return connect_file(target, readonly=readonly)


def connect_file(
    path: Path,
    *,
    readonly: bool = False,
    new_pragmas: Sequence[str] = (),
    busy_ms: int = BUSY_TIMEOUT_MS,
) -> sqlite3.Connection:
    """A SQLite connection with the pragmas every metanode connection needs.

    Autocommit mode (`isolation_level=None`): transactions are always explicit, so nothing begins
    one behind our back. `synchronous=FULL`: an acknowledged claim survives power loss (the
    cache's writer may relax it: `cache.CacheStore`, its `Writer`'s `pragmas`). A new
    database file is created 0600 first: SQLite gives its `-wal` and `-shm` the same mode.
    `new_pragmas` run only when this call creates the database, before anything writes its
    header (the switch to WAL does): what only an empty file takes, such as `auto_vacuum`.
    `busy_ms`: how long SQLite itself waits for a lock (`patiently` waits in Python instead).
    """
    timeout = busy_ms / 1000
    with storage_errors(path):
        new = False
        if readonly:
            conn = sqlite3.connect(
                _read_only(path),
                uri=True,
                isolation_level=None,
                check_same_thread=False,
                timeout=timeout,
            )
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                new = os.fstat(fd).st_size == 0
            finally:
                os.close(fd)
            conn = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False, timeout=timeout
            )
        try:
            for pragma in new_pragmas if new else ():
                conn.execute(pragma)
            if not readonly:
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA busy_timeout={busy_ms}")  # before any that reads the file
            for pragma in PRAGMAS:
                if not pragma.startswith("PRAGMA busy_timeout="):
                    conn.execute(pragma)
        except BaseException:
            conn.close()
            raise
    return conn


def _read_only(path: Path) -> str:
    return f"{path.resolve().as_uri()}?mode=ro"


async def connect_reader(target: Target) -> aiosqlite.Connection | pg.AsyncReader:
    """A read-only aiosqlite connection with `connect`'s pragmas, for a long read off the loop.

    Each call runs on the connection's own thread, in the order made. A caller cancelled while
    awaiting one gets the cancellation at once, and the call still runs to its end on that
    thread; whatever the caller queues next (a cursor's or the connection's `close()`) runs after
    it, so nothing ever closes the connection under a running call. A `close()` is queued before
    its first await, so even a cancelled `close()` closes. On PostgreSQL, an asyncio psycopg
    connection with the same subset (`pg.AsyncReader`).
    """
    if isinstance(target, pg.Target):
        with storage_errors(target):
            return await pg.AsyncReader.open(target)
    path = target
    with storage_errors(path):
        conn = await aiosqlite.connect(_read_only(path), uri=True, isolation_level=None)
        try:
            for pragma in PRAGMAS:
                await conn.execute_fetchall(pragma)  # fetched: no statement left open
        except BaseException:
            await conn.close()
            raise
    return conn


BUSY_RETRY_S = 0.05  # how often `Patience` tries a locked database again


class Patience:
    """SQLite's busy wait (`BUSY_TIMEOUT_MS`) for a locked database, done in Python: SQLite
    waits in C, where a Ctrl-C is not taken until the wait ends, so a `backup` waiting on a
    locked truth.db (a migration, an exclusive lock) acted on it only after 30 s. Python's
    sleep takes it at once; the deadline is SQLite's, and then it is `storage_locked`."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000

    def wait(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, tried again every `BUSY_RETRY_S` while it is `StorageLocked`."""
        while True:
            try:
                return attempt()
            except StorageLocked:
                if time.monotonic() > self.deadline:
                    raise
            time.sleep(BUSY_RETRY_S)

    def step(self, status: int, _remaining: int, _pages: int) -> None:
        """The progress callback of `sqlite3.Connection.backup`, called after every step (a
        Python call, where a pending Ctrl-C is raised, stopping the backup): a step that found
        the database locked past the deadline is `storage_locked`."""
        locked = status in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
        if locked and time.monotonic() > self.deadline:
            raise StorageLocked(f"{FAILED}{self.where}: database is locked (SQLITE_BUSY)")


def copy_database(source: Path, copy: Path, *, checked: bool = True) -> str:
    """An online copy of the database at `source` into the (existing, empty) file `copy`:
    consistent while others write, via SQLite's backup API in one step (the whole database
    as one read snapshot saw it). Returns the copy's `PRAGMA integrity_check` verdict ("ok"
    when it is sound; "ok" unchecked unless `checked`)."""
    patience = Patience(source)
    origin = patience.wait(lambda: connect_file(source, readonly=True, busy_ms=0))
    dest = sqlite3.connect(copy)
    try:
        origin.backup(dest, progress=patience.step, sleep=BUSY_RETRY_S)
        return str(dest.execute("PRAGMA integrity_check").fetchone()[0]) if checked else "ok"
    finally:
        dest.close()
        origin.close()


def copy_backup(backup: Path, dest: Path, newest: int, mark: str, what: str) -> None:
    """Copy a backup of a database (`copy_database` made it) into the empty file `dest`,
    refused (`InvalidRequest`) unless it is a sound SQLite database holding the table or view
    `mark` (the sign of `what`, the store it must be a backup of), of a schema this version
    reads (at most `newest`):
    what `metanode restore` puts in place. The backup is only read, opened immutable, so one
    on a read-only disk is read too (a WAL database opened read-only writes its `-shm`)."""
    with storage_errors(backup):
        source = sqlite3.connect(f"{backup.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    try:
        with storage_errors(dest), closing(sqlite3.connect(dest)) as copy:
            source.backup(copy)
            verdict = str(copy.execute("PRAGMA integrity_check").fetchone()[0])
            version = int(copy.execute("PRAGMA user_version").fetchone()[0])
            marked = copy.execute(
                "SELECT 1 FROM sqlite_master WHERE type IN ('table', 'view') AND name = ?",
                (mark,),
            ).fetchone()
    except StorageCorrupt:
        raise InvalidRequest(
            f"{backup} is not a backup (a damaged database, or no database)"
        ) from None
    finally:
        source.close()
    if verdict != "ok":
        raise InvalidRequest(f"{backup} failed its integrity check: {verdict}")
    if version < 1 or marked is None:
        raise InvalidRequest(f"{backup} is a database, but no backup of {what}")
    if version > newest:
        raise SchemaTooNew(
            f"{backup} is of schema {version}, newer than this metanode's ({newest}): "
            "restore it with the metanode that made it"
        )


COPY_PAGE = 2_000  # rows a `copy_table` reads and inserts at a time
# parameters a `copy_table` statement takes at most: below PostgreSQL's 65,535 and SQLite's
# 32,766 (its default since 3.32)
COPY_PARAMETERS = 30_000


def copy_table(dest: Connection, source: Connection, table: str, order: str) -> int:
    """Copy every row of `table` from a SQLite store into the same table of `dest` (in the
    current transaction; `migrate-storage`), a page at a time in `order`, by column name, so a
    column PostgreSQL keeps besides (a trigger's tsvector) fills itself; how many rows.

    A page is one INSERT of many rows, not one a row: a statement trigger (PostgreSQL's counts
    of the plugin runs, `cache.PG_SCHEMA_V7`) then runs once a page, not once a row."""
    cursor = source.execute(f"SELECT * FROM {table} ORDER BY {order}")
    columns = [d[0] for d in cursor.description]
    row = f"({', '.join('?' * len(columns))})"
    per_statement = max(1, min(COPY_PAGE, COPY_PARAMETERS // len(columns)))
    copied = 0
    while rows := cursor.fetchmany(per_statement):
        dest.execute(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([row] * len(rows))}",
            [value for values in rows for value in values],
        )
        copied += len(rows)
    return copied


def holds_rows(conn: Connection, tables: Sequence[str]) -> list[str]:
    """Which of `tables` hold at least one row."""
    return [t for t in tables if conn.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone()]


class Gate:
    """Whether one transaction committed, for work begun on its results before its COMMIT
    (`Writer.before_commit`): settled once by the writer, right after the COMMIT returns or
    fails; waited on by that work before it makes anything of those results durable itself."""

    def __init__(self) -> None:
        self._settled = threading.Event()
        self._committed = False

    def settle(self, committed: bool) -> None:
        self._committed = committed
        self._settled.set()

    def wait(self) -> None:
        """Return once the transaction has committed; raise `NotCommitted` if it did not."""
        self._settled.wait()
        if not self._committed:
            raise NotCommitted("the transaction this work began on did not commit")


# Called with a transaction's result between its last statement and its COMMIT: work that can
# begin on that result already, in another thread; the `Gate` it returns (None: no such work)
# is settled with the COMMIT's outcome.
BeforeCommit = Callable[[Any], Gate | None]


def run_txn(
    conn: Connection,
    fn: Txn[T],
    *args: Any,
    before_commit: BeforeCommit | None = None,
    where: Target | None = None,
) -> T:
    """Run `fn(conn, *args)` as one `BEGIN IMMEDIATE` transaction: all of it commits or none.

    A failing statement or COMMIT rolls back whatever SQLite has not rolled back itself (after
    SQLITE_FULL or an I/O error it may have; a failed COMMIT may leave the transaction open), so
    the connection is always usable for the next transaction. `before_commit`: see
    `BeforeCommit`; what it raises is logged and changes nothing here. `where`: the database
    a storage failure names (SQLite's "database or disk is full" names none: a refusal and
    `/health` could not tell a full truth.db from a full cache.db).
    """
    gate: Gate | None = None
    with storage_errors(where):
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn, *args)
            gate = _before_commit(before_commit, result)
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            if gate is not None:
                gate.settle(False)
            raise
    if gate is not None:
        gate.settle(True)
    return result


def _before_commit(hook: BeforeCommit | None, result: Any) -> Gate | None:
    if hook is None:
        return None
    try:
        return hook(result)
    except Exception:  # work that could not begin early begins after the COMMIT instead
        log.exception("work ahead of a COMMIT could not begin")
        return None


def _rollback(conn: Connection) -> None:
    if not conn.in_transaction:
        return
    try:
        conn.execute("ROLLBACK")
    except Exception as exc:  # the original error is the one to report
        if storage_error(exc) is None:
            log.exception("ROLLBACK failed after a failed transaction")
        else:  # the connection lost with its transaction (PostgreSQL away): said by the caller
            log.debug("ROLLBACK failed after a failed transaction: %s", exc)


def probe(conn: Connection, target: Target) -> None:
    """Raise the `StorageError` a write to the database at `target` would meet now, if any.

    Two checks: the file system has `PROBE_FREE_BYTES` free (a tiny write can still fit in the
    space a failed one left in the WAL, so it alone would report a full disk as healthy; not
    for PostgreSQL, whose disk is the server's), and a real write transaction commits (it
    rewrites `user_version` unchanged: one page).
    """
    if isinstance(target, Path):
        _check_free(target)
    run_txn(conn, _rewrite_user_version, where=target)


def read_only_disk(error: StorageError, target: Target) -> StorageError:
    """`error` as `StorageReadOnly` when it is an I/O error of a database whose file system is
    read-only now: the kernel makes ext4 so after disk errors (`errors=remount-ro`), under the
    node's open files, and SQLite's words for what its writes then meet are `disk I/O error
    (SQLITE_IOERR_WRITE)`, which said nothing of the mount nor of the way out."""
    if not isinstance(error, StorageIOError) or not isinstance(target, Path):
        return error
    if not _read_only_now(target):
        return error
    return StorageReadOnly(
        f"{FAILED}{target}: its file system is read-only now "
        f"({error.message.removeprefix(FAILED)}): mounted so, or made read-only by the kernel "
        "after disk errors (see `dmesg`); stop the node, check the disk (`fsck`), mount it "
        "read-write and start the node again (docs/operations.md, 'A full, read-only or "
        "failing disk')"
    )


def _read_only_now(path: Path) -> bool:
    """Whether the file system holding the file at `path` refuses writes as read-only: mounted
    so (`statvfs`), or made so by ext4 after an error, which `statvfs` does not show (the mount
    says `emergency_ro`) but an fsync of the file meets (EROFS), writing nothing."""
    try:
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return True
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.errno == errno.EROFS
    return False


def _check_free(path: Path) -> None:
    with storage_errors(path.parent):
        free = shutil.disk_usage(path.parent).free
    if free < PROBE_FREE_BYTES:
        raise StorageFull(
            f"the data directory failed: {path.parent} has {free} bytes free; "
            f"writes need at least {PROBE_FREE_BYTES}"
        )


def _rewrite_user_version(conn: Connection) -> None:
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    conn.execute(f"PRAGMA user_version={version}")


@contextmanager
def snapshot(conn: Connection) -> Iterator[Connection]:
    """A read transaction: every query inside sees the same committed state."""
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        conn.execute("COMMIT")


Migration = Callable[[Any], None]  # takes the store's connection (`Connection`)

# What to do about a database newer than this metanode besides upgrading it, by default (the
# truth's: its claims exist nowhere else); `Store.newer_schema_remedy` gives each store's own.
RESTORE_REMEDY = (
    "go back to what a backup taken before the upgrade holds (`metanode restore`, with the "
    "metanode that made it; docs/operations.md, 'Upgrading')"
)


def current(conn: sqlite3.Connection, newest: int, where: Target | str) -> bool:
    """Whether the SQLite database of `conn` is of schema `newest` already, read without the
    write lock that `migrate`'s transaction takes: every command opening a store migrated it
    so, and waited for a `rebuild-cache` beside it, `storage_locked` after 30 s (`check`,
    `export`, `signers`)."""
    with storage_errors(where if isinstance(where, Path) else None):
        return int(conn.execute("PRAGMA user_version").fetchone()[0]) == newest


def migrate(
    conn: Connection,
    migrations: Sequence[Migration],
    where: Target | str = "database",
    remedy: str = RESTORE_REMEDY,
) -> int:
    """Apply the migrations after `PRAGMA user_version`, each with its version bump, in one txn.

    Forward only: a database newer than this code is refused rather than guessed at, naming it
    (`where`) and what else than an upgrade brings it back (`remedy`): a user who went back to
    an older metanode read "database schema 11 is newer" and could not tell whether the truth
    or the cache was meant, nor that a newer cache is only rebuilt. Bringing an existing
    database up to date is said in the log, before and after: the first start after an upgrade
    may rewrite a large table for minutes (operations.md, "Upgrading"), and it said nothing
    meanwhile. Making a new one is not. A migration that fails (a full disk) says so, and that
    it changed nothing (`_migration_failed`): the bare "database or disk is full" named no
    file and no migration.
    """
    began = time.monotonic()
    name = str(where)
    found: list[int] = []  # the version the transaction found, for the failure's message

    def txn(conn: Connection) -> int:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        found.append(version)
        if version > len(migrations):
            raise SchemaTooNew(
                f"{name} is of schema {version}, newer than this metanode's "
                f"({len(migrations)}): upgrade metanode, or {remedy}"
            )
        if 0 < version < len(migrations):
            log.info(
                "migrating %s from schema %d to %d, in one transaction (docs/operations.md, "
                "'Upgrading')",
                name,
                version,
                len(migrations),
            )
        for number, step in enumerate(migrations[version:], start=version + 1):
            step(conn)
            conn.execute(f"PRAGMA user_version={number}")
        return version

    if isinstance(conn, sqlite3.Connection) and current(conn, len(migrations), where):
        return len(migrations)  # no write lock: a rebuild holding it made every command wait
    try:
        before = run_txn(conn, txn, where=None if isinstance(where, str) else where)
    except StorageError as exc:
        if not found or not 0 < found[-1] < len(migrations):
            raise
        raise _migration_failed(exc, where, found[-1], len(migrations)) from exc
    if 0 < before < len(migrations):
        log.info(
            "migrated %s to schema %d in %.1f s", name, len(migrations), time.monotonic() - began
        )
    return len(migrations)


def _migration_failed(exc: StorageError, where: Target | str, old: int, new: int) -> StorageError:
    """`exc`, of the same type, saying which migration it stopped and that the database is as
    it was; on a full disk, how much room the file takes and how much is free (a migration
    across several schemas rewrites tables in one transaction: docs/operations.md,
    "Upgrading", measured at about twice the file's size)."""
    message = (
        f"migrating {where} from schema {old} to {new} failed and changed nothing (it is still "
        f"schema {old}; the next start tries again): {exc.message}"
    )
    if isinstance(exc, StorageFull) and isinstance(where, Path):
        with suppress(OSError):
            size, free = where.stat().st_size, _free_once_closed(where)
            message += (
                f"; a migration across several schemas needs free disk of about twice the "
                f"file's size: the file is {size / 1e6:.0f} MB, {free / 1e6:.0f} MB are free "
                "(docs/operations.md, 'Upgrading')"
            )
    return type(exc)(message, **exc.extra)


def _free_once_closed(path: Path) -> int:
    """Bytes free on the disk of the database at `path` once it is closed: the rolled-back
    transaction's write-ahead log still fills the disk until then, and goes with the close."""
    wal = path.with_name(path.name + "-wal")
    return shutil.disk_usage(path.parent).free + (wal.stat().st_size if wal.exists() else 0)


def migrate_file(
    target: Target, migrations: Sequence[Migration], remedy: str = RESTORE_REMEDY
) -> int:
    """Create the database at `target` or bring its schema up to date (`migrate`) on a
    connection of its own (on PostgreSQL, the schema and its version row first)."""
    if isinstance(target, pg.Target):
        with storage_errors(target):
            pg.ensure_schema(target)
    conn = connect(target)
    try:
        return migrate(conn, migrations, target, remedy)
    finally:
        conn.close()


INCREMENTAL = 2  # `PRAGMA auto_vacuum`'s value for INCREMENTAL


def make_incremental(path: Path) -> bool:
    """Put the database at `path` in `auto_vacuum=INCREMENTAL` mode, so that freed pages can be
    given back to the file system (`reclaim`); whether it is in that mode now.

    A database this call creates is made so at once. An existing one switches only through a
    `VACUUM`, once: it rewrites the file (time and free space in proportion to its size). If
    that fails (a full disk, a reader holding it), it is logged and the database goes on as it
    was: its freed pages are still reused, only never returned; the next start tries again."""
    conn = connect_file(path, new_pragmas=(f"PRAGMA auto_vacuum={INCREMENTAL}",))
    try:
        if int(conn.execute("PRAGMA auto_vacuum").fetchone()[0]) == INCREMENTAL:
            return True
        log.info("switching %s to incremental vacuum (one VACUUM)", path)
        conn.execute(f"PRAGMA auto_vacuum={INCREMENTAL}")
        conn.execute("VACUUM")
        return True
    except sqlite3.Error as exc:
        log.warning("could not switch %s to incremental vacuum (%s); will retry", path, exc)
        return False
    finally:
        conn.close()


def reclaim(conn: Connection, reserve_pages: int) -> int:
    """Give the free pages beyond `reserve_pages` back to the file system (in the current write
    transaction; a no-op unless the database is in incremental mode); returns how many. The
    reserve absorbs the next writes without growing the file again at once. On PostgreSQL
    nothing: autovacuum makes the space of deleted rows reusable."""
    if not isinstance(conn, sqlite3.Connection):
        return 0
    free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    # One page per execution: the pragma frees a page per step, and Python's sqlite3 steps a
    # statement without result columns only once (≈ 6 µs a page).
    cursor = conn.cursor()
    try:
        for _ in range(free - reserve_pages):
            cursor.execute("PRAGMA incremental_vacuum(1)")
    finally:
        cursor.close()
    return max(0, free - reserve_pages)


def check_writable(target: Target) -> None:
    """Raise the `StorageError` a write to the database at `target` would meet now, if any."""
    conn = connect(target)
    try:
        probe(conn, target)
    finally:
        conn.close()


def executescript_in_txn(conn: Connection, script: str) -> None:
    """Run a multi-statement schema script inside the current transaction.

    `sqlite3.executescript` would COMMIT first; splitting on `;` is safe for our own DDL, which
    keeps statements and triggers free of string literals holding semicolons. PostgreSQL takes
    the script whole (`pg.executescript`).
    """
    if isinstance(conn, pg.Connection):
        pg.executescript(conn, script)
        return
    for statement in _split_sql(script):
        conn.execute(statement)


def _split_sql(script: str) -> list[str]:
    statements, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    if current.strip():
        statements.append(current.strip())
    return statements


_STOP = object()
GROUP_MAX = 2_000  # units (claims) one group transaction holds at most
GROUP_DEADLINE_S = 0.005  # ...and the longest a writer spends gathering one
# Under `serve --workers N` the requests a reader hands over reach the owner's truth writer
# just after the owner's own, and made a group of their own: two transactions where one would
# do, ≈ 4 one-claim batches a transaction with 8 clients instead of 8. So there a group of
# small batches smaller than the largest of the last `RECENT_S` waits up to `STRAGGLER_S` for
# the next (`Writer._straggler`, `Store.expect_stragglers`); one process does not wait: its
# late batch commits beside the group's apply, and waiting for it measured slower there
# (docs/benchmarks.md, "Session 23").
STRAGGLER_S = 0.001
RECENT_S = 1.0
STRAGGLER_UNITS = 64  # claims: a group holding more waits for nobody


# A grouped job's work that needs no transaction (`Writer.submit_grouped`): `prepare(*args)`
# gives the arguments its transaction function is then called with.
Prepare = Callable[..., tuple[Any, ...]]


@dataclass(frozen=True)
class _Job:
    """One queued transaction; jobs of one `group` queued together share a transaction."""

    future: concurrent.futures.Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    group: str | None = None
    units: int = 1
    prepare: Prepare | None = None
    queued_at: float = dataclasses.field(default_factory=time.monotonic)
    bundled: bool = False  # queued with others as one (`Writer.submit_together`)


Outcome = tuple[bool, Any]  # (True, a job's result) or (False, the exception it failed with)
# Runs many queued jobs of one transaction function as one call: `combine(conn, [job args…])`
# gives each job's `Outcome`, in order, as if each had run in turn under its own savepoint.
Combiner = Callable[[Connection, Sequence[tuple[Any, ...]]], list[Outcome]]


def _savepoints(conn: Connection, jobs: Sequence[_Job], first: bool) -> list[Outcome]:
    """Each job as if under its own savepoint (`_attempt`); `first`: nothing precedes these
    jobs in the transaction."""
    return [_attempt(conn, first and not n, job.fn, *job.args) for n, job in enumerate(jobs)]


# How `_attempt` undoes a job that failed: the whole transaction when it was the first work (and
# begins it again), else back to the job's savepoint.
_UNDO = {True: ("ROLLBACK", "BEGIN IMMEDIATE"), False: ("ROLLBACK TO job", "RELEASE job")}


def _attempt(conn: Connection, first: bool, fn: Callable[..., T], *args: Any) -> Outcome:
    """`fn(conn, *args)` under a savepoint: (True, result), or rolled back, (False, exception);
    a storage failure is raised (SQLite may have rolled back the whole transaction).

    The transaction's `first` work takes no savepoint: nothing precedes it, so rolling the
    whole transaction back and beginning it again undoes exactly it. A savepoint is not free:
    SQLite copies every page the work changes into its sub-journal, which cost a one-claim group
    of 8 about a fifth of its truth transaction (docs/benchmarks.md, "Session 14"), and on
    PostgreSQL it is two more round trips."""
    if not first:
        conn.execute("SAVEPOINT job")
    try:
        result = fn(conn, *args)
    except Exception as exc:
        if storage_error(exc) is not None or not conn.in_transaction:
            raise
        for statement in _UNDO[first]:
            conn.execute(statement)
        return False, exc
    if not first:
        conn.execute("RELEASE job")
    return True, result


def _runs(jobs: Sequence[_Job]) -> Iterator[list[_Job]]:
    """The jobs in maximal runs of one transaction function, in order."""
    run: list[_Job] = []
    for job in jobs:
        if run and job.fn is not run[0].fn:
            yield run
            run = []
        run.append(job)
    if run:
        yield run


def _group_txn(
    conn: Connection, jobs: Sequence[_Job], combiners: Mapping[Callable[..., Any], Combiner]
) -> list[Outcome]:
    """A group's jobs in one transaction: each run of one function that has a combiner as one
    combined call under one savepoint (one pass of statements for many requests instead of
    one per request); if that call raises, it is rolled back and its jobs run one by one under
    their own savepoints, so a failing job still fails alone. Other jobs: `_savepoints`. What
    runs first in the transaction needs no savepoint (`_attempt`): a group of one-claim
    requests usually takes none at all."""
    outcomes: list[Outcome] = []
    for run in _runs(jobs):
        first = not outcomes
        combine = combiners.get(run[0].fn) if len(run) > 1 else None
        together = (
            None if combine is None else _attempt(conn, first, combine, [j.args for j in run])
        )
        if together is not None and together[0]:
            outcomes += together[1]
        else:
            outcomes += _savepoints(conn, run, first)
    return outcomes


def _unseen(exc: OSError, path: Path) -> StorageError:
    """What `LogWatch.look` says of a log file it cannot look at."""
    typed = file_error(exc, path) or StorageIOError(f"{FAILED}{path}: {exc.strerror or exc}")
    return type(typed)(
        f"{typed.message} (writes go on through the files the node holds open, but it would "
        "not start again so)"
    )


class LogWatch:
    """The `-wal` and `-shm` of a SQLite database as its writer found them. Removed while the
    node ran (a careless `rm`, a clean-up script), they stay open, unlinked: the writer went on
    committing into a log no longer in the folder, so every commit since its last checkpoint
    was lost at a kill or a power loss (1,000 acknowledged claims, tried), and a command
    started meanwhile made new ones beside a node that did not read them. Seen after a commit
    (`look`: two `stat`s), the log is checkpointed into the database file at once, saving
    what it held, and every later write is refused (`refuse`) until the node is started
    again, which makes new ones. Nothing to watch on PostgreSQL."""

    def __init__(self, target: Target) -> None:
        ends = ("-wal", "-shm") if isinstance(target, Path) else ()
        self.paths = [Path(f"{target}{end}") for end in ends]
        self.seen: dict[Path, tuple[int, int]] = {}
        self.lost: StorageError | None = None

    def refuse(self) -> None:
        if self.lost is not None:
            raise self.lost

    def look(self, conn: Connection) -> StorageError | None:
        """See whether the logs are still the ones found first (`_lose` if not). One that
        cannot be looked at (the data directory's owner or mode changed under the node: a
        `chown -R root`) is returned as its typed error, for `/health`: the commit stands, as
        the node writes on through the files it holds open. Raised, it answered that commit
        500 `internal_error` though it was stored, and failed every write after."""
        for path in self.paths:
            try:
                info = path.stat()
                now: tuple[int, int] | None = (info.st_dev, info.st_ino)
            except FileNotFoundError:
                now = None
            except OSError as exc:
                return _unseen(exc, path)
            first = self.seen.get(path)
            if first is None and now is not None:
                self.seen[path] = now
            elif first is not None and now != first and self.lost is None:
                self._lose(conn, path)
        return None

    def _lose(self, conn: Connection, path: Path) -> None:
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()
        saved = "copied into the database file" if busy == 0 else "NOT all copied (busy)"
        self.lost = StorageIOError(
            f"the data directory failed: {path} was removed (or replaced) while the node ran: "
            f"the commits it held were {saved}, and writes are refused until the node is "
            "started again, which makes a new one (docs/operations.md, 'A damaged or lost "
            "file')"
        )
        log.error("%s", self.lost.message)


class Writer:
    """The single writer of one database: a thread that owns the only write connection.

    `run(fn, *args)` (async) and `run_sync(fn, *args)` (from other threads) queue `fn(conn, *args)`
    and return its result once it has committed. Jobs run one at a time, in order.

    Group commit: jobs submitted with the same `group` name that are queued one behind the other
    run in ONE transaction (`_gather`, `_run_group`), each as if under its own savepoint, so
    concurrent requests share one fsync'd COMMIT; each still gets its result only after that
    COMMIT, and a job that fails is rolled back alone. A transaction function with a `Combiner`
    (`combiners`) runs a run of its queued jobs as one call (`_group_txn`). A grouped job's
    `prepare` runs on this thread before the group's `BEGIN` (`_ready`). `before_commit` (if
    set) gets a group's outcomes before its COMMIT, to begin work on them meanwhile
    (`BeforeCommit`). Jobs queued together (`submit_together`: the claims of plugin runs that
    ended close together) are taken as one item, so they share a transaction (up to
    `GROUP_MAX`) however the writer's thread and the caller's interleave.
    `groups` counts the group transactions, `grouped` the jobs they held (/metrics).

    `failure` is the last `StorageError` a job met, until a probe (every `PROBE_S`, between
    jobs, on this thread) finds writes working again: so `/health` recovers by itself once the
    disk has space, without waiting for a client's write to succeed first.
    """

    def __init__(
        self,
        target: Target,
        name: str,
        combiners: Mapping[Callable[..., Any], Combiner] | None = None,
        pragmas: Sequence[str] = (),
    ) -> None:
        self.path = target
        self.combiners = dict(combiners or {})  # transaction function → its `Combiner`
        self.before_commit: BeforeCommit | None = None  # a group's, given its outcomes
        self.conn = connect(target)
        for pragma in pragmas:  # before the thread: some may not change inside a transaction
            self.conn.execute(pragma)
        self.failure: StorageError | None = None
        self.logs = LogWatch(target)
        self._next_probe = 0.0
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._held: Any = None  # a job `_gather` took but left for the next turn
        self._bundled: collections.deque[_Job] = collections.deque()  # of `submit_together`
        self._since: float | None = None  # when the job being run was queued (`backlog`)
        self._largest = (0, 0.0)  # the largest group of late, and when it was last that large
        self.straggler_s = 0.0  # how long a group smaller than of late waits for the next job
        self.groups = 0  # group transactions committed or tried
        self.grouped = 0  # ...and the jobs they held
        # told of each group as it is run, with its jobs' count: the node's /metrics counters,
        # which (unlike the two above) outlive a worker's restart (metrics.py)
        self.on_group: Callable[[int], None] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"{name}-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._held if self._held is not None else self._next_job()
            self._held = None
            if job is None:
                self._probe()
                continue
            if job is _STOP:
                break
            self._since = job.queued_at
            try:
                self._work(job)
            finally:
                self._since = None
        self._empty_wal()
        self.conn.close()

    def _work(self, job: _Job) -> None:
        """Run `job` (with the jobs of its group queued behind it) and answer its future."""
        if job.group is not None:
            self._run_group(self._gather(job))
            return
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(self._txn(job.fn, *job.args))
        except BaseException as exc:
            self._fail(job.future, exc)

    def _txn(self, fn: Txn[T], *args: Any, before_commit: BeforeCommit | None = None) -> T:
        """`run_txn` on this writer's connection, refused once its log files were removed, and
        looking at them after each commit, before anyone is answered (`LogWatch`)."""
        self.logs.refuse()
        result = run_txn(self.conn, fn, *args, before_commit=before_commit, where=self.path)
        if (unseen := self.logs.look(self.conn)) is not None:
            self._failed(unseen)  # committed: said in /health, not to whoever asked
        return result

    def backlog(self) -> tuple[int, float]:
        """(the jobs not yet committed, the one being run included; how many seconds the
        oldest of them has waited): what /health shows of a disk too slow for what is asked of
        it, where writes wait while reads are answered (operations.md, "Small boxes")."""
        since = self._since
        working = since is not None
        waited = time.monotonic() - since if since is not None else 0.0
        return self.queued() + working, waited

    def _empty_wal(self) -> None:
        """At close, copy the WAL into the database file and truncate it. SQLite deletes the
        WAL when the last connection closes, but only a writable one may: the loop's read-only
        connection, closed after this one, left it behind, and a backup later put in place of
        truth.db (operations.md) had that stale log replayed onto it at the next open. Never a
        wait: with another process reading (a command beside a running node, or the node
        beside a long export) the checkpoint would hold the write lock for the busy timeout,
        30 s of every other writer's time; then the WAL is left as it is (`restore` moves it
        aside with the file)."""
        if isinstance(self.path, pg.Target):
            return
        try:
            self.conn.execute("PRAGMA busy_timeout=0")
            emptied = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
        except sqlite3.Error:
            emptied = False
        if not emptied:
            log.debug("%s: the WAL was left at close (another connection reads it)", self.path)

    def _fail(self, future: concurrent.futures.Future[Any], exc: BaseException) -> None:
        if isinstance(exc, StorageError):
            exc = read_only_disk(exc, self.path)
            self._failed(exc)
        future.set_exception(exc)

    def _gather(self, first: _Job) -> list[_Job]:
        """`first` and the jobs of its group queued right behind it, each made ready (`_ready`):
        what one transaction commits, bounded by `GROUP_MAX` units (claims) and
        `GROUP_DEADLINE_S`; the first job of another kind is held back for the next turn, so
        order is kept. Only what is queued, never a wait for more: a lone request pays no
        latency for the grouping. Jobs queued while the earlier ones are prepared join too, so
        with 8 one-claim clients a transaction holds ≈ 7 of them (docs/benchmarks.md, "Small
        batches validated on the truth writer"), sharing its fixed cost (the COMMIT, the
        cache's apply). The rest of a bundle (`submit_together`) joins whatever the deadline:
        it was queued whole, and on a busy machine one thread switch passes 5 ms."""
        jobs: list[_Job] = []
        units, job = 0, first
        deadline = time.monotonic() + GROUP_DEADLINE_S
        while True:
            ready = self._ready(job)
            if ready is not None:
                jobs.append(ready)
                units += ready.units
            late = time.monotonic() >= deadline and not self._bundled
            if units >= GROUP_MAX or late:
                return jobs
            try:
                job = self._get(block=False)
            except queue.Empty:
                requests = sum(not each.bundled for each in jobs)  # a bundle foretells nothing
                job = self._straggler(requests, units, deadline)
                if job is None:
                    self._gathered(requests)
                    return jobs
            if job is _STOP or job.group != first.group:
                self._held = job
                return jobs

    def _straggler(self, gathered: int, units: int, deadline: float) -> Any:
        """The next job, if the group of small batches being gathered is smaller than the
        largest of the last `RECENT_S` (so more are on their way): waited for up to
        `straggler_s` (0 unless `Store.expect_stragglers`), never past `deadline`. None
        otherwise: a lone request, or a stream of lone ones, never waits."""
        largest, _ = self._largest
        if gathered >= largest or units >= STRAGGLER_UNITS:
            return None
        return self._within(min(self.straggler_s, deadline - time.monotonic()))

    def _gathered(self, size: int) -> None:
        """Remember a group's size: the largest of late is expected again for `RECENT_S`."""
        now = time.monotonic()
        largest, since = self._largest
        if size >= largest or now - since > RECENT_S:
            self._largest = (size, now)

    def _ready(self, job: _Job) -> _Job | None:
        """`job` as its transaction runs it, with the arguments its `prepare` gave; None if it
        was cancelled, or if `prepare` raised (its future then fails with that, alone)."""
        if not job.future.set_running_or_notify_cancel():
            return None
        if job.prepare is None:
            return job
        try:
            return dataclasses.replace(job, args=job.prepare(*job.args), prepare=None)
        except BaseException as exc:
            job.future.set_exception(exc)
            return None

    def _run_group(self, jobs: list[_Job]) -> None:
        """Run the ready jobs of a group in one transaction, each as if under a savepoint of its
        own (`_group_txn`): a job that raises is rolled back alone and fails alone; the others
        commit together, and each future is answered only after the COMMIT. A storage failure
        (a full disk) or a failed COMMIT fails every job: nothing of the group is durable."""
        if not jobs:
            return
        self.groups += 1
        self.grouped += len(jobs)
        if self.on_group is not None:
            self.on_group(len(jobs))
        try:
            outcomes = self._txn(_group_txn, jobs, self.combiners, before_commit=self.before_commit)
        except BaseException as exc:
            for job in jobs:
                self._fail(job.future, exc)
            return
        for job, (ok, value) in zip(jobs, outcomes, strict=True):
            if ok:
                job.future.set_result(value)
            else:
                job.future.set_exception(value)

    def _next_job(self) -> Any:
        """The next queued job; None when a probe is due first (only while writes fail: even
        under a steady stream of jobs, so a failure is never left standing after they work)."""
        if self.failure is None:
            return self._get()
        return self._within(self._next_probe - time.monotonic())

    def _within(self, seconds: float) -> Any:
        """The next queued job, waited for up to `seconds`; None if none came in time."""
        if seconds <= 0 and not self._bundled:
            return None
        try:
            return self._get(timeout=max(seconds, 0.0))
        except queue.Empty:
            return None

    def _get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next queued job (`queue.Empty` as `SimpleQueue.get`): a bundle's
        (`submit_together`) one at a time, before anything queued after it."""
        if self._bundled:
            return self._bundled.popleft()
        item = self._jobs.get(block, timeout)
        if isinstance(item, tuple):
            self._bundled.extend(item[1:])
            return item[0]
        return item

    def _failed(self, exc: StorageError) -> None:
        if self.failure is None:
            log.error(
                "writes to %s fail (%s: %s); probing every %g s until they work",
                self.path,
                exc.slug,
                exc.message,
                PROBE_S,
            )
        self.failure = exc
        self._next_probe = time.monotonic() + PROBE_S

    def _probe(self) -> None:
        if self.logs.lost is not None:  # no probe mends it: a restart does
            self._failed(self.logs.lost)
            return
        try:
            probe(self.conn, self.path)
            unseen = self.logs.look(self.conn)
        except StorageError as exc:
            self._failed(read_only_disk(exc, self.path))
            return
        except Exception:  # not a storage failure: keep the one we know, never kill the thread
            log.exception("probing writes to %s failed", self.path)
            self._next_probe = time.monotonic() + PROBE_S
            return
        if unseen is not None:
            self._failed(unseen)
            return
        log.warning("writes to %s work again", self.path)
        self.failure = None

    def queued(self) -> int:
        """How many jobs wait (an approximate figure, for tests and gauges: a bundle counts
        as one until the writer takes it)."""
        return self._jobs.qsize() + len(self._bundled) + (self._held is not None)

    def submit(self, fn: Txn[T], *args: Any) -> concurrent.futures.Future[T]:
        return self.submit_grouped(None, 1, fn, *args)

    def submit_grouped(
        self, group: str | None, units: int, fn: Txn[T], *args: Any, prepare: Prepare | None = None
    ) -> concurrent.futures.Future[T]:
        """Queue `fn(conn, *args)`; with a `group`, it may share a transaction with the jobs of
        that group queued next to it (`units`: its share of `GROUP_MAX`). `prepare`: work on
        `args` that needs no transaction (a batch's validation), done on this writer's thread
        as the group is gathered, before its `BEGIN`: no hop to another thread and back, and
        no lock held meanwhile; what it raises fails this job alone."""
        if self._closed:
            raise ShuttingDown("the node is shutting down; nothing was written")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put(_Job(future, fn, args, group, units, prepare))
        return future

    def submit_together(
        self, group: str, work: Sequence[tuple[int, Txn[T], tuple[Any, ...], Prepare | None]]
    ) -> list[concurrent.futures.Future[T]]:
        """Queue the jobs `(units, fn, args, prepare)` of `group` as ONE item, so the writer takes
        them in one turn and they share a transaction (each still under its own savepoint, or
        combined), bounded by `GROUP_MAX` units alone. Submitted one by one from the event
        loop, the writer's thread could take the first before the next was queued, and
        `GROUP_DEADLINE_S` could pass on a busy machine: a split group, two COMMITs."""
        if self._closed:
            raise ShuttingDown("the node is shutting down; nothing was written")
        jobs = tuple(
            _Job(concurrent.futures.Future(), fn, args, group, units, prepare, bundled=True)
            for units, fn, args, prepare in work
        )
        if jobs:
            self._jobs.put(jobs)
        return [job.future for job in jobs]

    async def run(self, fn: Txn[T], *args: Any) -> T:
        """Run a transaction function on the writer thread and await its committed result.

        If the awaiting request is cancelled the transaction still runs to its end (or not at
        all): a job is never abandoned half-way.
        """
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn, *args)))

    async def run_grouped(
        self, group: str | None, units: int, fn: Txn[T], *args: Any, prepare: Prepare | None = None
    ) -> T:
        """`run`, sharing a transaction with the jobs of `group` queued beside it
        (`submit_grouped`)."""
        future = self.submit_grouped(group, units, fn, *args, prepare=prepare)
        return await asyncio.shield(asyncio.wrap_future(future))

    async def run_together(
        self, group: str, work: Sequence[tuple[int, Txn[T], tuple[Any, ...], Prepare | None]]
    ) -> list[T | BaseException]:
        """`submit_together`, awaited: each job's result, or the exception it failed with, in
        order, once their transaction has committed (or failed)."""
        waits = [asyncio.shield(asyncio.wrap_future(f)) for f in self.submit_together(group, work)]
        return list(await asyncio.gather(*waits, return_exceptions=True))

    def run_sync(self, fn: Txn[T], *args: Any) -> T:
        return self.submit(fn, *args).result()

    def close(self) -> None:
        """Finish the queued jobs, then stop; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_STOP)
        self._thread.join()


SPARE_READERS = 4  # SQLite read connections a store keeps for its next reads (`Spares`)


class Spares:
    """The SQLite read connections `Store.reading` lends, kept open for the next read rather
    than closed. A new connection costs its open and a read of the schema, and, in a node run
    as root (a systemd unit without `User=`, a container's root), SQLite's `fchown` of the WAL
    to the database's owner, which changes the file's inode however little else happens: a
    journal commit on the data directory's disk for every /metrics scrape (two connections),
    every rescan and every plugin run. On an idle node scraped every 15 s that was ≈ 590 write
    requests an hour to an SD card that had nothing else to write (operations.md, "Small
    boxes"). At most `SPARE_READERS` are kept, each with its page cache let go (`shrink_memory`:
    a scan would leave 2 MiB in each); one a read left in a transaction or with an error is
    closed, never lent again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> sqlite3.Connection:
        """A kept connection, or a new one."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return connect_file(self.path, readonly=True)

    def give_back(self, conn: sqlite3.Connection, clean: bool) -> None:
        """Keep `conn` for the next read if its read ended `clean`ly, outside a transaction,
        and there is room; close it otherwise."""
        keep = clean and not conn.in_transaction and _let_go(conn)
        with self._lock:
            if keep and not self._closed and len(self._idle) < SPARE_READERS:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _let_go(conn: sqlite3.Connection) -> bool:
    """Free `conn`'s page cache; False if it fails (the connection is then not kept)."""
    try:
        conn.execute("PRAGMA shrink_memory")
    except sqlite3.Error:
        return False
    return True


class Store:
    """What the two stores (`truth.TruthStore`, `cache.CacheStore`) share: one database (a
    SQLite file or a PostgreSQL schema: `path`, a `Target`), its schema (`migrations`, or
    `pg_migrations` on PostgreSQL), its one writer thread and the event loop's read connection;
    `open()` and `close()`, or a `with` block. Each store adds the statements of its database."""

    name: ClassVar[str]  # the writer thread's name, and the PostgreSQL schema's
    migrations: ClassVar[Sequence[Migration]]
    combiners: ClassVar[Mapping[Callable[..., Any], Combiner]] = {}  # its writer's (`Writer`)
    pg_migrations: ClassVar[Sequence[Migration]]

    def __init__(self, path: Target, clock: Clock = now_ms) -> None:
        self.path = path
        self._clock = clock
        self._writer: Writer | None = None
        self._reader: Connection | None = None
        self._pool: pg.Pool | None = None
        self._spares = Spares(path) if isinstance(path, Path) else None  # `reading`'s

    @classmethod
    def configured(cls, settings: Settings, clock: Clock = now_ms, **options: Any) -> Self:
        """The store where `settings` keep it (`storage`, `data_dir`: `target`), not opened;
        `options` are the store's own (`cache.CacheStore`'s `relaxed`)."""
        return cls(
            target(settings.data_dir, settings.storage, cls.name, settings), clock, **options
        )

    def migrate(self) -> None:
        """Create the database or bring its schema up to date (forward only)."""
        pg_target = isinstance(self.path, pg.Target)
        migrations = self.pg_migrations if pg_target else self.migrations
        migrate_file(self.path, migrations, self.newer_schema_remedy())

    def newer_schema_remedy(self) -> str:
        """What brings back a database of this store that a newer metanode migrated, besides
        upgrading again (`migrate`'s refusal says it): the truth's, a backup's restore."""
        return RESTORE_REMEDY

    def open(self) -> Self:
        """Migrate, start the writer thread, open the loop's read connection (and on
        PostgreSQL the pool of `reading()`)."""
        self.migrate()
        self._writer = Writer(self.path, self.name, self.combiners, self._writer_pragmas())
        self._reader = connect(self.path, readonly=True, on_loop=True)
        if isinstance(self.path, pg.Target):
            with storage_errors(self.path):
                self._pool = pg.Pool(self.path)
        return self

    def held(self, who: str) -> AbstractContextManager[object]:
        """Say, while the block runs, that `who` holds this store's write lock for long
        (`Holding`; on PostgreSQL nothing: its lock waits name no file)."""
        return Holding(self.path, who) if isinstance(self.path, Path) else nullcontext()

    def holder(self) -> str | None:
        """Who `held` says holds this store now (`holder`), or None."""
        return holder(self.path) if isinstance(self.path, Path) else None

    def snapshot_to(self, copy: Path) -> None:
        """An online, consistent copy of this SQLite database into `copy` (not checked: for
        `check`, which reads its stores whole for damage first and compares copies of both,
        each one snapshot, taken in the order the node commits them: the cache's, then the
        truth's). The store need not be open."""
        assert isinstance(self.path, Path), "a SQLite store is copied"
        with storage_errors(self.path):
            copy_database(self.path, copy, checked=False)

    def _writer_pragmas(self) -> Sequence[str]:
        """Pragmas of the writer's connection beyond `PRAGMAS` (`CacheStore`'s relaxed
        commits), run on it before its first transaction."""
        return ()

    def expect_stragglers(self) -> None:
        """Let a group of small batches wait for the next one (`STRAGGLER_S`) while it is
        smaller than the groups of late: for the owner of `serve --workers N`, whose readers'
        batches arrive just after its own."""
        self.writer.straggler_s = STRAGGLER_S

    @contextmanager
    def reading(self, lent: bool = True) -> Iterator[Connection]:
        """A read-only connection of its own, for one read off the event loop (a thread, the
        CLI): on SQLite one of its `Spares` (taken back after), on PostgreSQL one lent by the
        pool (a new one when not open). `lent=False`: on PostgreSQL a new connection, opened
        for this read alone and closed after, for a periodic read that must never wait for the
        pool (its 8 connections may be taken by long reads: exports, reconciliation, plugin
        threads) nor leave one more connection open in it (the /metrics counts)."""
        spares = self._spares
        with storage_errors(self.path):
            if spares is not None:
                conn: Connection = spares.take()
            elif self._pool and lent:
                conn = self._pool.connection()
            else:
                conn = connect(self.path, readonly=True, stream=True)
        clean = False
        try:
            yield conn
            clean = True
        finally:
            if spares is not None and isinstance(conn, sqlite3.Connection):
                spares.give_back(conn, clean)
            else:
                conn.close()

    def stop_writes(self) -> None:
        """Finish the queued transactions and stop the writer; later writes raise ShuttingDown."""
        if self._writer is not None:
            self._writer.close()

    def close(self) -> None:
        """Stop writing, then close the read connections."""
        self.stop_writes()
        if self._reader is not None:
            self._reader.close()
        if self._spares is not None:
            self._spares.close()
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Self:
        """Open it, unless it is open already (`maintenance.truth_store` hands out an opened
        store for a `with` block: opening it twice would leak the first connections)."""
        return self if self._writer is not None else self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def failure(self) -> StorageError | None:
        """The last storage failure of a write, until writes work again (`/health`)."""
        return None if self._writer is None else self._writer.failure

    @property
    def writer(self) -> Writer:
        assert self._writer is not None, "the store is not open"
        return self._writer

    @property
    def conn(self) -> Connection:
        """The event loop's read connection (for the store's module and the tests only)."""
        assert self._reader is not None, "the store is not open"
        return self._reader


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> int | None:
    """This boot of the machine as a number from 1 to 2^60 (Linux's random boot id; None where
    there is none): what tells a restart of metanode from a restart of the machine, which may
    have lost what the operating system had not yet written to the disk."""
    try:
        text = BOOT_ID.read_text(encoding="ascii").replace("-", "").strip()
        return int(text[:15], 16) + 1
    except (OSError, ValueError):
        return None


def target(data_dir: Path, storage: str, name: str, settings: Settings | None = None) -> Target:
    """Where store `name` keeps its database: `<data_dir>/<name>.db` (`storage` "sqlite"), or
    the PostgreSQL schema `name` of the database `storage` names, waited for as `settings`
    say (`pg_stall_s`, `pg_connect_timeout_s`; their defaults without)."""
    if not pg.is_dsn(storage):
        return data_dir / f"{name}.db"
    if settings is None:
        return pg.Target(storage, name)
    return pg.Target(storage, name, settings.pg_stall_s, settings.pg_connect_timeout_s)
