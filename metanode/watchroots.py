"""The watch roots the owner chooses on the page (docs/watcher.md, "Choosing the folders").

When neither the config file nor the environment sets `watch_roots`, the folders are the
owner's: `POST /api/watch-roots` and the Files page add one, `DELETE` stops watching one, and
the list is kept in the data directory (`config.WATCHED_FOLDERS`, read by `config.load` at
every start in place of the default). This module checks a folder before it becomes a root
(`check_new`) and writes the list (`save`); the node does the rest (`Node.add_watch_root`).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from metanode import datadir
from metanode.config import WATCHED_FOLDERS, page_roots
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
