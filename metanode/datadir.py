"""The data directory as a whole: private modes, the lock of the one node using it, the address
it serves at, and whether it can take writes at all.

Private, because it holds the API token, the node's signing keys and every claim: the directory
is 0700 and every file in it 0600 (SQLite would create its files 0644 under the usual umask).

Locked, because two nodes on one directory would each run an applier, a watcher and plugins
over the same databases; SQLite keeps each transaction safe, not two nodes' bookkeeping. The
offline commands (`signers`, `import`, `export`, `check`, `backup`, ...) do not take the lock:
their transactions are safe beside a running node, which picks their changes up.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from metanode import db, keys
from metanode.errors import DataDirLocked, FileFailed, MetanodeError, StorageError, storage_error

log = logging.getLogger(__name__)
LOCK_NAME = "lock"
DIR_MODE, FILE_MODE = 0o700, 0o600


def secure(data_dir: Path) -> None:
    """Create the data directory (0700), or tighten an existing one: itself and every folder in
    it to 0700, every file to 0600, each change logged. Never loosens a mode. A file where it
    should be is refused in words (mkdir's own was `File exists`, of a folder that was not)."""
    if data_dir.exists() and not data_dir.is_dir():
        raise FileFailed(
            f"{data_dir} is a file, not a folder: the data directory (--data-dir, "
            "METANODE_DATA_DIR, data_dir) names a folder"
        )
    with db.storage_errors():
        data_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        _tighten(data_dir, DIR_MODE)
        for path in _contents(data_dir):
            _tighten(path, DIR_MODE if path.is_dir() else FILE_MODE)


def write_whole(path: Path, text: str) -> None:
    """`text` as the file `path`, whole or not at all: a temporary file made whole on the disk
    (`keys.write_new`: mode 0600, as the data directory's files are, fsync'd), renamed over
    `path`, the folder fsync'd, so a crash or a full disk leaves the old file or the new one,
    never half of one. A disk that refuses is its typed `StorageError`. (The watched folders,
    the web page's sessions.)"""
    with _whole(path) as part:
        keys.write_new(part, text)


@contextlib.contextmanager
def _whole(path: Path) -> Iterator[Path]:
    """The temporary file to make whole, then renamed over `path` (`write_whole`, `serving`)."""
    part = path.with_name(path.name + ".part")
    try:
        part.unlink(missing_ok=True)
        yield part
        os.replace(part, path)
        keys.sync_folder(path.parent)
    except OSError as exc:
        raise storage_error(exc, path) or StorageError(f"cannot write {path}: {exc}") from exc


def _contents(data_dir: Path) -> Iterable[Path]:
    """The files and folders of the data directory, one level into its folders (`keys/`);
    symbolic links are left alone (chmod would change what they point at)."""
    for path in data_dir.iterdir():
        if path.is_symlink():
            continue
        yield path
        if path.is_dir():
            yield from (inner for inner in path.iterdir() if not inner.is_symlink())


def _tighten(path: Path, allowed: int) -> None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:  # a -wal or -shm that a closing connection just removed
        return
    if mode & ~allowed:
        path.chmod(mode & allowed)
        log.warning(
            "tightened %s from %o to %o: the data directory is private", path, mode, mode & allowed
        )


# What the lock file says after the holder's pid: `running` while it holds it, `stopped` once it
# let go (`Lock.release`); the same length, so the one is written over the other in place.
RUNNING, STOPPED = "running", "stopped"


class Lock:
    """An exclusive `flock` on `<data dir>/lock`, which holds the holder's pid, for as long as a
    node (`serve`, `scan`) runs. The kernel drops it when the process ends, however it ends, so
    a stale lock file never blocks a restart: `serve` simply holds it until it exits.

    The file also tells whether the last holder let go (`release`, at the end of a clean stop)
    or died holding it (SIGKILL, a crash, the machine down): `unclean` is then its pid, so a
    start can say so (the node said nothing of it)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_NAME
        self._fd = -1
        self.unclean: int | None = None  # the pid of a last holder that never let go

    def __enter__(self) -> Lock:
        return self.acquire()

    def acquire(self) -> Lock:
        """Take the lock, or raise `DataDirLocked` naming the holder's pid."""
        secure(self.data_dir)
        with db.storage_errors():
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            self._acquire(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _acquire(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            said = os.pread(fd, 32, 0).decode("ascii", "replace").split()
            raise DataDirLocked(
                f"{self.data_dir.resolve()} is in use by pid {said[0] if said else 'unknown'} "
                "(a running node: stop it first, or give another --data-dir)"
            ) from None
        said = os.pread(fd, 32, 0).decode("ascii", "replace").split()
        if said[1:] == [RUNNING] and said[0].isdigit():
            self.unclean = int(said[0])
        with db.storage_errors(self.path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {RUNNING}\n".encode("ascii"), 0)

    def release(self) -> None:
        """Let go, marking the file `stopped` first: written over `running` in place, so even a
        full disk takes it (it needs no new block); if it is not taken, the next start says the
        stop was not clean, which is all that costs."""
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, STOPPED.encode("ascii"), len(f"{os.getpid()} "))
        os.close(self._fd)  # releases the flock; the file stays, for the next holder
        self._fd = -1

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@contextlib.contextmanager
def locked(data_dir: Path) -> Iterator[Lock]:
    """The lock, for a command that may be refused before it writes anything (`serve` on a port
    in use, `restore` of a file that is no backup): a refusal leaves no directory of its own
    making behind, holding only the lock file (a mistyped `--data-dir` stayed, made 0700)."""
    new = not data_dir.exists()
    try:
        with Lock(data_dir) as lock:
            yield lock
    except MetanodeError:
        if new:
            _discard(data_dir)
        raise


def _discard(data_dir: Path) -> None:
    """Remove a data directory just made, if it holds the lock file and nothing else."""
    with contextlib.suppress(OSError):
        if [path.name for path in data_dir.iterdir()] == [LOCK_NAME]:
            (data_dir / LOCK_NAME).unlink()
            data_dir.rmdir()


SERVING_NAME = "serving"


@contextlib.contextmanager
def serving(data_dir: Path, url: str) -> Iterator[None]:
    """Record `url`, where the node on this data directory listens, in `<data dir>/serving`
    while it serves, so the client commands find it by its data directory (`served_at`): the
    port or host given to `serve` alone (`--port`, this shell's METANODE_PORT) sent them to
    the default port's "no node answers". Written whole and `flock`ed before it takes its name,
    so a reader meets no record or a whole one; removed at the stop. One that outlived its node
    (SIGKILL, a crash, the machine down) is unlocked, the kernel having let go with the process:
    `served_at` says so, rather than send a client to an address nothing may answer at."""
    path, fd = data_dir / SERVING_NAME, -1
    try:
        with _whole(path) as part:
            keys.write_new(part, f"{url}\n")
            fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX)  # nobody knows this file yet: taken at once
        yield
    finally:
        with contextlib.suppress(OSError):  # a disk gone: the record is stale with the lock
            path.unlink(missing_ok=True)
        if fd >= 0:
            os.close(fd)


@dataclass(frozen=True)
class Served:
    """What `<data dir>/serving` says: the node's `url`, and whether that node still `runs`."""

    url: str
    runs: bool


def served_at(data_dir: Path) -> Served | None:
    """The address the node serving `data_dir` recorded (`serving`), with whether it still
    runs (holds the record's lock; a shared lock taken here for a moment blocks no one, since
    the node takes its own before the record has its name); None without a record to read
    (no node started here, or it stopped cleanly, or the folder is not this user's)."""
    try:
        fd = os.open(data_dir / SERVING_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            runs = False
        except BlockingIOError:
            runs = True
        return Served(os.read(fd, 4096).decode("utf-8", "replace").strip(), runs)
    except OSError:  # not a file (a folder by that name), or no locks on this file system
        return None
    finally:
        os.close(fd)


def check_writable(paths: Iterable[db.Target]) -> None:
    """Raise the `StorageError` a write to any of these databases would meet now: `serve`
    refuses to start on a full disk or a read-only mount rather than start and fail writes."""
    for path in paths:
        db.check_writable(path)
