"""Shared fixtures: the known-answer vectors, loaded from the project's own copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

VECTORS = Path(__file__).parent / "vectors"


def load_vectors(name: str) -> Any:
    return json.loads((VECTORS / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def claim_vectors() -> Any:
    return load_vectors("claims.json")
