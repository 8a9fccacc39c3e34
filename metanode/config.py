"""Settings, declared once as data.

Every setting is one field of `Settings` with its default and help text. Values come from, in
rising precedence: the default, the TOML file (`metanode.toml` in the working directory, or the
file named by `--config` / `METANODE_CONFIG`), the environment (`METANODE_<NAME>`, upper case),
then command-line flags. Every setting has a working default, so `metanode serve` needs none.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from metanode.errors import InvalidRequest, WatchRootsDamaged
from metanode.merge import MAX_WEIGHT

ENV_PREFIX = "METANODE_"
POSTGRESQL_SCHEMES = ("postgresql://", "postgres://")
DEFAULT_CONFIG_FILE = "metanode.toml"
# `METANODE_*` names that are not settings: the config file's, and the client commands' (cli.py).
OTHER_ENV_NAMES = frozenset({"CONFIG", "URL", "TOKEN"})


UNBOUNDED = float("inf")


def setting(default: Any, help: str, low: float | None = None, high: float = UNBOUNDED) -> Any:
    """One setting: its default, its help text and, for a number, its range [`low`, `high`]
    (every number has one: a value outside is refused at start, naming the setting, rather
    than a node that answers nothing, spins on a core or crashes later)."""
    return field(default=default, metadata={"help": help, "low": low, "high": high})


SECONDS = 0.001  # the shortest wait a `_s` setting takes: 0 would spin a core


@dataclass(frozen=True)
class Settings:
    host: str = setting(
        "127.0.0.1", "Address the HTTP server binds (0.0.0.0: every interface; never empty)."
    )
    port: int = setting(9000, "TCP port of the HTTP server.", low=1, high=65535)
    workers: int = setting(
        0,
        "Processes `metanode serve` serves with: 0, one a core it may run on (its CPU "
        "affinity: `taskset`, a container's cpuset), but no more than one per 512 MiB of the "
        "memory it may use (the machine's, or its cgroup's limit: a container's `--memory`); 1, "
        "one process (the simple mode). One owns the writers and the applier, the others serve "
        'reads and hand everything else to it (docs/architecture.md, "Workers"; '
        'docs/operations.md, "Small boxes").',
        low=0,
        high=256,
    )
    max_header_bytes: int = setting(
        65_536,
        "Longest request head (request line and headers), in bytes; a longer one is "
        "answered 431 `headers_too_large` and its connection closed.",
        low=1024,
    )
    header_timeout_s: float = setting(
        10.0,
        "Seconds a client has to send a whole request head, from opening the connection "
        "or from its first byte after an idle keep-alive; then 408 `request_timeout` and close.",
        low=SECONDS,
    )
    body_timeout_s: float = setting(
        60.0,
        "Seconds a client has to send a whole request body; then 408 `request_timeout`.",
        low=SECONDS,
    )
    max_connections: int = setting(
        1024,
        "Most HTTP connections (feed subscribers included) or requests in progress at "
        "once; a request beyond it is answered 503 `too_busy`.",
        low=1,
    )
    max_client_connections: int = setting(
        256,
        "Most HTTP connections from one client address at once (a proxy in `trusted_proxies` "
        "excepted); one beyond it is answered 503 `too_busy` and closed, so that one client "
        "cannot hold every connection `max_connections` allows.",
        low=1,
    )
    data_dir: Path = setting(
        Path("./data"),
        "Directory of truth.db, cache.db, the token, keys/; not inside a watch root (WebDAV would "
        "serve them).",
    )
    storage: str = setting(
        "sqlite",
        "Where the truth and the cache live: `sqlite` (truth.db and cache.db in the data "
        "directory) or a PostgreSQL DSN `postgresql://user:password@host:port/database` (schemas "
        "`truth` and `cache` of that database; needs `pip install metanode[postgresql]`; "
        "docs/scale-out.md). The data directory keeps the keys, the token and the lock either way.",
    )
    pg_stall_s: float = setting(
        5.0,
        "On PostgreSQL (`storage`): how long a statement waits for the server's answer before "
        "it is looked into. A read of the event loop is then given up, answered 503 "
        "`storage_unavailable`; a write is given up once the server does not answer a new "
        "connection either (`pg_connect_timeout_s`), so a write that is only slow (waiting for "
        "another replica's write lock, up to 30 s) goes on; so is a pooled read (an export). "
        "Once one connection finds the server silent, every connection fails 503 at once "
        "until it answers a probe again. A stopped or frozen server "
        "(SIGSTOP, a host or network that drops everything) would hold them for ever "
        '(docs/scale-out.md, "Connections").',
        low=0.1,
        high=3600,
    )
    pg_connect_timeout_s: int = setting(
        5,
        "On PostgreSQL: whole seconds a new connection may take (libpq's `connect_timeout`, "
        "at least 2), and a read of its own waits for a connection of the pool; past it, "
        "503 `storage_unavailable`.",
        low=2,
        high=3600,
    )
    accept_unknown_signers: bool = setting(
        False, "Accept claims from signers that are not registered (they are registered on use)."
    )
    max_value_bytes: int = setting(65_536, "Largest claim value, in UTF-8 bytes.", low=1)
    max_skew_ms: int = setting(
        300_000, "How far ahead of this node's clock a claim's ts may be.", low=0
    )
    max_batch_claims: int = setting(1_000, "Most claims in one POST /api/claims batch.", low=1)
    max_batch_bytes: int = setting(
        4 * 1024 * 1024, "Largest POST /api/claims body, in bytes.", low=1024
    )
    apply_wait_s: float = setting(
        5.0, "How long POST /api/claims waits for the cache before answering 202.", low=0
    )
    apply_poll_s: float = setting(
        1.0,
        "How often the applier looks for truth changes made by other processes (the CLI).",
        low=SECONDS,
    )
    cache_fsync: bool = setting(
        False,
        "Make every cache.db commit durable by itself (an fsync, as every truth.db commit "
        "is). Off, a cache commit survives a crash of metanode but maybe not of the machine: "
        "after a power loss or a kernel crash while metanode ran, the cache is rebuilt from the "
        "truth under a new feed epoch (subscribers get a gap, then a snapshot). Off is about "
        'a fifth faster at one claim a request (docs/benchmarks.md, "Session 24"). No claim '
        "is ever lost either way.",
    )
    hot_documents: int = setting(
        10_000,
        "GET /api/meta documents (without ?as=) each serving process keeps in memory, the "
        "most recently read (about a kilobyte each); 0: none, every read is one cache.db "
        "lookup. Emptied whenever the cache commits. Not used on PostgreSQL, whose every read "
        'asks the server (docs/benchmarks.md, "Hot documents", "Session 25").',
        low=0,
    )
    verify_processes: int = setting(
        1,
        "Worker processes beside the server that validate large POST /api/claims batches "
        "(64 claims or more), started at the first one; 0: none, every batch is validated on "
        "the server's threads. In a process of its own, validation does not hold the GIL the "
        "writers need; one validates more claims a second than the writers commit, and a "
        'second takes a core from them (docs/benchmarks.md, "One verify process, not two").',
        low=0,
        high=256,
    )
    feed_keep_alive_s: float = setting(
        15.0, "Seconds of silence after which the feed sends a `: keep-alive` comment.", low=SECONDS
    )
    feed_stall_s: float = setting(
        60.0,
        "Seconds a change-feed client may take no byte of its stream while bytes wait for it "
        "(its connection's buffers full); then it is disconnected, to resume from its last id.",
        low=SECONDS,
    )
    feed_retention_events: int = setting(
        100_000, "The feed keeps at most the newest N events.", low=1
    )
    feed_retention_days: float = setting(7.0, "The feed keeps no event older than this.", low=0)
    feed_prune_s: float = setting(
        60.0,
        "How often retention is enforced (feed events, and the truth's outbox rows the "
        "cache has applied), in seconds.",
        low=SECONDS,
    )
    watch_enabled: bool = setting(True, "Run the watcher inside `metanode serve`.")
    watch_roots: tuple[str, ...] = setting(
        ("./media",),
        "Folders to watch (made if missing, unless files were known there: a disk not mounted "
        "keeps its files, docs/watcher.md; one that cannot be made, a file of its name, is a "
        "warning in the log and in /health a folder it cannot read, the other roots watched), "
        "each folder once (a root may lie inside another); in the environment, `:`-separated. "
        "Set neither in the file nor in the environment, the owner chooses them on the Files "
        "page (`<data dir>/watched-folders.json`, read at every start; one of those missing is "
        "shown missing, never made).",
    )
    watch_ignore: tuple[str, ...] = setting(
        (), "Extra name or path globs to ignore (comma-separated in the environment)."
    )
    watch_follow_symlinks: bool = setting(False, "Follow symbolic links to files and folders.")
    watch_settle_s: float = setting(
        2.0, "A file is hashed once its size and mtime stayed unchanged this long.", low=0
    )
    watch_rescan_s: float = setting(
        600.0, "Full rescan period, for network mounts and missed events (0: never).", low=0
    )
    watch_hash_workers: int = setting(
        2, "Files hashed at once, off the event loop.", low=1, high=256
    )
    watch_min_size: int = setting(
        1,
        "Smallest file fingerprinted, in bytes: smaller files are not content (every empty "
        "file has the same midhash) and get no record.",
        low=1,
    )
    plugins_enabled: bool = setting(True, "Run plugins inside `metanode serve`.")
    plugins_disabled: tuple[str, ...] = setting(
        (), "Names of installed plugins not to run (comma-separated in the environment)."
    )
    plugin_weights: tuple[str, ...] = setting(
        (), "Signer weights of plugins as `name=weight` (comma-separated in the environment)."
    )
    plugin_workers: int = setting(
        1,
        "Runs of one plugin at once, each on its own thread: every plugin has its own queue, so "
        "a slow one holds up only its own files.",
        low=1,
        high=256,
    )
    plugin_timeout_s: float = setting(600.0, "A plugin run taking longer fails.", low=SECONDS)
    plugin_max_attempts: int = setting(
        3, "Attempts of a failing run before it stays failed.", low=1
    )
    plugin_retry_s: float = setting(
        5.0, "First retry delay of a failed run (then 4×, 16×…).", low=0
    )
    owner_weight: int = setting(
        100,
        "Signer weight of the box owner, the key in `keys/owner.key` that signs what a person "
        "fixes on the web page; above every plugin's default, so the owner's word wins.",
        low=0,
        high=MAX_WEIGHT,
    )
    ui_session_hours: float = setting(
        12.0,
        "How long a web page sign-in lasts (the signed session cookie expires after this; "
        "signing out ends it at once).",
        low=SECONDS,
    )
    signin_free_attempts: int = setting(
        5,
        "Wrong tokens a client may try in a row at the web page's sign-in before it must "
        "wait `signin_backoff_s` before its next try, then twice as long after each wrong one "
        "(429 `too_many_attempts`, `Retry-After`).",
        low=1,
    )
    signin_backoff_s: float = setting(
        1.0,
        "The first wait of a client past `signin_free_attempts` wrong tokens at sign-in.",
        low=SECONDS,
    )
    signin_max_backoff_s: float = setting(
        300.0,
        "The longest wait a client that keeps trying wrong tokens at sign-in is given; once "
        "it has tried none for that long, its count starts again.",
        low=SECONDS,
    )
    owner_carry_over: bool = setting(
        True,
        "When a watched file's content changes at the same path (a tag edit, a remux, an "
        "upgrade) and the old content is gone, re-sign the owner's claims about the new content.",
    )
    legacy_writer_weight: int = setting(
        1,
        "Signer weight of the legacy writer, the node's own key that signs MetaMesh `/meta` "
        "writes.",
        low=0,
        high=MAX_WEIGHT,
    )
    trusted_networks: tuple[str, ...] = setting(
        ("127.0.0.0/8", "::1/128"),
        "Client networks (CIDRs, comma-separated in the environment) that reach the MetaMesh "
        "compatibility routes without the token; anyone there can read the library and write "
        "legacy claims (docs/compat.md).",
    )
    trusted_hosts: tuple[str, ...] = setting(
        (),
        "Host names, beyond addresses, `localhost`, names of one label and private ones "
        "(`.lan`, `.local`, `.home.arpa`, `.internal`…), by which clients in trusted_networks "
        "reach the compatibility routes without the token (comma-separated in the "
        "environment); any other name is refused there, as a browser's page may have pointed "
        "it at this box (docs/compat.md).",
    )
    trusted_proxies: tuple[str, ...] = setting(
        (),
        "Reverse proxies (CIDRs, comma-separated in the environment) whose `X-Forwarded-For` "
        "and `X-Forwarded-Proto` are believed; from anyone else the headers are ignored. A "
        "proxy in front needs its address here (docs/operations.md, 'Behind a reverse proxy').",
    )
    root_path: str = setting(
        "",
        "The path a reverse proxy serves the node under (`/metanode` for "
        "`https://home.example/metanode/`; empty: the root of a host or port). Every link, "
        "redirect, cookie and URL the node writes starts with it; the node answers with and "
        "without it (docs/operations.md, 'Under a sub-path').",
    )
    metamesh_files_path: str = setting(
        "/files",
        "Where MetaMesh consumers mount the files (their FILES_PATH): the MetaMesh routes give "
        "a record's `filePath` as this folder, then its WebDAV path "
        "(`/files/media/films/film.mkv`), as meta-sort writes and compares it (docs/compat.md).",
    )
    metamesh_volume: str = setting(
        "",
        "The MetaMesh shared volume, the consumers' META_CORE_PATH (e.g. `/meta-core`; empty: "
        "none): `serve` writes `locks/kv-leader.info` there naming this node's URL, as "
        "meta-core did, and leaves it there at stop (a consumer takes any change to it for a "
        "new core); meta-sort, meta-fuse and meta-stremio builds "
        "without discovery find the core only by it; `/api/services` lists the services "
        "registered in its `services/` folder (docs/compat.md).",
    )
    webdav_plugin_writes: bool = setting(
        False,
        "Let WebDAV clients write plugin outputs under `/webdav/plugin/` (PUT, MKCOL, DELETE, "
        "MOVE, COPY), into `webdav_plugin_dir`, which is then watched as well (a poster is "
        "found by its CID); the watch roots stay read-only.",
    )
    webdav_put_max_bytes: int = setting(
        256 * 1024 * 1024,
        "Largest body of a WebDAV PUT under `/webdav/plugin/`, in bytes: a longer one is "
        "answered 413 `too_large` and nothing of it kept (a PUT's body may stand still for "
        "`body_timeout_s` at most).",
        low=1,
    )
    webdav_plugin_dir: str = setting(
        "",
        "Folder of the plugin outputs written over WebDAV (empty: `plugin` in the data "
        "directory); it may not be inside a watch root nor hold one.",
    )
    peer_poll_s: float = setting(
        1.0,
        "Seconds a peer follower waits, once caught up, before asking the peer's claim log "
        "again: how soon a claim made on a peer is here (docs/peers.md).",
        low=SECONDS,
    )
    peer_page_claims: int = setting(
        1_000,
        "Claims asked for per page of a peer's claim log (a page holds at most 1,000).",
        low=1,
        high=1_000,  # api.MAX_PAGE: a peer refuses a larger `limit`
    )
    peer_retry_s: float = setting(
        1.0, "First wait after a failed pull from a peer (then doubled each failure).", low=SECONDS
    )
    peer_max_backoff_s: float = setting(
        60.0, "Longest wait between failed pulls from a peer.", low=SECONDS
    )
    peer_timeout_s: float = setting(
        30.0,
        "Seconds a request to a peer may take, its whole answer included (a peer sending a "
        "byte at a time is given up then).",
        low=SECONDS,
    )
    log_level: str = setting("info", "Log level: debug, info, warning, error, critical.")
    log_access: bool = setting(
        False, "Log one line per HTTP request (costs about a fifth of the read rate)."
    )
    # Not a setting: where `watch_roots` was set ("" when neither the TOML file nor the
    # environment sets it: the folders are then the owner's to choose on the page, kept in
    # `WATCHED_FOLDERS` of the data directory). Made by `load`.
    watch_roots_from: str = field(default="", compare=False, metadata={"internal": True})
    # Not a setting: why `WATCHED_FOLDERS` could not be read ("" when it could, or there is
    # none), `watch_roots` then empty. Made by `load`, which refuses nothing for it: only what
    # needs the folders does (`require_roots`), so `signers list` or `backup` still work.
    watch_roots_damaged: str = field(default="", compare=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        for each in FIELDS.values():
            _in_range(each, getattr(self, each.name))
        if self.log_level.lower() not in LOG_LEVELS:
            raise InvalidRequest(
                f"setting log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
            )
        if not self.host.strip():
            # uvicorn binds every interface for "": an unset variable in a compose file
            # (`METANODE_HOST=${HOST}`) put the node on the network without a word
            raise InvalidRequest(
                "setting host: empty; give the address to listen on (127.0.0.1: this machine "
                "only; 0.0.0.0: every interface)"
            )
        _ = self.plugin_weight_map
        networks("trusted_networks", self.trusted_networks)
        networks("trusted_proxies", self.trusted_proxies)
        check_root_path(self.root_path)
        if self.storage != "sqlite" and not self.postgresql:
            raise InvalidRequest(
                "setting storage: must be `sqlite` or a PostgreSQL DSN "
                "(postgresql://user@host:port/database)"
            )
        self._check_roots()
        if self.webdav_plugin_writes:
            self._check_plugin_outputs()

    def _check_roots(self) -> None:
        """One folder named twice (spelt two ways, or through a link) would be scanned twice
        and served under two WebDAV names (`media`, `media-2`): refused. A root inside another
        is allowed (its files are served below the deeper root, webdav.Roots). A data
        directory inside a root is refused: WebDAV and `POST /file/cid` served its `api-token` and
        `keys/owner.key` to every trusted address, and the watcher fingerprinted them."""
        seen: dict[str, str] = {}
        data = os.path.realpath(self.data_dir)
        for root in self.watch_roots:
            real = os.path.realpath(root)
            if real in seen:
                raise InvalidRequest(
                    f"setting watch_roots: {root!r} is the folder {seen[real]!r} again"
                )
            seen[real] = root
            if os.path.commonpath([data, real]) == real:
                raise InvalidRequest(
                    f"setting data_dir: {str(self.data_dir)!r} lies inside the watch root "
                    f"{root!r}, whose files WebDAV serves to trusted networks without the token "
                    "(the API token, the keys): keep the data directory outside every watch root"
                )

    def _check_plugin_outputs(self) -> None:
        """Writes over WebDAV must never reach the media: refuse an outputs folder that is a
        watch root, lies inside one or holds one."""
        outputs = os.path.realpath(self.plugin_outputs)
        for root in self.watch_roots:
            real = os.path.realpath(root)
            if os.path.commonpath([outputs, real]) in (outputs, real):
                raise InvalidRequest(
                    f"setting webdav_plugin_dir: {str(self.plugin_outputs)!r} overlaps the "
                    f"watch root {root!r}; WebDAV writes may not reach the media"
                )

    @property
    def plugin_weight_map(self) -> dict[str, int]:
        """`plugin_weights` (`name=weight`) as a map, or the error naming the bad pair."""
        weights: dict[str, int] = {}
        for pair in self.plugin_weights:
            name, _, number = pair.partition("=")
            if not name or not number.isascii() or not number.isdigit():
                raise InvalidRequest(f"setting plugin_weights: {pair!r} is not name=weight")
            if int(number) > MAX_WEIGHT:
                raise InvalidRequest(
                    f"setting plugin_weights: {pair!r}: a weight is at most {MAX_WEIGHT}"
                )
            weights[name] = int(number)
        return weights

    @property
    def trusted(self) -> tuple[Network, ...]:
        """`trusted_networks`, parsed (checked when the settings were made)."""
        return networks("trusted_networks", self.trusted_networks)

    @property
    def proxies(self) -> tuple[Network, ...]:
        """`trusted_proxies`, parsed."""
        return networks("trusted_proxies", self.trusted_proxies)

    @property
    def serve_url(self) -> str:
        """The address `serve` listens on, as a URL: an IPv6 one in brackets (`http://::1:9000`
        was no URL)."""
        return http_url(self.host, self.port)

    @property
    def page_url(self) -> str:
        """`serve_url` with `root_path`: where the node's own page is (the node answers under
        the prefix too)."""
        return self.serve_url + self.root_path

    @property
    def client_url(self) -> str:
        """Where a client on this machine reaches the node these settings serve: a wildcard
        bind address (`0.0.0.0`, `::`) is asked on loopback."""
        return local_url(self.host, self.port)

    def require_roots(self) -> None:
        """Refuse (`watch_roots_damaged`, naming the file and the way out) what needs the
        watch roots when the list of folders chosen on the page is damaged: a node, `scan`,
        `plugins try`. Watching the default folder in their place would drop the chosen
        folders' files from the library without a word."""
        if self.watch_roots_damaged:
            raise WatchRootsDamaged(self.watch_roots_damaged)

    @property
    def watched(self) -> tuple[str, ...]:
        """The folders the watcher keeps: `watch_roots`, and the plugin outputs' folder when
        WebDAV writes are on, whose files (a poster a MetaMesh plugin wrote) are content as
        well: found by their CID (`/file/{cid}`, `info`), as meta-core's were. Refused when the
        page's list is damaged (`require_roots`)."""
        self.require_roots()
        if self.webdav_plugin_writes:
            return (*self.watch_roots, str(self.plugin_outputs))
        return self.watch_roots

    @property
    def plugin_outputs(self) -> Path:
        """Where WebDAV writes under `/webdav/plugin/` go (`webdav_plugin_dir`)."""
        return Path(self.webdav_plugin_dir) if self.webdav_plugin_dir else self.data_dir / "plugin"

    @property
    def worker_count(self) -> int:
        """`workers`, 0 read as `default_workers` of this machine."""
        return self.workers or default_workers(cores(), memory_bytes())

    @property
    def postgresql(self) -> bool:
        """Whether the stores live on PostgreSQL (`storage` is a DSN)."""
        return self.storage.startswith(POSTGRESQL_SCHEMES)

    @property
    def storage_shown(self) -> str:
        """`storage` for a message or a log line: `sqlite`, or the DSN without its password."""
        return dsn_shown(self.storage) if self.postgresql else "sqlite"

    @property
    def truth_path(self) -> Path:
        return self.data_dir / "truth.db"

    @property
    def cache_path(self) -> Path:
        return self.data_dir / "cache.db"

    @property
    def token_path(self) -> Path:
        return self.data_dir / "api-token"

    @property
    def instance_path(self) -> Path:
        """This data directory's random name among boxes (made at start; not in backups)."""
        return self.data_dir / "instance-id"

    @property
    def session_secret_path(self) -> Path:
        """The key the web page's session cookies are signed with (mode 0600, made at start)."""
        return self.data_dir / "session-secret"

    @property
    def sessions_path(self) -> Path:
        """The web page's live sessions (`ui.Sessions.keep`: ids and CSRF tokens, bearer
        secrets as the token is; mode 0600, not in backups), so a restart signs no one out."""
        return self.data_dir / "ui-sessions.json"

    @property
    def plugins_running_path(self) -> Path:
        """The plugin runs going on now (`plugins.InFlight`): charged at the next start if the
        process ended during them."""
        return self.data_dir / "plugins-running"

    @property
    def keys_dir(self) -> Path:
        return self.data_dir / "keys"


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _in_range(each: dataclasses.Field[Any], value: Any) -> None:
    """A number setting within its range (`setting`'s `low` and `high`), else the error."""
    low, high = each.metadata["low"], each.metadata["high"]
    if low is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"setting {each.name}: {value!r} is not a finite number")
    if not low <= value <= high:
        raise InvalidRequest(f"setting {each.name}: {value!r} is not {_words(low, high)}")


