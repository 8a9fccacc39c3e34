"""cache.db: merged records, the cid index, local files, the feed, and the applier that fills them.

`CacheStore` is the only door: it owns the connections, the writer and the schema; the
module-level functions are its statements. Derived and rebuildable. The apply reads the
truth's outbox after its last applied seq through a `view.TruthView`, lets `plan` decide what
the affected records become, and writes the changed rows, one feed event per changed key and
the new applied seq in ONE cache transaction. A crash anywhere
is repaired by applying again from the stored seq: behind, never wrong (SPEC §3).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import aiosqlite

from metanode import labels, merge, pg
from metanode import rid as rid_codec
from metanode.cid import MIDHASH_PREFIX
from metanode.claims import Claim
from metanode.clock import Clock, now_ms
from metanode.db import (
    Connection,
    Migration,
    Store,
    Target,
    boot_id,
    connect,
    connect_reader,
    copy_table,
    executescript_in_txn,
    holds_rows,
    mapped,
    run_txn,
    snapshot,
    storage_errors,
)
from metanode.errors import StorageError
from metanode.ignores import UNKNOWN_CTIME, Stat
from metanode.pg import AsyncReader, SessionLock
from metanode.plan import (
    Event,
    FileEvent,
    Inputs,
    Plan,
    Row,
    Scope,
    Touched,
    file_events,
    recompute,
    resolve,
)
from metanode.plan import touched as touched_by
from metanode.view import Ahead, TruthSource, TruthView, Written, overlay

log = logging.getLogger(__name__)

SCHEMA_V1 = """
CREATE TABLE records (
    rid TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (rid, key)
) WITHOUT ROWID;

