"""Settings: precedence, types, and documentation that cannot go stale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from metanode import api, config
from metanode.api import create_app
from metanode.errors import InvalidRequest, WatchRootsDamaged
from metanode.node import Node
from tests.helpers.settings import settings_for

DOC = Path(__file__).parents[1] / "docs" / "configuration.md"


def shown(value: Any) -> str:
    """A default as docs/configuration.md shows it: as it is written in metanode.toml (`true`,
    `["./media"]`, `""`), but a string without its quotes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(item) for item in value) + "]"
    return str(value) if value != "" else '""'


def test_every_setting_is_documented_with_its_default() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name, default, _help in config.describe():
        assert f"| `{name}` | `METANODE_{name.upper()}` | `{shown(default)}` |" in text, name


def test_defaults_need_no_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = config.load(env={})
    assert (settings.host, settings.port, settings.data_dir) == ("127.0.0.1", 9000, Path("data"))
    assert settings.accept_unknown_signers is False


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    file = tmp_path / "m.toml"
    file.write_text('port = 9100\nhost = "0.0.0.0"\naccept_unknown_signers = true\n')
    env = {"METANODE_PORT": "9200", "METANODE_ACCEPT_UNKNOWN_SIGNERS": "off"}
    settings = config.load(file, env=env, overrides={"host": "::1", "port": None})
    assert (settings.port, settings.host, settings.accept_unknown_signers) == (9200, "::1", False)
    assert config.load(env={"METANODE_CONFIG": str(file)}).port == 9100


def test_the_folders_chosen_on_the_page_replace_the_default_and_a_setting_replaces_them(
    tmp_path: Path,
) -> None:
    data, film = tmp_path / "data", tmp_path / "films"
    data.mkdir()
    env = {"METANODE_DATA_DIR": str(data)}
    assert config.load(env=env).watch_roots == ("./media",)  # nothing chosen: the default
    (data / config.WATCHED_FOLDERS).write_text(json.dumps({"roots": [str(film)]}))
    chosen = config.load(env=env)
    assert (chosen.watch_roots, chosen.watch_roots_from) == ((str(film),), "")
    file = tmp_path / "m.toml"
    file.write_text('watch_roots = ["/srv/tv"]\n')
    from_file = config.load(file, env=env)
    assert from_file.watch_roots == ("/srv/tv",)
    assert from_file.watch_roots_from == f"the config file {file}"
    from_env = config.load(file, env={**env, "METANODE_WATCH_ROOTS": "/srv/a:/srv/b"})
    assert from_env.watch_roots == ("/srv/a", "/srv/b")
    assert from_env.watch_roots_from == "the environment (METANODE_WATCH_ROOTS)"
    for damaged in ('{"roots": ["/srv/me', '{"roots": ["relative"]}', "[]", '{"roots": 3}'):
        (data / config.WATCHED_FOLDERS).write_text(damaged)
        loaded = config.load(env=env)  # what needs no folder goes on (signers, backup…)
        assert loaded.watch_roots == () and config.WATCHED_FOLDERS in loaded.watch_roots_damaged
        with pytest.raises(WatchRootsDamaged, match=config.WATCHED_FOLDERS):
            loaded.require_roots()
        with pytest.raises(WatchRootsDamaged, match=config.WATCHED_FOLDERS):
            _ = loaded.watched
        assert config.load(file, env=env).watch_roots == ("/srv/tv",)  # not read: not needed


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"METANODE_PORT": "nine"}, "port"),
        ({"METANODE_ACCEPT_UNKNOWN_SIGNERS": "maybe"}, "accept_unknown_signers"),
        ({"METANODE_MAX_CONNECTIONS": "0"}, "max_connections: 0 is not at least 1"),
        ({"METANODE_HEADER_TIMEOUT_S": "-5"}, "header_timeout_s: -5.0 is not at least 0.001"),
        ({"METANODE_APPLY_POLL_S": "0"}, "apply_poll_s"),  # 0 spun a core
        ({"METANODE_WATCH_SETTLE_S": "nan"}, "watch_settle_s: nan is not a finite number"),
        ({"METANODE_APPLY_WAIT_S": "1e400"}, "apply_wait_s: inf is not a finite number"),
        ({"METANODE_PEER_PAGE_CLAIMS": "1001"}, "peer_page_claims"),  # a peer gives 1,000
        ({"METANODE_OWNER_WEIGHT": "-5"}, "owner_weight: -5 is not from 0 to 1000000"),
        ({"METANODE_PLUGIN_WEIGHTS": "fullhash"}, "plugin_weights: 'fullhash' is not name=weight"),
        ({"METANODE_PLUGIN_WEIGHTS": "fullhash=abc"}, "plugin_weights"),
        ({"METANODE_PLUGIN_WEIGHTS": "a=1,b=-1"}, "plugin_weights: 'b=-1'"),
        ({"METANODE_PLUGIN_WEIGHTS": "a=1000001"}, "a weight is at most 1000000"),
        ({"METANODE_LOG_LEVEL": "verbose"}, "log_level: 'verbose' is not one of debug, info"),
        # the forms a boolean takes, not Python's `bool`; a number's kind in words
        ({"METANODE_CACHE_FSYNC": "maybe"}, r"cache_fsync: 'maybe' is not a boolean \(true/false"),
        ({"METANODE_PORT": "9100.5"}, "port: '9100.5' is not a whole number"),
        ({"METANODE_APPLY_WAIT_S": "soon"}, "apply_wait_s: 'soon' is not a number"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], fragment: str) -> None:
    """Each was accepted and then answered nothing, spun a core, crashed the start with a
    traceback, or (with --workers N) restarted the owner worker for ever."""
    with pytest.raises(InvalidRequest, match=fragment):
        config.load(env=env)