def networks(name: str, texts: tuple[str, ...]) -> tuple[Network, ...]:
    """CIDRs parsed by the stdlib (a bare address is a /32 or /128; host bits are allowed), or
    a clear error naming the setting: a typo must stop the node, not silently trust nobody."""
    parsed = []
    for text in texts:
        try:
            parsed.append(ipaddress.ip_network(text.strip(), strict=False))
        except ValueError as exc:
            raise InvalidRequest(
                f"setting {name}: {text!r} is not a CIDR network ({exc})"
            ) from None
    return tuple(parsed)


# A name of `root_path`: RFC 3986's unreserved characters only, so it is the same percent-encoded
# or not, in a cookie's `Path` and in HTML and JavaScript without any escaping.
ROOT_NAME = re.compile(r"[A-Za-z0-9._~-]+")
# The first name of every path the node serves itself (`api.FAMILIES` and the routes;
# tests/test_config.py keeps the two in step): a `root_path` starting with one would make the
# node's own paths ambiguous, since it answers both with and without the prefix.
SERVED_NAMES = frozenset(
    {
        *("api", "health", "metrics", "openapi.json", "docs", "static"),
        *("records", "live", "files", "plugins", "signers", "status", "signin", "signout"),
        *("meta", "file", "urls", "services", "webdav"),
        *("leader", "role", "neighbors", "data"),  # meta-core's, answered 404 (compat.NOT_SERVED)
    }
)


