"""The `metanode` command line (click). Thin: every command calls into the package.

Exit codes (`EXIT_CODES`, shown by `metanode --help`): 0 success, 1 a verdict failed (e.g. a
claim did not verify), 2 bad input (with the error slug on stderr), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from functools import wraps
from pathlib import Path
from typing import IO, Any, NamedTuple, NoReturn, TypeVar

import click
import httpx
from click.core import ParameterSource

from metanode import cid as cids
from metanode import (
    claims,
    client,
    config,
    datadir,
    jsonl,
    keys,
    logs,
    maintenance,
    merge,
    node,
    plugins,
    sse,
    watcher,
)
from metanode.clock import now_ms
from metanode.errors import (
    INTERRUPTED,
    INTERRUPTED_LINE,
    CannotListen,
    FileFailed,
    InvalidBatch,
    InvalidClaim,
    InvalidRequest,
    MetanodeError,
    MidhashError,
    Unreachable,
    WatchRootsDamaged,
    storage_error,
)

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


def reports_errors(func: F) -> F:
    """Turn a `MetanodeError` into `error: <slug>: <message>` on stderr and exit code 2; so too
    a file operation that failed outside the database layer (the token, a key, a backup copy,
    an `--out`): a full or read-only disk as its typed `StorageError`, any other (a missing
    folder, a file where a folder was meant) as `FileFailed`; and a database failure no store
    typed (a damaged file), never a traceback."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except BrokenPipeError:
            _reader_gone()
        except OSError as exc:
            _fail(storage_error(exc) or FileFailed.of(exc))
        except MetanodeError as exc:
            _fail(exc)
        except Exception as exc:  # a damaged database met where no store maps its error
            typed = maintenance.storage_failure(exc)
            if typed is None:
                raise
            _fail(typed)

    return wrapper  # type: ignore[return-value]


def _reader_gone() -> NoReturn:
    """The reader of stdout went away (`metanode export | head`): no error to tell, as `cat`
    tells none. stdout is pointed at /dev/null so the interpreter's own last flush is quiet."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)


def _fail(exc: MetanodeError) -> NoReturn:
    _say(exc)
    sys.exit(2)


def _say(exc: MetanodeError) -> None:
    """`error: <slug>: <message>` on stderr, the one form of every error of the CLI."""
    hint = UNREACHABLE_HINT if isinstance(exc, Unreachable) else ""
    click.echo(f"error: {exc.slug}: {exc.message}{hint}", err=True)


# where a client command looks for its node besides the address it tried (`node_address`)
UNREACHABLE_HINT = (
    "; a node on this machine is found by its data directory (--data-dir, METANODE_DATA_DIR), "
    "any other named with --url"
)


class Metanode(click.Group):
    """The `metanode` group. click's own errors (a missing argument, an unknown option, a file it
    cannot open) come out in the form every other error has, `error: <slug>: <message>`, with
    the same exit codes, instead of click's usage block."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # a bare `metanode` or `metanode peers`: its help, not an error line
            sys.exit(2)
        except click.UsageError as exc:
            hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
            click.echo(f"error: usage: {exc.format_message()}{hint}", err=True)
            sys.exit(2)
        except click.FileError as exc:
            click.echo(f"error: unreadable_file: {exc.format_message()}", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            click.echo(f"error: invalid_request: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:  # click's word for Ctrl-C (there is no prompt to abort)
            click.echo(INTERRUPTED_LINE, err=True)
            sys.exit(INTERRUPTED)


CHECK_INCONCLUSIVE = 3  # `check` reached no verdict: a node wrote while it compared
EXIT_CODES = (
    "Exit codes: 0 done; 1 a verdict failed (claim verify, check, health degraded) or the "
    "reader of stdout went away (`| head`); 2 bad input or a refusal, said on stderr as "
    "`error: <slug>: <message>`; 3 `check` reached no verdict (on PostgreSQL, a node wrote "
    "while it compared: run it again); 130 interrupted (Ctrl-C). Each command's --help says "
    "the rest."
)


@click.group(cls=Metanode, epilog=EXIT_CODES)
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
    """Print `<midhash256 CID>  <path>` for each FILE (one read of at most 1 MiB each); a
    path's backslashes, line feeds and carriage returns as `\\\\`, `\\n` and `\\r`.

    A FILE that cannot be read is named on stderr and the others are still hashed (exit 2 at
    the end), as `sha256sum` does."""
    failed = False
    for path in files:
        try:
            value, _size = watcher.midhash_file(path)
        except MidhashError as exc:  # one unreadable file of `media/*`: the rest still wanted
            _say(exc)
            failed = True
            continue
        click.echo(f"{value}  {one_line(path)}")
    if failed:
        sys.exit(2)


# What `one_line` writes for the characters that would end a line of output (and for the
# backslash that writes them): each file one line, as `sha256sum` writes its names.
LINE_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", "\r": "\\r"})


def one_line(path: str) -> str:
    """`path` on one line of output: a name may hold a line feed (`new\\nline.mkv`), which cut
    `metanode cid midhash`'s line for it in two (`cut -d' ' -f1` then read the rest of the
    name as the next CID)."""
    return path.translate(LINE_ESCAPES)


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
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Where to write the new key file (must not exist; created with mode 0600, and a "
    "folder it makes 0700; docs/operations.md, 'Key files').",
)
@reports_errors
def keygen(out: str) -> None:
    """Create a new Ed25519 key file and print its uid."""
    try:
        uid = keys.create(out)
    except FileExistsError as exc:
        if Path(exc.filename) != Path(out):  # a file where its folder would be: `file_failed`
            raise
        raise InvalidRequest(f"{out} already exists; refusing to overwrite a key") from None
    click.echo(uid)


@main.group()
def claim() -> None:
    """Sign, verify and post claims."""


@claim.command("sign")
@click.option(
    "--key",
    "key_file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Key file made by `metanode keygen`.",
)
@click.option(
    "--cid",
    "cid_value",
    required=True,
    help="The CID the claim is about, in its canonical spelling (base32, `b…`; "
    "`metanode cid parse` gives it).",
)
@click.option("--key-name", required=True, help="The claimed key, e.g. `title`.")
@click.option("--value", default=None, help="The value (a string).")
@click.option("--retract", is_flag=True, help="Sign a retraction (value null) instead.")
@click.option("--ts", type=int, default=None, help="Milliseconds since the epoch (default: now).")
@reports_errors
def claim_sign(
    key_file: str, cid_value: str, key_name: str, value: str | None, retract: bool, ts: int | None
) -> None:
    """Print a signed wire claim as one JSON line, validated exactly as a node would."""
    if retract == (value is not None):
        raise click.UsageError("give exactly one of --value or --retract")
    signing_key = keys.load(key_file)
    if exposed := keys.exposure(key_file):
        click.echo(f"warning: {exposed.slug}: {exposed.message}", err=True)
    when = ts if ts is not None else now_ms()
    signed = claims.sign(signing_key, cid_value, key_name, value, when)
    claims.validate(signed.wire(), now_ms())
    click.echo(jsonl.dumps(signed.wire()))


@claim.command("verify")
@reports_errors
def claim_verify() -> None:
    """Read claims on stdin (JSON lines or an array); print `ok` or the error slug for each.

    Exits 1 if any claim failed; no claim at all is refused (exit 2), as an empty or wrong
    file is a mistake, not a success.
    """
    verdicts = [_verdict(item) for _position, item in jsonl.read(stdin("claims"))]
    if not verdicts:
        raise InvalidRequest("no claims on stdin to verify")
    if not all(verdicts):
        sys.exit(1)


def stdin(what: str) -> IO[bytes]:
    """Standard input, for a command to read `what` from; at a terminal, said first on stderr:
    `metanode claim post` given no claim sat silent, waiting for one, as if it hung."""
    if sys.stdin.isatty():
        click.echo(f"reading {what} from the terminal, a JSON line each; Ctrl-D ends…", err=True)
    return sys.stdin.buffer


def _verdict(item: Any) -> bool:
    """Validate one claim read by `claim verify`, printing `ok` or its slug; whether it passed."""
    try:
        claims.validate(item, now_ms())
    except MetanodeError as exc:
        # a signature that does not verify: against which bytes, for a signer's author to
        # compare with what their code signed (docs/protocol.md, "Signing without metanode")
        signed = f"; signed: {exc.extra['signed']}" if "signed" in exc.extra else ""
        click.echo(f"{exc.slug}: {exc.message}{signed}")
        return False
    click.echo("ok")
    return True


# -- the node -----------------------------------------------------------------------------------


def settings_options(func: F) -> F:
    """`--config` and `--data-dir`, shared by every command that works on a data directory."""
    func = click.option(
        "--data-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Data directory (default ./data, or METANODE_DATA_DIR).",
    )(func)
    func = click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False),
        default=None,
        help="TOML config file (default ./metanode.toml if present).",
    )(func)
    return func


