"""truth.db: the authoritative store of claims, groups, rids, signers and the outbox.

Every write is one `*_txn` function run by the truth `Writer` (or `db.run_txn` from the CLI)
under `BEGIN IMMEDIATE`. Each transaction that changes what a record shows also appends rows to
the outbox `changes`, which the cache applier replays; so a crash between the truth commit and the
cache commit loses nothing (SPEC §3).

Constraints, not hope: claims reference a registered signer and a grouped CID; a CID can only
point at an active rid; a merged rid names an older survivor and holds no CID; rids are never
deleted (so never reused).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from metanode import merge
from metanode.claims import Claim
from metanode.db import Migration, executescript_in_txn
from metanode.errors import (
    BlockedSigner,
    InvalidBatch,
    LinkNotPermitted,
    SignerPolicyError,
    UnknownSigner,
    UnknownSignerUid,
)
from metanode.merge import Verdict
from metanode.rid import Minter
from metanode.rid import decode as decode_rid
from metanode.rid import parse as parse_rid

SCHEMA_V1 = """
CREATE TABLE signers (
    uid TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    weight INTEGER NOT NULL DEFAULT 1 CHECK (weight >= 0),
    status TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'blocked')),
    may_link INTEGER NOT NULL DEFAULT 0 CHECK (may_link IN (0, 1)),
    added_at INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE rids (
    rid TEXT PRIMARY KEY NOT NULL CHECK (length(rid) = 26),
    status TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'merged')),
    merged_into TEXT REFERENCES rids (rid),
    minted_at INTEGER NOT NULL,
    merged_at INTEGER,
    CHECK ((status = 'active' AND merged_into IS NULL AND merged_at IS NULL)
        OR (status = 'merged' AND merged_into IS NOT NULL AND merged_into < rid
            AND merged_at IS NOT NULL))
) WITHOUT ROWID;

CREATE TABLE cid_group (
    cid TEXT PRIMARY KEY NOT NULL,
    rid TEXT NOT NULL REFERENCES rids (rid)
) WITHOUT ROWID;
CREATE INDEX cid_group_rid ON cid_group (rid);

CREATE TABLE claims (
    uid TEXT NOT NULL REFERENCES signers (uid),
    cid TEXT NOT NULL REFERENCES cid_group (cid),
    key TEXT NOT NULL,
    value TEXT,
    ts INTEGER NOT NULL,
    sig BLOB NOT NULL CHECK (length(sig) = 64),
    PRIMARY KEY (uid, cid, key)
) WITHOUT ROWID;
CREATE INDEX claims_cid_key ON claims (cid, key);

CREATE TABLE changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK (kind IN ('claim', 'group', 'merge', 'signer', 'local')),
    rid TEXT,
    cid TEXT,
    key TEXT,
    uid TEXT,
    survivor TEXT,
    at INTEGER NOT NULL
);

CREATE TRIGGER cid_group_insert_active BEFORE INSERT ON cid_group
WHEN (SELECT status FROM rids WHERE rid = NEW.rid) IS NOT 'active'
BEGIN SELECT RAISE(ABORT, 'cid_group must point at an active rid'); END;

CREATE TRIGGER cid_group_update_active BEFORE UPDATE OF rid ON cid_group
WHEN (SELECT status FROM rids WHERE rid = NEW.rid) IS NOT 'active'
BEGIN SELECT RAISE(ABORT, 'cid_group must point at an active rid'); END;

CREATE TRIGGER cid_group_no_delete BEFORE DELETE ON cid_group
BEGIN SELECT RAISE(ABORT, 'a cid never leaves every group'); END;

CREATE TRIGGER rids_merged_is_empty BEFORE UPDATE OF status ON rids
WHEN NEW.status = 'merged' AND EXISTS (SELECT 1 FROM cid_group WHERE rid = NEW.rid)
BEGIN SELECT RAISE(ABORT, 'a merged rid must hold no cid'); END;

CREATE TRIGGER rids_never_unmerge BEFORE UPDATE OF status ON rids
WHEN OLD.status = 'merged' AND NEW.status = 'active'
BEGIN SELECT RAISE(ABORT, 'a merged rid never becomes active again'); END;