def test_a_huge_whole_number_is_checked_without_overflowing() -> None:
    """`math.isfinite(10**400)` raised OverflowError, a traceback instead of the setting's name."""
    assert config.load(env={"METANODE_HOT_DOCUMENTS": "1" + "0" * 400}).hot_documents > 0
    with pytest.raises(InvalidRequest, match="port: 1000"):
        config.load(env={"METANODE_PORT": "1" + "0" * 400})


def test_a_toml_boolean_is_no_number_and_weights_parse(tmp_path: Path) -> None:
    file = tmp_path / "m.toml"
    file.write_text("port = true\n")  # bound port 1
    with pytest.raises(InvalidRequest, match="port: True is not a whole number"):
        config.load(file, env={})
    weights = config.load(env={"METANODE_PLUGIN_WEIGHTS": "fullhash=5,filename=0"})
    assert weights.plugin_weight_map == {"fullhash": 5, "filename": 0}


def test_every_number_setting_has_a_range_and_the_docs_list_it() -> None:
    """A number without a range would take any value again; the docs' table is the code's."""
    text = DOC.read_text(encoding="utf-8")
    ranged = dict(config.ranges())
    for name, default, _help in config.describe():
        if isinstance(default, int | float) and not isinstance(default, bool):
            assert name in ranged, f"setting {name} has no range"
            assert f"| `{name}` | {ranged[name]} |" in text, name