def load_settings(config_file: str | None, **overrides: Any) -> config.Settings:
    """The settings, after a warning on stderr for each `METANODE_*` variable that names none."""
    for warning in config.unknown_environment():
        click.echo(f"warning: {warning}", err=True)
    return config.load(config_file, overrides=overrides)


@main.command()
@settings_options
@click.option(
    "--new-owner",
    is_flag=True,
    help="Make this data directory's owner key the owner of the node's databases: their "
    "recorded owner key is lost for good, or this is another box seeded from a copy of them "
    "(without it, another owner key is refused).",
)
@click.option(
    "--new-log",
    is_flag=True,
    help="Give the truth a new claim-log id and rebuild the cache under a new feed epoch: it was "
    "put back from a backup by hand (a pg_restore), so the boxes that follow it reconcile "
    "and the feed's readers start again from a snapshot, instead of skipping claims and "
    "events (`metanode restore` does this itself). Run it before the node starts.",
)
@reports_errors
def init(config_file: str | None, data_dir: str | None, new_owner: bool, new_log: bool) -> None:
    """Create the data directory, both databases and the API token; print where they are."""
    settings = load_settings(config_file, data_dir=data_dir)
    maintenance.open_store(settings)
    token, created = maintenance.ensure_token(settings.token_path)
    owner, former = maintenance.adopt_owner(settings, new_owner)
    if new_log:
        with datadir.Lock(settings.data_dir):  # a running node's followers: all reconciled
            renewed = maintenance.renew_log(settings)
            # the feed's ids after the backup's end would be given again to other events: a
            # reader holding one skipped them (a restored cache keeps its epoch)
            state = maintenance.rebuild_cache(settings, locked=True).state
        click.echo(f"claim log: {renewed} (a new id: followers reconcile)")
        click.echo(f"cache rebuilt: feed epoch {state.epoch} (feed readers start from a snapshot)")
    click.echo(f"data directory: {settings.data_dir.resolve()}")
    click.echo(f"owner key: {owner} (signer `owner`, in {settings.keys_dir})")
    for uid in former:
        click.echo(
            f"warning: the former owner key {uid} keeps its weight, and its edits stand; "
            f"if it may be in other hands, `metanode signers block {uid}` (its edits are "
            "withdrawn with it)",
            err=True,
        )
    if created:
        click.echo(f"API token (also in {settings.token_path}): {token}")
    else:
        click.echo(f"API token: in {settings.token_path}")


def node_settings(config_file: str | None, data_dir: str | None) -> config.Settings:
    """The settings of a command that reads an existing node (`maintenance.require_node`)."""
    settings = load_settings(config_file, data_dir=data_dir)
    maintenance.require_node(settings)
    return settings


def watching(settings: config.Settings) -> str:
    """The start-up line naming what the watcher watches, so a wrong folder shows at once."""
    if not settings.watch_enabled:
        return "watching: nothing (watch_enabled is off)"
    roots = ", ".join(str(Path(root).resolve()) for root in settings.watched)
    if not roots:  # every folder chosen on the page was let go
        roots = "no folder (add one on the web page's Files, or POST /api/watch-roots)"
    if settings.postgresql:
        return f"watching, while this replica applies (docs/scale-out.md): {roots}"
    return f"watching: {roots}"