CREATE TABLE cid_index (
    cid TEXT PRIMARY KEY NOT NULL,
    rid TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX cid_index_rid ON cid_index (rid);

CREATE TABLE local_file (
    path TEXT PRIMARY KEY NOT NULL,
    midhash TEXT NOT NULL,
    size INTEGER NOT NULL CHECK (size >= 0),
    mtime_ns INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX local_file_midhash ON local_file (midhash);

CREATE TABLE feed (
    seq INTEGER PRIMARY KEY NOT NULL,
    rid TEXT NOT NULL,
    op TEXT NOT NULL CHECK (op IN ('set', 'del')),
    key TEXT NOT NULL,
    value TEXT,
    at INTEGER NOT NULL,
    CHECK ((op = 'set') = (value IS NOT NULL))
);

CREATE TABLE state (
    name TEXT PRIMARY KEY NOT NULL,
    value INTEGER NOT NULL
) WITHOUT ROWID;
"""


SCHEMA_V2 = """
CREATE TABLE plugin_runs (
    plugin TEXT NOT NULL,
    version TEXT NOT NULL,
    midhash TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed')),
    attempts INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_at INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (plugin, version, midhash)
) WITHOUT ROWID;
CREATE INDEX plugin_runs_due ON plugin_runs (status, next_at);
"""


def _v1(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V1)


def _v2(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V2)


# The MetaMesh file-event log behind `GET /api/events/files` (docs/compat.md): one row per change
# of `local_file`, written by `local_txn` in the same transaction, on its own dense counter
# (`state.file_feed_seq`). Paths are stored absolute; the API makes them relative to the roots.
SCHEMA_V3 = """
CREATE TABLE file_feed (
    seq INTEGER PRIMARY KEY NOT NULL,
    op TEXT NOT NULL CHECK (op IN ('add', 'change', 'delete', 'rename')),
    path TEXT NOT NULL,
    old_path TEXT,
    size INTEGER NOT NULL CHECK (size >= 0),
    midhash TEXT NOT NULL,
    at INTEGER NOT NULL,
    CHECK ((op = 'rename') = (old_path IS NOT NULL))
);
"""


def _v3(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V3)


def _v4(conn: Connection) -> None:
    """The inode each local file was hashed from: `GET /file/{cid}` serves a path only while it
    still is that file (a file swapped in later, even of equal size and mtime, is not)."""
    conn.execute("ALTER TABLE local_file ADD COLUMN ino INTEGER NOT NULL DEFAULT 0")


# The library index of the web page (ui.py): one row per record with what its list shows, and a
# full-text index of its title and file name (SQLite FTS5, external content: the triggers keep
# it in step with `library` in the same statement). Written by `refresh` and `drop`, so in the
# very transaction that writes the record's rows; a rebuild fills it, and `_v5` fills it from
# the records an older cache already holds.
SCHEMA_V5 = """
CREATE TABLE library (
    id INTEGER PRIMARY KEY,
    rid TEXT NOT NULL UNIQUE,
    title TEXT NOT NULL,
    name TEXT NOT NULL,
    year TEXT NOT NULL,
    type TEXT NOT NULL,
    files INTEGER NOT NULL CHECK (files >= 0)
);
CREATE INDEX library_type ON library (type, rid);
CREATE INDEX library_files ON library (files, rid);
CREATE VIRTUAL TABLE library_fts USING fts5(
    title, name, content='library', content_rowid='id', tokenize='unicode61 remove_diacritics 2'
);
CREATE TRIGGER library_added AFTER INSERT ON library BEGIN
    INSERT INTO library_fts (rowid, title, name) VALUES (new.id, new.title, new.name);
END;
CREATE TRIGGER library_removed AFTER DELETE ON library BEGIN
    INSERT INTO library_fts (library_fts, rowid, title, name)
    VALUES ('delete', old.id, old.title, old.name);
END;
CREATE TRIGGER library_changed AFTER UPDATE ON library BEGIN
    INSERT INTO library_fts (library_fts, rowid, title, name)
    VALUES ('delete', old.id, old.title, old.name);
    INSERT INTO library_fts (rowid, title, name) VALUES (new.id, new.title, new.name);
END;
"""


def _v5(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V5)
    _reindex(conn, "SELECT DISTINCT rid FROM cid_index ORDER BY rid")


def _reindex(conn: Connection, select: str) -> None:
    """The library rows of the rids `select` lists made anew from their cached records, a chunk
    at a time (a migration that changes what the library shows of some records). Without their
    `words`, which come with v12 (`_v12` fills them in for every row)."""
    rids = [r[0] for r in conn.execute(select)]
    for chunk in _chunks(rids):
        records = records_rows(conn, chunk)
        index_library(conn, chunk, records, group_parts(conn, chunk)[1], words=False)


# The rendered `GET /api/meta/{cid}` documents (v6; a group's once since v15): the JSON bytes
# of a record's document without the leading `cid` member (the CID asked, which the read
# splices in: `splice`), so the read is one lookup and a write of stored bytes. Written by
# `render_documents` beside the library index, in the transaction that writes the record's
# rows, its CIDs or its local files; `_v7` (which moved the bodies into `cid_index`) renders
# the records of a cache from before v6.
SCHEMA_V6 = """
CREATE TABLE documents (
    cid TEXT PRIMARY KEY NOT NULL,
    body BLOB NOT NULL
) WITHOUT ROWID;
"""


def _v6(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V6)


# Schema v7: the rendered document is a column of the CID's index row. CIDs are random hashes,
# so `cid_index` (WITHOUT ROWID, keyed by CID) and `documents` (the same, with ≈ 150-byte
# bodies) were two random-order B-trees every new CID dirtied a leaf page of, and the CID was
# stored three times. Now one rowid table: rows are appended, and only the small UNIQUE (cid)
# index takes random inserts. Measured on the two tables alone (200,000 CIDs held, 50,000 new
# in transactions of 100, WAL, synchronous=FULL): 66 → 29 µs of wall time a new CID, 38 → 19 µs
# of CPU. (`body` is NULL only inside the transaction that adds the row. v15 moves the
# documents into `group_document`, one a group.)
SCHEMA_V7 = """
CREATE TABLE cid_index_new (
    id INTEGER PRIMARY KEY,
    cid TEXT NOT NULL UNIQUE,
    rid TEXT NOT NULL,
    body BLOB
);
"""
_CID_INDEX_RESHAPE = """
INSERT INTO cid_index_new (cid, rid, body)
    SELECT i.cid, i.rid, d.body FROM cid_index i LEFT JOIN documents d ON d.cid = i.cid
    ORDER BY i.rid, i.cid;
DROP TABLE documents;
DROP TABLE cid_index;
ALTER TABLE cid_index_new RENAME TO cid_index;
CREATE INDEX cid_index_rid ON cid_index (rid);
"""


def _v7(conn: Connection) -> None:
    """Reshape, then render what a cache from before v6 never had rendered."""
    executescript_in_txn(conn, SCHEMA_V7 + _CID_INDEX_RESHAPE)
    rids = [r[0] for r in conn.execute("SELECT DISTINCT rid FROM cid_index WHERE body IS NULL")]
    for chunk in _chunks(sorted(rids)):
        members, paths = group_parts(conn, chunk)
        records = records_rows(conn, chunk)
        conn.executemany(  # v7's layout: v15 moves them into `group_document`
            "UPDATE cid_index SET body = ? WHERE cid = ?",
            [
                (render_rest(cids, records.get(rid, {}), paths.get(rid, ())), cid)
                for rid, cids in members.items()
                for cid in cids
            ],
        )


def _v8(conn: Connection) -> None:
    """No new table: the library lists an episode with its number and title, a film with its
    part or volume (`labels.title`), and a record with no local file by its `fileName` (it
    showed its rid), so the rows of such records are indexed again."""
    _reindex(
        conn,
        "SELECT rid FROM records WHERE key IN ('season', 'episode', 'part', 'volume') UNION "
        "SELECT rid FROM records r WHERE key = 'fileName' AND NOT EXISTS "
        "(SELECT 1 FROM records p WHERE p.rid = r.rid AND p.key = 'filePath') ORDER BY rid",
    )


def _v9(conn: Connection) -> None:
    """No new table: the library lists subtitles, nfos and artwork as `labels.SIDECARS`
    (`labels.kind`), which it leaves out unless asked, so the records that may be one are
    indexed again."""
    _reindex(
        conn,
        "SELECT rid FROM records WHERE key = 'fileType' AND value IN ('subtitle', 'image') "
        "UNION SELECT rid FROM records WHERE key IN ('filePath', 'fileName') "
        "AND lower(value) LIKE '%.nfo' ORDER BY rid",
    )


# Schema v10: the plugin runs counted as they are written. `GET /api/plugins` (which the Plugins
# page asks again two seconds after each answer) and `/metrics` counted them with a scan of
# every run, 0.35 s at 500,000 runs (a home library of 100,000 files, five plugins), a core
# kept busy while the page is open. Triggers keep one row per (plugin, version, status as
# shown, a skip's reason) in the transaction that writes the run, so a read of the counts is
# a read of that small table (docs/benchmarks.md, "Counted plugin runs"). `shown` is `skipped`
# for a done run with a reason (`SKIPPED`), whose reason is `reason` ('' for every other run).
_RUN_SHOWN = (
    "CASE WHEN {0}.status = 'done' AND {0}.error IS NOT NULL THEN 'skipped' ELSE {0}.status END"
)
_RUN_REASON = "CASE WHEN {0}.status = 'done' THEN coalesce({0}.error, '') ELSE '' END"
_RUN_KEY = f"{{0}}.plugin, {{0}}.version, {_RUN_SHOWN}, {_RUN_REASON}"
_RUN_COUNTED = f"""
INSERT INTO plugin_run_counts (plugin, version, shown, reason, runs)
    VALUES ({_RUN_KEY.format("new")}, 1)
    ON CONFLICT (plugin, version, shown, reason) DO UPDATE SET runs = plugin_run_counts.runs + 1;
"""
_RUN_UNCOUNTED = f"""
UPDATE plugin_run_counts SET runs = runs - 1
    WHERE (plugin, version, shown, reason) = ({_RUN_KEY.format("old")});
DELETE FROM plugin_run_counts
    WHERE (plugin, version, shown, reason) = ({_RUN_KEY.format("old")}) AND runs = 0;
"""
# the counts as a scan of every run makes them (`check` compares the kept ones with it)
_RUN_COUNTS_SCAN = """
SELECT plugin, version, {shown}, {reason}, count(*) FROM plugin_runs
    GROUP BY plugin, version, {shown}, {reason}
""".format(shown=_RUN_SHOWN.format("plugin_runs"), reason=_RUN_REASON.format("plugin_runs"))
_RUN_COUNTS_FILL = f"""
INSERT INTO plugin_run_counts (plugin, version, shown, reason, runs) {_RUN_COUNTS_SCAN};
"""
_RUN_COUNTS_TABLE = """
CREATE TABLE plugin_run_counts (
    plugin TEXT NOT NULL,
    version TEXT NOT NULL,
    shown TEXT NOT NULL,
    reason TEXT NOT NULL,
    runs {integer} NOT NULL CHECK (runs >= 0),
    PRIMARY KEY (plugin, version, shown, reason)
){rowid};
"""
SCHEMA_V10 = f"""
{_RUN_COUNTS_TABLE.format(integer="INTEGER", rowid=" WITHOUT ROWID")}
CREATE TRIGGER plugin_run_added AFTER INSERT ON plugin_runs BEGIN {_RUN_COUNTED} END;
CREATE TRIGGER plugin_run_removed AFTER DELETE ON plugin_runs BEGIN {_RUN_UNCOUNTED} END;
CREATE TRIGGER plugin_run_changed AFTER UPDATE OF plugin, version, status, error ON plugin_runs
    WHEN ({_RUN_KEY.format("old")}) IS NOT ({_RUN_KEY.format("new")})
    BEGIN {_RUN_UNCOUNTED} {_RUN_COUNTED} END;
{_RUN_COUNTS_FILL}
"""


def _v10(conn: Connection) -> None:
    executescript_in_txn(conn, SCHEMA_V10)


def _v11(conn: Connection) -> None:
    """The due runs of one plugin, in order, straight from an index (`due_runs`): with only
    `plugin_runs_due` (status, next_at), each call read the pending runs of every plugin and
    sorted them, and the host calls it each time a run ends. 5,000 new files kept its event
    loop busy with that, at a few runs a second."""
    executescript_in_txn(
        conn,
        "CREATE INDEX plugin_runs_next ON plugin_runs (plugin, version, status, next_at, midhash)",
    )


# Schema v12: the full-text index reads `library.words` (`library_words`: the title and file
# name with each character of an unspaced script a word, `labels.search_words`), not the title
# and name as they are: SQLite's tokenizer read `進撃の巨人` as one word, so no search for a word
# inside a Chinese, Japanese or Korean title found it, nor `ABC` a title in fullwidth letters.
# The words are filled in before the new index exists (an external-content index must never be
# told to delete what it never held), then the index is built from them.
_LIBRARY_FTS_DROPPED = """
DROP TRIGGER library_added;
DROP TRIGGER library_removed;
DROP TRIGGER library_changed;
DROP TABLE library_fts;
ALTER TABLE library ADD COLUMN words TEXT NOT NULL DEFAULT '';
"""
_LIBRARY_FTS = """
CREATE VIRTUAL TABLE library_fts USING fts5(
    words, content='library', content_rowid='id', tokenize='{tokenizer}'
);
CREATE TRIGGER library_added AFTER INSERT ON library BEGIN
    INSERT INTO library_fts (rowid, words) VALUES (new.id, new.words);
END;
CREATE TRIGGER library_removed AFTER DELETE ON library BEGIN
    INSERT INTO library_fts (library_fts, rowid, words) VALUES ('delete', old.id, old.words);
END;
CREATE TRIGGER library_changed AFTER UPDATE OF words ON library WHEN old.words IS NOT new.words
BEGIN
    INSERT INTO library_fts (library_fts, rowid, words) VALUES ('delete', old.id, old.words);
    INSERT INTO library_fts (rowid, words) VALUES (new.id, new.words);
END;
INSERT INTO library_fts (library_fts) VALUES ('rebuild');
"""


def _v12(conn: Connection) -> None:
    executescript_in_txn(conn, _LIBRARY_FTS_DROPPED)
    _fill_words(conn)
    executescript_in_txn(conn, _LIBRARY_FTS.format(tokenizer="unicode61 remove_diacritics 2"))


# Schema v13: `library.words` are the folded words of `labels.search_words` (case, accents and
# punctuation taken off in Python, the same for both backends), and the index only splits them
# at their spaces (the `ascii` tokenizer: its one rule for a character outside ASCII is that it
# belongs to a word). unicode61 kept its own rules: `strasse` missed `Straße`, `soren` `Søren`,
# `ελληνικα` `Ελληνικά` and a vowelled Arabic or pointed Hebrew title its plain spelling, while
# PostgreSQL's parser read `Film.1080p.x264` or `WALL·E` as one word: the backends disagreed.
_LIBRARY_FTS_UNTOKENIZED = """
DROP TRIGGER library_added;
DROP TRIGGER library_removed;
DROP TRIGGER library_changed;
DROP TABLE library_fts;
"""


def _v13(conn: Connection) -> None:
    executescript_in_txn(conn, _LIBRARY_FTS_UNTOKENIZED)
    _fill_words(conn)
    executescript_in_txn(conn, _LIBRARY_FTS.format(tokenizer="ascii"))


def _v14(conn: Connection) -> None:
    """The change time (ctime) of the inode each local file was hashed from: a file rewritten
    in place to the same size with its mtime put back (`touch -r`, a tag editor keeping
    timestamps) kept its old midhash, as (size, mtime) could not see the write. 0 until the
    watcher's first look after the upgrade fills it in from the disk without hashing
    (`fill_ctimes_txn`): a library of 100,000 files is not hashed again."""
    conn.execute("ALTER TABLE local_file ADD COLUMN ctime_ns INTEGER NOT NULL DEFAULT 0")


# Schema v15 (PostgreSQL v11): a group's rendered document stored once, in `group_document`,
# not in each of its CIDs' index rows. Every CID of a group has the same document (`splice`
# puts the asked CID in), and a write into a group rewrote it under every CID: a claim into a
# group of 2,000 CIDs rewrote 2,000 rows of ≈ 280 KB each (docs/benchmarks.md, "A write into
# a large group"). The bodies a cache holds are carried over (each group's first row's).
_GROUP_DOCUMENT = """
CREATE TABLE group_document (
    rid TEXT PRIMARY KEY NOT NULL,
    body {blob} NOT NULL
);
INSERT INTO group_document (rid, body)
    SELECT i.rid, i.body FROM cid_index i WHERE i.id = (
        SELECT min(j.id) FROM cid_index j WHERE j.rid = i.rid AND j.body IS NOT NULL);
ALTER TABLE cid_index DROP COLUMN body;
"""


def _v15(conn: Connection) -> None:
    executescript_in_txn(conn, _GROUP_DOCUMENT.format(blob="BLOB"))


def _pg_v11(conn: Connection) -> None:
    executescript_in_txn(conn, _GROUP_DOCUMENT.format(blob="BYTEA"))


def _fill_words(conn: Connection) -> None:
    """Each library row's `words`, from its title and name (`library_words`)."""
    rows = [LibraryRow(*r) for r in conn.execute(f"SELECT {_LIBRARY_COLUMNS} FROM library l")]
    conn.executemany(
        "UPDATE library SET words = ? WHERE rid = ?", [(library_words(r), r.rid) for r in rows]
    )


MIGRATIONS: Sequence[Migration] = (
    _v1,
    _v2,
    _v3,
    _v4,
    _v5,
    _v6,
    _v7,
    _v8,
    _v9,
    _v10,
    _v11,
    _v12,
    _v13,
    _v14,
    _v15,
)

# The same schema on PostgreSQL (docs/scale-out.md): SQLite's v6 tables and columns with
# PostgreSQL's types. The library's full-text index is the column `library.search` (a tsvector
# of title and file name, accents removed as FTS5's `remove_diacritics` does, kept by a trigger)
# with a GIN index; `fts_match` turns `fts_query`'s FTS5 text (`"word"* …`) into the tsquery
# of the same prefixes, so `library_page` is one statement on both (`pg.REWRITES`).
# tests/test_pg.py checks both schemas have the same tables and columns.
PG_SCHEMA_V1 = """
CREATE TABLE records (
    rid TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (rid, key)
);

CREATE TABLE cid_index (
    cid TEXT PRIMARY KEY NOT NULL,
    rid TEXT NOT NULL
);
CREATE INDEX cid_index_rid ON cid_index (rid);

CREATE TABLE local_file (
    path TEXT PRIMARY KEY NOT NULL,
    midhash TEXT NOT NULL,
    size BIGINT NOT NULL CHECK (size >= 0),
    mtime_ns BIGINT NOT NULL,
    ino BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX local_file_midhash ON local_file (midhash);

CREATE TABLE feed (
    seq BIGINT PRIMARY KEY NOT NULL,
    rid TEXT NOT NULL,
    op TEXT NOT NULL CHECK (op IN ('set', 'del')),
    key TEXT NOT NULL,
    value TEXT,
    at BIGINT NOT NULL,
    CHECK ((op = 'set') = (value IS NOT NULL))
);

CREATE TABLE state (
    name TEXT PRIMARY KEY NOT NULL,
    value BIGINT NOT NULL
);

CREATE TABLE plugin_runs (
    plugin TEXT NOT NULL,
    version TEXT NOT NULL,
    midhash TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed')),
    attempts BIGINT NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_at BIGINT NOT NULL DEFAULT 0,
    error TEXT,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (plugin, version, midhash)
);
CREATE INDEX plugin_runs_due ON plugin_runs (status, next_at);

CREATE TABLE file_feed (
    seq BIGINT PRIMARY KEY NOT NULL,
    op TEXT NOT NULL CHECK (op IN ('add', 'change', 'delete', 'rename')),
    path TEXT NOT NULL,
    old_path TEXT,
    size BIGINT NOT NULL CHECK (size >= 0),
    midhash TEXT NOT NULL,
    at BIGINT NOT NULL,
    CHECK ((op = 'rename') = (old_path IS NOT NULL))
);

CREATE TABLE library (
    id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    rid TEXT NOT NULL UNIQUE,
    title TEXT NOT NULL,
    name TEXT NOT NULL,
    year TEXT NOT NULL,
    type TEXT NOT NULL,
    files BIGINT NOT NULL CHECK (files >= 0),
    search TSVECTOR NOT NULL DEFAULT ''
);
CREATE INDEX library_type ON library (type, rid);
CREATE INDEX library_files ON library (files, rid);
CREATE INDEX library_search ON library USING gin (search);

CREATE FUNCTION library_search() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.search := to_tsvector('simple', unaccent(NEW.title || ' ' || NEW.name));
    RETURN NEW;
END $$;
CREATE TRIGGER library_search BEFORE INSERT OR UPDATE OF title, name ON library
    FOR EACH ROW EXECUTE FUNCTION library_search();

CREATE FUNCTION fts_match(query TEXT) RETURNS tsquery LANGUAGE sql STABLE AS $$
    SELECT to_tsquery('simple', unaccent(replace(
        regexp_replace(query, '"([^"]*)"\\*', '\\1:*', 'g'), ' ', ' & ')))
$$;

CREATE TABLE documents (
    cid TEXT PRIMARY KEY NOT NULL,
    body BYTEA NOT NULL
);
"""


def _pg_v1(conn: Connection) -> None:
    """The schema, its functions calling `unaccent` where the extension is: made here (in this
    schema) unless the database has it already, perhaps in another schema."""
    conn.execute("CREATE EXTENSION IF NOT EXISTS unaccent")
    executescript_in_txn(conn, _with_unaccent(conn, PG_SCHEMA_V1))


def _with_unaccent(conn: Connection, script: str) -> str:
    """`script` calling `unaccent` in the schema the extension is in."""
    (where,) = conn.execute(
        "SELECT CAST(CAST(extnamespace AS regnamespace) AS text) FROM pg_extension "
        "WHERE extname = 'unaccent'"
    ).fetchone()
    return script.replace("unaccent(", f"{where}.unaccent(")


# SQLite's v7 on PostgreSQL: the rendered document in the CID's index row (`SCHEMA_V7`).
PG_SCHEMA_V2 = """
CREATE TABLE cid_index_new (
    id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    cid TEXT NOT NULL UNIQUE,
    rid TEXT NOT NULL,
    body BYTEA
);
"""


def _pg_v2(conn: Connection) -> None:
    executescript_in_txn(conn, PG_SCHEMA_V2 + _CID_INDEX_RESHAPE)


# SQLite's v10 on PostgreSQL: the plugin runs counted by a trigger function (`SCHEMA_V10`).
PG_SCHEMA_V3 = f"""
{_RUN_COUNTS_TABLE.format(integer="BIGINT", rowid="")}
CREATE FUNCTION plugin_run_counted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN {_RUN_UNCOUNTED} END IF;
    IF TG_OP <> 'DELETE' THEN {_RUN_COUNTED} END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER plugin_run_counted AFTER INSERT OR DELETE ON plugin_runs
    FOR EACH ROW EXECUTE FUNCTION plugin_run_counted();
CREATE TRIGGER plugin_run_changed AFTER UPDATE OF plugin, version, status, error ON plugin_runs
    FOR EACH ROW WHEN (({_RUN_KEY.format("OLD")}) IS DISTINCT FROM ({_RUN_KEY.format("NEW")}))
    EXECUTE FUNCTION plugin_run_counted();
{_RUN_COUNTS_FILL}
"""


def _pg_v3(conn: Connection) -> None:
    executescript_in_txn(conn, PG_SCHEMA_V3)


# PostgreSQL v7: the runs counted once a statement, not once a run. v5's row triggers updated
# a plugin's count row for every run a statement wrote, and PostgreSQL keeps every version of
# a row updated in a transaction until it ends: each update then looked through all the
# earlier ones, so a statement's cost grew with the square of its runs (a new plugin version
# queued on 50,000 files: 146 s, 3.9 s without the counts; 100,000: about ten minutes, the
# cache writer held all along). Statement triggers read the statement's rows (its transition
# tables), grouped: one update of each count row a statement. `_RUNS_MOVED`: the count rows
# moved by `{rows}` (plugin, version, shown, reason, +1 or -1 a run), the fewer by an UPDATE
# (an INSERT's proposed row must pass the CHECK, conflict or not), the more by an upsert.
_RUNS_MOVED = """
WITH moved AS (
    SELECT plugin, version, shown, reason, sum(runs) AS runs
        FROM ({rows}) AS m (plugin, version, shown, reason, runs)
        GROUP BY plugin, version, shown, reason HAVING sum(runs) <> 0
), fewer AS (
    UPDATE plugin_run_counts c SET runs = c.runs + moved.runs FROM moved
        WHERE (c.plugin, c.version, c.shown, c.reason)
            = (moved.plugin, moved.version, moved.shown, moved.reason) AND moved.runs < 0
)
INSERT INTO plugin_run_counts AS c SELECT * FROM moved WHERE runs > 0
    ON CONFLICT (plugin, version, shown, reason) DO UPDATE SET runs = c.runs + excluded.runs;
"""
_RUNS_ADDED = f"SELECT {_RUN_KEY.format('n')}, 1 FROM new_runs n"
_RUNS_REMOVED = f"SELECT {_RUN_KEY.format('o')}, -1 FROM old_runs o"
_RUNS_EMPTIED = f"""
DELETE FROM plugin_run_counts c USING old_runs o
    WHERE c.runs = 0 AND (c.plugin, c.version, c.shown, c.reason) = ({_RUN_KEY.format("o")});
"""
PG_SCHEMA_V7 = f"""
DROP TRIGGER plugin_run_counted ON plugin_runs;
DROP TRIGGER plugin_run_changed ON plugin_runs;
DROP FUNCTION plugin_run_counted();
CREATE FUNCTION plugin_runs_counted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        {_RUNS_MOVED.format(rows=_RUNS_ADDED)}
    ELSIF TG_OP = 'DELETE' THEN
        {_RUNS_MOVED.format(rows=_RUNS_REMOVED)} {_RUNS_EMPTIED}
    ELSE
        {_RUNS_MOVED.format(rows=f"{_RUNS_ADDED} UNION ALL {_RUNS_REMOVED}")} {_RUNS_EMPTIED}
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER plugin_runs_added AFTER INSERT ON plugin_runs REFERENCING NEW TABLE AS new_runs
    FOR EACH STATEMENT EXECUTE FUNCTION plugin_runs_counted();
CREATE TRIGGER plugin_runs_removed AFTER DELETE ON plugin_runs REFERENCING OLD TABLE AS old_runs
    FOR EACH STATEMENT EXECUTE FUNCTION plugin_runs_counted();
CREATE TRIGGER plugin_runs_changed AFTER UPDATE ON plugin_runs
    REFERENCING OLD TABLE AS old_runs NEW TABLE AS new_runs
    FOR EACH STATEMENT EXECUTE FUNCTION plugin_runs_counted();
"""


def _pg_v7(conn: Connection) -> None:
    executescript_in_txn(conn, PG_SCHEMA_V7)


# SQLite's v12 on PostgreSQL: `library.search` is made of `library.words`, and a query's phrase
# (`"巨 人"*`, the characters of an unspaced word) is their sequence (`巨 <-> 人:*`), not any
# order. The FTS5 text's phrases are separated by `* "`; the spaces left are inside phrases.
PG_SCHEMA_V8 = """
ALTER TABLE library ADD COLUMN words TEXT NOT NULL DEFAULT '';
CREATE OR REPLACE FUNCTION library_search() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.search := to_tsvector('simple', unaccent(NEW.words));
    RETURN NEW;
END $$;
DROP TRIGGER library_search ON library;
CREATE TRIGGER library_search BEFORE INSERT OR UPDATE OF words ON library
    FOR EACH ROW EXECUTE FUNCTION library_search();
CREATE OR REPLACE FUNCTION fts_match(query TEXT) RETURNS tsquery LANGUAGE sql STABLE AS $$
    SELECT to_tsquery('simple', unaccent(regexp_replace(
        replace(replace(query, ' ', '<->'), '*<->"', '* & "'), '"([^"]*)"\\*', '\\1:*', 'g')))
$$;
"""


def _pg_v8(conn: Connection) -> None:
    executescript_in_txn(conn, _with_unaccent(conn, PG_SCHEMA_V8))
    _fill_words(conn)


# SQLite's v13 on PostgreSQL: the words are folded in Python (`labels.search_words`), so
# `unaccent` no longer takes part (it spelled out `Æ` and `ß` on this backend only), and no
# parser reads them: the tsvector is `library.words` as they are, each word at its position
# (`'film':1 '1080p':2 …`), and the query the tsquery of the same words (`'巨' <-> '人':*`).
# The parser read a file name such as `Film.1080p.x264` as one word, and what it takes for a
# letter is the database's locale's (in `C.UTF-8` a Thai vowel sign is none): the index was
# not SQLite's. A word holds no quote, space or control character (`labels`). The extension
# stays.
PG_SCHEMA_V9 = """
CREATE OR REPLACE FUNCTION library_search() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.search := CAST(coalesce((
        SELECT string_agg('''' || w || ''':' || i, ' ')
        FROM unnest(string_to_array(NEW.words, ' ')) WITH ORDINALITY AS t(w, i)
    ), '') AS tsvector);
    RETURN NEW;
END $$;
CREATE OR REPLACE FUNCTION fts_match(query TEXT) RETURNS tsquery LANGUAGE sql IMMUTABLE AS $$
    SELECT CAST('''' || replace(replace(regexp_replace(replace(query, '"* "', chr(1)),
        '^"|"\\*$', '', 'g'), ' ', ''' <-> '''), chr(1), ''':* & ''') || ''':*' AS tsquery)
$$;
"""


def _pg_v9(conn: Connection) -> None:
    executescript_in_txn(conn, PG_SCHEMA_V9)
    _fill_words(conn)


def _pg_v10(conn: Connection) -> None:
    """SQLite's v14 on PostgreSQL: each local file's ctime (`_v14`); a constant default, so
    no row is rewritten."""
    conn.execute("ALTER TABLE local_file ADD COLUMN ctime_ns BIGINT NOT NULL DEFAULT 0")


PG_MIGRATIONS: Sequence[Migration] = (
    _pg_v1,
    _pg_v2,
    _v8,
    _v9,
    _pg_v3,
    _v11,
    _pg_v7,
    _pg_v8,
    _pg_v9,
    _pg_v10,
    _pg_v11,
)


# -- state --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    epoch: int  # 0: never built
    applied_seq: int
    feed_seq: int
    file_feed_seq: int  # the head of `file_feed` (MetaMesh's file events), on its own counter
    replans: int = 0  # signers whose records are still being replanned (`replan_step`)
    replanned: int = 0  # replan and rebuild steps (and starts) ever committed: moves the `mark`
    lost: bool = False  # commits may have been lost to a restart of the machine: rebuild it
    rebuilding: bool = False  # a rebuild in place is under way (`rebuild_step`)

    @property
    def mark(self) -> tuple[int, ...]:
        """What orders two committed states: every counter only grows from one commit to the
        next, so the later commit's mark is the greater (`Applier._publish`)."""
        return (self.epoch, self.feed_seq, self.applied_seq, self.file_feed_seq, self.replanned)


STATE = "SELECT name, value FROM state"
REPLAN = "replan:"  # state row `replan:<uid>`: the claim-log seq the signer's replan has reached
REPLANNED = "replanned"
# Relaxed commits (`CacheStore(relaxed=True)`): `relaxed_boot` is the boot of the machine
# (`db.boot_id`) under which a server commits without an fsync, 0 once it closed cleanly; a
# server that finds another boot there marks the cache `lost` until a rebuild.
RELAXED_BOOT = "relaxed_boot"
LOST = "lost"
# A rebuild in place (`start_rebuild_txn`): the last rid its steps recomputed, as two state rows
# (a rid is 128 bits, a state value a signed 64-bit integer): `rebuild:hi`, `rebuild:lo`.
REBUILD = "rebuild:"
REBUILD_HI, REBUILD_LO = REBUILD + "hi", REBUILD + "lo"


def read_state(conn: Connection) -> State:
    return state_of(conn.execute(STATE).fetchall())


def state_of(rows: Iterable[Any]) -> State:
    """The `State` that the rows of `STATE` (name, value) describe."""
    values = dict(rows)
    return State(
        values.get("epoch", 0),
        values.get("applied_seq", 0),
        values.get("feed_seq", 0),
        values.get(FILE_FEED_SEQ, 0),
        sum(1 for name in values if name.startswith(REPLAN)),
        values.get(REPLANNED, 0),
        bool(values.get(LOST, 0)),
        REBUILD_HI in values,
    )


def _set_state(conn: Connection, **values: int) -> None:
    conn.executemany(
        "INSERT INTO state (name, value) VALUES (?, ?) "
        "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        values.items(),
    )


# -- recomputing records ------------------------------------------------------------------------


# a `local_file` row's columns, in the order of `merge.LocalFile`'s fields
_LOCAL_FILE = "path, midhash, size, mtime_ns, ino, ctime_ns"


def local_files(conn: Connection, cids: Iterable[str]) -> list[merge.LocalFile]:
    wanted = sorted(set(cids))
    rows = conn.execute(
        f"SELECT {_LOCAL_FILE} FROM local_file WHERE midhash IN ({','.join('?' * len(wanted))})",
        wanted,
    )
    return [merge.LocalFile(*row) for row in rows]


def all_local_files(conn: Connection) -> list[merge.LocalFile]:
    """Every local_file row: what `check` copies into its fresh rebuild (facts about the disk,
    not derived from the truth)."""
    return [merge.LocalFile(*row) for row in conn.execute(f"SELECT {_LOCAL_FILE} FROM local_file")]


def put_local_files(cache: Connection, files: Iterable[merge.LocalFile]) -> None:
    """Insert local_file rows as they are (into an empty cache: `check`'s fresh rebuild)."""
    cache.executemany(
        f"INSERT INTO local_file ({_LOCAL_FILE}) VALUES (?, ?, ?, ?, ?, ?)",
        [(f.path, f.midhash, f.size, f.mtime_ns, f.ino, f.ctime_ns) for f in files],
    )


def local_file_count(conn: Connection) -> int:
    """How many local files the cache holds (the /metrics `watcher_files` gauge)."""
    return int(conn.execute("SELECT count(*) FROM local_file").fetchone()[0])


def local_files_of(conn: Connection, cids: Iterable[str]) -> dict[str, list[merge.LocalFile]]:
    """midhash → its local files, for the CIDs of many records in one fixed statement
    (`local_files`, one `?` per CID, stays the cheaper read for one record)."""
    found: dict[str, list[merge.LocalFile]] = {}
    for row in conn.execute(
        f"SELECT {_LOCAL_FILE} FROM local_file WHERE midhash IN (SELECT value FROM json_each(?))",
        (json_array(set(cids)),),
    ):
        found.setdefault(row[1], []).append(merge.LocalFile(*row))
    return found


def record_rows(conn: Connection, rid: str) -> dict[str, str]:
    return dict(conn.execute("SELECT key, value FROM records WHERE rid = ?", (rid,)).fetchall())


def records_rows(conn: Connection, rids: Iterable[str]) -> dict[str, dict[str, str]]:
    """`record_rows` of many records in one query (a record with no rows is absent)."""
    found: dict[str, dict[str, str]] = {}
    for rid, key, value in conn.execute(
        "SELECT rid, key, value FROM records WHERE rid IN (SELECT value FROM json_each(?))",
        (json_array(set(rids)),),
    ):
        found.setdefault(rid, {})[key] = value
    return found


def json_array(values: Iterable[object]) -> str:
    """`values` as one SQL parameter, read back with `IN (SELECT value FROM json_each(?))`."""
    return json.dumps(list(values), ensure_ascii=False)


def _votes(view: TruthView, scopes: Mapping[str, Scope]) -> dict[str, list[Claim]]:
    """The live claims each record's merge needs: all of them, or those on its scoped keys."""
    whole = [rid for rid, scope in scopes.items() if scope.whole]
    keyed = {rid: scope.keys for rid, scope in scopes.items() if scope.keys and not scope.whole}
    votes = view.groups_claims(whole) if whole else {}
    if keyed:
        wanted = set().union(*keyed.values())
        for rid, found in view.groups_claims(keyed, wanted).items():
            votes[rid] = [claim for claim in found if claim.key in keyed[rid]]
    return votes


def _read_inputs(cache: Connection, view: TruthView, scopes: Mapping[str, Scope]) -> Inputs:
    members = view.groups_cids([rid for rid, scope in scopes.items() if scope.regroups])
    files = local_files_of(cache, (cid for cids in members.values() for cid in cids))
    return Inputs(records_rows(cache, scopes), members, files, _votes(view, scopes))


def refresh(cache: Connection, view: TruthView, scopes: Mapping[str, Scope]) -> list[Event]:
    """Recompute the scoped keys of some records (at most `CHUNK`) from the truth (`view`),
    write what changed and index their CIDs; the events in the order of `scopes`.

    Set-based: each table is read once for all of them and the rows are written with
    `executemany`, instead of a round of statements per record. What was read to recompute
    them is what their library rows and documents are made of (`_after`, `_parts`): nothing
    just written is read back. Of the signers, only those whose votes are merged are read
    (`TruthView.merge_signers`).
    """
    inputs = _read_inputs(cache, view, scopes)
    uids = {claim.uid for votes in inputs.votes.values() for claim in votes}
    signers = view.merge_signers(uids) if uids else {}
    events = [
        event for rid, scope in scopes.items() for event in recompute(rid, scope, inputs, signers)
    ]
    cache.executemany(
        "DELETE FROM records WHERE rid = ? AND key = ?",
        [(e.rid, e.key) for e in events if e.op == "del"],
    )
    cache.executemany(
        "INSERT INTO records (rid, key, value) VALUES (?, ?, ?) "
        "ON CONFLICT (rid, key) DO UPDATE SET value = excluded.value",
        [(e.rid, e.key, e.value) for e in events if e.op == "set"],
    )
    records = _after(inputs.old, scopes, events)
    regrouped, others, paths = _parts(cache, scopes, inputs)
    render_documents(cache, regrouped, records, paths, index=True)
    render_documents(cache, others, records, paths)
    index_library(cache, list(scopes), records, paths)
    return events


def _after(
    old: Mapping[str, Mapping[str, str]], rids: Iterable[str], events: Sequence[Event]
) -> dict[str, dict[str, str]]:
    """The rows of each of `rids` once `events` are written: its rows before (`Inputs.old`,
    all of its keys) with the events applied; a record left with none is absent, as
    `records_rows` reads it."""
    rows = {rid: dict(old.get(rid, {})) for rid in rids}
    for event in events:
        if event.op == "set":
            rows[event.rid][event.key] = event.value  # type: ignore[assignment]  # set: a value
        else:
            rows[event.rid].pop(event.key, None)
    return {rid: found for rid, found in rows.items() if found}


def _parts(
    cache: Connection, scopes: Mapping[str, Scope], inputs: Inputs
) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[str]]]:
    """(regrouped record → its CIDs, other record → its CIDs, record → its local paths) of the
    scoped records. A regrouped record's are those its group keys were recomputed from
    (`Inputs.members`, `Inputs.files`): its index rows are exactly its members once this apply
    has written them, since a CID leaves a group only when the whole group merges away
    (`drop`). The others' are read from the index, which this apply does not change for them
    (`group_parts`)."""
    regrouped = {rid: inputs.members.get(rid, []) for rid, s in scopes.items() if s.regroups}
    paths = {
        rid: [f.path for cid in cids for f in inputs.files.get(cid, ())]
        for rid, cids in regrouped.items()
    }
    rest = [rid for rid in scopes if rid not in regrouped]
    if not rest:  # every record new or regrouped, as for new content
        return regrouped, {}, paths
    others, their_paths = group_parts(cache, rest)
    return regrouped, others, {**paths, **their_paths}


