"""truth.db: the authoritative store of claims, groups, rids, signers and the outbox.

`TruthStore` is the only door: it owns the connections, the writer and the schema. The
module-level functions below are its statements (each takes a connection, and only the store
hands them one). Every write is one `*_txn` function run by the store's `Writer` under
`BEGIN IMMEDIATE`. Each transaction that changes what a record shows also appends rows to
the outbox `changes`, which the cache applier replays; so a crash between the truth commit and the
cache commit loses nothing (SPEC §3).

Constraints, not hope: claims reference a registered signer and a grouped CID; a CID can only
point at an active rid; a merged rid names an older survivor and holds no CID; rids are never
deleted (so never reused).
"""

from __future__ import annotations

import functools
import json
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

from metanode import merge, pg
from metanode.claims import Claim, Limits, validate_batch
from metanode.clock import Clock, now_ms
from metanode.db import (
    Combiner,
    Connection,
    Gate,
    Migration,
    Outcome,
    Store,
    Target,
    connect,
    copy_backup,
    copy_database,
    copy_table,
    executescript_in_txn,
    holds_rows,
    make_incremental,
    mapped,
    migrate_file,
    reclaim,
    run_txn,
    snapshot,
    storage_error,
    storage_errors,
)
from metanode.errors import (
    BlockedSigner,
    InvalidBatch,
    InvalidCursor,
    InvalidRequest,
    LinkNotPermitted,
    OwnerMismatch,
    SignerPolicyError,
    UnknownSigner,
    UnknownSignerUid,
)
from metanode.merge import Verdict
from metanode.rid import Minter
from metanode.rid import decode as decode_rid
from metanode.rid import parse as parse_rid
from metanode.view import Change, Fresh, TruthView, Written

T = TypeVar("T")


def _outbox(name: str, kind_check: str) -> str:
    """The outbox table's statement: v1's, and v5's with another CHECK on `kind` (the text of
    v1 is what existing files hold, so this must not change)."""
    return f"""CREATE TABLE {name} (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK ({kind_check}),
    rid TEXT,
    cid TEXT,
    key TEXT,
    uid TEXT,
    survivor TEXT,
    at INTEGER NOT NULL
);"""


# Schema v1 as existing truth.db files hold it. The outbox kind 'local' in its CHECK is never
# written (the watcher's changes go straight to the cache, `cache.local_txn`); it stays allowed
# (v5 too), so no row an older node wrote is refused.
SCHEMA_V1 = (
    """
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

"""
    + _outbox("changes", "kind IN ('claim', 'group', 'merge', 'signer', 'local')")
    + """

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
)


def _v1(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V1)


# Schema v2: peers (docs/peers.md). `claims.log_seq` orders the claim log: every stored claim
# gets the next seq when it is stored or replaces an older one, so a superseded claim drops out
# of the log and its replacement shows at the end. Seqs only grow (claims are never deleted, so
# max(log_seq) is the newest ever given) and live in the truth: a cache rebuild or a restart
# keeps them. `box.log_id` names this truth's log, so a cursor of another box is recognised.
SCHEMA_V2 = """
ALTER TABLE claims ADD COLUMN log_seq INTEGER;
UPDATE claims SET log_seq = o.n FROM (SELECT uid, cid, key,
    row_number() OVER (ORDER BY ts, uid, cid, key) AS n FROM claims) AS o
    WHERE o.uid = claims.uid AND o.cid = claims.cid AND o.key = claims.key;
CREATE UNIQUE INDEX claims_log ON claims (log_seq);

CREATE TABLE box (
    name TEXT PRIMARY KEY NOT NULL,
    value TEXT NOT NULL
) WITHOUT ROWID;
INSERT INTO box (name, value) VALUES ('log_id', lower(hex(randomblob(8))));

ALTER TABLE signers ADD COLUMN learned_from TEXT;

CREATE TABLE peer_tokens (
    name TEXT PRIMARY KEY NOT NULL,
    hash TEXT NOT NULL UNIQUE CHECK (length(hash) = 64),
    created_at INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE peers (
    name TEXT PRIMARY KEY NOT NULL CHECK (length(name) BETWEEN 1 AND 64),
    url TEXT NOT NULL,
    token TEXT NOT NULL,
    weight INTEGER NOT NULL DEFAULT 0 CHECK (weight >= 0),
    cursor TEXT NOT NULL DEFAULT '',
    accepted INTEGER NOT NULL DEFAULT 0,
    duplicate INTEGER NOT NULL DEFAULT 0,
    stale INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    added_at INTEGER NOT NULL
) WITHOUT ROWID;
"""


def _v2(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V2)


# Schema v3: claims keyed by their claim-log seq. CIDs are random hashes, so under v1's
# `WITHOUT ROWID` primary key (uid, cid, key) and its index (cid, key) every new claim dirtied a
# random leaf page in two B-trees, and each secondary index entry carried the whole text key.
# A rowid table keyed by `log_seq` appends each new (or replacing) claim at the end of its
# B-tree; `claims_claim` (cid, key, uid) finds a claim by what it is about (and serves every
# read by CID), `claims_signer` (uid, log_seq) a signer's claims. Measured on the claims table
# alone (tools/bench/claims_layout.py, 50,000 claims in batches of 100, WAL, synchronous=FULL):
# 536 → 430 B a claim, insert 45.3 → 22.3 µs a claim. Rows are copied in log
# order; one without a seq (none should be: v2 numbered them all) joins the end of the log. The
# columns keep their order, so the schema still matches PostgreSQL's (tests/test_pg.py).
SCHEMA_V3 = """
CREATE TABLE claims_new (
    uid TEXT NOT NULL REFERENCES signers (uid),
    cid TEXT NOT NULL REFERENCES cid_group (cid),
    key TEXT NOT NULL,
    value TEXT,
    ts INTEGER NOT NULL,
    sig BLOB NOT NULL CHECK (length(sig) = 64),
    log_seq INTEGER PRIMARY KEY
);
INSERT INTO claims_new (uid, cid, key, value, ts, sig, log_seq)
    SELECT uid, cid, key, value, ts, sig, log_seq FROM claims
    ORDER BY log_seq IS NULL, log_seq;
DROP TABLE claims;
ALTER TABLE claims_new RENAME TO claims;
CREATE UNIQUE INDEX claims_claim ON claims (cid, key, uid);
CREATE INDEX claims_signer ON claims (uid, log_seq);
"""


def _v3(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V3)


# Schema v4: signers and CIDs by integer id (issue 18). A uid is 48 characters and a CID about
# 62, and v3 stored the CID text four times a claim (the claims row, `claims_claim`, `cid_group`
# and `cid_group_rid`) and the uid three times (the row, `claims_claim`, `claims_signer`);
# measured at 20,000 one-claim records, VACUUMed: 644 B a claim, of which `claims` 216.5,
# `claims_claim` 128.4, `cid_group` 95.6, `cid_group_rid` 95.6, `claims_signer` 59.8. Now each
# text is stored once with an integer id (`signers.id`, `cid_group.id`: rowids) and a claim row
# (`claim_rows`) names them by id; `claims_claim` is (cid_id, key, signer). New CIDs take growing
# ids, so a new claim appends to `claims_claim` too: only `cid_group`'s UNIQUE (cid) index is in
# hash order. The view `claims` shows a claim as before (uid, cid, key, value, ts, sig, log_seq),
# so reads and everything outside truth.py keep text uids and CIDs. Measured: see
# docs/benchmarks.md "Signers and CIDs by integer id (schema v4)".
# The store's connections have `PRAGMA foreign_keys=ON`, which a migration's transaction cannot
# turn off, so the tables are rebuilt in an order no foreign key breaks (SQLite's "other kinds
# of table schema changes"): new tables beside the old, rows copied, the old claims (the only
# child of the old signers and cid_group) dropped first, then the new tables renamed into place
# (a rename rewrites the foreign keys naming them). `rids_merged_is_empty` reads cid_group, so
# it is dropped before and made again after; cid_group's own triggers go with the old table.
# The part of v4 both backends share (SQLite `SCHEMA_V4`, PostgreSQL `PG_SCHEMA_V2`): copy the
# claims under their ids, swap the new tables in, index them, and the `claims` view.
_V4_RESHAPE = """
INSERT INTO claim_rows (log_seq, signer, cid_id, key, value, ts, sig)
    SELECT c.log_seq, s.id, g.id, c.key, c.value, c.ts, c.sig FROM claims c
    JOIN signers_v4 s ON s.uid = c.uid JOIN cid_group_v4 g ON g.cid = c.cid
    ORDER BY c.log_seq;

DROP TABLE claims;
DROP TABLE cid_group;
DROP TABLE signers;
ALTER TABLE signers_v4 RENAME TO signers;
ALTER TABLE cid_group_v4 RENAME TO cid_group;
CREATE INDEX cid_group_rid ON cid_group (rid);
CREATE UNIQUE INDEX claims_claim ON claim_rows (cid_id, key, signer);
CREATE INDEX claims_signer ON claim_rows (signer, log_seq);

CREATE VIEW claims AS
    SELECT s.uid AS uid, g.cid AS cid, c.key AS key, c.value AS value, c.ts AS ts,
        c.sig AS sig, c.log_seq AS log_seq
    FROM claim_rows c JOIN signers s ON s.id = c.signer JOIN cid_group g ON g.id = c.cid_id;
"""
SCHEMA_V4 = (
    """
DROP TRIGGER rids_merged_is_empty;

CREATE TABLE signers_v4 (
    id INTEGER PRIMARY KEY,
    uid TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL DEFAULT '',
    weight INTEGER NOT NULL DEFAULT 1 CHECK (weight >= 0),
    status TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'blocked')),
    may_link INTEGER NOT NULL DEFAULT 0 CHECK (may_link IN (0, 1)),
    added_at INTEGER NOT NULL,
    learned_from TEXT
);
INSERT INTO signers_v4 (uid, name, weight, status, may_link, added_at, learned_from)
    SELECT uid, name, weight, status, may_link, added_at, learned_from FROM signers
    ORDER BY added_at, uid;

CREATE TABLE cid_group_v4 (
    id INTEGER PRIMARY KEY,
    cid TEXT NOT NULL UNIQUE,
    rid TEXT NOT NULL REFERENCES rids (rid)
);
INSERT INTO cid_group_v4 (cid, rid) SELECT cid, rid FROM cid_group ORDER BY rid, cid;