def test_unknown_file_keys_and_broken_toml_are_errors(tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("prot = 1\nzzz = 2\n")
    with pytest.raises(InvalidRequest, match=r"prot \(did you mean port\?\), zzz$"):
        config.load(typo, env={})
    quoted = tmp_path / "quoted.toml"  # accepted as if it were a number
    quoted.write_text('port = "9100"\n')
    with pytest.raises(
        InvalidRequest, match="setting port: '9100' is text, not a number: write it without quotes"
    ):
        config.load(quoted, env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    with pytest.raises(InvalidRequest, match="cannot read"):
        config.load(broken, env={})


def test_a_config_file_is_utf8_with_or_without_a_byte_order_mark(tmp_path: Path) -> None:
    """Notepad's choices: UTF-8 with a byte-order mark is read; UTF-16 is refused in words
    (it was a UnicodeDecodeError's traceback)."""
    marked = tmp_path / "marked.toml"
    marked.write_text("port = 9100\n", encoding="utf-8-sig")
    assert config.load(marked, env={}).port == 9100
    wide = tmp_path / "wide.toml"
    wide.write_text("port = 9100\n", encoding="utf-16")
    with pytest.raises(InvalidRequest, match=r"wide\.toml: not UTF-8 text .*: save it as UTF-8$"):
        config.load(wide, env={})


def test_unknown_environment_names_are_warned_of_with_a_guess() -> None:
    env = {
        "METANODE_PROT": "1",
        "METANODE_WACH_ROOTS": "/m",
        "METANODE_ZZZ": "1",
        "METANODE_PORT": "9100",
        "METANODE_URL": "http://x",
        "METANODE_TOKEN": "t",
        "METANODE_CONFIG": "m.toml",
        "PATH": "/bin",
    }
    assert config.unknown_environment(env) == [
        "METANODE_PROT is not a metanode setting; ignored (did you mean METANODE_PORT?)",
        "METANODE_WACH_ROOTS is not a metanode setting; ignored (did you mean "
        "METANODE_WATCH_ROOTS?)",
        "METANODE_ZZZ is not a metanode setting; ignored",
    ]


def test_one_folder_named_twice_as_a_watch_root_is_refused(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (tmp_path / "link").symlink_to(media)
    with pytest.raises(InvalidRequest, match=r"'.*/link' is the folder '.*/media' again"):
        config.Settings(watch_roots=(str(media), str(tmp_path / "link")))
    with pytest.raises(InvalidRequest, match="again"):
        config.load(env={"METANODE_WATCH_ROOTS": f"{media}:{media}/"})
    nested = config.Settings(watch_roots=(str(media), str(media / "tv")))
    assert nested.watch_roots == (str(media), str(media / "tv"))


def test_the_address_serve_shows_is_a_url() -> None:
    """An IPv6 host was shown `http://::1:9000`, no URL. An empty host, which binds every
    address (an unset variable in a compose file), is refused."""
    shown = {
        host: config.Settings(host=host, port=9100).serve_url
        for host in ("::1", "10.0.0.2", "0.0.0.0")
    }
    assert shown == {
        "::1": "http://[::1]:9100",
        "10.0.0.2": "http://10.0.0.2:9100",
        "0.0.0.0": "http://0.0.0.0:9100",
    }
    for empty in ("", "  "):
        with pytest.raises(InvalidRequest, match="setting host: empty"):
            config.load(env={"METANODE_HOST": empty})


@pytest.mark.parametrize(
    ("root", "fragment"),
    [
        ("metanode", "'metanode' is not a path: write it as /metanode"),
        ("/", "'/' is the root of the host: leave root_path empty for that"),
        ("/metanode/", "'/metanode/' ends with a slash: write it as /metanode"),
        ("/home//metanode", "'' is not a name of a path here"),
        ("/home/../metanode", r"'\.\.' is not a name of a path here"),
        ("/./metanode", r"'\.' is not a name"),
        ("/meta node", "'meta node' is not a name"),
        ("/metanode?x=1", r"'metanode\?x=1' is not a name"),
        ("/metanode#top", "'metanode#top' is not a name"),
        ("/meta%6Eode", "'meta%6Eode' is not a name"),  # the same encoded or not: no escapes
        ("/metanode;x", "is not a name"),  # would end the cookie's Path
        ("/api", "'/api' begins with /api, a path the node serves itself"),
        ("/webdav/x", "begins with /webdav, a path the node serves itself"),
        ("/files", "begins with /files"),
    ],
)
def test_a_root_path_is_empty_or_a_path_of_plain_names(root: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=f"setting root_path: .*{fragment}"):
        config.load(env={"METANODE_ROOT_PATH": root})


def test_a_root_path_is_taken_off_a_path_that_starts_with_it() -> None:
    assert config.load(env={"METANODE_ROOT_PATH": "/home/metanode"}).root_path == "/home/metanode"
    assert config.load(env={"METANODE_ROOT_PATH": ""}).root_path == ""
    assert config.Settings(root_path="/m-1.x~").page_url == "http://127.0.0.1:9000/m-1.x~"
    below = {
        path: config.below_root(path, "/metanode")
        for path in ("/metanode", "/metanode/", "/metanode/files", "/metanodes/x", "/files")
    }
    assert below == {
        "/metanode": "/",
        "/metanode/": "/",
        "/metanode/files": "/files",
        "/metanodes/x": None,
        "/files": None,
    }


def test_the_names_a_root_path_may_not_begin_with_are_the_routes_the_node_serves(
    tmp_path: Path,
) -> None:
    """The node answers with and without `root_path` (`api.unroot`): a prefix that began with
    one of its own paths (`/files`) would make `/files/files` the Files page or the library."""
    app = create_app(Node(settings_for(tmp_path / "data")))
    paths = [getattr(route, "path", "") for route in app.routes]
    paths += [family for family, _access in api.FAMILIES]
    firsts = {path.split("/")[1] for path in paths if path.startswith("/")} - {""}
    assert firsts == config.SERVED_NAMES


MiB = 1 << 20


def test_workers_default_to_a_process_a_core_within_the_memory_of_a_small_box() -> None:
    """One per core, but no more than one per 512 MiB: a 1 GB Raspberry Pi 4 (≈ 925 MiB for
    Linux) serves with one process, a 2 GB one with three, and unknown memory bounds nothing."""
    assert config.default_workers(4, 925 * MiB) == 1
    assert config.default_workers(4, 1850 * MiB) == 3
    assert config.default_workers(4, 8192 * MiB) == 4
    assert config.default_workers(4, None) == 4
    assert config.default_workers(1, 64 * MiB) == 1
    assert config.Settings(workers=3).worker_count == 3  # given, never bounded


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_workers_default_to_the_cores_the_process_may_run_on_not_the_machines() -> None:
    """Under `taskset -c 0` (a container's cpuset) the default is one process, not one for each
    of the machine's cores, which `os.cpu_count` counts."""
    first = min(os.sched_getaffinity(0))
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "from metanode import config; print(config.Settings().worker_count)",
        ],
        preexec_fn=lambda: os.sched_setaffinity(0, {first}),
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == "1"


def test_the_memory_limit_is_the_lowest_of_the_cgroups_above_the_process(tmp_path: Path) -> None:
    """`/proc/self/cgroup` names the cgroups; each one's limit and its parents' count where
    they are found below the mount: a systemd slice's `MemoryMax` above the unit, v2's `max`
    (no limit), v1's huge number (none either) and a path a container does not see (its own
    cgroup is the mount's root)."""
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/system.slice/metanode.service\n")
    root = tmp_path / "sys"
    limits = {
        "memory.max": "max",
        "system.slice/memory.max": str(700 * MiB),
        "system.slice/metanode.service/memory.max": "max",
        "memory/memory.limit_in_bytes": "9223372036854771712",
    }
    for name, text in limits.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    assert sorted(config.cgroup_limits(proc, root)) == [700 * MiB, 9223372036854771712]
    assert config.memory_bytes(proc, root) == min(
        700 * MiB, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    )
    assert config.cgroup_limits(tmp_path / "none", root) == []