CHUNK = 500  # records per `refresh`: bounds what a rebuild or a long backlog holds in memory


def _chunks(rids: Sequence[str]) -> Iterator[Sequence[str]]:
    return (rids[start : start + CHUNK] for start in range(0, len(rids), CHUNK))


def refresh_all(cache: Connection, view: TruthView, scopes: Mapping[str, Scope]) -> list[Event]:
    """`refresh` every record of `scopes`, in rid order, a chunk at a time."""
    events: list[Event] = []
    for chunk in _chunks(sorted(scopes)):
        events += refresh(cache, view, {rid: scopes[rid] for rid in chunk})
    return events


def drop(cache: Connection, rid: str) -> list[Event]:
    """Remove a merged-away record: a `del` for each of its keys."""
    old = record_rows(cache, rid)
    cache.execute("DELETE FROM records WHERE rid = ?", (rid,))
    cache.execute("DELETE FROM cid_index WHERE rid = ?", (rid,))
    cache.execute("DELETE FROM group_document WHERE rid = ?", (rid,))
    cache.execute("DELETE FROM library WHERE rid = ?", (rid,))
    return [Event(rid, "del", key, None) for key in sorted(old)]


# -- the library index (the web page's list and search) -----------------------------------------


class LibraryRow(NamedTuple):
    """One record as the library lists it: `title` is empty when no title is known (the page
    shows `name`, the file name, instead)."""

    rid: str
    title: str
    name: str
    year: str
    type: str
    files: int


def library_row(rid: str, record: Mapping[str, str], files: int) -> LibraryRow:
    """What the library shows of a merged record with `files` local copies."""
    name = labels.file_name(record)
    kind = labels.kind(record, name)
    return LibraryRow(rid, labels.title(record), name, record.get("year", ""), kind, files)


def index_library(
    cache: Connection,
    rids: Sequence[str],
    records: Mapping[str, Mapping[str, str]],
    paths: Mapping[str, Sequence[str]],
    *,
    words: bool = True,
) -> None:
    """Bring the library rows (and through its triggers the full-text index) of `rids` in step
    with their `records` and local `paths` (as `records_rows` and `group_parts` read them): a
    record with no rows left loses its row; unchanged rows are not rewritten, so the index is
    touched only for what changed. `words=False`: without the `words` column, for a migration
    run on a schema from before it (`_reindex`).

    The upsert is ONE statement over all the rows (`json_each`), not `executemany`: FTS5 writes
    its pending terms out as a new segment at the end of every statement that touches it, so
    one statement a row wrote a segment (and merged segments) a record; one statement writes
    one for the batch (benchmarks.md, "Issue 18")."""
    cache.executemany(
        "DELETE FROM library WHERE rid = ?", [(rid,) for rid in rids if rid not in records]
    )
    rows = [library_row(rid, record, len(paths.get(rid, ()))) for rid, record in records.items()]
    cache.execute(
        _library_upsert(words),
        (json_array([(*row, library_words(row)) if words else row for row in rows]),),
    )