CREATE TABLE claim_rows (
    log_seq INTEGER PRIMARY KEY,
    signer INTEGER NOT NULL REFERENCES signers_v4 (id),
    cid_id INTEGER NOT NULL REFERENCES cid_group_v4 (id),
    key TEXT NOT NULL,
    value TEXT,
    ts INTEGER NOT NULL,
    sig BLOB NOT NULL CHECK (length(sig) = 64)
);
"""
    + _V4_RESHAPE
    + """

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
"""
)


def _v4(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V4)


# Schema v5: the outbox's CHECK on `kind` as a chain of `=` (issue 18). SQLite evaluates an
# `IN` list of more than two constants by building it into an ephemeral index once a statement
# run, and `executemany` runs the INSERT once a row: 2 µs of each outbox row, two rows a new
# claim (measured: 4.3 → 2.4 µs a row; the truth's transaction at batch 100 51.8 → 46.3 µs a
# claim, docs/benchmarks.md "Session 20"). A CHECK cannot be changed in place, so the table is
# rebuilt: cheap, as the outbox holds only what the cache has not applied yet. The AUTOINCREMENT
# counter must survive it, or an outbox pruned empty would give its seqs again: the copy's own
# counter (its highest row, below the old counter once rows were pruned) is replaced by the old
# one before DROP TABLE would delete that, and RENAME carries it back to `changes`. PostgreSQL
# compares an `IN` list value by value: its schema keeps it.
SCHEMA_V5 = (
    _outbox(
        "changes_v5",
        "kind = 'claim' OR kind = 'group' OR kind = 'merge' OR kind = 'signer' OR kind = 'local'",
    )
    + """
INSERT INTO changes_v5 (seq, kind, rid, cid, key, uid, survivor, at)
    SELECT seq, kind, rid, cid, key, uid, survivor, at FROM changes ORDER BY seq;
DELETE FROM sqlite_sequence WHERE name = 'changes_v5';
UPDATE sqlite_sequence SET name = 'changes_v5' WHERE name = 'changes';
DROP TABLE changes;
ALTER TABLE changes_v5 RENAME TO changes;
"""
)


def _v5(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V5)


MIGRATIONS: Sequence[Migration] = (_v1, _v2, _v3, _v4, _v5)

# The same schema on PostgreSQL (docs/scale-out.md): the tables and columns of SQLite's v3, each
# with PostgreSQL's types (BIGINT for ms timestamps and counters, BYTEA for signatures); the
# triggers as PL/pgSQL functions (a trigger's WHEN may not hold a subquery there). AUTOINCREMENT
# is `sequences` (what `max_seq` reads, through `pg.REWRITES`) kept by the `changes_seq`
# trigger inside the inserting transaction: a rolled-back insert gives its seq back, as on
# SQLite, so the outbox seqs of a transaction are consecutive (`_written`). `hex()` is SQLite's.
# tests/test_pg.py checks both schemas have the same tables and columns.
PG_SCHEMA_V1 = """
CREATE TABLE signers (
    uid TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    weight BIGINT NOT NULL DEFAULT 1 CHECK (weight >= 0),
    status TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'blocked')),
    may_link INTEGER NOT NULL DEFAULT 0 CHECK (may_link IN (0, 1)),
    added_at BIGINT NOT NULL,
    learned_from TEXT
);

CREATE TABLE rids (
    rid TEXT PRIMARY KEY NOT NULL CHECK (length(rid) = 26),
    status TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'merged')),
    merged_into TEXT REFERENCES rids (rid),
    minted_at BIGINT NOT NULL,
    merged_at BIGINT,
    CHECK ((status = 'active' AND merged_into IS NULL AND merged_at IS NULL)
        OR (status = 'merged' AND merged_into IS NOT NULL AND merged_into < rid
            AND merged_at IS NOT NULL))
);

CREATE TABLE cid_group (
    cid TEXT PRIMARY KEY NOT NULL,
    rid TEXT NOT NULL REFERENCES rids (rid)
);
CREATE INDEX cid_group_rid ON cid_group (rid);

CREATE TABLE claims (
    uid TEXT NOT NULL REFERENCES signers (uid),
    cid TEXT NOT NULL REFERENCES cid_group (cid),
    key TEXT NOT NULL,
    value TEXT,
    ts BIGINT NOT NULL,
    sig BYTEA NOT NULL CHECK (length(sig) = 64),
    log_seq BIGINT,
    PRIMARY KEY (uid, cid, key)
);
CREATE INDEX claims_cid_key ON claims (cid, key);
CREATE UNIQUE INDEX claims_log ON claims (log_seq);

CREATE TABLE changes (
    seq BIGINT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('claim', 'group', 'merge', 'signer', 'local')),
    rid TEXT,
    cid TEXT,
    key TEXT,
    uid TEXT,
    survivor TEXT,
    at BIGINT NOT NULL
);

CREATE TABLE sequences (
    name TEXT PRIMARY KEY NOT NULL,
    seq BIGINT NOT NULL
);
INSERT INTO sequences (name, seq) VALUES ('changes', 0);

CREATE TABLE box (
    name TEXT PRIMARY KEY NOT NULL,
    value TEXT NOT NULL
);
INSERT INTO box (name, value)
    VALUES ('log_id', substr(md5(random()::text || clock_timestamp()::text), 1, 16));

CREATE TABLE peer_tokens (
    name TEXT PRIMARY KEY NOT NULL,
    hash TEXT NOT NULL UNIQUE CHECK (length(hash) = 64),
    created_at BIGINT NOT NULL
);

CREATE TABLE peers (
    name TEXT PRIMARY KEY NOT NULL CHECK (length(name) BETWEEN 1 AND 64),
    url TEXT NOT NULL,
    token TEXT NOT NULL,
    weight BIGINT NOT NULL DEFAULT 0 CHECK (weight >= 0),
    cursor TEXT NOT NULL DEFAULT '',
    accepted BIGINT NOT NULL DEFAULT 0,
    duplicate BIGINT NOT NULL DEFAULT 0,
    stale BIGINT NOT NULL DEFAULT 0,
    rejected BIGINT NOT NULL DEFAULT 0,
    added_at BIGINT NOT NULL
);

CREATE FUNCTION hex(b BYTEA) RETURNS TEXT LANGUAGE sql IMMUTABLE AS
$$ SELECT upper(encode(b, 'hex')) $$;

CREATE FUNCTION changes_seq() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.seq IS NULL THEN
        UPDATE sequences SET seq = seq + 1 WHERE name = 'changes' RETURNING seq INTO NEW.seq;
    ELSE
        UPDATE sequences SET seq = greatest(seq, NEW.seq) WHERE name = 'changes';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER changes_seq BEFORE INSERT ON changes
    FOR EACH ROW EXECUTE FUNCTION changes_seq();

CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%', TG_ARGV[0] USING ERRCODE = 'integrity_constraint_violation';
END $$;

CREATE FUNCTION cid_group_active() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT status FROM rids WHERE rid = NEW.rid) IS DISTINCT FROM 'active' THEN
        RAISE EXCEPTION 'cid_group must point at an active rid'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER cid_group_active BEFORE INSERT OR UPDATE OF rid ON cid_group
    FOR EACH ROW EXECUTE FUNCTION cid_group_active();
CREATE TRIGGER cid_group_no_delete BEFORE DELETE ON cid_group
    FOR EACH ROW EXECUTE FUNCTION refuse('a cid never leaves every group');

CREATE FUNCTION rids_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'merged' AND EXISTS (SELECT 1 FROM cid_group WHERE rid = NEW.rid) THEN
        RAISE EXCEPTION 'a merged rid must hold no cid'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD.status = 'merged' AND NEW.status = 'active' THEN
        RAISE EXCEPTION 'a merged rid never becomes active again'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER rids_status BEFORE UPDATE OF status ON rids
    FOR EACH ROW EXECUTE FUNCTION rids_status();
CREATE TRIGGER rids_no_delete BEFORE DELETE ON rids
    FOR EACH ROW EXECUTE FUNCTION refuse('rids are never deleted, so never reused');
"""


def _pg_v1(conn: Connection) -> None:
    executescript_in_txn(conn, PG_SCHEMA_V1)


# Schema v4 of SQLite on PostgreSQL (its second version): the same tables, columns, indexes and
# view (`SCHEMA_V4`'s comment says why). The ids are given as SQLite gives a rowid, one above
# the largest (`next_id`, under the store's write lock, so no two writers race for one); an id
# given explicitly (`migrate-storage` copies them) is kept. The copy numbers the rows itself.
# cid_group's triggers go with the old table and are made again; `rids_status` reads cid_group
# by name when it runs, so it reads the new one. A claim without a log seq (none: every
# statement that stores one gives it) would fail the copy, which then changes nothing.
PG_SCHEMA_V2 = (
    """
CREATE TABLE signers_v4 (
    id BIGINT PRIMARY KEY,
    uid TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL DEFAULT '',
    weight BIGINT NOT NULL DEFAULT 1 CHECK (weight >= 0),
    status TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'blocked')),
    may_link INTEGER NOT NULL DEFAULT 0 CHECK (may_link IN (0, 1)),
    added_at BIGINT NOT NULL,
    learned_from TEXT
);
INSERT INTO signers_v4 (id, uid, name, weight, status, may_link, added_at, learned_from)
    SELECT row_number() OVER (ORDER BY added_at, uid), uid, name, weight, status, may_link,
        added_at, learned_from FROM signers;

CREATE TABLE cid_group_v4 (
    id BIGINT PRIMARY KEY,
    cid TEXT NOT NULL UNIQUE,
    rid TEXT NOT NULL REFERENCES rids (rid)
);
INSERT INTO cid_group_v4 (id, cid, rid)
    SELECT row_number() OVER (ORDER BY rid, cid), cid, rid FROM cid_group;

CREATE TABLE claim_rows (
    log_seq BIGINT PRIMARY KEY,
    signer BIGINT NOT NULL REFERENCES signers_v4 (id),
    cid_id BIGINT NOT NULL REFERENCES cid_group_v4 (id),
    key TEXT NOT NULL,
    value TEXT,
    ts BIGINT NOT NULL,
    sig BYTEA NOT NULL CHECK (length(sig) = 64)
);
"""
    + _V4_RESHAPE
    + """

CREATE FUNCTION next_id() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id IS NULL THEN
        EXECUTE format('SELECT coalesce(max(id), 0) + 1 FROM %I.%I',
            TG_TABLE_SCHEMA, TG_TABLE_NAME) INTO NEW.id;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER signers_id BEFORE INSERT ON signers
    FOR EACH ROW EXECUTE FUNCTION next_id();
CREATE TRIGGER cid_group_id BEFORE INSERT ON cid_group
    FOR EACH ROW EXECUTE FUNCTION next_id();

CREATE TRIGGER cid_group_active BEFORE INSERT OR UPDATE OF rid ON cid_group
    FOR EACH ROW EXECUTE FUNCTION cid_group_active();
CREATE TRIGGER cid_group_no_delete BEFORE DELETE ON cid_group
    FOR EACH ROW EXECUTE FUNCTION refuse('a cid never leaves every group');
