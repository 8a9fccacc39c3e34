"""The watcher: keeps `local_file` and the records' local keys true to the disk (SPEC §6).

Three sources of truth about the disk, one way to act on them:

* a full reconciliation at start (and every `watch_rescan_s`, for network mounts and missed
  events): a walk compared with `local_file` — an unchanged `Stat` (size, mtime, and the
  inode's ctime and number, which a write moves even when it puts the size and mtime back)
  costs a stat, new or changed files are hashed, vanished paths are removed;
* inotify (watchfiles) between scans: touched paths wait until they have settled;
* a file is hashed only once its stat stayed the same for the settle window, off the
  event loop, a bounded number at a time; if it changed while being hashed it waits again.

Each batch of results is applied in the documented order: the midhashes' groups in the truth
(minted if new), then `local_file` and the local keys with their feed events in one cache
transaction (`cache.local_txn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import resource
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import watchfiles

from metanode import cid as cids
from metanode import datadir, logs
from metanode.errors import OUT_OF_FILES, MidhashError, StorageError
from metanode.ignores import UNKNOWN_CTIME, Rules, Stat, is_text, stat_from
from metanode.merge import LocalFile

log = logging.getLogger(__name__)

BATCH = 256
TICK_S = 0.25
WATCH_LAID_S = 30.0  # the longest a reconciliation waits for an inotify watch to stand
PROGRESS_LOG_S = 30.0  # how often a long reconciliation says how far it is in the log

EnsureGroups = Callable[[Sequence[str]], Awaitable[None]]
ApplyLocal = Callable[[Sequence[LocalFile], Sequence[str]], Awaitable[None]]
KnownStats = Callable[[Sequence[str]], dict[str, Stat]]  # the rows at or below these paths
FillCtimes = Callable[[Mapping[str, Stat]], Awaitable[None]]  # `cache.fill_ctimes_txn`


# A folder made deep enough (by relative paths, as a copy of a deep tree does) holds paths
# longer than Linux's PATH_MAX: no call that takes a path reaches them, nor WebDAV, `/file`
# or a plugin. Said once a folder, which was skipped without a word.
TOO_LONG = (
    "skipping what %s holds: its paths are longer than the system takes (PATH_MAX, 4,096 "
    "bytes), so nothing can open them"
)


def abridged(path: str, ends: int = 100) -> str:
    """`path`'s first and last `ends` characters: enough of a path of 4,000 bytes to find it."""
    return path if len(path) <= 2 * ends else f"{path[:ends]}…{path[-ends:]}"


def shown_path(path: str) -> str:
    """A path as the log and the pages name it, on one line: its bytes that are not UTF-8 as
    `\\xNN` (`/srv/media/Am\\xe9lie.mkv`), what `ls` and watchfiles show, rather than
    Python's surrogate escapes (`\\udce9`), and its control characters as the terminal's log
    writes them (`\\n`, `logs.CONTROLS`)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace").translate(logs.CONTROLS)


def left_out(path: str, into: list[str] | None = None) -> None:
    """`path`, whose name is not text (`is_text`), is left out: said once in the log, with the
    whole path (a name alone did not say which of a library's folders holds it), and added to
    `into` (what a reconciliation found: /health, the Files page and `metanode scan` list
    them)."""
    shown = shown_path(path)
    _warn_once("ignoring a name that is not valid UTF-8: %s (rename it: docs/watcher.md)", shown)
    if into is not None:
        into.append(shown)


@lru_cache(maxsize=1024)
def _warn_once(message: str, subject: str) -> None:
    """Log `message` about `subject` once a process (as long as it stays among the last 1,024):
    a name that is not UTF-8 stays so, and every rescan or event would say it again."""
    log.warning(message, subject)


def walk(
    root: str,
    rules: Rules,
    start: str | None = None,
    unlisted: list[str] | None = None,
    not_text: list[str] | None = None,
) -> Iterator[tuple[str, Stat]]:
    """Every regular file below `start` (default `root`) that the rules keep, with its
    `Stat`. Rules apply relative to the watch `root`.

    Unreadable folders are logged, skipped and added to `unlisted` (one that vanished is not:
    its files are gone; one that cannot be listed for want of a file descriptor raises the
    `OSError`, so the walk is tried again rather than its folder reported unreadable), names
    that are not text (`is_text`) to `not_text` (`shown_path`);
    each folder is visited once, even through a followed symlink that loops back (to the root
    itself, say). A walk from a folder below the root (a change inotify reported) counts the
    folders above it as visited, as a walk from the root has: a link made to the root, or to
    a folder on the way to it, listed the whole library again below the link until the next
    rescan, which removed it.
    """
    first = start or root
    if start is not None and rules.ignored(root, start, left_out):
        return
    try:
        top = os.stat(first)
    except OSError:
        return
    seen = _above(root, first)
    if (top.st_dev, top.st_ino) in seen:
        return  # a link back up to a folder holding it: walked from there
    seen.add((top.st_dev, top.st_ino))
    stack = [first]
    check_paths = bool(rules.path_globs)
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as exc:
            if exc.errno in OUT_OF_FILES:  # not an unreadable folder: the walk is tried again
                raise
            log.warning("cannot list %s: %s", folder, exc.strerror or exc)
            if unlisted is not None and not isinstance(exc, FileNotFoundError | NotADirectoryError):
                unlisted.append(folder)
            continue
        for entry in entries:
            if rules.ignored_name(entry.name):
                continue
            if not is_text(entry.name):
                left_out(entry.path, not_text)
                continue
            if check_paths and rules.ignored(root, entry.path):
                continue
            try:
                if entry.is_symlink() and not rules.follow_symlinks:
                    continue
                info = entry.stat(follow_symlinks=True)
            except OSError as exc:
                if exc.errno == errno.ENAMETOOLONG:  # past PATH_MAX: nothing can open it
                    _warn_once(TOO_LONG, abridged(shown_path(folder)))
                continue  # vanished, or a dangling link
            if stat.S_ISDIR(info.st_mode):
                if (info.st_dev, info.st_ino) not in seen:
                    seen.add((info.st_dev, info.st_ino))
                    stack.append(entry.path)
            elif stat.S_ISREG(info.st_mode) and info.st_size >= rules.min_size:
                yield entry.path, stat_from(info)


def _above(root: str, path: str) -> set[tuple[int, int]]:
    """The (device, inode) of each folder from `root` down to `path`'s parent (none for the
    root itself), as a walk from the root meets them before `path`."""
    found: set[tuple[int, int]] = set()
    below = root.rstrip("/") + "/"
    folder = path
    while folder.startswith(below):
        folder = os.path.dirname(folder)
        with contextlib.suppress(OSError):
            info = os.stat(folder)
            found.add((info.st_dev, info.st_ino))
    return found


def prefixes(folders: Iterable[str]) -> tuple[str, ...]:
    """What every path below one of `folders` starts with (for `str.startswith`)."""
    return tuple(folder.rstrip("/") + "/" for folder in folders)


def plan(
    disk: Mapping[str, Stat], known: Mapping[str, Stat], unlisted: Sequence[str] = ()
) -> tuple[list[str], list[str], list[str]]:
    """(paths to hash, paths to remove, paths to fill): new or changed files (any of size,
    mtime, ctime, inode moved), rows whose file is gone, and rows that have no ctime yet
    (`UNKNOWN_CTIME`: hashed before change times were kept) whose file is as it was hashed
    otherwise, which take the disk's ctime without a hash: the first start after the upgrade
    hashes nothing that did not change. A row below an `unlisted` folder (unreadable, or a
    watch root that is missing: a disk not mounted) stays: its file was not seen, which is not
    that it is gone."""
    to_hash: list[str] = []
    to_fill: list[str] = []
    for path, st in disk.items():
        was = known.get(path)
        if was == st:
            continue
        if was is not None and was == st._replace(ctime_ns=UNKNOWN_CTIME):
            to_fill.append(path)
        else:
            to_hash.append(path)
    hidden = prefixes(unlisted)
    to_remove = sorted(p for p in set(known) - set(disk) if not p.startswith(hidden))
    return sorted(to_hash), to_remove, sorted(to_fill)


def stat_of(path: str, follow_symlinks: bool) -> Stat | None:
    """The `Stat` of a regular file, None for anything else or nothing."""
    try:
        info = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError:
        return None
    return stat_from(info) if stat.S_ISREG(info.st_mode) else None


def midhash_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """midhash256 CID and size of a file, with one read of at most 1 MiB."""
    midhash, info = midhash_opened(path)
    return midhash, info.st_size


def midhash_opened(path: str | os.PathLike[str]) -> tuple[str, os.stat_result]:
    """midhash256 CID of a file and the stat of the very file that was read (its inode too).

    A file that is shorter than its stat said by the time it is read (it shrank, or was replaced)
    raises `MidhashError`: hashing zero-filled bytes would give a CID that names no real content.
    So does a file that cannot be opened or read, but for the process being out of file
    descriptors (`OUT_OF_FILES`), raised as the `OSError` it is: nothing is wrong with the file.
    Opened without waiting (`O_NONBLOCK`, nothing to a regular file): a FIFO, found where a
    file was stat'ed a moment before or named by hand, waited for a writer for ever.
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise MidhashError(f"{name!r} is not a regular file")
            want = min(info.st_size, cids.MIDHASH_SAMPLE)
            sample = _read_exactly(fd, want, cids.midhash_offset(info.st_size))
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in OUT_OF_FILES:
            raise  # the process's failure, not the file's: `Watcher._hash` tries it again
        raise MidhashError(f"cannot read {name!r}: {exc.strerror or exc}") from None
    if len(sample) != want:
        raise MidhashError(f"{name!r} shrank while being hashed")
    return cids.midhash_cid(cids.midhash_digest(info.st_size, sample)), info


