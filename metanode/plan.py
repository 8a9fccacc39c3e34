"""The cache's pure decisions: which records a run of outbox changes touches, the events that
turn a record's old rows into its recomputed ones, and the file events of a watcher batch.

No I/O: `cache.CacheStore` reads the truth (through a `view.TruthView`) and its own rows, hands
them here, and writes what comes back. So the apply path is one truth read, a plan, one cache
write, and each decision is a function of its inputs (property-tested in tests/test_plan.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from metanode import merge
from metanode.claims import LINK_PREFIX, Claim
from metanode.view import Change


class Event(NamedTuple):
    """One feed event. A named tuple, not a dataclass: the applier makes one per changed key."""

    rid: str
    op: str  # "set" | "del"
    key: str
    value: str | None


@dataclass
class Scope:
    """What to recompute of one record: some claimed keys, the group keys, or all of it."""

    keys: set[str] = field(default_factory=set)
    group: bool = False
    whole: bool = False

    @property
    def regroups(self) -> bool:
        return self.group or self.whole


@dataclass(frozen=True)
class Inputs:
    """What recomputing a chunk of records reads, one query per table for the whole chunk."""

    old: dict[str, dict[str, str]]  # rid → its rows in the cache now
    members: dict[str, list[str]]  # rid → its CIDs (records whose group keys are recomputed)
    files: dict[str, list[merge.LocalFile]]  # midhash → its local files
    votes: dict[str, list[Claim]]  # rid → the live claims on the keys in scope


def diff(
    rid: str, old: Mapping[str, str], new: Mapping[str, str], keys: Iterable[str]
) -> list[Event]:
    """The events that turn `old` into `new` on `keys`, in key order (absent: no value)."""
    events = []
    for key in sorted(keys):
        before, after = old.get(key), new.get(key)
        if before != after:
            events.append(
                Event(rid, "del", key, None) if after is None else Event(rid, "set", key, after)
            )
    return events


def recompute(
    rid: str, scope: Scope, inputs: Inputs, signers: dict[str, merge.Signer]
) -> list[Event]:
    """The events of one record's recomputed `scope`, from the chunk's reads."""
    old = inputs.old.get(rid, {})
    new: dict[str, str] = {}
    keys: set[str] = set(scope.keys)
    if scope.regroups:
        members = inputs.members.get(rid, [])
        new.update(
            merge.group_keys(members, [f for cid in members for f in inputs.files.get(cid, ())])
        )
        keys |= set(new) | {k for k in old if merge.is_group_key(k)}
    if scope.whole:
        merged = merge.merge_record(inputs.votes.get(rid, ()), signers)
        keys |= set(merged) | set(old)
        new.update(merged)
    elif scope.keys:
        new.update(merge.merge_record(inputs.votes.get(rid, ()), signers))
    return diff(rid, old, new, keys)


# -- which records a run of changes touches -----------------------------------------------------


@dataclass
class Touched:
    """A run of outbox changes sorted by what they touch, before any CID or rid is resolved."""

    claimed: list[tuple[str, str]] = field(default_factory=list)  # (cid, key) to re-merge
    regrouped: list[str] = field(default_factory=list)  # rids whose group keys may change
    losers: list[str] = field(default_factory=list)  # rids merged away
    survived: list[str] = field(default_factory=list)  # rids that took in a merged group
    signers: list[str] = field(default_factory=list)  # uids re-weighed or (un)blocked


def touched(changes: Iterable[Change]) -> Touched:
    """Sort the changes by kind of effect."""
    result = Touched()
    for change in changes:
        if change.kind == "claim":
            result.claimed.append((change.cid or "", change.key or ""))
        elif change.kind == "group":
            result.regrouped.append(change.rid or "")
        elif change.kind == "merge":
            result.losers.append(change.rid or "")
            result.survived.append(change.survivor or "")
        elif change.kind == "signer":
            result.signers.append(change.uid or "")
    return result


@dataclass
class Plan:
    """Which records a run of outbox changes touches, resolved against the current truth."""

    losers: list[str] = field(default_factory=list)
    scopes: dict[str, Scope] = field(default_factory=dict)

    def scope(self, rid: str) -> Scope:
        scope = self.scopes.get(rid)
        if scope is None:
            scope = self.scopes[rid] = Scope()
        return scope


def resolve(
    work: Touched,
    claimed: Iterable[tuple[str, str]],
    groups: Mapping[str, str],
    survivors: Mapping[str, str],
) -> Plan:
    """The plan of `work`: `claimed` is every (cid, key) to re-merge (the claims' and the
    signers' votes), `groups` their CIDs' rids, `survivors` every regrouped and surviving rid's
    survivor. A `cids/` key is a link, shown through the group keys, never merged."""
    result = Plan(losers=list(work.losers))
    for cid, key in claimed:
        if cid in groups and not key.startswith(LINK_PREFIX):
            result.scope(groups[cid]).keys.add(key)
    for rid in work.regrouped:
        result.scope(survivors[rid]).group = True
    for rid in work.survived:
        result.scope(survivors[rid]).whole = True
    return result


# -- file events (GET /api/events/files, docs/compat.md) -----------------------------------------

Row = tuple[str, int, int]  # a local_file row: (midhash, size, mtime_ns)


@dataclass(frozen=True)
class FileEvent:
    """One change of what the disk holds, as MetaMesh's file events name it."""

    op: str  # "add" | "change" | "delete" | "rename"
    path: str
    old_path: str | None
    size: int
    midhash: str


def file_events(
    removed: dict[str, Row], written: Sequence[tuple[merge.LocalFile, bool]]
) -> list[FileEvent]:
    """The events of one local transaction: `delete` for each removed path not taken over, then
    per written path `add` (new path), `change` (new content or stat) or `rename`.

    A written path whose midhash equals a removed row's is that file moved: one `rename` from the
    removed path (preferring one with the same file name, then the first by path) instead of a
    `delete` and an `add`.
    """
    by_content: dict[str, list[str]] = {}
    for path, row in sorted(removed.items()):
        by_content.setdefault(row[0], []).append(path)
    taken: set[str] = set()
    upserted = []
    for file, is_new in written:
        sources = [p for p in by_content.get(file.midhash, ()) if p not in taken]
        if sources:
            name = file.path.rsplit("/", 1)[-1]
            source = next((p for p in sources if p.rsplit("/", 1)[-1] == name), sources[0])
            taken.add(source)
            upserted.append(FileEvent("rename", file.path, source, file.size, file.midhash))
        else:
            upserted.append(
                FileEvent("add" if is_new else "change", file.path, None, file.size, file.midhash)
            )
    deleted = [
        FileEvent("delete", path, None, row[1], row[0])
        for path, row in sorted(removed.items())
        if path not in taken
    ]
    return deleted + upserted