"""
)


def _pg_v2(conn: Connection) -> None:
    executescript_in_txn(conn, PG_SCHEMA_V2)


PG_MIGRATIONS: Sequence[Migration] = (_pg_v1, _pg_v2)


# -- reads --------------------------------------------------------------------------------------


def max_seq(conn: Connection) -> int:
    """The newest outbox seq ever written: AUTOINCREMENT keeps it in `sqlite_sequence` after
    the rows themselves are pruned."""
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
    return int(row[0]) if row else 0


# -- migrate-storage ----------------------------------------------------------------------------

# The truth's tables as `metanode migrate-storage` copies them: parents before the rows that
# name them (the foreign keys; a merged rid names an older survivor, so rids go in rid order).
COPIED_TABLES: tuple[tuple[str, str], ...] = (
    ("signers", "id"),
    ("rids", "rid"),
    ("cid_group", "id"),
    ("claim_rows", "log_seq"),
    ("changes", "seq"),
    ("box", "name"),
    ("peer_tokens", "name"),
    ("peers", "name"),
)
SEEDED = ("box",)  # rows the schema makes itself (the log id): the copy's replace them


def copy_txn(dest: Connection, source: Connection) -> dict[str, int]:
    """Copy a whole truth (one snapshot of `source`) into the empty truth `dest`: every table
    (`COPIED_TABLES`), the box's log id (so peers' cursors stay valid), and the outbox counter,
    which is ahead of the rows left after pruning; rows copied per table."""
    with snapshot(source):
        for table in SEEDED:
            dest.execute(f"DELETE FROM {table}")
        counts = {table: copy_table(dest, source, table, order) for table, order in COPIED_TABLES}
        dest.execute(
            "UPDATE sqlite_sequence SET seq = ? WHERE name = 'changes'", (max_seq(source),)
        )
    return counts


def min_seq(conn: Connection) -> int | None:
    """The oldest outbox seq still stored, or None if every row was pruned."""
    value: int | None = conn.execute("SELECT min(seq) FROM changes").fetchone()[0]
    return value


def max_rid(conn: Connection) -> str | None:
    row = conn.execute("SELECT max(rid) FROM rids").fetchone()
    return row[0] if row else None


def json_array(values: Iterable[object]) -> str:
    """`values` as one SQL parameter, read back with `IN (SELECT value FROM json_each(?))`: a
    set-based statement for a whole batch with one fixed SQL text, however many values."""
    return json.dumps(list(values), ensure_ascii=False)


def group_of(conn: Connection, cid: str) -> str | None:
    row = conn.execute("SELECT rid FROM cid_group WHERE cid = ?", (cid,)).fetchone()
    return row[0] if row else None


def groups_of(conn: Connection, cids: Iterable[str]) -> dict[str, str]:
    """cid → rid of every grouped CID among `cids` (one query; an ungrouped CID is absent)."""
    return dict(
        conn.execute(
            "SELECT cid, rid FROM cid_group WHERE cid IN (SELECT value FROM json_each(?))",
            (json_array(set(cids)),),
        ).fetchall()
    )


def group_cids(conn: Connection, rid: str) -> list[str]:
    return [r[0] for r in conn.execute("SELECT cid FROM cid_group WHERE rid = ?", (rid,))]


def groups_cids(conn: Connection, rids: Iterable[str]) -> dict[str, list[str]]:
    """rid → its CIDs, for many groups in one query (a rid holding none is absent)."""
    found: dict[str, list[str]] = {}
    for rid, cid in conn.execute(
        "SELECT rid, cid FROM cid_group WHERE rid IN (SELECT value FROM json_each(?))",
        (json_array(set(rids)),),
    ):
        found.setdefault(rid, []).append(cid)
    return found


def active_rids(conn: Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT rid FROM rids WHERE status = 'active' ORDER BY rid")]


def rids_after(conn: Connection, after: str, limit: int) -> list[str]:
    """The first `limit` active rids after `after`, in order: a step of a rebuild in place
    (`cache.rebuild_step`), through the rids' primary key."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT rid FROM rids WHERE rid > ? AND status = 'active' ORDER BY rid LIMIT ?",
            (after, limit),
        )
    ]


@dataclass(frozen=True)
class RidInfo:
    rid: str
    status: str
    merged_into: str | None


def rid_info(conn: Connection, rid: str) -> RidInfo | None:
    row = conn.execute("SELECT rid, status, merged_into FROM rids WHERE rid = ?", (rid,)).fetchone()
    return RidInfo(*row) if row else None


def survivor(conn: Connection, rid: str) -> str:
    """The active rid that `rid` is now part of (itself if active)."""
    info = rid_info(conn, rid)
    while info is not None and info.merged_into is not None:
        info = rid_info(conn, info.merged_into)
    return info.rid if info else rid


def survivors(conn: Connection, rids: Iterable[str]) -> dict[str, str]:
    """`survivor` of each of `rids`, one query per step of the longest chain instead of one per
    rid and step (merges keep chains one step long, so usually two queries in all)."""
    found: dict[str, str] = {}
    walking = {rid: rid for rid in rids}  # start → where its walk has got to
    while walking:
        merged_into = dict(
            conn.execute(
                "SELECT rid, merged_into FROM rids WHERE rid IN (SELECT value FROM json_each(?))",
                (json_array(set(walking.values())),),
            ).fetchall()
        )
        step: dict[str, str] = {}
        for start, rid in walking.items():
            if rid not in merged_into:  # unknown rid: `survivor` answers the rid asked about
                found[start] = start
            elif merged_into[rid] is None:
                found[start] = rid
            else:
                step[start] = merged_into[rid]
        walking = step
    return found


_CLAIM_COLUMNS = "uid, cid, key, value, ts, sig"
# A group's claims from the tables themselves (not the `claims` view): `g` its CIDs, `c` their
# claims, `s` the signers, so the group's rid leads through `cid_group_rid`.
_GROUP_CLAIMS = (
    "SELECT g.rid, s.uid, g.cid, c.key, c.value, c.ts, c.sig "
    "FROM cid_group g JOIN claim_rows c ON c.cid_id = g.id JOIN signers s ON s.id = c.signer"
)


def _claim(row: Sequence[Any]) -> Claim:
    return Claim(row[0], row[1], row[2], row[3], row[4], bytes(row[5]))


def stored_claim(conn: Connection, uid: str, cid: str, key: str) -> Claim | None:
    row = conn.execute(
        f"SELECT {_CLAIM_COLUMNS} FROM claims WHERE cid = ? AND key = ? AND uid = ?",
        (cid, key, uid),
    ).fetchone()
    return _claim(row) if row else None


ClaimId = tuple[str, str, str]  # (uid, cid, key): what one stored claim is kept per


def stored_claims(conn: Connection, ids: Iterable[ClaimId]) -> dict[ClaimId, Claim]:
    """`stored_claim` of many (uid, cid, key) in one query; those with no stored claim are
    absent."""
    rows = conn.execute(
        f"SELECT {_CLAIM_COLUMNS} FROM claims WHERE (cid, key, uid) IN "
        "(SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), "
        "json_extract(value, '$[2]') FROM json_each(?))",
        (json_array({(cid, key, uid) for uid, cid, key in ids}),),
    )
    return {(row[0], row[1], row[2]): _claim(row) for row in rows}


def group_claims(
    conn: Connection,
    rid: str,
    keys: Iterable[str] | None = None,
    uid: str | None = None,
    live_only: bool = True,
) -> list[Claim]:
    """Stored claims on every CID of a group, optionally only some keys or one signer."""
    sql = _GROUP_CLAIMS + " WHERE g.rid = ?"
    params: list[Any] = [rid]
    if live_only:
        sql += " AND c.value IS NOT NULL"
    if uid is not None:
        # `+ 0`: not through `claims_signer`, which the planner (no statistics) would pick to
        # read every claim of the signer; the group's few claims are read by its rid instead.
        sql += " AND c.signer + 0 = (SELECT id FROM signers WHERE uid = ?)"
        params.append(uid)
    if keys is not None:
        wanted = sorted(set(keys))
        sql += f" AND c.key IN ({','.join('?' * len(wanted))})"
        params.extend(wanted)
    sql += " ORDER BY g.cid, c.key, s.uid"
    return [_claim(row[1:]) for row in conn.execute(sql, params)]


def newest_said(conn: Connection, uid: str, pairs: Iterable[tuple[str, str]]) -> Claim | None:
    """`uid`'s newest stored claim, tombstones included, on the key of any (cid, key) pair
    about any CID of that cid's group: what a new word of `uid` on those pairs must be dated
    after to count (SPEC §2.3 keeps the newer claim per CID, §2.5 a signer's newest vote across
    the group). None if it said nothing there."""
    wanted: dict[str, set[str]] = {}
    for cid, key in pairs:
        wanted.setdefault(cid, set()).add(key)
    if not wanted:  # a plugin run asks before it has drafts: only the clock is in question
        return None
    by_rid: dict[str, set[str]] = {}
    for cid, rid in groups_of(conn, wanted).items():  # an ungrouped CID has no claims yet
        by_rid.setdefault(rid, set()).update(wanted[cid])
    said = [
        claim
        for rid, keys in sorted(by_rid.items())
        for claim in group_claims(conn, rid, keys, uid, live_only=False)
    ]
    return max(said, key=lambda claim: claim.ts, default=None)


def said_about(conn: Connection, uid: str, cid: str) -> list[Claim]:
    """`uid`'s live stored claims about exactly `cid` (a plugin's earlier run: what its new
    run replaces), in one snapshot."""
    with snapshot(conn):
        rid = group_of(conn, cid)
        if rid is None:
            return []
        return [c for c in group_claims(conn, rid, uid=uid) if c.cid == cid]


def groups_claims(
    conn: Connection, rids: Iterable[str], keys: Iterable[str] | None = None
) -> dict[str, list[Claim]]:
    """rid → the live stored claims on every CID of each group, optionally only some keys:
    `group_claims` of many groups in one query (in no particular order)."""
    sql = _GROUP_CLAIMS + (
        " WHERE g.rid IN (SELECT value FROM json_each(?)) AND c.value IS NOT NULL"
    )
    params = [json_array(set(rids))]
    if keys is not None:
        sql += " AND c.key IN (SELECT value FROM json_each(?))"
        params.append(json_array(set(keys)))
    found: dict[str, list[Claim]] = {}
    for row in conn.execute(sql, params):
        found.setdefault(row[0], []).append(_claim(row[1:]))
    return found


def all_claims(conn: Connection, uid: str | None = None) -> Iterable[Claim]:
    """Every stored claim, optionally of one signer, in claim-log order: the table's own order
    (or `claims_signer`'s), so an export streams without sorting the whole truth."""
    sql = f"SELECT {_CLAIM_COLUMNS} FROM claims"
    params: tuple[str, ...] = ()
    if uid is not None:
        sql, params = sql + " WHERE uid = ?", (uid,)
    return (_claim(row) for row in conn.execute(sql + " ORDER BY log_seq", params))


def claim_count(conn: Connection, uid: str | None = None) -> int:
    """How many claims are stored (tombstones too), optionally of one signer: an export's total."""
    if uid is None:
        return int(conn.execute("SELECT count(*) FROM claim_rows").fetchone()[0])
    return int(conn.execute("SELECT count(*) FROM claims WHERE uid = ?", (uid,)).fetchone()[0])


