"""The command line (SPEC §8): cid midhash/parse/rank, keygen, claim sign/verify."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result
from multiformats import CID

from metanode import cid as cids
from metanode import claims, keys
from metanode.cli import INTERRUPTED, main
from tests.helpers.plugins import install_plugin
from tests.helpers.vectors import load_vectors
from tests.helpers.wait import DEADLINE_S

MIDHASH: dict[str, Any] = load_vectors("midhash.json")
RANK_VECTORS: list[dict[str, Any]] = load_vectors("cid-rank-vectors.json")["vectors"]
CLAIM_VECTORS: list[dict[str, Any]] = load_vectors("claims.json")["vectors"]

MIDHASH_CID = MIDHASH["raw_codec_alias_example"]["codec_eq_mh"]  # midhash of the empty file
MIDHASH_RAW = MIDHASH["raw_codec_alias_example"]["raw_codec"]
TARGET = "bagacbabaea6gwjljwuu3cyxlrwwxgnmlfwd2gfshoi6mrtxysc4mnahe2hsqu"
TS = 1_764_500_000_000


def run(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin)


def commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command and group below `group`, as the words that name it."""
    for name, command in group.commands.items():
        yield (*path, name)
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))


def test_every_command_says_what_it_does_in_its_help() -> None:
    """`metanode signers block --help` said nothing but its usage, and `signers --help` listed
    block and unblock with no words beside them."""
    listed = list(commands(main))
    assert ("signers", "block") in listed and ("peers", "token", "revoke") in listed
    for words in listed:
        result = run(*words, "--help")
        assert result.exit_code == 0, result.output
        described = result.output.split("Options:")[0].split("\n", 2)[2].strip()
        assert described, f"metanode {' '.join(words)} --help: {result.output}"
    for group in ("signers", "peers", "peers token", "plugins", "claim", "cid"):
        listing = run(*group.split(), "--help").output.split("Commands:")[1]
        assert all(len(line.split()) > 1 for line in listing.strip().splitlines()), listing


@pytest.mark.parametrize("words", [(), ("peers",), ("peers", "token"), ("signers",)])
def test_a_bare_group_shows_its_help_not_an_error_line(words: tuple[str, ...]) -> None:
    """`metanode` alone, the first thing a newcomer types, printed `error: usage: Usage: …`
    (click's help taken for an error message): now the help itself, exit 2 as click gives."""
    result = run(*words)
    assert result.exit_code == 2
    assert result.stderr.startswith("Usage: "), result.stderr
    assert "error: usage" not in result.stderr and "Commands:" in result.stderr


def test_the_exit_codes_are_in_the_help() -> None:
    """A script's author finds what each exit code means without reading the source."""
    said = " ".join(run("--help").output.split())
    assert "Exit codes: 0 done; 1 a verdict failed" in said
    assert f"{INTERRUPTED} interrupted (Ctrl-C)" in said


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "signer.key"
    result = run("keygen", "--out", str(path))
    assert result.exit_code == 0, result.output
    return path


def sign(key_file: Path, *extra: str) -> dict[str, Any]:
    result = run("claim", "sign", "--key", str(key_file), "--cid", TARGET, *extra)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    parsed: dict[str, Any] = json.loads(lines[0])
    return parsed


# -- cid -----------------------------------------------------------------------------------------


def test_cid_midhash_prints_cid_and_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    abc = tmp_path / "abc.txt"
    abc.write_bytes(b"abc")
    counting = tmp_path / "counting.bin"
    counting.write_bytes(bytes(range(256)) * 16)  # the small-4KiB vector
    result = run("cid", "midhash", str(empty), str(abc), str(counting))
    assert result.exit_code == 0, result.output
    expected = {v["name"]: v["cid"] for v in MIDHASH["vectors"]}
    assert result.stdout.splitlines() == [
        f"{expected['empty']}  {empty}",
        f"{expected['literal-abc']}  {abc}",
        f"{expected['small-4KiB']}  {counting}",
    ]


