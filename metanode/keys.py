"""Ed25519 key files: create (mode 0600, whole or not at all, never overwriting) and load.

A key file is a small JSON object `{"type": "ed25519", "seed": "<64 hex>", "uid": "z6Mk…"}`.
The uid is stored next to the seed only so a person can see whose key it is; loading checks that
it matches the seed.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import nacl.signing

from metanode.claims import uid_of
from metanode.errors import OUT_OF_FILES, InvalidKeyFile, KeyFileExposed, storage_error

# What `link` fails with on a file system without hard links (FAT, exFAT, some SMB shares).
NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
MOST_KEY_BYTES = 4096  # a key file is about 155 bytes: more is another file named by mistake


def uid_of_key(key: nacl.signing.SigningKey) -> str:
    return uid_of(bytes(key.verify_key))


def create(path: str | os.PathLike[str], key: nacl.signing.SigningKey | None = None) -> str:
    """Write a new key file readable by its owner only; returns its uid.

    A second call, even at the same instant from another process, fails with
    `FileExistsError` (naming `path`) instead of silently replacing an identity.
    """
    key = key or nacl.signing.SigningKey.generate()
    uid = uid_of_key(key)
    body = json.dumps({"type": "ed25519", "seed": bytes(key).hex(), "uid": uid}) + "\n"
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # keys/: its owner's only
    write_secret(target, body)
    return uid


def write_secret(path: Path, text: str) -> None:
    """Make the file `path` (mode 0600; an existing one is never replaced: `FileExistsError`
    naming `path`) holding `text`, whole under its name from the first instant, and on the
    disk before anyone uses it.

    The text is written and fsync'd in a temporary file of the same folder, which is then
    hard-linked to `path`: `link`, like `O_EXCL`, fails if the name exists, so of two
    processes making one key at once (two `init`s, `init` beside a first `serve`) one wins and
    the other reads the winner's key. Made in place with `O_EXCL`, the loser read it empty
    (`invalid_key_file`, 12 of 1,600 racing loads) or failed `File exists` (20 of 1,600), and
    a crash between the name and the bytes left an empty key. The folder is fsync'd after: a
    key file written and no more was found empty after a disk error 1 s after the first start
    (ext4 writes a file's data seconds after its name), while the truth, fsync'd, already named
    that owner key. On a file system without hard links (a FAT stick holding a person's key)
    the file is made in place with `O_EXCL`, as before: never two keys, but a reader at that
    instant may see it unfinished. A temporary file a crash leaves (`.<name>.<pid>-<hex>.part`)
    is never read."""
    part = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.part")
    write_new(part, text)
    try:
        _link(part, path, text)
    finally:
        part.unlink(missing_ok=True)
    sync_folder(path.parent)


def _link(part: Path, path: Path, text: str) -> None:
    """Give the whole file `part` the name `path` too, unless `path` exists."""
    try:
        os.link(part, path)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        write_new(path, text)


def write_new(path: Path, text: str) -> None:
    """Make the file `path` (mode 0600, `O_EXCL`) holding `text`, fsync'd; one that cannot be
    written whole (a full disk) is removed, not left empty. (A temporary file, renamed or
    linked into place after: `write_secret`, `datadir.write_whole`.)"""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def sync_folder(folder: Path) -> None:
    """fsync `folder`, so the names made or renamed in it are on the disk too."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike[str]) -> nacl.signing.SigningKey:
    """Read a key file; raises `InvalidKeyFile` saying what is wrong with it in words (empty,
    cut short, not a key file, a bad seed: Python's own `Expecting value: line 1 column 1
    (char 0)` told nobody what to do), and `OutOfFiles` if it could not be opened for want of
    a file descriptor (the file is fine: `invalid_key_file` sent an operator to a key that was
    whole)."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MOST_KEY_BYTES + 1)
    except OSError as exc:
        if exc.errno in OUT_OF_FILES:
            raise storage_error(exc) or exc from None
        raise InvalidKeyFile(f"{path}: cannot read key file ({exc.strerror or exc})") from None
    key, uid = _parse(raw, path)
    if uid not in (None, uid_of_key(key)):
        raise InvalidKeyFile(f"{path}: the uid does not match the seed")
    return key


def _parse(raw: bytes, path: str | os.PathLike[str]) -> tuple[nacl.signing.SigningKey, Any]:
    """The key a key file's bytes hold, and the uid it names beside it."""
    if not raw.strip():
        raise InvalidKeyFile(
            f"{path}: the key file is empty: its writing never finished (a crash, a full "
            "disk), or it is not a key file"
        )
    if len(raw) > MOST_KEY_BYTES:
        raise InvalidKeyFile(f"{path}: not a key file (over {MOST_KEY_BYTES} bytes)")
    try:
        data = json.loads(raw)
    except ValueError:
        raise InvalidKeyFile(f"{path}: not a key file, or one cut short (not JSON)") from None
    if not isinstance(data, dict):
        raise InvalidKeyFile(f"{path}: not a key file (JSON, but no object)")
    if data.get("type") != "ed25519":
        raise InvalidKeyFile(f"{path}: not an ed25519 key file")
    try:
        return nacl.signing.SigningKey(bytes.fromhex(data["seed"])), data.get("uid")
    except (KeyError, ValueError, TypeError):
        raise InvalidKeyFile(f"{path}: its seed is not 64 hex digits (32 bytes)") from None


def exposure(path: str | os.PathLike[str]) -> KeyFileExposed | None:
    """Why others on this machine may read or change the key file `path` (any group or other
    bit, as ssh checks a private key), or None. Said as a warning, not a refusal: refusing
    does not take the secret back from whoever read it, and a FAT stick cannot give a file
    0600 at all."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if not mode & 0o077:
        return None
    return KeyFileExposed(
        f"{path} may be read or changed by other users of this machine (mode {mode:o}): "
        f"`chmod 600 {path}`; if anyone else could have read it, take it as leaked: make a "
        "new key, and block this one where it is registered (`metanode signers block <uid>`, "
        "docs/operations.md, 'A signing key lost or leaked')"
    )


def load_or_create(path: str | os.PathLike[str]) -> nacl.signing.SigningKey:
    """The key at `path`, created on first use (plugins' and the node's own keys). Made by
    another process at the same instant, the one it made is read (`write_secret`)."""
    if not Path(path).exists():
        try:
            create(path)
        except FileExistsError as exc:
            if Path(exc.filename) != Path(path):  # a file where its folder would be
                raise
    return load(path)
