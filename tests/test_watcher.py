"""The watcher's pure parts and its decisions, without a server (SPEC §6).

`Rules.ignored`, `walk`, `plan`, `stat_of` and `hash_settled` on real temporary directories; then
`Watcher` itself wired to an in-memory stand-in for the node (`Store`: the three callables the
watcher is given), so reconciliation, inotify batches and the settle loop are driven by hand.
The real inotify/server round trips are in test_watcher_server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import resource
import shutil
import sqlite3
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import watchfiles
from hypothesis import example, given
from hypothesis import strategies as st

from metanode import cache, db, watcher
from metanode import cid as cids
from metanode.errors import MidhashError
from metanode.ignores import UNKNOWN_CTIME, Rules, Stat, stat_from
from metanode.merge import LocalFile
from metanode.node import Node
from metanode.watcher import Watcher, hash_settled, plan, stat_of, walk
from tests.helpers.mounts import Mounts
from tests.helpers.rewrite import rewrite_in_place
from tests.helpers.settings import settings_for
from tests.helpers.sqlsteps import vm_steps
from tests.helpers.wait import until

Change = watchfiles.Change


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def stat_now(path: Path) -> Stat:
    """The file's `Stat` as the watcher takes it (size, mtime, ctime, inode)."""
    return stat_from(path.stat())


# -- Rules.ignored ------------------------------------------------------------------------------

pytestmark = pytest.mark.both_backends  # the tests on a `node` run on both

ROOT = "/srv/media"


@pytest.mark.parametrize(
    "relative",
    [
        ".hidden",
        ".DS_Store",
        ".cache/movie.mkv",
        "shows/.trash/episode.mkv",
        "shows/.hidden.mkv",
        "movie.mkv.part",
        "movie.mkv.PART",
        "movie.tmp",
        "setup.crdownload",
        "movie.mkv.!qB",
        "movie.mkv.!QB",
        "folder.part",
    ],
)
def test_default_rules_ignore(relative: str) -> None:
    assert Rules().ignored(ROOT, f"{ROOT}/{relative}")


@pytest.mark.parametrize(
    "relative",
    [
        "movie.mkv",
        "shows/s01/e01.mkv",
        "not.hidden/movie.mkv",
        "movie.part.mkv",
        "tmp",
        "partial",
        "movie.mkv.parts",
        "a..b",
    ],
)
def test_default_rules_keep(relative: str) -> None:
    assert not Rules().ignored(ROOT, f"{ROOT}/{relative}")


def test_the_root_itself_is_never_ignored_and_outside_paths_are() -> None:
    rules = Rules()
    assert not rules.ignored(ROOT, ROOT)
    assert not rules.ignored("/srv/.media", "/srv/.media/movie.mkv")  # a dot in the root's own path
    assert rules.ignored(ROOT, "/srv/other/movie.mkv")  # relpath starts with ".."


def test_configured_globs_match_names_case_insensitively_and_relative_paths() -> None:
    rules = Rules(globs=("*.NFO", "Thumbs.db", "extras/*"))
    assert rules.ignored(ROOT, f"{ROOT}/movie.nfo")
    assert rules.ignored(ROOT, f"{ROOT}/deep/down/movie.Nfo")
    assert rules.ignored(ROOT, f"{ROOT}/sub/thumbs.db")
    assert rules.ignored(ROOT, f"{ROOT}/extras/trailer.mkv")
    assert not rules.ignored(ROOT, f"{ROOT}/movie.mkv")
    assert not rules.ignored(ROOT, f"{ROOT}/sub/extras.mkv")
    # the defaults still apply alongside configured globs
    assert rules.ignored(ROOT, f"{ROOT}/movie.tmp")


def test_a_name_that_is_not_text_is_ignored_and_handed_to_the_caller_to_say() -> None:
    """`ignores` is pure: it logs nothing, and hands the watcher (on an inotify event) the path
    it leaves out for a name not UTF-8, so the log says it; a name ignored anyway is not."""
    said: list[str] = []
    latin1 = f"{ROOT}/caf\udce9/movie.mkv"
    assert Rules().ignored(ROOT, latin1, said.append)
    assert Rules().ignored(ROOT, f"{ROOT}/.caf\udce9.mkv", said.append)  # a dot-name first
    assert Rules().ignored(ROOT, latin1)  # nobody told, still ignored (WebDAV)
    assert said == [latin1]


@pytest.mark.parametrize(
    ("globs", "relative"),
    [
        (("Samples",), "Movie/Samples/clip.mkv"),
        ((), "download.part/movie.mkv"),
    ],
)
def test_files_below_an_ignored_folder_are_ignored(globs: tuple[str, ...], relative: str) -> None:
    rules = Rules(globs=globs)
    folder = f"{ROOT}/{relative.rsplit('/', 1)[0]}"
    assert rules.ignored(ROOT, folder)  # walk() does not enter it…
    assert rules.ignored(ROOT, f"{ROOT}/{relative}")  # …so the live path must skip its files too


# -- walk ---------------------------------------------------------------------------------------


def test_walk_lists_kept_regular_files_with_their_stat(tmp_path: Path) -> None:
    root = tmp_path / "root"
    kept = [
        write(root / "a.mkv", b"a"),
        write(root / "sub" / "b.mkv", b"bb"),
        write(root / "sub" / "deeper" / "c.mkv", b"ccc"),
    ]
    empty = write(root / "empty", b"")  # no content: kept only with min_size 0
    for name in (
        ".hidden",
        ".dot/x.mkv",
        "sub/.dot/y.mkv",
        "d.part",
        "e.tmp",
        "f.crdownload",
        "g.!qB",
        "skip.part/inside.mkv",
    ):
        write(root / name, b"ignored")
    os.mkfifo(root / "fifo")
    (root / "empty-folder").mkdir()
    listed = dict(walk(str(root), Rules()))
    assert listed == {str(p): stat_now(p) for p in kept}
    assert dict(walk(str(root), Rules(min_size=0))) == {str(p): stat_now(p) for p in [*kept, empty]}


def test_walk_applies_configured_globs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root / "movie.mkv", b"m")
    write(root / "movie.nfo", b"n")
    write(root / "extras" / "trailer.mkv", b"t")
    listed = dict(walk(str(root), Rules(globs=("*.nfo", "extras/*"))))
    assert set(listed) == {str(root / "movie.mkv")}


