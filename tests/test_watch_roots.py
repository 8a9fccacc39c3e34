"""Choosing the watched folders through `/api/watch-roots` (docs/watcher.md, "Choosing the
folders on the page"), against a real `metanode serve` with real folders and ffmpeg's files:
a folder added is watched at once and after a restart, one no longer watched keeps its files'
records, both at once in WebDAV and the MetaMesh routes' `filePath` (in every worker), each
refusal has its slug, and folders set by a setting are only shown."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import cid as cids
from tests.helpers.dav import propfind
from tests.helpers.server import Server, serve_refused
from tests.helpers.wait import poll

ROUTE = "/api/watch-roots"
PAGE_CHOSEN = ("METANODE_WATCH_ROOTS",)  # the helper's setting, left out: the page chooses
# root's power to read any folder, dropped so that a folder of mode 000 is unreadable to it
NO_OVERRIDE = ("setpriv", "--bounding-set=-dac_override,-fowner,-dac_read_search", "--")

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs Debian's ffmpeg")


def page_server(tmp_path: Path, **fields: Any) -> Server:
    """A server whose `watch_roots` no setting sets (its default, `./media`, beside its data)."""
    return Server(tmp_path / "data", unset=PAGE_CHOSEN, **fields)


def listing(srv: Server) -> dict[str, Any]:
    response = httpx.get(srv.url + ROUTE, headers=srv.headers, timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def paths(body: dict[str, Any]) -> list[str]:
    return [root["path"] for root in body["roots"]]


def add(srv: Server, path: object) -> httpx.Response:
    return httpx.post(srv.url + ROUTE, headers=srv.headers, json={"path": path}, timeout=130)


def remove(srv: Server, path: str) -> httpx.Response:
    return httpx.delete(srv.url + ROUTE, headers=srv.headers, params={"path": path}, timeout=130)


def video(path: Path) -> Path:
    """A one-second ffmpeg test video at `path`, written under an ignored name and renamed in
    whole (the watcher ignores `*.part`), its content its own (the name is in its title)."""
    part = path.with_name(path.name + ".part")
    subprocess.run(
        [
            *("ffmpeg", "-v", "error", "-f", "lavfi", "-i", "testsrc=d=1", "-metadata"),
            *(f"title={path}", "-f", "matroska", "-y", str(part)),
        ],
        check=True,
        timeout=120,
    )
    part.rename(path)
    return path


def recorded(srv: Server, path: Path) -> str:
    """The rid of `path`'s record, once the watcher has it (GET /api/files)."""

    def fetch() -> str | None:
        params = {"prefix": str(path)}
        answer = httpx.get(srv.url + "/api/files", headers=srv.headers, params=params, timeout=30)
        return next((f["rid"] for f in answer.json()["files"] if f["path"] == str(path)), None)

    return poll(fetch, f"the record of {path}")


def midhash(srv: Server, path: Path) -> str:
    """The midhash of `path`, once the node serves it (`/api/file/{cid}/info`)."""
    cid = cids.midhash_bytes(path.read_bytes())
    url = f"{srv.url}/api/file/{cid}/info"
    poll(
        lambda: httpx.get(url, headers=srv.headers, timeout=30).json()["exists"] or None, str(path)
    )
    return cid


def webdav_names(srv: Server) -> set[str]:
    """The top-level collections of `/webdav/` (PROPFIND, Depth 1)."""
    listed = propfind(srv.url + "/webdav/", "1", srv.headers)
    return {href.removeprefix("/webdav/").strip("/") for href in listed} - {""}


