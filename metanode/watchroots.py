"""The watch roots the owner chooses on the page (docs/watcher.md, "Choosing the folders").

When neither the config file nor the environment sets `watch_roots`, the folders are the
owner's: `POST /api/watch-roots` and the Files page add one, `DELETE` stops watching one, and
the list is kept in the data directory (`config.WATCHED_FOLDERS`, read by `config.load` at
every start in place of the default). This module checks a folder before it becomes a root
(`check_new`) and writes the list (`save`); the node does the rest (`Node.add_watch_root`).

It also keeps each root's WebDAV name (`Names`, docs/compat.md "WebDAV"), whoever chose the
roots: a name derived from the set of roots (`-2` for the second `films` in order) changed
another folder's name when one was let go, so each is given once and kept in the data
directory (`WEBDAV_NAMES`) for as long as its folder stays watched.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from metanode import datadir
from metanode.config import WATCHED_FOLDERS, WEBDAV_PLUGIN, page_roots
from metanode.errors import (
    WatchRootDataDir,
    WatchRootMissing,
    WatchRootNotFolder,
    WatchRootPluginOutputs,
    WatchRootsDamaged,
    WatchRootTaken,
    WatchRootUnreadable,
)

log = logging.getLogger(__name__)

WEBDAV_NAMES = "webdav-names.json"  # in the data directory: each watch root's WebDAV name
FORMER_MAX = 100  # names of folders let go kept to give back (`named`), the oldest forgotten
NONE: Mapping[str, str] = MappingProxyType({})


def check_new(text: str, roots: Sequence[str], data_dir: Path, outputs: Path | None) -> str:
    """The absolute path of folder `text` (relative to the working directory, as the setting
    is), if it may become a watch root: an existing folder this process may list, neither the
    data directory nor inside it nor holding it (the rule `Settings._check_roots` enforces of
    `watch_roots`, and its other half: a root inside the data directory would serve its files
    too), nor the plugin outputs' folder `outputs` (None: WebDAV writes are off) nor inside
    nor holding it (`Settings._check_plugin_outputs`' rule: accepted here, it refused the next
    start), and no folder watched already (by another spelling or a link); else the typed
    refusal, naming it."""
    path = os.path.abspath(text)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise WatchRootMissing(f"{path} does not exist (or is not mounted)") from None
    except OSError as exc:
        raise WatchRootUnreadable(f"{path} cannot be looked at: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise WatchRootNotFolder(f"{path} is a file, not a folder")
    if not os.access(path, os.R_OK | os.X_OK):
        raise WatchRootUnreadable(f"{path} is a folder this node may not read (its permissions)")
    real, data = os.path.realpath(path), os.path.realpath(data_dir)
    if overlap(real, data):
        raise WatchRootDataDir(
            f"{path} overlaps the data directory {data}: WebDAV would serve the API token and "
            "the keys, and the watcher fingerprint them; choose a folder outside it"
        )
    if outputs is not None and overlap(real, os.path.realpath(outputs)):
        raise WatchRootPluginOutputs(
            f"{path} overlaps the plugin outputs' folder {outputs} (webdav_plugin_dir), which "
            "WebDAV clients write into: their writes would reach the media; choose a folder "
            "outside it"
        )
    for root in roots:
        if os.path.realpath(root) == real:
            raise WatchRootTaken(f"{path} is watched already (as {root})")
    return path


def overlap(one: str, other: str) -> bool:
    """Whether real paths `one` and `other` are the same folder, or one holds the other."""
    return os.path.commonpath([one, other]) in (one, other)


def save(data_dir: Path, roots: Sequence[str]) -> None:
    """Keep `roots` as the folders to watch from the next start on (`write`)."""
    write(data_dir / WATCHED_FOLDERS, roots)


def write(path: Path, roots: Sequence[str]) -> None:
    """A list of watched folders at `path` (the data directory's, or a backup's copy), whole or
    not at all (`datadir.write_whole`)."""
    datadir.write_whole(
        path, json.dumps({"roots": list(roots)}, indent=1, ensure_ascii=False) + "\n"
    )


class Followed:
    """The list as another process keeps it: a reader worker of `serve --workers N` serves
    `filePath` and the file events, but the owner worker changes the folders (it takes every
    `POST`/`DELETE /api/watch-roots`) and writes them here (`save`). Read again whenever the
    file is another (`save` renames a new one over it: another inode) or changed, one `stat`
    a look; a list that cannot be read keeps the last one read, logged (the owner never
    writes such a one: someone edited it by hand)."""

    def __init__(self, data_dir: Path, roots: Sequence[str]) -> None:
        self.data_dir = data_dir
        self.roots = [os.path.abspath(root) for root in roots]
        self._seen: tuple[int, int, int] | None = None

    def __call__(self) -> list[str]:
        try:
            info = os.stat(self.data_dir / WATCHED_FOLDERS)
        except OSError:
            return self.roots  # never chosen (or let go by hand): what the start read
        seen = (info.st_ino, info.st_size, info.st_mtime_ns)
        if seen != self._seen:
            self._seen = seen
            try:
                chosen = page_roots(self.data_dir)
            except WatchRootsDamaged as exc:
                log.warning("%s: the folders stay %s", exc.message, ", ".join(self.roots))
            else:  # None: gone between the two looks, as if never chosen
                self.roots = self.roots if chosen is None else list(chosen)
        return self.roots


def named(
    roots: Sequence[str], kept: Mapping[str, str], former: Mapping[str, str] = NONE
) -> list[tuple[str, str]]:
    """(WebDAV name, root) for each of `roots`, in their order: the name `kept` gives a root
    (`Names`: the one it was given when it came), unless an earlier root holds it too (a list
    edited by hand); else the name it had before it was let go (`former`), if none holds it
    now: a disk's folder let go and chosen again keeps its consumers' paths; else its
    folder's basename (`root` for `/`), made unique with `-2`, `-3`… against every name held,
    and never `plugin`. A pure function of its arguments, so every worker of one node names
    the roots alike."""
    taken = {WEBDAV_PLUGIN}
    names: dict[str, str] = {}
    for given in (kept, former):
        for root in roots:
            name = given.get(root)
            if root not in names and name is not None and name not in taken:
                names[root] = name
                taken.add(name)
    for root in roots:
        if root not in names:
            base = os.path.basename(os.path.realpath(root)) or "root"
            name, n = base, 1
            while name in taken:
                n += 1
                name = f"{base}-{n}"
            names[root] = name
            taken.add(name)
    return [(names[root], root) for root in roots]


def read_names(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The names kept at `path` (`{"names": {root: name}, "former": {root: name}}`: the
    roots' and those of folders let go), empty when there are none; a file that cannot be
    read as that is logged and read as none (the roots are named anew, and the owner writes
    the file again): WebDAV's names are no reason to refuse a start. A name that is no single
    path segment is left out (named anew); a file without `former` (written before it was
    kept) has none."""
    try:
        written: Any = json.loads(path.read_text(encoding="utf-8"))
        kept, former = written["names"], written.get("former", {})
    except FileNotFoundError:
        return {}, {}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("cannot read the WebDAV names in %s (%s): the roots are named anew", path, exc)
        return {}, {}
    if not isinstance(kept, dict) or not isinstance(former, dict):
        log.warning("%s holds no names: the roots are named anew", path)
        return {}, {}
    return _segments(kept), _segments(former)