CREATE TRIGGER rids_no_delete BEFORE DELETE ON rids
BEGIN SELECT RAISE(ABORT, 'rids are never deleted, so never reused'); END;
"""


def _v1(conn: sqlite3.Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V1)


MIGRATIONS: Sequence[Migration] = (_v1,)


# -- reads --------------------------------------------------------------------------------------


def max_seq(conn: sqlite3.Connection) -> int:
    """The newest outbox seq ever written: AUTOINCREMENT keeps it in `sqlite_sequence` after
    the rows themselves are pruned."""
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
    return int(row[0]) if row else 0


def min_seq(conn: sqlite3.Connection) -> int | None:
    """The oldest outbox seq still stored, or None if every row was pruned."""
    value: int | None = conn.execute("SELECT min(seq) FROM changes").fetchone()[0]
    return value


def max_rid(conn: sqlite3.Connection) -> str | None:
    row = conn.execute("SELECT max(rid) FROM rids").fetchone()
    return row[0] if row else None


def group_of(conn: sqlite3.Connection, cid: str) -> str | None:
    row = conn.execute("SELECT rid FROM cid_group WHERE cid = ?", (cid,)).fetchone()
    return row[0] if row else None


def group_cids(conn: sqlite3.Connection, rid: str) -> list[str]:
    return [r[0] for r in conn.execute("SELECT cid FROM cid_group WHERE rid = ?", (rid,))]


def active_rids(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT rid FROM rids WHERE status = 'active' ORDER BY rid")]


@dataclass(frozen=True)
class RidInfo:
    rid: str
    status: str
    merged_into: str | None


def rid_info(conn: sqlite3.Connection, rid: str) -> RidInfo | None:
    row = conn.execute("SELECT rid, status, merged_into FROM rids WHERE rid = ?", (rid,)).fetchone()
    return RidInfo(*row) if row else None


def survivor(conn: sqlite3.Connection, rid: str) -> str:
    """The active rid that `rid` is now part of (itself if active)."""
    info = rid_info(conn, rid)
    while info is not None and info.merged_into is not None:
        info = rid_info(conn, info.merged_into)
    return info.rid if info else rid


_CLAIM_COLUMNS = "uid, cid, key, value, ts, sig"


def _claim(row: Sequence[Any]) -> Claim:
    return Claim(row[0], row[1], row[2], row[3], row[4], bytes(row[5]))


def stored_claim(conn: sqlite3.Connection, uid: str, cid: str, key: str) -> Claim | None:
    row = conn.execute(
        f"SELECT {_CLAIM_COLUMNS} FROM claims WHERE uid = ? AND cid = ? AND key = ?",
        (uid, cid, key),
    ).fetchone()
    return _claim(row) if row else None


def group_claims(
    conn: sqlite3.Connection,
    rid: str,
    keys: Iterable[str] | None = None,
    uid: str | None = None,
    live_only: bool = True,
) -> list[Claim]:
    """Stored claims on every CID of a group, optionally only some keys or one signer."""
    sql = (f"SELECT {_CLAIM_COLUMNS} FROM claims WHERE cid IN "
           "(SELECT cid FROM cid_group WHERE rid = ?)")
    params: list[Any] = [rid]
    if live_only:
        sql += " AND value IS NOT NULL"
    if uid is not None:
        sql += " AND uid = ?"
        params.append(uid)
    if keys is not None:
        wanted = sorted(set(keys))
        sql += f" AND key IN ({','.join('?' * len(wanted))})"
        params.extend(wanted)
    sql += " ORDER BY cid, key, uid"
    return [_claim(row) for row in conn.execute(sql, params)]


def all_claims(conn: sqlite3.Connection, uid: str | None = None) -> Iterable[Claim]:
    sql = f"SELECT {_CLAIM_COLUMNS} FROM claims"
    params: tuple[str, ...] = ()
    if uid is not None:
        sql, params = sql + " WHERE uid = ?", (uid,)
    return (_claim(row) for row in conn.execute(sql + " ORDER BY uid, cid, key", params))


def signer_cid_keys(conn: sqlite3.Connection, uid: str) -> list[tuple[str, str]]:
    """Every (cid, key) a signer has a claim on: what blocking or re-weighting it can change."""
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT cid, key FROM claims WHERE uid = ?", (uid,))]


@dataclass(frozen=True)
class SignerRow:
    uid: str
    name: str
    weight: int
    status: str
    may_link: bool
    added_at: int

    def as_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "name": self.name, "weight": self.weight,
                "status": self.status, "may_link": self.may_link, "added_at": self.added_at}


_SIGNER_COLUMNS = "uid, name, weight, status, may_link, added_at"


def _signer(row: Sequence[Any]) -> SignerRow:
    return SignerRow(row[0], row[1], row[2], row[3], bool(row[4]), row[5])


def signer(conn: sqlite3.Connection, uid: str) -> SignerRow | None:
    row = conn.execute(f"SELECT {_SIGNER_COLUMNS} FROM signers WHERE uid = ?", (uid,)).fetchone()
    return _signer(row) if row else None


def signers(conn: sqlite3.Connection) -> list[SignerRow]:
    return [_signer(r) for r in conn.execute(f"SELECT {_SIGNER_COLUMNS} FROM signers ORDER BY uid")]


def merge_signers(conn: sqlite3.Connection) -> dict[str, merge.Signer]:
    """Weights and blocks of every signer, as the merge rules take them."""
    return {
        uid: merge.Signer(weight=weight, blocked=status == "blocked")
        for uid, weight, status in conn.execute("SELECT uid, weight, status FROM signers")
    }


@dataclass(frozen=True)
class Change:
    """One outbox row: something that may change what a record shows."""

    seq: int
    kind: str
    rid: str | None
    cid: str | None
    key: str | None
    uid: str | None
    survivor: str | None


def changes_after(conn: sqlite3.Connection, seq: int) -> list[Change]:
    return [Change(*row) for row in conn.execute(
        "SELECT seq, kind, rid, cid, key, uid, survivor FROM changes WHERE seq > ? ORDER BY seq",
        (seq,))]


# -- signer policy ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    accept_unknown_signers: bool = False


def policy_error(row: SignerRow | None, claim: Claim, policy: Policy) -> SignerPolicyError | None:
    """Why this signer may not make this claim, or None (SPEC §2.2, last two rules)."""
    if row is None:
        if not policy.accept_unknown_signers:
            return UnknownSigner(f"signer {claim.uid} is not registered")
        if claim.is_link:
            return LinkNotPermitted(f"unregistered signer {claim.uid} may not link groups")
        return None
    if row.status == "blocked":
        return BlockedSigner(f"signer {claim.uid} is blocked")
    if claim.is_link and not row.may_link:
        return LinkNotPermitted(f"signer {claim.uid} may not link groups (may_link is off)")
    return None


def check_policy(conn: sqlite3.Connection, batch: Sequence[Claim], policy: Policy) -> set[str]:
    """Raise `InvalidBatch` (403) listing every claim whose signer may not make it; else the
    batch's signers that are registered already."""
    rows = {uid: signer(conn, uid) for uid in {c.uid for c in batch}}
    items = []
    for index, claim in enumerate(batch):
        error = policy_error(rows[claim.uid], claim, policy)
        if error is not None:
            items.append({"index": index, "error": error.slug, "message": error.message})
    if items:
        raise InvalidBatch(items, status=403)
    return {uid for uid, row in rows.items() if row is not None}