@functools.cache
def _library_upsert(words: bool) -> str:
    """`index_library`'s one statement, of a JSON array of rows (`LibraryRow` and, with
    `words`, its `library_words`): a row is rewritten only where what it shows changed."""
    columns = [*LibraryRow._fields, "words"] if words else list(LibraryRow._fields)
    values = [f"json_extract(value, '$[{i}]')" for i in range(len(columns))]
    values[5] = "CAST(json_extract(value, '$[5]') AS BIGINT)"  # files
    shown = ", ".join(f"library.{c}" for c in LibraryRow._fields[1:])
    return (
        f"INSERT INTO library ({', '.join(columns)}) SELECT {', '.join(values)} "
        "FROM json_each(?) WHERE true ON CONFLICT (rid) DO UPDATE SET "
        f"{', '.join(f'{c} = excluded.{c}' for c in columns[1:])} "
        f"WHERE ({shown}) IS DISTINCT FROM ({shown.replace('library.', 'excluded.')})"
    )


def library_words(row: LibraryRow) -> str:
    """What the full-text index holds of a library row: its title, file name and year (the
    list shows it beside the title, so `dune 2021` finds `Dune` of 2021 whatever its file is
    called) as `labels.search_words` writes them."""
    return labels.search_words(f"{row.title} {row.name} {row.year}")