@main.command()
@settings_options
@click.option("--host", default=None, help="Bind address (default 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65_535), default=None, help="Port (default 9000).")
@click.option(
    "--workers",
    type=click.IntRange(0, 256),
    default=None,
    help="Serving processes (default: the workers setting; 0 = the number of cores; 1 = one).",
)
@click.option("--worker", default=None, hidden=True, help="role:index:fd (set by the supervisor)")
@reports_errors
def serve(
    config_file: str | None,
    data_dir: str | None,
    host: str | None,
    port: int | None,
    workers: int | None,
    worker: str | None,
) -> None:
    """Run the node (HTTP API, applier, watcher, plugins, peers) until SIGINT, SIGTERM or
    SIGHUP."""
    settings = load_settings(config_file, data_dir=data_dir, host=host, port=port, workers=workers)
    settings.require_roots()  # a damaged list of folders: refused before anything is made
    logs.configure(settings.log_level)  # before the data directory: tightening it is logged
    if worker is not None:
        serve_worker(settings, worker)
        return
    with datadir.locked(settings.data_dir) as lock:  # held until the node stops
        if lock.unclean is not None:
            after_unclean_stop(settings, lock.unclean)
        serve_node(settings, config_file)


def after_unclean_stop(settings: config.Settings, pid: int) -> None:
    """Say that the last node did not stop cleanly, once both databases were read for the
    damage such a stop can leave (`maintenance.after_unclean_stop`: a damaged truth refuses
    the start, a damaged cache is moved aside and built anew)."""
    aside = maintenance.after_unclean_stop(settings)
    log.warning(
        "the last node on this data directory (pid %d) did not stop cleanly (killed, crashed, "
        "or the machine went down): nothing it acknowledged is lost, as every truth commit is "
        "on disk; the cache catches up from the truth",
        pid,
    )
    if aside is not None:
        log.warning(
            "cache.db was damaged: moved into %s; it is built anew from the truth (nothing "
            "acknowledged is lost)",
            aside,
        )


def serve_node(settings: config.Settings, config_file: str | None) -> None:
    """`serve` once it holds the data directory: open, check, listen, say where, then serve in
    this process or as the supervisor of `settings.worker_count` workers."""
    maintenance.refuse_lost_truth(settings)  # before open_store would make an empty one
    sock = listen(settings)  # first: a port in use makes no databases, keys or token
    maintenance.open_store(settings)
    maintenance.check_writable(settings)
    maintenance.check_keys(settings)  # before a worker or a plugin meets a damaged one
    maintenance.adopt_owner(settings)  # a replica given a fresh data directory: refused
    token, created = maintenance.ensure_token(settings.token_path)
    for made_once in (settings.instance_path, settings.session_secret_path):  # before any
        maintenance.ensure_token(made_once)  # worker reads it: a damaged one refused here
    url = settings.page_url  # under `root_path`, the page's address (it answers there too)
    count = settings.worker_count
    # the storage: after `migrate-storage`, a start without `storage` serves the old SQLite
    where = f"data: {settings.data_dir.resolve()}, storage: {settings.storage_shown}"
    click.echo(f"metanode serving {url}  ({where}, workers: {workers_shown(settings)})")
    click.echo(watching(settings))
    if created:
        click.echo(f"API token, shown once (kept in {settings.token_path}): {token}")
    else:
        click.echo(f"API token: in {settings.token_path}")
    from metanode import compat

    compat.announce(settings)  # MetaMesh's lock file, if `metamesh_volume` is set
    from metanode import server

    server.raise_open_files(settings.max_connections)  # before the workers: they inherit it
    # where it listens, for the client commands given only its data directory (`connect`)
    with datadir.serving(settings.data_dir, config.local_url(*sock.getsockname()[:2])):
        if count > 1:
            supervise(settings, count, config_file, sock)
            return
        from metanode.api import create_app

        app = create_app(node.Node(settings))
        stop_cleanly()
        with contextlib.suppress(KeyboardInterrupt):
            server.run(app, settings, [sock])


def workers_shown(settings: config.Settings) -> str:
    """How many processes serve, and, where `workers = 0` gave fewer than the cores, why: a
    small box's memory (`config.default_workers`)."""
    count, cores = settings.worker_count, config.cores()
    if settings.workers or count >= cores:
        return str(count)
    memory = (config.memory_bytes() or 0) / (1 << 30)
    share = config.WORKER_MEMORY >> 20
    return f"{count}, one per {share} MiB of the {memory:.1f} GiB of memory, for {cores} cores"


def listen(settings: config.Settings) -> socket.socket:
    """The address taken before anything says the node serves: a port another server holds
    is `cannot_listen` (exit 2), not a "serving" line followed by a failure."""
    from metanode import workers

    try:
        return workers.listen(settings)
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        reason = os.strerror(exc.errno) if exc.errno else str(exc)  # not create_server's repeat
        if exc.errno is not None and exc.errno < 0:  # the resolver's code, no errno: its words
            reason = f"{str(exc.strerror).split(' (while attempting')[0]} ({HOST_HINT})"
        raise CannotListen(f"{where}: {reason}") from None


# what a host that does not resolve (`cannot_listen`, an error of the resolver) must be instead
HOST_HINT = "host must be an address of this machine, or a name that resolves to one"


def stop_cleanly() -> None:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    that was installed before it: make that handler a clean exit (status 0), not a kill."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))


def supervise(
    settings: config.Settings, count: int, config_file: str | None, sock: socket.socket
) -> None:
    """`serve --workers N`: run the workers (workers.py) on the bound `sock` until
    SIGTERM/SIGINT/SIGHUP."""
    from metanode import workers

    base = ["--data-dir", str(settings.data_dir), "--host", settings.host]
    base += ["--port", str(settings.port), *(["--config", config_file] if config_file else [])]
    metrics, status = workers.metrics_path(settings), workers.status_path(settings)
    workers.Supervisor(count, sock, workers.worker_command(base), metrics, status).run()


def serve_worker(settings: config.Settings, spec: str) -> None:
    """One worker of `serve --workers N`, on the listening socket its supervisor handed it."""
    import socket

    from metanode import server, workers

    role, index, fd = spec.split(":")
    sockets = [socket.socket(fileno=int(fd))]
    if role == workers.OWNER:
        sockets.append(workers.owner_socket(settings))
    app = workers.worker_app(settings, role, int(index))
    stop_cleanly()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run(app, settings, sockets)
    finally:
        if role == workers.OWNER:
            workers.socket_path(settings).unlink(missing_ok=True)


@main.group()
def signers() -> None:
    """Manage the signer registry (works on the data directory, server running or not)."""


@signers.command("add")
@click.argument("uid")
@click.option(
    "--name", default=None, help="A human name for the signer (a known one keeps its own)."
)
@click.option(
    "--weight",
    type=click.IntRange(0, merge.MAX_WEIGHT),
    default=None,
    help=f"Its weight (a new signer: {merge.DEFAULT_WEIGHT}; a known one keeps its own).",
)
@click.option(
    "--may-link/--no-may-link",
    default=None,
    help="Whether its cids/ votes may link groups (a new signer: no; a known one keeps its own).",
)
@settings_options
@reports_errors
def signers_add(
    uid: str,
    name: str | None,
    weight: int | None,
    may_link: bool | None,
    config_file: str | None,
    data_dir: str | None,
) -> None:
    """Register UID (or update its name, and its weight and link permission where given)."""
    row = maintenance.add_signer(node_settings(config_file, data_dir), uid, name, weight, may_link)
    click.echo(jsonl.dumps(row.as_json()))


@signers.command("list")
@settings_options
@reports_errors
def signers_list(config_file: str | None, data_dir: str | None) -> None:
    """Print every registered signer as one JSON line."""
    for row in maintenance.signers(node_settings(config_file, data_dir)):
        click.echo(jsonl.dumps(row.as_json()))


def _status_command(name: str, status: str) -> None:
    # the help given to click, which reads it as the command is made (a __doc__ set after
    # left `signers block --help` and `signers --help` without a word of what it does)
    @signers.command(
        name, help=f"Set UID's status to {status}; the records it voted on are recomputed."
    )
    @click.argument("uid")
    @settings_options
    @reports_errors
    def command(uid: str, config_file: str | None, data_dir: str | None) -> None:
        row = maintenance.set_signer_status(node_settings(config_file, data_dir), uid, status)
        click.echo(jsonl.dumps(row.as_json()))


_status_command("block", "blocked")
_status_command("unblock", "active")


def client_options(func: F) -> F:
    """`--url`, and the data directory and settings it defaults from (`node_address`)."""
    func = click.option(
        "--url",
        default=None,
        envvar="METANODE_URL",
        help="Base URL of the node (default: where the node serving the data directory "
        "listens, else http://<host>:<port> of the settings, i.e. METANODE_HOST / "
        "METANODE_PORT, else http://127.0.0.1:9000; none when the node that recorded its "
        "address there was killed: said, not asked).",
    )(func)
    return settings_options(func)


def token_option(func: F) -> F:
    return click.option(
        "--token",
        envvar="METANODE_TOKEN",
        default=None,
        help="API token (default: METANODE_TOKEN, else the api-token file of "
        "the data directory, when it is on this machine).",
    )(func)


def read_token(path: Path) -> str | None:
    """The API token kept in a local data directory, if there is one that can be read."""
    try:
        return path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


class Located(NamedTuple):
    """Where a client command asks (`node_address`): the `url`, where it came from (`source`,
    said when nothing answers there), and whether it may be asked at all: not `asked` is the
    address a node that is not running recorded, said rather than asked."""

    url: str
    source: str
    asked: bool = True


class NodeClient(client.Client):
    """A client command's client, with what to say when the node refuses its token
    (`unauthorized`): the node's message speaks of the header and the web page's cookie, not
    of where this command looked for the token. An address recorded by a node that is not
    running is never asked (`_ask_only_where_asked`): whatever took its port since is another
    node, or another program, not the one serving this data directory."""

    token_hint = ""

    def __init__(self, locate: Callable[[], Located], token: str | None, timeout: float) -> None:
        url, self.source, self.asked = locate()
        super().__init__(url, token=token, timeout=timeout)
        self._locate = locate
        self._http.event_hooks = {"request": [self._ask_only_where_asked]}

    def _ask_only_where_asked(self, request: httpx.Request) -> None:
        """Refuse, as a connection refused, a request to an address not to be asked: every
        command's request and the `events` stream go through here, so each says, or waits
        on, "not running" as it does on a node that does not answer."""
        if not self.asked:
            raise httpx.ConnectError("the node that recorded it is not running", request=request)

    def reconnecting(self) -> None:
        """Ask again where the node listens (`node_address`), for a command that waits for it
        (`events`, `get --wait`): one that started, or started again elsewhere, is followed."""
        url, self.source, self.asked = self._locate()
        self.url = client.node_address(url).rstrip("/")
        self._http.base_url = httpx.URL(self.url)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return super().request(method, path, **kwargs)
        except Unreachable as exc:
            raise Unreachable(f"{exc.message} ({self.source})") from None


def node_address(settings: config.Settings, url: str | None) -> Located:
    """Where a client command asks, and where that came from: `--url` (or METANODE_URL), else
    the address the node serving the data directory recorded (`datadir.served_at`: `serve
    --port 9100` or another shell's METANODE_PORT), else the settings' host and port. A record
    its node outlived (killed) is said and not asked, nor is the settings' address: no node
    serves this data directory (one would hold the record), so whatever answers at either is
    another node, and reading or writing it would be reading or writing the wrong node."""
    if url is not None:
        context = click.get_current_context(silent=True)
        given = context.get_parameter_source("url") if context else None
        return Located(
            url, f"from {'METANODE_URL' if given is ParameterSource.ENVIRONMENT else '--url'}"
        )
    where = settings.data_dir.absolute()
    served = datadir.served_at(settings.data_dir)
    if served is None:
        none = f"no running node recorded its address in {where}"
        return Located(settings.client_url, f"from the settings' host and port: {none}")
    if served.runs:
        return Located(served.url, f"recorded by the node serving {where}")
    gone = (
        f"recorded in {where} by a node killed or crashed since; not asked, nor the settings' "
        "address: what answers there now is not the node of this data directory; start it "
        "again with `metanode serve`"
    )
    return Located(served.url, gone, asked=False)


def connect(
    config_file: str | None,
    data_dir: str | None,
    url: str | None,
    token: str | None = None,
    needs_token: bool = False,
    token_flag: str = "--token",
) -> NodeClient:
    """A client of the node serving the data directory of these settings (`node_address`), with
    its token if needed (`token` from `token_flag` or METANODE_TOKEN, else the data directory's
    api-token)."""
    settings = load_settings(config_file, data_dir=data_dir)
    given, kept = f"{token_flag} or METANODE_TOKEN", settings.token_path.absolute()
    if needs_token and token is None:
        token = read_token(kept)
        given = str(kept)
    node_client = NodeClient(lambda: node_address(settings, url), token=token, timeout=60)
    if needs_token and token is None:
        node_client.token_hint = (
            f"no token was sent: none was given ({token_flag} or METANODE_TOKEN) and there is "
            f"none in {kept}; give {token_flag}, or --data-dir naming the node's data "
            "directory (or run where it is)"
        )
    elif needs_token:
        node_client.token_hint = (
            f"the token from {given} was refused: give this node's, the content of its data "
            "directory's api-token"
        )
    return node_client


def _print_response(
    node_client: NodeClient, response: httpx.Response, places: Sequence[str] = ()
) -> None:
    """A good answer's JSON on stdout; the node's refusal as every error of the CLI comes out
    (`_refused`), not its envelope on stdout, where a script would take it for the answer."""
    try:
        node_client.answer(response)
    except client.ClientError as exc:
        _refused(exc, places, node_client)
    click.echo(response.text)


def _refused(
    exc: client.ClientError, places: Sequence[str] = (), node_client: NodeClient | None = None
) -> NoReturn:
    """The node's refusal: `error: <slug>: <message>` on stderr, then each rejected claim of a
    batch (`invalid_batch`) on a line of its own, named where the command read it (`places`,
    by the batch's index: `argument 2`, `claim 3` of stdin), else by that index, or for a
    refused token where it came from (`NodeClient.token_hint`); exit 2."""
    items = exc.body.get("items")
    lines = [f"error: {exc.slug}: {exc.body.get('message')}"]
    lines += [
        f"  {_place(places, item.get('index'))}: {item.get('error')}: {item.get('message')}"
        for item in (items if isinstance(items, list) else [])
        if isinstance(item, dict)
    ]
    if exc.slug == "unauthorized" and node_client is not None:
        hints = (node_client.token_hint, _path_hint(node_client.url))
        lines += [f"  {hint}" for hint in hints if hint]
    click.echo("\n".join(lines), err=True)
    sys.exit(2)


def _path_hint(url: str) -> str:
    """What a refused token may really mean when the node's address has a path: the node asks
    a token of every path it does not serve, so `--url http://box:9000/ui` (copied from the
    browser) was told `unauthorized` even by `health` and `get`, which need none."""
    path = urllib.parse.urlsplit(url).path
    if not path:
        return ""
    return (
        f"the address {url} has a path, {path}: unless it is the node's root_path, give the "
        "node's base address (http://host:port), under which every route is"
    )


def _place(places: Sequence[str], index: object) -> str:
    if isinstance(index, int) and 0 <= index < len(places):
        return places[index]
    return f"claim {index}"


@claim.command("post")
@client_options
@token_option
@click.argument("claim_json", nargs=-1)
@reports_errors
def claim_post(
    url: str | None,
    token: str | None,
    claim_json: tuple[str, ...],
    config_file: str | None,
    data_dir: str | None,
) -> None:
    """POST claims (arguments, or JSON lines / a JSON array on stdin) as one batch."""
    read = (
        [(f"argument {n}", jsonl.loads(c, f"argument {n}")) for n, c in enumerate(claim_json, 1)]
        if claim_json
        else [(f"claim {n}", item) for n, item in jsonl.read(stdin("claims"))]
    )
    if not read:
        raise InvalidRequest("no claims to post")
    places, items = zip(*read, strict=True)
    with connect(config_file, data_dir, url, token, needs_token=True) as node_client:
        response = node_client.request("POST", "/api/claims", json={"claims": list(items)})
        _print_response(node_client, response, places)


@main.command()
@client_options
@click.argument("cid_value")
@click.option("--as", "viewer", default=None, help="See the record as this uid.")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0),
    default=0,
    help="Seconds to keep asking while no record holds CID_VALUE yet (a file just dropped "
    "into a watched folder: it settles, then is fingerprinted), or the node is not up yet.",
)
@reports_errors
def get(
    url: str | None,
    cid_value: str,
    viewer: str | None,
    wait_s: float,
    config_file: str | None,
    data_dir: str | None,
) -> None:
    """Print the merged document of CID_VALUE from a running node."""
    params = {"as": viewer} if viewer else {}
    path = f"/api/meta/{urllib.parse.quote(cid_value, safe='')}"  # a CID, never another route
    deadline, said = time.monotonic() + wait_s, False
    with connect(config_file, data_dir, url) as node_client:
        while True:
            try:
                response = node_client.request("GET", path, params=params)
                if not _not_yet(response) or time.monotonic() >= deadline:
                    break
            except Unreachable as exc:  # a node still starting (the README's tour): asked again
                if time.monotonic() >= deadline:
                    raise
                if not said:  # as `events` says it: a wrong --url is not a silent wait
                    click.echo(f"waiting up to {wait_s:g} s: {exc.message}…", err=True)
                    said = True
            time.sleep(WAIT_POLL_S)
            node_client.reconnecting()  # a node starting records its address meanwhile
        _print_response(node_client, response)


