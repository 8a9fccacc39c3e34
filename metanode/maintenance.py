"""Offline maintenance of a data directory: what the CLI and tools do with no server running.

Creating the store and the API token; `rebuild-cache`, `check`, `backup`, `export`, `import`,
the signer registry (`metanode signers …`), and bringing the cache up to date after such writes.
Each function opens the stores it needs (`truth.TruthStore`, `cache.CacheStore`: never a
connection) and closes them before it returns; writes go through the same store methods as the
running node's. The edges (`cli.py`, `tools/`) call these functions, and `node.Node` for a
running node: never `db`, `truth` or `cache` themselves.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import itertools
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metanode import cache, claims, config, datadir, db, keys, truth, watchroots
from metanode import rid as rids
from metanode.applier import cache_needs_build
from metanode.clock import iso, now_ms
from metanode.config import Settings
from metanode.errors import (
    BadSignature,
    FileFailed,
    InvalidBatch,
    InvalidKeyFile,
    InvalidRequest,
    MetanodeError,
    NoNode,
    OwnerKey,
    StorageCorrupt,
    StorageError,
    TargetNotEmpty,
    TruthMissing,
    UnknownPeer,
    WatchRootsDamaged,
    storage_error,
)

# -- the store and the token ------------------------------------------------------------------


def ensure_token(path: Path) -> tuple[str, bool]:
    """The API token (or the session secret, the instance id: made alike), created (mode 0600)
    on first start: (token, created now). One left empty or unreadable (a full disk when it
    was written, a damaged card) is refused naming it (`read_token`)."""
    token = secrets.token_urlsafe(32)
    try:
        keys.write_secret(path, token + "\n")
    except FileExistsError:
        return read_token(path), False
    return token, True


OWNER_NAME = "owner"  # the box owner's signer: what a person fixes on the web page


def own_key_path(settings: Settings, name: str) -> Path:
    """The key file of a signer the node holds itself (`owner`, `legacy-writer`)."""
    return settings.keys_dir / f"{name}.key"


def ensure_owner(settings: Settings) -> tuple[str, bool]:
    """The box owner's key (`keys/owner.key`, mode 0600), created at `init`: (uid, created now).
    `metanode serve` registers it as signer `owner` with `owner_weight`."""
    path = own_key_path(settings, OWNER_NAME)
    created = not path.exists()
    return keys.uid_of_key(keys.load_or_create(path)), created


def adopt_owner(settings: Settings, new_owner: bool = False) -> tuple[str, list[str]]:
    """`ensure_owner`, then the truth's owner checked against it (`init`, `serve`): refused
    with `OwnerMismatch` if the truth belongs to another key, unless `new_owner` makes this
    key the owner (the old one lost); then registered as the node registers it at every start
    (so `signers list` shows it from `init` on, not from the first start). (The owner's uid,
    and the former owners' it was adopted over.)"""
    uid, _ = ensure_owner(settings)
    with truth_store(settings) as store:
        former = store.claim_owner_sync(uid, adopt=new_owner)
        store.add_signer_sync(uid, OWNER_NAME, settings.owner_weight, True)
    return uid, former


KEY_WAY_OUT = (
    "put it back from the backup taken with the truth (`<backup folder>/keys-<stamp>/`, "
    "copied into keys/), or, with none, move it out of keys/: the owner's is then made anew "
    "and adopted with `metanode init --new-owner` (the old key's edits stay), a plugin's is "
    "made anew at the next start and signs what the plugin does from then on, its former "
    "key's claims standing (docs/operations.md, 'A damaged or lost file')"
)


def key_problems(settings: Settings) -> list[MetanodeError]:
    """Why each key file in keys/ (the owner's, the plugins', MetaMesh's writer's) cannot be
    loaded, with the way out: `serve` refuses the first (a damaged plugin key crashed the
    node's start, a worker restarted for ever), `check` lists them all. One it may not open
    is a permission to mend, not damage: its typed `StorageError` says so."""
    found = sorted(settings.keys_dir.glob("*.key")) if settings.keys_dir.is_dir() else []
    problems: list[MetanodeError] = []
    for path in found:
        try:
            path.open("rb").close()
            keys.load(path)
        except OSError as exc:
            problems.append(storage_error(exc) or FileFailed.of(exc))
        except InvalidKeyFile as exc:
            problems.append(InvalidKeyFile(f"{exc.message}: {KEY_WAY_OUT}"))
    return problems


def check_keys(settings: Settings) -> None:
    """Raise the first of `key_problems`."""
    if problems := key_problems(settings):
        raise problems[0]


def renew_log(settings: Settings) -> str:
    """`metanode init --new-log`: a new claim-log id for a truth put back by hand (a
    pg_restore; `restore` renews it itself), so its followers' cursors are refused and they
    reconcile (docs/peers.md); the new id."""
    with truth_store(settings) as store:
        return store.renew_log_sync()


def refuse_owner_change(owner: str | None, uid: str, status: str | None = None) -> None:
    """`OwnerKey` for changing `owner`, the box owner's uid, through the signer registry: a
    block (`status` "blocked") or a registration (`status` None: a weight of 0 silences the
    page's edits as surely as a block). Its row is the node's own, set from `owner_weight` at
    every start; unblocking stays allowed. The one place of the rule (API, page and CLI)."""
    if uid == owner and status != "active":
        raise OwnerKey(
            "the box owner's key signs the edits made on the web page: it is not blocked or "
            "re-registered here (its weight is the owner_weight setting); withdraw its word on "
            "a key with Revert on the record instead"
        )


def owner_uid(settings: Settings) -> str | None:
    """The box owner's uid, if `init` (or a first start) made its key."""
    path = own_key_path(settings, OWNER_NAME)
    return keys.uid_of_key(keys.load(path)) if path.exists() else None


def open_store(settings: Settings) -> None:
    """Create the data directory (or make an existing one private) and bring both schemas up
    to date (on PostgreSQL, `storage`: the schemas `truth` and `cache` of its database)."""
    datadir.secure(settings.data_dir)
    truth.TruthStore.configured(settings).migrate()
    cache.CacheStore.configured(settings).migrate()


def read_token(path: Path) -> str:
    """The token in `path`, which must be one line of printable ASCII: an empty one was taken
    as is and no request could name it (every token was refused), a damaged one stopped the
    start with a traceback. Either is `FileFailed` saying how a new one is made."""
    with db.storage_errors(path):
        raw = path.read_bytes()
    token = raw.strip()
    if token and token.isascii() and all(0x21 <= byte < 0x7F for byte in token):
        return token.decode("ascii")
    state = "empty" if not token else "damaged (not one line of printable ASCII)"
    printed = " and prints it once" if path.name == "api-token" else ""
    raise FileFailed(
        f"{path} is {state}: remove it and start the node again, which makes a new one{printed} "
        "(docs/operations.md, 'A damaged or lost file')"
    )


# what only a node that ran makes in its data directory, beside truth.db (`init` and the first
# start): one of them there with no truth.db, and the truth was lost, not never made
NODE_MARKS = ("cache.db", "instance-id")


def refuse_lost_truth(settings: Settings) -> None:
    """Raise `TruthMissing` when truth.db is missing or empty (0 bytes) but the data directory
    held a node (`NODE_MARKS`): `serve` and `scan` would make an empty truth in its place and
    serve no claims, `check` would call that clean. `init` is the one way to start over."""
    path = settings.truth_path
    if settings.postgresql or (path.is_file() and path.stat().st_size > 0):
        return
    marks = [name for name in NODE_MARKS if (settings.data_dir / name).exists()]
    if not marks:
        return
    state = "empty (0 bytes)" if path.exists() else "missing"
    raise TruthMissing(
        f"{path} is {state}, but {settings.data_dir} held a node ({' and '.join(marks)} are "
        "there): truth.db holds every claim, and a start would begin an empty one in its place. "
        "Put it back: from a backup, `metanode restore <folder>/truth-<stamp>.db`; if it was "
        "moved, move it back with its -wal and -shm (docs/operations.md, 'A damaged or lost "
        "file'). To start this box over with no claims, run `metanode init` first"
    )


def require_node(settings: Settings) -> None:
    """Raise `NoNode` unless the data directory holds a node's truth (on SQLite its truth.db;
    on PostgreSQL the database is the node, whatever the folder): for the commands that read
    one (`backup`, `check`, `export`, ...), which would otherwise make an empty node in a
    mistyped folder and report on it with success; `TruthMissing` for one whose truth.db was
    lost (`refuse_lost_truth`)."""
    refuse_lost_truth(settings)
    if not settings.postgresql and not settings.truth_path.is_file():
        raise NoNode(
            f"{settings.data_dir} holds no node (no truth.db): name the data directory with "
            "--data-dir, or make one there with `metanode init`"
        )


def check_writable(settings: Settings) -> None:
    """Raise the `StorageError` a write to either store would meet now (`serve` refuses to
    start on a full disk, a read-only mount or an unreachable PostgreSQL)."""
    stores = (truth.TruthStore.configured(settings), cache.CacheStore.configured(settings))
    datadir.check_writable(store.path for store in stores)


# -- the signer registry ------------------------------------------------------------------------


def storage_failure(exc: BaseException) -> StorageError | None:
    """The typed error of a database failure a command met outside a store's own mapping (a
    damaged file read by an export's generator), or None for anything else: the CLI's one
    way to say it in words (`reports_errors`), where a traceback came out."""
    return db.storage_error(exc)


def truth_store(settings: Settings) -> truth.TruthStore:
    """The data directory's truth store, opened (its schema brought up to date); a `with` block
    closes it."""
    open_store(settings)
    return truth.TruthStore.configured(settings).open()


def add_signer(
    settings: Settings, uid: str, name: str | None, weight: int | None, may_link: bool | None
) -> truth.SignerRow:
    """`metanode signers add`: register `uid` (or update what is given of its name, weight and
    link permission: `truth.add_signer_txn` keeps a known signer's own otherwise); the server,
    if one runs, sees it at its next poll."""
    claims.public_key(uid)
    refuse_owner_change(owner_uid(settings), uid)
    with truth_store(settings) as store:
        return store.add_signer_sync(uid, name, weight, may_link)


def set_signer_status(settings: Settings, uid: str, status: str) -> truth.SignerRow:
    """`metanode signers block|unblock`: the records it voted on are recomputed by the applier."""
    refuse_owner_change(owner_uid(settings), uid, status)
    with truth_store(settings) as store:
        return store.set_signer_status_sync(uid, status)


def signers(settings: Settings) -> list[truth.SignerRow]:
    """`metanode signers list`: every registered signer, by uid."""
    with truth_store(settings) as store:
        return store.signers()


# -- peer tokens (docs/peers.md) ----------------------------------------------------------------


def create_peer_token(settings: Settings, name: str) -> str:
    """`metanode peers token create`: a new read-only token for a peer, printed once; only its
    SHA-256 is kept (the running node sees it at once: it looks tokens up in the truth)."""
    if not 1 <= len(name) <= 64 or not name.isprintable():
        raise InvalidRequest("a peer token's name is 1 to 64 printable characters")
    token = secrets.token_urlsafe(32)
    with truth_store(settings) as store:
        store.add_peer_token_sync(name, hashlib.sha256(token.encode()).hexdigest())
    return token


def peer_tokens(settings: Settings) -> list[truth.PeerTokenRow]:
    with truth_store(settings) as store:
        return store.peer_tokens()


def revoke_peer_token(settings: Settings, name: str) -> None:
    """`metanode peers token revoke`: the token stops working at its next request."""
    with truth_store(settings) as store:
        if not store.revoke_peer_token_sync(name):
            raise UnknownPeer(f"no peer token is named {name!r}")


# -- the cache: rebuild, check ------------------------------------------------------------------


CACHE_FILES = ("cache.db", "cache.db-wal", "cache.db-shm")


@dataclass(frozen=True)
class Rebuilt:
    """What `rebuild-cache` did: the new cache's state, and, when cache.db was damaged, what
    SQLite found wrong with it and the `replaced-<stamp>/` folder it was moved into."""

    state: cache.State
    damage: str | None = None
    aside: Path | None = None


def cache_damage(settings: Settings) -> str | None:
    """What SQLite's `quick_check` finds wrong with cache.db (`db.damage`), None if nothing is
    (or the cache is on PostgreSQL): a damaged one cannot be rebuilt in place."""
    return None if settings.postgresql else db.damage(settings.cache_path)


def rebuild_cache(settings: Settings, *, locked: bool = False) -> Rebuilt:
    """`metanode rebuild-cache`: recompute cache.db from truth.db, keeping local files. A
    damaged cache.db (SQLite's `quick_check`) cannot be rebuilt in place, since opening it
    fails (the way out its own error names led back to it): it is moved, with its `-wal` and
    `-shm`, into `replaced-<stamp>/` and a new one is built from the truth. Only what the cache
    alone held goes with it: the watcher's file rows (the next start hashes the files again)
    and the plugin runs (the plugins run again); every claim is in the truth.

    The data directory's lock is held throughout (unless the caller holds it,
    `locked`), so it is refused while a node runs there (`DataDirLocked`: `metanode
    rebuild-cache` asks a serving node to rebuild in place instead), and a node started
    meanwhile is refused rather than left waiting for the one transaction of the whole cache
    (past SQLite's 30 s busy wait its cache writes failed)."""
    if not locked and not settings.postgresql and (who := db.holder(settings.cache_path)):
        raise db.held_by(settings.cache_path, who)  # not "a running node" of the lock below
    lock = datadir.Lock(settings.data_dir)
    with contextlib.nullcontext() if locked else lock:
        damage = cache_damage(settings)
        aside = None if damage is None else _move_aside(settings.data_dir, CACHE_FILES)
        with (
            truth_store(settings) as source,
            cache.CacheStore.configured(settings) as store,
            store.held(f"`metanode rebuild-cache` (pid {os.getpid()}, since {iso(now_ms())})"),
        ):
            return Rebuilt(store.build_sync(source), damage, aside)


@dataclass(frozen=True)
class CheckReport:
    differences: list[str]
    bad_signatures: list[str]
    claims_checked: int
    unbuilt: bool = False  # the cache awaits a build (after `restore`): only signatures checked
    damaged: list[str] = field(default_factory=list)  # nothing else checked (`damaged_files`)
    notes: list[str] = field(default_factory=list)  # said, but no verdict of damage
    # why the differences may be a node's writes in flight rather than damage ("" when the
    # comparison held still): no verdict, `check` is run again
    inconclusive: str = ""

    @property
    def clean(self) -> bool:
        bad = self.differences or self.bad_signatures or self.damaged
        return not bad and not self.inconclusive

    @property
    def verdict(self) -> str:
        """`clean`, `MISMATCH`, or `INCONCLUSIVE`: differences that writes in flight may
        explain, where MISMATCH told a user whose cache was sound that it was not."""
        if self.clean:
            return "clean"
        mismatch = self.bad_signatures or self.damaged or not self.inconclusive
        return "MISMATCH" if mismatch else "INCONCLUSIVE"


DAMAGE_WAY_OUT = {
    "truth.db": "put it back from a backup, `metanode restore <folder>/truth-<stamp>.db`, "
    "after saving what it still holds (docs/operations.md, 'A damaged or lost file')",
    "cache.db": "run `metanode rebuild-cache`, which moves it aside and builds a new one from "
    "the truth (nothing acknowledged is lost)",
}


def damaged_files(settings: Settings) -> list[str]:
    """Each SQLite database of the data directory that `db.damage` finds damaged, with its way
    out: `check` read the stores through the pages its comparison needs, so damage elsewhere
    (an index, a table it does not compare) went unseen, and damage it met stopped it with an
    error that did not always name the file."""
    if settings.postgresql:
        return []
    paths = (settings.truth_path, settings.cache_path)
    found = ((path, db.damage(path)) for path in paths)
    return [
        f"{path} is damaged ({damage}): {DAMAGE_WAY_OUT[path.name]}"
        for path, damage in found
        if damage is not None
    ]


SNAPSHOT_TRIES = 3  # copies of both stores taken again when the outbox was pruned between


def check(settings: Settings, scratch: Path) -> CheckReport:
    """`metanode check`: both databases read whole for damage (`damaged_files`: only that is
    reported if any is), then the live cache against a fresh rebuild, and every stored
    signature. `scratch` is the fresh cache's file, in a folder of the check's own (copies of
    the stores go beside it). On SQLite the stores are compared as one moment held them
    (`_check_copies`): a node writing meanwhile changes nothing of the verdict."""
    if damaged := damaged_files(settings):
        return CheckReport([], [], 0, damaged=damaged)
    open_store(settings)  # a schema too new refused naming the live file, as a start does
    rebuilding = cache.CacheStore.configured(settings).holder()
    report = (_check_live if settings.postgresql else _check_copies)(settings, scratch)
    if rebuilding is None:
        return report
    said = (
        f"{rebuilding} is rebuilding cache.db: this compared the cache as it was before that "
        "rebuild, which replaces it when it ends; check again then"
    )
    return dataclasses.replace(report, notes=[*report.notes, said])


def _check_copies(settings: Settings, scratch: Path) -> CheckReport:
    """`check` on SQLite: a copy of cache.db, then one of truth.db, each one read snapshot
    (`Store.snapshot_to`), taken in the order the node commits them, so the truth's copy holds
    every change the cache's had applied, and the outbox rows of those it had not. Those are
    applied to the cache's copy, as the node applies them, and the copy compared with a fresh
    build from the truth's. The live stores are only read. A node writing meanwhile (`serve`,
    `rebuild-cache`) made differences of its writes in flight and MISMATCH, of a sound cache
    (1,702 to 5,302 lines under 100-claim posts without pause)."""
    marks: list[tuple[int, int]] = []
    while True:
        live_copy, truth_copy = _store_copies(settings, scratch)
        with (
            truth.TruthStore(truth_copy) as source,
            cache.CacheStore(live_copy) as live,
            cache.CacheStore(scratch) as fresh,
        ):
            state = live.state()
            marks.append((state.applied_seq, source.max_seq()))
            # the node applied and pruned between the two copies (rare: the prune runs every
            # `feed_prune_s`): again; the same twice, nothing moved: an old cache.db put back
            if _pruned_between(state, source) and marks[-2:-1] != marks[-1:]:
                if len(marks) < SNAPSHOT_TRIES:
                    continue
                bad, count = _verify_all(source)
                return CheckReport([], bad, count, inconclusive=_pruned_note(marks))
            return _compare(settings, source, live, fresh, copies=True)


def _pruned_note(marks: Sequence[tuple[int, int]]) -> str:
    """`check`'s word when every copy of the stores it took missed outbox rows the node pruned
    between the cache's copy and the truth's."""
    return (
        f"the node applied and pruned the truth's changes between the copies of cache.db and "
        f"truth.db, {len(marks)} times (cache applied seq, truth seq: {marks}): the records "
        "were not compared; check again"
    )


def _store_copies(settings: Settings, scratch: Path) -> tuple[Path, Path]:
    """Fresh copies of cache.db and truth.db beside `scratch`, in that order (`_check_copies`)."""
    copies = scratch.with_name(f"{scratch.name}.live"), scratch.with_name(f"{scratch.name}.truth")
    _gone(*(copy.with_name(copy.name + end) for copy in copies for end in ("", "-wal", "-shm")))
    cache.CacheStore.configured(settings).snapshot_to(copies[0])
    truth.TruthStore.configured(settings).snapshot_to(copies[1])
    return copies


def _pruned_between(state: cache.State, source: truth.TruthStore) -> bool:
    """Whether the truth's copy lacks outbox rows the cache's copy had yet to apply although
    that cache was built and sound: the node applied them, and pruned them from the outbox,
    between the two copies (rare: the prune runs every `feed_prune_s`)."""
    built = state.epoch != 0 and not state.lost and state.applied_seq <= source.max_seq()
    return built and cache_needs_build(state, source)


def _check_live(settings: Settings, scratch: Path) -> CheckReport:
    """`check` on PostgreSQL, which copies no schema: the live stores read as they are, a
    comparison that writes in flight can make differ; said `inconclusive` when they moved."""
    with (
        truth_store(settings) as source,
        cache.CacheStore.configured(settings) as live,
        cache.CacheStore(scratch) as fresh,
    ):
        return _compare(settings, source, live, fresh, copies=False)


def _compare(
    settings: Settings,
    source: truth.TruthStore,
    live: cache.CacheStore,
    fresh: cache.CacheStore,
    *,
    copies: bool,
) -> CheckReport:
    """The records of `live` against `fresh` built from `source`, every signature of `source`,
    the keys. The copies of `_check_copies` are brought up to the truth's copy first (its
    changes not applied yet, a replan under way: notes); the live stores of `_check_live` are
    compared only once applied up to the truth (else one line says how far behind)."""
    state, truth_seq = live.state(), source.max_seq()
    unbuilt = cache_needs_build(state, source)  # a cache a start would rebuild anyway
    differences: list[str] = []
    notes: list[str] = []
    if not unbuilt:
        if copies:
            notes = _caught_up(live, source, state, truth_seq)
        else:
            differences = _live_notes(state, truth_seq)
        if copies or state.applied_seq >= truth_seq:
            fresh.build_sync(source, live.all_local_files())
            differences += live.diff(fresh)
    differences += [problem.message for problem in key_problems(settings)]
    bad, count = _verify_all(source)
    moved = (source.max_seq(), live.state().applied_seq)
    inconclusive = ""
    if not copies and differences and moved != (truth_seq, state.applied_seq):
        inconclusive = (  # a replica (or `serve`) wrote meanwhile: said, not called damage
            f"the stores changed during the check (truth seq {truth_seq} → {moved[0]}, "
            f"cache applied seq {state.applied_seq} → {moved[1]}): a node is writing, and "
            "the differences above may be its writes in flight; check again while no "
            "claims come in"
        )
    return CheckReport(differences, bad, count, unbuilt, notes=notes, inconclusive=inconclusive)


def _caught_up(
    live: cache.CacheStore, source: truth.TruthStore, state: cache.State, truth_seq: int
) -> list[str]:
    """Apply to the cache's copy what the node had not applied when it was taken (as the node
    does: `cache_catcher`), replans to their end; what that was, in notes."""
    notes = []
    if state.applied_seq < truth_seq:
        notes.append(
            f"the cache was {truth_seq - state.applied_seq} change(s) behind the truth (applied "
            f"seq {state.applied_seq}, truth seq {truth_seq}: a node applying them, or one "
            "stopped before it did, which applies them at its next start): compared once "
            "applied to a copy"
        )
    if state.replans:
        notes.append(
            f"the records of {state.replans} blocked or re-weighed signer(s) were being "
            "recomputed: compared once recomputed in a copy"
        )
    if state.rebuilding:
        notes.append(
            "a rebuild in place was under way (`metanode rebuild-cache` beside the node): "
            "compared once finished in a copy"
        )
    _catch_up(live, source)
    return notes


def _live_notes(state: cache.State, truth_seq: int) -> list[str]:
    """What keeps the live cache of `_check_live` from equalling a rebuild without damage:
    the truth's last changes not applied yet (then it is not compared: a difference for
    every record they touch), a replan under way (compared, its records among the
    differences)."""
    if state.applied_seq < truth_seq:
        return [behind_note(state.applied_seq, truth_seq)]
    notes = []
    if state.applied_seq != truth_seq:
        notes.append(f"cache applied seq {state.applied_seq} != truth seq {truth_seq}")
    if replans := state.replans:
        notes.append(
            f"the records of {replans} blocked or re-weighed signer(s) are still being "
            "recomputed (the differences below include them): run `metanode serve` until "
            "/health shows replans 0, then check again"
        )
    if state.rebuilding:
        notes.append(
            "a rebuild in place is under way (the differences below include what it has "
            "not reached yet): run `metanode serve` until /health shows rebuilding false, "
            "then check again"
        )
    return notes


def _verify_all(source: truth.TruthStore) -> tuple[list[str], int]:
    """Every stored claim's signature verified again: (those that fail, how many were read)."""
    bad, count = [], 0
    for claim in source.claims():
        count += 1
        try:
            claims.verify(claim)
        except BadSignature:
            bad.append(f"{claim.uid} {claim.cid} {claim.key}")
    return bad, count


def behind_note(applied_seq: int, truth_seq: int) -> str:
    """`check`'s one line for a cache that has not applied the truth's last changes yet. A
    rebuild holds them, so every record they touch differed: a `scan` interrupted between its
    two commits made `check` print about a thousand differences and MISMATCH, for a cache the
    next start brings up to date as it always does."""
    return (
        f"the cache is {truth_seq - applied_seq} change(s) behind the truth (applied seq "
        f"{applied_seq}, truth seq {truth_seq}): a running node applies them within moments, "
        "a node stopped before it did (an interrupted `scan` or `serve`) at its next start; "
        "the records were not compared: check again once /health shows `apply_lag` 0 (or "
        "after `metanode scan`)"
    )


@dataclass(frozen=True)
class MigrationReport:
    """What `migrate-storage` copied (rows per table, truth and cache) and `check`'s verdict
    on the target."""

    copied: dict[str, int]
    check: CheckReport


def migrate_storage(settings: Settings, dsn: str, scratch: Path) -> MigrationReport:
    """`metanode migrate-storage --to DSN`: copy this SQLite box into the PostgreSQL database
    `dsn` (docs/scale-out.md): the whole truth (claims, groups and rids merged ones included,
    signers with weights and statuses, the outbox, the box's log id, peers and peer tokens),
    the local files and plugin runs and the feed epoch of the cache; build the target's cache
    from the copied truth (under a later epoch); then `check` the target. A target already
    holding a node's data is refused (`TargetNotEmpty`) before anything is written to it."""
    if settings.postgresql:
        raise InvalidRequest(
            "migrate-storage copies a SQLite box; this one is on PostgreSQL (its `storage` "
            "setting, or METANODE_STORAGE, names a DSN: run it with METANODE_STORAGE=sqlite "
            "and the DSN in --to)"
        )
    target = dataclasses.replace(settings, storage=dsn)
    if not target.postgresql:
        raise InvalidRequest("migrate-storage --to: must be a postgresql:// DSN")
    open_store(target)
    with (
        truth_store(settings) as source,
        truth.TruthStore.configured(target) as dest,
        cache.CacheStore.configured(settings) as old,
        cache.CacheStore.configured(target) as new,
    ):
        held = [f"truth.{t}" for t in dest.holding()] + [f"cache.{t}" for t in new.holding()]
        if held:
            raise TargetNotEmpty(
                f"the target database already holds data ({', '.join(held)}); "
                "migrate into an empty database (one `metanode init` wrote into holds the "
                "owner's signer: drop it and create it again, without `init`)"
            )
        copied = {f"truth.{t}": n for t, n in dest.copy_from(source).items()}
        copied |= {f"cache.{t}": n for t, n in new.copy_local_from(old).items()}
        new.build_sync(dest)
    return MigrationReport(copied, check(target, scratch))


def scratch_truth(settings: Settings, scratch: Path) -> Settings:
    """The settings of a SQLite data directory made at `scratch` holding a copy of `settings`'
    truth, for work that must not touch the real one (the migration tool's dry run): SQLite's
    online backup of truth.db, or the rows of a truth on PostgreSQL copied into a SQLite one
    (the dry run once ran on the live database: `storage` was kept with the data directory)."""
    target = dataclasses.replace(settings, data_dir=scratch, storage="sqlite")
    scratch.mkdir(parents=True)
    if settings.postgresql:
        open_store(target)
        with truth_store(settings) as real, truth_store(target) as copy:
            copy.copy_from(real)
    elif settings.truth_path.is_file():
        copy_truth(settings, target.truth_path)
    return target


def copy_truth(settings: Settings, target: Path) -> str:
    """An online copy of truth.db at `target` (SQLite's backup, integrity-checked: the verdict,
    "ok" when sound), leaving the source as it is: no migration, no change of mode. The
    migration tool's dry run works on such a copy."""
    return truth.TruthStore.configured(settings).backup_to(target)


@dataclass(frozen=True)
class BackedUp:
    """What `backup` made: the truth's copy (its keys and folders beside it), and why the list
    of watched folders was left out ("" when it was copied or there is none): it is damaged."""

    copy: Path
    folders_damaged: str = ""
    # what backups into the same folder that did not finish (killed) had left, removed now
    cleared: list[Path] = field(default_factory=list)


def backup(settings: Settings, target: Path) -> BackedUp:
    """`metanode backup DIR`: an online copy of the truth (consistent while the node writes)
    plus the node's keys, the folders chosen on the page (`watched-folders-<stamp>.json`,
    when any were: a box restored from it watches what this one watches; a damaged list is
    left out, and said, rather than costing the backup of the rest) and the watch roots'
    WebDAV names (`webdav-names-<stamp>.json`: restored, each folder keeps its name, and so
    every consumer's `filePath`; without it a second `films` became `films` again). On SQLite
    a checked copy of truth.db (the cache is not backed up: it is rebuilt from the truth); on
    PostgreSQL a `pg_dump` of the database in its custom format (`pg_restore` puts it back:
    docs/scale-out.md). Private like the data directory: a new TARGET is 0700, the copies 0600
    (the keys keep theirs). The truth is copied as it is, never migrated first: the backup
    taken before an upgrade must still open in the version before."""
    target.mkdir(mode=datadir.DIR_MODE, parents=True, exist_ok=True)
    cleared = _clear_leftovers(target)
    copy, keys, held = _backup_names(target, "pgdump" if settings.postgresql else "db")
    partial = _partial(copy)
    folders, names = _folders_beside(copy), _webdav_names_beside(copy)
    try:
        damaged = _copy_all(settings, partial, keys, folders, names)
        partial.rename(copy)  # the last step: a truth-<stamp> file is a whole backup
    except BaseException:  # all of it or nothing: never a truth copy without its keys
        _gone(keys, folders, names, partial)  # the .partial last: it marks the rest a leftover
        raise
    finally:
        os.close(held)  # its flock, after the rename: a `.partial` no backup holds is a leftover
    return BackedUp(copy, damaged, cleared)


def _copy_all(settings: Settings, partial: Path, keys: Path, folders: Path, names: Path) -> str:
    """`backup`'s copies: the truth into `partial`, the keys, the folders chosen on the page,
    the WebDAV names; why the folders' list was left out ("" when it was not: it is damaged)."""
    _copy_truth_into(settings, partial)
    if settings.keys_dir.is_dir():
        shutil.copytree(settings.keys_dir, keys)
    damaged = ""
    try:
        chosen = config.page_roots(settings.data_dir)
    except WatchRootsDamaged as exc:  # a restore would refuse a copy of it
        chosen, damaged = None, exc.message
    if chosen is not None:
        watchroots.write(folders, chosen)
    kept = watchroots.read_names(settings.data_dir / watchroots.WEBDAV_NAMES)
    if any(kept):
        watchroots.write_names(names, *kept)
    return damaged


def _partial(copy: Path) -> Path:
    """Where the truth's copy is written until the backup is whole: a SIGKILL (or power loss)
    mid-way leaves this name, never a `truth-<stamp>.db` that looks like the newest backup
    to a rotation script or an operator and is refused by `restore`."""
    return copy.with_name(copy.name + ".partial")


def _backup_names(target: Path, suffix: str) -> tuple[Path, Path, int]:
    """`truth-<UTC stamp>.<suffix>` and `keys-<stamp>` in `target`, none there before, nor a
    `.partial` of the first (made here, empty, 0600: the copy is written into it, and renamed
    once whole), and a descriptor of that `.partial` holding its `flock` (while the backup
    runs: `_clear_leftovers` of another backup into the same folder leaves it be): a second
    backup within the same second is `<stamp>-2`, and so on."""
    for tag in _stamps():
        copy, keys = target / f"truth-{tag}.{suffix}", target / f"keys-{tag}"
        if keys.exists() or copy.exists():
            continue
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            held = os.open(_partial(copy), flags, datadir.FILE_MODE)
        except FileExistsError:
            continue
        fcntl.flock(held, fcntl.LOCK_EX)
        if copy.exists() or not _still(_partial(copy), held):
            # a backup of the same second renamed its copy in between, or another's
            # `_clear_leftovers` took the `.partial` before its lock was held
            _partial(copy).unlink(missing_ok=True)
            os.close(held)
            continue
        return copy, keys, held
    raise AssertionError("_stamps never ends")


def _still(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd` (not removed, nor replaced)."""
    try:
        return path.stat().st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _clear_leftovers(target: Path) -> list[Path]:
    """Remove what backups into `target` that did not finish (SIGKILL, the OOM killer, a power
    loss) left: each `truth-<stamp>.<db|pgdump>.partial` no running backup holds (its
    `flock`, `_backup_names`), with what that backup made beside it, its copy never renamed
    (`keys-<stamp>`, the folders' lists); what was removed. They were left for the user to
    find and delete by hand, a `.partial` holding up to a whole truth.db each."""
    removed: list[Path] = []
    for partial in sorted(target.glob("truth-*.partial")):
        if not _unheld(partial):
            continue  # a backup running now
        copy = partial.with_name(partial.name.removesuffix(".partial"))
        beside = (target / f"keys-{_stamp_of(copy)}", _folders_beside(copy))
        made = [] if copy.exists() else [*beside, _webdav_names_beside(copy)]
        found = [path for path in (*made, partial) if path.exists()]
        _gone(*found)
        removed += found
    return removed


def _unheld(path: Path) -> bool:
    """Whether no process holds `path`'s `flock` (one that held it and ended dropped it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `restore` did: where it put what it replaced, and whether the keys came too."""

    aside: Path | None  # the replaced truth (with its WAL) and keys, kept; None: there were none
    keys: Path | None  # the keys folder restored, or None: the data directory's kept
    # the watched folders restored (the backup's `watched-folders-<stamp>.json`), or None: the
    # backup has none (none chosen on the page, or a backup made before they were kept), the
    # data directory's list kept
    folders: tuple[str, ...] | None = None
    missing: tuple[str, ...] = ()  # those of `folders` that are no folder on this machine


def restore(settings: Settings, backup: Path, keys_from: Path | None, keep_keys: bool) -> Restored:
    """`metanode restore BACKUP`, the node stopped (the CLI holds the data directory's lock):
    the checked backup becomes truth.db, its keys (`keys-<stamp>` beside it, or `keys_from`)
    the keys, its watched folders (`watched-folders-<stamp>.json` beside it, when it has any)
    the folders chosen on the page, each that is no folder here named in `missing` (it stays
    in the list: a disk not mounted yet is watched once it is), its WebDAV names
    (`webdav-names-<stamp>.json`, when it has them) the roots' names, the cache goes (rebuilt
    at the next start). What was there is moved, whole, into `replaced-<stamp>/` in the data
    directory: truth.db with its `-wal` and `-shm`, since a WAL left beside a restored file is
    replayed onto it at the next open (the stale log undid the restore), the keys, the list
    and the names. On PostgreSQL `pg_restore` does it (scale-out.md)."""
    if settings.postgresql:
        raise InvalidRequest(
            "restore puts a SQLite backup in place; on PostgreSQL restore the dump with "
            "pg_restore (docs/scale-out.md, 'Backup and restore')"
        )
    if not backup.is_file():
        raise FileFailed(f"{backup}: no such file (a truth-<stamp>.db that `backup` wrote)")
    if backup.name.endswith(".partial"):  # whole or not, no backup finished with it
        raise InvalidRequest(
            f"{backup} is the copy of a backup that did not finish (killed mid-way): restore a "
            "truth-<stamp>.db instead (the next `metanode backup` into that folder removes it)"
        )
    if keep_keys and keys_from is not None:
        raise InvalidRequest("--keys names the keys to restore, --keep-keys keeps these: not both")
    if backup.resolve() == settings.truth_path.resolve():
        raise InvalidRequest(f"{backup} is this data directory's own truth.db, no backup")
    keys = None if keep_keys else (keys_from or _keys_beside(backup))
    datadir.secure(settings.data_dir)
    incoming = settings.data_dir / "truth.db.restoring"
    keys_in = settings.data_dir / "keys.restoring"
    _gone(incoming, keys_in)  # a restore that stopped half-way left them
    try:  # all that can fail, before anything of the data directory is touched
        os.close(os.open(incoming, os.O_WRONLY | os.O_CREAT | os.O_EXCL, datadir.FILE_MODE))
        truth.TruthStore.restore_copy(backup, incoming)  # first: is it a backup at all?
        if keys is not None and not (keys / f"{OWNER_NAME}.key").is_file():
            raise FileFailed(
                f"{keys} holds no {OWNER_NAME}.key: name the backup's keys folder with --keys, "
                "or keep this data directory's with --keep-keys"
            )
        if keys is not None:
            shutil.copytree(keys, keys_in)
        folders = config.read_roots(_folders_beside(backup))  # a damaged copy: refused here
        names = watchroots.read_names(_webdav_names_beside(backup))  # damaged: none
    except BaseException:
        _gone(incoming, keys_in)
        raise
    for name in ("cache.db", "cache.db-wal", "cache.db-shm"):  # first: it is the old truth's
        (settings.data_dir / name).unlink(missing_ok=True)
    replaced = ["truth.db", "truth.db-wal", "truth.db-shm", *(["keys"] if keys else [])]
    if folders is not None:
        replaced.append(config.WATCHED_FOLDERS)
    if any(names):
        replaced.append(watchroots.WEBDAV_NAMES)
    aside = _move_aside(settings.data_dir, replaced)
    incoming.rename(settings.truth_path)
    if keys is not None:
        keys_in.rename(settings.keys_dir)
        datadir.secure(settings.data_dir)
    if any(names):
        watchroots.write_names(settings.data_dir / watchroots.WEBDAV_NAMES, *names)
    if folders is None:
        return Restored(aside, keys)
    watchroots.save(settings.data_dir, folders)
    missing = tuple(root for root in folders if not os.path.isdir(root))
    return Restored(aside, keys, folders, missing)


def _gone(*paths: Path) -> None:
    """Remove each of `paths` (a file or a folder) that is there."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _keys_beside(backup: Path) -> Path:
    """The keys folder `backup` made beside `truth-<stamp>.db`: `keys-<stamp>`."""
    return backup.parent / f"keys-{_stamp_of(backup)}"


def _folders_beside(backup: Path) -> Path:
    """The watched folders `backup` kept beside `truth-<stamp>.db` (or `.pgdump`):
    `watched-folders-<stamp>.json`."""
    return backup.parent / f"watched-folders-{_stamp_of(backup)}.json"


def _webdav_names_beside(backup: Path) -> Path:
    """The WebDAV names `backup` kept beside `truth-<stamp>.db` (or `.pgdump`):
    `webdav-names-<stamp>.json`."""
    return backup.parent / f"webdav-names-{_stamp_of(backup)}.json"


def _stamp_of(backup: Path) -> str:
    """The `<stamp>` of `truth-<stamp>.db` (or `.pgdump`), which the files beside it share."""
    return backup.name.removeprefix("truth-").removesuffix(".db").removesuffix(".pgdump")


def after_unclean_stop(settings: Settings) -> Path | None:
    """Both databases read whole for damage (`db.damage`) before a start that follows a node
    which did not stop cleanly (killed, crashed, the machine down: when a disk that lies about
    its flushes leaves damage): a damaged truth.db refuses the start (`StorageCorrupt`, its way
    out said), where it started and answered reads, degraded; a damaged cache.db is moved into
    `replaced-<stamp>/`, returned, for the start to build a new one from the truth. A clean
    stop's start reads neither: `quick_check` reads every page (seconds for a large box)."""
    if settings.postgresql:
        return None
    if (damage := db.damage(settings.truth_path)) is not None:
        raise StorageCorrupt(
            f"{settings.truth_path} is damaged ({damage}): {DAMAGE_WAY_OUT['truth.db']}"
        )
    if db.damage(settings.cache_path) is None:
        return None
    return _move_aside(settings.data_dir, CACHE_FILES)


def _move_aside(data_dir: Path, names: Iterable[str]) -> Path | None:
    """Move each of `names` that is in `data_dir` into a new `replaced-<stamp>/` there, and
    return that folder; None when none is there (a new data directory, a new machine's, has
    nothing to keep: no empty folder)."""
    present = [name for name in names if (data_dir / name).exists()]
    if not present:
        return None
    aside = _aside(data_dir)
    for name in present:
        (data_dir / name).rename(aside / name)
    return aside


def _aside(data_dir: Path) -> Path:
    """A new folder `replaced-<stamp>` in `data_dir` (`_stamps`)."""
    for tag in _stamps():
        aside = data_dir / f"replaced-{tag}"
        with contextlib.suppress(FileExistsError):
            aside.mkdir(mode=datadir.DIR_MODE)
            return aside
    raise AssertionError("_stamps never ends")


def _stamps() -> Iterator[str]:
    """The UTC time to the second, then the same with `-2`, `-3`…: names of things made now,
    one taken meaning the next."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    yield stamp
    for n in itertools.count(2):
        yield f"{stamp}-{n}"


def _copy_truth_into(settings: Settings, copy: Path) -> None:
    """The truth copied into `copy`; a damaged truth.db is `StorageCorrupt` naming it, where
    the error named the copy as damaged (or, when only the copy's integrity check found it, a
    RuntimeError's traceback), and said nothing of what a backup cannot do then."""
    if settings.postgresql:
        truth.TruthStore.configured(settings).dump_to(copy)
        return
    try:
        verdict = copy_truth(settings, copy)
    except StorageCorrupt as exc:
        verdict = str(exc.__cause__ or exc.message)
    if verdict != "ok":
        raise StorageCorrupt(
            f"{settings.truth_path} is damaged ({' '.join(verdict.split())}), so no copy of it "
            "is a sound backup: save the claims it still holds instead (docs/operations.md, "
            "'A damaged or lost file')"
        )


# -- export and import --------------------------------------------------------------------------


def export_claims(settings: Settings, uid: str | None) -> tuple[int, Iterator[dict[str, Any]]]:
    """Every stored claim (tombstones too) as wire dicts, optionally of one signer: (count, it).
    A `uid` that is no uid is `invalid_uid`, not an export of nothing."""
    if uid is not None:
        claims.public_key(uid)
    with truth_store(settings) as store:
        total = store.claim_count(uid)
    return total, (claim.wire() for claim in truth.TruthStore.configured(settings).claims(uid))


IMPORT_BATCH = 1000
IMPORT_ERRORS_KEPT = 100  # a file of 10 million bad claims must not fill memory with errors
Numbered = tuple[int, object]  # (where in its file, a wire claim): `jsonl.read`'s items


def _numbered_chunks(items: Iterable[Numbered]) -> Iterator[list[Numbered]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, IMPORT_BATCH)):
        yield chunk


def _placed(
    positions: Sequence[int],
    future: concurrent.futures.Future[tuple[list[claims.Claim], list[dict[str, Any]]]],
) -> tuple[list[tuple[int, claims.Claim]], list[dict[str, Any]]]:
    """A chunk's `validate_items` answer with file positions: `position` for `index`."""
    valid, errors = future.result()
    failed = {error["index"] for error in errors}
    kept = [p for i, p in enumerate(positions) if i not in failed]
    placed = [
        {"position": positions[e["index"]], **{k: v for k, v in e.items() if k != "index"}}
        for e in errors
    ]
    return list(zip(kept, valid, strict=True)), placed


def _verified_chunks(
    items: Iterable[Numbered], limits: claims.Limits
) -> Iterator[tuple[list[tuple[int, claims.Claim]], list[dict[str, Any]]]]:
    """The items verified `IMPORT_BATCH` at a time on a thread pool, in order: per chunk, the
    valid claims and the errors, each with its position. Only a few chunks are in flight, so
    memory stays flat however many items there are."""
    now, workers = now_ms(), os.cpu_count() or 2
    with concurrent.futures.ThreadPoolExecutor(workers, "import-verify") as pool:
        pending: collections.deque[
            tuple[
                list[int],
                concurrent.futures.Future[tuple[list[claims.Claim], list[dict[str, Any]]]],
            ]
        ] = collections.deque()
        for chunk in _numbered_chunks(items):
            wires = [wire for _, wire in chunk]
            pending.append(
                ([p for p, _ in chunk], pool.submit(claims.validate_items, wires, 0, now, limits))
            )
            if len(pending) > workers:
                yield _placed(*pending.popleft())
        while pending:
            yield _placed(*pending.popleft())


@contextlib.contextmanager
def _signer_rows(settings: Settings) -> Iterator[Callable[[str], truth.SignerRow | None]]:
    """Signer rows as the truth holds them now, cached. There are none without a truth.db: an
    import into a new data directory creates nothing until every claim has passed."""
    if not settings.postgresql and not settings.truth_path.exists():
        yield lambda uid: None
        return
    with truth_store(settings) as store:
        yield functools.cache(store.signer)


@dataclass
class ImportCheck:
    """What pass 1 of an import keeps of a file of any size: counts and the signers."""

    claims: int = 0
    signers: set[str] = field(default_factory=set)


def validate_import(
    items: Iterable[Numbered],
    settings: Settings,
    register_signers: bool,
    progress: Callable[[int], None],
) -> ImportCheck:
    """Pass 1 of `metanode import`: verify every claim, and its signer's policy against the
    truth as it is now, writing nothing. Raises `InvalidBatch` with the first
    `IMPORT_ERRORS_KEPT` failures (each with its `position`) and the count of all of them.
    With `register_signers`, unknown signers pass: they are registered (may link) first."""
    check, failed = ImportCheck(), 0
    errors: list[dict[str, Any]] = []
    limits = claims.Limits(settings.max_value_bytes, settings.max_skew_ms)
    policy = truth.Policy(settings.accept_unknown_signers)
    with _signer_rows(settings) as row_of:
        for valid, chunk_errors in _verified_chunks(items, limits):
            check.claims += len(valid) + len(chunk_errors)
            for position, claim in valid:
                check.signers.add(claim.uid)
                row = row_of(claim.uid)
                error = (
                    None
                    if row is None and register_signers
                    else truth.policy_error(row, claim, policy)
                )
                if error is not None:
                    chunk_errors.append(
                        {"position": position, "error": error.slug, "message": error.message}
                    )
            chunk_errors.sort(key=lambda e: int(e["position"]))
            errors.extend(chunk_errors[: IMPORT_ERRORS_KEPT - len(errors)])
            failed += len(chunk_errors)
            progress(len(valid))
    if failed:
        raise InvalidBatch(errors, total=failed)
    return check


def import_claims(
    settings: Settings,
    items: Iterable[Numbered],
    check: ImportCheck,
    register_signers: bool,
    progress: Callable[[int], None],
) -> dict[str, int]:
    """Pass 2 of `metanode import`, after `validate_import` passed on the same items: ingest
    them through the normal transaction `IMPORT_BATCH` at a time, the cache brought up to date
    after each. `register_signers` trusts the file's signers (weight 1, may link); otherwise they
    must be registered already.

    The items are verified again as they are written (on the thread pool, beside the writes):
    the file is read a second time, and only what the writing pass verified may reach the
    truth. Should the file change between the passes, the import stops at the first claim that
    no longer verifies, with the (verified) claims before it written."""
    policy = truth.Policy(settings.accept_unknown_signers)
    limits = claims.Limits(settings.max_value_bytes, settings.max_skew_ms)
    with truth_store(settings) as store:
        if register_signers:
            for uid in sorted(check.signers):
                if store.signer(uid) is None:
                    store.add_signer_sync(uid, "imported", 1, True)
        with cache_catcher(settings, store) as catch_up:
            return _ingest_chunks(store, items, limits, policy, progress, catch_up)


def _ingest_chunks(
    store: truth.TruthStore,
    items: Iterable[Numbered],
    limits: claims.Limits,
    policy: truth.Policy,
    progress: Callable[[int], None],
    catch_up: Callable[[], cache.State],
) -> dict[str, int]:
    """Pass 2's loop: per chunk, verify, ingest, count the verdicts and bring the cache up to
    date (memory stays flat: the cache never has more than a chunk's changes to apply)."""
    minter = rids.Minter()
    counts = {"accepted": 0, "duplicate": 0, "stale": 0}
    for valid, errors in _verified_chunks(items, limits):
        if errors:
            raise InvalidRequest(
                f"claim {errors[0]['position']} no longer verifies "
                f"({errors[0]['error']}): the file changed during the "
                "import; the claims before it were imported"
            )
        batch = [claim for _, claim in valid]
        result = store.ingest_sync(batch, minter, policy, now_ms())
        for verdict in result.verdicts:
            counts[verdict] += 1
        catch_up()
        progress(len(batch))
    return counts


# -- bringing the cache up to date --------------------------------------------------------------


@contextlib.contextmanager
def cache_catcher(
    settings: Settings, source: truth.TruthStore
) -> Iterator[Callable[[], cache.State]]:
    """A function applying the truth's outbox (of the open `source`) to the cache now (the
    CLI's writes, when no server runs), the cache store open for as many calls as the block
    makes: a long import calls it after every chunk, so no one transaction holds a whole file's
    changes."""
    with cache.CacheStore.configured(settings) as store:
        yield functools.partial(_catch_up, store, source)


def _catch_up(store: cache.CacheStore, source: truth.TruthStore) -> cache.State:
    """`store` brought up to `source`: built if only a build can, else its outbox applied and
    every replan step taken, and every step of a rebuild in place (no server to take them
    later)."""
    if cache_needs_build(store.state(), source):
        return store.build_sync(source)
    state = store.apply_sync(source)
    while state.replans or state.rebuilding:
        state = store.apply_sync(source)
    return state


def catch_up_cache(settings: Settings) -> cache.State:
    """Apply the truth's outbox to the cache now (the CLI's writes, when no server runs)."""
    with truth_store(settings) as source, cache_catcher(settings, source) as catch_up:
        return catch_up()
