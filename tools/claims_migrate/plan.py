"""From meta-core records to metanode groups and claims: the rules of docs/migration.md.

Pure: a `Keyspace` in, `Planned` records and the planning half of the `Report` out. Nothing
here touches the data directory, so a dry run plans exactly what a real run writes.

The rules, in order:
1. Every CID a record names (its root id if that is a CID, `cids/<cid>` fields, the old `cids`
   SET, `cid_*`/`midhash256` field values) is a candidate member of its group.
2. A CID's owner is the record the `cid:` index names (the index wins); a CID the index does not
   know goes to the first record naming it, older rid first. Every candidate a record loses is
   reported.
3. A record's group = the CIDs it owns; its canonical CID = the best by rank. Every field it keeps
   becomes a claim about that CID; every other member becomes a `cids/<member>` link claim.
4. A record that owns no CID but named some is folded into the owner of its best one (its own
   fields claimed there, the owner's value winning a key both hold); one that named none cannot be
   claimed about and is reported.
5. Deprecated fields (`cid_*`, `midhash256`, `canonical_cid`, `__fields__`, `duplicates`) and
   box-local facts (`filePath`, `sizeByte`, `mtimeNano`, `fileSize`, the older `mtime`) are
   dropped and counted; the watcher's rescan restores the local ones.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from metanode import cid as cids
from metanode import rid as rids
from metanode.claims import LINK_PREFIX
from metanode.errors import ClaimError
from tools.claims_migrate.keyspace import Keyspace, SourceRecord
from tools.claims_migrate.report import Report

DEPRECATED = frozenset({"midhash256", "canonical_cid", "__fields__", "duplicates"})
DEPRECATED_PREFIX = "cid_"
LOCAL = frozenset({"filePath", "sizeByte", "mtimeNano", "fileSize", "mtime"})
MEMBER_SET = "cids"  # the pre-v1 per-record SET of `<algo>:<cid>` tokens
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_HEX_CODECS = {
    "midhash256": lambda d: cids.midhash_cid(d),
    "sha256": lambda d: cids.encode(cids.RAW, cids.SHA2_256, d),
    "sha2-256": lambda d: cids.encode(cids.RAW, cids.SHA2_256, d),
}


def cid_of(text: str, algo: str | None = None) -> str | None:
    """The canonical CID a meta-core id or value names, or None.

    Accepted: any CID spelling (`normalise`: other multibases and CIDv0 too), the token form
    `<algo>:<cid>` of the intermediate layouts (`midhash256:bagacbabae…`, `ipfs:bafy…`), and a
    bare 64-hex digest of midhash256 or sha2-256 (with the algorithm from the token or the field
    name `cid_<algo>`).
    """
    text = text.strip()
    if not text:
        return None
    try:
        return cids.normalise(text)
    except ClaimError:
        pass
    head, sep, rest = text.partition(":")
    if sep and head and rest:
        return cid_of(rest, head.lower())
    if algo in _HEX_CODECS and _HEX64.fullmatch(text):
        return _HEX_CODECS[algo](bytes.fromhex(text))
    return None


def rid_of(root: str) -> str | None:
    """The rid spelling of a meta-core root id that is a UUIDv7 (26-char Crockford, either case,
    or 8-4-4-4-12 hex); None for hashIds, literal CIDs and UUIDs of other versions."""
    text = root.strip()
    try:
        if len(text) == 36:
            return rids.parse(rids.from_uuid(uuid.UUID(text)))
        return rids.parse(text)
    except (ValueError, ClaimError):  # InvalidRid is a ClaimError
        return None


@dataclass
class Planned:
    """One group to write: its CIDs (canonical first), its rid if kept, its claims."""

    root: str
    rid: str | None  # the kept rid; None: found through the CIDs in the truth, or minted
    cids: list[str]  # best rank first; cids[0] is the canonical CID
    fields: dict[str, str] = field(default_factory=dict)  # key → value, claimed about cids[0]

    @property
    def canonical(self) -> str:
        return self.cids[0]

    def claims(self) -> list[tuple[str, str]]:
        """(key, value) of every claim: the fields, then a link for every other member."""
        links = [(f"{LINK_PREFIX}{member}", "true") for member in self.cids[1:]]
        return sorted(self.fields.items()) + links


@dataclass
class _Source:
    record: SourceRecord
    rid: str | None
    members: dict[str, str] = field(default_factory=dict)  # cid → where the record names it
    keep: dict[str, str] = field(default_factory=dict)  # fields to claim


def _order(source: _Source) -> tuple[bool, str]:
    """Kept rids first, oldest first; then records without one, by root."""
    return (source.rid is None, source.rid or source.record.root)


def _members(record: SourceRecord, report: Report) -> dict[str, str]:
    found: dict[str, str] = {}

    def add(cid: str | None, where: str) -> None:
        if cid is not None and cid not in found:
            found[cid] = where

    add(cid_of(record.root), "root id")
    for name, value in sorted(record.fields.items()):
        if name.startswith(LINK_PREFIX):
            member = cid_of(name[len(LINK_PREFIX) :])
            if member is None:
                report.drop("invalid_member_cid")
            add(member, "cids/*")
        elif name.startswith(DEPRECATED_PREFIX):
            add(cid_of(value, name[len(DEPRECATED_PREFIX) :].lower()), name)
        elif name == "midhash256":
            add(cid_of(value, "midhash256"), name)
    for token in record.sets.get(MEMBER_SET, []):
        add(cid_of(token), "cids set")
    return found


def _keep(record: SourceRecord, owned: set[str], report: Report) -> dict[str, str]:
    """The fields that become claims; every other field counted by why it is not one."""
    keep: dict[str, str] = {}
    for name, value in sorted(record.fields.items()):
        if name.startswith(LINK_PREFIX):
            member = cid_of(name[len(LINK_PREFIX) :])
            if member is None:
                continue  # counted in _members
            if member in owned:
                report.group_members += 1
            else:
                report.drop("index_wins")  # the member belongs to another record's group
        elif name in DEPRECATED or name.startswith(DEPRECATED_PREFIX):
            report.drop("deprecated")
        elif name in LOCAL:
            report.drop("local")
        else:
            keep[name] = value
    for name in record.sets:
        report.drop("deprecated" if name in DEPRECATED or name == MEMBER_SET else "not_a_string")
    for reason in record.unreadable.values():
        report.drop(reason)
    return keep


def _index(space: Keyspace, by_root: dict[str, _Source], report: Report) -> dict[str, str]:
    """The `cid:` index as CID → owning root; entries naming no record are reported, not used."""
    by_rid = {s.rid: root for root, s in sorted(by_root.items()) if s.rid is not None}
    owners: dict[str, str] = {}
    for key, value in sorted(space.index.items()):
        cid = cid_of(key)
        if cid is None:
            report.dangling_aliases.append({"cid": key, "rid": value, "reason": "not a CID"})
            continue
        root = value if value in by_root else by_rid.get(rid_of(value) or "")
        if root is None:
            report.dangling_aliases.append({"cid": key, "rid": value, "reason": "no such record"})
            continue
        if owners.get(cid, root) != root:  # two spellings of one CID naming two records
            report.dangling_aliases.append(
                {"cid": key, "rid": value, "reason": f"{cid} is indexed to {owners[cid]}"}
            )
            continue
        owners[cid] = root
    return owners


def plan(space: Keyspace, report: Report) -> list[Planned]:
    """The groups and claims to write, best rank first within each group, in a stable order."""
    sources = {root: _Source(rec, rid_of(root)) for root, rec in space.records.items()}
    for source in sources.values():
        rec = source.record
        report.records += 1
        report.fields += len(rec.fields) + len(rec.sets) + len(rec.unreadable)
        layout = "mixed" if len(rec.layouts) > 1 else next(iter(rec.layouts), "index only")
        report.layouts[layout] += 1
        if not rec.indexed and rec.layouts:
            report.not_indexed.append(rec.root)
        source.members = _members(rec, report)
    ordered = sorted(sources.values(), key=_order)

    owner = _index(space, sources, report)
    indexed = set(owner)
    for source in ordered:
        for cid in source.members:
            owner.setdefault(cid, source.record.root)
    for source in ordered:
        for cid, where in source.members.items():
            if owner[cid] != source.record.root:
                rule = "the cid: index wins" if cid in indexed else "an older record names it"
                report.disagreements.append(
                    {
                        "record": source.record.root,
                        "cid": cid,
                        "source": where,
                        "owner": owner[cid],
                        "rule": rule,
                    }
                )

    owned: dict[str, set[str]] = {}
    for cid, root in owner.items():
        owned.setdefault(root, set()).add(cid)
    planned: dict[str, Planned] = {}
    for source in ordered:
        mine = owned.get(source.record.root, set())
        source.keep = _keep(source.record, mine, report)
        if mine:
            planned[source.record.root] = Planned(
                source.record.root, source.rid, cids.by_rank(mine), dict(source.keep)
            )
    for source in ordered:
        root = source.record.root
        if root in planned:
            continue
        if not source.members:
            report.without_cid.append(root)
            report.drop("no_cid", len(source.keep))
            continue
        into = planned[owner[cids.by_rank(source.members)[0]]]
        report.absorbed.append({"record": root, "into": into.root})
        for key, value in source.keep.items():
            if key not in into.fields:
                into.fields[key] = value
            elif into.fields[key] == value:
                report.drop("folded_duplicate")
            else:
                report.field_conflicts.append({"record": root, "into": into.root, "key": key})
                report.drop("folded_conflict")
    report.groups = len(planned)
    return [planned[s.record.root] for s in ordered if s.record.root in planned]
