"""The migration report: counted while planning and writing, printed and optionally saved."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Report:
    """Everything one run did (or, with --dry-run, would do)."""

    redis: str = ""
    data_dir: str = ""
    dry_run: bool = False
    started_at: str = ""
    duration_s: float = 0.0
    legacy_signer: dict[str, Any] = field(default_factory=dict)
    keyspace: dict[str, Any] = field(default_factory=dict)
    # records
    records: int = 0
    layouts: Counter[str] = field(default_factory=Counter)  # flat, hash, mixed
    not_indexed: list[str] = field(default_factory=list)  # records with keys, absent from the index
    without_cid: list[str] = field(default_factory=list)  # no CID at all: nothing to claim about
    absorbed: list[dict[str, str]] = field(default_factory=list)  # every CID owned elsewhere
    rids_kept: int = 0  # records whose old rid names their group
    rids_minted: int = 0  # records without a usable rid (older hashIds) given a new one
    rids_reused: int = 0  # records without a usable rid whose CIDs were grouped already
    rids_merged: list[dict[str, str]] = field(default_factory=list)  # kept rid merged into older
    # fields
    fields: int = 0  # every field read, of every record
    fields_claimed: int = 0  # signed and accepted now
    fields_unchanged: int = 0  # the legacy signer already holds the same value (a re-run)
    fields_stale: int = 0  # signed but the truth holds a newer claim of the legacy signer
    group_members: int = 0  # `cids/*` fields carried by the group itself
    dropped: Counter[str] = field(default_factory=Counter)  # reason → fields not claimed
    # groups
    groups: int = 0
    rids_created: int = 0  # rows added to `rids` (adopted or minted)
    cids_joined: int = 0  # rows added to `cid_group`
    groups_merged: list[dict[str, str]] = field(default_factory=list)  # with pre-existing groups
    # claims
    claims_signed: int = 0
    claims_accepted: int = 0
    links_accepted: int = 0  # `cids/<member>` link claims among them
    claims_duplicate: int = 0
    claims_stale: int = 0
    # conflicts
    disagreements: list[dict[str, str]] = field(default_factory=list)
    field_conflicts: list[dict[str, str]] = field(default_factory=list)
    dangling_aliases: list[dict[str, str]] = field(default_factory=list)
    changes: int = 0  # truth outbox rows written: zero on a re-run that had nothing to add

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n

    @property
    def conflicts_resolved(self) -> int:
        return len(self.disagreements) + len(self.field_conflicts) + len(self.groups_merged)

    def as_json(self) -> dict[str, Any]:
        return {
            "redis": self.redis,
            "data_dir": self.data_dir,
            "dry_run": self.dry_run,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "legacy_signer": self.legacy_signer,
            "keyspace": self.keyspace,
            "records": {
                "total": self.records,
                "layouts": dict(sorted(self.layouts.items())),
                "rids_kept": self.rids_kept,
                "rids_minted": self.rids_minted,
                "rids_reused": self.rids_reused,
                "rids_merged": self.rids_merged,
                "not_indexed": self.not_indexed,
                "without_cid": self.without_cid,
                "absorbed": self.absorbed,
            },
            "fields": {
                "total": self.fields,
                "claimed": self.fields_claimed,
                "unchanged": self.fields_unchanged,
                "stale": self.fields_stale,
                "group_members": self.group_members,
                "dropped_total": sum(self.dropped.values()),
                "dropped": dict(sorted(self.dropped.items())),
            },
            "groups": {
                "total": self.groups,
                "rids_created": self.rids_created,
                "cids_joined": self.cids_joined,
                "merged_with_existing": self.groups_merged,
            },
            "claims": {
                "signed": self.claims_signed,
                "accepted": self.claims_accepted,
                "links_accepted": self.links_accepted,
                "duplicate": self.claims_duplicate,
                "stale": self.claims_stale,
            },
            "conflicts_resolved": self.conflicts_resolved,
            "disagreements": self.disagreements,
            "field_conflicts": self.field_conflicts,
            "dangling_aliases": self.dangling_aliases,
            "changes": self.changes,
        }

    def save(self, path: Path) -> None:
        path.write_text(
            json.dumps(self.as_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    def lines(self) -> list[str]:
        """The human summary printed at the end of a run."""
        verb = "would write" if self.dry_run else "wrote"
        layouts = ", ".join(f"{k} {v}" for k, v in sorted(self.layouts.items())) or "none"
        out = [
            f"claims-migrate {'(dry run) ' if self.dry_run else ''}from {self.redis} "
            f"into {self.data_dir} in {self.duration_s:.1f} s",
            f"records: {self.records} ({layouts}); "
            f"rids kept {self.rids_kept}, minted {self.rids_minted}, reused {self.rids_reused}; "
            f"{len(self.without_cid)} without any CID, {len(self.absorbed)} absorbed, "
            f"{len(self.not_indexed)} missing from file:__index__",
            f"fields: {self.fields} read; {self.fields_claimed} claimed, "
            f"{self.fields_unchanged} unchanged, {self.group_members} group members, "
            f"{sum(self.dropped.values())} dropped"
            + (
                " (" + ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) + ")"
                if self.dropped
                else ""
            ),
            f"groups: {self.groups}; {self.rids_created} rids and {self.cids_joined} cid rows "
            f"added, {len(self.groups_merged)} merged with groups the node had",
            f"claims: {self.claims_signed} signed, {self.claims_accepted} accepted "
            f"({self.links_accepted} links), {self.claims_duplicate} duplicate, "
            f"{self.claims_stale} stale",
            f"conflicts resolved: {self.conflicts_resolved}",
        ]
        for root in self.without_cid:
            out.append(f"  record {root}: names no CID, so none of its fields can be claimed")
        for a in self.absorbed:
            out.append(
                f"  record {a['record']}: owns no CID, its fields were claimed on {a['into']}"
            )
        for d in self.disagreements:
            out.append(
                f"  record {d['record']}: {d['source']} member {d['cid']} belongs to "
                f"{d['owner']} ({d['rule']})"
            )
        for c in self.field_conflicts:
            out.append(f"  record {c['record']} folded into {c['into']}: kept its own {c['key']}")
        for m in self.groups_merged:
            out.append(f"  group {m['lost']} merged into {m['into']}")
        for a in self.dangling_aliases:
            out.append(f"  alias cid:{a['cid']} → {a['rid']} ignored ({a['reason']})")
        out.append(f"changes: {verb} {self.changes} truth change(s)")
        if self.legacy_signer:
            s = self.legacy_signer
            out.append(
                f"legacy signer: {s['uid']} (weight {s['weight']}, key "
                f"{s.get('key_file') or 'not created: dry run'})"
            )
        return out