def group_parts(
    cache: Connection, rids: Sequence[str]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(rid → its CIDs, rid → its local file paths) of `rids`, in one statement. A CID is
    listed once however many files it has: kept in a dict (ordered, each test O(1)), as a
    list's `in` made reading a group of N CIDs cost N² (2,000 CIDs: 25 ms a write into it)."""
    members: dict[str, dict[str, None]] = {}
    paths: dict[str, list[str]] = {}
    for rid, cid, path in cache.execute(
        "SELECT i.rid, i.cid, f.path FROM cid_index i LEFT JOIN local_file f "
        "ON f.midhash = i.cid WHERE i.rid IN (SELECT value FROM json_each(?))",
        (json_array(rids),),
    ):
        members.setdefault(rid, {})[cid] = None
        if path is not None:
            paths.setdefault(rid, []).append(path)
    return {rid: list(cids) for rid, cids in members.items()}, paths


# -- the rendered documents (GET /api/meta/{cid}) ------------------------------------------------


# Starlette's `JSONResponse` options, in one encoder made once: `json.dumps` with options builds
# an encoder every call (3.3 µs a document against 2.5; 0.93 against 0.22 for the asked CID
# that `splice` renders on every GET).
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def render(value: object) -> bytes:
    """`value`'s JSON bytes exactly as Starlette's `JSONResponse` renders them."""
    return _JSON.encode(value).encode("utf-8")


def render_rest(cids: Iterable[str], record: Mapping[str, str], paths: Iterable[str]) -> bytes:
    """A record's `GET /api/meta` document without its leading `cid` member: `{"canonical_cid":
    …}` (the same for every CID of the group, so stored once per CID and spliced)."""
    body = merge.document("", cids, record, paths)
    del body["cid"]
    return render(body)


def splice(asked: str, rest: bytes) -> bytes:
    """The stored `rest` of a document as asked for by CID `asked`: `cid` first, as
    `merge.document` orders it."""
    return b'{"cid":' + render(asked) + b"," + rest[1:]


def render_documents(
    cache: Connection,
    members: Mapping[str, Sequence[str]],
    records: Mapping[str, Mapping[str, str]],
    paths: Mapping[str, Sequence[str]],
    *,
    index: bool = False,
) -> None:
    """Store the rendered document of each group of `members` (rid → CIDs) once, in its
    `group_document` row (a group of no CIDs has none); an unchanged one is not rewritten. A
    write into a group of N CIDs writes one document, not N (schema v15). `index`: the groups'
    CIDs may be new to the index or come from another group, so each CID's index row is
    upserted too (written only where its rid changed)."""
    if index:
        cache.executemany(
            "INSERT INTO cid_index (cid, rid) VALUES (?, ?) ON CONFLICT (cid) "
            "DO UPDATE SET rid = excluded.rid WHERE cid_index.rid <> excluded.rid",
            [(cid, rid) for rid, cids in members.items() for cid in cids],
        )
    cache.executemany(
        "INSERT INTO group_document (rid, body) VALUES (?, ?) ON CONFLICT (rid) "
        "DO UPDATE SET body = excluded.body WHERE group_document.body <> excluded.body",
        [
            (rid, render_rest(cids, records.get(rid, {}), paths.get(rid, ())))
            for rid, cids in members.items()
            if cids
        ],
    )


def data_version(conn: Connection) -> int:
    return int(conn.execute("PRAGMA data_version").fetchone()[0])


def rendered(conn: Connection, cid: str) -> bytes | None:
    """The stored document rest of CID `cid` (this exact spelling), or None."""
    row = conn.execute(
        "SELECT d.body FROM cid_index i JOIN group_document d ON d.rid = i.rid WHERE i.cid = ?",
        (cid,),
    ).fetchone()
    return None if row is None else bytes(row[0])


# -- the applier's transaction ------------------------------------------------------------------


def _append_feed(cache: Connection, state: State, events: Sequence[Event], at: int) -> int:
    """Feed rows on consecutive seqs from the stored counter, stamped `at`; returns the new
    counter."""
    cache.executemany(
        "INSERT INTO feed (seq, rid, op, key, value, at) VALUES (?, ?, ?, ?, ?, ?)",
        [(state.feed_seq + i, *event, at) for i, event in enumerate(events, 1)],
    )
    return state.feed_seq + len(events)


def _plan(view: TruthView, work: Touched, replanned: Sequence[tuple[str, str]]) -> Plan:
    """The records `work` and a replan step's (cid, key) pairs touch, with every CID resolved
    to its group and every rid to its survivor by one set-based read each (not one lookup per
    change)."""
    claimed = [*work.claimed, *replanned]
    groups = view.groups_of(cid for cid, _ in claimed)
    survivors = view.survivors(work.regrouped + work.survived)
    return resolve(work, claimed, groups, survivors)


# Claims of a blocked or re-weighed signer re-merged a transaction (`replan_step`): a replan of
# a signer with 1M records took ≈ 47 s in ONE transaction, every write waiting behind it. With
# steps of this many, a write waits ≈ 13 ms (p50) during a replan and the replan takes ≈ 1.2×
# as long; 100 halve the wait and cost 1.6×, 1,000 quadruple it (docs/benchmarks.md, "A
# signer's replan, a step at a time").
REPLAN_CHUNK = 250


def replan_signers(cache: Connection, uids: Iterable[str]) -> None:
    """Start (or start over) the replan of each signer of `uids`, whose weight or status just
    changed: every record it has a claim on is recomputed, `REPLAN_CHUNK` claims a step. Over,
    if one was under way: the records it reached were weighed before this change."""
    _set_state(cache, **{REPLAN + uid: 0 for uid in uids})


def replan_step(cache: Connection, view: TruthView, limit: int) -> list[tuple[str, str]] | None:
    """One step of the first replan under way: the (cid, key) of the signer's next `limit`
    claims, its progress stored (the row removed once they are all met); None if no replan is
    under way. In the transaction that recomputes them, so a restart goes on where the last
    committed step stopped."""
    row = cache.execute(
        "SELECT name, value FROM state WHERE name LIKE ? ORDER BY name LIMIT 1", (REPLAN + "%",)
    ).fetchone()
    if row is None:
        return None
    name, after = row
    found = view.signer_claims(name[len(REPLAN) :], after, limit)
    if len(found) < limit:
        cache.execute("DELETE FROM state WHERE name = ?", (name,))
    else:
        _set_state(cache, **{name: found[-1][0]})
    return [(cid, key) for _, cid, key in found]


# Records recomputed a step of a rebuild in place (`rebuild_step`): each write waits for at most
# one step (benchmarks.md, "Rebuilding the cache of a serving node").
REBUILD_CHUNK = 100
_LOW = 1 << 63  # `rebuild:lo` holds the rid's low 64 bits minus this, in a signed integer


def start_rebuild_txn(cache: Connection) -> State:
    """Start (or start over) a rebuild in place: every record recomputed from the truth,
    `REBUILD_CHUNK` a step, by the applier's own applies (`rebuild_step`), writes applied
    between two steps. Nothing is emptied and the epoch stays: each step writes what differs,
    with its feed events, so feed readers follow without a gap (a cache that was right gets
    none). It moves the state's `mark` (`REPLANNED`), so the applier publishes it at once and
    /health says `rebuilding` from the answer on."""
    moved = {REPLANNED: read_state(cache).replanned + 1}
    _set_state(cache, **_rebuilt_through(rid_codec.encode(0)), **moved)
    return read_state(cache)


def _rebuilt_through(last: str) -> dict[str, int]:
    value = rid_codec.decode(last)
    return {REBUILD_HI: value >> 64, REBUILD_LO: (value & (_LOW * 2 - 1)) - _LOW}


def _rebuild_cursor(cache: Connection) -> str | None:
    """The last rid the rebuild under way recomputed (rid 0 at its start); None if none is."""
    values = dict(
        cache.execute(
            "SELECT name, value FROM state WHERE name IN (?, ?)", (REBUILD_HI, REBUILD_LO)
        ).fetchall()
    )
    if REBUILD_HI not in values:
        return None
    return rid_codec.encode((values[REBUILD_HI] << 64) | (values[REBUILD_LO] + _LOW))


def _cached_rids(cache: Connection, after: str, through: str | None) -> set[str]:
    """The rids the cache holds anything of (rows, index, document, library row) in the range
    (`after`, `through`] (no upper bound: None)."""
    bound = "" if through is None else " AND rid <= ?"
    args = (after,) if through is None else (after, through)
    return {
        row[0]
        for table in ("records", "cid_index", "group_document", "library")
        for row in cache.execute(f"SELECT DISTINCT rid FROM {table} WHERE rid > ?{bound}", args)
    }


class RebuildStep(NamedTuple):
    """A step of a rebuild in place: the active rids to recompute whole, and the rids the
    cache holds in their range that the truth has no active record of (to drop)."""

    rids: list[str]
    strays: list[str]


def rebuild_step(cache: Connection, view: TruthView, limit: int) -> RebuildStep | None:
    """The next `limit` active rids of the rebuild under way, its progress stored (the rows
    removed once the last rid is met); None if no rebuild is under way. In the transaction
    that recomputes them, so a restart goes on where the last committed step stopped."""
    after = _rebuild_cursor(cache)
    if after is None:
        return None
    rids = view.rids_after(after, limit)
    last = rids[-1] if len(rids) == limit else None
    if last is None:
        cache.execute("DELETE FROM state WHERE name IN (?, ?)", (REBUILD_HI, REBUILD_LO))
    else:
        _set_state(cache, **_rebuilt_through(last))
    return RebuildStep(rids, sorted(_cached_rids(cache, after, last).difference(rids)))


def _take_step(
    cache: Connection, view: TruthView, replan: bool
) -> tuple[list[tuple[str, str]] | None, RebuildStep | None]:
    """The one step an apply takes, if `replan`: a signer's replan first, else a rebuild's."""
    if not replan:
        return None, None
    step = replan_step(cache, view, REPLAN_CHUNK)
    return step, (rebuild_step(cache, view, REBUILD_CHUNK) if step is None else None)


def apply_txn(
    cache: Connection,
    source: TruthSource,
    clock: Clock = now_ms,
    written: Sequence[Written] = (),
    replan: bool = False,
    upto: int | None = None,
) -> State:
    """Apply every outbox change after the stored seq (`upto`: through that seq at most) and,
    if `replan`, one step of a signer's replan (`replan_step`) or, with none under way, of a
    rebuild in place (`rebuild_step`), in one cache transaction.

    The truth is read in one snapshot, so the changes and the state they are recomputed from
    agree. Merged-away records are dropped first (all their `del`s), then survivors and other
    touched records are refreshed, so the losing rid never reappears. `written` (what the
    ingest transactions handed over) answers what it can (`view.overlay`: the outbox rows and
    the groups they minted are not read back); then only its rows are applied. A signer's
    change only starts its replan (`replan_signers`); the applier's own applies take the steps
    (`replan`), one a transaction, so writes are applied between them; an apply ahead of an
    ingest's COMMIT takes none, so no write waits for one.
    """
    state = read_state(cache)
    if upto is not None and state.applied_seq >= upto:
        return state
    with source.snapshot() as truth_view:
        view = overlay(truth_view, written, state.applied_seq)
        changes = view.changes_after(state.applied_seq)
        if upto is not None:
            changes = [change for change in changes if change.seq <= upto]
        work = touched_by(changes)
        if work.signers:
            replan_signers(cache, work.signers)
        step, rebuilt = _take_step(cache, view, replan)
        if not changes and step is None and rebuilt is None:
            return state
        plan = _plan(view, work, step or ())
        gone = plan.losers + (rebuilt.strays if rebuilt else [])
        events = [event for loser in gone for event in drop(cache, loser)]
        if rebuilt is not None:
            plan.scopes.update(dict.fromkeys(rebuilt.rids, Scope(whole=True)))
        events += refresh_all(cache, view, plan.scopes)
    last = _append_feed(cache, state, events, clock())
    applied = changes[-1].seq if changes else state.applied_seq
    took = step is not None or rebuilt is not None
    stepped = {REPLANNED: state.replanned + 1} if took else {}
    _set_state(cache, applied_seq=applied, feed_seq=last, **stepped)
    return (
        read_state(cache)
        if work.signers or stepped
        else replace(state, applied_seq=applied, feed_seq=last)
    )


def apply_ahead_txn(
    cache: Connection,
    source: TruthSource,
    clock: Clock,
    written: Sequence[Written],
    committed: Callable[[], None],
) -> State:
    """`apply_txn` of what an ingest transaction wrote, begun before that transaction's COMMIT
    returned (`Applier.apply_ahead`): the truth is read only once `committed()` has returned
    (`view.Ahead`), and this transaction commits only after it too, so the cache never holds
    what the truth may not; if that COMMIT failed, `committed()` raises and all of this rolls
    back.

    Through the last seq of `written` at most, and nothing if an apply before it took that
    already (one that read the outbox back: the applier's poll, or an apply ahead that found
    a gap). Otherwise such an apply takes the changes of the transactions that committed
    while it waited, whose own applies ahead, queued behind it, then find the cache past
    their first seq and read their changes back from the truth too, taking the next ones':
    one read-back went on to the end of a burst of writes (at batch 100, 75 of 171 applies
    read their claims back; benchmarks.md, "Session 24")."""
    state = apply_txn(
        cache, Ahead(source, committed), clock, written, upto=max(w.last for w in written)
    )
    committed()
    return state


def relax_txn(cache: Connection, boot: int) -> None:
    """Mark the cache as committed to without an fsync under `boot` (`RELAXED_BOOT`); if the
    last server to do so ran under another boot and did not close cleanly, the machine
    restarted under it, and its last commits may be lost: mark the cache `LOST`."""
    before = dict(cache.execute(STATE).fetchall()).get(RELAXED_BOOT, 0)
    if before not in (0, boot):
        _set_state(cache, **{LOST: 1})
    _set_state(cache, **{RELAXED_BOOT: boot})


def settle_txn(cache: Connection) -> None:
    """Mark the cache closed cleanly: every commit before this fsync'd one is on the disk."""
    _set_state(cache, **{RELAXED_BOOT: 0})


# What `metanode migrate-storage` copies of a cache: the facts about the disk and the plugins'
# progress, which no rebuild from the truth gives back. The rest is rebuilt (`build_txn`).
COPIED_TABLES: tuple[tuple[str, str], ...] = (
    ("local_file", "path"),
    ("plugin_runs", "plugin, version, midhash"),
)


def copy_local_txn(dest: Connection, source: Connection) -> dict[str, int]:
    """Copy the local files and plugin runs of `source` into the empty cache `dest`, and its
    feed epoch: the build that follows starts a later one, so no feed cursor of the old box
    is taken for one of the new (`build_txn`: `max(now, epoch + 1)`); rows per table."""
    with snapshot(source):
        counts = {table: copy_table(dest, source, table, order) for table, order in COPIED_TABLES}
        epoch = read_state(source).epoch
    _set_state(dest, epoch=epoch)
    return counts


def prune_feed_txn(cache: Connection, keep_events: int, older_than_ms: int) -> int:
    """Retention: drop feed events beyond the newest `keep_events` or older than a cutoff.

    The counter in `state` is untouched, so seqs are never reused; a subscriber that needed a
    pruned event notices the hole and gets a gap and a snapshot.
    """
    head = read_state(cache).feed_seq
    cursor = cache.execute(
        "DELETE FROM feed WHERE seq <= ? OR at < ?", (head - keep_events, older_than_ms)
    )
    _prune_file_feed(cache, keep_events, older_than_ms)
    return cursor.rowcount


class BuildStopped(Exception):
    """A rebuild given up between two chunks (`build_txn`'s `stop`): its transaction rolls
    back, the cache as it was."""


def build_txn(
    cache: Connection,
    source: TruthSource,
    clock: Clock = now_ms,
    stop: threading.Event | None = None,
) -> State:
    """Recompute every record from the truth under a new epoch (create, rebuild, or repair).

    Local files are kept: they are facts about the disk, not derived from the truth. The feed
    starts again empty under the new epoch, so old cursors get `gap` and a snapshot. Records are
    recomputed a chunk at a time and their events dropped, so memory stays bounded. A replan
    or a rebuild in place under way ends: every record is recomputed. So does the mark of
    commits lost to a restart of the machine (`LOST`): the records, the feed and its epoch are
    made anew. `stop`, once set, gives it up at the next chunk (`BuildStopped`): a Ctrl-C of
    `rebuild-cache` or `check`.
    """
    old = read_state(cache)
    cache.execute(
        "DELETE FROM state WHERE name LIKE ? OR name LIKE ? OR name = ?",
        (REPLAN + "%", REBUILD + "%", LOST),
    )
    cache.execute("DELETE FROM records")
    cache.execute("DELETE FROM cid_index")
    cache.execute("DELETE FROM group_document")
    cache.execute("DELETE FROM feed")
    cache.execute("DELETE FROM library")
    whole = Scope(whole=True)
    with source.snapshot() as view:
        seq = view.max_seq()
        for chunk in _chunks(view.active_rids()):
            if stop is not None and stop.is_set():
                raise BuildStopped("the rebuild was stopped; nothing of it was kept")
            refresh(cache, view, dict.fromkeys(chunk, whole))
    state = State(
        epoch=max(clock(), old.epoch + 1),
        applied_seq=seq,
        feed_seq=0,
        file_feed_seq=old.file_feed_seq,
        replanned=old.replanned,
    )
    _set_state(cache, epoch=state.epoch, applied_seq=state.applied_seq, feed_seq=0)
    return state


# -- local files (the watcher) ------------------------------------------------------------------


def local_txn(
    cache: Connection,
    source: TruthSource,
    upserts: Sequence[merge.LocalFile],
    removals: Sequence[str],
    clock: Clock = now_ms,
) -> State:
    """Record what the disk holds and recompute the local keys it changes, in one transaction.

    `removals` are paths of files or folders (every row under a folder goes). Both the old and the
    new midhash of each touched path have their `filePath`/`fileSize`/`mtimeNano` recomputed, so
    a rename (a removal and an upsert of the same content in one call) is one `set` of
    `filePath`, and replacing a file's content moves the path from one record to the other. The
    midhashes' groups must exist in the truth already (`TruthStore.ensure_groups`). What changed
    on disk is also appended to `file_feed` (`file_events`).
    """
    touched: set[str] = set()
    removed: dict[str, Row] = {}
    for path in removals:
        for row_path, midhash, size, mtime_ns in rows_at_or_below(cache, path):
            touched.add(midhash)
            removed[row_path] = (midhash, size, mtime_ns)
            cache.execute("DELETE FROM local_file WHERE path = ?", (row_path,))
    written: list[tuple[merge.LocalFile, bool]] = []  # (file, it is new at its path)
    recorded = 0  # rows written: none, and the transaction writes nothing at all
    for file in upserts:
        found = cache.execute(
            f"SELECT {_LOCAL_FILE} FROM local_file WHERE path = ?", (file.path,)
        ).fetchone()
        if found is not None and merge.LocalFile(*found) == file:
            continue  # recorded as it is already: two looks at one file (the start's, a rescan)
        recorded += 1
        before = (found[1], found[2], found[3]) if found else removed.pop(file.path, None)
        if before != (file.midhash, file.size, file.mtime_ns):  # else only its inode's ctime
            written.append((file, before is None))  # (a chmod, a link): no key changes
            touched.update([file.midhash] if before is None else [file.midhash, before[0]])
        cache.execute(
            f"INSERT INTO local_file ({_LOCAL_FILE}) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (path) DO UPDATE SET midhash = excluded.midhash, size = excluded.size, "
            "mtime_ns = excluded.mtime_ns, ino = excluded.ino, ctime_ns = excluded.ctime_ns",
            (file.path, file.midhash, file.size, file.mtime_ns, file.ino, file.ctime_ns),
        )
    state = read_state(cache)
    if not recorded and not removed:
        return state
    with source.snapshot() as view:
        rids = set(view.groups_of(touched).values())
        events = refresh_all(cache, view, {rid: Scope(group=True) for rid in rids})
    at = clock()
    last = _append_feed(cache, state, events, at)
    _set_state(cache, feed_seq=last)
    files = _append_file_feed(cache, state.file_feed_seq, file_events(removed, written), at)
    return replace(state, feed_seq=last, file_feed_seq=files)


def rows_at_or_below(conn: Connection, path: str) -> list[tuple[str, str, int, int]]:
    """The `local_file` rows (path, midhash, size, mtime_ns) of a file, or below a folder
    (with or without its last `/`): its path, then ["<path>/", "<path>0"), as "0" follows "/"
    in code point order; two ranges of the primary key. `substr(path, 1, n) = ?` read every
    row instead, once a path: a deleted show of 2,000 files in a library of 100,000 held the
    cache's writer for 58 s."""
    stem = path.rstrip("/")
    return [
        (row_path, midhash, size, mtime_ns)
        for row_path, midhash, size, mtime_ns in conn.execute(
            "SELECT path, midhash, size, mtime_ns FROM local_file "
            "WHERE path = ? OR (path >= ? AND path < ?)",
            (path, stem + "/", stem + "0"),
        )
    ]


def prefix_end(prefix: str) -> str | None:
    """The least text above every text that starts with `prefix` (None: no such text, as for
    an empty prefix), so that "starts with `prefix`" is the range [prefix, prefix_end) of an
    index: `substr(path, 1, n) = ?` read every row, as no index answers it (76 ms a page at
    100,000 files for a folder's few). Code point order, which is SQLite's for UTF-8 text and
    PostgreSQL's `COLLATE "C"` (`pg.ensure_schema`)."""
    stem = prefix.rstrip(chr(sys.maxunicode))  # nothing is above U+10FFFF: bound what it follows
    if not stem:
        return None
    following = ord(stem[-1]) + 1
    if 0xD800 <= following <= 0xDFFF:  # a surrogate is no text: the next code point is U+E000
        following = 0xE000
    return stem[:-1] + chr(following)


def files_query(prefix: str, after: str, limit: int) -> tuple[str, tuple[str | int, ...]]:
    """`files`' statement and values: a range of the primary key, from the later of `after`
    and `prefix`, bounded above where the prefix bounds it."""
    sql = (
        "SELECT f.path, f.midhash, f.size, f.mtime_ns, i.rid FROM local_file f "
        "LEFT JOIN cid_index i ON i.cid = f.midhash WHERE "
    )
    # one lower bound, the higher, for SQLite keeps only one of two as the range's start
    sql += "f.path > ?" if after >= prefix else "f.path >= ?"
    values: list[str | int] = [max(after, prefix)]
    end = prefix_end(prefix)
    if end is not None:
        sql += " AND f.path < ?"
        values.append(end)
    return sql + " ORDER BY f.path LIMIT ?", (*values, limit)


def subfolders(conn: Connection, folder: str, after: str, limit: int) -> tuple[list[str], bool]:
    """The names of the folders directly in `folder` that hold files (at any depth), in path
    order, after the one named `after` (if any): at most `limit`, and whether there are more
    (the Files page's folder list).

    A skip scan of the primary key, one statement a folder: the first path below `folder` that
    lies in a subfolder names it, and the next search starts past that subfolder's range, so
    its files are never read (the files directly in `folder` are stepped over inside the
    statement). 6,700 folders of 100,000 files need no read of every row, as a GROUP BY would.
    """
    start = folder.rstrip("/") + "/"
    end = prefix_end(start)
    sql = "SELECT path FROM local_file WHERE path >= ? AND path < ? AND substr(path, ?) LIKE '%/%'"
    names: list[str] = []
    bound = f"{start}{after}0" if after else start
    while len(names) <= limit:
        row = conn.execute(f"{sql} ORDER BY path LIMIT 1", (bound, end, len(start) + 1)).fetchone()
        if row is None:
            return names, False
        name = row[0][len(start) :].split("/", 1)[0]
        names.append(name)
        bound = f"{start}{name}0"  # past "<name>/…": "0" follows "/" (`local_stats`)
    return names[:limit], True


def local_stats(conn: Connection, paths: Iterable[str]) -> dict[str, Stat]:
    """path → the `Stat` (size, mtime_ns, ctime_ns, ino) of every local file row at or below
    the given paths: a watch root's files, or the rows an inotify batch touches (its files, and
    the files of a folder that went).

    One statement, each path a lookup and a range on the primary key, never a scan: the paths
    that start with "<path>/" are exactly those in ["<path>/", "<path>0"), as "0" follows "/" in
    code point order. A row without its inode (0: written before inodes were recorded) matches
    no file on the disk, so the next reconciliation hashes that file once more and records it;
    one without its ctime (`UNKNOWN_CTIME`) has it filled in (`watcher.plan`, `fill_ctimes_txn`).
    """
    wanted = sorted({path.rstrip("/") for path in paths})
    if not wanted:
        return {}
    return {
        path: Stat(size, mtime, ctime, ino)
        for path, size, mtime, ctime, ino in conn.execute(
            f"SELECT {_STAT_COLUMNS} FROM json_each(?) AS w JOIN local_file l "
            "ON l.path = w.value OR (l.path >= w.value || '/' AND l.path < w.value || '0')",
            (json.dumps(wanted),),
        )
    }


_STAT_COLUMNS = "l.path, l.size, l.mtime_ns, l.ctime_ns, l.ino"  # a `Stat` with its path


def local_stats_outside(conn: Connection, roots: Sequence[str]) -> dict[str, Stat]:
    """path → `Stat` of every local file row below none of `roots`: files of a folder no
    longer watched, or that `metanode scan` was given (a scan of the table)."""
    ranges = " AND ".join(["NOT (path >= ? AND path < ?)"] * len(roots)) or "true"
    bounds = [bound for root in roots for bound in (root.rstrip("/") + "/", root.rstrip("/") + "0")]
    return {
        path: Stat(size, mtime, ctime, ino)
        for path, size, mtime, ctime, ino in conn.execute(
            f"SELECT {_STAT_COLUMNS} FROM local_file l WHERE {ranges}", bounds
        )
    }


def fill_ctimes_txn(cache: Connection, found: Mapping[str, Stat]) -> None:
    """Record the ctime of files whose rows have none (`UNKNOWN_CTIME`: hashed before cache
    schema v14 kept it), as the disk shows it now, without hashing them: only where the row
    still holds that size, mtime and inode. So a library of 100,000 files is not hashed again
    at the first start after the upgrade (a write that put the size and mtime back before it
    stays unseen, as it was)."""
    cache.executemany(
        "UPDATE local_file SET ctime_ns = ? "
        "WHERE path = ? AND ctime_ns = ? AND size = ? AND mtime_ns = ? AND ino = ?",
        [(s.ctime_ns, path, UNKNOWN_CTIME, s.size, s.mtime_ns, s.ino) for path, s in found.items()],
    )


def files(conn: Connection, prefix: str, after: str, limit: int) -> list[dict[str, Any]]:
    """A page of local files with their midhash and current rid (GET /api/files): the paths
    after `after` in the range of those starting with `prefix` (`files_query`)."""
    rows = conn.execute(*files_query(prefix, after, limit))
    return [
        {"path": p, "midhash": m, "size": s, "mtimeNano": str(t), "rid": r}
        for p, m, s, t, r in rows
    ]


# -- file events (GET /api/events/files, docs/compat.md) -----------------------------------------

FILE_FEED_SEQ = "file_feed_seq"


def file_feed_head(conn: Connection) -> int:
    """The seq of the newest file event ever written (0: none); never goes back."""
    row = conn.execute("SELECT value FROM state WHERE name = ?", (FILE_FEED_SEQ,)).fetchone()
    return int(row[0]) if row else 0


def _append_file_feed(cache: Connection, head: int, events: Sequence[FileEvent], at: int) -> int:
    """File events on consecutive seqs after `head`; returns the new head."""
    if not events:
        return head
    cache.executemany(
        "INSERT INTO file_feed (seq, op, path, old_path, size, midhash, at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        [
            (head + i, e.op, e.path, e.old_path, e.size, e.midhash, at)
            for i, e in enumerate(events, 1)
        ],
    )
    _set_state(cache, **{FILE_FEED_SEQ: head + len(events)})
    return head + len(events)


