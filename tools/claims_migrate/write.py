"""Writing planned groups and claims into a metanode data directory (the server stopped).

Everything goes through the node's own write path, the truth store: groups through
`truth.adopt_group_txn` (an old rid kept) or `truth.ensure_group` (a rid minted for a record
that had none), claims through `claims.sign` → `claims.validate_items` → `truth.ingest_txn`, one
transaction (`TruthStore.migrate_batch_sync`) per batch of records, then
`maintenance.catch_up_cache` brings cache.db up to date. Each batch commits its
groups and claims together, so a run that stops half-way leaves whole records behind, and running
again finishes the job: a claim the legacy signer already holds with the same value is skipped, a
group already in place is left alone.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import nacl.signing

from metanode import claims, keys, maintenance, truth
from metanode import rid as rids
from metanode.claims import LINK_PREFIX, Claim
from metanode.clock import now_ms
from metanode.config import Settings
from tools.claims_migrate.plan import Planned
from tools.claims_migrate.report import Report

MARKER = "claims-migrate.json"
KEY_STEM = "legacy-migrate-"
DEFAULT_WEIGHT = 1


class MigrateError(Exception):
    """A reason to stop, worded for the person running the tool."""


# -- is the data directory in use? --------------------------------------------------------------


def holders(settings: Settings) -> list[int]:
    """Pids of other processes that have truth.db or cache.db open (Linux /proc; elsewhere
    nothing is found). A running `metanode serve` always has both open."""
    proc = Path("/proc")
    if not proc.is_dir() or not settings.data_dir.is_dir():
        return []
    wanted = {
        str(path.resolve()) + suffix
        for path in (settings.truth_path, settings.cache_path)
        for suffix in ("", "-wal")
    }
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return sorted(found)


# -- the legacy key -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Legacy:
    """The throwaway key that signs every migrated field."""

    key: nacl.signing.SigningKey
    uid: str
    path: Path | None  # None: held in memory only (a dry run before any real run)
    created: bool

    def sign(self, cid: str, key: str, value: str, ts: int) -> Claim:
        """`claims.sign` with the uid computed once (its base58 encoding costs more than the
        signature itself)."""
        sig = self.key.sign(claims.signing_bytes(self.uid, cid, key, value, ts)).signature
        return Claim(self.uid, cid, key, value, ts, sig)


def _write_marker(settings: Settings, path: Path, uid: str) -> None:
    """Record which key the migration signs with, so a re-run signs with the same one."""
    body = {
        "tool": "claims-migrate",
        "uid": uid,
        "key_file": str(path.relative_to(settings.data_dir)),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    marker = settings.data_dir / MARKER
    scratch = marker.with_name(marker.name + ".tmp")
    scratch.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    os.replace(scratch, marker)


def find_legacy_key(settings: Settings) -> Path | None:
    """The key an earlier run used: named by the marker, else the newest `legacy-migrate-*.key`
    (a run that stopped between creating the key and writing the marker)."""
    marker = settings.data_dir / MARKER
    if marker.is_file():
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
            path = settings.data_dir / str(data["key_file"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MigrateError(f"{marker} is unreadable ({exc}); fix or remove it") from None
        if not path.is_file():
            raise MigrateError(
                f"{marker} names the legacy key {path}, which is missing; restore "
                "it (re-signing with a new key would duplicate every claim)"
            )
        return path
    found = sorted(settings.keys_dir.glob(f"{KEY_STEM}*.key")) if settings.keys_dir.is_dir() else []
    return found[-1] if found else None


def legacy_key(settings: Settings, dry_run: bool) -> Legacy:
    """The legacy key of this data directory: the earlier run's, or a new one in
    `keys/legacy-migrate-<date>.key` (mode 0600). A dry run never creates a file."""
    found = find_legacy_key(settings)
    if found is not None:
        key = keys.load(found)
        uid = keys.uid_of_key(key)
        marker = settings.data_dir / MARKER
        if marker.is_file():
            recorded = json.loads(marker.read_text(encoding="utf-8")).get("uid")
            if recorded not in (None, uid):
                raise MigrateError(
                    f"{marker} records the legacy signer {recorded}, but {found} "
                    f"holds the key of {uid}; restore the right key file"
                )
        elif not dry_run:
            _write_marker(settings, found, uid)
        return Legacy(key, uid, found, False)
    if dry_run:
        key = nacl.signing.SigningKey.generate()
        return Legacy(key, keys.uid_of_key(key), None, True)
    path = settings.keys_dir / f"{KEY_STEM}{time.strftime('%Y-%m-%d', time.gmtime())}.key"
    uid = keys.create(path)
    _write_marker(settings, path, uid)
    return Legacy(keys.load(path), uid, path, True)


def register(store: truth.TruthStore, legacy: Legacy, weight: int | None) -> truth.SignerRow:
    """Register the legacy signer (low weight, may link: it signs the groups' `cids/` links).

    A re-run keeps the registered weight unless `weight` is given; a blocked legacy signer stops
    the run rather than being silently unblocked.
    """
    name = KEY_STEM + (legacy.path.stem[len(KEY_STEM) :] if legacy.path else "dry-run")
    row = store.signer(legacy.uid)
    if row is not None and row.status == "blocked":
        raise MigrateError(
            f"the legacy signer {legacy.uid} is blocked; unblock it first "
            f"(metanode signers unblock {legacy.uid}) to migrate again"
        )
    if row is None:
        return store.add_signer_sync(
            legacy.uid, name, DEFAULT_WEIGHT if weight is None else weight, True
        )
    if (weight is not None and weight != row.weight) or not row.may_link:
        return store.add_signer_sync(
            legacy.uid, row.name, row.weight if weight is None else weight, True
        )
    return row


# -- groups and claims --------------------------------------------------------------------------


def _batches(planned: Sequence[Planned], size: int) -> Iterator[list[Planned]]:
    """Records in runs of about `size` claims (a record is never split across batches)."""
    batch: list[Planned] = []
    count = 0
    for record in planned:
        batch.append(record)
        count += len(record.fields) + len(record.cids)
        if count >= size:
            yield batch
            batch, count = [], 0
    if batch:
        yield batch


def _count_groups(
    report: Report, records: Sequence[Planned], grouped: Sequence[truth.Grouped]
) -> None:
    for record, done in zip(records, grouped, strict=True):
        adopted = done.adopted
        if done.how == "kept":
            if adopted.rid == record.rid:
                report.rids_kept += 1
            else:
                report.rids_merged.append(
                    {"record": record.root, "rid": record.rid or "", "into": adopted.rid}
                )
        elif done.how == "minted":
            report.rids_minted += 1
        else:
            report.rids_reused += 1
        report.rids_created += adopted.created
        report.cids_joined += len(adopted.joined)
        report.groups_merged += [
            {"record": record.root, "lost": lost, "into": adopted.rid} for lost in adopted.merged
        ]


def write(
    settings: Settings,
    planned: Sequence[Planned],
    legacy: Legacy,
    ts: int,
    batch_size: int,
    report: Report,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write every planned record into the truth of `settings` (open_store done by the caller).

    `ts` is the migration time, the same for every claim of the run.
    """
    limits = claims.Limits(settings.max_value_bytes, settings.max_skew_ms)
    policy = truth.Policy(settings.accept_unknown_signers)
    minter = rids.Minter()
    with maintenance.truth_store(settings) as store:
        for records in _batches(planned, batch_size):
            pending: list[tuple[str, str, str]] = []  # (cid, key, value) to sign
            for record in records:
                for key, value in record.claims():
                    stored = store.stored_claim(legacy.uid, record.canonical, key)
                    if stored is not None and stored.value == value:
                        if not key.startswith(LINK_PREFIX):
                            report.fields_unchanged += 1
                        continue
                    pending.append((record.canonical, key, value))
            wires = [legacy.sign(cid, key, value, ts).wire() for cid, key, value in pending]
            valid, errors = claims.validate_items(wires, 0, now_ms(), limits)
            for error in errors:
                report.drop(str(error["error"]))
            report.claims_signed += len(valid)
            grouped, result = store.migrate_batch_sync(
                [truth.Grouping(r.rid, r.canonical, tuple(r.cids)) for r in records],
                valid,
                minter,
                policy,
            )
            _count_groups(report, records, grouped)
            for claim, verdict in zip(valid, result.verdicts, strict=True):
                link = claim.is_link
                if verdict == "accepted":
                    report.claims_accepted += 1
                    report.links_accepted += link
                    report.fields_claimed += not link
                elif verdict == "duplicate":
                    report.claims_duplicate += 1
                    report.fields_unchanged += not link
                else:
                    report.claims_stale += 1
                    report.fields_stale += not link
            if progress is not None:
                progress(len(records))