def rid_status_counts(conn: Connection) -> dict[str, int]:
    """How many rids are in each lifecycle status (`active`, `merged`): the /metrics gauges."""
    return {
        status: int(n)
        for status, n in conn.execute("SELECT status, count(*) FROM rids GROUP BY status")
    }


def signer_claims(conn: Connection, uid: str, after: int, limit: int) -> list[tuple[int, str, str]]:
    """(log seq, cid, key) of the first `limit` claims of a signer after claim-log seq
    `after`, in log order (through `claims_signer`): what blocking or re-weighing it can change,
    a chunk at a time. A claim replaced since moved to the log's end, so a walk from 0 meets
    every claim the signer holds when it ends."""
    return [
        (int(r[0]), r[1], r[2])
        for r in conn.execute(
            "SELECT log_seq, cid, key FROM claims WHERE uid = ? AND log_seq > ? "
            "ORDER BY log_seq LIMIT ?",
            (uid, after, limit),
        )
    ]


@dataclass(frozen=True)
class SignerRow:
    uid: str
    name: str
    weight: int
    status: str
    may_link: bool
    added_at: int
    learned_from: str | None = None  # the peer it was first seen through (docs/peers.md)

    def as_json(self) -> dict[str, Any]:
        body = {
            "uid": self.uid,
            "name": self.name,
            "weight": self.weight,
            "status": self.status,
            "may_link": self.may_link,
            "added_at": self.added_at,
        }
        if self.learned_from is not None:
            body["learned_from"] = self.learned_from
        return body


_SIGNER_COLUMNS = "uid, name, weight, status, may_link, added_at, learned_from"


def _signer(row: Sequence[Any]) -> SignerRow:
    return SignerRow(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6])


def signer(conn: Connection, uid: str) -> SignerRow | None:
    row = conn.execute(f"SELECT {_SIGNER_COLUMNS} FROM signers WHERE uid = ?", (uid,)).fetchone()
    return _signer(row) if row else None


def signers(conn: Connection) -> list[SignerRow]:
    return [_signer(r) for r in conn.execute(f"SELECT {_SIGNER_COLUMNS} FROM signers ORDER BY uid")]


def merge_signers(conn: Connection, uids: Iterable[str]) -> dict[str, merge.Signer]:
    """Weights and blocks of `uids` (those the truth knows), as the merge rules take them.

    Only the signers asked for: every apply needs those of the votes it merges, and reading
    all of them cost 1.2 µs a known signer an apply (1.2 ms at 1,000, a peer's signers
    included; docs/benchmarks.md "Session 20")."""
    return {
        uid: merge.Signer(weight=weight, blocked=status == "blocked")
        for uid, weight, status in conn.execute(
            "SELECT uid, weight, status FROM signers WHERE uid IN (SELECT value FROM json_each(?))",
            (json_array(set(uids)),),
        )
    }


def changes_after(conn: Connection, seq: int) -> list[Change]:
    return [
        Change._make(row)
        for row in conn.execute(
            "SELECT seq, kind, rid, cid, key, uid, survivor FROM changes "
            "WHERE seq > ? ORDER BY seq",
            (seq,),
        )
    ]


# -- the claim log and peers (docs/peers.md) ---------------------------------------------------


def max_log_seq(conn: Connection) -> int:
    """The newest claim-log seq ever given (0: none): claims are never deleted and a replacement
    always takes a higher seq, so the largest stored one is the newest given."""
    return int(conn.execute("SELECT coalesce(max(log_seq), 0) FROM claim_rows").fetchone()[0])


def log_id(conn: Connection) -> str:
    """The random name of this truth's claim log, part of every cursor it gives."""
    return str(conn.execute("SELECT value FROM box WHERE name = 'log_id'").fetchone()[0])


def claim_owner_txn(conn: Connection, uid: str, adopt: bool) -> list[str]:
    """The box's owner is `uid`: recorded in `box` the first time, and `OwnerMismatch` if
    another is recorded, unless `adopt` (`metanode init --new-owner`: the recorded key is lost,
    or this is another box seeded from a copy of the truth). The one place of the rule. Returns
    the owner keys adopted over (none, or one; or several from a truth before `box.owner`
    that registered several), which keep their signer rows and weights: their edits stand until
    they are blocked, which withdraws them. They are renamed `former owner`, so the registry
    names one `owner`."""
    row = conn.execute("SELECT value FROM box WHERE name = 'owner'").fetchone()
    recorded = str(row[0]) if row is not None else _registered_owner(conn, uid)
    if recorded == uid or adopt:
        if row is None or row[0] != uid:  # written once, not at every start
            conn.execute("DELETE FROM box WHERE name = 'owner'")
            conn.execute("INSERT INTO box (name, value) VALUES ('owner', ?)", (uid,))
        former = [] if recorded == uid else recorded.split(", ")
        conn.executemany(
            "UPDATE signers SET name = 'former owner' WHERE uid = ?", [(old,) for old in former]
        )
        return former
    raise OwnerMismatch(
        f"this node's databases belong to the owner key {recorded}, but this data "
        f"directory's keys/owner.key is {uid}: copy keys/ from the node's data directory "
        "(docs/scale-out.md), or put them back from the backup: its keys-<stamp>/ copied into "
        "keys/ (`metanode restore --keys` only to put the backup's truth back with them: it "
        "drops the claims made since); if that "
        "key is lost for good, or this is another box seeded from a copy, `metanode init "
        "--new-owner` makes this one the owner"
    )


def _registered_owner(conn: Connection, uid: str) -> str:
    """Whose a truth from before `box.owner` is: its registered signer(s) named `owner`, or
    `uid`'s when there is none (a new truth) or `uid` is one of them."""
    named = [str(r[0]) for r in conn.execute("SELECT uid FROM signers WHERE name = 'owner'")]
    return uid if not named or uid in named else ", ".join(sorted(named))


def renew_log_txn(conn: Connection) -> str:
    """A new `box.log_id` (returned), for a truth put back from a backup: its seqs after the
    backup's end will be given again to other claims, so a follower's cursor of the log as it
    was would be taken for a place in this one and the claims below it skipped. Another log id
    makes every such cursor `invalid_cursor`, and the follower reconciles (peers.md)."""
    new = secrets.token_hex(LOG_ID_BYTES)
    conn.execute("UPDATE box SET value = ? WHERE name = 'log_id'", (new,))
    return new


LOG_ID_BYTES = 8  # as the schema's own `randomblob(8)`


def log_cursor(name: str, seq: int) -> str:
    return f"{name}.{seq}"


def parse_log_cursor(conn: Connection, cursor: str | None) -> int:
    """The seq a cursor of this log names (None: the start); 400 `invalid_cursor` for one that is
    malformed, of another box's log, or beyond this log's end."""
    if cursor is None or cursor == "":
        return 0
    name, _, number = cursor.partition(".")
    if not (number.isascii() and number.isdigit() and len(number) <= 18):
        raise InvalidCursor(f"{cursor!r} is not a claim-log cursor (<log id>.<seq>)")
    if name != log_id(conn):
        raise InvalidCursor(f"{cursor!r} is a cursor of another box's claim log")
    seq = int(number)
    if seq > max_log_seq(conn):
        raise InvalidCursor(f"{cursor!r} is beyond the end of this claim log")
    return seq


@dataclass(frozen=True)
class LogPage:
    claims: list[Claim]
    next: str
    more: bool


def claims_log(conn: Connection, after: int, limit: int, uid: str | None) -> LogPage:
    """A page of the claim log after seq `after`, in the order the claims were stored."""
    sql = f"SELECT {_CLAIM_COLUMNS}, log_seq FROM claims WHERE log_seq > ?"
    params: list[Any] = [after]
    if uid is not None:
        sql += " AND uid = ?"
        params.append(uid)
    rows = conn.execute(sql + " ORDER BY log_seq LIMIT ?", (*params, limit + 1)).fetchall()
    page = rows[:limit]
    last = page[-1][6] if page else after
    return LogPage([_claim(r) for r in page], log_cursor(log_id(conn), last), len(rows) > limit)


ID_BYTES = 16  # a claim's identity in set reconciliation: the first bytes of its signature


def claim_ids(conn: Connection) -> tuple[str, list[bytes]]:
    """(the log's cursor at its end, every stored claim's identity), in one snapshot."""
    with snapshot(conn):
        head = log_cursor(log_id(conn), max_log_seq(conn))
        ids = [
            bytes(r[0]) for r in conn.execute(f"SELECT substr(sig, 1, {ID_BYTES}) FROM claim_rows")
        ]
    return head, ids


def claims_by_ids(conn: Connection, ids: Iterable[bytes]) -> list[Claim]:
    """The stored claims with these identities (one scan: reconciliation fetches few)."""
    rows = conn.execute(
        f"SELECT {_CLAIM_COLUMNS} FROM claims WHERE hex(substr(sig, 1, {ID_BYTES})) IN "
        "(SELECT value FROM json_each(?)) ORDER BY log_seq",
        (json_array(i.hex().upper() for i in ids),),
    )
    return [_claim(r) for r in rows]


@dataclass(frozen=True)
class PeerRow:
    name: str
    url: str
    token: str
    weight: int
    cursor: str
    accepted: int
    duplicate: int
    stale: int
    rejected: int
    added_at: int


_PEER_COLUMNS = "name, url, token, weight, cursor, accepted, duplicate, stale, rejected, added_at"


def peers(conn: Connection) -> list[PeerRow]:
    return [PeerRow(*r) for r in conn.execute(f"SELECT {_PEER_COLUMNS} FROM peers ORDER BY name")]


def peer(conn: Connection, name: str) -> PeerRow | None:
    row = conn.execute(f"SELECT {_PEER_COLUMNS} FROM peers WHERE name = ?", (name,)).fetchone()
    return PeerRow(*row) if row else None


@dataclass(frozen=True)
class PeerTokenRow:
    name: str
    created_at: int


def peer_tokens(conn: Connection) -> list[PeerTokenRow]:
    return [
        PeerTokenRow(*r)
        for r in conn.execute("SELECT name, created_at FROM peer_tokens ORDER BY name")
    ]


def peer_token_named(conn: Connection, digest: str) -> str | None:
    """The name of the peer token whose SHA-256 is `digest`, or None."""
    row = conn.execute("SELECT name FROM peer_tokens WHERE hash = ?", (digest,)).fetchone()
    return row[0] if row else None


# -- signer policy ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    accept_unknown_signers: bool = False


def policy_error(row: SignerRow | None, claim: Claim, policy: Policy) -> SignerPolicyError | None:
    """Why this signer may not make this claim, or None (SPEC §2.2, last two rules)."""
    if row is None:
        if not policy.accept_unknown_signers:
            return UnknownSigner(
                f"signer {claim.uid} is not registered (POST /api/signers or `metanode "
                "signers add` registers it)"
            )
        if claim.is_link:
            return LinkNotPermitted(f"unregistered signer {claim.uid} may not link groups")
        return None
    if row.status == "blocked":
        return BlockedSigner(f"signer {claim.uid} is blocked")
    if claim.is_link and not row.may_link:
        return LinkNotPermitted(f"signer {claim.uid} may not link groups (may_link is off)")
    return None