def _read_exactly(fd: int, want: int, offset: int) -> bytes:
    """Read `want` bytes at `offset`, looping over short reads; fewer bytes only at end of file."""
    chunks: list[bytes] = []
    got = 0
    while got < want:
        chunk = os.pread(fd, want - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def hash_settled(path: str, expected: Stat) -> LocalFile | None:
    """The midhash of a file that still has the stat it settled with, else None (try later).
    Recorded with that stat: the inode read, and its ctime before the read, so a write during
    or after it (one that puts the size and mtime back too) is a change at the next look."""
    before = stat_of(path, follow_symlinks=True)
    if before != expected:
        return None
    midhash, read = midhash_opened(path)
    if stat_of(path, follow_symlinks=True) != before or stat_from(read) != before:
        return None  # written to, or replaced, while being hashed
    return recorded(path, midhash, before)


def recorded(path: str, midhash: str, st: Stat) -> LocalFile:
    """The `local_file` row of a file hashed with this stat."""
    return LocalFile(path, midhash, st.size, st.mtime_ns, st.ino, st.ctime_ns)


def stat_recorded(file: LocalFile) -> Stat:
    """The stat a `local_file` row was hashed with: the disk's while the file is unchanged."""
    return Stat(file.size, file.mtime_ns, file.ctime_ns, file.ino)


@dataclass
class Summary:
    """What one reconciliation did (`metanode scan` prints it)."""

    seen: int = 0
    unchanged: int = 0
    hashed: int = 0
    removed: int = 0
    failed: list[str] = field(default_factory=list)
    moved_on: int = 0  # to hash, but changed or gone before it was (a copy still being written)
    not_text: list[str] = field(default_factory=list)  # names left out, as `shown_path` shows
    bytes_sampled: int = 0
    left: int = 0  # to hash, but the watcher stopped first: hashed at the next start

    def said(self) -> str:
        """What it did, in words: `metanode scan` prints it, and the log says it (with the
        time it took) of a reconciliation that changed something; a first scan of a large
        library said nothing in the log from its start to its end."""
        extra = [f"{self.moved_on} changed or gone while scanning"] if self.moved_on else []
        extra += [f"{self.left} left for the next start (stopping)"] if self.left else []
        extra += [f"{len(self.not_text)} not UTF-8 left out"] if self.not_text else []
        return ", ".join(
            [
                f"{self.seen} file{'' if self.seen == 1 else 's'} seen: {self.hashed} hashed, "
                f"{self.unchanged} unchanged, {self.removed} removed, "
                f"{len(self.failed)} unreadable",
                *extra,
            ]
        )


@dataclass
class ScanProgress:
    """How far the reconciliation under way is, once its walk is done (/health's
    `watcher.scan`, the Health page): files on the disk, those to fingerprint (new or
    changed), and how many of them are done. A first scan of 100,000 files takes minutes, and
    `scanning` alone said nothing of how far it was."""

    seen: int
    to_hash: int
    done: int = 0


# (files done, bytes done, files to do, bytes to do), cumulative; first called with nothing done
Progress = Callable[[int, int, int, int], None]
Mounted = tuple[tuple[str, int, int], ...]  # (root, device, inode) of the roots that are folders
ROOTS_S = 2.0  # how often the roots are looked at for a disk mounted or taken off
WALK_TRIES = 3  # walks of the roots while disks are mounted or taken off meanwhile (`_walk`)
DEVICES_FILE = "watch-roots.json"  # in the data directory: `RootDevices`
MOUNTINFO = Path("/proc/self/mountinfo")  # the mount table: `mount_points`
_OCTAL = re.compile(rb"\\([0-7]{3})")  # how the mount table writes a space, a tab, a `\`
REWATCH_MAX_S = 30.0  # the longest pause between failed watches (`Watcher._pause_after`)
RETRY_MIN_S, RETRY_MAX_S = 2.0, 60.0  # a reconciliation after a failed batch (`_retry`)
OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how watchfiles (Rust) says an errno
UNDECODABLE = re.compile(r"Unable to decode path (.*) to string", re.DOTALL)  # watchfiles' words
# What an operator raises, and in a user namespace (rootless containers) its own limit, which
# may be lower: the lower of the two is the one that applies.
WATCH_LIMITS = (
    Path("/proc/sys/fs/inotify/max_user_watches"),
    Path("/proc/sys/user/max_inotify_watches"),
)
IN_ATTRIB = 0x4
DELETED = watchfiles.Change.deleted


class Watcher:
    """Watches roots; talks to the node only through the three callables it is given."""

    def __init__(
        self,
        roots: Iterable[str],
        rules: Rules,
        settle_s: float,
        rescan_s: float,
        workers: int,
        ensure_groups: EnsureGroups,
        apply_local: ApplyLocal,
        known_stats: KnownStats,
        fill_ctimes: FillCtimes,
        devices: RootDevices | None = None,
        stray_stats: KnownStats | None = None,
        kept_missing: Iterable[str] = (),
    ) -> None:
        self.roots = [str(Path(r).resolve()) for r in roots]
        # roots never made when missing (the folders the owner chose on the page): watched as
        # missing, and once they are folders, as a disk away is (`_make_new_roots`)
        self._kept_missing = {str(Path(r).resolve()) for r in kept_missing}
        self.rules = rules
        self.settle_s = settle_s
        self.rescan_s = rescan_s
        self._ensure_groups = ensure_groups
        self._apply_local = apply_local
        self._known_stats = known_stats
        self._fill_ctimes = fill_ctimes
        self._stray_stats = stray_stats  # rows below no root: checked at a full reconciliation
        self.devices = devices or RootDevices(None)
        self._slots = asyncio.Semaphore(max(1, workers))
        self.pending: dict[str, tuple[Stat, float]] = {}  # path → (stat, when it last changed)
        self._failed: dict[str, Stat] = {}  # unreadable files: said once till they change (`_hash`)
        self._stop = asyncio.Event()
        self._rewatch = asyncio.Event()  # ends the current inotify watch: the roots changed
        self._watch_stands = asyncio.Event()  # the watch being laid is laid (`_watch_laid`)
        self._mounted: Mounted = ()  # the roots inotify follows (those that exist), by inode
        self._mounts: dict[str, int] = {}  # the mount points below them then (`mount_points`)
        self._around: frozenset[str] = frozenset()  # the unreadable folders the watch avoids
        self._resyncing: asyncio.Task[None] | None = None
        self._resync_wanted = False  # a reconciliation asked for that has not begun yet
        self._pause = TICK_S  # before watching again after a failed watch: `_pause_after`
        self._watched_since = time.monotonic()  # when the current watch began
        self._retrying: asyncio.Task[None] | None = None  # a reconciliation after a failure
        self._retry_s = RETRY_MIN_S
        self.failing: str | None = None  # why batches fail (/health), until a retry works
        self.unlisted: list[str] = []  # folders the last reconciliation could not read
        self.not_text: list[str] = []  # names the last full one left out (`is_text`)
        self.watches_full = False  # this user may add no inotify watch (`inotify_full`)
        self.folders = 0  # the folders below the roots, counted when `watches_full` began
        self._reconciling = 0  # reconciliations under way (a rescan may overlap the start's)
        self._started = False  # a reconciliation has ended: `scanning` until then
        self.scan: ScanProgress | None = None  # the newest reconciliation under way, once walked
        self.heartbeat = time.monotonic()  # the settle loop's last turn: /health sees a stall
        self.out_of_files: str | None = None  # why files wait to be opened (/health), or None

    @property
    def scanning(self) -> bool:
        """Whether a reconciliation is under way, or none has ended yet (/health's `scanning`):
        while the start's inotify watch was being laid, before its reconciliation began,
        /health said `scanning: false, pending: 0`, as of a node that had read the disk, and a
        file written then was fingerprinted by that reconciliation, not settled."""
        return self._reconciling > 0 or not self._started

    # -- applying results -----------------------------------------------------------------------

    async def _hash(self, path: str, expected: Stat) -> LocalFile | None:
        """The file hashed, or None: changed meanwhile, or unreadable (said once until it
        changes or is read: each rescan tries it again, as a permission fixed on a network
        mount sends no event, but said it again every `watch_rescan_s`)."""
        async with self._slots:
            try:
                done = await asyncio.to_thread(hash_settled, path, expected)
            except MidhashError as exc:
                if stat_of(path, self.rules.follow_symlinks) == expected:
                    if self._failed.get(path) != expected:
                        log.warning("skipping unreadable file: %s", exc.message)
                    self._failed[path] = expected
                return None
            except OSError as exc:  # `OUT_OF_FILES`: back to `pending`, tried again
                self._note_out_of_files(exc.strerror or str(exc))
                return None
        self._files_open_again()
        if done is not None:
            self._failed.pop(path, None)
        return done

    def _retries(self, disk: Mapping[str, Stat], to_hash: Iterable[str]) -> int:
        """How many of `to_hash` are files found unreadable before, unchanged since: tried
        again quietly, neither waited for nor said."""
        return sum(1 for path in to_hash if self._failed.get(path) == disk[path])

    def _note_out_of_files(self, why: str) -> None:
        """Say once, in the log and /health, that files (or inotify) wait for a descriptor."""
        if self.out_of_files is None:
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            self.out_of_files = (
                f"cannot open files to fingerprint or watch them ({why}; this process may hold "
                f"{soft}, `ulimit -n`): they wait and are tried again; raise the limit (the "
                "container's nofile) above max_connections (docs/operations.md)"
            )
            log.warning("%s", self.out_of_files)

    def _nothing_waits(self) -> None:
        """No file waits to be opened (those that did are gone, or it was inotify's watch):
        the wait is over once a descriptor is free."""
        if descriptor_free():
            self._files_open_again()

    def _files_open_again(self) -> None:
        """A file was opened, or none waits and one could be (`_settle_loop`): say so, once."""
        if self.out_of_files is not None:
            self.out_of_files = None
            log.warning("no file waits for a file descriptor any more: fingerprinting goes on")

    def _forget_failed(self, gone: Callable[[str], bool]) -> None:
        """Forget the unreadable files `gone` says are gone. Each is kept (`_hash`) until it is
        read or changes; one deleted was kept for the life of the process, so a folder where
        unreadable names come and go (a downloader's partial files, kept from other users)
        grew this map by one entry per name, for months."""
        for path in [path for path in self._failed if gone(path)]:
            del self._failed[path]

    async def _commit(self, files: Sequence[LocalFile], removals: Sequence[str]) -> None:
        if removals:
            removed, below = set(removals), prefixes(removals)
            self._forget_failed(lambda path: path in removed or path.startswith(below))
        if files:
            await self._ensure_groups(sorted({f.midhash for f in files}))
            # A file deleted or changed while its group was being made must not come back:
            # only what still stands as hashed is recorded (the change itself is queued apart).
            files = [
                f for f in files if stat_of(f.path, self.rules.follow_symlinks) == stat_recorded(f)
            ]
        if files or removals:
            await self._apply_local(files, removals)

    async def _hash_and_commit(
        self, candidates: Mapping[str, Stat], removals: Sequence[str] = ()
    ) -> list[LocalFile]:
        """Hash settled candidates in parallel and commit them (with removals) in one batch.

        A candidate that changed meanwhile goes back to `pending`.
        """
        self.heartbeat = time.monotonic()
        paths = list(candidates)
        results = await asyncio.gather(*(self._hash(p, candidates[p]) for p in paths))
        done = [r for r in results if r is not None]
        for path, result in zip(paths, results, strict=True):
            current = stat_of(path, self.rules.follow_symlinks)
            if result is None and current is not None and self._failed.get(path) != current:
                self.pending[path] = (current, time.monotonic())
        await self._commit(done, removals)
        return done

    # -- reconciliation -------------------------------------------------------------------------

    async def reconcile(
        self,
        roots: Sequence[str] | None = None,
        settle: bool = True,
        progress: Progress | None = None,
    ) -> Summary:
        """Compare the disk with `local_file` under `roots` and make them agree; a full one
        (`roots` not given) also the rows below no root (`_strays`)."""
        full = not roots
        # the roots as they are now: one added while this runs is walked by the next
        roots = [str(Path(r).resolve()) for r in roots] if roots else list(self.roots)
        self._reconciling += 1
        scan: ScanProgress | None = None
        began = time.monotonic()
        try:
            walked, known, mounted, points, moving = await self._walk(roots)
            disk = {path: st for listing in walked for path, st in listing.files.items()}
            if full:
                stray_known, stray_disk = await self._strays()
                known, disk = {**known, **stray_known}, {**disk, **stray_disk}
            self.devices.found(mounted)  # a disk mounted below a root: its device, files or not
            self._note_unlisted(
                sorted(folder for listing in walked for folder in listing.unlisted)
                + self._emptied(walked, known, disk, points)
                + moving
            )
            self.devices.found(
                {x.root: x.device for x in walked if x.files and x.device is not None}
            )
            under, hidden = prefixes(roots), prefixes(self.unlisted)
            self._forget_failed(  # deleted unseen: a missed event, a network mount
                lambda path: (
                    path.startswith(under) and path not in disk and not path.startswith(hidden)
                )
            )
            to_hash, to_remove, to_fill = plan(disk, known, self.unlisted)
            await self._filled({path: disk[path] for path in to_fill})
            summary = Summary(
                seen=len(disk),
                unchanged=len(disk) - len(to_hash),
                removed=len(to_remove),
                not_text=sorted(name for listing in walked for name in listing.not_text),
            )
            if full:
                self.not_text = summary.not_text
            total_bytes = sum(disk[p][0] for p in to_hash)
            report = progress or (lambda *_: None)
            report(0, 0, len(to_hash), total_bytes)
            self.scan = scan = ScanProgress(len(disk), len(to_hash))
            if len(to_hash) > BATCH:
                log.info(
                    "fingerprinting %d new or changed file(s) of %d in %s (progress in /health)",
                    len(to_hash),
                    len(disk),
                    ", ".join(roots),
                )
            fresh = len(to_hash) - self._retries(disk, to_hash)
            if settle and fresh:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settle_s)
            removals: Sequence[str] = to_remove
            files_done = bytes_done = 0
            said_at = time.monotonic()
            for start in range(0, len(to_hash), BATCH):
                if self._stop.is_set():  # the rest is hashed at the next start (`plan`)
                    break
                chunk = {p: disk[p] for p in to_hash[start : start + BATCH]}
                done = await self._hash_and_commit(chunk, removals)
                removals = ()
                summary.hashed += len(done)
                summary.bytes_sampled += sum(min(f.size, cids.MIDHASH_SAMPLE) for f in done)
                files_done += len(chunk)
                bytes_done += sum(st.size for st in chunk.values())
                report(files_done, bytes_done, len(to_hash), total_bytes)
                scan.done = files_done
                if time.monotonic() - said_at >= PROGRESS_LOG_S:
                    log.info("fingerprinted %d of %d file(s)", files_done, len(to_hash))
                    said_at = time.monotonic()
            if removals:
                await self._commit([], removals)
            summary.failed = sorted(p for p in to_hash[:files_done] if p in self._failed)
            summary.moved_on = files_done - summary.hashed - len(summary.failed)
            summary.left = len(to_hash) - files_done
            if fresh or summary.hashed or to_remove:
                seconds = time.monotonic() - began
                log.info("scanned %s: %s in %.1f s", ", ".join(roots), summary.said(), seconds)
            return summary
        finally:
            self._reconciling -= 1
            self._started = True
            if self.scan is scan:  # not one begun meanwhile, which says its own progress
                self.scan = None

    async def _walk(
        self, roots: Sequence[str]
    ) -> tuple[list[Listing], dict[str, Stat], dict[str, int], dict[str, int | None], list[str]]:
        """The roots walked, their rows, and the mount points below them (`_points`), with the
        mount table looked at before the walk too: a disk mounted or taken off meanwhile makes
        the listing and the mount points disagree (a disk mounted back on its folder was
        listed empty, then found on its own device, and every file of it removed), so the walk
        is made again, `WALK_TRIES` times at most; then the mount points that kept moving
        (`remounted`, the last item) are read as unlisted, their rows kept."""
        for _ in range(WALK_TRIES):
            before = await asyncio.to_thread(mount_points, roots)
            walking = asyncio.gather(*(asyncio.to_thread(self._listing, root) for root in roots))
            try:
                known = self._known_stats(roots)  # on the loop, while the walks run on threads
            finally:
                walked = list(await walking)
            mounted, points = await asyncio.to_thread(self._points, roots)
            moving = remounted(before, mounted)
            if not moving:
                break
            log.info("a disk was mounted or taken off at %s during the walk", ", ".join(moving))
        return walked, known, mounted, points, moving

    async def _filled(self, found: Mapping[str, Stat]) -> None:
        """Give rows without a ctime the disk's (`plan`), `BATCH` × 16 rows a transaction, so
        the writer is not held for the whole library at the first start after the upgrade."""
        paths = sorted(found)
        step = BATCH * 16
        for start in range(0, len(paths), step):
            await self._fill_ctimes({p: found[p] for p in paths[start : start + step]})
        if paths:
            log.info(
                "recorded the change time (ctime) of %d file(s) hashed before it was kept, "
                "without hashing them again",
                len(paths),
            )

    async def _strays(self) -> tuple[dict[str, Stat], dict[str, Stat]]:
        """(known, on disk) of the rows below no watch root: a folder taken out of
        `watch_roots`, or one `metanode scan` was given. Nothing watches them, so each full
        reconciliation looks at each file again: one gone from its folder loses its row (its
        paths left the records for good otherwise), one changed is hashed again. A file whose
        folder is gone too is kept as it was: that may be a disk not mounted (`metanode scan
        /mnt/usb`, unplugged), as for a root (`_listing`). On threads: the rows are a scan of
        the table, and the files are stat'ed one by one."""
        if self._stray_stats is None:
            return {}, {}
        known = await asyncio.to_thread(self._stray_stats, self.roots)
        follow = self.rules.follow_symlinks

        def stat_each() -> dict[str, Stat]:
            found = {}
            for path, was in known.items():
                now = stat_of(path, follow)
                if now is not None or not os.path.isdir(os.path.dirname(path)):
                    found[path] = was if now is None else now
            return found

        on_disk = await asyncio.to_thread(stat_each) if known else {}
        if gone := len(known) - len(on_disk):
            log.info("%d file(s) outside the watched folders are gone: their rows go", gone)
        return known, on_disk

    # -- live -----------------------------------------------------------------------------------

    def _listing(self, root: str) -> Listing:
        """The files below watch `root`, and the folders that could not be listed: the root
        itself if it is missing or no folder (a disk not mounted, a share not up)."""
        device = _folder_device(root)
        if device is None:
            log.warning(
                "watch root %s is missing or no folder: its files are kept until it is back", root
            )
            return Listing(root, None, {}, [root])
        unlisted: list[str] = []
        not_text: list[str] = []
        files = dict(walk(root, self.rules, root, unlisted, not_text))
        return Listing(root, device, files, unlisted, not_text)

    def _points(self, roots: Sequence[str]) -> tuple[dict[str, int], dict[str, int | None]]:
        """The mount points below `roots` now (`mount_points`), and those and the ones known
        before (`RootDevices`) with their device now (None: no folder there). Stats them: run
        it on a thread."""
        mounted = mount_points(roots)
        below = prefixes(roots)
        points: dict[str, int | None] = dict(mounted)
        for point in self.devices.folders():
            if point.startswith(below) and point not in mounted:
                points[point] = _folder_device(point)
        return mounted, points

    def _volumes(
        self, walked: Iterable[Listing], disk: Mapping[str, Stat], points: Mapping[str, int | None]
    ) -> list[tuple[str, int, bool]]:
        """(folder, device now, whether it listed a file) of each root that could be read and
        each mount point below one (`_points`) that is a folder."""
        volumes = [
            (listing.root, listing.device, bool(listing.files))
            for listing in walked
            if listing.device is not None and not listing.unlisted
        ]
        for point, device in points.items():
            if device is not None:
                below = point.rstrip("/") + "/"
                volumes.append((point, device, any(p.startswith(below) for p in disk)))
        return volumes

    def _emptied(
        self,
        walked: Iterable[Listing],
        known: Mapping[str, Stat],
        disk: Mapping[str, Stat],
        points: Mapping[str, int | None],
    ) -> list[str]:
        """The roots, and the mount points below them, that listed no file at all, though
        files were known below them, on another device than the one they were found on
        (`RootDevices`): a mount point whose disk is not mounted (a bind mount of nothing, a
        disk unplugged from `/srv/media/usb`) is taken for that, not for every file deleted
        at once. A folder emptied on its own device is empty, and its rows go."""
        emptied = []
        for folder, device, shows in self._volumes(walked, disk, points):
            was, below = self.devices.get(folder), prefixes([folder])
            if shows or was in (None, device) or not any(p.startswith(below) for p in known):
                continue
            log.warning(
                "watched folder %s is empty and on another device than its files were found "
                "on (a disk not mounted?): they are kept until it shows files again",
                folder,
            )
            emptied.append(folder)
        return emptied

    def _files_below(
        self, folder: str, root: str, unlisted: list[str] | None = None
    ) -> dict[str, Stat]:
        """Files below `folder` that the rules keep, judged relative to their watch `root`; the
        folders below it that cannot be listed are added to `unlisted`."""
        return dict(walk(root, self.rules, folder, unlisted))

    def _root_of(self, path: str) -> str | None:
        for root in self.roots:
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return root
        return None

    def _keep(self, change: watchfiles.Change, path: str) -> bool:
        root = self._root_of(path)
        return root is not None and not self.rules.ignored(root, path, left_out)

    async def _on_changes(self, changes: set[tuple[watchfiles.Change, str]]) -> None:
        """Route a batch of inotify events: gone → removed now; present → settle or scan.

        A file that appears with exactly the (size, mtime_ns) of a row removed in the same batch
        was moved (a rename moves the ctime, and a move from another disk the inode): it is
        hashed at once and committed with the removal, so a rename is one transaction (one
        `set` of `filePath`), not a loss and a late re-appearance. A folder is walked; if a
        file of its name was known (a file replaced by a folder), that file is gone; if part
        of it cannot be listed, /health says so now (`unlisted`), not at the next
        reconciliation. A root reported deleted (moved away, or deleted and maybe made again at
        once: the new folder may even have the old one's inode) is watched again, and the
        reconciliation that follows keeps its files as those of a root missing at start, or
        reads the new folder: removing the rows below it reported every file deleted to
        consumers, and hashed each again, as new, once the folder was back.
        """
        removed: list[str] = []
        touched: dict[str, Stat] = {}
        folders: list[str] = []
        unlisted: list[str] = []
        gone = {p for change, p in changes if p in self.roots and change == DELETED}
        if gone:  # the watched folder: missing now (`_listing`), or a new one made at once
            self._rewatch.set()
        for path in sorted({p for _, p in changes} - gone):
            if os.path.isdir(path) and (self.rules.follow_symlinks or not os.path.islink(path)):
                folders.append(path)
                root = self._root_of(path) or path
                found = await asyncio.to_thread(self._files_below, path, root, unlisted)
                touched.update(found)
                continue
            current = self.rules.kept(stat_of(path, self.rules.follow_symlinks))
            if current is None:
                removed.append(path)
                self.pending.pop(path, None)
            else:
                touched[path] = current
        removed += sorted(set(folders) & set(self._rows_at(folders)))
        if unlisted:
            self._note_unlisted(sorted(set(self.unlisted) | set(unlisted)))
        gone_stats = {st.written for st in self._rows_at(removed).values()}
        known = self._rows_at(list(touched))
        moved = {p: s for p, s in touched.items() if s.written in gone_stats and known.get(p) != s}
        now = time.monotonic()
        for path, current in touched.items():
            if path in moved or known.get(path) == current:
                continue  # moved: committed below; unchanged: nothing to do
            held = self.pending.get(path)
            self.pending[path] = (current, now if held is None or held[0] != current else held[1])
        if moved or removed:
            await self._hash_and_commit(moved, removed)
        hidden = prefixes(self.unlisted)  # a folder that could not be read, a root left empty
        if hidden and any(path.startswith(hidden) for path in touched):
            self._resync_later()  # shows files again: the next reconciliation reads it

    def _note_unlisted(self, folders: list[str]) -> None:
        """Keep the folders that could not be read (/health names them), and watch again if
        the unreadable ones below the roots changed: the watch is laid out around them
        (`watch_paths`)."""
        self.unlisted = folders
        if unreadable(self.roots, folders) != self._around:
            self._rewatch.set()

    def _rows_at(self, paths: Sequence[str]) -> dict[str, Stat]:
        """`local_file` rows of these paths, or below them where a path was a folder: looked up
        path by path, not by reading the rows of the folders they are in (a flat folder of
        thousands of files would cost every batch in it a read of them all). A path that is a
        folder (its own event: a chmod, a rename) reads the rows below it, as its walk does."""
        return self._known_stats(paths) if paths else {}

    async def _settle_loop(self) -> None:
        """Hash pending files once their stat held still for the settle window."""
        while not self._stop.is_set():
            await asyncio.sleep(TICK_S)
            now = self.heartbeat = time.monotonic()
            ready: dict[str, Stat] = {}
            for path, (expected, since) in list(self.pending.items()):
                if now - since < self.settle_s:
                    continue
                current = self.rules.kept(stat_of(path, self.rules.follow_symlinks))
                if current is None:
                    del self.pending[path]
                elif current != expected:
                    self.pending[path] = (current, now)
                else:
                    del self.pending[path]
                    ready[path] = current
                if len(ready) >= BATCH:
                    break
            if ready:
                await self._guarded(self._settled(ready))
            elif self.out_of_files and not self.pending and not self._reconciling:
                self._nothing_waits()

    async def _settled(self, ready: Mapping[str, Stat]) -> None:
        """Hash and commit settled files; if one of them has other names (hard links: a
        download linked into the library), reconcile, as inotify reports a write under the
        name it was made through only: the others kept the old content's midhash until the
        next rescan. A file a reconciliation recorded while it settled, as it is now, is left
        alone: at a start, every file copied in meanwhile was hashed and written twice."""
        known = self._rows_at(list(ready))
        fresh = {path: st for path, st in ready.items() if known.get(path) != st}
        paths = [f.path for f in await self._hash_and_commit(fresh)] if fresh else []
        linked: bool = bool(paths) and await asyncio.to_thread(_any_linked, paths)
        if linked:
            self._resync_later()

    def _present(self) -> Mounted:
        """The roots that are folders now, each with its device and inode: a disk mounted on a
        root, or taken off it, changes the device though the folder stays; a root deleted and
        made again (`rm -rf`, then a sync tool's `mkdir`) is mostly a new inode, which the
        watch of the old one never saw (its deletion, when inotify reports it, is the surer
        sign: `_on_changes`). Stats the roots: run it on a thread, as a hung network mount
        blocks a stat for as long as it hangs."""
        found = ((root, _folder_identity(root)) for root in self.roots)
        return tuple((root, *identity) for root, identity in found if identity is not None)

    async def _roots_loop(self) -> None:
        """Watch again (`_rewatch`) when a root comes, goes, is made anew, or changes device
        (mounted), when
        a disk is mounted below one or taken off (the watch lay on the folder beneath it, and
        saw nothing of the disk's files), or
        when inotify takes watches again after the user's limit was reached (raised, or
        another program's watches gone: the folders refused meanwhile are watched only by a
        new watch): looked at every `ROOTS_S` on a thread, one look at a time (a hung mount
        holds only that)."""
        while not self._stop.is_set():
            await asyncio.sleep(ROOTS_S)
            present, mounts, full = await asyncio.to_thread(self._look)
            self.devices.found(mounts)  # before a reconciliation may find one taken off
            if (present, mounts) != (self._mounted, self._mounts) or (
                self.watches_full and not full
            ):
                self._rewatch.set()
            if full and not self.watches_full:
                self.folders = await asyncio.to_thread(count_folders, self.roots, self.rules)
                log.warning("inotify: %s", self.watch_limit_problem())
            self.watches_full = full

    def watch_limit_problem(self) -> str:
        """What /health and the log say while the user's inotify watches are all taken."""
        return watch_limit_problem(self.rescan_s, self.folders)

    def _look(self) -> tuple[Mounted, dict[str, int], bool]:
        present = self._present()
        mounts = mount_points([root for root, *_ in present])
        return present, mounts, bool(present) and inotify_full(present[0][0])

    async def _inotify_loop(self) -> None:
        """Follow inotify on the roots that exist; if watchfiles itself fails (it raises on a
        path it cannot decode), or a root came or went (`_roots_loop` sets `_rewatch`), or a
        folder below one turned unreadable or readable (`_note_unlisted`), watch again and
        reconcile once the new watch stands, to catch what the gap missed."""
        loop = asyncio.get_running_loop()

        def laid() -> None:  # from watchfiles' thread
            loop.call_soon_threadsafe(self._watch_stands.set)

        while not self._stop.is_set():
            self._rewatch.clear()
            self._watched_since = time.monotonic()
            self._mounted, self._mounts, _ = await asyncio.to_thread(self._look)
            self._around = unreadable(self.roots, self.unlisted)
            paths = await asyncio.to_thread(
                watch_paths,
                [root for root, *_ in self._mounted],
                self._around,
                self.rules.follow_symlinks,
            )
            try:
                if self._mounted:
                    async for changes in watchfiles.awatch(
                        *paths,
                        watch_filter=self._keep,
                        debounce=200,
                        step=50,
                        stop_event=_Either(self._stop, self._rewatch, laid),
                        ignore_permission_denied=True,
                    ):
                        await self._guarded(self._on_changes(changes))
                else:
                    self._watch_stands.set()  # nothing to watch: nothing to wait for
                    await _first(self._stop, self._rewatch)
            except Exception as exc:
                self._watch_stands.set()  # none will stand before the pause: walk meanwhile
                await self._pause_after(exc)
            self._watch_stands.clear()  # the next reconciliation waits for the next watch
            if not self._stop.is_set():
                self._resync_later()
        if self._resyncing is not None:
            self._resyncing.cancel()

    async def _pause_after(self, failure: Exception) -> None:
        """Say why the watch failed and wait before watching again: a quarter second at first,
        twice as long after each failure that follows within `REWATCH_MAX_S` of the last, up to
        it. A file whose name is not UTF-8 fails watchfiles at each change (a download being
        written: several a second), and every failure costs a new watch of each folder and a
        reconciliation: the pause bounds that to one every `REWATCH_MAX_S`."""
        self._pause = next_pause(self._pause, time.monotonic() - self._watched_since)
        name = undecodable(failure)
        why = out_of_files(failure)
        if why is not None:  # a traceback at each try, up to every 30 s, said nothing more
            self._note_out_of_files(why)
        elif name is None:
            log.exception("inotify failed; watching again and rescanning", exc_info=failure)
        else:
            _warn_once(
                "inotify cannot report a change to %s, whose name is not valid UTF-8: each one "
                "stops the watch, and the folders are read again instead (rename it to end this)",
                name,
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self._pause)

    def _resync_later(self) -> None:
        """A reconciliation soon: one begun already walks the roots as they were then, so one
        asked for meanwhile follows it (`_resync_soon`). A folder added on the page while the
        reconciliation of the one added before it ran waited for the next rescan (10 min)."""
        self._resync_wanted = True
        if self._resyncing is None or self._resyncing.done():
            self._resyncing = asyncio.create_task(self._resync_soon())

    async def _resync_soon(self) -> None:
        """Reconcile once the watch stands, again as long as one was asked for since the
        last began."""
        while self._resync_wanted:
            await self._watch_laid()
            self._resync_wanted = False
            await self._guarded(self.reconcile())

    async def _watch_laid(self) -> None:
        """Until the inotify watch being laid stands (watchfiles polls its stop event once its
        watches are made: `_Either`), or there is none to lay, or laying it failed; at most
        `WATCH_LAID_S`. A reconciliation begun sooner could walk a folder, then see a file
        written there before its watch stood neither on the disk nor as an event: it waited
        for the next rescan (10 min), as two tests found under load at a node's start."""
        await _first_or_timeout(self._watch_stands, WATCH_LAID_S)

    async def _rescan_loop(self) -> None:
        while self.rescan_s > 0 and not self._stop.is_set():
            await asyncio.sleep(self.rescan_s)
            await self._guarded(self.reconcile())

    async def _guarded(self, work: Awaitable[object]) -> None:
        """One failed batch is logged and a reconciliation retries it soon (`_retry`);
        it never stops the watcher."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._say_failed(exc, "watcher batch failed")
            if not self._stop.is_set() and (self._retrying is None or self._retrying.done()):
                self._retrying = asyncio.create_task(self._retry())

    def _say_failed(self, exc: Exception, what: str) -> None:
        """Log a failure (a storage error in a line, anything else with its traceback) and
        say it in /health (`failing`) until a reconciliation works."""
        self.failing = f"{what}: {exc}"
        if (why := out_of_files(exc)) is not None:
            self._note_out_of_files(why)
        if isinstance(exc, StorageError) or why:  # expected: no traceback
            log.warning("%s (%s); reconciling in %g s", what, exc, self._retry_s)
        else:
            log.exception("%s; reconciling in %g s", what, self._retry_s, exc_info=exc)

    async def _retry(self) -> None:
        """Reconcile after `_retry_s`, which doubles up to `RETRY_MAX_S` while reconciling
        fails: what a failed batch held (files hashed but not recorded: the database was away,
        the disk full) is recorded once the store is back, not at the next rescan, ten minutes
        on. One such task at a time, cancelled with the watcher."""
        while not self._stop.is_set():
            await asyncio.sleep(self._retry_s)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
                self._say_failed(exc, "reconciling after a failed batch failed")
                continue
            self.failing, self._retry_s = None, RETRY_MIN_S
            return

    async def _make_new_roots(self) -> None:
        """Make each root that is no folder and that the cache knows no file under: a new
        root. A known one is a disk away, watched once it is back; so is one of `kept_missing`
        (chosen on the page, so a folder once: after `metanode restore` on another machine the
        cache knows no file anywhere, and its disk, not mounted yet, was made an empty folder
        that said `watching`). Knowing needs the database:
        while it fails (an outage; a replica taking the applier lock just after a restart of
        PostgreSQL, its read connection still waiting to reconnect) this is tried again after
        `_retry_s`, doubling, `failing` saying why (/health). That read's failure stopped the
        watcher for good, with a traceback, and /health said `the watcher has stopped` until
        the node was restarted or another replica took the lead."""
        while not self._stop.is_set():
            present = {r for r, *_ in await asyncio.to_thread(self._present)}
            missing = set(self.roots) - present - self._kept_missing
            try:
                new = [root for root in sorted(missing) if not self._known_stats([root])]
            except StorageError as exc:
                if self.failing is None:  # said once, not at every try
                    log.warning(
                        "reading which watched roots are new failed (%s); trying again "
                        "until it works",
                        exc,
                    )
                self.failing = f"reading which watched roots are new failed: {exc}"
                await _first_or_timeout(self._stop, self._retry_s)
                self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
                continue
            for root in new:
                _make_root(root)
            if self.failing is not None:
                log.info("the watched roots could be read again")
            self.failing, self._retry_s = None, RETRY_MIN_S
            return

    async def run(self) -> None:
        """Follow inotify, reconcile, then settle and rescan until `stop()`.

        inotify stands before the reconciliation begins (`_watch_laid`), so nothing that
        changes during it is missed.
        """
        await self._make_new_roots()
        tasks = [asyncio.create_task(self._inotify_loop(), name="watcher-inotify")]
        tasks.append(asyncio.create_task(self._roots_loop(), name="watcher-roots"))
        try:
            await self._watch_laid()
            await self._guarded(self.reconcile())
            tasks.append(asyncio.create_task(self._settle_loop(), name="watcher-settle"))
            tasks.append(asyncio.create_task(self._rescan_loop(), name="watcher-rescan"))
            await self._stop.wait()
        finally:
            tasks += [t for t in (self._retrying, self._resyncing) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def add_root(self, root: str) -> None:
        """Watch `root` as well, from now on (the owner chose it on the page): inotify is laid
        anew over every root (`_rewatch`), and the reconciliation that follows each new watch
        (`_resync_later`) walks it, so its files are fingerprinted without a restart."""
        real = str(Path(root).resolve())
        if real not in self.roots:
            self.roots.append(real)
            self._rewatch.set()

    def remove_root(self, root: str) -> None:
        """Stop watching `root`. Its files keep their rows, as those of a folder taken out of
        `watch_roots` do: below no root, each full reconciliation looks at each again
        (`_strays`); what waited to settle below it is dropped, and so is what /health said of
        its folders."""
        real = str(Path(root).resolve())
        if real not in self.roots:
            return
        self.roots.remove(real)
        below = prefixes([real])
        for path in [p for p in self.pending if p.startswith(below)]:
            del self.pending[path]
        self.unlisted = [f for f in self.unlisted if f != real and not f.startswith(below)]
        self._rewatch.set()

    def state_of(self, root: str) -> str:
        """What the Files page and `GET /api/watch-roots` say of watch `root`: `watching`;
        `missing` (no folder there: a disk not mounted); `not_mounted` (empty, on another
        device than its files were found on); `unreadable` (it, or a folder below it, could not
        be listed: /health names them). Stats the root: a hung network mount holds the caller,
        so call it on a thread."""
        real = str(Path(root).resolve())
        below = prefixes([real])
        if _folder_device(real) is None:
            return "missing"
        if real in self.unlisted:
            return "unreadable" if not os.access(real, os.R_OK | os.X_OK) else "not_mounted"
        if any(folder.startswith(below) for folder in self.unlisted):
            return "unreadable"
        return "watching"

    def stop(self) -> None:
        self._stop.set()


def inotify_full(path: str) -> bool:
    """Whether this user may add no more inotify watches: one added on `path` (and dropped at
    once) fails with ENOSPC. notify, under watchfiles, fails the same way for each folder past
    the limit, and watchfiles says nothing: those folders are not watched, their changes seen
    only at a rescan. The limit is the user's, shared with every program it runs (in a
    container, with the host user of the same uid). False where there is no inotify."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_CLOEXEC)
    except (OSError, AttributeError):
        return False
    if fd < 0:
        return False  # no instance to be had (another limit): not what this asks
    try:
        added = libc.inotify_add_watch(fd, os.fsencode(path), IN_ATTRIB)
        return added < 0 and ctypes.get_errno() == errno.ENOSPC
    finally:
        os.close(fd)


