"""What of a watch root is no part of the library: the watcher keeps no record of it and WebDAV
neither lists nor serves it (docs/watcher.md "What it watches", docs/compat.md "WebDAV").

Pure (no I/O), so both the watcher, a service, and WebDAV, an edge, take their rules from one
place below them: the edge need not import the service to agree with it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from metanode.claims import utf8_size

DEFAULT_IGNORED = ("*.part", "*.tmp", "*.crdownload", "*.!qb")

MTIME_MIN, MTIME_MAX = -(1 << 63), (1 << 63) - 1  # what `mtime_of` keeps an mtime within
UNKNOWN_CTIME = 0  # a `local_file` row's `ctime_ns` from before change times were kept


class Stat(NamedTuple):
    """What tells the watcher a file changed: its size and mtime, which a writer sets, and its
    inode's change time and number, which no user can set back. A file rewritten in place to
    the same size with its mtime put back (`touch -r`, a tag editor preserving timestamps)
    keeps its size and mtime, but the kernel moves its ctime on every write; a chmod, a chown
    or a new hard link moves it too, which costs a hash that finds the same midhash."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @property
    def written(self) -> tuple[int, int]:
        """(size, mtime_ns): what a move keeps (a rename moves the ctime on most file systems,
        and a file moved in from another disk is a new inode)."""
        return self.size, self.mtime_ns


def is_text(name: str) -> bool:
    """Whether a name (decoded from the disk's bytes) is text: valid UTF-8, the common case of
    ASCII at once. One that is not (a Latin-1 `caf\\xe9.mkv` from an old share) carries lone
    surrogates that UTF-8, SQLite and JSON cannot hold: records, feeds and WebDAV carry text."""
    return name.isascii() or utf8_size(name) is not None


def mtime_of(info: os.stat_result) -> int:
    """A file's mtime in ns, within a signed 64-bit integer (the years 1677 to 2262), as the
    databases keep it: a file dated past them (ext4 and NTFS take dates to 2446 and beyond; a
    camera's clock gone wrong, `touch -d @99999999999`) failed to be stored, and with it
    every batch it was in and every reconciliation after, for good."""
    return min(max(info.st_mtime_ns, MTIME_MIN), MTIME_MAX)


def ctime_of(info: os.stat_result) -> int:
    """A file's ctime in ns, kept within what the databases store as `mtime_of` keeps the
    mtime (a clock gone wrong when the file last changed)."""
    return min(max(info.st_ctime_ns, MTIME_MIN), MTIME_MAX)


def stat_from(info: os.stat_result) -> Stat:
    """A file's `Stat` from what `os.stat` or `os.fstat` gave."""
    return Stat(info.st_size, mtime_of(info), ctime_of(info), info.st_ino)


@dataclass(frozen=True)
class Rules:
    """Which paths the watcher ignores, and whether it follows symlinks.

    A path is ignored when any of its components (below the watch root) is a dot-name or matches
    a name glob (case-insensitively): so a file inside an ignored folder is ignored however it
    arrives, by a walk or by inotify. Globs with a `/` match the path relative to the root.
    Names that are not valid UTF-8 are ignored too (`ignored` tells its caller, which says so:
    the database stores text). Files smaller than `min_size` bytes are not content (every empty
    file has one midhash): a walk skips them and a file that shrinks below it counts as gone.
    """

    globs: tuple[str, ...] = ()
    follow_symlinks: bool = False
    min_size: int = 1

    def kept(self, current: Stat | None) -> Stat | None:
        """The stat of a file worth a record: None for nothing there or too small a file."""
        return current if current is not None and current[0] >= self.min_size else None

    @cached_property
    def _name_match(self) -> Callable[[str], re.Match[str] | None]:
        names = [g for g in DEFAULT_IGNORED + self.globs if "/" not in g]
        return re.compile("|".join(fnmatch.translate(g) for g in names), re.IGNORECASE).match

    @cached_property
    def path_globs(self) -> tuple[str, ...]:
        """The globs that match a path relative to the root (those with a `/`)."""
        return tuple(g for g in self.globs if "/" in g)

    def ignored_name(self, name: str) -> bool:
        """One path component: dot-name or a name glob."""
        return name.startswith(".") or self._name_match(name) is not None

    def ignored(self, root: str, path: str, not_text: Callable[[str], None] | None = None) -> bool:
        """Whether `path` is ignored: the root itself never is, a path outside it always is.
        A path ignored for a name that is not text is handed to `not_text` (the watcher logs
        it; a WebDAV request for it was refused before it got here)."""
        if path == root:
            return False
        prefix = root.rstrip("/") + "/"
        if not path.startswith(prefix):
            return True
        relative = path[len(prefix) :]
        parts = relative.split("/")
        if any(self.ignored_name(part) for part in parts):
            return True
        if not all(map(is_text, parts)):
            if not_text is not None:
                not_text(path)
            return True
        return any(fnmatch.fnmatchcase(relative, g) for g in self.path_globs)