def _prune_file_feed(cache: Connection, keep_events: int, older_than_ms: int) -> int:
    """The feed's retention, applied to the file events (the counter is kept: no seq reuse)."""
    return cache.execute(
        "DELETE FROM file_feed WHERE seq <= ? OR at < ?",
        (file_feed_head(cache) - keep_events, older_than_ms),
    ).rowcount


# -- reading the two event tables (feed.Hub pages them, feed.Reading snapshots) ------------------


class FeedRow(NamedTuple):
    """A `feed` row: framed by `GET /api/events` and by MetaMesh's meta stream, each its own way."""

    seq: int
    rid: str
    op: str
    key: str
    value: str | None
    at: int


class FileFeedRow(NamedTuple):
    """A `file_feed` row (MetaMesh's file events)."""

    seq: int
    op: str
    path: str
    old_path: str | None
    size: int
    midhash: str
    at: int


def feed_rows(conn: Connection, after: int, upto: int) -> list[FeedRow]:
    """The feed rows with seqs in (after, upto], in order."""
    return list(
        map(
            FeedRow._make,
            conn.execute(
                "SELECT seq, rid, op, key, value, at FROM feed "
                "WHERE seq > ? AND seq <= ? ORDER BY seq",
                (after, upto),
            ),
        )
    )


def file_feed_rows(conn: Connection, after: int, upto: int) -> list[FileFeedRow]:
    """The file events with seqs in (after, upto], in order."""
    return list(
        map(
            FileFeedRow._make,
            conn.execute(
                "SELECT seq, op, path, old_path, size, midhash, at FROM file_feed "
                "WHERE seq > ? AND seq <= ? ORDER BY seq",
                (after, upto),
            ),
        )
    )


def oldest_feed_seq(conn: Connection) -> int | None:
    """The oldest feed seq still stored (retention prunes from the front); None if empty."""
    value: int | None = conn.execute("SELECT min(seq) FROM feed").fetchone()[0]
    return value


def oldest_file_feed_seq(conn: Connection) -> int | None:
    value: int | None = conn.execute("SELECT min(seq) FROM file_feed").fetchone()[0]
    return value


Query = tuple[str, Sequence[object]]  # a statement and its parameters, for a `Reading`


def records_in_order(rids: Iterable[str] = ()) -> Query:
    """(rid, key, value) of every record (only of `rids`, if any) by rid and key: for a
    snapshot to fetch a page at a time."""
    wanted = sorted(rids)
    if wanted:
        return (
            "SELECT rid, key, value FROM records WHERE rid IN "
            f"({','.join('?' * len(wanted))}) ORDER BY rid, key",
            wanted,
        )
    return "SELECT rid, key, value FROM records ORDER BY rid, key", ()


def local_files_in_order() -> Query:
    """(path, midhash, size) of every local file by path, as above."""
    return "SELECT path, midhash, size FROM local_file ORDER BY path", ()


# -- plugin runs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginRun:
    plugin: str
    version: str
    midhash: str
    attempts: int
    updated_at: int = 0  # as picked: a run re-queued meanwhile is not marked finished


def enqueue_runs_txn(
    cache: Connection,
    versions: Sequence[tuple[str, str]],
    midhashes: Sequence[str] | None,
    now_ms: int,
) -> None:
    """Queue a run per (plugin, version) for the given midhashes, or for every local file (at
    the host's start, which also runs a version again that another ran after it: a rollback,
    2 → 1, left version 2's claims in place, version 1's runs being done).

    At the start the rows are stamped after every run of the plugin (`_after_every_run`), so
    "ran after" means it whatever the clock did since."""
    stamps = dict.fromkeys((plugin for plugin, _ in versions), now_ms)
    if midhashes is None:
        for plugin, version in versions:
            stamps[plugin] = _after_every_run(cache, plugin, now_ms)
            cache.execute(
                "UPDATE plugin_runs SET status = 'pending', attempts = 0, next_at = 0, "
                "error = NULL, updated_at = ? WHERE plugin = ? AND version = ? AND "
                "(SELECT max(updated_at) FROM plugin_runs WHERE plugin = ? AND version <> ?) > "
                "(SELECT max(updated_at) FROM plugin_runs WHERE plugin = ? AND version = ?)",
                (stamps[plugin], plugin, version, plugin, version, plugin, version),
            )
    source = (
        "SELECT DISTINCT midhash FROM local_file"
        if midhashes is None
        else "SELECT value AS midhash FROM json_each(?)"
    )
    params: tuple[Any, ...] = () if midhashes is None else (json.dumps(list(midhashes)),)
    for plugin, version in versions:
        cache.execute(
            "INSERT INTO plugin_runs (plugin, version, midhash, status, updated_at) "
            f"SELECT ?, ?, midhash, 'pending', ? FROM ({source}) AS s WHERE true "
            "ON CONFLICT DO NOTHING",
            (plugin, version, stamps[plugin], *params),
        )


def _after_every_run(cache: Connection, plugin: str, now_ms: int) -> int:
    """`now_ms`, or just after the newest `updated_at` of any version of `plugin` if that is
    later: a clock set back (a wrong year put right) made a new version's rows older than the
    old version's, which then read as a rollback at every start, and the new version ran on
    every file again each time."""
    newest = cache.execute(
        "SELECT max(updated_at) FROM plugin_runs WHERE plugin = ?", (plugin,)
    ).fetchone()[0]
    return now_ms if newest is None else max(now_ms, int(newest) + 1)


def due_runs(
    conn: Connection, plugin: str, version: str, now_ms: int, limit: int
) -> list[PluginRun]:
    """The first pending runs that are due of one plugin at one version, read in order from
    the `plugin_runs_next` index (`_v11`), however many other runs wait: rows of an old
    version or a disabled plugin stay in the table but never crowd out current work."""
    return [
        PluginRun(*row)
        for row in conn.execute(
            "SELECT plugin, version, midhash, attempts, updated_at FROM plugin_runs "
            "WHERE plugin = ? AND version = ? AND status = 'pending' AND next_at <= ? "
            "ORDER BY next_at, midhash LIMIT ?",
            (plugin, version, now_ms, limit),
        )
    ]


def still_pending(conn: Connection, run: PluginRun) -> bool:
    """Whether `run` is pending as it was picked (neither finished nor queued again since)."""
    row = conn.execute(
        "SELECT 1 FROM plugin_runs WHERE plugin = ? AND version = ? AND midhash = ? "
        "AND status = 'pending' AND updated_at = ?",
        (run.plugin, run.version, run.midhash, run.updated_at),
    ).fetchone()
    return row is not None


def file_of(conn: Connection, midhash: str) -> tuple[str, str, int, int] | None:
    """(midhash, first path, size, mtime_ns) of a local copy of this content, if any."""
    row = conn.execute(
        "SELECT midhash, path, size, mtime_ns FROM local_file WHERE midhash = ? "
        "ORDER BY path LIMIT 1",
        (midhash,),
    ).fetchone()
    return (row[0], row[1], row[2], row[3]) if row else None


def finish_run_txn(
    cache: Connection,
    run: PluginRun,
    status: str,
    attempts: int,
    next_at: int,
    error: str | None,
    now_ms: int,
) -> None:
    """Record a run's outcome, unless it was re-queued while it ran (`requeue_runs_txn`): then
    it stays pending and runs again on what is there now."""
    cache.execute(
        "UPDATE plugin_runs SET status = ?, attempts = ?, next_at = ?, error = ?, updated_at = ? "
        "WHERE plugin = ? AND version = ? AND midhash = ? AND updated_at = ?",
        (
            status,
            attempts,
            next_at,
            error,
            max(now_ms, run.updated_at + 1),
            run.plugin,
            run.version,
            run.midhash,
            run.updated_at,
        ),
    )


def requeue_runs_txn(
    cache: Connection,
    versions: Sequence[tuple[str, str]],
    midhashes: Sequence[str],
    now_ms: int,
) -> None:
    """Make the runs of these (plugin, version)s on these midhashes pending and due now, done
    or not (their paths changed); `updated_at` moves on, so a run in progress is not marked
    finished by its outcome."""
    for plugin, version in versions:
        cache.execute(
            "INSERT INTO plugin_runs (plugin, version, midhash, status, updated_at) "
            "SELECT ?, ?, value, 'pending', ? FROM json_each(?) WHERE true "
            "ON CONFLICT (plugin, version, midhash) DO UPDATE SET status = 'pending', "
            "attempts = 0, next_at = 0, error = NULL, "
            "updated_at = CASE WHEN excluded.updated_at > plugin_runs.updated_at "
            "THEN excluded.updated_at ELSE plugin_runs.updated_at + 1 END",
            (plugin, version, now_ms, json.dumps(sorted(set(midhashes)))),
        )


def midhashes_near(conn: Connection, folders: Iterable[str]) -> list[str]:
    """The midhashes of the local files in these folders and in their direct sub-folders (a
    range on the primary key per folder, as `local_stats`)."""
    found: set[str] = set()
    for folder in folders:
        stem = folder.rstrip("/")
        found.update(
            midhash
            for (midhash,) in conn.execute(
                "SELECT midhash FROM local_file WHERE path >= ? AND path < ? "
                "AND length(substr(path, ?)) - length(replace(substr(path, ?), '/', '')) <= 1",
                (stem + "/", stem + "0", len(stem) + 2, len(stem) + 2),
            )
        )
    return sorted(found)


def midhashes_at(conn: Connection, paths: Iterable[str]) -> dict[str, str]:
    """path → midhash of the local_file rows at these paths or below them (folders)."""
    return {
        row_path: midhash
        for path in paths
        for row_path, midhash, _, _ in rows_at_or_below(conn, path)
    }


def missing(conn: Connection, after: str, limit: int) -> list[dict[str, Any]]:
    """A page of records that hold a midhash but no local file any more (`GET /api/files
    ?missing=1`), in midhash order: a range of `cid_index`'s key, the rest by its indexes.
    A midhash's own file is looked for first, and the rest of its group only where that is
    gone: a library with nothing missing reads every midhash for an empty page, and the
    group of each cost 375 ms at 100,000 files where its own file costs 59."""
    rows = conn.execute(
        "SELECT i.cid, i.rid, (SELECT value FROM records r WHERE r.rid = i.rid "
        "AND r.key = 'fileName') FROM cid_index i "
        "WHERE i.cid > ? AND i.cid >= ? AND i.cid < ? "
        "AND NOT EXISTS (SELECT 1 FROM local_file f WHERE f.midhash = i.cid) AND NOT EXISTS ("
        "SELECT 1 FROM cid_index j JOIN local_file f ON f.midhash = j.cid WHERE j.rid = i.rid) "
        "ORDER BY i.cid LIMIT ?",
        (after, MIDHASH_PREFIX, MIDHASH_PREFIX[:-1] + "f", limit),
    )
    return [{"midhash": m, "rid": r, "fileName": name} for m, r, name in rows]


def finish_runs_txn(
    cache: Connection,
    rows: Sequence[tuple[PluginRun, str, int, int, str | None]],
    now_ms: int,
) -> None:
    """`finish_run_txn` of each of `rows` (run, status, attempts, next_at, error)."""
    for run, status, attempts, next_at, error in rows:
        finish_run_txn(cache, run, status, attempts, next_at, error, now_ms)


def drop_run_txn(cache: Connection, plugin: str, version: str, midhash: str) -> None:
    cache.execute(
        "DELETE FROM plugin_runs WHERE plugin = ? AND version = ? AND midhash = ?",
        (plugin, version, midhash),
    )


PluginRunCounts = dict[tuple[str, str], dict[str, int]]  # (plugin, version) → status → runs
Skips = dict[tuple[str, str], list[tuple[str, int]]]  # (plugin, version) → [(reason, runs)]
SKIPPED = "skipped: "  # how a done run's error says the plugin skipped the file, and why


def run_counts(conn: Connection, reasons: int) -> tuple[PluginRunCounts, Skips]:
    """Every (plugin, version)'s runs by status (a done run with an error is `skipped`), and
    its `reasons` commonest reasons to skip, most runs first: a read of the counts the
    triggers keep (`SCHEMA_V10`), not of the runs. The reasons tell a person what a plugin
    lacks (`ffprobe not found`) where a count does not."""
    counts: PluginRunCounts = {}
    skips: Skips = {}
    for plugin, version, status, reason, n in conn.execute(
        "SELECT plugin, version, shown, reason, runs FROM plugin_run_counts"
    ):
        empty = {"done": 0, "pending": 0, "failed": 0, "skipped": 0}
        counts.setdefault((plugin, version), empty)[status] += n
        if status == "skipped" and reasons:
            skips.setdefault((plugin, version), []).append((reason.removeprefix(SKIPPED), n))
    for listed in skips.values():
        listed.sort(key=lambda skip: (-skip[1], skip[0]))
        del listed[reasons:]
    return counts, skips


Failure = tuple[str, str | None, str, int]  # (midhash, a local path or None, error, when)


class RunReport(NamedTuple):
    """What `GET /api/plugins` says of the runs (`CacheStore.run_report`)."""

    counts: PluginRunCounts
    skips: Skips
    failures: dict[tuple[str, str], list[Failure]]


def failed_runs(conn: Connection, limit: int) -> dict[tuple[str, str], list[Failure]]:
    """The newest `limit` failed runs of each (plugin, version), newest first: one pass over
    the failed rows (the `(status, next_at)` index), for `GET /api/plugins`."""
    failures: dict[tuple[str, str], list[Failure]] = {}
    for plugin, version, midhash, path, error, at in conn.execute(
        "SELECT plugin, version, midhash, "
        "(SELECT min(path) FROM local_file f WHERE f.midhash = r.midhash), error, updated_at "
        "FROM (SELECT plugin, version, midhash, error, updated_at, row_number() OVER "
        "(PARTITION BY plugin, version ORDER BY updated_at DESC, midhash) AS n "
        "FROM plugin_runs WHERE status = 'failed') AS r WHERE n <= ? "
        "ORDER BY plugin, version, n",
        (limit,),
    ):
        failures.setdefault((plugin, version), []).append((midhash, path, error or "", at))
    return failures


class Retried(NamedTuple):
    """The runs `retry_txn` queued again: those that had failed, those that had skipped."""

    failed: int
    skipped: int


def retry_txn(cache: Connection, plugin: str, version: str, now_ms: int) -> Retried:
    """Make the failed runs of (plugin, version), and its skipped ones (done, with the reason),
    pending and due now. A skip is a plugin saying what it lacked (`ffprobe not found`): once
    that is installed, its files must run again, and a run that yields what the plugin said
    before signs nothing new (`plugins.replacing`)."""
    counts = [
        cache.execute(
            "UPDATE plugin_runs SET status = 'pending', attempts = 0, next_at = 0, error = NULL, "
            f"updated_at = ? WHERE plugin = ? AND version = ? AND {which}",
            (now_ms, plugin, version),
        ).rowcount
        for which in ("status = 'failed'", "status = 'done' AND error IS NOT NULL")
    ]
    return Retried(*counts)


