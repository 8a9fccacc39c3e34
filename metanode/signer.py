"""Signers whose keys the node itself holds: the box owner and MetaMesh's legacy writer.

Both sign claims for someone who cannot sign (a person at the web page, a MetaMesh client that
knows no Ed25519) and ingest them through the ordinary path, so their words are votes like any
other signer's. One class keeps the two rules they share: the key file is created once (mode
0600, never replaced) and registered with its configured weight, and each new word is dated
after the signer's own newest on the same key (`Registry.stamp`), even within one millisecond
and after the clock steps back, so a later word always wins over an earlier one of the same
signer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import nacl.signing

from metanode import claims, keys

Draft = tuple[str, str, str | None]  # (cid, key, value or None for a tombstone)


class Registry(Protocol):
    """What a node-held signer needs of the node: register itself, and date its drafts."""

    async def register_signer(self, uid: str, name: str, weight: int, may_link: bool) -> Any: ...

    def stamp(self, uid: str, pairs: Sequence[tuple[str, str]]) -> int:
        """The ts of `uid`'s new word on these (cid, key) pairs (`claims.next_ts`); raises
        `ClockBehind`."""
        ...


class OwnSigner:
    """One node-held signer; its writes are serialised by `lock`, so its timestamps increase."""

    def __init__(
        self,
        path: Path,
        name: str,
        weight: int,
        registry: Registry,
        ingest: Callable[[list[object]], Awaitable[Any]],
    ) -> None:
        self.path, self.name, self.weight = path, name, weight
        self._registry, self._ingest = registry, ingest
        self.lock = asyncio.Lock()  # held by callers that read the state their drafts depend on
        self._registering = asyncio.Lock()  # two first writes must not both create the key
        self._key: nacl.signing.SigningKey | None = None
        self.uid = ""

    async def register(self) -> str:
        """Load (or create) the key and register it (weight from the settings, may link);
        returns the uid. Idempotent: later calls only return the uid."""
        async with self._registering:
            if self._key is None:
                key = await asyncio.to_thread(keys.load_or_create, self.path)
                uid = keys.uid_of_key(key)
                await self._registry.register_signer(uid, self.name, self.weight, True)
                self._key, self.uid = key, uid
        return self.uid

    async def say(self, drafts: Sequence[Draft]) -> Any:
        """Sign and ingest `drafts` under `lock` (for drafts that depend on nothing read)."""
        async with self.lock:
            return await self.sign_and_ingest(drafts)

    async def sign_and_ingest(self, drafts: Sequence[Draft]) -> Any:
        """Sign every draft with one new timestamp and ingest them as one batch (all or none).

        Call it holding `lock`, together with the reads the drafts depend on (a retraction
        lists this signer's live votes first), so no other write of this signer comes between:
        the timestamp is read from what it stored last. Raises `ClockBehind` when the clock
        cannot date the drafts so that they count.
        """
        await self.register()
        assert self._key is not None
        ts = self._registry.stamp(self.uid, [(cid, key) for cid, key, _ in drafts])
        wire: list[object] = [claims.sign(self._key, c, k, v, ts).wire() for c, k, v in drafts]
        return await self._ingest(wire)
