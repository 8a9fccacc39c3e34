"""The life of a key file, on real files and real processes: made whole or not at all, one key
however many processes make it at once, private modes, and a damaged or exposed file said so
in the one error form (docs/operations.md, "Key files")."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from metanode import keys
from metanode.cli import main
from tests.helpers.keyrace import race

TARGET = "bagacbabaea6gwjljwuu3cyxlrwwxgnmlfwd2gfshoi6mrtxysc4mnahe2hsqu"
ROUNDS, PROCESSES = 12, 6


def metanode(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command line as a person runs it: its own process."""
    return subprocess.run(
        [sys.executable, "-m", "metanode", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )


def sign_with(key: Path) -> subprocess.CompletedProcess[str]:
    return metanode(
        "claim", "sign", "--key", str(key), "--cid", TARGET, "--key-name", "title", "--value", "x"
    )


def leftovers(folder: Path) -> list[str]:
    """What is in `folder` besides key files: a temporary file a creation left."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".key"))


# -- made once, whole -------------------------------------------------------------------------


def test_processes_loading_a_new_key_at_once_all_get_the_one_key(tmp_path: Path) -> None:
    """The node's own and the plugins' keys are made on first use (`load_or_create`): made in
    place, a process that lost the race read the winner's file still empty (`invalid_key_file`)
    or failed `File exists`, 32 of 1,600 calls in 200 rounds of 8."""
    for round_ in range(ROUNDS):
        path = tmp_path / str(round_) / "plugin.key"
        outcomes = race(path, "load_or_create", PROCESSES)
        assert {kind for kind, _ in outcomes} == {"ok"}, outcomes
        assert {uid for _, uid in outcomes} == {keys.uid_of_key(keys.load(path))}
        assert leftovers(path.parent) == []
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_processes_creating_one_key_at_once_make_exactly_one(tmp_path: Path) -> None:
    """`keys.create` never replaces a key: one process makes it, every other is told it exists,
    naming the file."""
    for round_ in range(ROUNDS):
        path = tmp_path / str(round_) / "me.key"
        outcomes = race(path, "create", PROCESSES)
        made = [uid for kind, uid in outcomes if kind == "ok"]
        assert made == [keys.uid_of_key(keys.load(path))], outcomes
        refused = [text for kind, text in outcomes if kind != "ok"]
        assert refused == [f"[Errno {errno.EEXIST}] File exists: '{path}'"] * (PROCESSES - 1)
        assert leftovers(path.parent) == []


def at_once(arguments: list[str], count: int) -> list[tuple[int, str, str]]:
    """`metanode <arguments>` started `count` times at once: each one's (exit code, stdout,
    stderr)."""
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "metanode", *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    said = []
    for run in runs:
        out, err = run.communicate()
        said.append((run.returncode, out, err))
    return said


def test_keygen_run_at_once_makes_one_key_and_refuses_the_others(tmp_path: Path) -> None:
    """Two people (or two scripts) running `metanode keygen --out` on one file at once."""
    path = tmp_path / "me.key"
    said = at_once(["keygen", "--out", str(path)], PROCESSES)
    made = [out.strip() for code, out, _ in said if code == 0]
    assert made == [keys.uid_of_key(keys.load(path))], said
    refusals = [err for code, _, err in said if code != 0]
    assert all(
        err == f"error: invalid_request: {path} already exists; refusing to overwrite a key\n"
        for err in refusals
    ), refusals
    assert len(refusals) == PROCESSES - 1


def test_init_run_at_once_gives_one_owner_and_one_token(tmp_path: Path) -> None:
    """`metanode init` twice at once on a new data directory (a container's entrypoint and a
    person): one of four failed `file_failed: …/keys/owner.key: File exists` before."""
    data = tmp_path / "data"
    said = at_once(["init", "--data-dir", str(data)], 4)
    assert [code for code, _, _ in said] == [0] * 4, said
    owner = keys.uid_of_key(keys.load(data / "keys" / "owner.key"))
    assert all(f"owner key: {owner} " in out for _, out, _ in said), said
    assert len((data / "api-token").read_text().strip()) == 43
    assert leftovers(data / "keys") == []


def test_a_file_system_without_hard_links_makes_the_key_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key kept on a FAT stick: `link` is refused there (EPERM). This kernel mounts no FAT
    (no vfat module, no mkfs.vfat), so `link` is made to fail as it does on one."""

    def no_links(source: object, target: object) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(source), None, str(target))

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "stick" / "me.key"
    uid = keys.create(path)
    assert keys.uid_of_key(keys.load(path)) == uid
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert leftovers(path.parent) == []
    with pytest.raises(FileExistsError):
        keys.create(path)
    assert keys.uid_of_key(keys.load(path)) == uid


