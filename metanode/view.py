"""What the cache's apply reads of the truth: the `TruthView` protocol and the outbox row.

A neutral module between the two stores: `truth.TruthStore` implements the view over one read
snapshot, `cache.CacheStore` consumes it, and neither imports the other's statements. A second
backend (PostgreSQL) implements these same reads; nothing here names SQLite.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
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

    def merge_signers(self) -> dict[str, merge.Signer]:
        """Every signer's weight and block, as the merge rules take them."""
        ...

    def signer_cid_keys(self, uid: str) -> list[tuple[str, str]]:
        """Every (cid, key) `uid` has a claim on."""
        ...

    def active_rids(self) -> list[str]:
        """Every active rid, in order."""
        ...


class TruthSource(Protocol):
    """Where a view comes from: `snapshot()` opens one read snapshot, closed on leaving."""

    def snapshot(self) -> AbstractContextManager[TruthView]: ...