def write_names(path: Path, names: Mapping[str, str], former: Mapping[str, str]) -> None:
    """The names as `read_names` reads them, written whole as `path`."""
    text = json.dumps({"names": names, "former": former}, indent=1, ensure_ascii=False)
    datadir.write_whole(path, text + "\n")


def _segments(names: Mapping[str, object]) -> dict[str, str]:
    """The (root, name) pairs of `names` whose name can be one (`segment`)."""
    return {root: name for root, name in names.items() if isinstance(name, str) and segment(name)}


def segment(name: object) -> bool:
    """Whether `name` can be a top-level WebDAV collection's: one path segment, not `.`/`..`."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(char in name for char in "/\0")
    )


class Names:
    """The WebDAV names of the watch roots (`named`), kept in the data directory
    (`WEBDAV_NAMES`, written whole: `datadir.write_whole`). The process that changes the roots
    (the owner worker, or the only process) writes them (`keep`) at its start and at each
    change, before the new roots are served; every process reads them again whenever the file
    is another or changed (one `stat` a look, as `Followed` does), so a reader worker names a
    root as the owner does, and a restart as before it."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / WEBDAV_NAMES
        self.kept: dict[str, str] = {}
        self.former: dict[str, str] = {}  # of folders let go, the newest last
        self._seen: tuple[int, int, int] | None = None

    def __call__(self, roots: Sequence[str]) -> list[tuple[str, str]]:
        """(name, root) for each of `roots`, by the names kept now."""
        self._follow()
        return named(roots, self.kept, self.former)

    def _follow(self) -> None:
        try:
            info = os.stat(self.path)
        except OSError:
            return  # none kept yet: what was read (nothing), or what this process wrote
        seen = (info.st_ino, info.st_size, info.st_mtime_ns)
        if seen != self._seen:
            self._seen = seen
            self.kept, self.former = read_names(self.path)

    def keep(self, roots: Sequence[str]) -> None:
        """Name `roots` (those already named keep their names; one no longer among them gives
        its name up, and it is kept as its former name, the newest `FORMER_MAX`) and write the
        names if they changed; a disk that refuses is its typed `StorageError`, nothing
        changed."""
        self._follow()
        names = {root: name for name, root in named(roots, self.kept, self.former)}
        given_up = {root: name for root, name in self.kept.items() if root not in names}
        former = {
            root: name
            for root, name in self.former.items()
            if root not in names and root not in given_up
        } | given_up
        former = dict(list(former.items())[-FORMER_MAX:])
        if names != self.kept or former != self.former or self._seen is None:
            write_names(self.path, names, former)
            self.kept, self.former = names, former