# -- writes -------------------------------------------------------------------------------------


def prune_changes_txn(conn: sqlite3.Connection, applied_seq: int) -> int:
    """Drop the outbox rows the cache has applied (the cache is all that reads them); returns
    how many. The seq counter stays, so seqs are never reused."""
    return conn.execute("DELETE FROM changes WHERE seq <= ?", (applied_seq,)).rowcount


def _change(conn: sqlite3.Connection, now_ms: int, kind: str, **cols: str | None) -> None:
    conn.execute(
        "INSERT INTO changes (kind, rid, cid, key, uid, survivor, at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (kind, cols.get("rid"), cols.get("cid"), cols.get("key"), cols.get("uid"),
         cols.get("survivor"), now_ms),
    )


def _mint(conn: sqlite3.Connection, minter: Minter, now_ms: int) -> str:
    """A new rid, above every rid the truth holds (also those minted by other processes)."""
    floor = max_rid(conn)
    if floor is not None:
        minter.observe(floor)
    rid = minter.mint()
    conn.execute("INSERT INTO rids (rid, minted_at) VALUES (?, ?)", (rid, now_ms))
    return rid


def _join(conn: sqlite3.Connection, cid: str, rid: str, now_ms: int) -> None:
    conn.execute("INSERT INTO cid_group (cid, rid) VALUES (?, ?)", (cid, rid))
    _change(conn, now_ms, "group", rid=rid, cid=cid)