# -- reads for the API --------------------------------------------------------------------------


def lookup(conn: Connection, cid: str) -> str | None:
    row = conn.execute("SELECT rid FROM cid_index WHERE cid = ?", (cid,)).fetchone()
    return row[0] if row else None


@dataclass(frozen=True)
class ScrapeCounts:
    """What `CacheStore.scrape_counts` counts: records, local files, and plugin runs by
    (plugin, version) and status."""

    records: int
    local_files: int
    runs: dict[tuple[str, str], dict[str, int]]


def record_count(conn: Connection) -> int:
    """How many records the cache holds (the /metrics `records` gauge)."""
    return int(conn.execute("SELECT count(DISTINCT rid) FROM cid_index").fetchone()[0])


def group_cids(conn: Connection, rid: str) -> list[str]:
    return [r[0] for r in conn.execute("SELECT cid FROM cid_index WHERE rid = ?", (rid,))]


@dataclass(frozen=True)
class Group:
    """What the cache holds of one group: its rid, CIDs, record rows and local file paths."""

    rid: str
    cids: list[str]
    record: dict[str, str]
    paths: list[str]


# One statement, so one implicit read snapshot: the group, its record and its files always agree,
# even while a merge is applied, without a BEGIN/COMMIT round trip around four queries.
_GROUP_SQL = """
WITH g(rid) AS ({which})
SELECT 0, rid, NULL FROM g
UNION ALL SELECT 1, cid, NULL FROM cid_index WHERE rid = (SELECT rid FROM g)
UNION ALL SELECT 2, key, value FROM records WHERE rid = (SELECT rid FROM g)
UNION ALL SELECT 3, path, NULL FROM local_file
    WHERE midhash IN (SELECT cid FROM cid_index WHERE rid = (SELECT rid FROM g))
"""
_GROUP_BY_CID = _GROUP_SQL.format(which="SELECT rid FROM cid_index WHERE cid = ?")
_GROUP_BY_RID = _GROUP_SQL.format(which="SELECT ?")


def _group(conn: Connection, sql: str, param: str) -> Group | None:
    rid: str | None = None
    members: list[str] = []
    record: dict[str, str] = {}
    paths: list[str] = []
    for part, a, b in conn.execute(sql, (param,)):
        if part == 0:
            rid = a
        elif part == 1:
            members.append(a)
        elif part == 2:
            record[a] = b
        else:
            paths.append(a)
    return Group(rid, members, record, paths) if rid is not None and members else None


def group_by_cid(conn: Connection, cid: str) -> Group | None:
    """The group holding `cid` (this exact spelling), or None."""
    return _group(conn, _GROUP_BY_CID, cid)


def group_by_rid(conn: Connection, rid: str) -> Group | None:
    """Group `rid`, or None if the cache does not hold it (yet)."""
    return _group(conn, _GROUP_BY_RID, rid)


def document(
    group: Group, asked: str | None, record: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The merged document of a group, as asked for by `asked` (None: by rid), showing `record`
    (default: the group's merged record; a viewer's view is `merge.seen_by` of it)."""
    ranked = merge.document(
        asked or "", group.cids, group.record if record is None else record, group.paths
    )
    if asked is None:
        ranked["cid"] = ranked["canonical_cid"]
    return ranked


def all_rids(conn: Connection) -> list[str]:
    """Every record's rid, in order, in one list (MetaMesh's unpaginated `GET /meta`)."""
    return [r[0] for r in conn.execute("SELECT DISTINCT rid FROM cid_index ORDER BY rid")]


def record_value(conn: Connection, rid: str, key: str) -> str | None:
    row = conn.execute("SELECT value FROM records WHERE rid = ? AND key = ?", (rid, key)).fetchone()
    return None if row is None else str(row[0])


def local_copies(conn: Connection, rid: str) -> tuple[list[merge.LocalFile], str | None]:
    """The local files of group `rid` by path, and its record's `mimeType` (None if it has
    none), read in one snapshot."""
    with snapshot(conn):
        files = local_files(conn, group_cids(conn, rid))
        mime = record_value(conn, rid, "mimeType")
    return sorted(files, key=lambda f: f.path), mime


def hash_ids(conn: Connection, after: str, limit: int) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT rid FROM cid_index WHERE rid > ? ORDER BY rid LIMIT ?", (after, limit)
        )
    ]


_LIBRARY_COLUMNS = "l.rid, l.title, l.name, l.year, l.type, l.files"
NEWEST = "~"  # above every rid: the `before` of the first page
SEARCH_WORDS = 64  # the words of a search that are asked (`fts_query`)


def fts_query(text: str) -> str:
    """The FTS5 query of what a person typed: every word, as a prefix, all of them required;
    a word of an unspaced script the phrase of its characters (`labels.search_phrases`, read
    as the index holds the titles: `search_words`). Words are quoted, so no input is FTS5
    syntax (an operator or a stray quote cannot fail). A word typed twice is asked once, and
    only the first `SEARCH_WORDS` are asked: a pasted page of 30,000 words took a second on
    SQLite and exceeded PostgreSQL's stack depth (a 500), where 64 words find what they find."""
    phrases = dict.fromkeys(" ".join(words) for words in labels.search_phrases(text))
    return " ".join(f'"{phrase}"*' for phrase in list(phrases)[:SEARCH_WORDS])


def library_query(match: str, kind: str, held: bool | None, sidecars: bool, newer: bool) -> str:
    """The statement of one library page: the rows just below `:bound` (a rid), newest first,
    or with `newer` the rows just above it, oldest first (the page before, which the caller
    turns round), through an index whatever the filter. With words, the full-text index picks
    the rows (`library_fts MATCH`), the primary key joins them, and they are sorted (as many as
    match); else the rid, type or files index reads just one page. `held`: only records with
    a local file (True), only those with none left (False), or either (None).
    `labels.SIDECARS` are left out unless `sidecars` or `kind` names one."""
    where = ["l.rid > :bound" if newer else "l.rid < :bound"]
    source = "library l"
    if match:
        # CROSS JOIN: SQLite keeps the tables in this order, so the index of the words leads
        # and a type filter checks only the rows it found, never every row of that type.
        source = "library_fts f CROSS JOIN library l ON l.id = f.rowid"
        where.append("library_fts MATCH :match")
    if kind:
        where.append("l.type = :kind")
    elif not sidecars:
        where.append(f"l.type NOT IN ({', '.join(repr(side) for side in labels.SIDECARS)})")
    if held is not None:
        where.append("l.files > 0" if held else "l.files = 0")
    return (
        f"SELECT {_LIBRARY_COLUMNS} FROM {source} WHERE {' AND '.join(where)} "
        f"ORDER BY l.rid {'ASC' if newer else 'DESC'} LIMIT :limit"
    )


def library_page(
    conn: Connection,
    text: str,
    kind: str,
    held: bool | None,
    bound: str,
    limit: int,
    *,
    sidecars: bool = False,
    newer: bool = False,
) -> list[LibraryRow]:
    """A page of the library, newest first: the `limit` rows below rid `bound`, or with
    `newer` the `limit` rows just above it (see `library_query`); words that make no query
    match nothing."""
    match = fts_query(text)
    if text.strip() and not match:
        return []
    params = {"bound": bound, "match": match, "kind": kind, "limit": limit}
    rows = [
        LibraryRow(*row)
        for row in conn.execute(library_query(match, kind, held, sidecars, newer), params)
    ]
    return rows[::-1] if newer else rows


def library_plan(conn: Connection, text: str, kind: str, held: bool | None) -> list[str]:
    """`EXPLAIN QUERY PLAN` of `library_page`'s statement (the benchmark shows it is index
    lookups, never a table scan)."""
    match = fts_query(text)
    params = {"bound": NEWEST, "match": match, "kind": kind, "limit": 50}
    sql = "EXPLAIN QUERY PLAN " + library_query(match, kind, held, False, False)
    return [str(row[-1]) for row in conn.execute(sql, params)]


def library_types(conn: Connection) -> list[str]:
    """Every distinct non-empty type, one index lookup per type (a skip scan of
    `library_type`, not a read of every row)."""
    return [
        r[0]
        for r in conn.execute(
            "WITH RECURSIVE t(v) AS (SELECT min(type) FROM library WHERE type > '' "
            "UNION ALL SELECT (SELECT min(type) FROM library WHERE type > t.v) FROM t "
            "WHERE t.v IS NOT NULL) SELECT v FROM t WHERE v IS NOT NULL"
        )
    ]


def duplicates(conn: Connection, limit: int) -> list[tuple[str, list[str]]]:
    """Contents held at several paths: (midhash, its paths), at most `limit` contents, by
    midhash. Only a record of two local files or more can hold one (`library.files`, an
    index): grouping every `local_file` row by midhash read the whole table at each Files page
    (70–120 ms at 100,000 files, on the event loop). The records are read one by one, until
    `limit` contents are found at several paths."""
    paths: dict[str, list[str]] = {}
    found = 0
    last = None
    for rid, midhash, path in conn.execute(
        "SELECT l.rid, f.midhash, f.path FROM library l JOIN cid_index i ON i.rid = l.rid "
        "JOIN local_file f ON f.midhash = i.cid WHERE l.files > 1 ORDER BY l.files, l.rid"
    ):
        if rid != last and found >= limit:
            break  # the records read so far are whole: each content's paths are all here
        last = rid
        held = paths.setdefault(midhash, [])
        held.append(path)
        found += len(held) == 2
    listed = sorted((midhash, sorted(held)) for midhash, held in paths.items() if len(held) > 1)
    return listed[:limit]


def diff(live: Connection, fresh: Connection) -> list[str]:
    """Human-readable differences between two caches' records, cid index and library index
    (for `check`): each table read from both in the order of its key, side by side, so that
    only the differences are held. Read whole into sets, they held both caches in memory: 450
    MB for 100,000 files with no plugin claim, 560 MB with their first 170,000."""
    out = []
    for table, key, sql in (
        ("records", 2, "SELECT rid, key, value FROM records ORDER BY rid, key"),
        ("cid_index", 1, "SELECT cid, rid FROM cid_index ORDER BY cid"),
        (
            "library",
            1,
            "SELECT rid, title, name, year, type, files, words FROM library ORDER BY rid",
        ),
        ("documents", 1, "SELECT rid, body FROM group_document ORDER BY rid"),
    ):
        only_live, only_fresh = differences(live.execute(sql), fresh.execute(sql), key)
        out += [f"{table}: only in live cache: {row}" for row in only_live]
        out += [f"{table}: missing from live cache: {row}" for row in only_fresh]
    return out + run_count_drift(live)


TableRow = tuple[Any, ...]


def differences(
    live: Iterable[Sequence[Any]], fresh: Iterable[Sequence[Any]], key: int
) -> tuple[list[TableRow], list[TableRow]]:
    """The rows only in `live` and those only in `fresh`, of two row streams ordered by their
    first `key` columns (which no two rows of one stream share): a merge of the two, one row
    of each in memory at a time. Two rows of one key that differ are one in each list."""
    only_live: list[TableRow] = []
    only_fresh: list[TableRow] = []
    ours, theirs = map(tuple, live), map(tuple, fresh)
    a, b = next(ours, None), next(theirs, None)
    while a is not None or b is not None:
        if a is not None and (b is None or a[:key] < b[:key]):
            only_live.append(a)
            a = next(ours, None)
        elif b is not None and (a is None or b[:key] < a[:key]):
            only_fresh.append(b)
            b = next(theirs, None)
        else:  # a row of the same key on each side
            assert a is not None and b is not None
            if a != b:
                only_live.append(a)
                only_fresh.append(b)
            a, b = next(ours, None), next(theirs, None)
    return only_live, only_fresh


def run_count_drift(conn: Connection) -> list[str]:
    """Where the plugin run counts the triggers keep differ from a scan of the runs (a rebuild
    does not make runs: they are compared with their own table). Nothing, unless a write
    path the triggers miss came to be, or rows were edited by hand."""
    kept = {
        tuple(row)
        for row in conn.execute(
            "SELECT plugin, version, shown, reason, runs FROM plugin_run_counts"
        )
    }
    scanned = {tuple(row) for row in conn.execute(_RUN_COUNTS_SCAN)}
    return [f"plugin_run_counts: kept {row}, not in the runs" for row in sorted(kept - scanned)] + [
        f"plugin_run_counts: not kept {row}, in the runs" for row in sorted(scanned - kept)
    ]


# -- the store ----------------------------------------------------------------------------------


class Reading:
    """An open read transaction on a read-only aiosqlite connection of its own: the cache state
    it reflects, and the rows of one query, fetched a page at a time on the connection's thread
    so that a large cache never stalls the event loop. Made by `CacheStore.records_reading` and
    `files_reading` (`open`); holds the connection until `close()`, which nothing else sees.

    A cancelled `rows()` returns at once while its fetch finishes on that thread; `close()`
    queues behind it (`db.connect_reader`), so the read transaction ends right after that page.
    """

    def __init__(
        self, conn: aiosqlite.Connection | AsyncReader, state: State, rows: Any, page: int
    ) -> None:
        self.state = state
        self._conn = conn
        self._rows = rows
        self._page = page
        self._closed = False

    @classmethod
    async def open(cls, path: Target, query: Query, page: int) -> Reading:
        """`BEGIN`, the state, the query's cursor: one read transaction from here to `close`."""
        conn = await connect_reader(path)
        try:
            with storage_errors(path):
                await conn.execute_fetchall("BEGIN")
                state = state_of(await conn.execute_fetchall(STATE))
                rows = await conn.execute(*query)
        except BaseException:
            await conn.close()
            raise
        return cls(conn, state, rows, page)

    async def rows(self) -> list[Any]:
        """The next page of rows (as the query names its columns); empty at the end."""
        with storage_errors():
            return list(await self._rows.fetchmany(self._page))

    async def close(self) -> None:
        """End the read transaction and free the file; idempotent. The cursor first, since a
        connection closed while a cursor still holds a statement keeps its file open until that
        cursor is garbage. Both are queued before any await, so a cancellation cannot skip the
        connection's close."""
        if self._closed:
            return
        self._closed = True
        with storage_errors():
            try:
                await self._rows.close()
            finally:
                await self._conn.close()