def test_cid_midhash_writes_each_file_on_one_line_whatever_its_name(tmp_path: Path) -> None:
    """A line feed in a name cut its line in two (`cut -d' ' -f1` took the name's second half
    for a CID); it, a carriage return and the backslash that writes them are escaped, and a
    name that is not UTF-8 is written as its bytes."""
    names = [b"new\nline.mkv", b"carriage\rreturn.mkv", b"back\\slash.mkv", b"Am\xe9lie.mkv"]
    paths = [os.path.join(os.fsencode(tmp_path), name) for name in names]
    for path in paths:
        with open(path, "wb") as out:
            out.write(path)
    done = subprocess.run(  # a real process: its stdout writes a name's bytes as they are
        [sys.executable, "-m", "metanode", "cid", "midhash", *paths],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split(b"\n")[:-1]
    assert [line.split(b"  ", 1)[1] for line in lines] == [
        os.fsencode(tmp_path) + b"/" + name
        for name in (
            b"new\\nline.mkv",
            b"carriage\\rreturn.mkv",
            b"back\\\\slash.mkv",
            b"Am\xe9lie.mkv",
        )
    ]
    assert all(line.startswith(b"bagacbabae") for line in lines)


def test_cid_midhash_missing_file_is_an_error(tmp_path: Path) -> None:
    result = run("cid", "midhash", str(tmp_path / "absent.bin"))
    assert result.exit_code == 2
    assert "midhash_failed" in result.stderr


def test_cid_midhash_hashes_the_other_files_after_one_it_cannot_read(tmp_path: Path) -> None:
    """`metanode cid midhash media/*` stopped at the first file it could not read, and a
    script lost every CID after it; now each is named on stderr, the rest still hashed, and
    the exit code says something failed, as `sha256sum` does."""
    first, last = tmp_path / "first.mkv", tmp_path / "last.mkv"
    first.write_bytes(b"first")
    last.write_bytes(b"last")
    absent = tmp_path / "absent.mkv"
    result = run("cid", "midhash", str(first), str(absent), str(last))
    assert result.exit_code == 2
    assert result.stdout.splitlines() == [
        f"{cids.midhash_bytes(b'first')}  {first}",
        f"{cids.midhash_bytes(b'last')}  {last}",
    ]
    assert result.stderr == f"error: midhash_failed: cannot read {str(absent)!r}: " + (
        "No such file or directory\n"
    )


def test_cid_midhash_of_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO in a media folder: opening it to read waited for a writer that never came, so
    `metanode cid midhash *` hung (and so would the watcher, had a file been replaced by one
    between its stat and its read). It is opened without waiting, and is no regular file."""
    fifo = tmp_path / "film.mkv"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "cid", "midhash", str(fifo)],
        capture_output=True,
        text=True,
        timeout=60,  # a bound on the hang this was, not a measure
    )
    assert done.returncode == 2 and "is not a regular file" in done.stderr, done.stderr


def test_cid_midhash_directory_is_refused(tmp_path: Path) -> None:
    result = run("cid", "midhash", str(tmp_path))
    assert result.exit_code == 2
    assert result.stdout == ""


def test_cid_midhash_needs_a_file() -> None:
    assert run("cid", "midhash").exit_code == 2


def test_cid_parse_prints_json() -> None:
    result = run("cid", "parse", MIDHASH_CID)
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    assert view["canonical"] == MIDHASH_CID
    assert view["rank"] == 10
    assert view["alias"] == MIDHASH_RAW
    assert view["version"] == 1
    assert view["codec"] == view["multihash"] == 0x1000
    assert view["codec_hex"] == view["multihash_hex"] == "0x1000"
    assert len(bytes.fromhex(view["digest_hex"])) == 32


def test_cid_parse_normalises_other_spellings() -> None:
    sha = "bafkreibjb5etyrhv2y6qnm3u2cs2xuus7lryxewkwl5ol37p4gyosnd7ky"
    result = run("cid", "parse", CID.decode(sha).encode("base58btc"))
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    assert view["canonical"] == sha
    assert view["rank"] == 30
    assert view["alias"] == cids.alias(sha)
    assert view["alias"].startswith("baejbei")


@pytest.mark.parametrize(
    "value",
    ["garbage", "midhash256:" + MIDHASH_CID, ""],
    ids=["garbage", "token-form", "empty"],
)
def test_cid_parse_invalid(value: str) -> None:
    result = run("cid", "parse", value)
    assert result.exit_code == 2
    assert "invalid_cid" in result.stderr
    assert result.stdout == ""


def test_cid_rank_orders_best_first() -> None:
    given = [
        "not-a-cid",
        TARGET,
        "bafkreiaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "bagbcbaraeaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "bafybeiaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "bagasbajacqaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    ]
    result = run("cid", "rank", *given)
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows == [
        ["40", "bafybeiaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],
        ["30", "bafkreiaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],
        ["20", "bagasbajacqaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],  # tie: smaller string first
        ["20", "bagbcbaraeaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],
        ["10", TARGET],
        ["0", "not-a-cid"],
    ]


def test_cid_rank_of_every_fixture_vector() -> None:
    values = [v["cid"] for v in RANK_VECTORS if v["cid"]]  # "" cannot be an argument here
    result = run("cid", "rank", *values)
    assert result.exit_code == 0, result.output
    rank_of = {v["cid"]: v["rank"] for v in RANK_VECTORS}
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[1] for row in rows] == sorted(values, key=lambda c: (-rank_of[c], c))
    assert all(int(row[0]) == rank_of[row[1]] for row in rows)


# -- keygen --------------------------------------------------------------------------------------


def test_keygen_writes_an_owner_only_key(tmp_path: Path) -> None:
    path = tmp_path / "me.key"
    result = run("keygen", "--out", str(path))
    assert result.exit_code == 0, result.output
    uid = result.stdout.strip()
    assert uid.startswith("z6Mk")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys.uid_of_key(keys.load(path)) == uid
    assert bytes(claims.public_key(uid)) == bytes(keys.load(path).verify_key)


def test_keygen_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "me.key"
    assert run("keygen", "--out", str(path)).exit_code == 0
    before = path.read_bytes()
    result = run("keygen", "--out", str(path))
    assert result.exit_code != 0
    assert "already exists" in result.output
    assert path.read_bytes() == before


def test_keygen_needs_out() -> None:
    assert run("keygen").exit_code == 2


# -- claim sign / verify -------------------------------------------------------------------------


def test_sign_then_verify(key_file: Path) -> None:
    signed = sign(key_file, "--key-name", "title", "--value", "The Matrix", "--ts", str(TS))
    assert signed["uid"] == keys.uid_of_key(keys.load(key_file))
    assert signed["cid"] == TARGET
    assert (signed["key"], signed["value"], signed["ts"]) == ("title", "The Matrix", TS)
    assert len(signed["sig"]) == 86
    result = run("claim", "verify", stdin=json.dumps(signed) + "\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["ok"]


def test_sign_defaults_to_now(key_file: Path) -> None:
    before = time.time_ns() // 1_000_000
    signed = sign(key_file, "--key-name", "year", "--value", "1999")
    after = time.time_ns() // 1_000_000
    assert before <= signed["ts"] <= after
    assert run("claim", "verify", stdin=json.dumps(signed)).exit_code == 0


def test_sign_keeps_unicode_readable(key_file: Path) -> None:
    signed = sign(key_file, "--key-name", "titles/jpn", "--value", "マトリックス", "--ts", str(TS))
    assert signed["value"] == "マトリックス"
    assert run("claim", "verify", stdin=json.dumps(signed, ensure_ascii=False)).exit_code == 0


def test_a_path_that_cannot_be_used_is_an_error_line_not_a_traceback(
    tmp_path: Path, key_file: Path
) -> None:
    """A missing folder, a file where a folder is meant, a name too long: `file_failed`,
    exit 2, like every error of the command line."""
    (tmp_path / "a-file").write_text("x")
    assert run("init", "--data-dir", str(tmp_path / "data")).exit_code == 0
    for args in (
        ("export", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "no" / "x")),
        ("keygen", "--out", str(tmp_path / "a-file" / "k.key")),
        ("keygen", "--out", str(tmp_path / ("k" * 300 + ".key"))),
        ("init", "--data-dir", str(tmp_path / "a-file" / "data")),
    ):
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith("error: file_failed: "), (args, result.output)


def test_a_data_directory_without_a_node_is_refused_not_made(tmp_path: Path) -> None:
    """The commands that read or change a node refuse a folder that holds none (a mistyped
    --data-dir) instead of making an empty node there and reporting on it with success."""
    typo = tmp_path / "dat"
    for args in (
        ("backup", str(tmp_path / "bk")),
        ("check",),
        ("export",),
        ("rebuild-cache",),
        ("signers", "list"),
        ("signers", "block", "z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"),
        ("signers", "add", "z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"),
        ("peers", "token", "create", "--name", "b"),
        ("peers", "token", "list"),
        ("peers", "token", "revoke", "b"),
    ):
        result = run(*args, "--data-dir", str(typo))
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith(f"error: no_node: {typo} holds no node"), result.output
        assert not typo.exists() and not (tmp_path / "bk").exists()


def test_a_peer_token_is_printed_alone_and_the_other_box_is_told_what_to_run(
    tmp_path: Path,
) -> None:
    """The token alone on stdout (a script keeps it); on stderr, the `peers add` the other
    box runs with it (it printed a bare token, the next step left to the docs)."""
    data = str(tmp_path / "data")
    assert run("init", "--data-dir", data).exit_code == 0
    made = run("peers", "token", "create", "--name", "box-b", "--data-dir", data)
    assert made.exit_code == 0, made.output
    (token,) = made.stdout.split()
    assert made.stderr == (
        "on box-b: metanode peers add http://<this box's name or address>:9000 "
        f"--token {token} --name <a name for this box>\n"
    )


def test_signers_add_again_changes_only_what_it_is_given(tmp_path: Path) -> None:
    """Re-adding a known signer (to rename it) keeps its weight and link permission unless
    they are given: renaming the owner never takes its weight of 100 away."""
    data = str(tmp_path / "data")
    uid = "z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
    assert run("init", "--data-dir", data).exit_code == 0

    def add(*flags: str) -> dict[str, Any]:
        result = run("signers", "add", uid, *flags, "--data-dir", data)
        assert result.exit_code == 0, result.output
        row: dict[str, Any] = json.loads(result.output)
        return row

    assert (add("--name", "new")["weight"], add("--name", "new")["may_link"]) == (1, False)
    row = add("--name", "heavy", "--weight", "7", "--may-link")
    assert (row["weight"], row["may_link"]) == (7, True)
    row = add("--name", "renamed")
    assert (row["name"], row["weight"], row["may_link"]) == ("renamed", 7, True)
    row = add("--name", "renamed", "--no-may-link")
    assert (row["weight"], row["may_link"]) == (7, False)
    row = add("--weight", "3")  # no --name: a known signer keeps its own
    assert (row["name"], row["weight"], row["may_link"]) == ("renamed", 3, False)
    # names are printed as written, as every JSON line of the commands is (they were \u00e9)
    add("--name", "Zoé's box")
    listed = run("signers", "list", "--data-dir", data)
    assert '"name": "Zoé\'s box"' in listed.output, listed.output


def test_export_of_a_signer_that_is_no_uid_is_refused(tmp_path: Path) -> None:
    assert run("init", "--data-dir", str(tmp_path / "data")).exit_code == 0
    result = run("export", "--signer", "notauid", "--data-dir", str(tmp_path / "data"))
    assert result.exit_code == 2 and result.output.startswith("error: invalid_uid: ")


def test_tampered_claim_fails(key_file: Path) -> None:
    signed = sign(key_file, "--key-name", "title", "--value", "The Matrix", "--ts", str(TS))
    tampered = {**signed, "value": "The Matrix Reloaded"}
    result = run("claim", "verify", stdin=json.dumps(tampered))
    assert result.exit_code == 1
    fields = (tampered[name] for name in ("uid", "cid", "key", "value", "ts"))
    assert result.stdout == (  # what it was checked against, to compare with what was signed
        "bad_signature: signature does not verify against uid; signed: "
        f"{claims.signing_bytes(*fields).decode()}\n"
    )


def test_verify_reports_each_claim(key_file: Path) -> None:
    good = sign(key_file, "--key-name", "title", "--value", "x", "--ts", str(TS))
    bad = {**good, "ts": TS + 1}
    result = run("claim", "verify", stdin=json.dumps([good, bad, good, {"uid": 1}]))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "ok"
    assert lines[1].startswith("bad_signature:")
    assert lines[2] == "ok"
    assert lines[3].startswith("invalid_claim:")


def test_a_command_reading_claims_from_a_terminal_says_so(key_file: Path) -> None:
    """`metanode claim verify` (or `claim post` given no claim) typed at a terminal sat silent,
    waiting for stdin, as if it hung: now it says what it waits for, then reads it."""
    line = json.dumps(sign(key_file, "--key-name", "title", "--value", "typed"))
    controller, terminal = os.openpty()
    with subprocess.Popen(
        [sys.executable, "-m", "metanode", "claim", "verify"],
        stdin=terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as verifying:
        os.close(terminal)
        assert verifying.stderr is not None
        said = verifying.stderr.readline()
        assert said == "reading claims from the terminal, a JSON line each; Ctrl-D ends…\n"
        os.write(controller, f"{line}\n".encode() + b"\x04")  # Ctrl-D: the end of input
        out, err = verifying.communicate(timeout=120)
    os.close(controller)
    assert (verifying.returncode, out, err) == (0, "ok\n", "")


def test_verify_the_vectors_as_json_lines() -> None:
    text = "\n".join(json.dumps(v["claim"]) for v in CLAIM_VECTORS) + "\n\n"
    result = run("claim", "verify", stdin=text)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["ok"] * len(CLAIM_VECTORS)


@pytest.mark.parametrize("text", ["", "\n\n", "[]"], ids=["nothing", "blank-lines", "empty-array"])
def test_verify_of_no_claims_is_refused_not_reported_as_all_ok(text: str) -> None:
    """An empty or wrong file piped to verify said nothing and exited 0, which a script reads
    as every claim verified."""
    result = run("claim", "verify", stdin=text)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: invalid_request: no claims"), result.stderr


def test_sign_retract(key_file: Path) -> None:
    signed = sign(key_file, "--key-name", "title", "--retract", "--ts", str(TS))
    assert signed["value"] is None
    assert run("claim", "verify", stdin=json.dumps(signed)).stdout.strip() == "ok"


def test_value_and_retract_together_is_a_usage_error(key_file: Path) -> None:
    result = run(
        "claim",
        "sign",
        "--key",
        str(key_file),
        "--cid",
        TARGET,
        "--key-name",
        "title",
        "--value",
        "x",
        "--retract",
    )
    assert result.exit_code == 2
    assert "--retract" in result.output
    assert result.stdout == ""


def test_neither_value_nor_retract_is_a_usage_error(key_file: Path) -> None:
    result = run("claim", "sign", "--key", str(key_file), "--cid", TARGET, "--key-name", "title")
    assert result.exit_code == 2
    assert result.stdout == ""


def test_sign_validates_before_printing(key_file: Path) -> None:
    base58 = CID.decode(TARGET).encode("base58btc")
    result = run(
        "claim",
        "sign",
        "--key",
        str(key_file),
        "--cid",
        base58,
        "--key-name",
        "title",
        "--value",
        "x",
    )
    assert result.exit_code == 2
    assert "noncanonical_cid" in result.stderr
    assert TARGET in result.stderr
    assert result.stdout == ""
    reserved = run(
        "claim",
        "sign",
        "--key",
        str(key_file),
        "--cid",
        TARGET,
        "--key-name",
        "filePath",
        "--value",
        "/x",
    )
    assert reserved.exit_code == 2
    assert "reserved_key" in reserved.stderr


def test_sign_with_a_broken_key_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.key"
    path.write_text("{not json")
    result = run(
        "claim", "sign", "--key", str(path), "--cid", TARGET, "--key-name", "title", "--value", "x"
    )
    assert result.exit_code == 2
    assert "invalid_key_file" in result.stderr


@pytest.mark.parametrize(
    "text", ["{not json", "[1, 2", '{"uid": 1}\nnope\n'], ids=["object", "array", "second-line"]
)
def test_verify_invalid_json(text: str) -> None:
    result = run("claim", "verify", stdin=text)
    assert result.exit_code == 2
    assert "invalid_json" in result.stderr


def test_a_misspelt_environment_variable_is_warned_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("METANODE_DATA_DIRR", str(tmp_path / "elsewhere"))
    result = run("init", "--data-dir", str(tmp_path / "data"))
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        "warning: METANODE_DATA_DIRR is not a metanode setting; ignored "
        "(did you mean METANODE_DATA_DIR?)"
    )
    assert not (tmp_path / "elsewhere").exists()


def test_plugins_try_says_a_slow_run_is_still_going_on(tmp_path: Path) -> None:
    """`plugins try` of a slow plugin (mediainfo's ffprobe on a network share) said nothing
    until the run ended, up to plugin_timeout_s (10 minutes): it says every `TICK_S` that the
    run is still going on, and when it would be given up. The plugin runs until the test
    has read that line (a condition, not a timer), then ends, its claim printed."""
    site = tmp_path / "site"
    site.mkdir()
    released = tmp_path / "released"
    install_plugin(
        site,
        "slow",
        "slow",
        f"while not os.path.exists({str(released)!r}):\n    time.sleep(0.05)\n"
        "register(file.cid, 'done', 'yes')",
    )
    slow = site / "slow_plugin.py"
    slow.write_text("import time\n" + slow.read_text())
    (tmp_path / "a.mkv").write_bytes(b"twelve bytes")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    with subprocess.Popen(
        [sys.executable, "-m", "metanode", "plugins", "try", "slow", "a.mkv"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as tried:
        assert tried.stderr is not None and tried.stdout is not None
        bound = threading.Timer(DEADLINE_S, released.touch)  # a bound on a hang: no line came
        bound.start()
        said = tried.stderr.readline()  # blocks until the line comes: the run is going on
        released.touch()
        bound.cancel()
        assert said == "  slow still running after 10 s (given up at 600 s: plugin_timeout_s)\n"
        assert tried.wait(timeout=120) == 0
        assert json.loads(tried.stdout.read())["value"] == "yes"


def test_plugins_try_runs_one_plugin_on_one_file_without_a_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin author had to install the plugin into a node, drop a file and read the log or
    the record: `plugins try` prints what it would claim, names what the node would refuse,
    says where it raised, and why a plugin does not load."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(
        site,
        "sizer",
        "sizer",
        "register(file.cid, 'size', str(file.size))\n"
        "register(file.cid, 'where', file.in_root)\n"
        "register(file.cid, 'gone', None)",
    )
    install_plugin(
        site,
        "sloppy",
        "sloppy",
        "register(file.cid, 'fine', 'x')\n"
        "register(file.cid, 'cid_x', 'y')\n"
        f"register(file.cid, 'cids/{MIDHASH_CID}', 'true')",  # it may not link
    )
    install_plugin(site, "raiser", "raiser", "raise ValueError('boom')")
    install_plugin(site, "exiter", "exiter", "raise SystemExit(3)")
    released = tmp_path / "released"
    install_plugin(  # hangs until the test is done with it
        site, "hanger", "hanger", f"while not os.path.exists({str(released)!r}): time.sleep(0.05)"
    )
    hanger = site / "hanger_plugin.py"
    hanger.write_text("import time\n" + hanger.read_text())
    install_plugin(site, "broken", "broken")
    (site / "broken_plugin.py").write_text("import not_installed_anywhere\n")
    install_plugin(site, "typo", "typo")  # a module of its own package: no install mends it
    (site / "typo_plugin.py").write_text("import sizer_plugin.helpers\n")
    install_plugin(site, "returner", "returner", "return [(file.cid, 'k', 'v')]")
    install_plugin(site, "asyncer", "asyncer", "register(file.cid, 'k', 'v')")
    asyncer = site / "asyncer_plugin.py"
    asyncer.write_text(asyncer.read_text().replace("def process", "async def process"))
    monkeypatch.syspath_prepend(str(site))
    media = tmp_path / "media"
    (media / "Show").mkdir(parents=True)
    film = media / "Show" / "a.mkv"
    film.write_bytes(b"twelve bytes")
    monkeypatch.chdir(tmp_path)  # the default watch root: ./media
    midhash = cids.midhash_bytes(b"twelve bytes")

    tried = run("plugins", "try", "sizer", str(film))
    assert tried.exit_code == 0, tried.output
    assert [json.loads(line) for line in tried.stdout.splitlines()] == [
        {"cid": midhash, "key": "size", "value": "12"},
        {"cid": midhash, "key": "where", "value": "Show/a.mkv"},
        {"cid": midhash, "key": "gone", "value": None},
    ]
    assert tried.stderr == f"sizer on Show/a.mkv (midhash {midhash}): 3 claim(s)\n"
    assert "cannot load plugin" not in caplog.text  # another plugin's traceback is no news

    sloppy = run("plugins", "try", "sloppy", str(film))
    assert sloppy.exit_code == 2  # a refused claim is not printed
    assert sloppy.stdout == json.dumps({"cid": midhash, "key": "fine", "value": "x"}) + "\n"
    assert sloppy.stderr.splitlines()[1:] == [
        "  refused: 'cid_x': reserved_key: key 'cid_x' is reserved",
        f"  refused: 'cids/{MIDHASH_CID}': link_not_permitted: the plugin does not declare "
        "may_link",
        "error: invalid_claim: the node would refuse 2 of its 3 claims, and so the whole run: "
        "it takes a run's claims all or none",
    ]
    (media / "empty.mkv").write_bytes(b"")  # the watcher never fingerprints it
    empty = run("plugins", "try", "sizer", str(media / "empty.mkv"))
    assert empty.exit_code == 2 and empty.stderr.startswith("error: invalid_request: ")
    assert "watch_min_size (1)" in empty.stderr
    raised = run("plugins", "try", "raiser", str(film))
    assert raised.exit_code == 2 and raised.stdout == ""
    assert raised.stderr.startswith(f"error: plugin_failed: raiser 1 on {film}: ValueError: boom")
    assert "raiser_plugin.py:7 in process)" in raised.stderr
    exited = run("plugins", "try", "exiter", str(film))  # it ended `try` silently, exit code 3
    assert exited.exit_code == 2 and exited.stderr.startswith(
        f"error: plugin_failed: exiter 1 on {film}: Aborted: SystemExit: 3"
    )
    monkeypatch.setenv("METANODE_PLUGIN_TIMEOUT_S", "0.2")  # `try` waited for ever
    hung = run("plugins", "try", "hanger", str(film))
    released.touch()
    assert hung.exit_code == 2 and hung.stderr.startswith(
        f"error: plugin_failed: hanger 1 on {film}: timed out after 0.2 s (plugin_timeout_s; "
    )
    monkeypatch.delenv("METANODE_PLUGIN_TIMEOUT_S")
    broken = run("plugins", "try", "broken", str(film))
    assert broken.stderr.startswith(
        "error: not_found: plugin 'broken' does not load: ModuleNotFoundError: No module named "
        "'not_installed_anywhere'"
    )
    assert broken.stderr.endswith(  # where it goes: the node's Python, not the one on PATH
        f": the node's Python ({sys.prefix}) has no 'not_installed_anywhere'; install the "
        f"package that provides it there ({sys.executable} -m pip install …) and list it in "
        "the plugin's dependencies\n"
    )
    # it printed nothing and said `0 claim(s)`, exit 0: the claims it returned were dropped
    returned = run("plugins", "try", "returner", str(film))
    assert returned.exit_code == 2 and returned.stdout == ""
    assert returned.stderr == (
        f"error: plugin_failed: returner 1 on {film}: TypeError: process returned "
        f"[('{midhash}', 'k', 'v')], not None: the host takes only what it passes to "
        f"register(cid, key, value), one claim a call (at {site / 'returner_plugin.py'}:6 in "
        "process)\n"  # the plugin's line, not asyncio's
    )
    awaited = run("plugins", "try", "asyncer", str(film))  # a coroutine never awaited, 0 claims
    assert awaited.exit_code == 2 and awaited.stderr == (
        "error: not_found: plugin 'asyncer' does not load: TypeError: asyncer_plugin:P: process "
        "is an async def: the host calls it on a thread of its own and never awaits it; make it "
        "a plain def\n"
    )
    typo = run("plugins", "try", "typo", str(film))
    assert typo.stderr.startswith("error: not_found: plugin 'typo' does not load: ")
    assert "pip install" not in typo.stderr
    unknown = run("plugins", "try", "nope", str(film))
    assert unknown.stderr.startswith("error: not_found: no installed plugin is named 'nope' ")
    assert unknown.stderr.endswith(  # installed into another Python than the node's, say
        f"of the packages installed in the node's Python ({sys.prefix}); install yours there "
        f"({sys.executable} -m pip install -e <its folder>)\n"
    )
    missing = run("plugins", "try", "sizer", str(media / "missing.mkv"))
    assert (missing.exit_code, missing.stderr.split(":")[1]) == (2, " midhash_failed")


def test_the_plugin_and_its_tests_in_plugins_md_run(tmp_path: Path) -> None:
    """docs/plugins.md's `WordCount`, installed by its `pyproject.toml`'s entry point, passes the
    tests the page gives for it: calling `process` itself, and `metanode plugins try`."""
    page = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```(python|toml)\n(.*?)```", page, re.S)
    [plugin] = [code for kind, code in blocks if kind == "python" and "class WordCount" in code]
    [tests] = [code for kind, code in blocks if kind == "python" and "def test_" in code]
    [toml] = [code for kind, code in blocks if kind == "toml" and "metanode.plugins" in code]
    [entry] = re.findall(r'^(wordcount) = "(my_plugin:WordCount)"$', toml, re.M)
    # `metanode` on PyPI is another project: a plugin depending on it would fetch that one
    assert tomllib.loads(toml)["project"]["dependencies"] == []
    site = tmp_path / "site"
    (site / "my_plugin").mkdir(parents=True)
    (site / "my_plugin" / "__init__.py").write_text(plugin)
    info = site / "my_plugin-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 1.0.0\n")
    (info / "entry_points.txt").write_text("[metanode.plugins]\n{} = {}\n".format(*entry))
    (tmp_path / "test_wordcount.py").write_text(tests)
    root = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_wordcount.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{root}"},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_a_reader_that_goes_away_is_no_error() -> None:
    """`metanode … | head` printed `error: file_failed: Broken pipe` after head had what it
    wanted; now it ends quietly, as `cat` does."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "metanode", "cid", "rank", *[MIDHASH_CID] * 20_000],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().endswith(f"{MIDHASH_CID}\n".encode())
    proc.stdout.close()  # more than a pipe's buffer is still to come: the next write fails
    with proc.stderr:
        assert proc.stderr.read() == b""
    assert proc.wait(timeout=120) == 1