@main.command()
@client_options
@reports_errors
def health(url: str | None, config_file: str | None, data_dir: str | None) -> None:
    """Say how the running node is: `ok` or `degraded`, then each problem and each warning of
    its /health on a line of its own; exit 0 if ok, 1 if degraded (a cron job or a container
    health check), 2 if it does not answer (`error: unreachable: …`) or its database is away
    (`error: storage_unavailable: …`)."""
    with connect(config_file, data_dir, url) as node_client:
        try:
            body = node_client.answer(node_client.request("GET", "/health"))
        except client.ClientError as exc:
            _refused(exc, (), node_client)
    click.echo(f"{body['status']} ({node_client.url})")
    for kind in ("problem", "warning"):
        for line in body.get(f"{kind}s", []):
            click.echo(f"  {kind}: {line}")
    sys.exit(0 if body["status"] == "ok" else 1)


WAIT_POLL_S = 0.25  # how often `get --wait` asks again


def _not_yet(response: httpx.Response) -> bool:
    """Whether `response` may change by waiting: no record holds the CID yet (404
    `unknown_cid`), or the node says to retry (a 503: its cache still being built)."""
    if response.status_code == 503:
        return True
    if response.status_code != 404:
        return False
    try:
        return bool(response.json().get("error") == "unknown_cid")
    except ValueError:
        return False


