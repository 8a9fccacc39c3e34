"""Signers and claims: a real Ed25519 key per test signer, and the claim routes driven through an
in-process httpx client."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import nacl.signing

from metanode import claims as claims_mod

NOW_MS = time.time_ns() // 1_000_000


@dataclass
class Signer:
    """A test signer: a real Ed25519 key that signs wire claims."""

    key: nacl.signing.SigningKey = field(default_factory=nacl.signing.SigningKey.generate)

    @property
    def uid(self) -> str:
        return claims_mod.uid_of(bytes(self.key.verify_key))

    def claim(self, cid: str, key: str, value: str | None, ts: int | None = None) -> dict[str, Any]:
        return claims_mod.sign(self.key, cid, key, value, NOW_MS if ts is None else ts).wire()


async def register(
    client: httpx.AsyncClient,
    signer: Signer,
    *,
    weight: int = 1,
    may_link: bool = False,
    name: str = "t",
) -> None:
    """Add `signer` to the node's signers (POST /api/signers); it must succeed."""
    response = await client.post(
        "/api/signers",
        json={"uid": signer.uid, "name": name, "weight": weight, "may_link": may_link},
    )
    assert response.status_code == 200, response.text


async def post(client: httpx.AsyncClient, *claims: dict[str, Any]) -> httpx.Response:
    """POST one batch of wire claims to /api/claims, whatever the answer."""
    return await client.post("/api/claims", json={"claims": list(claims)})


def verdicts(response: httpx.Response) -> list[str]:
    """The per-claim statuses of a POST /api/claims answer, in order."""
    return [r["status"] for r in response.json()["results"]]


def fast_claims(
    signer: Signer, items: Iterable[tuple[str, str, str | None, int]]
) -> list[dict[str, Any]]:
    """Wire claims `(cid, key, value, ts)` signed by `signer`, its uid computed once.

    `Signer.claim` recomputes the uid (a base58 encoding) per claim, which dominates signing
    thousands of claims; the bytes signed and the wire form are the same.
    """
    uid = signer.uid
    out = []
    for cid, key, value, ts in items:
        sig = signer.key.sign(claims_mod.signing_bytes(uid, cid, key, value, ts)).signature
        out.append(claims_mod.Claim(uid, cid, key, value, ts, sig).wire())
    return out


def without_owner(signers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A `GET /api/signers` list less the box owner, whom every node registers at start."""
    return [s for s in signers if s["name"] != "owner"]