def check_policy(
    conn: Connection,
    batch: Sequence[Claim],
    policy: Policy,
    rows: dict[str, SignerRow | None] | None = None,
) -> set[str]:
    """Raise `InvalidBatch` (403) listing every claim whose signer may not make it; else the
    batch's signers that are registered already. `rows`: signer rows read already (uid → row
    or None), kept current with those read here (a group reads each signer once)."""
    rows = {} if rows is None else rows
    for uid in {c.uid for c in batch} - rows.keys():
        rows[uid] = signer(conn, uid)
    items = []
    for index, claim in enumerate(batch):
        error = policy_error(rows[claim.uid], claim, policy)
        if error is not None:
            items.append({"index": index, "error": error.slug, "message": error.message})
    if items:
        raise InvalidBatch(items, status=403)
    return {c.uid for c in batch if rows[c.uid] is not None}


# -- writes -------------------------------------------------------------------------------------


RESERVE_PAGES = 1024  # free pages kept for the next writes (4 MiB) when the outbox is pruned


def prune_changes_txn(conn: Connection, applied_seq: int) -> int:
    """Drop the outbox rows the cache has applied (the cache is all that reads them), and give
    their space back (`db.reclaim`), so truth.db holds the claims and little else; returns how
    many rows. The seq counter stays, so seqs are never reused."""
    pruned = conn.execute("DELETE FROM changes WHERE seq <= ?", (applied_seq,)).rowcount
    reclaim(conn, RESERVE_PAGES)
    return pruned


ChangeRow = tuple[str, str | None, str | None, str | None, str | None, str | None, int]


def _change(
    now_ms: int,
    kind: str,
    *,
    rid: str | None = None,
    cid: str | None = None,
    key: str | None = None,
    uid: str | None = None,
    survivor: str | None = None,
) -> ChangeRow:
    """One outbox row, as `_write_changes` inserts it."""
    return (kind, rid, cid, key, uid, survivor, now_ms)


OUTBOX_INSERT = (
    "INSERT INTO changes (kind, rid, cid, key, uid, survivor, at) VALUES (?, ?, ?, ?, ?, ?, ?)"
)


def _write_changes(conn: Connection, rows: Iterable[ChangeRow]) -> None:
    """Append outbox rows; their seqs follow the order of `rows`."""
    conn.executemany(OUTBOX_INSERT, rows)


class _Groups:
    """The grouping of one transaction: every CID join, mint and merge, and the outbox rows.

    Why a class: per new claim this was a `cid_group` lookup, a `max(rid)`, an insert into
    `rids`, one into `cid_group` and one into `changes`, each its own statement. Here the groups
    of the CIDs the transaction names are read in one query and kept current in memory as CIDs
    join and groups merge (a CID not named up front is looked up when asked). New rids,
    memberships and outbox rows wait in lists and are written with `executemany` by `flush`,
    which a merge also calls first, as its UPDATEs must see them. The rid floor is read at the
    first mint only: while this transaction holds the write lock no one else adds a rid.
    """

    def __init__(
        self,
        conn: Connection,
        now_ms: int,
        cids: Iterable[str],
        minter: Minter | None = None,
    ) -> None:
        self._conn = conn
        self._now_ms = now_ms
        self._minter = minter  # None: this transaction only joins and merges (adoption)
        self._floor_seen = False
        self._rid: dict[str, str | None] = dict.fromkeys(cids)
        self._members: dict[str, list[str]] = {}  # rid → the CIDs of `_rid` it holds
        for cid, rid in groups_of(conn, self._rid).items():
            self._remember(cid, rid)
        self._new_rids: list[tuple[str, int]] = []
        self._joins: list[tuple[str, str]] = []
        self.outbox: list[ChangeRow] = []
        self.written: list[ChangeRow] = []  # every outbox row flushed, in seq order
        self.minted: list[str] = []

    def _remember(self, cid: str, rid: str) -> None:
        self._rid[cid] = rid
        self._members.setdefault(rid, []).append(cid)

    def rid_of(self, cid: str) -> str | None:
        """`group_of(cid)` as of this transaction's writes so far."""
        if cid not in self._rid:
            rid = self._rid[cid] = group_of(self._conn, cid)
            if rid is not None:
                self._remember(cid, rid)
        return self._rid[cid]

    def _mint(self) -> str:
        """A new rid, above every rid the truth holds (also those minted by other processes)."""
        assert self._minter is not None, "adoption never mints"
        if not self._floor_seen:
            floor = max_rid(self._conn)
            if floor is not None:
                self._minter.observe(floor)
            self._floor_seen = True
        rid = self._minter.mint()
        self._new_rids.append((rid, self._now_ms))
        self.minted.append(rid)
        return rid

    def join(self, cid: str, rid: str) -> None:
        """Put an ungrouped CID in group `rid`."""
        self._remember(cid, rid)
        self._joins.append((cid, rid))
        self.outbox.append(_change(self._now_ms, "group", rid=rid, cid=cid))

    def ensure(self, cid: str) -> str:
        """The rid of `cid`'s group; a first-seen CID with no link gets a freshly minted one."""
        rid = self.rid_of(cid)
        if rid is None:
            rid = self._mint()
            self.join(cid, rid)
        return rid

    def link(self, a: str, b: str) -> None:
        """Put `a` and `b` in one group; two existing groups merge and the older rid survives."""
        if a == b:  # a self-link links nothing; the CID still needs its group
            self.ensure(a)
            return
        ra, rb = self.rid_of(a), self.rid_of(b)
        if ra is None and rb is None:
            ra = self.ensure(a)
        if ra is None:
            self.join(a, rb)  # type: ignore[arg-type]  # rb is set here
        elif rb is None:
            self.join(b, ra)
        elif ra != rb:
            self.merge(min(ra, rb), max(ra, rb))

    def merge(self, keep: str, lose: str) -> None:
        """Move every CID of `lose` to `keep` and retire `lose` for good (SPEC §2.4)."""
        self.flush()
        conn = self._conn
        conn.execute("UPDATE cid_group SET rid = ? WHERE rid = ?", (keep, lose))
        conn.execute(
            "UPDATE rids SET status = 'merged', merged_into = ?, merged_at = ? WHERE rid = ?",
            (keep, self._now_ms, lose),
        )
        # Keep every merged rid one step from its survivor, so a lookup never walks a chain.
        conn.execute("UPDATE rids SET merged_into = ? WHERE merged_into = ?", (keep, lose))
        self.outbox.append(_change(self._now_ms, "merge", rid=lose, survivor=keep))
        moved = self._members.pop(lose, [])
        self._members.setdefault(keep, []).extend(moved)
        self._rid.update(dict.fromkeys(moved, keep))

    def flush(self) -> None:
        """Write what waits: rids before the memberships that point at them, then the outbox."""
        self._conn.executemany("INSERT INTO rids (rid, minted_at) VALUES (?, ?)", self._new_rids)
        self._conn.executemany("INSERT INTO cid_group (cid, rid) VALUES (?, ?)", self._joins)
        _write_changes(self._conn, self.outbox)
        self.written += self.outbox
        self._new_rids, self._joins, self.outbox = [], [], []

    def fresh(self, live: Iterable[Claim]) -> dict[str, Fresh]:
        """The groups minted by this transaction and still standing, each with its CIDs (all
        joined here) and, among `live`, the claims on them: what the cache's apply is handed
        instead of reading them back (`view.Written`)."""
        standing = [rid for rid in self.minted if rid in self._members]
        claims: dict[str, list[Claim]] = {}
        for claim in live:
            rid = self._rid.get(claim.cid)
            if rid is not None:
                claims.setdefault(rid, []).append(claim)
        return {
            rid: Fresh(tuple(self._members[rid]), tuple(claims.get(rid, ()))) for rid in standing
        }


def ensure_group(conn: Connection, cid: str, minter: Minter, now_ms: int) -> str:
    """`_Groups.ensure` of one CID, written at once (for callers that group CIDs one by one in
    their own transaction, such as the migration tool)."""
    groups = _Groups(conn, now_ms, [cid], minter)
    rid = groups.ensure(cid)
    groups.flush()
    return rid


def _store(conn: Connection, accepted: Sequence[Claim]) -> None:
    """Upsert accepted claims in order (of two on one (uid, cid, key) the later is kept), each
    at the next claim-log seq: a replaced claim leaves the log, its replacement joins the end.
    The signer and the CID are named by id (schema v4), looked up by their unique text."""
    first = max_log_seq(conn) + 1
    conn.executemany(
        "INSERT INTO claim_rows (signer, cid_id, key, value, ts, sig, log_seq) VALUES "
        "((SELECT id FROM signers WHERE uid = ?), (SELECT id FROM cid_group WHERE cid = ?), "
        "?, ?, ?, ?, ?) "
        "ON CONFLICT (cid_id, key, signer) DO UPDATE SET value = excluded.value, "
        "ts = excluded.ts, sig = excluded.sig, log_seq = excluded.log_seq",
        [(c.uid, c.cid, c.key, c.value, c.ts, c.sig, n) for n, c in enumerate(accepted, first)],
    )


def _register_unknown(conn: Connection, uid: str, now_ms: int) -> None:
    conn.execute(
        "INSERT INTO signers (uid, added_at) VALUES (?, ?) ON CONFLICT DO NOTHING", (uid, now_ms)
    )


INGEST_GROUP = "ingest"  # the writer's group of `ingest_txn` jobs: they share a transaction


@dataclass(frozen=True)
class IngestResult:
    verdicts: list[Verdict]
    seq: int  # the outbox seq the cache must reach for these claims to be visible
    written: Written = Written(())  # what the transaction wrote, for the cache's apply


def _named_cids(batch: Iterable[Claim]) -> set[str]:
    """Every CID a batch may group: each claim's CID and each link's member."""
    named = {claim.cid for claim in batch}
    named.update(claim.member for claim in batch if claim.member is not None)
    return named


def ingest_txn(
    conn: Connection,
    batch: Sequence[Claim],
    minter: Minter,
    policy: Policy,
    now_ms: int,
    peer_cursor: PeerCursor | None = None,
) -> IngestResult:
    """Store a validated batch atomically: policy first, then newest-wins per (uid, cid, key).

    Claims are applied in batch order, so a batch holding the same claim twice gets `accepted`
    then `duplicate`, exactly as two batches would (`_store_batches`).
    `peer_cursor`: the batch is a page pulled from a peer; its cursor and counts are stored in
    this same transaction, so a crash never skips or re-applies a page (docs/peers.md).
    """
    known = check_policy(conn, batch, policy)
    result = _store_batches(conn, [batch], known, minter, now_ms)[0]
    if peer_cursor is not None:
        advance_peer(conn, peer_cursor, result.verdicts)
    return result