def watch_limit_problem(rescan_s: float, folders: int) -> str:
    """What /health and the log say while `inotify_full`: the limit, what the watched
    `folders` need of it (a number to raise it past, with room for the user's other
    programs), and how to raise it."""
    limits = []
    for path in WATCH_LIMITS:
        with contextlib.suppress(OSError, ValueError):
            limits.append(int(path.read_text()))
    said = [f"the limit here: {min(limits)}"] if limits else []
    said += [f"the watched folders need {folders}, one each"] if folders else []
    limit = f" ({'; '.join(said)})" if said else ""
    seen = f"every {rescan_s:g} s" if rescan_s > 0 else "never (watch_rescan_s is 0)"
    return (
        f"the user's inotify watch limit is reached: folders past it are not watched, their "
        f"changes seen only at the rescan, {seen}; raise fs.inotify.max_user_watches{limit} "
        "(docs/watcher.md)"
    )


def count_folders(roots: Sequence[str], rules: Rules) -> int:
    """The folders below `roots`, themselves included, each an inotify watch: every one, as
    notify watches ignored folders too (their events are dropped after). A walk of every
    folder: run it on a thread, once, when the limit is reached."""
    return sum(1 for root in roots for _ in os.walk(root, followlinks=rules.follow_symlinks))


def unreadable(roots: Sequence[str], unlisted: Iterable[str]) -> frozenset[str]:
    """The folders of `unlisted` that lie below a root (a root itself there is missing, or an
    empty mount point: nothing to lay a watch around)."""
    below = prefixes(roots)
    return frozenset(folder for folder in unlisted if folder.startswith(below))