def test_a_temporary_file_a_crash_left_is_never_read(tmp_path: Path) -> None:
    """A process killed between writing the temporary file and linking it leaves only that
    file: the key's own name is never half made, and the next start makes the key."""
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o700)
    (folder / ".owner.key.4242-0a0b0c0d.part").write_text('{"type": "ed25519", "se')
    key = keys.load_or_create(folder / "owner.key")
    assert keys.uid_of_key(keys.load(folder / "owner.key")) == keys.uid_of_key(key)


def test_keygen_makes_a_new_folder_private_and_leaves_an_existing_one(tmp_path: Path) -> None:
    """The key 0600 and a folder it makes 0700, whatever the umask; a folder that was there
    (a home directory) keeps its mode: it is the person's, not the key's."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    old = os.umask(0)
    try:
        made = metanode("keygen", "--out", str(shared / "new" / "me.key"))
        beside = metanode("keygen", "--out", str(shared / "you.key"))
    finally:
        os.umask(old)
    assert made.returncode == 0 and beside.returncode == 0, (made.stderr, beside.stderr)
    assert stat.S_IMODE((shared / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE((shared / "new" / "me.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((shared / "you.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


# -- a damaged or exposed key file -------------------------------------------------------------

VECTOR_UID = "z6MkehRgf7yJbgaGfYsdoAsKdBPE3dj2CYhowQdcjqSJgvVd"  # seed 00 01 … 1f


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"", "the key file is empty: its writing never finished"),
        (b"\n", "the key file is empty: its writing never finished"),
        (b'{"type": "ed25519", "seed": "0001', "not a key file, or one cut short (not JSON)"),
        (b"\xff\xfe\x00garbage", "not a key file, or one cut short (not JSON)"),
        (b"[1, 2]", "not a key file (JSON, but no object)"),
        (b"null", "not a key file (JSON, but no object)"),
        (b'{"type": "rsa", "seed": "00"}', "not an ed25519 key file"),
        (b'{"type": "ed25519"}', "its seed is not 64 hex digits (32 bytes)"),
        (b'{"type": "ed25519", "seed": "0011"}', "its seed is not 64 hex digits (32 bytes)"),
        (b'{"type": "ed25519", "seed": 7}', "its seed is not 64 hex digits (32 bytes)"),
        (
            json.dumps({"type": "ed25519", "seed": "11" * 32, "uid": VECTOR_UID}).encode(),
            "the uid does not match the seed",
        ),
        (b" " * 5000, "the key file is empty"),
        (b"{" + b" " * 5000 + b"}", "not a key file (over 4096 bytes)"),
    ],
    ids=[
        "empty",
        "newline",
        "cut-short",
        "binary",
        "array",
        "null",
        "not-ed25519",
        "no-seed",
        "short-seed",
        "seed-not-text",
        "uid-mismatch",
        "blanks",
        "too-large",
    ],
)
def test_a_damaged_key_file_is_said_in_words(tmp_path: Path, body: bytes, said: str) -> None:
    """`claim sign` with a damaged key: `error: invalid_key_file: <file>: <what is wrong>`,
    exit 2, never a traceback nor Python's own words (`'list' object has no attribute 'get'`,
    `Expecting value: line 1 column 1 (char 0)`). (In process: thirteen interpreters cost 30 s.)"""
    path = tmp_path / "me.key"
    path.write_bytes(body)
    path.chmod(0o600)
    args = ["claim", "sign", "--key", str(path), "--cid", TARGET, "--key-name", "k", "--value", "x"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2, done.output
    assert done.stdout == ""
    assert done.stderr.startswith(f"error: invalid_key_file: {path}: {said}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_a_key_file_others_may_read_is_warned_of_and_still_signs(tmp_path: Path) -> None:
    """ssh refuses such a key; metanode warns (the secret is no safer for a refusal, and a FAT
    stick gives every file 0755), once, in the one form, with the way out."""
    path = tmp_path / "me.key"
    uid = keys.create(path)
    quiet = sign_with(path)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet
    for mode in (0o644, 0o640, 0o604, 0o620):
        path.chmod(mode)
        warned = sign_with(path)
        assert warned.returncode == 0, warned
        assert json.loads(warned.stdout)["uid"] == uid
        assert warned.stderr == (
            f"warning: key_file_exposed: {path} may be read or changed by other users of this "
            f"machine (mode {mode:o}): `chmod 600 {path}`; if anyone else could have read it, "
            "take it as leaked: make a new key, and block this one where it is registered "
            "(`metanode signers block <uid>`, docs/operations.md, 'A signing key lost or "
            "leaked')\n"
        ), warned.stderr