# -- peers (docs/peers.md) ----------------------------------------------------------------------


@main.group("peers")
def peers_group() -> None:
    """Follow other boxes' claims, and give them tokens to follow this one."""


@peers_group.command("add")
@client_options
@click.option(
    "--api-token",
    "token",
    envvar="METANODE_TOKEN",
    default=None,
    help="This node's API token (default: METANODE_TOKEN, else the data directory's).",
)
@click.argument("peer_url")
@click.option(
    "--token", "peer_token", required=True, help="The peer token the other box made for this one."
)
@click.option(
    "--weight",
    type=click.IntRange(0, merge.MAX_WEIGHT),
    default=0,
    show_default=True,
    help="Weight of the signers first seen through this peer (0: listed, not counted).",
)
@click.option("--name", default=None, help="A name for the peer (default: its host:port).")
@reports_errors
def peers_add(
    url: str | None,
    token: str | None,
    peer_url: str,
    peer_token: str,
    weight: int,
    name: str | None,
    config_file: str | None,
    data_dir: str | None,
) -> None:
    """Follow the box at PEER_URL: reconcile first if this box holds claims, then pull."""
    body: dict[str, Any] = {"url": peer_url, "token": peer_token, "weight": weight}
    if name is not None:
        body["name"] = name
    with connect(
        config_file, data_dir, url, token, needs_token=True, token_flag="--api-token"
    ) as node_client:
        response = node_client.request("POST", "/api/peers", json=body)
        _print_response(node_client, response)
    row = response.json()
    if row.get("last_error"):  # the node tried the peer once before it answered
        click.echo(
            f"warning: peer {row['name']}: {row['last_error']}\n"
            f"  it stays followed and is tried again with back-off; "
            f"`metanode peers remove {row['name']}` stops it",
            err=True,
        )


def _list_command(
    group: click.Group, path: str, member: str, doc: str, warned: str | None = None
) -> None:
    """`group list`: each row of the list `member` of the running node's GET `path` answer,
    as one JSON line; each row of the list `warned` (when named) as a warning on stderr."""

    @group.command("list", help=doc)
    @client_options
    @token_option
    @reports_errors
    def command(
        url: str | None, token: str | None, config_file: str | None, data_dir: str | None
    ) -> None:
        with connect(config_file, data_dir, url, token, needs_token=True) as node_client:
            try:
                answer = node_client.answer(node_client.request("GET", path))
            except client.ClientError as exc:
                _refused(exc, (), node_client)
            for row in answer[member]:
                click.echo(jsonl.dumps(row))
            for row in answer.get(warned, []) if warned else []:
                click.echo(f"warning: {warned}: {jsonl.dumps(row)}", err=True)


_list_command(
    peers_group,
    "/api/peers",
    "peers",
    "Print each peer (cursor, lag, last error, counts) as one JSON line.",
)


def _named_command(
    group: click.Group, name: str, argument: str, method: str, path: str, doc: str
) -> None:
    """`group name ARGUMENT`: one request of the running node about the peer or plugin
    ARGUMENT names (quoted into `path`), its answer printed."""

    @group.command(name, help=doc)
    @client_options
    @token_option
    @click.argument("named", metavar=argument)
    @reports_errors
    def command(
        url: str | None,
        token: str | None,
        named: str,
        config_file: str | None,
        data_dir: str | None,
    ) -> None:
        quoted = urllib.parse.quote(named, safe="")
        with connect(config_file, data_dir, url, token, needs_token=True) as node_client:
            _print_response(node_client, node_client.request(method, path.format(quoted)))


_named_command(
    peers_group,
    "remove",
    "PEER_NAME",
    "DELETE",
    "/api/peers/{}",
    "Stop following PEER_NAME (its claims stay).",
)
_named_command(
    peers_group,
    "sync",
    "PEER_NAME",
    "POST",
    "/api/peers/{}/sync",
    "Reconcile with PEER_NAME now and fetch the claims this box lacks (after trusting a "
    "signer whose claims were refused, say).",
)


