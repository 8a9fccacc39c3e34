"""The one exception tree of metanode.

Every rejection the node can give is a subclass of `MetanodeError` carrying its HTTP status, a
stable machine-readable slug and whether retrying can help. The API renders all of them through
one handler into the envelope `{"error": slug, "message": text, "retryable": bool}` (plus any
`extra` fields), so a client can switch on the slug and never parse prose.

The tree, by family:

* `ClaimError` (400): one claim broke a rule of SPEC §2.2 (`invalid_uid`, `invalid_cid`, ...).
* `SignerPolicyError` (403): the claim is well formed but its signer may not make it.
* `RequestError` (400/408/413/414/431): the request itself is malformed, too large or too slow.
* `NotFoundError` (404): nothing is known under that name.
* `AuthError` (401): the perimeter token is missing or wrong; `TooManyAttempts` (429): too many
  wrong ones at sign-in.
* `UnavailableError` (503): the node cannot answer right now; retrying helps. Its
  `StorageError` family says why the disk refused a write (`storage_full`, ...) or a file
  could not be opened (`too_many_open_files`);
  `storage_error()` maps a raw `OSError` into it (`db.storage_error` a database's errors).
  `Unreachable`, raised on the client side (`metanode.client`, the CLI), is one too: no node
  answered at all.
* `NotMetanode` (502, client side): what answered is not a metanode.
* `InternalError` (500): a bug; what no handler turned into one of the above.
* Command line only: `NoNode`, `FileFailed` (a data directory or a path a command cannot use),
  `PluginFailed` (a plugin run by hand raised).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from typing import Any, ClassVar


class MetanodeError(Exception):
    """Base of every error the node reports to a caller."""

    status: ClassVar[int] = 400
    slug: ClassVar[str] = "bad_request"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra

    def envelope(self) -> dict[str, Any]:
        """The JSON body of this error: the envelope plus any extra fields."""
        return {
            "error": self.slug,
            "message": self.message,
            "retryable": self.retryable,
            **self.extra,
        }


# -- one claim is invalid (SPEC §2.2) ------------------------------------------------------------


class ClaimError(MetanodeError):
    """A claim (or an identifier inside one) breaks a validation rule."""


class InvalidClaim(ClaimError):
    slug = "invalid_claim"


class InvalidUid(ClaimError):
    slug = "invalid_uid"


class InvalidCid(ClaimError):
    slug = "invalid_cid"


class NoncanonicalCid(ClaimError):
    """A CID spelled other than CIDv1 base32 lower; `canonical` names the right spelling."""

    slug = "noncanonical_cid"


class InvalidKey(ClaimError):
    slug = "invalid_key"


class ReservedKey(ClaimError):
    slug = "reserved_key"


class InvalidMemberCid(ClaimError):
    slug = "invalid_member_cid"


class InvalidValue(ClaimError):
    slug = "invalid_value"


class InvalidTs(ClaimError):
    slug = "invalid_ts"


class TsInFuture(ClaimError):
    slug = "ts_in_future"
    retryable = True


class BadSignature(ClaimError):
    slug = "bad_signature"


class InvalidRid(ClaimError):
    slug = "invalid_rid"


# -- the signer may not make this claim ---------------------------------------------------------


class SignerPolicyError(MetanodeError):
    status = 403
    slug = "forbidden"


class UnknownSigner(SignerPolicyError):
    slug = "unknown_signer"


class BlockedSigner(SignerPolicyError):
    slug = "blocked_signer"


class LinkNotPermitted(SignerPolicyError):
    slug = "link_not_permitted"


class OwnerKey(SignerPolicyError):
    """The box owner's key is not blocked: it signs what a person fixes on the web page, so
    every edit after would be refused (its words are withdrawn one by one, with Revert)."""

    slug = "owner_key"


# -- the request as a whole ---------------------------------------------------------------------


class RequestError(MetanodeError):
    slug = "bad_request"


class InvalidJson(RequestError):
    slug = "invalid_json"


class InvalidRequest(RequestError):
    slug = "invalid_request"


class InvalidCursor(RequestError):
    """A feed cursor (`Last-Event-ID`, `?since=`) that is not `<epoch>-<seq>` (or `…-<seq>.<n>`)."""

    slug = "invalid_cursor"


class InvalidBatch(RequestError):
    """At least one claim of a batch failed; `items` lists each failure and nothing was written."""

    slug = "invalid_batch"

    def __init__(
        self, items: list[dict[str, Any]], status: int = 400, total: int | None = None
    ) -> None:
        """`total` counts every failure when `items` keeps only the first of them."""
        self.total = len(items) if total is None else total
        super().__init__(f"{self.total} claim(s) rejected; nothing was written", items=items)
        self.items = items
        self.status = status  # type: ignore[misc]  # 400, or 403 when only signer policy failed


class TooLarge(RequestError):
    status = 413
    slug = "too_large"


class PathTooLong(RequestError):
    """A WebDAV path longer than a file system takes (a name over 255 bytes, a path over 4,096),
    or deeper or longer than a plugin output may be: refused before the file system is asked."""

    status = 414
    slug = "path_too_long"


class HeadersTooLarge(RequestError):
    """The request line and headers passed `max_header_bytes` before they ended; the server
    answers this itself, before the app, and closes the connection."""

    status = 431
    slug = "headers_too_large"


class RequestTimeout(RequestError):
    """The client sent its headers or body too slowly (`header_timeout_s`, `body_timeout_s`);
    the connection is closed after the answer."""

    status = 408
    slug = "request_timeout"
    retryable = True


class TooComplex(RequestError):
    """The request asks more than the database runs as one statement: PostgreSQL's program
    limits (SQLSTATE class 54; 54001 "stack depth limit exceeded" for a library search of
    15,000 characters of an unspaced script, measured, where 10,000 ran). Was a 500; not an
    outage, so not retryable: the same request fails again, a smaller one works."""

    slug = "too_complex"


class InvalidKeyFile(RequestError):
    """A key file that holds no key: empty, cut short, not one, a bad seed, a uid not its own."""

    slug = "invalid_key_file"


class KeyFileExposed(RequestError):
    """A key file other users of the machine may read (`keys.exposure`): a warning on stderr
    (`warning: key_file_exposed: …`) of `metanode claim sign`, which signs all the same."""

    slug = "key_file_exposed"


class DeprecatedField(RequestError):
    """A MetaMesh `/meta` write of a removed per-algorithm CID field (`cid_*`, `midhash256`,
    `canonical_cid`); the writer should send `cids/<cid>` = "true" instead (docs/compat.md)."""

    slug = "deprecated_field"


# -- nothing under that name --------------------------------------------------------------------


class NotFoundError(MetanodeError):
    status = 404
    slug = "not_found"


class UnknownCid(NotFoundError):
    slug = "unknown_cid"


class UnknownRid(NotFoundError):
    slug = "unknown_rid"


class Merged(NotFoundError):
    """The rid was merged into an older one; `survivor` names it."""

    slug = "merged"


class UnknownSignerUid(NotFoundError):
    slug = "unknown_signer"


class Forbidden(MetanodeError):
    """What no one may do to this target (WebDAV: the plugin outputs' folder copied or moved
    into itself, or replaced by a MOVE or COPY); `SignerPolicyError`'s refusals share the
    slug."""

    status = 403
    slug = "forbidden"


class MethodNotAllowed(MetanodeError):
    status = 405
    slug = "method_not_allowed"


class UploadInProgress(MetanodeError):
    """A WebDAV MOVE, COPY or DELETE below `plugin/` would move, delete or replace a file whose
    PUT's body is still coming (423 Locked, RFC 4918 §11.3): asked again once the PUT is
    answered, it is done. A folder moved away under an upload made the PUT a 500 and left
    its hidden `.part` behind for good."""

    status = 423
    slug = "upload_in_progress"
    retryable = True


# -- perimeter ----------------------------------------------------------------------------------


class Unauthorized(MetanodeError):
    status = 401
    slug = "unauthorized"


class TooManyAttempts(MetanodeError):
    """A client signed in to the web page with a wrong token too often in a row
    (`signin_free_attempts`): it waits `retry_after` seconds (sent as `Retry-After`) before its
    next try, the right token included (docs/ui.md, "Signing in")."""

    status = 429
    slug = "too_many_attempts"
    retryable = True
    retry_after = 1  # seconds, sent as `Retry-After`: each refusal says its own

    def __init__(self, message: str, retry_after: int = 1, **extra: Any) -> None:
        super().__init__(message, **extra)  # as every error: extra fields, rebuilt elsewhere
        self.retry_after = retry_after


class CsrfRefused(MetanodeError):
    """A state-changing request made with the web page's session cookie, without the
    session's CSRF token or from another site's page (docs/api.md, "The session cookie")."""

    status = 403
    slug = "csrf_refused"


class PeerTokenScope(MetanodeError):
    """A peer token (`metanode peers token create`) used on a route outside its read-only
    scope: the claim log, reconciliation and `/api/meta/*` (docs/peers.md)."""

    status = 403
    slug = "peer_token_scope"


# -- the watched folders (docs/watcher.md, "Choosing the folders on the page") --------------------


class WatchRootRefused(RequestError):
    """A folder the owner asked to watch (`POST /api/watch-roots`, the Files page) that cannot
    be one; each reason its own slug below, the message naming the folder."""

    slug = "watch_root_refused"


class WatchRootMissing(WatchRootRefused):
    slug = "watch_root_missing"


class WatchRootNotFolder(WatchRootRefused):
    slug = "watch_root_not_folder"


class WatchRootUnreadable(WatchRootRefused):
    slug = "watch_root_unreadable"


class WatchRootDataDir(WatchRootRefused):
    """The folder is the data directory, lies inside it or holds it: WebDAV would serve the
    token and the keys, and the watcher fingerprint them (the rule `watch_roots` has)."""

    slug = "watch_root_data_dir"


class WatchRootPluginOutputs(WatchRootRefused):
    """The folder is the plugin outputs' folder, lies inside it or holds it, while WebDAV
    writes are on: the writes would reach the media (the rule `webdav_plugin_dir` has, which
    refused the next start instead)."""

    slug = "watch_root_plugin_outputs"


class WatchRootTaken(WatchRootRefused):
    """The folder is watched already (spelt another way, or through a link)."""

    status = 409
    slug = "watch_root_taken"


class UnknownWatchRoot(NotFoundError):
    slug = "unknown_watch_root"


class WatchRootsFromSettings(MetanodeError):
    """`watch_roots` is set in the config file or the environment: the page shows the folders
    but changes them there only, so that a change of the file is never silently overridden."""

    status = 409
    slug = "watch_roots_from_settings"


class WatchRootsDamaged(MetanodeError):
    """The data directory's list of the folders chosen on the page cannot be read: refused at
    start rather than watching the default folder in their place."""

    slug = "watch_roots_damaged"


# -- peers (docs/peers.md) ----------------------------------------------------------------------


class UnknownPeer(NotFoundError):
    slug = "unknown_peer"


class PeerFailed(MetanodeError):
    """A peer could not be pulled from: no answer, a refusal, or an answer that is not a
    metanode's claim log. Shown as the peer's last error; the follower retries with backoff."""

    status = 502
    slug = "peer_failed"
    retryable = True


class PeerAnswerTooLarge(PeerFailed):
    """A peer's answer is larger than a follower reads (`peers.ANSWER_BYTES`): a log page or a
    fetch is asked again in smaller pieces, anything else is a failure, backed off."""


class PeerAnswerCut(PeerFailed):
    """A peer's answer did not come whole: not within `peer_timeout_s`, or its connection broke
    halfway. A failure, backed off; what the follower asks at once is halved for the next try
    (`peers.Asking`): over a slow link a page that cannot come within the timeout was asked
    again whole, for ever."""


class PeerCannotReconcile(PeerFailed):
    """The peer has no reconciliation route (an older version): its log is read from the start
    instead. Only this, not a peer that is down or refuses the token, falls back so."""


class PeerCursorRefused(PeerFailed):
    """The peer refused this box's cursor into its log (`invalid_cursor`): its log is another
    than the one the cursor was taken in (restored from a backup, or another box answers at
    the address). The follower reconciles again, as a new peer does, and reads on from there."""


class PeerIsSelf(PeerFailed):
    """The peer's answers carry this box's own instance id: its address is this box. Polled,
    it would be for ever (its claims are this box's own); `peers add` refuses it, and a
    follower of one (an address that came to name this box) stops."""


# -- the node cannot answer now -----------------------------------------------------------------


class UnavailableError(MetanodeError):
    status = 503
    slug = "unavailable"
    retryable = True
    retry_after: ClassVar[int] = 1  # seconds, sent as `Retry-After`


class CacheNotReady(UnavailableError):
    slug = "cache_not_ready"


class TooBusy(UnavailableError):
    """More than `max_connections` connections or requests at once; answered by the server
    before the app."""

    slug = "too_busy"


class ShuttingDown(UnavailableError):
    slug = "shutting_down"


class ClockBehind(UnavailableError):
    """A signer this node holds the key of (the owner, the legacy writer, a plugin) cannot date
    a new claim so that it counts: this box's clock reads before 2000, or is behind that
    signer's own newest word on the key by more than the skew the node accepts. `valid_from`:
    the clock reading from which it can (milliseconds since the epoch)."""

    slug = "clock_behind"
    retry_after = 60


# -- the node could not be asked (`metanode.client` and the command line) ----------------------


class Unreachable(UnavailableError):
    """No node answered at the address: the connection was refused, timed out, or the host is
    unknown."""

    slug = "unreachable"


class AnswerTimedOut(UnavailableError):
    """The node took the request but did not answer within the client's time: it may still be
    doing it (a `peers sync` of a large box)."""

    slug = "answer_timed_out"


class NotMetanode(MetanodeError):
    """Something answered at the address, but not a metanode: not its JSON, not its envelope."""

    status = 502
    slug = "not_metanode"


class StorageError(UnavailableError):
    """The data directory failed a read or (mostly) a write; a failed transaction wrote nothing.

    Retryable: the same request succeeds once the operator has freed space, remounted or
    unlocked; the node probes and reports in `/health` meanwhile (docs/operations.md).
    """

    slug = "storage_error"
    retry_after = 5  # a disk is not freed within a second


class StorageFull(StorageError):
    slug = "storage_full"


class StorageReadOnly(StorageError):
    """The file system is read-only, or the data directory is not writable by this user."""

    slug = "storage_read_only"


class StorageIOError(StorageError):
    slug = "storage_io_error"


class StorageUnavailable(StorageError):
    """The database server (PostgreSQL, `storage`) cannot be reached or dropped the connection;
    the node reconnects by itself once it answers again."""

    slug = "storage_unavailable"
    retry_after = 1


class StorageRefused(StorageError):
    """The database server refused the login itself (no such user, a wrong password, no such
    database, no `pg_hba.conf` entry): not an outage, so asking again does not help until the
    operator mends `storage` or the server's roles."""

    slug = "storage_refused"
    retryable = False


class StorageCorrupt(StorageError):
    """A database file is damaged (SQLite: "database disk image is malformed", "file is not a
    database"): asking again does not help. The cache is rebuilt from the truth
    (`metanode rebuild-cache`); a damaged truth is put back from a backup (`metanode restore`)."""

    slug = "storage_corrupt"
    retryable = False


class StorageLocked(StorageError):
    """Another connection held the database lock for longer than the busy timeout."""

    slug = "storage_locked"


class OutOfFiles(StorageError):
    """The process (EMFILE: its open-file limit, `ulimit -n`) or the system (ENFILE) had no file
    descriptor to spare for a file of the data directory. SQLite says only "unable to open
    database file" (SQLITE_CANTOPEN), which read as `storage_read_only` and sent an operator to
    a disk that was fine; the way out is a higher limit, or fewer connections held open."""

    slug = "too_many_open_files"


_ERRNO_STORAGE: dict[int, type[StorageError]] = {
    errno.ENOSPC: StorageFull,
    errno.EDQUOT: StorageFull,
    errno.EROFS: StorageReadOnly,
    errno.EACCES: StorageReadOnly,
    errno.EPERM: StorageReadOnly,
    errno.EIO: StorageIOError,
    errno.EMFILE: OutOfFiles,
    errno.ENFILE: OutOfFiles,
}


def shown(value: object, limit: int = 100) -> str:
    """`value` as an error message quotes it: its repr, cut to `limit` characters with its full
    length said, so a megabyte of bad input is not echoed back a megabyte long."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value):,} characters)" if isinstance(value, str) else ""
    return f"{clipped(text, limit)}{size}"


def clipped(text: str, limit: int = 100) -> str:
    """`text` cut to `limit` characters: a library's own words about bad input (which may
    quote some of it) in a message of ours."""
    return text if len(text) <= limit else f"{text[:limit]}…"


def storage_error(exc: BaseException, where: object = None) -> StorageError | None:
    """The typed error for a failed file operation (by errno), or None when `exc` is something
    else that must not be mistaken for a full disk. `where` names the file when the error itself
    does not. (A database's own errors are mapped by the stores: `db.storage_error`.)"""
    if not isinstance(exc, OSError) or exc.errno is None:
        return None
    kind = _ERRNO_STORAGE.get(exc.errno)
    if kind is None:
        return None
    hint = _hint(exc.errno)
    return kind(
        f"the data directory failed: {exc.filename or where}: {exc.strerror}{hint}"
        if exc.filename or where
        else f"the data directory failed: {exc.strerror}{hint}"
    )


def _hint(code: int) -> str:
    """What an operator does about the failure `code` (an errno), when its name alone misleads."""
    if code in _DENIED:
        return PERMISSION_HINT.format(uid=os.geteuid())
    if code in OUT_OF_FILES:
        return out_of_files_hint(code)
    return ""


def out_of_files(exc: OSError, path: object) -> OutOfFiles:
    """`OutOfFiles` for a watched file (not one of the data directory) that `exc` (EMFILE or
    ENFILE) kept from being opened: a client that was told 404 or 500 took it for missing."""
    code = exc.errno if exc.errno is not None else errno.EMFILE
    return OutOfFiles(f"cannot open {path}: {exc.strerror}{out_of_files_hint(code)}")


def out_of_files_hint(code: int) -> str:
    """The way out of `code` (EMFILE: this process's limit, named with its value; ENFILE: the
    system's)."""
    if code == errno.ENFILE:
        return (
            "; the system as a whole has no file descriptor to spare (`fs.file-max`): raise "
            "it (`sysctl fs.file-max`) or stop what holds them (docs/operations.md, "
            "'Connections and slow clients')"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (
        f"; this process holds every file descriptor its open-file limit allows ({soft}; "
        f"hard limit {hard}): raise it (`ulimit -n`, systemd's `LimitNOFILE=`, Docker's "
        "`--ulimit nofile=`) or lower `max_connections` (docs/operations.md, 'Connections and "
        "slow clients')"
    )


# No file descriptor to spare: in this process (EMFILE: `ulimit -n`) or in the system (ENFILE).
# A file that cannot be opened for that is not unreadable (the watcher skipped such files as
# unreadable until they changed: a burst of connections holding every descriptor left each file
# added meanwhile out of its record for good), nor on a read-only disk (`OutOfFiles`).
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)
_DENIED = (errno.EACCES, errno.EPERM)
# what a file of the data directory it may not open needs (a `chmod 000`, a `sudo` copy owned by
# root): said, where `Permission denied` alone sent a reader to a full or read-only disk
PERMISSION_HINT = (
    "; the data directory and every file in it must be the user's metanode runs as (uid {uid}) "
    "and readable and writable by it: `chown -R` them to it (modes: docs/operations.md, "
    "'Permissions')"
)


class CannotListen(MetanodeError):
    """`serve` cannot take its address (another server holds the port, no such interface):
    said before anything claims the node is serving."""

    status = 503
    slug = "cannot_listen"


class SchemaTooNew(MetanodeError):
    """A database a newer metanode migrated: this version cannot read it and does not guess
    (docs/operations.md, "Upgrading": a backup taken before the upgrade goes back)."""

    status = 503
    slug = "schema_too_new"


class OwnerMismatch(MetanodeError):
    """The truth belongs to another owner key than the data directory's `keys/owner.key`: a
    replica given a fresh data directory (`init` instead of a copy), or a truth restored
    without its keys. Refused at start: the node would register a second `owner` whose
    edits compete with the first's, and plugin signers anew (docs/scale-out.md)."""

    status = 409
    slug = "owner_mismatch"


class NoNode(MetanodeError):
    """A command that reads a node's data was given a data directory that holds none (a
    mistyped `--data-dir`): refused, rather than made anew and reported on as empty."""

    status = 404
    slug = "no_node"


class TruthMissing(MetanodeError):
    """truth.db is missing or empty in a data directory that held a node (its cache.db, its
    instance id): a start would have begun an empty truth in its place, serving no claims and
    rebuilding the cache from none, as if the box were new (a careless `rm`, a card that lost
    the file). Refused until it is put back, or `metanode init` says to start over."""

    status = 409
    slug = "truth_missing"


class PluginFailed(MetanodeError):
    """A plugin run by hand (`metanode plugins try`) raised: its error, with the line of its
    code that raised. (The node records a failed run instead: GET /api/plugins.)"""

    status = 500
    slug = "plugin_failed"


class FileFailed(MetanodeError):
    """A file or folder named to a command (`--out`, `--data-dir`, a backup's folder) cannot be
    used as asked: missing, not a folder, a name too long, already there. What a full,
    read-only or forbidden disk gives is a `StorageError` instead (`storage_error`)."""

    status = 400
    slug = "file_failed"

    @classmethod
    def of(cls, exc: OSError) -> FileFailed:
        if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
            return cls("; ".join(str(why) for *_, why in exc.args[0]))  # a tree copy's files
        where = f"{exc.filename}: " if exc.filename else ""
        return cls(f"{where}{exc.strerror or exc}")


class DataDirLocked(MetanodeError):
    """Another process (a `serve`, a `scan`) runs a node on the data directory."""

    status = 409
    slug = "data_dir_locked"
    retryable = True


class TargetNotEmpty(MetanodeError):
    """`metanode migrate-storage` was pointed at a database that already holds a node's data:
    nothing is copied over it (docs/scale-out.md)."""

    status = 409
    slug = "target_not_empty"


class ToolMissing(MetanodeError):
    """A command needs a program that is not installed (`metanode backup` on PostgreSQL runs
    `pg_dump`); the message names it and the package that has it."""

    status = 409
    slug = "tool_missing"


class InternalError(MetanodeError):
    """What escaped every handler: a bug, logged with its traceback under the request id."""

    status = 500
    slug = "internal_error"


class MidhashError(MetanodeError):
    """A file could not be fingerprinted (it shrank or vanished while being read)."""

    slug = "midhash_failed"
    retryable = True


# -- an error handed from one process of a node to another (`handoff`) --------------------------

Portable = tuple[str, int, str, dict[str, Any], int]  # class name, status, message, extra, total


def portable(exc: MetanodeError) -> Portable:
    """`exc` as plain values, for another process of this node to raise again (`rebuilt`). By
    class name, not slug: two classes share a slug (`unknown_signer` is a 403 and a 404)."""
    return type(exc).__name__, exc.status, exc.message, exc.extra, getattr(exc, "total", 0)


def rebuilt(error: Portable) -> MetanodeError:
    """The error `portable` described, as an instance of its own class, so it renders, counts
    (`metanode_claims_rejected_total` by slug) and sets `Retry-After` as it would where it was
    raised. Both processes run the same build; a class this module lacks (a bug) is an
    `InternalError`."""
    name, status, message, extra, total = error
    kind = globals().get(name)
    if not (isinstance(kind, type) and issubclass(kind, MetanodeError)):
        return InternalError(f"{name}: {message}")
    if issubclass(kind, InvalidBatch):
        return kind(extra["items"], status, total)
    exc = kind.__new__(kind)
    MetanodeError.__init__(exc, message, **extra)
    return exc


# -- a signal between two of a node's threads, never an answer ------------------------------------


class NotCommitted(Exception):
    """The transaction whose results other work began on before its COMMIT (`db.Gate`) did not
    commit: that work is rolled back. Caught inside the node (the cache's apply ahead of the
    truth's COMMIT, `Applier.apply_ahead`); no client ever sees it."""


# A command Ctrl-C ended (the CLI, and `metanode.__main__` while it still imports the CLI): this
# line on stderr and exit 128 + SIGINT, as a shell reports it, so a script tells it from exit 1,
# a verdict (`claim verify`, `check`, `health` degraded)
INTERRUPTED = 130
INTERRUPTED_LINE = "error: interrupted"