def watch_paths(roots: Sequence[str], around: Iterable[str], follow_symlinks: bool) -> list[str]:
    """The paths to give watchfiles, which watches each recursively, so that every folder that
    can be watched is, with unreadable folders below the roots (`around`).

    notify stops a recursive watch at the first folder it may not watch, and watchfiles, told
    to ignore permission errors, says nothing: one unreadable folder (`lost+found` at the root
    of a disk, for a node not run as root) left every folder after it in the walk unwatched,
    their changes seen only at the next rescan. So a root with one below it is given as its
    parts: the folders on the way down to an unreadable one (each is watched itself, first,
    before its walk stops) and their other sub-folders (whole, as nothing below them is
    unreadable). Lists those folders: run it on a thread."""
    around = set(around)
    on_the_way: set[str] = set()
    for folder in around:
        for root, below in zip(roots, prefixes(roots), strict=True):
            parent = os.path.dirname(folder)
            while folder.startswith(below) and parent not in on_the_way:
                on_the_way.add(parent)
                if parent == root:
                    break
                parent = os.path.dirname(parent)
    parts = [
        sub
        for folder in sorted(on_the_way)
        for sub in _subfolders(folder, follow_symlinks)
        if sub not in on_the_way and sub not in around
    ]
    return [r for r in roots if r not in on_the_way] + sorted(on_the_way) + parts


