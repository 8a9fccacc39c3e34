"""What the cache's apply reads of the truth: the `TruthView` protocol and the outbox row.

A neutral module between the two stores: `truth.TruthStore` implements the view over one read
snapshot, `cache.CacheStore` consumes it, and neither imports the other's statements. A second
backend (PostgreSQL) implements these same reads; nothing here names SQLite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from metanode import merge
from metanode.claims import Claim


class Change(NamedTuple):
    """One outbox row: something that may change what a record shows. A named tuple, not a
    dataclass: the applier reads one or two per claim."""

    seq: int
    kind: str
    rid: str | None
    cid: str | None
    key: str | None
    uid: str | None
    survivor: str | None


class TruthView(Protocol):
    """The truth as one consistent read snapshot: every read the cache's apply, build and local
    recompute make. All answers of one view agree with each other."""

    def max_seq(self) -> int:
        """The newest outbox seq ever written (0: none)."""
        ...

    def changes_after(self, seq: int) -> list[Change]:
        """The outbox rows after `seq`, in seq order."""
        ...

    def groups_of(self, cids: Iterable[str]) -> dict[str, str]:
        """cid → rid of every grouped CID among `cids` (an ungrouped one is absent)."""
        ...

    def groups_cids(self, rids: Iterable[str]) -> dict[str, list[str]]:
        """rid → its CIDs (a rid holding none is absent)."""
        ...

    def survivors(self, rids: Iterable[str]) -> dict[str, str]:
        """rid → the active rid it is part of now (itself if active or unknown)."""
        ...

    def groups_claims(
        self, rids: Iterable[str], keys: Iterable[str] | None = None
    ) -> dict[str, list[Claim]]:
        """rid → the live claims on its CIDs, optionally only on `keys`."""
        ...

    def merge_signers(self, uids: Iterable[str]) -> dict[str, merge.Signer]:
        """The weight and block of each of `uids` the truth knows, as the merge rules take
        them (one absent is weighed as `merge.Signer()`)."""
        ...

    def signer_claims(self, uid: str, after: int, limit: int) -> list[tuple[int, str, str]]:
        """(log seq, cid, key) of `uid`'s first `limit` claims after claim-log seq `after`."""
        ...

    def active_rids(self) -> list[str]:
        """Every active rid, in order."""
        ...

    def rids_after(self, after: str, limit: int) -> list[str]:
        """The first `limit` active rids greater than `after`, in order."""
        ...


class TruthSource(Protocol):
    """Where a view comes from: `snapshot()` opens one read snapshot, closed on leaving."""

    def snapshot(self) -> AbstractContextManager[TruthView]: ...


@dataclass(frozen=True)
class Fresh:
    """A group a truth transaction minted: every CID it holds and its live claims, all written
    by that transaction (a CID no group held had no claims: claims reference `cid_group`)."""

    cids: tuple[str, ...]
    claims: tuple[Claim, ...]


@dataclass(frozen=True)
class Written:
    """What one ingest transaction wrote, handed to the cache's apply so it need not read back
    what was just written: its outbox rows (seqs consecutive) and the groups it minted."""

    changes: tuple[Change, ...]
    fresh: Mapping[str, Fresh] = field(default_factory=dict)

    @property
    def last(self) -> int:
        return self.changes[-1].seq if self.changes else 0


def _mentions(change: Change) -> set[str]:
    return {name for name in (change.rid, change.cid, change.survivor) if name is not None}


def _still_fresh(written: Sequence[Written]) -> dict[str, Fresh]:
    """The groups minted by one of `written` that no later one touched (a claim on one of its
    CIDs, a CID joined, a merge): their memory is the truth as of the last of `written`."""
    fresh: dict[str, Fresh] = {}
    for part in written:
        touched = set().union(*map(_mentions, part.changes)) if part.changes else set()
        fresh = {
            rid: group
            for rid, group in fresh.items()
            if rid not in touched and touched.isdisjoint(group.cids)
        }
        fresh.update(part.fresh)
    return fresh


def covering(written: Sequence[Written], after: int) -> list[Written]:
    """The run of `written` that holds every outbox row from `after + 1` on, seqs consecutive
    (empty if there is none: a change someone else wrote, a restart, a gap)."""
    run: list[Written] = []
    expected = after + 1
    for part in sorted((w for w in written if w.last > after), key=lambda w: w.last):
        if not part.changes or part.changes[0].seq != expected:
            break
        run.append(part)
        expected = part.last + 1
    return run


