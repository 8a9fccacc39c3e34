"""The known-answer vectors (the project's copy of ../shared/vectors/) and the byte patterns
midhash.json describes its contents with."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

VECTORS = Path(__file__).resolve().parent.parent / "vectors"


def load_vectors(name: str) -> Any:
    return json.loads((VECTORS / name).read_text(encoding="utf-8"))


def naive_byte(pattern: str, i: int) -> int:
    """The byte at offset `i`, straight from the formula written in midhash.json."""
    if pattern == "zero":
        return 0
    if pattern == "i%256":
        return i % 256
    if pattern == "(7i+3)%256":
        return (7 * i + 3) % 256
    if pattern == "(i*31+i//4096)%251":
        return (i * 31 + i // 4096) % 251
    raise AssertionError(f"unknown pattern {pattern!r}")


@functools.lru_cache(maxsize=8)
def pattern_bytes(pattern: str, size: int) -> bytes:
    """The whole content of a pattern file, built fast (periodic slices and translate tables)."""
    if pattern == "zero":
        return bytes(size)
    if pattern in ("i%256", "(7i+3)%256"):
        period = bytes(naive_byte(pattern, i) for i in range(256))
        return (period * (size // 256 + 1))[:size]
    if pattern == "(i*31+i//4096)%251":
        # (31*i) % 251 is periodic with period 251; the block number b = i // 4096 is added mod 251.
        base = bytes((31 * i) % 251 for i in range(251))
        longer = base * 18  # > 4096 + 251 bytes, so any 4096-byte window fits
        out = bytearray()
        for start in range(0, size, 4096):
            block = start // 4096
            n = min(4096, size - start)
            off = start % 251
            chunk = longer[off : off + n]
            table = bytes((x + block) % 251 if x < 251 else x for x in range(256))
            out += chunk.translate(table)
        return bytes(out)
    raise AssertionError(f"unknown pattern {pattern!r}")