def _subfolders(folder: str, follow_symlinks: bool) -> list[str]:
    """The folders directly in `folder` (none if it cannot be listed now)."""
    try:
        with os.scandir(folder) as entries:
            return sorted(
                entry.path
                for entry in entries
                if (follow_symlinks or not entry.is_symlink())
                and entry.is_dir(follow_symlinks=follow_symlinks)
            )
    except OSError:
        return []


def _make_root(root: str) -> None:
    """Make a new watch root. One that cannot be made (a file of its name, a folder it may not
    write) is said here and watched as a missing one (`_listing`, /health): it stopped the
    whole watcher, the other roots too, and nothing said why but /health's "stopped"."""
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cannot make watch root %s (%s); it is watched once it is a folder", root, exc)


def next_pause(pause: float, watched_s: float) -> float:
    """The pause before watching again after a watch that failed `watched_s` after it began:
    twice the last pause, up to `REWATCH_MAX_S`, while watches keep failing soon; `TICK_S`
    again after one that held `REWATCH_MAX_S` or more."""
    return TICK_S if watched_s >= REWATCH_MAX_S else min(pause * 2, REWATCH_MAX_S)


def descriptor_free() -> bool:
    """Whether this process can open a file now (it is not out of descriptors)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        return False
    return True


def out_of_files(failure: BaseException) -> str | None:
    """Why a walk or watchfiles' watch failed, when it is the process or the system out of
    file descriptors (`OUT_OF_FILES`; watchfiles says so in words, `… (os error 24)`), else
    None."""
    if isinstance(failure, OSError) and failure.errno in OUT_OF_FILES:
        return failure.strerror or str(failure)
    found = OS_ERROR.search(str(failure))
    if found is None or int(found[1]) not in OUT_OF_FILES:
        return None
    return os.strerror(int(found[1]))


def undecodable(failure: BaseException) -> str | None:
    """The path watchfiles could not decode, if that is what `failure` (or one exception of
    its group) is: `Unable to decode path "/media/caf\\xE9.mkv" to string` names it."""
    if isinstance(failure, BaseExceptionGroup):
        found = (undecodable(inner) for inner in failure.exceptions)
        return next((name for name in found if name is not None), None)
    match = UNDECODABLE.fullmatch(str(failure))
    return match[1] if match else None


def _any_linked(paths: Iterable[str]) -> bool:
    """Whether a file of `paths` has other names (hard links)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if os.stat(path).st_nlink > 1:
                return True
    return False