def check_root_path(root: str) -> None:
    """`root_path` is empty or `/name[/name…]` (no trailing slash, no `.` or `..`, only
    unreserved characters, not a path the node serves itself), else the error saying how to
    write it."""
    if root == "":
        return
    said = f"setting root_path: {root!r}"
    if root == "/":
        raise InvalidRequest(f"{said} is the root of the host: leave root_path empty for that")
    if not root.startswith("/"):
        raise InvalidRequest(f"{said} is not a path: write it as /{root.strip('/')}")
    if root.endswith("/"):
        raise InvalidRequest(f"{said} ends with a slash: write it as {root.rstrip('/')}")
    names = root[1:].split("/")
    for name in names:
        if not ROOT_NAME.fullmatch(name) or name in (".", ".."):
            raise InvalidRequest(
                f"{said}: {name!r} is not a name of a path here (letters, digits, "
                "'-', '.', '_' and '~'; no empty, '.' or '..' one)"
            )
    if names[0] in SERVED_NAMES:
        raise InvalidRequest(
            f"{said} begins with /{names[0]}, a path the node serves itself; choose another name"
        )


def below_root(path: str, root: str) -> str | None:
    """`path` without the `root_path` prefix `root` it starts with (`/metanode/files` →
    `/files`, `/metanode` → `/`), or None when it does not start with it."""
    if path == root:
        return "/"
    if path.startswith(root) and path[len(root)] == "/":
        return path[len(root) :]
    return None