def _validated(
    limits: Limits, items: Sequence[object], minter: Minter, policy: Policy, now: int
) -> tuple[Sequence[Claim], Minter, Policy, int]:
    """`TruthStore.ingest_wire`'s `prepare`: `ingest_txn`'s arguments with the batch validated."""
    return validate_batch(items, now, limits), minter, policy, now


def ingest_many_txn(conn: Connection, jobs: Sequence[tuple[Any, ...]]) -> list[Outcome]:
    """Group commit's combiner of queued `ingest_txn(batch, minter, policy, now)` jobs
    (`db.Writer`): every batch its signers' policy allows, resolved in ONE pass (one read of
    the stored claims and of the groups, one write of each table) instead of a round of
    statements per request; the verdicts are those of running them one after the other. A batch
    the policy refuses fails alone. Each batch's seq is the group's last (they commit together);
    the first carries what the whole group wrote, for the cache (`Applier.hand`)."""
    outcomes: list[Outcome] = []
    allowed: list[Sequence[Claim]] = []
    known: set[str] = set()
    rows: dict[str, SignerRow | None] = {}
    for batch, _minter, policy, _now in jobs:
        try:
            known |= check_policy(conn, batch, policy, rows)
        except InvalidBatch as exc:
            outcomes.append((False, exc))
            continue
        outcomes.append((True, None))
        allowed.append(batch)
    minter, now_ms = jobs[0][1], max(job[3] for job in jobs)
    results = iter(_store_batches(conn, allowed, known, minter, now_ms) if allowed else ())
    return [(True, next(results)) if ok else (ok, value) for ok, value in outcomes]


def _store_batches(
    conn: Connection,
    batches: Sequence[Sequence[Claim]],
    known: set[str],
    minter: Minter,
    now_ms: int,
) -> list[IngestResult]:
    """Store policy-checked batches in order, as one: each claim is resolved against the stored
    claims read in one query up front, updated in memory by every claim accepted before it;
    groups, outbox rows and claims are written set-wise (`_Groups`, `_store`) once all are
    resolved. `known`: the registered signers among theirs. One result a batch; the first holds
    what all of them wrote."""
    every = [claim for batch in batches for claim in batch]
    before = max_seq(conn)
    stored = stored_claims(conn, ((c.uid, c.cid, c.key) for c in every))
    groups = _Groups(conn, now_ms, _named_cids(every), minter)
    verdicts: list[Verdict] = []
    accepted: list[Claim] = []
    for claim in every:
        ident = (claim.uid, claim.cid, claim.key)
        verdict = merge.resolve(stored.get(ident), claim)
        verdicts.append(verdict)
        if verdict != "accepted":
            continue
        stored[ident] = claim
        accepted.append(claim)
        if claim.uid not in known:
            _register_unknown(conn, claim.uid, now_ms)
            known.add(claim.uid)
        member = claim.member
        if member is not None and claim.value is not None:
            groups.link(claim.cid, member)  # joins before it would mint
        else:
            groups.ensure(claim.cid)
        groups.outbox.append(_change(now_ms, "claim", cid=claim.cid, key=claim.key, uid=claim.uid))
    groups.flush()
    _store(conn, accepted)
    seq = max_seq(conn)
    written = _written(groups, before, seq, stored.values())
    results, start = [], 0
    for batch in batches:
        results.append(IngestResult(verdicts[start : start + len(batch)], seq, written))
        start += len(batch)
        written = Written(())
    return results


def _written(groups: _Groups, before: int, seq: int, stored: Iterable[Claim]) -> Written:
    """What an ingest transaction wrote: its outbox rows (seqs `before + 1` … `seq`, as
    AUTOINCREMENT gave them under the write lock) and the groups it minted."""
    assert seq - before == len(groups.written), "outbox seqs are consecutive in a transaction"
    changes = tuple(Change(before + i, *row[:6]) for i, row in enumerate(groups.written, start=1))
    return Written(changes, groups.fresh(c for c in stored if c.value is not None))


# Told a group commit's writes before its COMMIT: (what its ingests wrote, a call that returns
# once the COMMIT has returned and raises `NotCommitted` if it failed); on the writer's thread.
Ahead = Callable[[Sequence[Written], Callable[[], None]], None]


def written_ahead(ahead: Ahead, outcomes: Sequence[Outcome]) -> Gate | None:
    """`TruthStore.on_written`'s hook: the `Written` of a group's ingests, if any, to `ahead`,
    with the `Gate` the writer settles at the COMMIT."""
    written = [
        value.written
        for ok, value in outcomes
        if ok and isinstance(value, IngestResult) and value.written.changes
    ]
    if not written:
        return None
    gate = Gate()
    ahead(written, gate.wait)
    return gate


def ensure_groups_txn(conn: Connection, cids: Sequence[str], minter: Minter, now_ms: int) -> None:
    """Give every CID a group (the watcher's midhashes): minted if new, in one transaction."""
    groups = _Groups(conn, now_ms, cids, minter)
    for cid in cids:
        groups.ensure(cid)
    groups.flush()


def add_signer_txn(
    conn: Connection,
    uid: str,
    name: str | None,
    weight: int | None,
    may_link: bool | None,
    now_ms: int,
) -> SignerRow:
    """Register a signer, or update its name, weight and link permission. What is None keeps a
    known signer's own (a new one's: no name, `merge.DEFAULT_WEIGHT`, no linking), so renaming
    a signer never takes its weight away: the API and the CLI share this one rule."""
    before = signer(conn, uid)
    if before is not None:
        name = before.name if name is None else name
        weight = before.weight if weight is None else weight
        may_link = before.may_link if may_link is None else may_link
    conn.execute(
        "INSERT INTO signers (uid, name, weight, may_link, added_at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (uid) DO UPDATE SET name = excluded.name, weight = excluded.weight, "
        "may_link = excluded.may_link",
        (
            uid,
            name or "",
            merge.DEFAULT_WEIGHT if weight is None else weight,
            int(bool(may_link)),
            now_ms,
        ),
    )
    if before is not None and before.weight != weight:
        _write_changes(conn, [_change(now_ms, "signer", uid=uid)])
    after = signer(conn, uid)
    assert after is not None
    return after


def set_signer_status_txn(conn: Connection, uid: str, status: str, now_ms: int) -> SignerRow:
    """Block or unblock a signer; every record it voted on is recomputed by the applier."""
    before = signer(conn, uid)
    if before is None:
        raise UnknownSignerUid(f"signer {uid} is not registered")
    if before.status != status:
        conn.execute("UPDATE signers SET status = ? WHERE uid = ?", (status, uid))
        _write_changes(conn, [_change(now_ms, "signer", uid=uid)])
    after = signer(conn, uid)
    assert after is not None
    return after


# -- peers (docs/peers.md) ----------------------------------------------------------------------


@dataclass(frozen=True)
class PeerCursor:
    """What a page pulled from peer `name` moves: its cursor (None: a reconciliation fetch,
    which leaves it) and the claims of the page refused before the ingest (`rejected`)."""

    name: str
    cursor: str | None
    rejected: int
    # what the peer calls the page's signers (`signers` of its answer, checked: `peers`)
    signer_names: Mapping[str, str] = field(default_factory=dict)


def learned_name(peer: str, given: str | None) -> str:
    """A learned signer's name: the peer's own name for it, and through which peer (`filename
    (via a)`, `owner (via a)`); `peer:<name>` when the peer gave none (an older version). Its
    plugins and its owner were all `peer:a` alike, on the page and in `signers list`."""
    return f"{given} (via {peer})" if given else f"peer:{peer}"


def advance_peer(conn: Connection, page: PeerCursor, verdicts: Sequence[Verdict]) -> None:
    """Count a page's verdicts on its peer and store its cursor (inside the page's ingest)."""
    conn.execute(
        "UPDATE peers SET cursor = coalesce(?, cursor), accepted = accepted + ?, "
        "duplicate = duplicate + ?, stale = stale + ?, rejected = rejected + ? WHERE name = ?",
        (
            page.cursor,
            verdicts.count("accepted"),
            verdicts.count("duplicate"),
            verdicts.count("stale"),
            page.rejected,
            page.name,
        ),
    )


def peer_ingest_txn(
    conn: Connection,
    batch: Sequence[Claim],
    page: PeerCursor,
    weight: int,
    minter: Minter,
    now_ms: int,
) -> tuple[IngestResult, list[tuple[Claim, SignerPolicyError]]]:
    """Ingest a verified page from a peer: a signer first seen here is registered as learned
    from the peer (its weight, may not link); a claim its signer may not make (blocked, a link
    without `may_link`) is refused and counted, the rest stored with the cursor, in one
    transaction. Returns the ingest's result and the claims refused, each with why."""
    uids = {c.uid for c in batch}
    named = {uid: learned_name(page.name, page.signer_names.get(uid)) for uid in uids}
    conn.executemany(
        "INSERT INTO signers (uid, name, weight, may_link, added_at, learned_from) "
        "VALUES (?, ?, ?, 0, ?, ?) ON CONFLICT DO NOTHING",
        [(uid, named[uid], weight, now_ms, page.name) for uid in uids],
    )
    conn.executemany(  # learned before the peer said names: named now, unless renamed here
        "UPDATE signers SET name = ? WHERE uid = ? AND learned_from = ? AND name = ?",
        [
            (named[uid], uid, page.name, learned_name(page.name, None))
            for uid in uids & page.signer_names.keys()
        ],
    )
    rows = {uid: signer(conn, uid) for uid in {c.uid for c in batch}}
    kept: list[Claim] = []
    refused: list[tuple[Claim, SignerPolicyError]] = []
    for claim in batch:
        error = policy_error(rows[claim.uid], claim, Policy())
        if error is None:
            kept.append(claim)
        else:
            refused.append((claim, error))
    counted = PeerCursor(page.name, page.cursor, page.rejected + len(refused))
    return ingest_txn(conn, kept, minter, Policy(), now_ms, peer_cursor=counted), refused


def add_peer_txn(
    conn: Connection, name: str, url: str, token: str, weight: int, now_ms: int
) -> PeerRow:
    """Follow a peer (or update its address, token and weight). Its cursor stays while the
    address does; a new address may be another box, whose log the cursor does not name, so
    the cursor starts over (the first sync then reconciles: only what is missing travels).
    An address another name follows is refused: followed twice, every claim travelled twice
    and each name's counts held half of them."""
    twin = conn.execute(
        "SELECT name FROM peers WHERE rtrim(url, '/') = rtrim(?, '/') AND name <> ?", (url, name)
    ).fetchone()
    if twin is not None:
        raise InvalidRequest(
            f"{url} is followed already, as the peer {twin[0]!r}: add it again under that name "
            "(to change its token or weight), or remove that one first"
        )
    conn.execute(
        "INSERT INTO peers (name, url, token, weight, added_at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET url = excluded.url, token = excluded.token, "
        "weight = excluded.weight, "
        "cursor = CASE WHEN peers.url = excluded.url THEN peers.cursor ELSE '' END",
        (name, url, token, weight, now_ms),
    )
    row = peer(conn, name)
    assert row is not None
    return row


