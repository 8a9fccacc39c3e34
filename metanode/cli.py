"""The `metanode` command line (click). Thin: every command calls into the package.

Exit codes: 0 success, 1 a verdict failed (e.g. a claim did not verify), 2 bad input (with the
error slug on stderr).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, TypeVar

import click

from metanode import cid as cids
from metanode import claims, keys
from metanode.errors import InvalidJson, MetanodeError

F = TypeVar("F", bound=Callable[..., Any])


def reports_errors(func: F) -> F:
    """Turn a `MetanodeError` into `error: <slug>: <message>` on stderr and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MetanodeError as exc:
            click.echo(f"error: {exc.slug}: {exc.message}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@click.group()
@click.version_option(package_name="metanode")
def main() -> None:
    """metanode: a claims-and-CID metadata node for home media boxes."""


# -- cid ----------------------------------------------------------------------------------------


@main.group()
def cid() -> None:
    """Compute, parse and rank CIDs."""


@cid.command("midhash")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@reports_errors
def cid_midhash(files: tuple[str, ...]) -> None:
    """Print `<midhash256 CID>  <path>` for each FILE (one read of at most 1 MiB each)."""
    for path in files:
        value, _size = cids.midhash_file(path)
        click.echo(f"{value}  {path}")


@cid.command("parse")
@click.argument("value")
@reports_errors
def cid_parse(value: str) -> None:
    """Print VALUE's canonical form, version, codec, multihash, digest, rank and alias as JSON.

    Any multibase and CIDv0 are accepted; exit 2 with the error slug if VALUE is not a CID.
    """
    click.echo(json.dumps(cids.parse(value).as_json(), indent=2))


@cid.command("rank")
@click.argument("values", nargs=-1, required=True)
def cid_rank(values: tuple[str, ...]) -> None:
    """Print the CIDs best first, one per line, as `<rank>  <cid>` (unparseable ranks 0)."""
    for value in cids.by_rank(values):
        click.echo(f"{cids.rank(value):>2}  {value}")


# -- keys and claims ----------------------------------------------------------------------------


@main.command()
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False),
              help="Where to write the new key file (must not exist; created with mode 0600).")
@reports_errors
def keygen(out: str) -> None:
    """Create a new Ed25519 key file and print its uid."""
    try:
        uid = keys.create(out)
    except FileExistsError:
        raise click.ClickException(f"{out} already exists; refusing to overwrite a key") from None
    click.echo(uid)


@main.group()
def claim() -> None:
    """Sign, verify and post claims."""


@claim.command("sign")
@click.option("--key", "key_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Key file made by `metanode keygen`.")
@click.option("--cid", "cid_value", required=True, help="Canonical CID the claim is about.")
@click.option("--key-name", required=True, help="The claimed key, e.g. `title`.")
@click.option("--value", default=None, help="The value (a string).")
@click.option("--retract", is_flag=True, help="Sign a retraction (value null) instead.")
@click.option("--ts", type=int, default=None, help="Milliseconds since the epoch (default: now).")
@reports_errors
def claim_sign(key_file: str, cid_value: str, key_name: str, value: str | None, retract: bool,
               ts: int | None) -> None:
    """Print a signed wire claim as one JSON line; the claim is validated before it is signed."""
    if retract == (value is not None):
        raise click.UsageError("give exactly one of --value or --retract")
    signing_key = keys.load(key_file)
    signed = claims.sign(signing_key, cid_value, key_name, value, ts if ts is not None else now_ms())
    claims.validate(signed.wire(), now_ms())
    click.echo(json.dumps(signed.wire(), ensure_ascii=False))


def read_claims(text: str) -> Iterator[object]:
    """Claims from text: a JSON array, or one JSON object per line."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            yield from json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise InvalidJson(f"input is not a JSON array: {exc}") from None
        return
    for number, line in enumerate(stripped.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidJson(f"line {number} is not JSON: {exc}") from None


@claim.command("verify")
@reports_errors
def claim_verify() -> None:
    """Read claims on stdin (JSON lines or an array); print `ok` or the error slug for each.

    Exits 1 if any claim failed.
    """
    failed = False
    for item in read_claims(sys.stdin.read()):
        try:
            claims.validate(item, now_ms())
            click.echo("ok")
        except MetanodeError as exc:
            failed = True
            click.echo(f"{exc.slug}: {exc.message}")
    if failed:
        sys.exit(1)
