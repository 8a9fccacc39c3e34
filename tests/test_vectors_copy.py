"""The project's copy of the vectors must equal ../shared/vectors/ wherever that folder exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.vectors import VECTORS

SHARED = Path(__file__).resolve().parents[2] / "shared" / "vectors"


def test_copy_has_every_vector_file() -> None:
    names = {p.name for p in VECTORS.glob("*.json")}
    assert {
        "midhash.json",
        "claims.json",
        "rids.json",
        "ipfs.json",
        "cid-rank-vectors.json",
        "cid-aliases.json",
    } <= names


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/vectors/ is not beside this checkout")
def test_copy_equals_shared() -> None:
    shared = {p.name: p.read_bytes() for p in SHARED.glob("*.json")}
    local = {p.name: p.read_bytes() for p in VECTORS.glob("*.json")}
    assert local == shared