def remove_peer_txn(conn: Connection, name: str) -> bool:
    """Stop following a peer (the claims it brought stay); whether there was one."""
    return conn.execute("DELETE FROM peers WHERE name = ?", (name,)).rowcount > 0


def add_peer_token_txn(conn: Connection, name: str, digest: str, now_ms: int) -> None:
    """Store a new peer token's SHA-256 under `name` (a name is given once)."""
    if conn.execute("SELECT 1 FROM peer_tokens WHERE name = ?", (name,)).fetchone():
        raise InvalidRequest(f"a peer token named {name!r} exists; revoke it first")
    conn.execute(
        "INSERT INTO peer_tokens (name, hash, created_at) VALUES (?, ?, ?)", (name, digest, now_ms)
    )


def revoke_peer_token_txn(conn: Connection, name: str) -> bool:
    return conn.execute("DELETE FROM peer_tokens WHERE name = ?", (name,)).rowcount > 0


# -- migration: adopting rids minted elsewhere (tools/claims-migrate) ---------------------------


@dataclass(frozen=True)
class Adopted:
    """What `adopt_group_txn` did: the active rid now holding the CIDs, and how it got there."""

    rid: str
    created: bool  # `rid` (the adopted one) was inserted into `rids` now
    joined: tuple[str, ...]  # CIDs that were in no group and joined this one
    merged: tuple[str, ...]  # rids merged away because they already held one of the CIDs


def adopt_group_txn(conn: Connection, rid: str, cids: Sequence[str], now_ms: int) -> Adopted:
    """Make `cids` one group named by an existing rid, minted by another store (a migrated
    MetaMesh record keeps its UUIDv7), instead of minting a fresh one.

    * `rid` (a UUIDv7 in rid spelling) is inserted into `rids` if absent, with `minted_at` its
      own UUIDv7 timestamp. If it is there already and was merged away, its survivor stands for
      it. Minting stays monotonic: `_Groups` always mints above the largest rid the truth holds.
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
    groups = _Groups(conn, now_ms, cids)
    for cid in cids:
        held = groups.rid_of(cid)
        if held is None:
            groups.join(cid, target)
            joined.append(cid)
        elif held != target:
            keep, lose = min(held, target), max(held, target)
            groups.merge(keep, lose)
            merged.append(lose)
            target = keep
    groups.flush()
    return Adopted(target, created, tuple(joined), tuple(merged))


@dataclass(frozen=True)
class Grouping:
    """A migrated record's group: its old rid (None: it had none), the CID to mint a group for
    if need be, and every CID the group must hold."""

    rid: str | None
    canonical: str
    cids: tuple[str, ...]


@dataclass(frozen=True)
class Grouped:
    adopted: Adopted
    how: str  # "kept" (the old rid), "reused" (found through its CIDs), "minted"


def _adopt_record(conn: Connection, record: Grouping, minter: Minter, now_ms: int) -> Grouped:
    """Put a record's CIDs in one group: under its old rid, else under the rid that already holds
    one of them (a re-run), else under a freshly minted one."""
    if record.rid is not None:
        return Grouped(adopt_group_txn(conn, record.rid, record.cids, now_ms), "kept")
    held = sorted({r for c in record.cids if (r := group_of(conn, c)) is not None})
    if held:
        return Grouped(adopt_group_txn(conn, held[0], record.cids, now_ms), "reused")
    rid = ensure_group(conn, record.canonical, minter, now_ms)
    rest = adopt_group_txn(conn, rid, record.cids, now_ms)
    return Grouped(Adopted(rest.rid, True, (record.canonical, *rest.joined), rest.merged), "minted")


def migrate_batch_txn(
    conn: Connection,
    records: Sequence[Grouping],
    batch: Sequence[Claim],
    minter: Minter,
    policy: Policy,
    now_ms: int,
) -> tuple[list[Grouped], IngestResult]:
    """One transaction of tools/claims_migrate: the groups of some records, then their claims."""
    grouped = [_adopt_record(conn, record, minter, now_ms) for record in records]
    return grouped, ingest_txn(conn, batch, minter, policy, now_ms)


# -- the store ----------------------------------------------------------------------------------


class _View:
    """`view.TruthView` over one connection inside one read transaction. Each read raises a
    storage failure as its typed `StorageError` itself: the snapshot's `with` block also holds
    the cache's writes, whose failures are the cache's, not the truth's."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    @mapped
    def max_seq(self) -> int:
        return max_seq(self._conn)

    @mapped
    def changes_after(self, seq: int) -> list[Change]:
        return changes_after(self._conn, seq)

    @mapped
    def groups_of(self, cids: Iterable[str]) -> dict[str, str]:
        return groups_of(self._conn, cids)

    @mapped
    def groups_cids(self, rids: Iterable[str]) -> dict[str, list[str]]:
        return groups_cids(self._conn, rids)

    @mapped
    def survivors(self, rids: Iterable[str]) -> dict[str, str]:
        return survivors(self._conn, rids)

    @mapped
    def groups_claims(
        self, rids: Iterable[str], keys: Iterable[str] | None = None
    ) -> dict[str, list[Claim]]:
        return groups_claims(self._conn, rids, keys)

    @mapped
    def merge_signers(self, uids: Iterable[str]) -> dict[str, merge.Signer]:
        return merge_signers(self._conn, uids)

    @mapped
    def signer_claims(self, uid: str, after: int, limit: int) -> list[tuple[int, str, str]]:
        return signer_claims(self._conn, uid, after, limit)

    @mapped
    def active_rids(self) -> list[str]:
        return active_rids(self._conn)

    @mapped
    def rids_after(self, after: str, limit: int) -> list[str]:
        return rids_after(self._conn, after, limit)