def _folder_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the folder at `path`, None if there is none (missing, no folder)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


def _folder_device(path: str) -> int | None:
    """The device of the folder at `path`, None if there is none (missing, not a folder)."""
    identity = _folder_identity(path)
    return None if identity is None else identity[0]


def remounted(before: Mapping[str, int], after: Mapping[str, int]) -> list[str]:
    """The mount points that came, went or changed disk between two looks at the mount table
    (`mount_points`), one before a walk and one after: what the walk listed below them may be
    either disk's (`Watcher._walk`)."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def mount_points(roots: Sequence[str]) -> dict[str, int]:
    """The mount points strictly below `roots`, each with its device, from the mount table
    (none where there is none): a disk mounted on a folder of the library, as a root's files
    may be. Stats each: run it on a thread."""
    try:
        table = MOUNTINFO.read_bytes()
    except OSError:
        return {}
    below = prefixes(roots)
    found: dict[str, int] = {}
    for line in table.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4:  # the fifth is the mount point, its spaces written `\040`
            point = os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8)]), fields[4]))
            device = _folder_device(point) if point.startswith(below) else None
            if device is not None and point not in roots:
                found[point] = device
    return found


@dataclass(frozen=True)
class Listing:
    """One watch root as a reconciliation found it: its device (None: missing), its files, and
    the folders below it that could not be listed (the root itself when missing)."""

    root: str
    device: int | None
    files: dict[str, Stat]
    unlisted: list[str]
    not_text: list[str] = field(default_factory=list)  # names left out (`is_text`)


class RootDevices:
    """The device each watch root's files were last found on, kept across restarts in a small
    JSON file of the data directory (`DEVICES_FILE`; None: in memory only): what tells an
    empty mount point, its disk not mounted, from a folder that was emptied."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._devices: dict[str, int] = {}
        if path is not None:
            with contextlib.suppress(OSError, ValueError, TypeError):
                self._devices = {str(k): int(v) for k, v in json.loads(path.read_text()).items()}

    def get(self, root: str) -> int | None:
        return self._devices.get(root)

    def folders(self) -> list[str]:
        """Every folder remembered: roots, and the mount points below them."""
        return list(self._devices)

    def found(self, seen: Mapping[str, int]) -> None:
        """Remember the device of each folder (root, mount point) that showed files, writing
        the file if it changed."""
        if all(self._devices.get(root) == device for root, device in seen.items()):
            return
        self._devices.update(seen)
        if self.path is not None:
            with contextlib.suppress(OSError):  # worst case: an unmounted disk is not told apart
                part = self.path.with_suffix(".part")
                part.unlink(missing_ok=True)  # made anew: private, as the data directory is
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, datadir.FILE_MODE)
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.write(json.dumps(self._devices, sort_keys=True))
                os.replace(part, self.path)


class _Either:
    """Set when either event is: what watchfiles polls (`is_set`) to end one watch, and sets
    (`set`) when it is cancelled. Its first poll comes from watchfiles' thread once the watch
    is made (`RustNotify` has laid every inotify watch before it waits for changes): `laid`
    is called then, once."""

    def __init__(
        self, first: asyncio.Event, second: asyncio.Event, laid: Callable[[], None]
    ) -> None:
        self._events = (first, second)
        self._laid: Callable[[], None] | None = laid

    def is_set(self) -> bool:
        if self._laid is not None:
            laid, self._laid = self._laid, None
            laid()
        return any(event.is_set() for event in self._events)

    def set(self) -> None:
        self._events[1].set()

    async def wait(self) -> None:
        await _first(*self._events)


async def _first_or_timeout(event: asyncio.Event, seconds: float) -> None:
    """Wait until `event` is set or `seconds` passed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


async def _first(*events: asyncio.Event) -> None:
    """Wait until one of `events` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