def test_walk_does_not_follow_symlinks_by_default(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    write(root / "real.mkv", b"real")
    target = write(outside / "target.mkv", b"target")
    write(outside / "folder" / "inner.mkv", b"inner")
    (root / "link.mkv").symlink_to(target)
    (root / "linked-folder").symlink_to(outside / "folder")
    (root / "dangling.mkv").symlink_to(tmp_path / "nowhere")
    assert set(dict(walk(str(root), Rules()))) == {str(root / "real.mkv")}


def test_walk_follows_symlinks_when_asked(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    write(root / "real.mkv", b"real")
    target = write(outside / "target.mkv", b"target")
    inner = write(outside / "folder" / "inner.mkv", b"inner")
    (root / "link.mkv").symlink_to(target)
    (root / "linked-folder").symlink_to(outside / "folder")
    (root / "dangling.mkv").symlink_to(tmp_path / "nowhere")
    listed = dict(walk(str(root), Rules(follow_symlinks=True)))
    assert listed == {
        str(root / "real.mkv"): stat_now(root / "real.mkv"),
        str(root / "link.mkv"): stat_now(target),  # the target's stat
        str(root / "linked-folder" / "inner.mkv"): stat_now(inner),
    }


def test_walk_visits_a_folder_reached_twice_through_symlinks_once(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    write(outside / "shared" / "x.mkv", b"x")
    (root / "one").mkdir(parents=True)
    (root / "one" / "a").symlink_to(outside / "shared")
    (root / "one" / "b").symlink_to(outside / "shared")
    (root / "one" / "loop").symlink_to(root / "one")  # a cycle below the root
    listed = list(walk(str(root), Rules(follow_symlinks=True)))
    assert len(listed) == 1  # terminates, and the shared folder's file is listed once
    assert listed[0][0] in {str(root / "one" / "a" / "x.mkv"), str(root / "one" / "b" / "x.mkv")}


def test_walk_a_symlink_back_to_the_root_does_not_list_the_tree_twice(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root / "a.mkv", b"a")
    (root / "all").symlink_to(root)
    listed = sorted(p for p, _ in walk(str(root), Rules(follow_symlinks=True)))
    assert listed == [str(root / "a.mkv")]


def test_walk_from_a_link_up_to_a_folder_above_it_lists_nothing(tmp_path: Path) -> None:
    """A link made to the root (or a folder on the way to it) is reported by inotify, and its
    walk listed the library again below the link; a walk from the root lists it once."""
    root = tmp_path / "root"
    write(root / "a.mkv", b"a")
    write(root / "Music" / "b.flac", b"b")
    (root / "Music" / "all").symlink_to(root)
    (root / "Music" / "up").symlink_to(root / "Music")
    (root / "Music" / "sub").mkdir()
    rules = Rules(follow_symlinks=True)
    for link in ("all", "up"):
        assert list(walk(str(root), rules, str(root / "Music" / link))) == []
    assert [p for p, _ in walk(str(root), rules, str(root / "Music"))] == [
        str(root / "Music" / "b.flac")
    ]
    assert sorted(p for p, _ in walk(str(root), rules)) == [
        str(root / "Music" / "b.flac"),
        str(root / "a.mkv"),
    ]


def lock_folders(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make every folder whose path ends in `name` unlistable, as its mode makes it for any
    user but root (who can read anything, and runs these tests)."""
    real_scandir = os.scandir

    def scandir(path: str) -> Iterable[os.DirEntry[str]]:
        if path.endswith(name):
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)


def test_walk_skips_an_unlistable_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    write(root / "ok" / "a.mkv", b"a")
    write(root / "locked" / "b.mkv", b"b")
    lock_folders(monkeypatch, "locked")
    unlisted: list[str] = []
    assert set(dict(walk(str(root), Rules(), unlisted=unlisted))) == {str(root / "ok" / "a.mkv")}
    assert unlisted == [str(root / "locked")]


def test_walk_says_what_lies_past_path_max_and_a_name_not_utf8(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tree copied in deep enough holds paths longer than PATH_MAX (nothing can open them),
    skipped without a word; a Latin-1 name was named without its folder. Both are said, once,
    with where they are."""
    root = tmp_path / "root"
    write(root / "a.mkv", b"a")
    deep = os.open(root, os.O_RDONLY)
    try:
        for _ in range(21):  # 21 folders of 200 bytes: past 4,096 bytes once the root is in front
            os.mkdir("d" * 200, dir_fd=deep)
            below = os.open("d" * 200, os.O_RDONLY, dir_fd=deep)
            os.close(deep)
            deep = below
        os.close(os.open("deep.mkv", os.O_WRONLY | os.O_CREAT, dir_fd=deep))
    finally:
        os.close(deep)
    latin1 = os.path.join(os.fsencode(root), b"Vid\xe9os")
    os.mkdir(latin1)
    write(Path(os.fsdecode(latin1)) / "inside.mkv", b"b")
    not_text: list[str] = []
    with caplog.at_level(logging.WARNING, "metanode.watcher"):
        assert set(dict(walk(str(root), Rules(), not_text=not_text))) == {str(root / "a.mkv")}
    assert not_text == [f"{root}/Vid\\xe9os"]
    said = [r.getMessage() for r in caplog.records]
    assert (
        f"ignoring a name that is not valid UTF-8: {root}/Vid\\xe9os (rename it: docs/watcher.md)"
        in said
    )
    assert any(
        m.startswith(f"skipping what {root}/ddd") and "longer than the system takes" in m
        for m in said
    ), said


def test_watch_paths_go_around_an_unreadable_folder(tmp_path: Path) -> None:
    """notify watches each path recursively but stops at the first folder it may not read: so
    the folders on the way down to one are given (each is watched before its walk stops), and
    their other sub-folders whole. A root with none is given as it is; one missing from the
    roots given (not mounted) is left out."""
    root, other = tmp_path / "media", tmp_path / "other"
    for folder in ("a/b/locked", "a/b/c", "a/d/e", "f", "g/h"):
        (root / folder).mkdir(parents=True)
    (other / "x").mkdir(parents=True)
    (root / "a" / "link").symlink_to(root / "f")
    paths = watcher.watch_paths(
        [str(root), str(other)], {str(root / "a/b/locked"), str(tmp_path / "gone/y")}, False
    )
    assert paths == [
        str(other),
        *(str(root / p) for p in ("", "a", "a/b")),
        *(str(root / p) for p in ("f", "g", "a/d", "a/b/c")),
    ]
    assert watcher.watch_paths([str(root)], set(), False) == [str(root)]


# -- plan ---------------------------------------------------------------------------------------


async def test_undecodable_names_the_path_watchfiles_could_not_decode(tmp_path: Path) -> None:
    """The real failure, as watchfiles raises it today: if its wording changes, this fails
    (and the watcher would log tracebacks again instead of one warning)."""
    stop = asyncio.Event()

    async def change() -> None:
        while not stop.is_set():  # until the watch has started and failed on it
            Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9.mkv"))).touch()
            await asyncio.sleep(0.05)

    writer = asyncio.create_task(change())
    try:
        with pytest.raises(BaseException) as failed:
            async for _ in watchfiles.awatch(tmp_path, stop_event=stop, debounce=50, step=10):
                pass
    finally:
        stop.set()
        await writer
    assert watcher.undecodable(failed.value) == f'"{tmp_path}/caf\\xE9.mkv"'
    assert watcher.undecodable(RuntimeError("disk on fire")) is None


@given(st.lists(st.floats(min_value=0, max_value=100), min_size=1, max_size=40))
@example([0.1] * 12 + [31.0, 0.1])
def test_watches_that_keep_failing_soon_wait_longer_up_to_the_cap(watched: list[float]) -> None:
    """Each pause doubles while watches fail soon after they began, never past the cap, and a
    watch that held the cap long starts over. Measured from the last failure instead, a pause
    at the cap made the next failure look old and the pause fell back to a quarter second."""
    pause = watcher.TICK_S
    for held in watched:
        after = watcher.next_pause(pause, held)
        if held >= watcher.REWATCH_MAX_S:
            assert after == watcher.TICK_S
        else:
            assert after == min(2 * pause, watcher.REWATCH_MAX_S)
        assert watcher.TICK_S <= after <= watcher.REWATCH_MAX_S
        pause = after
    assert watcher.next_pause(watcher.REWATCH_MAX_S, 0.1) == watcher.REWATCH_MAX_S


def test_plan_hashes_new_and_changed_and_removes_vanished() -> None:
    disk = {
        "/m/new": Stat(1, 10, 5, 1),
        "/m/same": Stat(2, 20, 5, 2),
        "/m/grown": Stat(4, 30, 5, 3),
        "/m/touched": Stat(5, 41, 5, 4),
        "/m/rewritten": Stat(6, 50, 9, 5),  # same size, mtime put back: its ctime moved
        "/m/replaced": Stat(7, 60, 5, 8),  # another file of its size and mtime swapped in
    }
    known = {
        "/m/same": Stat(2, 20, 5, 2),
        "/m/grown": Stat(3, 30, 5, 3),
        "/m/touched": Stat(5, 40, 5, 4),
        "/m/rewritten": Stat(6, 50, 5, 5),
        "/m/replaced": Stat(7, 60, 5, 6),
        "/m/gone": Stat(6, 60, 5, 7),
        "/m/also-gone": Stat(7, 70, 5, 9),
    }
    to_hash, to_remove, to_fill = plan(disk, known)
    assert to_hash == ["/m/grown", "/m/new", "/m/replaced", "/m/rewritten", "/m/touched"]
    assert to_remove == ["/m/also-gone", "/m/gone"]
    assert to_fill == []


def test_plan_fills_the_ctime_of_rows_from_before_it_was_kept_without_hashing() -> None:
    """A row of cache schema 13 has no ctime: the file as it was hashed otherwise (size, mtime,
    inode) takes the disk's ctime without a hash; one whose size, mtime or inode moved, or
    whose row has no inode either (schema 3), is hashed."""
    disk = {
        "/m/kept": Stat(1, 10, 77, 1),
        "/m/touched": Stat(2, 21, 77, 2),
        "/m/replaced": Stat(3, 30, 77, 9),
        "/m/no-inode": Stat(4, 40, 77, 4),
    }
    known = {
        "/m/kept": Stat(1, 10, UNKNOWN_CTIME, 1),
        "/m/touched": Stat(2, 20, UNKNOWN_CTIME, 2),
        "/m/replaced": Stat(3, 30, UNKNOWN_CTIME, 3),
        "/m/no-inode": Stat(4, 40, UNKNOWN_CTIME, 0),
    }
    assert plan(disk, known) == (["/m/no-inode", "/m/replaced", "/m/touched"], [], ["/m/kept"])


FOLDERS = st.sampled_from(["/m", "/m/a", "/m/a/b", "/m/c", "/n"])
ONE = Stat(1, 1, 1, 1)


@given(
    st.dictionaries(st.builds("{}/{}".format, FOLDERS, st.sampled_from("xyz")), st.just(ONE)),
    st.dictionaries(st.builds("{}/{}".format, FOLDERS, st.sampled_from("xyz")), st.just(ONE)),
    st.lists(FOLDERS, max_size=2),
)
def test_plan_never_removes_what_lies_below_a_folder_it_could_not_read(
    disk: dict[str, Stat], known: dict[str, Stat], unlisted: list[str]
) -> None:
    """A row is removed exactly when its file is not on the disk and no unlisted folder (an
    unreadable one, a root not mounted) holds it: not seen is not gone."""
    _, to_remove, _ = plan(disk, known, unlisted)
    for path in known:
        below = any(path.startswith(folder + "/") for folder in unlisted)
        assert (path in to_remove) == (path not in disk and not below), (path, unlisted)


def test_plan_of_an_unchanged_tree_is_empty() -> None:
    disk = {f"/m/{i}": Stat(i, i * 7, i * 9, i) for i in range(100)}
    assert plan(disk, dict(disk)) == ([], [], [])
    assert plan({}, {}) == ([], [], [])


# -- stat_of / hash_settled ---------------------------------------------------------------------


def test_stat_of_regular_files_only(tmp_path: Path) -> None:
    f = write(tmp_path / "f", b"12345")
    (tmp_path / "link").symlink_to(f)
    assert stat_of(str(f), False) == stat_now(f)
    assert stat_of(str(tmp_path), False) is None  # a folder
    assert stat_of(str(tmp_path / "link"), False) is None  # the link itself
    assert stat_of(str(tmp_path / "link"), True) == stat_now(f)
    assert stat_of(str(tmp_path / "missing"), True) is None


def test_hash_settled_hashes_a_file_that_kept_its_stat(tmp_path: Path) -> None:
    data = os.urandom(3000)
    f = write(tmp_path / "f.mkv", data)
    now = stat_now(f)
    result = hash_settled(str(f), now)
    assert result == LocalFile(
        str(f), cids.midhash_bytes(data), *now.written, now.ino, now.ctime_ns
    )


def test_hash_settled_refuses_a_file_whose_stat_moved_on(tmp_path: Path) -> None:
    f = write(tmp_path / "f.mkv", b"first")
    settled = stat_now(f)
    with f.open("ab") as out:
        out.write(b" and more")
    assert hash_settled(str(f), settled) is None
    f.unlink()
    assert hash_settled(str(f), settled) is None  # vanished


def test_hash_settled_refuses_a_file_changed_while_being_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changed between the first stat and the end of the hash: None, so the caller waits again."""
    f = write(tmp_path / "f.mkv", b"original content")
    settled = stat_now(f)
    real = watcher.midhash_opened

    def midhash_then_append(path: str | os.PathLike[str]) -> tuple[str, os.stat_result]:
        answer = real(path)
        with open(path, "ab") as out:
            out.write(b"+")
        return answer

    monkeypatch.setattr(watcher, "midhash_opened", midhash_then_append)
    assert hash_settled(str(f), settled) is None


def test_hash_settled_refuses_a_same_size_rewrite_while_being_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = write(tmp_path / "f.mkv", b"A" * 100)
    settled = stat_now(f)
    real = watcher.midhash_opened

    def midhash_then_rewrite(path: str | os.PathLike[str]) -> tuple[str, os.stat_result]:
        answer = real(path)
        Path(path).write_bytes(b"B" * 100)
        os.utime(path, ns=(settled.mtime_ns + 1_000_000, settled.mtime_ns + 1_000_000))
        return answer

    monkeypatch.setattr(watcher, "midhash_opened", midhash_then_rewrite)
    assert hash_settled(str(f), settled) is None


# -- Watcher, against an in-memory node ---------------------------------------------------------


@dataclass
class Store:
    """The node as the watcher sees it: groups, `local_file` rows, and every commit made."""

    rows: dict[str, LocalFile] = field(default_factory=dict)
    groups: set[str] = field(default_factory=set)
    commits: list[tuple[list[LocalFile], list[str]]] = field(default_factory=list)
    read: int = 0  # the rows `known_stats` has answered, all calls together
    filled: int = 0  # the rows `fill_ctimes` gave a ctime

    async def ensure_groups(self, midhashes: Sequence[str]) -> None:
        self.groups.update(midhashes)

    async def apply_local(self, files: Sequence[LocalFile], removals: Sequence[str]) -> None:
        assert {f.midhash for f in files} <= self.groups, "groups must be ensured first"
        self.commits.append((list(files), list(removals)))
        for gone in removals:
            for path in [p for p in self.rows if p == gone or p.startswith(gone + "/")]:
                del self.rows[path]
        self.rows.update((f.path, f) for f in files)

    def known_stats(self, paths: Sequence[str]) -> dict[str, Stat]:
        """The rows at or below `paths`, as `cache.local_stats` answers (counted in `read`)."""
        exact, below = set(paths), tuple(u.rstrip("/") + "/" for u in paths)
        found = {
            p: watcher.stat_recorded(f)
            for p, f in self.rows.items()
            if p in exact or p.startswith(below)
        }
        self.read += len(found)
        return found

    def stray_stats(self, roots: Sequence[str]) -> dict[str, Stat]:
        below = self.known_stats(roots)
        return {p: watcher.stat_recorded(f) for p, f in self.rows.items() if p not in below}

    async def fill_ctimes(self, found: Mapping[str, Stat]) -> None:
        """As `cache.fill_ctimes_txn`: the ctime of rows that have none (counted in `filled`)."""
        for path, now in found.items():
            row = self.rows[path]
            if watcher.stat_recorded(row) == now._replace(ctime_ns=UNKNOWN_CTIME):
                self.rows[path] = replace(row, ctime_ns=now.ctime_ns)
                self.filled += 1

    def watcher(
        self,
        root: Path,
        settle_s: float = 0.0,
        rules: Rules | None = None,
        devices: watcher.RootDevices | None = None,
    ) -> Watcher:
        return Watcher(
            [str(root)],
            rules or Rules(),
            settle_s,
            0,
            2,
            self.ensure_groups,
            self.apply_local,
            self.known_stats,
            self.fill_ctimes,
            devices,
            self.stray_stats,
        )


def local(path: Path) -> LocalFile:
    return watcher.recorded(str(path), watcher.midhash_file(path)[0], stat_now(path))


async def test_reconcile_hashes_new_files_then_nothing(tmp_path: Path) -> None:
    root = tmp_path / "media"
    files = [write(root / f"f{i}.mkv", os.urandom(1000 * (i + 1))) for i in range(3)]
    write(root / ".hidden", b"h")
    store = Store()
    w = store.watcher(root)
    calls: list[tuple[int, int, int, int]] = []
    summary = await w.reconcile(settle=False, progress=lambda *a: calls.append(a))
    assert (summary.seen, summary.hashed, summary.unchanged, summary.removed) == (3, 3, 0, 0)
    assert summary.failed == []
    assert summary.bytes_sampled == 1000 + 2000 + 3000
    assert calls[0] == (0, 0, 3, 6000) and calls[-1] == (3, 6000, 3, 6000)
    assert store.rows == {str(f): local(f) for f in files}
    assert len(store.commits) == 1  # one batch

    again = await w.reconcile(settle=False)
    assert (again.seen, again.hashed, again.unchanged, again.removed) == (3, 0, 3, 0)
    assert len(store.commits) == 1  # nothing hashed, nothing committed
    assert not w.scanning


async def test_it_says_scanning_until_a_reconciliation_has_ended(tmp_path: Path) -> None:
    """From its start until its first reconciliation ends (its inotify watch being laid, the
    disk not read yet), /health said `scanning` false as of a watcher that had read the disk."""
    root = tmp_path / "media"
    write(root / "a.mkv", b"a")
    w = Store().watcher(root)
    assert w.scanning
    await w.reconcile(settle=False)
    assert not w.scanning


async def test_a_reconciliation_begun_and_ended_inside_another_leaves_it_its_progress(
    tmp_path: Path,
) -> None:
    """A rescan may run while the start's scan is still fingerprinting. The one that ended
    first took the other's progress away with its own (`scan` None), and the other then failed
    at its next batch (AttributeError), its remaining files left unhashed; and /health said
    `scanning` false while one still ran."""
    root = tmp_path / "media"
    for i in range(watcher.BATCH + 44):
        write(root / f"f{i:03d}.mkv", f"file {i}".encode())
    store = Store()
    w = store.watcher(root)
    commit = store.apply_local
    inner: list[watcher.Summary] = []

    async def rescan_inside_the_first_batch(
        files: Sequence[LocalFile], removals: Sequence[str]
    ) -> None:
        await commit(files, removals)
        if not inner:
            inner.append(await w.reconcile([str(root)], settle=False))
            assert w.scanning  # the outer one still runs

    w._apply_local = rescan_inside_the_first_batch
    outer = await w.reconcile(settle=False)
    assert (outer.seen, outer.hashed, outer.left) == (300, 300, 0)
    assert inner[0].seen == 300
    assert len(store.rows) == 300
    assert w.scan is None and not w.scanning


async def test_a_stopped_scan_ends_after_its_batch_in_hand_and_the_next_start_goes_on(
    tmp_path: Path,
) -> None:
    """A stop during a long scan (a first one of a large library: minutes) ends it once the
    batch in hand is committed: the node's stop waited for the whole scan, and `serve --workers`
    killed its owner after 15 s. While it runs, `scan` says how far it is; the next start
    fingerprints only what was left."""
    root = tmp_path / "media"
    for i in range(watcher.BATCH + 44):
        write(root / f"f{i:03d}.mkv", f"file {i}".encode())
    store = Store()
    w = store.watcher(root)
    seen: list[watcher.ScanProgress | None] = []
    commit = store.apply_local

    async def stop_after_the_first(files: Sequence[LocalFile], removals: Sequence[str]) -> None:
        seen.append(replace(w.scan) if w.scan else None)
        await commit(files, removals)
        w.stop()

    w._apply_local = stop_after_the_first
    summary = await w.reconcile(settle=False)
    assert seen == [watcher.ScanProgress(seen=300, to_hash=300, done=0)]
    assert (len(store.commits), len(store.rows)) == (1, watcher.BATCH)
    assert (summary.hashed, summary.moved_on, summary.left) == (watcher.BATCH, 0, 44)
    assert summary.said().endswith(", 44 left for the next start (stopping)")
    assert w.scan is None and not w.scanning

    again = await store.watcher(root).reconcile(settle=False)
    assert (again.seen, again.hashed, again.unchanged, again.left) == (300, 44, 256, 0)
    assert len(store.rows) == 300


async def test_a_scan_summary_adds_up_when_files_go_while_it_runs(tmp_path: Path) -> None:
    """Seen = hashed + unchanged + unreadable + changed or gone meanwhile: a file deleted
    between the walk and its hash is counted, not lost from the sum (4,000 seen, 3,577 hashed
    and nothing else, in a review)."""
    root = tmp_path / "media"
    files = [write(root / f"f{i}.mkv", f"file {i}".encode()) for i in range(3)]
    scanner = Store().watcher(root)

    def delete_the_first_before_hashing(done: int, *_: int) -> None:
        if not done:
            files[0].unlink(missing_ok=True)

    summary = await scanner.reconcile(settle=False, progress=delete_the_first_before_hashing)
    assert (summary.seen, summary.hashed, summary.unchanged, summary.moved_on) == (3, 2, 0, 1)
    assert summary.failed == []


async def test_reconcile_rehashes_changed_and_removes_vanished(tmp_path: Path) -> None:
    root = tmp_path / "media"
    a, b, c = (write(root / n, n.encode()) for n in ("a.mkv", "b.mkv", "sub/c.mkv"))
    store = Store()
    w = store.watcher(root)
    await w.reconcile(settle=False)
    b.write_bytes(b"b, rewritten")
    c.unlink()
    d = write(root / "d.mkv", b"d")
    summary = await w.reconcile(settle=False)
    assert (summary.seen, summary.hashed, summary.unchanged, summary.removed) == (3, 2, 1, 1)
    assert store.rows == {str(p): local(p) for p in (a, b, d)}
    files, removals = store.commits[-1]
    assert removals == [str(c)]  # the removal is committed together with the first batch
    assert {f.path for f in files} == {str(b), str(d)}


async def test_files_of_a_folder_no_longer_watched_are_checked_at_each_full_reconcile(
    tmp_path: Path,
) -> None:
    """A folder taken out of `watch_roots` (or given to `metanode scan`) kept its rows for
    good: a file deleted there stayed on its record. A full reconciliation stats them: one
    gone from its folder loses its row, one changed is hashed again, the rest stay as they are,
    and so does one whose folder is gone too (a disk not mounted). A scan of named folders
    leaves them alone."""
    old, new, usb = tmp_path / "old", tmp_path / "new", tmp_path / "usb"
    gone, changed, kept = (write(old / n, n.encode()) for n in ("gone.mkv", "changed.mkv", "k"))
    unplugged = write(usb / "films" / "away.mkv", b"on a disk not mounted now")
    store = Store()
    await store.watcher(old).reconcile(settle=False)
    await store.watcher(usb).reconcile([str(usb)], settle=False)  # `metanode scan /mnt/usb`
    shutil.rmtree(usb)  # its folder is gone with it: kept, as a root's would be
    here = write(new / "here.mkv", b"here")
    now = store.watcher(new)
    await now.reconcile([str(new)], settle=False)
    gone.unlink()
    changed.write_bytes(b"changed, longer")
    rows_before = dict(store.rows)
    assert set(rows_before) == {str(p) for p in (gone, changed, kept, here, unplugged)}
    summary = await now.reconcile(settle=False)
    assert (summary.seen, summary.hashed, summary.unchanged, summary.removed) == (4, 1, 3, 1)
    assert store.rows == {
        **{str(p): local(p) for p in (changed, kept, here)},
        str(unplugged): rows_before[str(unplugged)],
    }


async def test_reconcile_commits_removals_alone_when_nothing_is_hashed(tmp_path: Path) -> None:
    root = tmp_path / "media"
    a = write(root / "a.mkv", b"a")
    store = Store()
    w = store.watcher(root)
    await w.reconcile(settle=False)
    a.unlink()
    summary = await w.reconcile(settle=False)
    assert (summary.seen, summary.hashed, summary.removed) == (0, 0, 1)
    assert store.commits[-1] == ([], [str(a)])
    assert store.rows == {}


async def test_an_empty_root_on_another_device_than_its_files_keeps_them(
    tmp_path: Path,
) -> None:
    """A mount point whose disk is not mounted is an empty folder on the device below it: its
    files are kept and the root named as unlisted. The same root emptied on the device its
    files were found on (a folder emptied while the node did not watch) loses them."""
    root, kept = tmp_path / "media", tmp_path / "watch-roots.json"
    a = write(root / "a.mkv", b"a")
    store = Store()
    await store.watcher(root, devices=watcher.RootDevices(kept)).reconcile(settle=False)
    device = root.stat().st_dev
    assert json.loads(kept.read_text()) == {str(root): device}
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600  # private, as the data directory is
    a.unlink()
    kept.write_text(json.dumps({str(root): device + 1}))  # its files were on another disk
    away = store.watcher(root, devices=watcher.RootDevices(kept))
    summary = await away.reconcile(settle=False)
    assert (summary.removed, away.unlisted, list(store.rows)) == (0, [str(root)], [str(a)])
    kept.write_text(json.dumps({str(root): device}))  # the same disk: emptied, not away
    here = store.watcher(root, devices=watcher.RootDevices(kept))
    summary = await here.reconcile(settle=False)
    assert (summary.removed, here.unlisted, store.rows) == (1, [], {})


async def test_a_disk_taken_off_a_folder_below_the_root_keeps_its_files(tmp_path: Path) -> None:
    """A disk mounted on a folder of the library (`/srv/media/usb`) and taken off left an empty
    folder on the root's own disk: the next reconciliation removed every file of it (reported
    deleted) and hashed them all again once it was back. Its mount point is remembered with
    its device, as a root is, and an empty one on another device keeps its files."""
    root, kept = tmp_path / "media", tmp_path / "watch-roots.json"
    usb = root / "usb"
    with Mounts() as mounts:
        mounts.mount(usb)
        film = write(usb / "film.mkv", b"on the usb disk")
        write(root / "here.mkv", b"on the root's disk")
        store = Store()
        first = await store.watcher(root, devices=watcher.RootDevices(kept)).reconcile(False)
        assert first.hashed == 2
        assert json.loads(kept.read_text())[str(usb)] == usb.stat().st_dev
        mounts.unmount(usb)
        away = store.watcher(root, devices=watcher.RootDevices(kept))
        summary = await away.reconcile(settle=False)
        assert (summary.removed, away.unlisted) == (0, [str(usb)])
        assert str(film) in store.rows
        mounts.mount(usb)  # back (a new tmpfs: its own device again), its file restored
        write(usb / "film.mkv", b"on the usb disk")
        back = store.watcher(root, devices=watcher.RootDevices(kept))
        summary = await back.reconcile(settle=False)
        assert (summary.removed, back.unlisted) == (0, [])
        film.unlink()  # emptied on its own disk: gone
        summary = await back.reconcile(settle=False)
        assert (summary.removed, back.unlisted, str(film) in store.rows) == (1, [], False)


async def test_a_disk_mounted_back_during_the_walk_keeps_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk mounted back on its folder after the walk listed the folder empty, before the
    mount table was read: the folder was found on the disk's own device, taken for emptied,
    and every file of it removed (and reported deleted), to be hashed again at the next
    look. The mount table is read before the walk too, and the walk made again when the two
    disagree."""
    root, kept = tmp_path / "media", tmp_path / "watch-roots.json"
    usb = root / "usb"
    with Mounts() as mounts:
        disk = mounts.mount(tmp_path / "disk")
        mounts.bind(disk, usb)
        film = write(usb / "film.mkv", b"on the usb disk")
        store = Store()
        w = store.watcher(root, devices=watcher.RootDevices(kept))
        assert (await w.reconcile(settle=False)).hashed == 1
        mounts.unmount(usb)
        real, walks = Watcher._listing, []

        def walk_then_mount(self: Watcher, walked_root: str) -> watcher.Listing:
            listing = real(self, walked_root)
            walks.append(listing)
            if len(walks) == 1:
                mounts.bind(disk, usb)  # after the walk, before the mount table is read
            return listing

        monkeypatch.setattr(Watcher, "_listing", walk_then_mount)
        summary = await w.reconcile(settle=False)
        assert (summary.removed, summary.unchanged, w.unlisted) == (0, 1, [])
        assert str(film) in store.rows
        assert [str(film) in x.files for x in walks] == [False, True]  # walked again


async def test_reconcile_reports_an_unreadable_file_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "media"
    good = write(root / "good.mkv", b"good")
    bad = write(root / "bad.mkv", b"bad")
    real = watcher.midhash_opened

    def refuse_bad(path: str | os.PathLike[str]) -> tuple[str, os.stat_result]:
        if os.fspath(path) == str(bad):
            raise MidhashError(f"cannot read {os.fspath(path)!r}: Permission denied")
        return real(path)

    monkeypatch.setattr(watcher, "midhash_opened", refuse_bad)
    store = Store()
    w = store.watcher(root)
    summary = await w.reconcile(settle=False)
    assert (summary.seen, summary.hashed, summary.unchanged) == (2, 1, 0)
    assert summary.failed == [str(bad)]
    assert set(store.rows) == {str(good)}
    assert str(bad) not in w.pending  # not retried until it changes


async def test_an_unreadable_file_that_is_deleted_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unreadable files are remembered (said once) until read or changed; one deleted, seen by
    its event or by a reconciliation (a missed event), is forgotten: kept, they grew by one entry
    per name that came and went, for the life of the process."""
    root = tmp_path / "media"
    real = watcher.midhash_opened

    def refuse_bad(path: str | os.PathLike[str]) -> tuple[str, os.stat_result]:
        if Path(path).name.startswith("bad"):
            raise MidhashError(f"cannot read {os.fspath(path)!r}: Permission denied")
        return real(path)

    monkeypatch.setattr(watcher, "midhash_opened", refuse_bad)
    w = Store().watcher(root)
    names = [root / "bad1.mkv", root / "sub" / "bad2.mkv", root / "bad3.mkv", root / "kept.mkv"]
    bad1, bad2, bad3, _ = [write(path, b"x") for path in names]
    await w.reconcile(settle=False)
    assert set(w._failed) == {str(bad1), str(bad2), str(bad3)}
    bad1.unlink()
    shutil.rmtree(bad2.parent)
    await w._on_changes({(Change.deleted, str(bad1)), (Change.deleted, str(bad2.parent))})
    assert set(w._failed) == {str(bad3)}
    bad3.unlink()  # no event: the next reconciliation finds it gone
    await w.reconcile(settle=False)
    assert w._failed == {}


async def test_on_changes_commits_a_rename_at_once_in_one_batch(tmp_path: Path) -> None:
    root = tmp_path / "media"
    old = write(root / "old.mkv", b"content")
    store = Store()
    w = store.watcher(root, settle_s=60)  # no settling: a rename must not wait for it
    await w.reconcile(settle=False)
    new = root / "new.mkv"
    old.rename(new)
    await w._on_changes({(Change.deleted, str(old)), (Change.added, str(new))})
    assert store.commits[-1] == ([local(new)], [str(old)])  # one transaction
    assert store.rows == {str(new): local(new)}
    assert w.pending == {}


async def test_on_changes_commits_a_folder_rename_at_once(tmp_path: Path) -> None:
    root = tmp_path / "media"
    files = [write(root / "album" / f"t{i}.flac", f"track {i}".encode()) for i in range(3)]
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w.reconcile(settle=False)
    (root / "album").rename(root / "renamed")
    await w._on_changes(
        {(Change.deleted, str(root / "album")), (Change.added, str(root / "renamed"))}
    )
    moved = [root / "renamed" / f.name for f in files]
    assert store.rows == {str(p): local(p) for p in moved}
    assert len(store.commits) == 2 and store.commits[-1][1] == [str(root / "album")]
    assert w.pending == {}


async def test_on_changes_queues_new_and_changed_files_and_ignores_unchanged(
    tmp_path: Path,
) -> None:
    root = tmp_path / "media"
    same = write(root / "same.mkv", b"same")
    changed = write(root / "changed.mkv", b"v1")
    chmodded = write(root / "chmodded.mkv", b"mode")
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w.reconcile(settle=False)
    commits = len(store.commits)
    os.chmod(chmodded, 0o600)  # an attribute change: same (size, mtime), its ctime moved
    changed.write_bytes(b"version 2")
    new = write(root / "new.mkv", b"new")
    await w._on_changes(
        {
            (Change.modified, str(same)),  # reported, but nothing of it changed
            (Change.modified, str(chmodded)),
            (Change.modified, str(changed)),
            (Change.added, str(new)),
        }
    )
    assert set(w.pending) == {str(changed), str(new), str(chmodded)}
    assert w.pending[str(new)][0] == stat_now(new)
    assert len(store.commits) == commits  # nothing is hashed before it settles


async def test_a_settled_file_a_reconciliation_recorded_meanwhile_is_not_hashed_again(
    tmp_path: Path,
) -> None:
    """An event queued a new file; a reconciliation (the start's, a rescan) hashed it before
    it settled: once settled it is left alone, where it was hashed and committed again."""
    root = tmp_path / "media"
    film = write(root / "film.mkv", b"copied in during the start")
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w._on_changes({(Change.added, str(film))})
    assert set(w.pending) == {str(film)}
    await w.reconcile(settle=False)
    commits = len(store.commits)
    await w._settled({str(film): stat_now(film)})
    assert len(store.commits) == commits
    film.write_bytes(b"changed since")  # one that did change is hashed as ever
    await w._settled({str(film): stat_now(film)})
    assert len(store.commits) == commits + 1


async def test_on_changes_folder_moved_in_and_deleted(tmp_path: Path) -> None:
    root, outside = tmp_path / "media", tmp_path / "outside"
    root.mkdir()
    tracks = [write(outside / "album" / f"t{i}.flac", f"t{i}".encode()) for i in range(3)]
    write(outside / "album" / ".hidden", b"h")
    write(outside / "album" / "cover.jpg.part", b"p")
    store = Store()
    w = store.watcher(root, settle_s=0)
    (outside / "album").rename(root / "album")
    await w._on_changes({(Change.added, str(root / "album"))})
    assert set(w.pending) == {str(root / "album" / t.name) for t in tracks}
    await w._hash_and_commit({p: s for p, (s, _) in w.pending.items()})
    assert len(store.rows) == 3
    for path in (root / "album").iterdir():
        path.unlink()
    (root / "album").rmdir()
    await w._on_changes({(Change.deleted, str(root / "album"))})
    assert store.rows == {}


async def test_on_changes_removes_a_deleted_file_and_forgets_it_pending(tmp_path: Path) -> None:
    root = tmp_path / "media"
    kept = write(root / "kept.mkv", b"kept")
    gone = write(root / "gone.mkv", b"gone")
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w.reconcile(settle=False)
    gone.write_bytes(b"gone, rewritten")
    await w._on_changes({(Change.modified, str(gone))})
    assert str(gone) in w.pending
    gone.unlink()
    await w._on_changes({(Change.deleted, str(gone))})
    assert str(gone) not in w.pending
    assert set(store.rows) == {str(kept)}


async def test_local_stats_answers_the_rows_at_or_below_each_path(node: Node) -> None:
    """What the watcher asks of the store: a file's own row, a folder's rows (not those of a
    sibling that shares its name's start), several paths in one statement, nothing for none."""
    paths = ["/m/a.mkv", "/m/a/b.mkv", "/m/a/c/d.mkv", "/m/a b.mkv", "/m/a0.mkv", "/n/e.mkv"]
    files = [
        LocalFile(path, cids.midhash_cid(cids.midhash_digest(i + 1, bytes(i + 1))), i + 1, 7, 9)
        for i, path in enumerate(paths)
    ]
    await node.ensure_groups([f.midhash for f in files])
    await node.apply_local(files, [])
    stats = {f.path: watcher.stat_recorded(f) for f in files}

    def at(*asked: str) -> dict[str, Stat]:
        return node.cache.local_stats(list(asked))

    assert at("/m/a") == {p: stats[p] for p in ("/m/a/b.mkv", "/m/a/c/d.mkv")}
    assert at("/m/a.mkv", "/m/a b.mkv", "/n/gone.mkv") == {
        p: stats[p] for p in ("/m/a.mkv", "/m/a b.mkv")
    }
    assert at("/m/", "/n") == stats
    assert at() == {}


def numbered(path: str, n: int) -> LocalFile:
    """A `local_file` row of content of its own (the n-th size, so the n-th midhash)."""
    return LocalFile(path, cids.midhash_cid(cids.midhash_digest(n, bytes(1))), n, 7, 9)


async def put(node: Node, paths: Sequence[str], first: int, *, same: bool = False) -> None:
    """Files at `paths`, the first of content `first`, the others of the following contents
    (or all of `first`'s: `same`)."""
    files = [numbered(path, first + (0 if same else i)) for i, path in enumerate(paths)]
    await node.ensure_groups([f.midhash for f in files])
    await node.apply_local(files, [])


async def test_a_folder_is_read_listed_and_removed_by_its_own_rows(
    node: Node, backend: str
) -> None:
    """Deleting a folder reads the rows below it, and listing a prefix (`GET /api/files
    ?prefix=`, the Files page) the rows that start with it: a range of the key each, whatever
    else the library holds. Each read every row: a deleted show of 2,000 files held the cache's
    writer for 58 s in a library of 100,000, and a folder's page of files took 76 ms."""
    show = ["/m/show/s01/e1.mkv", "/m/show/s01/e2.mkv", "/m/show/e3.mkv"]
    siblings = ["/m/show", "/m/show b.mkv", "/m/show0.mkv", "/m/shows/e.mkv"]
    await put(node, show + siblings, 1)
    cache_db = node.settings.data_dir / "cache.db"

    def work() -> tuple[int, int]:
        """The steps of reading the folder's rows as a removal does, and of listing it."""
        with contextlib.closing(sqlite3.connect(cache_db)) as conn:
            return (
                vm_steps(conn, lambda: cache.rows_at_or_below(conn, "/m/show")),
                vm_steps(conn, lambda: cache.files(conn, "/m/show/", "", 100)),
            )

    before = work() if backend == "sqlite" else None
    await put(node, [f"/m/a/{i:04d}.mkv" for i in range(1000)], 100)
    await put(node, [f"/m/z/{i:04d}.mkv" for i in range(1000)], 2000)
    if backend == "sqlite":
        assert work() == before  # not one step more for 2,000 rows more on either side

    listed = node.files("/m/show/", None, 100)
    assert [f["path"] for f in listed["files"]] == sorted(show)
    assert listed["next"] is None
    assert [f["path"] for f in node.files("/m/show", "/m/show/s01/e1.mkv", 3)["files"]] == [
        "/m/show/s01/e2.mkv",
        "/m/show0.mkv",
        "/m/shows/e.mkv",
    ]
    await node.apply_local([], ["/m/show/"])
    assert node.files("/m/show/", None, 100)["files"] == []
    assert [f["path"] for f in node.files("/m/show", None, 100)["files"]] == sorted(siblings)
    assert len(node.files("/m/", None, 1000)["files"]) == 1000


async def test_duplicates_are_found_among_the_records_of_several_files_alone(
    node: Node, backend: str
) -> None:
    """The Files page's duplicates (content at several paths) come from the records of two
    files or more (an index), not from grouping every file by its content: that read the
    whole table at each page, 70–120 ms at 100,000 files."""
    await put(node, ["/m/b1.mkv", "/m/b2.mkv", "/m/b3.mkv"], 5, same=True)
    await put(node, ["/m/a.mkv", "/m/copy/a.mkv"], 3, same=True)
    await put(node, ["/m/single.mkv"], 4)
    a, b = numbered("", 3).midhash, numbered("", 5).midhash
    both = sorted(
        [(a, ["/m/a.mkv", "/m/copy/a.mkv"]), (b, ["/m/b1.mkv", "/m/b2.mkv", "/m/b3.mkv"])]
    )
    cache_db = node.settings.data_dir / "cache.db"

    def work() -> int:
        with contextlib.closing(sqlite3.connect(cache_db)) as conn:
            return vm_steps(conn, lambda: cache.duplicates(conn, 50))

    before = work() if backend == "sqlite" else 0
    await put(node, [f"/m/films/{i:04d}.mkv" for i in range(1000)], 100)
    if backend == "sqlite":
        # a step more at most (the index one level taller), not steps for each film
        assert work() - before <= 1
    assert node.duplicates(50) == both
    assert len(node.duplicates(1)) == 1
    await node.apply_local([], ["/m/b2.mkv", "/m/b3.mkv"])
    assert node.duplicates(50) == [(a, ["/m/a.mkv", "/m/copy/a.mkv"])]


async def test_a_folders_folders_are_found_without_reading_the_files_inside_them(
    node: Node, backend: str
) -> None:
    """The Files page lists the folders directly in a folder (a film a folder: thousands in a
    root), each found by one seek past the one before, so the files inside them are never
    read; files directly in the folder are no folder, and a sibling sharing a name's start
    (`show`, `show b`, `show0`, `shows`) is its own. In path order, as the files are listed,
    and paged after a name."""
    await put(
        node,
        [
            "/m/show/s01/e1.mkv",
            "/m/show/e3.mkv",
            "/m/show b/e.mkv",
            "/m/show.nfo",
            "/m/show0/e.mkv",
            "/m/shows/deep/er/e.mkv",
            "/m/zz.mkv",
            "/other/x/y.mkv",
        ],
        1,
    )
    names = ["show b", "show", "show0", "shows"]  # path order: " " comes before "/"
    assert await node.subfolders("/m", "", 10) == (names, False)
    assert await node.subfolders("/m", "", 2) == (names[:2], True)
    assert await node.subfolders("/m", "show", 2) == (names[2:], False)
    assert await node.subfolders("/m/show", "", 10) == (["s01"], False)
    assert await node.subfolders("/m/show/s01", "", 10) == ([], False)
    assert await node.subfolders("/", "", 10) == (["m", "other"], False)
    cache_db = node.settings.data_dir / "cache.db"

    def work() -> int:
        with contextlib.closing(sqlite3.connect(cache_db)) as conn:
            return vm_steps(conn, lambda: cache.subfolders(conn, "/m", "", 10))

    before = work() if backend == "sqlite" else 0
    await put(node, [f"/m/show b/{i:04d}.mkv" for i in range(1000)], 100)
    if backend == "sqlite":
        assert work() - before <= 8  # the index a level taller at most, not a step a file
    assert await node.subfolders("/m", "", 10) == (names, False)


BOUNDS = st.sampled_from(["a", "b", "/", "0", "é", "\ud7ff", "\ue000", "\U0010ffff"])


@given(st.text(BOUNDS, max_size=4), st.text(BOUNDS, max_size=5))
@example("a\U0010ffff", "b")
@example("\ud7ff", "\ue000")
def test_a_prefix_s_range_holds_exactly_the_texts_that_start_with_it(
    prefix: str, text: str
) -> None:
    """[prefix, prefix_end) is "starts with prefix", as SQLite compares text (a character past
    the prefix's last one, the highest code point, the one before the surrogates)."""
    end = cache.prefix_end(prefix)
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        (inside,) = conn.execute(
            "SELECT ? >= ? AND (? IS NULL OR ? < ?)", (text, prefix, end, text, end)
        ).fetchone()
    assert bool(inside) == text.startswith(prefix)


async def test_a_batch_in_a_flat_folder_reads_only_the_rows_of_its_own_paths(
    tmp_path: Path,
) -> None:
    """Each batch looks its paths up, not the rows of their folders: one new file beside a
    thousand known ones reads no row, a rename reads two (a folder of 100,000 films made every
    batch in it read them all, on the event loop, and compare each with each path)."""
    root = tmp_path / "media"
    for i in range(1000):
        write(root / f"film{i:04d}.mkv", f"film {i}".encode())
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w.reconcile(settle=False)
    store.read = 0
    new = write(root / "new.mkv", b"new")
    await w._on_changes({(Change.added, str(new))})
    assert (store.read, set(w.pending)) == (0, {str(new)})
    renamed = root / "renamed.mkv"
    (root / "film0007.mkv").rename(renamed)
    await w._on_changes(
        {(Change.deleted, str(root / "film0007.mkv")), (Change.added, str(renamed))}
    )
    assert store.read == 1  # the row of the path that went; the new name has none
    assert store.rows[str(renamed)] == local(renamed)
    assert len(store.rows) == 1000


async def test_a_file_replaced_by_a_folder_of_its_name_is_gone(tmp_path: Path) -> None:
    root = tmp_path / "media"
    swap = write(root / "swap", b"a file first")
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w.reconcile(settle=False)
    swap.unlink()
    inner = write(swap / "inner.mkv", b"then a folder of that name")
    await w._on_changes({(Change.deleted, str(swap)), (Change.added, str(swap))})
    assert store.rows == {}
    assert store.commits[-1] == ([], [str(swap)])
    assert set(w.pending) == {str(inner)}


async def test_a_folder_made_unreadable_is_in_unlisted_at_its_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/health names a folder that cannot be read as soon as inotify reports it (its mode
    changed), not at the next reconciliation, ten minutes on; its files stay."""
    root = tmp_path / "media"
    kept = write(root / "locked" / "a.mkv", b"kept")
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w.reconcile(settle=False)
    lock_folders(monkeypatch, "locked")
    await w._on_changes({(Change.modified, str(root / "locked"))})
    assert w.unlisted == [str(root / "locked")]
    assert set(store.rows) == {str(kept)}


async def next_turn(w: Watcher, timeout: float = 30.0) -> None:
    """Wait until the settle loop has taken a turn since this call (its heartbeat moved on)."""
    loop = asyncio.get_running_loop()
    before, deadline = w.heartbeat, loop.time() + timeout
    while w.heartbeat == before:
        assert loop.time() < deadline, f"the settle loop took no turn in {timeout} s"
        await asyncio.sleep(0.01)


async def test_settle_loop_hashes_only_after_the_stat_held_still(tmp_path: Path) -> None:
    """While the file keeps changing it is not hashed, however slowly this test runs: the window
    is a minute, and each change is checked against a turn of the loop. Then the window is made
    short: the loop finds the stat it queued out of date, waits a window again, and hashes the
    final content, once."""
    root = tmp_path / "media"
    root.mkdir()
    store = Store()
    w = store.watcher(root, settle_s=60)
    loop_task = asyncio.create_task(w._settle_loop())
    try:
        f = write(root / "growing.mkv", b"part 1")
        await w._on_changes({(Change.added, str(f))})
        for i in range(2, 5):  # keep changing it, inside the settle window
            await next_turn(w)
            assert store.rows == {} and str(f) in w.pending, "hashed before it settled"
            with f.open("ab") as out:
                out.write(f", part {i}".encode())
        await next_turn(w)
        assert store.rows == {}, "hashed before it settled"
        w.settle_s = 0.3  # it holds still from now on
        deadline = asyncio.get_running_loop().time() + 30
        while not store.rows and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert store.rows == {str(f): local(f)}
        assert len(store.commits) == 1  # hashed once, the final content
        assert w.pending == {}
    finally:
        w.stop()
        await loop_task


def inotify_watches() -> set[int]:
    """The inodes this process's inotify instances watch now (`/proc/self/fdinfo`)."""
    found: set[int] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify":
                continue
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:  # closed meanwhile (the listing's own descriptor, say)
            continue
        found |= {
            int(ino, 16) for ino in re.findall(r"^inotify wd:\S+ ino:([0-9a-f]+)", info, re.M)
        }
    return found


async def test_the_starts_reconciliation_reads_the_disk_once_inotify_watches_it(
    tmp_path: Path,
) -> None:
    """A file written after the start's walk passed its folder but before the inotify watch
    stood was neither walked nor reported: it waited for the rescan (10 min). Two server tests
    lost their files so under load. The reconciliation now begins once the watch stands
    (`Watcher._watch_laid`), which this checks in the kernel's own list of watches, at the
    moment the reconciliation reads the rows it compares the walk with. 2,000 folders make the
    watch long to lay, so a reconciliation that did not wait would meet it unlaid."""
    root = tmp_path / "media"
    for i in range(2000):
        (root / f"d{i}").mkdir(parents=True)
    store = Store()
    watched_when_read: list[bool] = []
    rows_of = store.known_stats

    def known_stats(paths: Sequence[str]) -> dict[str, Stat]:
        watched_when_read.append(root.stat().st_ino in inotify_watches())
        return rows_of(paths)

    store.known_stats = known_stats  # type: ignore[method-assign]
    w = store.watcher(root)
    running = asyncio.create_task(w.run())
    try:
        await until(lambda: bool(watched_when_read), "the start's reconciliation")
    finally:
        w.stop()
        await running
    assert watched_when_read[0], "the reconciliation read the disk before inotify watched it"


async def test_a_delete_reported_while_a_hash_is_being_committed_wins(tmp_path: Path) -> None:
    root = tmp_path / "media"
    f = write(root / "a.mkv", b"about to be deleted")
    store = Store()
    entered, release = asyncio.Event(), asyncio.Event()
    real_ensure = store.ensure_groups

    async def slow_ensure(midhashes: Sequence[str]) -> None:  # e.g. the truth writer is busy
        entered.set()
        await release.wait()
        await real_ensure(midhashes)

    w = Watcher(
        [str(root)],
        Rules(),
        0,
        0,
        2,
        slow_ensure,
        store.apply_local,
        store.known_stats,
        store.fill_ctimes,
    )
    scan = asyncio.create_task(w.reconcile(settle=False))
    await asyncio.wait_for(entered.wait(), 10)  # hashed; its commit is under way
    f.unlink()
    await w._on_changes({(Change.deleted, str(f))})  # inotify reports the deletion
    release.set()
    await scan
    assert str(f) not in store.rows


@contextlib.contextmanager
def out_of_descriptors() -> Iterator[None]:
    """This process may open no more file until the block ends: the limit is on descriptor
    numbers, and a new file takes the lowest one free, so the limit is set to that."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_watch_or_a_walk_refused_for_want_of_descriptors_is_told_apart(tmp_path: Path) -> None:
    """watchfiles says in words (`… (os error 24)`) that it could not make its watch because
    the process is out of file descriptors: that is waited out and said in /health
    (`Watcher._pause_after`), not logged with a traceback at every try. A folder that cannot
    be listed so is not unreadable (it was added to `unlisted`: "a disk not mounted?", read
    again at the next rescan): the walk raises, and the reconciliation is tried again. Real
    words, under a limit this process has reached; no other failure is mistaken for it."""
    write(tmp_path / "Album" / "track.flac", b"x" * 100)
    failure: BaseException | None = None
    unlisted: list[str] = []
    with out_of_descriptors():
        try:
            watchfiles._rust_notify.RustNotify([str(tmp_path)], False, False, 0, True, False)
        except Exception as exc:  # whatever watchfiles raises is what it says
            failure = exc
        with pytest.raises(OSError) as walked:
            list(walk(str(tmp_path), Rules(), unlisted=unlisted))
    assert failure is not None, "watchfiles made a watch without a descriptor"
    assert watcher.out_of_files(failure) == "Too many open files", failure
    assert watcher.out_of_files(walked.value) == "Too many open files" and unlisted == []
    assert watcher.out_of_files(OSError(errno.EACCES, "Permission denied")) is None
    assert watcher.out_of_files(RuntimeError("Unable to decode path b'x' to string")) is None


# -- what (size, mtime) cannot see: the inode's ctime ---------------------------------------------


async def test_a_file_rewritten_with_its_size_and_mtime_put_back_is_hashed_again(
    tmp_path: Path,
) -> None:
    """A tag editor told to keep timestamps, `touch -r`, `rsync --inplace --times`: new bytes
    under the old size and mtime. The reconciliation (and the rescan) compared (size, mtime)
    and kept the old midhash for good; the ctime the write moved tells it now, at a
    reconciliation and at inotify's report alike."""
    root = tmp_path / "media"
    song = write(root / "song.flac", b"A" * 5000)
    store = Store()
    w = store.watcher(root, settle_s=60)
    await w.reconcile(settle=False)
    rewrite_in_place(song, b"B" * 5000)
    await w._on_changes({(Change.modified, str(song))})
    assert str(song) in w.pending  # the write is seen live, not taken for an unchanged stat
    summary = await w.reconcile(settle=False)
    assert (summary.hashed, summary.unchanged) == (1, 0)
    assert store.rows[str(song)] == local(song)
    assert store.rows[str(song)].midhash == cids.midhash_bytes(b"B" * 5000)
    assert (await w.reconcile(settle=False)).hashed == 0


async def test_a_chmod_costs_one_hash_that_finds_the_same_content(tmp_path: Path) -> None:
    """A chmod, a chown, a hard link made or removed move the ctime too: the file is hashed
    again, once, to the midhash it had (the CID is the content's), and the row keeps the new
    ctime, so the next rescan hashes nothing."""
    root = tmp_path / "media"
    film = write(root / "film.mkv", os.urandom(4000))
    store = Store()
    w = store.watcher(root)
    await w.reconcile(settle=False)
    before = store.rows[str(film)]
    os.chmod(film, 0o600)
    summary = await w.reconcile(settle=False)
    assert summary.hashed == 1
    after = store.rows[str(film)]
    assert after.midhash == before.midhash and after.ctime_ns == film.stat().st_ctime_ns
    assert after.ctime_ns != before.ctime_ns
    assert (await w.reconcile(settle=False)).hashed == 0


async def test_hard_links_are_hashed_again_once_after_a_change_not_at_every_rescan(
    tmp_path: Path,
) -> None:
    """Every name of a hard-linked file shares its inode, so its ctime: a write under one name
    (or a new link, which moves the ctime too) has each name hashed once, each row keeping the
    inode's new ctime; the rescans after hash none of them."""
    root = tmp_path / "media"
    first = write(root / "downloads" / "song.flac", b"A" * 3000)
    names = [first, root / "library" / "song.flac", root / "library" / "again.flac"]
    names[1].parent.mkdir()
    for name in names[1:]:
        os.link(first, name)
    store = Store()
    w = store.watcher(root)
    assert (await w.reconcile(settle=False)).hashed == 3
    rewrite_in_place(first, b"B" * 3000)
    assert (await w.reconcile(settle=False)).hashed == 3
    assert {store.rows[str(n)].midhash for n in names} == {cids.midhash_bytes(b"B" * 3000)}
    assert (await w.reconcile(settle=False)).hashed == 0
    names.append(root / "library" / "third.flac")
    os.link(first, names[-1])  # the link count is the inode's: its ctime moves
    assert (await w.reconcile(settle=False)).hashed == 4
    assert {p: store.rows[p] for p in map(str, names)} == {str(n): local(n) for n in names}
    for _ in range(3):
        assert (await w.reconcile(settle=False)).hashed == 0


async def test_rows_from_before_ctimes_were_kept_take_them_without_a_hash(tmp_path: Path) -> None:
    """The first look after the upgrade (cache schema 14) gives each row the disk's ctime and
    hashes nothing unchanged (a library of 100,000 files is not read again); from then on a
    rewrite that puts the size and mtime back is seen."""
    root = tmp_path / "media"
    files = [write(root / f"f{i}.mkv", os.urandom(2000 + i)) for i in range(5)]
    store = Store()
    w = store.watcher(root)
    await w.reconcile(settle=False)
    hashed = dict(store.rows)
    store.rows = {p: replace(f, ctime_ns=UNKNOWN_CTIME) for p, f in store.rows.items()}
    commits = len(store.commits)
    summary = await w.reconcile(settle=False)
    assert (summary.hashed, summary.unchanged, store.filled) == (0, 5, 5)
    assert store.rows == hashed and len(store.commits) == commits
    rewrite_in_place(files[0], b"C" * 2000)
    assert (await w.reconcile(settle=False)).hashed == 1
    assert store.rows[str(files[0])].midhash == cids.midhash_bytes(b"C" * 2000)


async def test_the_cache_keeps_each_files_ctime_and_fills_an_older_rows_at_the_first_look(
    node: Node, tmp_path: Path
) -> None:
    """Through the node and the cache of either backend: the rows hold the ctime the file was
    hashed with; rows without one (an upgraded cache) take the disk's at the next
    reconciliation without a hash or a feed event; a rewrite that keeps the size and mtime
    moves the path to the new content; a chmod is hashed again and changes no record (no
    feed event, no file event)."""
    media = tmp_path / "media"
    files = [write(media / f"f{i}.mkv", os.urandom(3000 + i)) for i in range(3)]
    await node.scan([str(media)])
    assert node.cache.local_stats([str(media)]) == {str(f): stat_now(f) for f in files}
    await node.cache.writer.run(lambda conn: conn.execute("UPDATE local_file SET ctime_ns = 0"))
    state = node.applier.state
    summary = await node.scan([str(media)])
    assert (summary.hashed, summary.unchanged) == (0, 3)
    assert node.cache.local_stats([str(media)]) == {str(f): stat_now(f) for f in files}
    assert node.applier.state.mark == state.mark  # nothing written but the ctimes

    rewrite_in_place(files[0], b"R" * 3000)
    assert (await node.scan([str(media)])).hashed == 1
    assert node.cache.midhashes_at([str(files[0])]) == {
        str(files[0]): cids.midhash_bytes(b"R" * 3000)
    }
    state = node.applier.state
    os.chmod(files[1], 0o600)
    assert (await node.scan([str(media)])).hashed == 1
    assert node.cache.local_stats([str(files[1])]) == {str(files[1]): stat_now(files[1])}
    assert (node.applier.state.feed_seq, node.applier.state.file_feed_seq) == (
        state.feed_seq,
        state.file_feed_seq,
    )


async def test_an_older_caches_local_files_have_no_ctime_until_the_watcher_gives_one(
    tmp_path: Path, storage: str
) -> None:
    """The migration (SQLite v14, PostgreSQL v10) adds the column to the rows there are and
    rewrites none; a ctime is filled in only where the row still holds the size, mtime and
    inode the disk shows (`fill_ctimes_txn`), else the file is hashed as any changed one."""
    settings = settings_for(tmp_path, storage=storage)
    target = db.target(settings.data_dir, settings.storage, "cache")
    migrations = cache.MIGRATIONS if storage == "sqlite" else cache.PG_MIGRATIONS
    db.migrate_file(target, migrations[: 13 if storage == "sqlite" else 9])
    conn = db.connect(target)
    rows = [("/m/a.mkv", "bagacba1", 5, 10, 7), ("/m/b.mkv", "bagacba2", 6, 20, 8)]
    try:
        db.run_txn(
            conn,
            lambda c: c.executemany(
                "INSERT INTO local_file (path, midhash, size, mtime_ns, ino) "
                "VALUES (?, ?, ?, ?, ?)",
                rows,
            ),
        )
        assert db.migrate(conn, migrations) == len(migrations)
        assert cache.local_stats(conn, ["/m"]) == {
            "/m/a.mkv": Stat(5, 10, UNKNOWN_CTIME, 7),
            "/m/b.mkv": Stat(6, 20, UNKNOWN_CTIME, 8),
        }
        found = {"/m/a.mkv": Stat(5, 10, 99, 7), "/m/b.mkv": Stat(6, 20, 99, 9)}  # b: replaced
        db.run_txn(conn, lambda c: cache.fill_ctimes_txn(c, found))
        assert cache.local_stats(conn, ["/m"]) == {
            "/m/a.mkv": Stat(5, 10, 99, 7),
            "/m/b.mkv": Stat(6, 20, UNKNOWN_CTIME, 8),
        }
    finally:
        conn.close()