class TruthStore(Store):
    """truth.db: its schema, its single writer, its read connections and every statement on it.

    `open()` migrates the schema, starts the writer thread and opens two read-only connections:
    one for reads on the event loop (primary-key lookups, microseconds: no thread hop), one for
    the cache's apply (`snapshot()`, used on the cache writer's thread, under a lock). Writes are
    async methods running one transaction on the writer (`*_sync` from a thread or the CLI);
    reads are plain methods. Callers see values (`Claim`, `SignerRow`, `RidInfo`, `Change` …),
    never a connection; a storage failure is raised as its typed `StorageError`.
    """

    name = "truth"
    migrations = MIGRATIONS
    # group commit: one pass of statements for a group's batches (`ingest_many_txn`)
    combiners: ClassVar[Mapping[Callable[..., Any], Combiner]] = {ingest_txn: ingest_many_txn}
    pg_migrations = PG_MIGRATIONS

    def __init__(self, path: Target, clock: Clock = now_ms) -> None:
        super().__init__(path, clock)
        self._source: Connection | None = None
        self._source_lock = threading.Lock()
        self._poll: Connection | None = None  # `max_seq_apart`'s, opened at its first call
        self._poll_lock = threading.Lock()

    def migrate(self) -> None:
        """Incremental vacuum, so pruning the outbox shrinks the file (`db.make_incremental`:
        set as a new file is made, else a VACUUM once, outside any transaction, so not a
        numbered migration), then the schema."""
        if isinstance(self.path, Path):
            make_incremental(self.path)
        super().migrate()

    def open(self) -> Self:
        """Migrate, start the writer, open the loop's read connection and the apply's."""
        super().open()
        self._source = connect(self.path, readonly=True)
        return self

    def close(self) -> None:
        """Stop writing, then close the read connections; only once nothing reads a view."""
        super().close()
        if self._source is not None:
            self._source.close()
        with self._poll_lock:
            if self._poll is not None:
                self._poll.close()
                self._poll = None

    # -- writes ---------------------------------------------------------------------------------

    def on_written(self, ahead: Ahead) -> None:
        """Tell `ahead` what each group of ingest transactions wrote, on the writer's thread,
        between the group's last statement and its COMMIT (`written_ahead`), so the cache's
        apply of it can begin while that COMMIT runs (`Applier.apply_ahead`)."""
        self.writer.before_commit = functools.partial(written_ahead, ahead)

    async def ingest(
        self,
        batch: Sequence[Claim],
        minter: Minter,
        policy: Policy,
        now: int,
    ) -> IngestResult:
        """Store a validated batch (`ingest_txn`); `now` is the time it was validated at.

        Group commit: batches queued together share one transaction (`INGEST_GROUP`), in one
        pass (`ingest_many_txn`), and each is answered once that transaction has committed."""
        return await self.writer.run_grouped(
            INGEST_GROUP, len(batch), ingest_txn, batch, minter, policy, now
        )

    async def ingest_wire(
        self,
        items: Sequence[object],
        limits: Limits,
        minter: Minter,
        policy: Policy,
        now: int,
    ) -> IngestResult:
        """`ingest` of a small batch of wire claims, validated on the writer's thread as its
        group is gathered (`claims.validate_batch` as the job's `prepare`), so the request
        takes one hop to a thread and back, not two (docs/benchmarks.md, "Small batches
        validated on the truth writer"). Invalid, it fails alone with `InvalidBatch`, having
        held no lock."""
        prepare = functools.partial(_validated, limits)
        return await self.writer.run_grouped(
            INGEST_GROUP, len(items), ingest_txn, items, minter, policy, now, prepare=prepare
        )

    async def ingest_together(
        self,
        batches: Sequence[tuple[Sequence[object], bool]],
        limits: Limits,
        minter: Minter,
        policy: Policy,
        now: int,
    ) -> list[IngestResult | BaseException]:
        """`ingest` (a batch validated already, True) or `ingest_wire` (wire claims validated
        on the writer's thread) of each of `batches`, queued as one (`Writer.submit_together`):
        they share one transaction (up to `GROUP_MAX` claims) and one apply, each failing alone
        (its exception in its place), each answered only once that transaction has committed.
        For plugin runs that ended close together: submitted one by one they took a COMMIT
        each (docs/benchmarks.md, "Plugin runs committed together")."""
        prepare = functools.partial(_validated, limits)
        return await self.writer.run_together(
            INGEST_GROUP,
            [
                (len(b), ingest_txn, (b, minter, policy, now), None if valid else prepare)
                for b, valid in batches
            ],
        )

    def ingest_sync(
        self, batch: Sequence[Claim], minter: Minter, policy: Policy, now: int
    ) -> IngestResult:
        future = self.writer.submit_grouped(
            INGEST_GROUP, len(batch), ingest_txn, batch, minter, policy, now
        )
        return future.result()

    async def ensure_groups(self, cids: Sequence[str], minter: Minter) -> None:
        await self.writer.run(ensure_groups_txn, cids, minter, self._clock())

    async def add_signer(
        self, uid: str, name: str | None, weight: int | None, may_link: bool | None
    ) -> SignerRow:
        return await self.writer.run(add_signer_txn, uid, name, weight, may_link, self._clock())

    def add_signer_sync(
        self, uid: str, name: str | None, weight: int | None, may_link: bool | None
    ) -> SignerRow:
        return self.writer.run_sync(add_signer_txn, uid, name, weight, may_link, self._clock())

    async def claim_owner(self, uid: str) -> None:
        """`claim_owner_txn` at start: refused if the truth belongs to another owner key."""
        await self.writer.run(claim_owner_txn, uid, False)

    def renew_log_sync(self) -> str:
        return self.writer.run_sync(renew_log_txn)

    def claim_owner_sync(self, uid: str, adopt: bool = False) -> list[str]:
        return self.writer.run_sync(claim_owner_txn, uid, adopt)

    async def set_signer_status(self, uid: str, status: str) -> SignerRow:
        return await self.writer.run(set_signer_status_txn, uid, status, self._clock())

    def set_signer_status_sync(self, uid: str, status: str) -> SignerRow:
        return self.writer.run_sync(set_signer_status_txn, uid, status, self._clock())

    async def ingest_peer(
        self, batch: Sequence[Claim], page: PeerCursor, weight: int, minter: Minter, now: int
    ) -> tuple[IngestResult, list[tuple[Claim, SignerPolicyError]]]:
        """A verified page from a peer with its cursor, in one transaction (`peer_ingest_txn`)."""
        return await self.writer.run(peer_ingest_txn, batch, page, weight, minter, now)

    async def add_peer(self, name: str, url: str, token: str, weight: int) -> PeerRow:
        return await self.writer.run(add_peer_txn, name, url, token, weight, self._clock())

    async def remove_peer(self, name: str) -> bool:
        return await self.writer.run(remove_peer_txn, name)

    def add_peer_token_sync(self, name: str, digest: str) -> None:
        self.writer.run_sync(add_peer_token_txn, name, digest, self._clock())

    def revoke_peer_token_sync(self, name: str) -> bool:
        return self.writer.run_sync(revoke_peer_token_txn, name)

    async def prune_changes(self, applied_seq: int) -> int:
        return await self.writer.run(prune_changes_txn, applied_seq)

    def migrate_batch_sync(
        self, records: Sequence[Grouping], batch: Sequence[Claim], minter: Minter, policy: Policy
    ) -> tuple[list[Grouped], IngestResult]:
        return self.writer.run_sync(
            migrate_batch_txn, records, batch, minter, policy, self._clock()
        )

    # -- reads ----------------------------------------------------------------------------------

    @mapped
    def max_seq(self) -> int:
        return max_seq(self.conn)

    def max_seq_apart(self) -> int:
        """`max_seq` on a connection of its own, for a thread: the applier's poll every 20 ms
        (`applier.Replica`), which must not hold up the event loop's connection or keep it in
        its reconnection wait while the server is away. Kept open for the poll alone, not lent
        by the pool (`reading`): with the pool's connections taken by long reads (exports,
        reconciliation) the poll waited 10 s for one and failed, and every replica stopped
        seeing the others' writes meanwhile."""
        with self._poll_lock, storage_errors(self.path):
            if self._poll is None:
                self._poll = connect(self.path, readonly=True)
            return max_seq(self._poll)

    @mapped
    def min_seq(self) -> int | None:
        return min_seq(self.conn)

    @mapped
    def signer(self, uid: str) -> SignerRow | None:
        return signer(self.conn, uid)

    @mapped
    def signers(self) -> list[SignerRow]:
        return signers(self.conn)

    @mapped
    def newest_said(self, uid: str, pairs: Iterable[tuple[str, str]]) -> Claim | None:
        return newest_said(self.conn, uid, pairs)

    @mapped
    def rid_info(self, rid: str) -> RidInfo | None:
        return rid_info(self.conn, rid)

    @mapped
    def survivor(self, rid: str) -> str:
        return survivor(self.conn, rid)

    @mapped
    def group_of(self, cid: str) -> str | None:
        return group_of(self.conn, cid)

    @mapped
    def group_cids(self, rid: str) -> list[str]:
        return group_cids(self.conn, rid)

    @mapped
    def group_claims(
        self, rid: str, keys: Iterable[str] | None = None, uid: str | None = None
    ) -> list[Claim]:
        return group_claims(self.conn, rid, keys=keys, uid=uid)

    @mapped
    def stored_claim(self, uid: str, cid: str, key: str) -> Claim | None:
        return stored_claim(self.conn, uid, cid, key)

    def rid_status_counts(self) -> dict[str, int]:
        """On a connection of its own, for a thread: a scan of every rid (0.23 s at 1M), so
        /metrics runs it off the event loop (`Node.metrics_text`)."""
        return self._own_read(rid_status_counts, lent=False)

    @mapped
    def listing(
        self, rid: str, keys: Iterable[str] | None, uid: str | None
    ) -> tuple[list[str], list[Claim]]:
        """(the CIDs of group `rid`, its live claims, optionally filtered), in one snapshot."""
        with snapshot(self.conn):
            return group_cids(self.conn, rid), group_claims(self.conn, rid, keys=keys, uid=uid)

    @mapped
    def votes_of(self, rid: str, uid: str) -> tuple[list[Claim], dict[str, merge.Signer]]:
        """(`uid`'s live claims on the group `rid` is part of now, its weight and block), in
        one snapshot: what `merge.seen_by` needs for `?as=`."""
        with snapshot(self.conn):
            votes = group_claims(self.conn, survivor(self.conn, rid), uid=uid)
            return votes, merge_signers(self.conn, [uid])

    @mapped
    def claims_log(self, after: str | None, limit: int, uid: str | None) -> LogPage:
        """A page of the claim log after cursor `after` (None: from the start), one snapshot."""
        with snapshot(self.conn):
            return claims_log(self.conn, parse_log_cursor(self.conn, after), limit, uid)

    @mapped
    def log_head(self) -> str:
        """The claim log's cursor at its end."""
        with snapshot(self.conn):
            return log_cursor(log_id(self.conn), max_log_seq(self.conn))

    def _own_read(self, fn: Callable[[Connection], T], lent: bool = True) -> T:
        """`fn` on a read connection of its own: for the long reads run off the event loop
        (`lent`: `reading`'s)."""
        with self.reading(lent) as conn, storage_errors(self.path):
            return fn(conn)

    def said_about(self, uid: str, cid: str) -> list[Claim]:
        """On a connection of its own, for a plugin run's thread: `uid`'s live stored claims
        about exactly `cid`."""
        return self._own_read(functools.partial(said_about, uid=uid, cid=cid))

    def newest_said_apart(self, uid: str, pairs: Sequence[tuple[str, str]]) -> Claim | None:
        """`newest_said` on a connection of its own, for a plugin run's thread: a run of
        50,000 claims read them for 1 s on the event loop."""
        return self._own_read(functools.partial(newest_said, uid=uid, pairs=pairs))

    def claim_ids(self) -> tuple[str, list[bytes]]:
        """(the log's end cursor, every claim's identity): reconciliation's items (a thread)."""
        return self._own_read(claim_ids)

    def claims_by_ids(self, ids: Sequence[bytes]) -> list[Claim]:
        """The stored claims with these identities (a scan: call it from a thread)."""
        return self._own_read(lambda conn: claims_by_ids(conn, ids))

    @mapped
    def peers(self) -> list[PeerRow]:
        return peers(self.conn)

    @mapped
    def peer(self, name: str) -> PeerRow | None:
        return peer(self.conn, name)

    @mapped
    def peer_tokens(self) -> list[PeerTokenRow]:
        return peer_tokens(self.conn)

    @mapped
    def peer_token_named(self, digest: str) -> str | None:
        return peer_token_named(self.conn, digest)

    @mapped
    def claim_count(self, uid: str | None = None) -> int:
        return claim_count(self.conn, uid)

    def claims(self, uid: str | None = None) -> Iterator[Claim]:
        """Every stored claim (tombstones too), optionally of one signer, in claim-log order:
        read in one snapshot on a connection of its own, closed when the iterator ends."""
        with self.reading() as conn, storage_errors(self.path), snapshot(conn):
            yield from all_claims(conn, uid)

    @mapped
    def holding(self) -> list[str]:
        """The tables holding a node's data (not the rows the schema seeds): a migration's
        target must hold none."""
        return holds_rows(self.conn, [t for t, _ in COPIED_TABLES if t not in SEEDED])

    def copy_from(self, source: TruthStore) -> dict[str, int]:
        """`copy_txn` of `source` into this (empty) truth, on this store's writer."""
        with source.reading() as conn:
            return self.writer.run_sync(copy_txn, conn)

    def dump_to(self, file: Path) -> None:
        """On PostgreSQL, `pg.dump` of the database (both stores) into `file`."""
        assert isinstance(self.path, pg.Target), "a SQLite truth is copied (`backup_to`)"
        pg.dump(self.path, file)

    def backup_to(self, copy: Path) -> str:
        """An online, consistent copy of truth.db into the (existing, empty) file `copy`; the
        copy's `PRAGMA integrity_check` verdict ("ok" when it is sound). Refused on
        PostgreSQL, whose own tool makes the consistent copy (`pg_dump`, docs/scale-out.md)."""
        if not isinstance(self.path, Path):
            raise InvalidRequest(
                f"backup copies a SQLite truth.db; the truth is on PostgreSQL ({self.path}): "
                "back it up with pg_dump (docs/scale-out.md)"
            )
        with storage_errors(copy):
            return copy_database(self.path, copy)

    @classmethod
    def restore_copy(cls, backup: Path, dest: Path) -> None:
        """Copy the backup `backup` (`backup_to` made it) into the empty file `dest`, checked
        (sound, of a schema this version reads), brought up to this schema, and given a log id
        of its own (`renew_log_txn`): what `metanode restore` puts in place."""
        copy_backup(backup, dest, len(MIGRATIONS), "claims", "truth.db")
        with storage_errors(dest):
            try:
                migrate_file(dest, MIGRATIONS)
            except sqlite3.DatabaseError as exc:  # a `claims` table, but not a truth's
                if storage_error(exc) is not None:
                    raise
                raise InvalidRequest(f"{backup} is no backup of truth.db: {exc}") from None
            conn = connect(dest)
            try:
                run_txn(conn, renew_log_txn, where=dest)
            finally:
                conn.close()

    def apply_connection(self) -> Connection:
        """The connection `snapshot()` reads on (for tests that trace what the apply reads)."""
        assert self._source is not None, "the store is not open"
        return self._source

    @contextmanager
    def snapshot(self) -> Iterator[TruthView]:
        """One read snapshot of the truth as a `view.TruthView` (the cache's apply reads it on
        the cache writer's thread; the lock keeps two threads off the one connection)."""
        assert self._source is not None, "the store is not open"
        with self._source_lock:
            with storage_errors(self.path):
                self._source.execute("BEGIN")
            try:
                yield _View(self._source)
            finally:
                with storage_errors(self.path):
                    self._source.execute("COMMIT")