@main.group("plugins")
def plugins_group() -> None:
    """The plugins the running node runs (their runs, retrying those that failed), and one
    plugin tried on one file without a node."""


_list_command(
    plugins_group,
    "/api/plugins",
    "plugins",
    "Print each plugin (version, weight, run counts, newest failures) as one JSON line, and "
    "on stderr each installed one that does not run, with why.",
    warned="not_loaded",
)


_named_command(
    plugins_group,
    "retry",
    "PLUGIN_NAME",
    "POST",
    "/api/plugins/{}/retry",
    "Run PLUGIN_NAME's failed and skipped runs again (once what they lacked is there: a tool "
    "installed).",
)


@plugins_group.command("try")
@click.argument("plugin_name")
@click.argument("file", type=click.Path(dir_okay=False))
@settings_options
@reports_errors
def plugins_try(plugin_name: str, file: str, config_file: str | None, data_dir: str | None) -> None:
    """Run PLUGIN_NAME on FILE as the node would and print each claim it makes as one JSON line
    (`{"cid", "key", "value"}`, a null value retracting), without a node: to write or check a
    plugin. Its record lookup answers nothing, nothing is signed or stored, and it has
    plugin_timeout_s to finish; a claim the node would refuse is named on stderr and the exit
    code is 2 (the node would then take none of the run's claims)."""
    settings = load_settings(config_file, data_dir=data_dir)
    real = os.path.realpath(file)
    midhash, stat = watcher.midhash_opened(real)
    tried = plugins.trial(
        plugin_name,
        (midhash, real, stat.st_size, stat.st_mtime_ns),
        [os.path.realpath(root) for root in settings.watched],
        claims.Limits(settings.max_value_bytes, settings.max_skew_ms),
        settings.watch_min_size,
        settings.plugin_timeout_s,
        lambda file, elapsed: _trying(plugin_name, file, elapsed, settings.plugin_timeout_s),
    )
    for cid, key, value in tried.drafts:
        click.echo(jsonl.dumps({"cid": cid, "key": key, "value": value}))
    click.echo(
        f"{plugin_name} on {tried.file.in_root} (midhash {tried.file.cid}): "
        f"{len(tried.drafts)} claim(s){f'; {tried.skipped}' if tried.skipped else ''}",
        err=True,
    )
    for why in tried.refusals:
        click.echo(f"  refused: {why}", err=True)
    if tried.refusals:
        total = len(tried.drafts) + len(tried.refusals)
        _fail(
            InvalidClaim(
                f"the node would refuse {len(tried.refusals)} of its {total} claims, and so the "
                "whole run: it takes a run's claims all or none"
            )
        )


def _trying(name: str, file: plugins.LocalFile, elapsed: float, timeout_s: float) -> None:
    """What `plugins try` says on stderr while the plugin runs: on a terminal that it starts,
    and wherever stderr goes, every `plugins.TICK_S` after, that it still runs and until when
    (a slow plugin, mediainfo's ffprobe on a network share, left the terminal silent; a
    script's captured stderr is left as it was for a quick run)."""
    if elapsed == 0.0:
        if sys.stderr.isatty():
            click.echo(f"running {name} on {file.in_root} (midhash {file.cid})…", err=True)
        return
    click.echo(
        f"  {name} still running after {elapsed:.0f} s (given up at {timeout_s:g} s: "
        "plugin_timeout_s)",
        err=True,
    )


@peers_group.group("token")
def peers_token() -> None:
    """Read-only tokens for other boxes (work on the data directory, server running or not)."""


@peers_token.command("create")
@click.option("--name", required=True, help="Whom the token is for.")
@settings_options
@reports_errors
def peers_token_create(name: str, config_file: str | None, data_dir: str | None) -> None:
    """Make a peer token and print it (once: only its hash is kept); on stderr, the command
    the other box runs with it."""
    settings = node_settings(config_file, data_dir)
    token = maintenance.create_peer_token(settings, name)
    click.echo(token)
    click.echo(
        f"on {name}: metanode peers add http://<this box's name or address>:{settings.port} "
        f"--token {token} --name <a name for this box>",
        err=True,
    )


@peers_token.command("list")
@settings_options
@reports_errors
def peers_token_list(config_file: str | None, data_dir: str | None) -> None:
    """Print each peer token's name and creation time as one JSON line."""
    for row in maintenance.peer_tokens(node_settings(config_file, data_dir)):
        click.echo(jsonl.dumps({"name": row.name, "created_at": row.created_at}))


@peers_token.command("revoke")
@click.argument("name")
@settings_options
@reports_errors
def peers_token_revoke(name: str, config_file: str | None, data_dir: str | None) -> None:
    """Revoke the peer token NAME; it is refused from its next request."""
    maintenance.revoke_peer_token(node_settings(config_file, data_dir), name)
    click.echo(jsonl.dumps({"revoked": name}))


@main.command("rebuild-cache")
@settings_options
@reports_errors
def rebuild_cache(config_file: str | None, data_dir: str | None) -> None:
    """Recompute cache.db from truth.db. With a node serving the data directory, the node
    does it in place, a chunk of records at a time between its writes, keeping the feed epoch;
    else under a new feed epoch (local files are kept; a damaged cache.db is moved into
    replaced-<stamp>/ and built anew)."""
    settings = node_settings(config_file, data_dir)
    served = datadir.served_at(settings.data_dir)
    if served is not None and served.runs and not maintenance.cache_damage(settings):
        _rebuild_by_the_node(connect(config_file, data_dir, None, needs_token=True))
        return
    rebuilt = maintenance.rebuild_cache(settings)
    if rebuilt.aside is not None:
        click.echo(
            f"cache.db was damaged ({rebuilt.damage}): moved into {rebuilt.aside}, and built "
            "anew from the truth (no claim is lost: the next start hashes the watched files "
            "again and the plugins run again)"
        )
    state = rebuilt.state
    click.echo(f"rebuilt: epoch {state.epoch}, applied seq {state.applied_seq}")


REBUILD_POLL_S = 0.5  # how often `rebuild-cache` asks a node rebuilding in place how far it is


def _rebuild_by_the_node(node_client: NodeClient) -> None:
    """`rebuild-cache` beside a running node: ask it to rebuild in place (POST
    /api/cache/rebuild), then wait until its /health no longer says `rebuilding`. Rebuilt by
    this process, the cache was one transaction the node's writes waited behind, every post
    held for the whole rebuild (37 s at 500,000 claims) and failed past SQLite's busy wait.
    A Ctrl-C ends the waiting, not the rebuild, which the node finishes (after a restart too)."""
    with node_client:
        try:
            started = node_client.answer(node_client.request("POST", "/api/cache/rebuild"))
            click.echo(
                f"the node serving this data directory ({node_client.url}) rebuilds its cache "
                f"in place, between its writes (epoch {started['epoch']} kept); waiting for "
                "it (Ctrl-C stops the waiting, not the rebuild)"
            )
            while (health := _rebuild_progress(node_client))["rebuilding"]:
                time.sleep(REBUILD_POLL_S)
        except client.ClientError as exc:
            _refused(exc, (), node_client)
    click.echo(f"rebuilt: epoch {health['epoch']}, applied seq {health['applied_seq']}")