def file_path(srv: Server, cid: str) -> tuple[str, str]:
    """(`GET /meta/{cid}/filePath`, the worker that answered)."""
    answer = httpx.get(f"{srv.url}/meta/{cid}/filePath", headers=srv.headers, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.text, answer.headers.get("x-metanode-worker", "")


def kept(srv: Server) -> list[str]:
    """The folders kept in the data directory, after checking the file is private."""
    path = srv.data_dir / "watched-folders.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    roots: list[str] = json.loads(path.read_text())["roots"]
    return roots


def test_a_folder_added_is_watched_at_once_and_after_a_restart_until_it_is_stopped(
    tmp_path: Path,
) -> None:
    srv = page_server(tmp_path).start()
    try:
        body = listing(srv)
        assert body["editable"] and body["set_in"] is None and body["watcher"]
        assert body["roots"] == [{"path": str(srv.media), "state": "watching"}]
        films = tmp_path / "library" / "Films"
        films.mkdir(parents=True)
        before = video(films / "Before.2001.mkv")  # there before: found by the reconciliation
        answer = add(srv, str(films))
        assert answer.status_code == 200, answer.text
        assert paths(answer.json()) == [str(srv.media), str(films)]
        assert answer.json()["roots"][1]["state"] == "watching"
        assert kept(srv) == [str(srv.media), str(films)]
        recorded(srv, before)
        recorded(srv, video(films / "Live.2002.mkv"))  # inotify's report
        health = httpx.get(srv.url + "/health", timeout=30).json()
        assert str(films) in health["watcher"]["roots"]

        srv.stop()
        srv.start()
        assert paths(listing(srv)) == [str(srv.media), str(films)]
        after = recorded(srv, video(films / "After.Restart.2003.mkv"))

        answer = remove(srv, str(films))
        assert answer.status_code == 200, answer.text
        assert paths(answer.json()) == [str(srv.media)]
        assert kept(srv) == [str(srv.media)]
        health = httpx.get(srv.url + "/health", timeout=30).json()
        assert str(films) not in health["watcher"]["roots"]
        # the watcher's rule for a root taken out of the settings: the records stay
        assert recorded(srv, films / "After.Restart.2003.mkv") == after
        srv.stop()
        srv.start()
        assert paths(listing(srv)) == [str(srv.media)]
        recorded(srv, films / "Before.2001.mkv")  # still there after the restart
    finally:
        srv.stop()
        srv.print_log()


def test_a_folder_added_or_let_go_is_served_by_webdav_and_named_in_file_paths_at_once(
    tmp_path: Path,
) -> None:
    srv = page_server(tmp_path).start()
    try:
        films = tmp_path / "library" / "Films"
        films.mkdir(parents=True)
        film = video(films / "Film.2001.mkv")
        assert webdav_names(srv) == {"media"}
        assert add(srv, str(films)).status_code == 200
        cid = midhash(srv, film)
        assert webdav_names(srv) == {"media", "Films"}  # no restart
        got = httpx.get(f"{srv.url}/webdav/Films/{film.name}", headers=srv.headers, timeout=30)
        assert got.status_code == 200 and got.content == film.read_bytes()
        info = httpx.get(f"{srv.url}/api/file/{cid}/info", headers=srv.headers, timeout=30)
        assert info.json()["filePath"] == f"Films/{film.name}"
        assert file_path(srv, cid)[0] == f"/files/Films/{film.name}"

        assert remove(srv, str(films)).status_code == 200
        assert webdav_names(srv) == {"media"}
        gone = httpx.get(f"{srv.url}/webdav/Films/{film.name}", headers=srv.headers, timeout=30)
        assert gone.status_code == 404
        # its record keeps its path, below no root now: no WebDAV path serves it
        assert file_path(srv, cid)[0] == f"/files/{str(film).lstrip('/')}"
    finally:
        srv.stop()
        srv.print_log()


def test_a_folder_added_while_the_one_before_is_reconciled_is_reconciled_too(
    tmp_path: Path,
) -> None:
    """Two folders added one after the other: the second, added while the reconciliation of
    the first was fingerprinting its files, was never walked (the one running walked the roots
    as they were, and no other was begun), so its files waited for the next full rescan, ten
    minutes later. The window is made long (thousands of files to fingerprint) and seen open
    (/health's scan) before the second is added."""
    srv = page_server(tmp_path).start()
    big, small = tmp_path / "Big", tmp_path / "Small"
    try:
        big.mkdir()
        small.mkdir()
        for i in range(4000):
            (big / f"track {i:04}.flac").write_bytes(os.urandom(1024))
        song = small / "song.flac"
        song.write_bytes(os.urandom(4096))  # there before its folder is watched: no event
        assert add(srv, str(big)).status_code == 200

        def scanning() -> bool | None:
            health = httpx.get(srv.url + "/health", timeout=30).json()
            return health["watcher"]["scan"] is not None or None

        poll(scanning, "the first folder's files being fingerprinted")
        assert add(srv, str(small)).status_code == 200
        recorded(srv, song)
        recorded(srv, big / "track 3999.flac")
    finally:
        srv.stop()
        srv.print_log()


def metanode(srv: Server, *args: str) -> subprocess.CompletedProcess[str]:
    """`metanode ARGS` as the owner runs it beside `srv`, no setting naming the folders."""
    env = {k: v for k, v in srv.base_env().items() if k not in PAGE_CHOSEN}
    return subprocess.run(
        [sys.executable, "-m", "metanode", *args],
        env=env,
        cwd=srv.data_dir.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_backup_restored_into_a_new_data_directory_watches_the_same_folders(
    tmp_path: Path,
) -> None:
    """The folders of the backup are watched after a restore; one that is not on the new
    machine (its disk not mounted yet) was made there, empty, at the first start and said
    `watching`: it is kept missing now, the Files page and /health naming it, its records
    kept, and watched with its files once its disk is there."""
    srv = page_server(tmp_path).start()
    films, shows = tmp_path / "Films", tmp_path / "Shows"
    try:
        films.mkdir()
        shows.mkdir()
        film = video(films / "Film.2001.mkv")
        episode = video(shows / "Show.S01E01.mkv")
        assert add(srv, str(films)).status_code == 200
        recorded(srv, film)  # before the next: one added during its reconciliation waits
        assert add(srv, str(shows)).status_code == 200
        rid = recorded(srv, episode)
        made = metanode(srv, "backup", str(tmp_path / "bk"), "--data-dir", str(srv.data_dir))
        assert made.returncode == 0, made.stderr  # online, the node running
    finally:
        srv.stop()
        srv.print_log()
    backup = Path(made.stdout.strip())
    chosen = [str(srv.media), str(films), str(shows)]
    copy = backup.with_name(backup.name.replace("truth-", "watched-folders-")[:-3] + ".json")
    assert json.loads(copy.read_text())["roots"] == chosen
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    disk = tmp_path / "disk"
    shows.rename(disk)  # the new machine has no such folder: its disk is not mounted yet

    fresh = page_server(tmp_path / "new")
    fresh.data_dir.parent.mkdir()
    done = metanode(fresh, "restore", str(backup), "--data-dir", str(fresh.data_dir))
    assert done.returncode == 0, done.stderr
    assert f"watched folders: {', '.join(chosen)} (the backup's list)" in done.stdout
    assert f"warning: watched folder {shows} does not exist here" in done.stderr
    assert str(films) not in done.stderr
    assert kept(fresh) == chosen
    fresh.start()
    try:
        recorded(fresh, film)  # the first reconciliation is done
        states = {root["path"]: root["state"] for root in listing(fresh)["roots"]}
        assert states == {str(srv.media): "watching", str(films): "watching", str(shows): "missing"}
        assert not shows.exists()  # not made, though the restored node knows no file in it
        health = httpx.get(fresh.url + "/health", timeout=30).json()
        assert health["status"] == "degraded"
        assert any(str(shows) in problem for problem in health["problems"]), health
        with httpx.Client(base_url=fresh.url, timeout=30) as browser:
            signed = browser.post("/signin", data={"token": fresh.token, "then": "/files"})
            assert signed.status_code == 303, signed.text
            page = browser.get("/files").text
        assert str(shows) in page and "missing (not mounted?): its files are kept" in page
        record = httpx.get(f"{fresh.url}/api/metadata/{rid}", headers=fresh.headers, timeout=30)
        assert record.status_code == 200 and "filePath" not in record.json()  # kept, no path
        assert webdav_names(fresh) == {"media", "Films"}  # not listed while away (was a 500)
        disk.rename(shows)  # the disk is mounted: watched and its files found, as they were
        assert recorded(fresh, episode) == rid
        poll(lambda: listing(fresh)["roots"][2]["state"] == "watching" or None, "watching")
        assert webdav_names(fresh) == {"media", "Films", "Shows"}
    finally:
        fresh.stop()
        fresh.print_log()


def test_a_damaged_list_in_a_backup_refuses_the_restore_and_changes_nothing(
    tmp_path: Path,
) -> None:
    srv = page_server(tmp_path)
    made = metanode(srv, "init", "--data-dir", str(srv.data_dir))
    assert made.returncode == 0, made.stderr
    chosen = json.dumps({"roots": [str(tmp_path / "Films")]})
    (srv.data_dir / "watched-folders.json").write_text(chosen)
    made = metanode(srv, "backup", str(tmp_path / "bk"), "--data-dir", str(srv.data_dir))
    assert made.returncode == 0, made.stderr
    backup = Path(made.stdout.strip())
    copy = next((tmp_path / "bk").glob("watched-folders-*.json"))
    copy.write_text('{"roots": ["/srv/me')
    fresh = tmp_path / "fresh"
    refused = metanode(srv, "restore", str(backup), "--data-dir", str(fresh))
    assert refused.returncode == 2, refused.stdout
    assert refused.stderr.startswith("error: watch_roots_damaged: "), refused.stderr
    assert str(copy) in refused.stderr
    assert not fresh.exists()  # nothing of it was put in place


def test_each_folder_refused_says_why_by_its_slug(tmp_path: Path) -> None:
    root = os.geteuid() == 0
    prefix = NO_OVERRIDE if root and shutil.which("setpriv") else ()
    outputs = tmp_path / "out" / "plugin"  # WebDAV clients write there: never the media
    writes = {"METANODE_WEBDAV_PLUGIN_WRITES": "true", "METANODE_WEBDAV_PLUGIN_DIR": str(outputs)}
    srv = page_server(tmp_path, prefix=prefix, env=writes).start()
    try:
        a_file = tmp_path / "notes.txt"
        a_file.write_text("not a folder")
        (tmp_path / "media-link").symlink_to(srv.media)
        refused = {
            str(tmp_path / "nowhere"): (400, "watch_root_missing"),
            str(a_file): (400, "watch_root_not_folder"),
            str(srv.data_dir): (400, "watch_root_data_dir"),
            str(srv.data_dir / "keys"): (400, "watch_root_data_dir"),
            str(tmp_path): (400, "watch_root_data_dir"),  # holds the data directory
            str(outputs): (400, "watch_root_plugin_outputs"),
            str(outputs.parent): (400, "watch_root_plugin_outputs"),  # holds it
            str(srv.media): (409, "watch_root_taken"),
            str(tmp_path / "media-link"): (409, "watch_root_taken"),  # the same, by a link
            "media": (409, "watch_root_taken"),  # relative to the working directory
        }
        if prefix or not root:
            closed = tmp_path / "closed"
            closed.mkdir(mode=0o000)
            refused[str(closed)] = (400, "watch_root_unreadable")
        for path, (status, slug) in refused.items():
            answer = add(srv, path)
            assert (answer.status_code, answer.json()["error"]) == (status, slug), path
            assert path.rsplit("/", 1)[-1] in answer.json()["message"]
        for body in ({"path": 3}, {"path": ""}, {"folder": str(tmp_path)}, ["x"]):
            answer = httpx.post(srv.url + ROUTE, headers=srv.headers, json=body, timeout=30)
            assert (answer.status_code, answer.json()["error"]) == (400, "invalid_request")
        answer = remove(srv, str(tmp_path / "nowhere"))
        assert (answer.status_code, answer.json()["error"]) == (404, "unknown_watch_root")
        assert paths(listing(srv)) == [str(srv.media)]
        assert not (srv.data_dir / "watched-folders.json").exists()
        no_token = httpx.post(srv.url + ROUTE, json={"path": str(tmp_path)}, timeout=30)
        assert no_token.status_code == 401
    finally:
        srv.stop()


def test_folders_set_by_a_setting_are_shown_and_changed_only_there(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # a list the page kept once: the setting wins over it, and it stays as it was
    chosen = json.dumps({"roots": [str(elsewhere)]})
    (data / "watched-folders.json").write_text(chosen)
    srv = Server(data).start()  # the helper sets METANODE_WATCH_ROOTS
    try:
        body = listing(srv)
        assert not body["editable"]
        assert body["set_in"] == "the environment (METANODE_WATCH_ROOTS)"
        assert paths(body) == [str(srv.media)]
        for answer in (add(srv, str(elsewhere)), remove(srv, str(srv.media))):
            assert answer.status_code == 409, answer.text
            assert answer.json()["error"] == "watch_roots_from_settings"
            assert "METANODE_WATCH_ROOTS" in answer.json()["message"]
        assert (data / "watched-folders.json").read_text() == chosen
    finally:
        srv.stop()


def test_a_damaged_list_of_folders_refuses_only_what_needs_the_folders(tmp_path: Path) -> None:
    """A damaged `watched-folders.json` refused every command, `signers list`, `export`,
    `check`, `health` and `backup` too, which never read it: no backup of the claims could be
    made until the file was fixed. Only what needs the folders refuses now (`serve`, `scan`,
    `plugins try`), naming the file and the way out; `backup` saves the truth and the keys and
    says the list was left out (a restore would refuse a copy of it)."""
    srv = page_server(tmp_path).start()
    try:
        listed = srv.data_dir / "watched-folders.json"
        listed.write_text('{"roots": ["/srv/me')  # edited by hand
        listed.chmod(0o600)
        health = metanode(srv, "health", "--url", srv.url)
        assert health.returncode == 0 and health.stdout.startswith("ok"), health.stderr
    finally:
        srv.stop()
    data = ("--data-dir", str(srv.data_dir))
    for args in (("signers", "list"), ("export",), ("check",), ("peers", "token", "list")):
        done = metanode(srv, *args, *data)
        assert done.returncode == 0 and "watch_roots_damaged" not in done.stderr, args
    made = metanode(srv, "backup", str(tmp_path / "bk"), *data)
    assert made.returncode == 0, made.stderr
    backup = Path(made.stdout.strip())
    stamp = backup.name.removeprefix("truth-").removesuffix(".db")
    assert (backup.parent / f"keys-{stamp}" / "owner.key").is_file()
    assert not list(backup.parent.glob("watched-folders-*"))
    assert made.stderr.startswith("warning: watch_roots_damaged: "), made.stderr
    assert "watched-folders.json" in made.stderr and "back up again" in made.stderr
    film = tmp_path / "Film.2001.mkv"
    film.write_bytes(b"a film" * 1000)
    for args in (("scan", str(tmp_path)), ("plugins", "try", "filename", str(film))):
        refused = metanode(srv, *args, *data)
        assert refused.returncode == 2, (args, refused.stdout)
        assert refused.stderr.startswith("error: watch_roots_damaged: "), refused.stderr
        assert "watched-folders.json" in refused.stderr and "fix it" in refused.stderr
    env = {k: v for k, v in srv.base_env().items() if k not in PAGE_CHOSEN}
    refused = serve_refused(tmp_path, env, *data, "--port", "1")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("error: watch_roots_damaged: "), refused.stderr
    assert "watched-folders.json" in refused.stderr
    assert "serving" not in refused.stdout


def test_under_two_workers_the_owner_watches_a_folder_any_worker_was_asked_for(
    tmp_path: Path,
) -> None:
    srv = page_server(tmp_path, workers=2).start()
    try:
        shows = tmp_path / "Shows"
        shows.mkdir()
        answer = add(srv, str(shows))
        assert answer.status_code == 200, answer.text
        episode = video(shows / "Show.S01E01.mkv")
        recorded(srv, episode)
        for _ in range(8):  # whichever worker each connection reaches says the same
            assert paths(listing(srv)) == [str(srv.media), str(shows)]
        # `/meta/…` is a read a reader answers itself, from the list the owner kept
        cid, layout = midhash(srv, episode), f"/files/Shows/{episode.name}"
        assert by_a_reader(srv, cid) == layout
        answer = remove(srv, str(shows))
        assert answer.status_code == 200, answer.text
        assert paths(listing(srv)) == [str(srv.media)]
        assert by_a_reader(srv, cid) == f"/files/{str(episode).lstrip('/')}"
    finally:
        srv.stop()


def by_a_reader(srv: Server, cid: str) -> str:
    """`filePath` as a reader worker answers it, every answer until then (the owner's) the
    same: connections are spread among the workers by the kernel."""
    answers: set[str] = set()

    def asked() -> bool | None:
        text, worker = file_path(srv, cid)
        answers.add(text)
        return worker.startswith("reader") or None

    poll(asked, "an answer of a reader worker")
    assert len(answers) == 1, answers
    return answers.pop()


def kept_names(srv: Server) -> dict[str, str]:
    """The WebDAV names kept in the data directory, after checking the file is private."""
    path = srv.data_dir / "webdav-names.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    names: dict[str, str] = json.loads(path.read_text())["names"]
    return names


def info_path(srv: Server, cid: str) -> str:
    """`filePath` as `GET /api/file/{cid}/info` gives it (the WebDAV path)."""
    info = httpx.get(f"{srv.url}/api/file/{cid}/info", headers=srv.headers, timeout=30)
    path: str = info.json()["filePath"]
    return path


def test_letting_a_folder_go_renames_no_other_and_a_restart_keeps_every_name(
    tmp_path: Path,
) -> None:
    """Two folders called `films` were `films` and `films-2`, by their order in the list: let
    the first go and the second became `films`, so a meta-fuse mount or a player's saved
    `/webdav/films-2/…` named nothing, and `films/…` another folder's files. Now each keeps
    the name it was given while it is watched, in WebDAV and in `filePath` (a reader
    worker's too), across restarts; a folder added later never takes a name held, but may
    take one given up."""
    srv = page_server(tmp_path, workers=2).start()
    try:
        first, second, third = (tmp_path / side / "films" for side in ("a", "b", "c"))
        for folder in (first, second, third):
            folder.mkdir(parents=True)
        film, other = video(second / "Film.2001.mkv"), video(third / "Other.2002.mkv")
        for folder in (first, second):
            assert add(srv, str(folder)).status_code == 200
        assert webdav_names(srv) == {"media", "films", "films-2"}
        cid = midhash(srv, film)
        assert info_path(srv, cid) == f"films-2/{film.name}"

        assert remove(srv, str(first)).status_code == 200
        assert webdav_names(srv) == {"media", "films-2"}  # not `films`
        assert kept_names(srv) == {str(srv.media): "media", str(second): "films-2"}
        assert info_path(srv, cid) == f"films-2/{film.name}"
        assert by_a_reader(srv, cid) == f"/files/films-2/{film.name}"
        read = httpx.get(f"{srv.url}/webdav/films-2/{film.name}", headers=srv.headers, timeout=30)
        assert read.status_code == 200 and read.content == film.read_bytes()
        gone = httpx.get(f"{srv.url}/webdav/films/{film.name}", headers=srv.headers, timeout=30)
        assert gone.status_code == 404

        srv.stop()
        srv.start()
        assert webdav_names(srv) == {"media", "films-2"}
        assert info_path(srv, cid) == f"films-2/{film.name}"
        # a new `films` takes the name given up, never the one the second holds
        assert add(srv, str(third)).status_code == 200
        assert webdav_names(srv) == {"media", "films", "films-2"}
        listed = propfind(f"{srv.url}/webdav/films/", "1", srv.headers)
        assert f"/webdav/films/{other.name}" in listed
        srv.stop()
        srv.start()
        names = {str(srv.media): "media", str(second): "films-2", str(third): "films"}
        assert kept_names(srv) == names
        assert info_path(srv, midhash(srv, other)) == f"films/{other.name}"
        assert by_a_reader(srv, cid) == f"/files/films-2/{film.name}"
    finally:
        srv.stop()
        srv.print_log()


def test_a_backup_keeps_the_webdav_names_and_a_folder_chosen_again_gets_its_name_back(
    tmp_path: Path,
) -> None:
    """A backup restored named the roots anew (`webdav-names.json` was not in it): the second
    `films`, `films-2` while the first was let go, came back as `films`, and every consumer's
    `filePath` below it changed. And a folder let go and chosen again was named anew: `films`
    when that was free, where its consumers knew it as `films-2`."""
    srv = page_server(tmp_path).start()
    first, second = (tmp_path / side / "films" for side in ("a", "b"))
    try:
        for folder in (first, second):
            folder.mkdir(parents=True)
            assert add(srv, str(folder)).status_code == 200
        assert remove(srv, str(first)).status_code == 200
        assert webdav_names(srv) == {"media", "films-2"}
        made = metanode(srv, "backup", str(tmp_path / "bk"), "--data-dir", str(srv.data_dir))
        assert made.returncode == 0, made.stderr
    finally:
        srv.stop()
        srv.print_log()
    backup = Path(made.stdout.strip())
    copy = backup.with_name(backup.name.replace("truth-", "webdav-names-")[:-3] + ".json")
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600

    fresh = page_server(tmp_path / "new")
    fresh.data_dir.parent.mkdir()
    done = metanode(fresh, "restore", str(backup), "--data-dir", str(fresh.data_dir))
    assert done.returncode == 0, done.stderr
    fresh.start()
    try:
        assert webdav_names(fresh) == {"media", "films-2"}
        assert kept_names(fresh) == {str(srv.media): "media", str(second): "films-2"}
        assert remove(fresh, str(second)).status_code == 200
        assert webdav_names(fresh) == {"media"}
        assert add(fresh, str(second)).status_code == 200  # `films` is free: its own comes back
        assert webdav_names(fresh) == {"media", "films-2"}
        assert add(fresh, str(first)).status_code == 200  # its own, `films`, is free too
        assert webdav_names(fresh) == {"media", "films", "films-2"}
    finally:
        fresh.stop()
        fresh.print_log()