# the settings, without what `load` adds about them (`watch_roots_from`)
FIELDS = {f.name: f for f in dataclasses.fields(Settings) if "internal" not in f.metadata}
# What a value of each type is, in the words of a refusal (Python's `bool`, `int` said little).
_KINDS: dict[Any, str] = {
    bool: "a boolean (true/false, 1/0, yes/no, on/off)",
    int: "a whole number",
    float: "a number",
    tuple: "a list of text",
}


def _convert(name: str, raw: Any) -> Any:
    """Coerce a TOML or environment value to the field's type, or explain why it cannot be."""
    kind: Any = type(FIELDS[name].default)
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(text)
            return text in ("1", "true", "yes", "on")
        if kind is Path:
            return Path(str(raw))
        if kind is tuple:
            return _as_tuple(name, raw)
        if kind in (int, float) and isinstance(raw, bool):  # TOML `port = true` is no 1
            raise ValueError(raw)
        if kind is int and isinstance(raw, float):
            raise ValueError(raw)
        return kind(raw)
    except (TypeError, ValueError):
        what = _KINDS.get(kind, f"a valid {kind.__name__}")
        raise InvalidRequest(f"setting {name}: {raw!r} is not {what}") from None


_LIST_SEPARATORS = {
    "watch_roots": os.pathsep,
    "watch_ignore": ",",
    "plugins_disabled": ",",
    "plugin_weights": ",",
    "trusted_networks": ",",
    "trusted_hosts": ",",
    "trusted_proxies": ",",
}