def ensure_group(conn: sqlite3.Connection, cid: str, minter: Minter, now_ms: int) -> str:
    """The rid of `cid`'s group; a first-seen CID with no link gets a freshly minted one."""
    rid = group_of(conn, cid)
    if rid is None:
        rid = _mint(conn, minter, now_ms)
        _join(conn, cid, rid, now_ms)
    return rid


def link(conn: sqlite3.Connection, a: str, b: str, minter: Minter, now_ms: int) -> None:
    """Put `a` and `b` in one group; two existing groups merge and the older rid survives."""
    if a == b:  # a self-link links nothing; the CID still needs its group
        ensure_group(conn, a, minter, now_ms)
        return
    ra, rb = group_of(conn, a), group_of(conn, b)
    if ra is None and rb is None:
        ra = ensure_group(conn, a, minter, now_ms)
    if ra is None:
        _join(conn, a, rb, now_ms)  # type: ignore[arg-type]  # rb is set here
    elif rb is None:
        _join(conn, b, ra, now_ms)
    elif ra != rb:
        merge_groups(conn, min(ra, rb), max(ra, rb), now_ms)


def merge_groups(conn: sqlite3.Connection, keep: str, lose: str, now_ms: int) -> None:
    """Move every CID of `lose` to `keep` and retire `lose` for good (SPEC §2.4)."""
    conn.execute("UPDATE cid_group SET rid = ? WHERE rid = ?", (keep, lose))
    conn.execute("UPDATE rids SET status = 'merged', merged_into = ?, merged_at = ? WHERE rid = ?",
                 (keep, now_ms, lose))
    # Keep every merged rid one step from its survivor, so a lookup never walks a chain.
    conn.execute("UPDATE rids SET merged_into = ? WHERE merged_into = ?", (keep, lose))
    _change(conn, now_ms, "merge", rid=lose, survivor=keep)


def _store(conn: sqlite3.Connection, claim: Claim) -> None:
    conn.execute(
        "INSERT INTO claims (uid, cid, key, value, ts, sig) VALUES (?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (uid, cid, key) DO UPDATE SET value = excluded.value, ts = excluded.ts, "
        "sig = excluded.sig",
        (claim.uid, claim.cid, claim.key, claim.value, claim.ts, claim.sig),
    )


def _register_unknown(conn: sqlite3.Connection, uid: str, now_ms: int) -> None:
    conn.execute("INSERT OR IGNORE INTO signers (uid, added_at) VALUES (?, ?)", (uid, now_ms))


@dataclass(frozen=True)
class IngestResult:
    verdicts: list[Verdict]
    seq: int  # the outbox seq the cache must reach for these claims to be visible


def ingest_txn(
    conn: sqlite3.Connection,
    batch: Sequence[Claim],
    minter: Minter,
    policy: Policy,
    now_ms: int,
) -> IngestResult:
    """Store a validated batch atomically: policy first, then newest-wins per (uid, cid, key).

    Claims are applied in batch order, so a batch holding the same claim twice gets `accepted`
    then `duplicate`, exactly as two batches would.
    """
    known = check_policy(conn, batch, policy)
    verdicts: list[Verdict] = []
    for claim in batch:
        verdict = merge.resolve(stored_claim(conn, claim.uid, claim.cid, claim.key), claim)
        verdicts.append(verdict)
        if verdict != "accepted":
            continue
        if claim.uid not in known:
            _register_unknown(conn, claim.uid, now_ms)
            known.add(claim.uid)
        if claim.member is not None and claim.value is not None:
            link(conn, claim.cid, claim.member, minter, now_ms)  # joins before it would mint
        else:
            ensure_group(conn, claim.cid, minter, now_ms)
        _store(conn, claim)
        _change(conn, now_ms, "claim", cid=claim.cid, key=claim.key, uid=claim.uid)
    return IngestResult(verdicts, max_seq(conn))


