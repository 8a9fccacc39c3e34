"""Ed25519 key files: create (mode 0600, never overwriting) and load.

A key file is a small JSON object `{"type": "ed25519", "seed": "<64 hex>", "uid": "z6Mk…"}`.
The uid is stored next to the seed only so a person can see whose key it is; loading checks that
it matches the seed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nacl.signing

from metanode.claims import uid_of
from metanode.errors import OUT_OF_FILES, InvalidKeyFile, storage_error


def uid_of_key(key: nacl.signing.SigningKey) -> str:
    return uid_of(bytes(key.verify_key))


def create(path: str | os.PathLike[str], key: nacl.signing.SigningKey | None = None) -> str:
    """Write a new key file readable by its owner only; returns its uid.

    `O_EXCL` makes a second call fail instead of silently replacing an identity.
    """
    key = key or nacl.signing.SigningKey.generate()
    uid = uid_of_key(key)
    body = json.dumps({"type": "ed25519", "seed": bytes(key).hex(), "uid": uid}) + "\n"
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # keys/: its owner's only
    write_secret(target, body)
    return uid


def write_secret(path: Path, text: str) -> None:
    """Make the file `path` (mode 0600; an existing one is never replaced: `FileExistsError`)
    holding `text`, on the disk before anyone uses it: the file and its folder fsync'd. A key
    file written and no more was found empty after a disk error 1 s after the first start
    (ext4 writes a file's data seconds after its name), while the truth, fsync'd, already
    named that owner key: the node refused to start until `init --new-owner`. A power cut does
    the same. One that cannot be written whole (a full disk) is removed, not left empty. (No
    rename or link into place: a FAT or SMB data directory may not take one.)"""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """fsync `folder`, so the names made or renamed in it are on the disk too."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike[str]) -> nacl.signing.SigningKey:
    """Read a key file; raises `InvalidKeyFile` with the reason if it is not one, and
    `OutOfFiles` if it could not be opened for want of a file descriptor (the file is fine:
    `invalid_key_file` sent an operator to a key that was whole)."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("type") != "ed25519":
            raise InvalidKeyFile(f"{path}: not an ed25519 key file")
        key = nacl.signing.SigningKey(bytes.fromhex(data["seed"]))
    except InvalidKeyFile:
        raise
    except OSError as exc:
        if exc.errno in OUT_OF_FILES:
            raise storage_error(exc) or exc from None
        raise InvalidKeyFile(f"{path}: cannot read key file ({exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidKeyFile(f"{path}: cannot read key file ({exc})") from None
    if data.get("uid") not in (None, uid_of_key(key)):
        raise InvalidKeyFile(f"{path}: the uid does not match the seed")
    return key


def load_or_create(path: str | os.PathLike[str]) -> nacl.signing.SigningKey:
    """The key at `path`, created on first use (plugins' and the node's own keys)."""
    if not Path(path).exists():
        create(path)
    return load(path)