def _rebuild_progress(node_client: NodeClient) -> Any:
    """The node's /health while it rebuilds; a node that stopped answering meanwhile is said
    with what becomes of the rebuild (it goes on after a start, from its last step)."""
    try:
        return node_client.answer(node_client.request("GET", "/health"))
    except Unreachable as exc:
        raise Unreachable(
            f"{exc.message}; the rebuild goes on from its last step when the node starts again "
            "(its /health says rebuilding until it ends)"
        ) from None


@main.command()
@settings_options
@reports_errors
def check(config_file: str | None, data_dir: str | None) -> None:
    """Compare the live cache with a fresh rebuild and re-verify every stored signature.

    Exits 1 and prints each difference if anything disagrees. Beside a running node it
    compares copies of both stores taken at one moment (SQLite; on PostgreSQL a node writing
    meanwhile makes it say INCONCLUSIVE, exit 3: run it again).
    """
    settings = node_settings(config_file, data_dir)
    with tempfile.TemporaryDirectory() as scratch:
        report = maintenance.check(settings, Path(scratch) / "cache.db")
    _report_check(report)


def _report_check(report: maintenance.CheckReport) -> None:
    """Print `check`'s differences and verdict; exit 1 unless clean."""
    if report.damaged:
        click.echo("\n".join(report.damaged))
        click.echo("DAMAGED: nothing else was compared")
        sys.exit(1)
    for line in report.differences + [f"bad signature: {b}" for b in report.bad_signatures]:
        click.echo(line)
    for line in [*report.notes, *([report.inconclusive] if report.inconclusive else [])]:
        click.echo(f"note: {line}")
    if report.unbuilt:  # after `restore`: a list of every record "missing" said nothing true
        click.echo("the cache is not built yet (the next start builds it): not compared")
    click.echo(f"{report.claims_checked} claims verified; {report.verdict}")
    if report.verdict != "clean":
        sys.exit(CHECK_INCONCLUSIVE if report.verdict == "INCONCLUSIVE" else 1)


@main.command("migrate-storage")
@click.option("--to", "dsn", required=True, help="The empty PostgreSQL database: postgresql://…")
@settings_options
@reports_errors
def migrate_storage(dsn: str, config_file: str | None, data_dir: str | None) -> None:
    """Copy this SQLite box into an empty PostgreSQL database, then check the copy.

    Claims, groups and rids, signers, peers, local files and the feed epoch are copied; the
    cache is rebuilt there. Run it with the node stopped (it takes the data directory's lock);
    then set `storage` to the DSN (docs/scale-out.md).
    """
    settings = load_settings(config_file, data_dir=data_dir)
    with datadir.Lock(settings.data_dir), tempfile.TemporaryDirectory() as scratch:
        report = maintenance.migrate_storage(settings, dsn, Path(scratch) / "cache.db")
    for table, rows in report.copied.items():
        click.echo(f"copied {table}: {rows} rows")
    _report_check(report.check)


@main.command()
@client_options
@token_option
@click.option("--since", default=None, help="Resume after this event id (<epoch>-<seq>).")
@click.option("--snapshot", is_flag=True, help="Start with every current record.")
@click.option("--prefix", multiple=True, help="Only keys starting with this (repeatable).")
@click.option("--rid", "rid_values", multiple=True, help="Only this record (repeatable).")
@reports_errors
def events(
    url: str | None,
    token: str | None,
    since: str | None,
    snapshot: bool,
    prefix: tuple[str, ...],
    rid_values: tuple[str, ...],
    config_file: str | None,
    data_dir: str | None,
) -> None:
    """Follow the change feed, one line per event: `<id or -> <event> <json>`; reconnects by
    itself and resumes where it was (saying so on stderr while it waits). Ctrl-C stops."""
    # the node's own rules, here where they were typed: with the node away, a mistyped
    # --since or --rid waited for it, to be refused once it came
    sse.parse_cursor(since)
    sse.Filter.of(rid_values, prefix)
    node_client = connect(config_file, data_dir, url, token, needs_token=True)

    def waiting(reason: str) -> None:
        click.echo(
            f"waiting for the node at {node_client.url} ({node_client.source}; {reason}); "
            "retrying every second…",
            err=True,
        )

    try:
        for event in node_client.events(
            since=since, snapshot=snapshot, prefix=prefix, rid=rid_values, on_wait=waiting
        ):
            data = json.dumps(event.data, ensure_ascii=False, separators=(",", ":"))
            click.echo(f"{event.id or '-'} {event.kind} {data}")
            sys.stdout.flush()  # a line as it happens, also into a pipe (`| grep`, a script)
    except client.ClientError as exc:
        _refused(exc, (), node_client)
    except KeyboardInterrupt:
        pass
    finally:
        node_client.close()


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@settings_options
@reports_errors
def scan(paths: tuple[str, ...], config_file: str | None, data_dir: str | None) -> None:
    """Reconcile PATHS with the data directory once: hash new and changed files, drop vanished
    ones, update their records; with a progress bar. Refused while `serve` runs on the data
    directory (its watcher does this)."""
    settings = load_settings(config_file, data_dir=data_dir, watch_enabled=False)
    maintenance.refuse_lost_truth(settings)

    async def run() -> watcher.Summary:
        the_node = node.Node(settings)
        await the_node.start()
        try:
            with logs.progress_bar(sizes=True) as bar:
                task = bar.add_task("hashing", total=None, files="")

                def report(files: int, size: int, total_files: int, total_size: int) -> None:
                    bar.update(
                        task, completed=size, total=total_size, files=f"{files}/{total_files} files"
                    )

                return await the_node.scan(paths, progress=report)
        finally:
            await the_node.stop()

    with datadir.Lock(settings.data_dir):  # a second node beside a running `serve`: refused
        summary = asyncio.run(run())
    click.echo(summary.said())
    for path in summary.failed:
        click.echo(f"unreadable: {one_line(path)}", err=True)
    for path in summary.not_text:
        click.echo(f"not UTF-8, left out (rename it): {path}", err=True)  # one line already


@main.command()
@click.argument("target", type=click.Path(file_okay=False))
@settings_options
@reports_errors
def backup(target: str, config_file: str | None, data_dir: str | None) -> None:
    """Copy truth.db (online: consistent while the server writes), keys/ and the watched
    folders chosen on the page into TARGET.

    `metanode restore TARGET/truth-<stamp>.db` puts it back (the node stopped). A damaged
    list of folders is left out, and said on stderr; the rest is backed up.
    """
    settings = node_settings(config_file, data_dir)
    made = maintenance.backup(settings, Path(target))
    if made.cleared:
        cleared = ", ".join(path.name for path in made.cleared)
        click.echo(f"removed what backups that did not finish left: {cleared}", err=True)
    click.echo(made.copy)
    if made.folders_damaged:
        click.echo(
            f"warning: {WatchRootsDamaged.slug}: {made.folders_damaged}; this backup holds no "
            "list of watched folders (the truth and the keys are in it): fix the list, then "
            "back up again",
            err=True,
        )