def ensure_groups_txn(conn: sqlite3.Connection, cids: Sequence[str], minter: Minter,
                      now_ms: int) -> None:
    """Give every CID a group (the watcher's midhashes): minted if new, in one transaction."""
    for cid in cids:
        ensure_group(conn, cid, minter, now_ms)


def add_signer_txn(
    conn: sqlite3.Connection, uid: str, name: str, weight: int, may_link: bool, now_ms: int
) -> SignerRow:
    """Register a signer, or update its name, weight and link permission."""
    before = signer(conn, uid)
    conn.execute(
        "INSERT INTO signers (uid, name, weight, may_link, added_at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (uid) DO UPDATE SET name = excluded.name, weight = excluded.weight, "
        "may_link = excluded.may_link",
        (uid, name, weight, int(may_link), now_ms),
    )
    if before is not None and before.weight != weight:
        _change(conn, now_ms, "signer", uid=uid)
    after = signer(conn, uid)
    assert after is not None
    return after


def set_signer_status_txn(
    conn: sqlite3.Connection, uid: str, status: str, now_ms: int
) -> SignerRow:
    """Block or unblock a signer; every record it voted on is recomputed by the applier."""
    before = signer(conn, uid)
    if before is None:
        raise UnknownSignerUid(f"signer {uid} is not registered")
    if before.status != status:
        conn.execute("UPDATE signers SET status = ? WHERE uid = ?", (status, uid))
        _change(conn, now_ms, "signer", uid=uid)
    after = signer(conn, uid)
    assert after is not None
    return after


# -- migration: adopting rids minted elsewhere (tools/claims-migrate) ---------------------------


@dataclass(frozen=True)
class Adopted:
    """What `adopt_group_txn` did: the active rid now holding the CIDs, and how it got there."""

    rid: str
    created: bool  # `rid` (the adopted one) was inserted into `rids` now
    joined: tuple[str, ...]  # CIDs that were in no group and joined this one
    merged: tuple[str, ...]  # rids merged away because they already held one of the CIDs


def adopt_group_txn(conn: sqlite3.Connection, rid: str, cids: Sequence[str],
                    now_ms: int) -> Adopted:
    """Make `cids` one group named by an existing rid, minted by another store (a migrated
    MetaMesh record keeps its UUIDv7), instead of minting a fresh one.

    * `rid` (a UUIDv7 in rid spelling) is inserted into `rids` if absent, with `minted_at` its
      own UUIDv7 timestamp. If it is there already and was merged away, its survivor stands for
      it. Minting stays monotonic: `_mint` always starts above the largest rid the truth holds.
    * A CID in no group joins it (a `group` outbox row, as `ensure_group` writes).
    * A CID already in another group links the two exactly as a `cids/` vote does: the groups
      merge and the older (smaller) rid survives (a `merge` outbox row). A migrated rid was
      minted long before this node's own, so in practice it survives.

    Idempotent: adopting the same rid and CIDs again writes nothing. A rid is never adopted
    without a CID (an empty group could never be reached).
    """
    if not cids:
        raise ValueError("a group needs at least one CID")
    rid = parse_rid(rid)
    info = rid_info(conn, rid)
    created = info is None
    if info is None:
        minted_at = decode_rid(rid) >> 80
        conn.execute("INSERT INTO rids (rid, minted_at) VALUES (?, ?)", (rid, minted_at))
        target = rid
    else:
        target = survivor(conn, rid)
    joined: list[str] = []
    merged: list[str] = []
    for cid in cids:
        held = group_of(conn, cid)
        if held is None:
            _join(conn, cid, target, now_ms)
            joined.append(cid)
        elif held != target:
            keep, lose = min(held, target), max(held, target)
            merge_groups(conn, keep, lose, now_ms)
            merged.append(lose)
            target = keep
    return Adopted(target, created, tuple(joined), tuple(merged))