class CacheStore(Store):
    """cache.db: its schema, its single writer, its read connection and every statement on it.

    `open()` migrates, starts the writer thread and opens the event loop's read connection (the
    primary-key reads of GET /api/meta stay there: microseconds, no thread hop). The apply path
    (`apply`, `build`, `apply_local`) runs on the writer and reads the truth only through a
    `view.TruthSource`; the feed's snapshots (`records_reading`, `files_reading`) each open an
    aiosqlite connection of their own (a `Reading`), paged off the loop. Callers
    see values (`State`, `Group`, `FeedRow` …), never a connection; a storage failure is raised
    as its typed `StorageError`.
    """

    name = "cache"
    migrations = MIGRATIONS
    pg_migrations = PG_MIGRATIONS

    def __init__(self, path: Target, clock: Clock = now_ms, *, relaxed: bool = False) -> None:
        """`relaxed`: the writer commits without an fsync (`synchronous=NORMAL`), where that
        can be made safe: a SQLite file on a machine whose boots can be told apart
        (`db.boot_id`). A commit then survives a crash of metanode (it is in the operating
        system's cache) but maybe not of the machine; so the store marks the cache with the
        boot it commits under until it closes cleanly (`relax_txn`, `settle_txn`, fsync'd),
        and a later open under another boot finds it `lost`, which `Applier` rebuilds under a
        new feed epoch. One fsync fewer on every write: +20 % at one claim a request
        (docs/benchmarks.md, "Session 24"). The truth commits with an fsync always."""
        super().__init__(path, clock)
        self._boot = boot_id() if relaxed and isinstance(path, Path) else None

    def newer_schema_remedy(self) -> str:
        """The cache holds nothing the truth does not: a newer one is rebuilt, not restored,
        and a restore would throw away every claim made since the upgrade. Moving it aside
        costs a hash of every watched file and every plugin run again, nothing else."""
        if isinstance(self.path, pg.Target):
            aside = f"drop the schema {self.path.schema} (DROP SCHEMA {self.path.schema} CASCADE)"
        else:
            aside = f"move {self.path.name} (with its -wal and -shm) out of the data directory"
        return (
            f"let it build the cache anew from the truth: with the node stopped, {aside}; the "
            "claims are all in the truth, the files are hashed and the plugins run again "
            "(docs/operations.md, 'Upgrading')"
        )

    def _writer_pragmas(self) -> Sequence[str]:
        if self._boot is None:
            return ()
        with contextlib.closing(connect(self.path)) as conn:  # fsync'd: synchronous=FULL
            run_txn(conn, relax_txn, self._boot, where=self.path)
        return ("PRAGMA synchronous=NORMAL",)

    def close(self) -> None:
        """`Store.close`, then, if relaxed, the fsync'd mark of a clean close (`settle_txn`):
        only once the writer has stopped, so no commit without an fsync follows it."""
        super().close()
        if self._boot is None:
            return
        try:
            with contextlib.closing(connect(self.path)) as conn:
                run_txn(conn, settle_txn, where=self.path)
        except StorageError as exc:  # the mark stays: a restart of the machine rebuilds
            log.warning("could not mark cache.db closed cleanly (%s)", exc.message)

    # -- the apply path -------------------------------------------------------------------------

    async def apply(self, source: TruthSource, written: Sequence[Written] = ()) -> State:
        """Apply the truth's outbox after the stored seq and take a replan step (`apply_txn`),
        told what the ingest transactions wrote (`written`) so as not to read it back."""
        return await self.writer.run(apply_txn, source, self._clock, written, True)

    def apply_sync(self, source: TruthSource, written: Sequence[Written] = ()) -> State:
        return self.writer.run_sync(apply_txn, source, self._clock, written, True)

    def apply_ahead(
        self, source: TruthSource, written: Sequence[Written], committed: Callable[[], None]
    ) -> concurrent.futures.Future[State]:
        """Queue the apply of what an ingest transaction wrote, before its COMMIT has returned
        (`apply_ahead_txn`), from any thread; its future holds the state it committed."""
        return self.writer.submit(apply_ahead_txn, source, self._clock, written, committed)

    async def start_rebuild(self) -> State:
        """Start a rebuild in place, which the applier's applies then take a step at a time
        (`start_rebuild_txn`)."""
        return await self.writer.run(start_rebuild_txn)

    async def build(self, source: TruthSource) -> State:
        """Recompute every record under a new epoch (`build_txn`)."""
        return await self.writer.run(build_txn, source, self._clock)

    def build_sync(self, source: TruthSource, files: Sequence[merge.LocalFile] = ()) -> State:
        """`build`, first inserting `files` as local_file rows (`check`'s fresh rebuild into an
        empty cache), in the same transaction. A Ctrl-C while it runs (the command line's: the
        caller waits here) stops the rebuild at its next chunk and rolls it back before the
        KeyboardInterrupt goes on: it ran to its end behind `error: interrupted`, up to a
        minute on a large box, the cache rebuilt (a new epoch, a gap for every feed reader)
        after the operator was told it was not."""
        stop = threading.Event()
        future = self.writer.submit(_build_with_files, source, files, self._clock, stop)
        try:
            return future.result()
        except KeyboardInterrupt:
            stop.set()
            concurrent.futures.wait([future])
            raise

    async def apply_local(
        self, source: TruthSource, files: Sequence[merge.LocalFile], removals: Sequence[str]
    ) -> State:
        """The watcher's results: local_file rows and local keys (`local_txn`)."""
        return await self.writer.run(local_txn, source, files, removals, self._clock)

    async def fill_ctimes(self, found: Mapping[str, Stat]) -> None:
        """The watcher's first look at files whose rows have no ctime (`fill_ctimes_txn`)."""
        await self.writer.run(fill_ctimes_txn, found)

    async def drained(self) -> None:
        """Return once every write queued before this call has committed."""
        await self.writer.run(_nothing)

    async def prune_feed(self, keep_events: int, older_than_ms: int) -> int:
        """Retention of both event tables (`prune_feed_txn`); how many feed events went."""
        return await self.writer.run(prune_feed_txn, keep_events, older_than_ms)

    # -- plugin runs ----------------------------------------------------------------------------

    async def enqueue_runs(
        self, versions: Sequence[tuple[str, str]], midhashes: Sequence[str] | None
    ) -> None:
        await self.writer.run(enqueue_runs_txn, versions, midhashes, self._clock())

    async def finish_run(
        self, run: PluginRun, status: str, attempts: int, next_at: int, error: str | None
    ) -> None:
        await self.writer.run(finish_run_txn, run, status, attempts, next_at, error, self._clock())

    async def finish_runs(
        self, rows: Sequence[tuple[PluginRun, str, int, int, str | None]]
    ) -> None:
        """`finish_run` of many runs (run, status, attempts, next_at, error) in one
        transaction: the runs whose claims one turn of the plugin host committed together."""
        if rows:
            await self.writer.run(finish_runs_txn, rows, self._clock())

    async def drop_run(self, run: PluginRun) -> None:
        await self.writer.run(drop_run_txn, run.plugin, run.version, run.midhash)

    async def requeue_runs(
        self, versions: Sequence[tuple[str, str]], midhashes: Sequence[str]
    ) -> None:
        if versions and midhashes:
            await self.writer.run(requeue_runs_txn, versions, midhashes, self._clock())

    @mapped
    def midhashes_near(self, folders: Sequence[str]) -> list[str]:
        return midhashes_near(self.conn, folders)

    @mapped
    def midhashes_at(self, paths: Sequence[str]) -> dict[str, str]:
        return midhashes_at(self.conn, paths)

    def missing(self, after: str, limit: int) -> list[dict[str, Any]]:
        """`missing` on a read connection of its own, for a thread: with nothing missing it
        reads every midhash (59 ms at 100,000 files), which on the event loop's connection
        held every other request as long."""
        with self.reading() as conn, storage_errors(self.path):
            return missing(conn, after, limit)

    @mapped
    def due_runs(self, plugin: str, version: str, limit: int) -> list[PluginRun]:
        return due_runs(self.conn, plugin, version, self._clock(), limit)

    @mapped
    def still_pending(self, run: PluginRun) -> bool:
        return still_pending(self.conn, run)

    @mapped
    def file_of(self, midhash: str) -> tuple[str, str, int, int] | None:
        return file_of(self.conn, midhash)

    async def retry(self, plugin: str, version: str) -> Retried:
        return await self.writer.run(retry_txn, plugin, version, self._clock())

    def run_report(self, failures: int, reasons: int) -> RunReport:
        """On a connection of its own, for a thread: a scan of every plugin run (one a file and
        plugin) and the newest `failures` failed ones of each, so `GET /api/plugins` and the
        plugins page run it off the event loop; not on a lent connection (`scrape_counts`)."""
        with self.reading(lent=False) as conn, storage_errors(self.path):
            return RunReport(*run_counts(conn, reasons), failed_runs(conn, failures))

    # -- reads ----------------------------------------------------------------------------------

    @mapped
    def state(self) -> State:
        return read_state(self.conn)

    @mapped
    def lookup(self, cid: str) -> str | None:
        return lookup(self.conn, cid)

    @mapped
    def group_by_cid(self, cid: str) -> Group | None:
        return group_by_cid(self.conn, cid)

    @mapped
    def holding(self) -> list[str]:
        """Which of the tables a migration copies hold rows (its target must hold none)."""
        return holds_rows(self.conn, [t for t, _ in COPIED_TABLES])

    def copy_local_from(self, source: CacheStore) -> dict[str, int]:
        """`copy_local_txn` of `source` into this (empty) cache, on this store's writer."""
        with source.reading() as conn:
            return self.writer.run_sync(copy_local_txn, conn)

    def applier_lock(self) -> SessionLock | None:
        """On PostgreSQL, the session lock that makes one replica of all those sharing this
        cache its applier (`applier.Replica`); None on SQLite, where the data directory's
        lock already makes the node the only one."""
        return SessionLock(self.path, "applier") if isinstance(self.path, pg.Target) else None

    @mapped
    def data_version(self) -> int:
        """SQLite's `PRAGMA data_version` of the loop connection: it moves whenever another
        connection (another process's writer) commits (`applier.Follower`)."""
        return data_version(self.conn)

    @mapped
    def rendered(self, cid: str) -> bytes | None:
        return rendered(self.conn, cid)

    @mapped
    def group_by_rid(self, rid: str) -> Group | None:
        return group_by_rid(self.conn, rid)

    def record_of(self, cid: str) -> dict[str, str] | None:
        """The merged record of the group holding `cid`, on a connection of its own: for
        threads (plugins), which must not share the event loop's."""
        with self.reading() as conn, storage_errors(self.path):
            group = group_by_cid(conn, cid)
        return None if group is None else dict(sorted(group.record.items()))

    @mapped
    def record_rows(self, rid: str) -> dict[str, str]:
        return record_rows(self.conn, rid)  # one statement: one snapshot

    @mapped
    def record_value(self, rid: str, key: str) -> str | None:
        return record_value(self.conn, rid, key)

    @mapped
    def local_copies(self, rid: str) -> tuple[list[merge.LocalFile], str | None]:
        return local_copies(self.conn, rid)

    def all_rids(self) -> list[str]:
        """Every record's rid, on a read connection of its own, for a thread: a read of the
        whole CID index (0.06–0.1 s at 100,000 records, more with each CID the plugins add),
        which on the event loop's connection held every other request as long."""
        with self.reading() as conn, storage_errors(self.path):
            return all_rids(conn)

    @mapped
    def hash_ids(self, after: str, limit: int) -> list[str]:
        return hash_ids(self.conn, after, limit)

    @mapped
    def files(self, prefix: str, after: str, limit: int) -> list[dict[str, Any]]:
        return files(self.conn, prefix, after, limit)

    def subfolders(self, folder: str, after: str, limit: int) -> tuple[list[str], bool]:
        """`subfolders` on a read connection of its own, for a thread: a folder with many
        files directly in it is stepped over row by row."""
        with self.reading() as conn, storage_errors(self.path):
            return subfolders(conn, folder, after, limit)

    @mapped
    def local_stats(self, paths: Iterable[str]) -> dict[str, Stat]:
        return local_stats(self.conn, paths)

    def local_stats_outside(self, roots: Sequence[str]) -> dict[str, Stat]:
        """`local_stats_outside` on a connection of its own: a thread's (a scan of the table
        must not hold the event loop)."""
        with self.reading(lent=False) as conn:
            return local_stats_outside(conn, roots)

    @mapped
    def all_local_files(self) -> list[merge.LocalFile]:
        return all_local_files(self.conn)

    @mapped
    def library_page(
        self,
        text: str,
        kind: str,
        held: bool | None,
        bound: str,
        limit: int,
        *,
        sidecars: bool = False,
        newer: bool = False,
    ) -> list[LibraryRow]:
        return library_page(
            self.conn, text, kind, held, bound, limit, sidecars=sidecars, newer=newer
        )

    @mapped
    def library_plan(self, text: str, kind: str, held: bool | None) -> list[str]:
        return library_plan(self.conn, text, kind, held)

    @mapped
    def library_types(self) -> list[str]:
        return library_types(self.conn)

    @mapped
    def duplicates(self, limit: int) -> list[tuple[str, list[str]]]:
        return duplicates(self.conn, limit)

    def scrape_counts(self) -> ScrapeCounts:
        """The /metrics gauges that count rows, on a connection of its own, for a thread: scans
        (0.15 s for the records at 1M), so a scrape runs them off the event loop
        (`Node.metrics_text`); never on a connection the pool lends (`reading(lent=False)`)."""
        with self.reading(lent=False) as conn, storage_errors(self.path):
            return ScrapeCounts(record_count(conn), local_file_count(conn), run_counts(conn, 0)[0])

    @mapped
    def diff(self, fresh: CacheStore) -> list[str]:
        """Human-readable differences of records and cid index from `fresh`, and of the run
        counts from the runs (for `check`)."""
        return diff(self.conn, fresh.conn)

    # -- the event tables -----------------------------------------------------------------------

    @mapped
    def feed_page(self, after: int, upto: int) -> tuple[State, list[FeedRow]]:
        """(the state, the feed rows in (after, upto]) in one read transaction."""
        with snapshot(self.conn):
            return read_state(self.conn), feed_rows(self.conn, after, upto)

    @mapped
    def file_feed_page(self, after: int, upto: int) -> tuple[State, list[FileFeedRow]]:
        with snapshot(self.conn):
            return read_state(self.conn), file_feed_rows(self.conn, after, upto)

    @mapped
    def oldest_feed_seq(self) -> int | None:
        return oldest_feed_seq(self.conn)

    @mapped
    def oldest_file_feed_seq(self) -> int | None:
        return oldest_file_feed_seq(self.conn)

    async def records_reading(self, rids: Iterable[str], page: int) -> Reading:
        """Every record's (rid, key, value) (only of `rids`, if any), by rid and key."""
        return await Reading.open(self.path, records_in_order(rids), page)

    async def files_reading(self, page: int) -> Reading:
        """Every local file's (path, midhash, size), by path."""
        return await Reading.open(self.path, local_files_in_order(), page)


def _build_with_files(
    cache: Connection,
    source: TruthSource,
    files: Sequence[merge.LocalFile],
    clock: Clock,
    stop: threading.Event,
) -> State:
    put_local_files(cache, files)
    return build_txn(cache, source, clock, stop)


def _nothing(cache: Connection) -> None:
    """An empty transaction: `drained`'s marker in the writer's queue."""