@main.command()
@click.argument("backup_file", type=click.Path(dir_okay=False))
@click.option(
    "--keys",
    "keys_from",
    type=click.Path(file_okay=False),
    default=None,
    help="The backup's keys folder (default: keys-<stamp> beside BACKUP_FILE).",
)
@click.option(
    "--keep-keys", is_flag=True, help="Keep this data directory's keys instead of the backup's."
)
@settings_options
@reports_errors
def restore(
    backup_file: str,
    keys_from: str | None,
    keep_keys: bool,
    config_file: str | None,
    data_dir: str | None,
) -> None:
    """Put a backup (`metanode backup`) in place of truth.db and its keys in place of keys/,
    the node stopped: checked first, what it replaces kept in replaced-<stamp>/, the cache
    rebuilt at the next start."""
    settings = load_settings(config_file, data_dir=data_dir)
    with datadir.locked(settings.data_dir):  # never under a running node
        done = maintenance.restore(
            settings, Path(backup_file), Path(keys_from) if keys_from else None, keep_keys
        )
    click.echo(f"restored {backup_file} into {settings.truth_path}")
    click.echo(f"keys: {done.keys or f'kept, {settings.keys_dir}'}")
    _restored_folders(settings, done)
    click.echo(f"what it replaced: {done.aside or 'nothing (a new data directory)'}")


def _restored_folders(settings: config.Settings, done: maintenance.Restored) -> None:
    """What `restore` said of the watched folders: the backup's list, or the data directory's
    kept; each restored folder that is not there named on stderr, with what the next start
    does with it: kept in the list and shown missing, never made empty (`Node._chosen_roots`),
    watched once it is there."""
    if done.folders is None:
        click.echo("watched folders: the backup has no list of them; this data directory's kept")
        if settings.watch_roots_damaged:  # the start refuses it: the way out said now
            click.echo(
                f"warning: {WatchRootsDamaged.slug}: {settings.watch_roots_damaged}", err=True
            )
        return
    click.echo(f"watched folders: {', '.join(done.folders) or 'none'} (the backup's list)")
    for root in done.missing:
        click.echo(
            f"warning: watched folder {root} does not exist here (or its disk is not mounted): "
            "it stays in the list, shown missing on the Files page and in /health (never made "
            "empty), and is watched once it is there: mount its disk, or, if it is gone for "
            "good, stop watching it on the Files page (or DELETE /api/watch-roots)",
            err=True,
        )
    if settings.watch_roots_from:
        click.echo(
            f"note: watch_roots is set in {settings.watch_roots_from}, which the node watches "
            "instead: the restored list is read once that setting is removed",
            err=True,
        )


@main.command("export")
@click.option("--signer", "uid", default=None, help="Only the claims of this uid.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default="-",
    show_default=True,
    help="Where to write the JSON lines (- is stdout).",
)
@settings_options
@reports_errors
def export_command(
    uid: str | None, out: str, config_file: str | None, data_dir: str | None
) -> None:
    """Write every stored claim, retractions included, as JSON lines of wire claims."""
    settings = node_settings(config_file, data_dir)
    total, rows = maintenance.export_claims(settings, uid)
    with click.open_file(out, "wb") as sink, logs.progress_bar() as bar:
        task = bar.add_task("claims", total=total)
        for row in rows:
            sink.write(jsonl.encode(row))
            bar.advance(task)
    click.echo(f"exported {total} claims", err=True)


@contextlib.contextmanager
def _rereadable(source: str, spool_dir: Path) -> Iterator[IO[bytes]]:
    """SOURCE opened for reading twice (seek to 0 in between). Standard input cannot be: it is
    copied to an unnamed temporary file on disk first, beside the data directory when it can be
    (a tmpfs /tmp would hold it in memory)."""
    if source != "-":
        with open(source, "rb") as f:
            yield f
        return
    with tempfile.TemporaryFile(dir=spool_dir if spool_dir.is_dir() else None) as spool:
        shutil.copyfileobj(stdin("claims"), spool)
        spool.seek(0)
        yield spool


@main.command("import")
@click.argument("source", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option(
    "--register-signers",
    is_flag=True,
    help="Trust the file's signers: register unknown ones (weight 1, may link).",
)
@settings_options
@reports_errors
def import_command(
    source: str, register_signers: bool, config_file: str | None, data_dir: str | None
) -> None:
    """Verify every claim of SOURCE (JSON lines or an array; - is stdin), then ingest them as
    the node would. Nothing is written if any claim fails; each failure is listed with its line.

    JSON lines are streamed twice (verify, then ingest): memory stays flat whatever the size.
    Into a node only (`metanode init` makes one): a data directory that holds none, a mistyped
    --data-dir, is refused (no_node) rather than made, so the claims never go astray."""
    settings = node_settings(config_file, data_dir)
    with _rereadable(source, settings.data_dir.resolve().parent) as f:
        try:
            with logs.progress_bar() as bar:
                task = bar.add_task("verifying", total=None)
                check = maintenance.validate_import(
                    jsonl.read(f), settings, register_signers, lambda n: bar.advance(task, n)
                )
        except InvalidBatch as exc:
            _list_failures(exc)
        f.seek(0)
        with logs.progress_bar() as bar:
            task = bar.add_task("importing", total=check.claims)
            counts = maintenance.import_claims(
                settings, jsonl.read(f), check, register_signers, lambda n: bar.advance(task, n)
            )
    click.echo(
        f"imported {check.claims} claims: {counts['accepted']} accepted, "
        f"{counts['duplicate']} duplicate, {counts['stale']} stale"
    )


def _list_failures(exc: InvalidBatch) -> NoReturn:
    """The refusal, then below it each kept failure once per reason (`  claims 1, 2, 5:
    unknown_signer: …`: one unregistered signer was a hundred lines), how many more there
    were, and the way out of an unknown signer; exit 2."""
    click.echo(f"error: {exc.slug}: {exc.message}", err=True)
    lines: dict[tuple[str, str], list[str]] = {}
    for item in exc.items:
        lines.setdefault((item["error"], item["message"]), []).append(str(item["position"]))
    for (slug, message), positions in lines.items():
        shown = ", ".join(positions[:8]) + (f", … ({len(positions)})" if positions[8:] else "")
        claims_word = "claim" if len(positions) == 1 else "claims"
        click.echo(f"  {claims_word} {shown}: {slug}: {message}", err=True)
    if exc.total > len(exc.items):
        click.echo(f"  … and {exc.total - len(exc.items)} more", err=True)
    if any(slug == "unknown_signer" for slug, _ in lines):
        click.echo(
            "  register each signer first (`metanode signers add UID --weight W`), or trust "
            "every signer of the file with --register-signers",
            err=True,
        )
    if any(slug == "link_not_permitted" for slug, _ in lines):  # known, so not registered
        click.echo(
            "  a signer whose cids/ votes may link groups is given that first (`metanode "
            "signers add UID --may-link`)",
            err=True,
        )
    sys.exit(2)
