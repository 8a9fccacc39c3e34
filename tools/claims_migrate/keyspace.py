"""Reading a meta-core Redis keyspace, both layouts, into plain records (docs/migration.md).

* v1.x flat: one STRING per leaf `file:<rid>/<field path>`, the key-set `file:<rid>/cids/<cid>` =
  "true", the reverse index `cid:<cid>` → rid, the SETs `file:<rid>/__fields__` and
  `file:<rid>/duplicates`, and the SET `file:__index__` of every rid.
* older: one HASH per record `file:<hashId>` (hashIds like `midhash256:<cid>`), its fields inside,
  plus the SET `file:__index__`.

Nothing here interprets a field: a record is its root id, its string fields, its SET-typed fields
and what could not be read. `plan.py` decides what each becomes. Reading is SCAN + pipelined TYPE,
then MGET / HGETALL / SMEMBERS in chunks, so it works on any Redis version and a keyspace of
hundreds of thousands of keys costs a few hundred round trips.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis

SCAN_COUNT = 1000
CHUNK = 1000
SCHEMA_VERSION_KEY = "meta-core:schema-version"
INDEX = "__index__"


def decode_key(raw: bytes) -> str:
    """A key or field name as text; bytes that are not UTF-8 survive as surrogates (and then
    fail claim validation as `invalid_key`, rather than being silently changed)."""
    return raw.decode("utf-8", "surrogateescape")


def decode_value(raw: bytes) -> str | None:
    """A value as text, or None if it is not UTF-8 (a claim value must be a Unicode string)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass
class SourceRecord:
    """One meta-core record as Redis holds it."""

    root: str  # the id after `file:`: a rid (v1.x), a hashId (older), or a literal CID
    layouts: set[str] = field(default_factory=set)  # "flat" and/or "hash"
    fields: dict[str, str] = field(default_factory=dict)  # string fields
    sets: dict[str, list[str]] = field(default_factory=dict)  # SET-typed fields
    unreadable: dict[str, str] = field(default_factory=dict)  # field → reason it was not read
    indexed: bool = False  # a member of `file:__index__`


@dataclass
class Keyspace:
    records: dict[str, SourceRecord] = field(default_factory=dict)
    index: dict[str, str] = field(default_factory=dict)  # `cid:` key suffix → its value
    index_members: int = 0
    schema_version: str | None = None
    keys_read: int = 0
    ignored: Counter[str] = field(default_factory=Counter)  # keys not understood, by Redis type

    def record(self, root: str) -> SourceRecord:
        found = self.records.get(root)
        if found is None:
            found = self.records[root] = SourceRecord(root)
        return found


def _glob_escape(text: str) -> str:
    """A literal for a SCAN MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _chunks(client: redis.Redis, pattern: str) -> Iterator[list[bytes]]:
    """Every key matching `pattern`, once each, in lists of at most CHUNK."""
    seen: set[bytes] = set()
    chunk: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=SCAN_COUNT):
        raw = cast(bytes, key)
        if raw in seen:  # SCAN may return a key twice
            continue
        seen.add(raw)
        chunk.append(raw)
        if len(chunk) >= CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _pipelined(
    client: redis.Redis, keys: Sequence[bytes], command: Callable[[Any, bytes], object]
) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        command(pipe, key)
    result: list[Any] = pipe.execute()
    return result


def read(
    client: redis.Redis, prefix: str = "", progress: Callable[[int], None] | None = None
) -> Keyspace:
    """Read every record key, the `cid:` index and the schema sentinel under `prefix`.

    `progress(n)` is called with the number of keys read since its last call.
    """
    space = Keyspace()
    file_prefix, cid_prefix = prefix + "file:", prefix + "cid:"
    for chunk in _chunks(client, _glob_escape(file_prefix) + "*"):
        types = _pipelined(client, chunk, lambda p, k: p.type(k))
        by_type: dict[str, list[bytes]] = {}
        for key, kind in zip(chunk, types, strict=True):
            name = kind.decode() if isinstance(kind, bytes) else str(kind)
            by_type.setdefault(name, []).append(key)
        _read_strings(client, space, file_prefix, by_type.pop("string", []))
        _read_hashes(client, space, file_prefix, by_type.pop("hash", []))
        _read_sets(client, space, file_prefix, by_type.pop("set", []))
        for kind, keys in by_type.items():
            for key in keys:
                root, sep, name = decode_key(key)[len(file_prefix) :].partition("/")
                if sep and kind != "none":
                    space.record(root).unreadable[name] = "not_a_string"
                elif kind != "none":  # e.g. the watcher's `file:events` stream
                    space.ignored[kind] += 1
        space.keys_read += len(chunk)
        if progress is not None:
            progress(len(chunk))
    for chunk in _chunks(client, _glob_escape(cid_prefix) + "*"):
        values = cast(list[bytes | None], client.mget(chunk))
        for key, value in zip(chunk, values, strict=True):
            text = None if value is None else decode_value(value)
            if text is None:
                space.ignored["cid: index entry not a string"] += 1
                continue
            space.index[decode_key(key)[len(cid_prefix) :]] = text.strip()
        space.keys_read += len(chunk)
        if progress is not None:
            progress(len(chunk))
    version = cast(bytes | None, client.get(prefix + SCHEMA_VERSION_KEY))
    space.schema_version = None if version is None else decode_value(version)
    return space


def _read_strings(
    client: redis.Redis, space: Keyspace, file_prefix: str, keys: list[bytes]
) -> None:
    if not keys:
        return
    values = cast(list[bytes | None], client.mget(keys))
    for key, value in zip(keys, values, strict=True):
        root, sep, name = decode_key(key)[len(file_prefix) :].partition("/")
        if not sep:
            space.ignored["string"] += 1  # `file:<x>` holding a plain string: no layout has that
            continue
        if value is None:
            continue  # expired or deleted between SCAN and MGET
        record = space.record(root)
        record.layouts.add("flat")
        _put(record, name, value)


def _put(record: SourceRecord, name: str, raw: bytes) -> None:
    """One field's value, or why it cannot be migrated (bytes that are not UTF-8)."""
    text = decode_value(raw)
    if text is None:
        record.unreadable[name] = "invalid_utf8"
    else:
        record.fields[name] = text


def _read_hashes(client: redis.Redis, space: Keyspace, file_prefix: str, keys: list[bytes]) -> None:
    if not keys:
        return
    for key, mapping in zip(keys, _pipelined(client, keys, lambda p, k: p.hgetall(k)), strict=True):
        root, sep, name = decode_key(key)[len(file_prefix) :].partition("/")
        record = space.record(root)
        if sep:  # a HASH at a flat leaf: not a value a claim can carry
            record.unreadable[name] = "not_a_string"
            continue
        record.layouts.add("hash")
        for raw_name, raw_value in cast(dict[bytes, bytes], mapping).items():
            _put(record, decode_key(raw_name), raw_value)


def _read_sets(client: redis.Redis, space: Keyspace, file_prefix: str, keys: list[bytes]) -> None:
    if not keys:
        return
    for key, members in zip(
        keys, _pipelined(client, keys, lambda p, k: p.smembers(k)), strict=True
    ):
        root, sep, name = decode_key(key)[len(file_prefix) :].partition("/")
        texts = sorted(decode_key(m) for m in cast(set[bytes], members))
        if not sep and root == INDEX:
            space.index_members += len(texts)
            for member in texts:
                space.record(member).indexed = True
        elif not sep:
            space.ignored["set"] += 1
        else:
            record = space.record(root)
            record.layouts.add("flat")
            record.sets[name] = texts