class Overlay:
    """A `TruthView` that answers from what the ingest transactions wrote (`written`, a
    `covering` run) and reads from the truth only the rest: the outbox rows are theirs, and
    the groups they minted (`_still_fresh`) are known whole. The apply then applies those rows
    only; a row written later is applied by the next apply."""

    def __init__(self, view: TruthView, written: Sequence[Written]) -> None:
        self._view = view
        self._changes = [change for part in written for change in part.changes]
        self._fresh = _still_fresh(written)
        self._rid_of = {cid: rid for rid, group in self._fresh.items() for cid in group.cids}

    def max_seq(self) -> int:
        return self._view.max_seq()

    def changes_after(self, seq: int) -> list[Change]:
        return [change for change in self._changes if change.seq > seq]

    def groups_of(self, cids: Iterable[str]) -> dict[str, str]:
        wanted = set(cids)
        known = {cid: self._rid_of[cid] for cid in wanted if cid in self._rid_of}
        rest = wanted.difference(known)
        return {**known, **(self._view.groups_of(rest) if rest else {})}

    def _split(self, rids: Iterable[str]) -> tuple[list[str], list[str]]:
        wanted = set(rids)
        return [r for r in wanted if r in self._fresh], [r for r in wanted if r not in self._fresh]

    def groups_cids(self, rids: Iterable[str]) -> dict[str, list[str]]:
        fresh, rest = self._split(rids)
        found = {rid: list(self._fresh[rid].cids) for rid in fresh}
        return {**found, **(self._view.groups_cids(rest) if rest else {})}

    def survivors(self, rids: Iterable[str]) -> dict[str, str]:
        fresh, rest = self._split(rids)
        return {**{rid: rid for rid in fresh}, **(self._view.survivors(rest) if rest else {})}

    def groups_claims(
        self, rids: Iterable[str], keys: Iterable[str] | None = None
    ) -> dict[str, list[Claim]]:
        fresh, rest = self._split(rids)
        wanted = None if keys is None else set(keys)
        found: dict[str, list[Claim]] = {}
        for rid in fresh:
            claims = [c for c in self._fresh[rid].claims if wanted is None or c.key in wanted]
            if claims:
                found[rid] = claims
        return {**found, **(self._view.groups_claims(rest, wanted) if rest else {})}

    def merge_signers(self, uids: Iterable[str]) -> dict[str, merge.Signer]:
        return self._view.merge_signers(uids)

    def signer_claims(self, uid: str, after: int, limit: int) -> list[tuple[int, str, str]]:
        return self._view.signer_claims(uid, after, limit)

    def active_rids(self) -> list[str]:
        return self._view.active_rids()

    def rids_after(self, after: str, limit: int) -> list[str]:
        return self._view.rids_after(after, limit)


def overlay(view: TruthView, written: Sequence[Written], after: int) -> TruthView:
    """`view` answered where it can from `written` (an `Overlay`), when `written` holds every
    outbox row after `after`; else `view` itself, which reads everything back."""
    run = covering(written, after)
    return Overlay(view, run) if run else view


class Ahead:
    """The truth as an apply begun before the truth's COMMIT of the changes it applies reads it
    (`Applier.apply_ahead`): `committed()` returns once that COMMIT has returned (it raises if
    the COMMIT failed). An `Overlay` answers most of such an apply from what the transaction
    wrote; a read it passes on to the truth waits for `committed()` first and then opens the
    snapshot, so it sees those changes. Every signer's weight may be read before: the
    transaction adds none but unknown signers, registered with the weight and status an absent
    signer has (`merge.Signer()`), and no other transaction can commit before it."""

    def __init__(self, source: TruthSource, committed: Callable[[], None]) -> None:
        self._source = source
        self._committed = committed

    @contextmanager
    def snapshot(self) -> Iterator[TruthView]:
        with ExitStack() as stack:
            yield _AheadView(self._source, self._committed, stack)


class _AheadView:
    """`Ahead`'s view: the snapshot opened at the first read that needs the committed truth."""

    def __init__(
        self, source: TruthSource, committed: Callable[[], None], stack: ExitStack
    ) -> None:
        self._source = source
        self._committed = committed
        self._stack = stack
        self._view: TruthView | None = None

    def _opened(self) -> TruthView:
        if self._view is None:
            self._committed()
            self._view = self._stack.enter_context(self._source.snapshot())
        return self._view

    def merge_signers(self, uids: Iterable[str]) -> dict[str, merge.Signer]:
        if self._view is not None:
            return self._view.merge_signers(uids)
        with self._source.snapshot() as before:  # a snapshot of its own, ended at once
            return before.merge_signers(uids)

    def max_seq(self) -> int:
        return self._opened().max_seq()

    def changes_after(self, seq: int) -> list[Change]:
        return self._opened().changes_after(seq)

    def groups_of(self, cids: Iterable[str]) -> dict[str, str]:
        return self._opened().groups_of(cids)

    def groups_cids(self, rids: Iterable[str]) -> dict[str, list[str]]:
        return self._opened().groups_cids(rids)

    def survivors(self, rids: Iterable[str]) -> dict[str, str]:
        return self._opened().survivors(rids)

    def groups_claims(
        self, rids: Iterable[str], keys: Iterable[str] | None = None
    ) -> dict[str, list[Claim]]:
        return self._opened().groups_claims(rids, keys)

    def signer_claims(self, uid: str, after: int, limit: int) -> list[tuple[int, str, str]]:
        return self._opened().signer_claims(uid, after, limit)

    def active_rids(self) -> list[str]:
        return self._opened().active_rids()

    def rids_after(self, after: str, limit: int) -> list[str]:
        return self._opened().rids_after(after, limit)