def _as_tuple(name: str, raw: Any) -> tuple[str, ...]:
    """A list setting from a TOML array, or from an environment string split on its separator."""
    if isinstance(raw, str):
        return tuple(part for part in raw.split(_LIST_SEPARATORS[name]) if part)
    if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
        return tuple(raw)
    raise ValueError(raw)


def load(
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Settings from defaults < TOML file < `METANODE_*` environment < explicit overrides.

    `watch_roots` set by none of them is the folders the owner chose on the page, when any
    were (`page_roots`), else the default; `watch_roots_from` says which of them set it. A
    damaged list of the page's is no refusal here but `watch_roots_damaged`, for what needs
    the folders to refuse (`Settings.require_roots`)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        values.update(_read_toml(Path(path)))
    where = {name: f"the config file {path}" for name in values}
    for name in FIELDS:
        if ENV_PREFIX + name.upper() in env:
            values[name] = env[ENV_PREFIX + name.upper()]
            where[name] = f"the environment ({ENV_PREFIX}{name.upper()})"
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    values.update(given)
    where.update({name: "the command's own settings (its flags)" for name in given})
    converted = {name: _convert(name, raw) for name, raw in values.items()}
    if "watch_roots" in where:
        return Settings(**converted, watch_roots_from=where["watch_roots"])
    try:
        chosen = page_roots(Path(converted.get("data_dir", FIELDS["data_dir"].default)))
    except WatchRootsDamaged as exc:
        return Settings(**converted, watch_roots=(), watch_roots_damaged=exc.message)
    return Settings(**converted) if chosen is None else Settings(**converted, watch_roots=chosen)


WATCHED_FOLDERS = "watched-folders.json"  # in the data directory: the folders the page chose
# WebDAV's top-level collection of plugin outputs (`webdav.PLUGIN`): never a watch root's name
WEBDAV_PLUGIN = "plugin"


def page_roots(data_dir: Path) -> tuple[str, ...] | None:
    """The watch roots the owner chose on the page (`WATCHED_FOLDERS`: `{"roots": [...]}`,
    absolute paths), None when none were ever chosen (the default applies). A file that is
    there and cannot be read as that is `WatchRootsDamaged`: it refuses the start
    (`Settings.require_roots`), since watching the default folder in their place would drop
    the chosen folders' files from the library without a word."""
    return read_roots(data_dir / WATCHED_FOLDERS)


def read_roots(path: Path) -> tuple[str, ...] | None:
    """The roots a list of watched folders at `path` holds (the data directory's, or the copy
    `metanode backup` made of it), None when there is no such file; `WatchRootsDamaged`
    naming it when it is not such a list."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # the data directory's own checks say
        return None  # what is wrong with it, if anything (a file of its name: `file_failed`)
    except (OSError, UnicodeDecodeError) as exc:
        raise WatchRootsDamaged(f"cannot read {path}: {exc}; fix or delete it") from None
    try:
        roots = json.loads(text)["roots"]
    except (ValueError, TypeError, KeyError) as exc:
        raise WatchRootsDamaged(
            f"{path} is not the list of watched folders the page writes ({exc!r}): fix it, or "
            'delete it to watch the default folder (its form: {"roots": ["/srv/media"]})'
        ) from None
    if not isinstance(roots, list) or not all(
        isinstance(r, str) and os.path.isabs(r) for r in roots
    ):
        raise WatchRootsDamaged(f"{path}: roots must be a list of absolute paths; fix or delete it")
    return tuple(roots)


def local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a node listening on `host` and `port`: a wildcard
    address (`0.0.0.0`, `::`) is asked on loopback."""
    return http_url({"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), port)


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _read_toml(path: Path) -> dict[str, Any]:
    """The settings of the TOML file at `path`. UTF-8 with or without the byte-order mark an
    editor may write first (a mark made `port = 9100` an invalid statement); a file in another
    encoding (UTF-16, as Windows' Notepad saves) is refused in words: it was a traceback."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"cannot read config file {path}: not UTF-8 text ({exc.reason} at byte {exc.start}): "
            "save it as UTF-8"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequest(f"cannot read config file {path}: {exc}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        names = ", ".join(name + _guess(name, FIELDS) for name in unknown)
        raise InvalidRequest(f"{path}: unknown setting(s) {names}")
    for name, value in data.items():  # the environment's text is parsed; TOML has types
        kind = _TOML_KINDS.get(type(FIELDS[name].default))
        if kind is not None and isinstance(value, str):
            raise InvalidRequest(
                f"{path}: setting {name}: {value!r} is text, not {kind}: write it without quotes"
            )
    return data


_TOML_KINDS = {bool: "true or false", int: "a number", float: "a number"}


def unknown_environment(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each `METANODE_*` variable that names no setting, with the setting it may
    have meant: a misspelt variable is otherwise ignored without a word, and the default serves."""
    env = os.environ if env is None else env
    known = [name.upper() for name in (*FIELDS, *OTHER_ENV_NAMES)]
    unknown = (n[len(ENV_PREFIX) :] for n in sorted(env) if n.startswith(ENV_PREFIX))
    return [
        f"{ENV_PREFIX}{name} is not a metanode setting; ignored{_guess(name, known, ENV_PREFIX)}"
        for name in unknown
        if name not in known
    ]


def _guess(name: str, known: Iterable[str], prefix: str = "") -> str:
    """` (did you mean PORT?)` when a known name is close to `name`, else nothing."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def describe() -> list[tuple[str, Any, str]]:
    """(name, default, help) of every setting, for `--help` and the docs."""
    return [(f.name, f.default, f.metadata["help"]) for f in FIELDS.values()]


def dsn_shown(dsn: str) -> str:
    """A DSN without its password and its parameters (which may hold one): for messages and
    logs."""
    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{parts.username}@{host}" if parts.username else host
    return urlunsplit(parts._replace(netloc=netloc, query="", fragment=""))


def ranges() -> list[tuple[str, str]]:
    """(name, range in words) of every number setting, as docs/configuration.md lists them."""
    return [
        (f.name, _words(f.metadata["low"], f.metadata["high"]))
        for f in FIELDS.values()
        if f.metadata["low"] is not None
    ]


def _words(low: float, high: float) -> str:
    def number(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    return (
        f"at least {number(low)}" if high == UNBOUNDED else f"from {number(low)} to {number(high)}"
    )


# -- the machine `workers = 0` sizes itself to ---------------------------------------------------

WORKER_MEMORY = 512 << 20  # memory a serving process is allowed by default (`default_workers`)
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_LIMIT, V2_LIMIT = "memory.limit_in_bytes", "memory.max"


def default_workers(cores: int, memory: int | None) -> int:
    """The serving processes of `workers = 0`: one a core, but no more than one per
    `WORKER_MEMORY` of `memory` (None: unknown, not bounded), and at least one. A process costs
    ≈ 40-55 MiB idle and the owner ≈ 130 MiB while it scans a new library, the supervisor ≈ 40
    MiB more (docs/operations.md, "Small boxes"): four of them on a 1 GB Raspberry Pi 4 took
    a third of its memory to serve reads a home box asks one process for."""
    bound = cores if memory is None else min(cores, memory // WORKER_MEMORY)
    return max(1, bound)


def cores() -> int:
    """The cores this process may run on: its CPU affinity (`taskset -c 0`, a container's
    `--cpuset-cpus`), which `os.cpu_count` does not see: it counts the machine's, and under
    `taskset -c 0` on two cores made two workers share the one."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def memory_bytes(proc: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The memory this process may use: the machine's, or less where a cgroup caps it (a
    container's `--memory`, a systemd unit's `MemoryMax`), the lowest limit of its cgroup and
    those above it; None if nothing says."""
    known = [size for size in (_physical_memory(), *cgroup_limits(proc, root)) if size]
    return min(known, default=None)


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that says
        return None


def cgroup_limits(proc: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> list[int]:
    """The memory limits set on this process's cgroup and on each one above it, as
    `/proc/self/cgroup` names them: cgroup v2's `memory.max` (the line `0::<path>`) and v1's
    `memory.limit_in_bytes` (the `memory` controller's line). A path missing below `root` is
    left out, so a container that sees its own cgroup as the root (Docker's cgroup namespace,
    or v1's mount of its own folder) reads its limit from `root` itself."""
    try:
        lines = proc.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            limits += _limits_along(root, path, V2_LIMIT)
        elif "memory" in controllers.split(","):
            limits += _limits_along(root / "memory", path, V1_LIMIT)
    return limits


def _limits_along(base: Path, path: str, name: str) -> list[int]:
    """The limits `name` sets in `base` and in each folder of `path` below it that exists."""
    parts = [part for part in path.split("/") if part]
    folders = (base.joinpath(*parts[:depth]) for depth in range(len(parts) + 1))
    limits = []
    for folder in folders:
        try:
            text = (folder / name).read_text(encoding="ascii").strip()
        except OSError:  # no such cgroup here, or no memory controller in it
            continue
        if text.isdigit():  # "max": no limit
            limits.append(int(text))
    return limits
