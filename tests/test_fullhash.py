"""The fullhash plugin (SPEC §7): sha2-256, blake3 and the IPFS CID of `vectors/ipfs.json` from one
read pass, the midhash re-derived from the same bytes, and memory that does not grow with the file.
"""

from __future__ import annotations

import hashlib
import os
import random
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from metanode_fullhash import BLOCK, ContentChanged, Digests, FullHash, hash_file, ipfs

from metanode import cid as cids
from metanode import watcher
from metanode.plugins import LocalFile
from tests.helpers.vectors import load_vectors, pattern_bytes

MIB = 1 << 20
GIB = 1 << 30

IPFS: dict[str, Any] = load_vectors("ipfs.json")
IPFS_VECTORS: list[dict[str, Any]] = IPFS["vectors"]
# Small enough to feed through hypothesis many times; the 45/50 MiB vectors get seeded splits.
SMALL_IPFS = [v for v in IPFS_VECTORS if v["size"] <= 6 * MIB]


def _ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for v in vectors]


def content(vector: dict[str, Any]) -> bytes:
    data = pattern_bytes(vector["pattern"], vector["size"])
    assert len(data) == vector["size"]
    return data


def pieces(data: bytes, cuts: list[int]) -> Iterator[memoryview]:
    """`data` cut at the given offsets (sorted, duplicates give empty pieces)."""
    view = memoryview(data)
    start = 0
    for cut in sorted(min(max(c, 0), len(data)) for c in cuts):
        yield view[start:cut]
        start = cut
    yield view[start:]


def build(data: bytes, cuts: list[int]) -> str:
    builder = ipfs.Builder()
    for piece in pieces(data, cuts):
        builder.update(piece)
    root: str = builder.finish()
    return root


# -- the vectors, through the plugin's one read pass -------------------------------------------


def test_the_vectors_cover_every_layout() -> None:
    """A raw leaf (≤ 1 chunk), one dag-pb level and two levels (more than 174 chunks)."""
    sizes = [v["size"] for v in IPFS_VECTORS]
    assert 0 in sizes and ipfs.CHUNK in sizes and ipfs.CHUNK + 1 in sizes
    assert max(sizes) > ipfs.CHUNK * ipfs.MAX_LINKS
    for v in IPFS_VECTORS:
        prefix = "bafkrei" if v["size"] <= ipfs.CHUNK else "bafybei"
        assert v["cid"].startswith(prefix), v["name"]


@pytest.mark.parametrize("vector", IPFS_VECTORS, ids=_ids(IPFS_VECTORS))
def test_hash_file_vector(vector: dict[str, Any], tmp_path: Path) -> None:
    data = content(vector)
    path = tmp_path / "content.bin"
    path.write_bytes(data)
    digests = hash_file(str(path))
    assert digests.ipfs == vector["cid"]
    assert digests.size == len(data)
    assert digests.sha256 == cids.encode(cids.RAW, cids.SHA2_256, hashlib.sha256(data).digest())
    assert digests.blake3 == cids.encode(cids.RAW, cids.BLAKE3, blake3.blake3(data).digest())
    assert digests.midhash == cids.midhash_bytes(data)
    assert digests.midhash == watcher.midhash_file(path)[0]
    assert digests.sha256.startswith("bafkrei")
    assert digests.blake3.startswith("bafkr4i")
    assert cids.rank(digests.ipfs) == (30 if len(data) <= ipfs.CHUNK else 40)
    if len(data) <= ipfs.CHUNK:  # one chunk: the IPFS CID is the raw leaf, i.e. the sha2-256 CID
        assert digests.ipfs == digests.sha256


@pytest.mark.parametrize("vector", IPFS_VECTORS, ids=_ids(IPFS_VECTORS))
def test_builder_vector_in_random_pieces(vector: dict[str, Any]) -> None:
    """The streaming builder gives the vector's CID however the bytes are cut."""
    data = content(vector)
    rng = random.Random(vector["name"])
    n = len(data)
    whole = ipfs.Builder()
    whole.update(data)
    assert whole.finish() == vector["cid"]
    for _ in range(3):
        cuts = [rng.randrange(n + 1) for _ in range(rng.randrange(1, 40))]
        # Cuts right at, just before and just after chunk boundaries, and empty pieces.
        boundary = ipfs.CHUNK * rng.randrange(0, n // ipfs.CHUNK + 1)
        cuts += [boundary - 1, boundary, boundary, boundary + 1]
        assert build(data, cuts) == vector["cid"], cuts


@pytest.mark.parametrize("vector", SMALL_IPFS, ids=_ids(SMALL_IPFS))
@settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_builder_vector_hypothesis_pieces(vector: dict[str, Any], data: st.DataObject) -> None:
    payload = content(vector)
    cuts = data.draw(st.lists(st.integers(0, len(payload)), max_size=30), label="cuts")
    assert build(payload, cuts) == vector["cid"]


# -- the streaming layout against a from-scratch balanced builder -------------------------------


def reference_root(data: bytes) -> str:
    """ipfs-unixfs-importer's balanced layout, whole-file: chunk, then batch every level by
    MAX_LINKS until one node is left; a file of one chunk is its raw leaf."""
    chunks = [data[i : i + ipfs.CHUNK] for i in range(0, len(data), ipfs.CHUNK)] or [b""]
    level = [ipfs.leaf(chunk) for chunk in chunks]
    while len(level) > 1:
        level = [
            ipfs.parent(level[i : i + ipfs.MAX_LINKS]) for i in range(0, len(level), ipfs.MAX_LINKS)
        ]
    return cids._b32encode(level[0].cid)


@settings(max_examples=150, deadline=None, database=None)
@given(
    chunk=st.integers(1, 5),
    links=st.integers(2, 4),
    size=st.integers(0, 400),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_builder_matches_balanced_reference_on_deep_trees(
    chunk: int, links: int, size: int, cuts: list[int]
) -> None:
    """With tiny chunks and fan-out the streaming builder makes trees of up to 8 levels; it must
    close every level exactly as the whole-file reference does (exact powers, one-past, …)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ipfs, "CHUNK", chunk)
        mp.setattr(ipfs, "MAX_LINKS", links)
        data = bytes((i * 7 + size) % 256 for i in range(size))
        assert build(data, cuts) == reference_root(data)


@pytest.mark.parametrize(
    "chunks", [1, 2, 173, 174, 175, 348, 349, 174 * 174, 174 * 174 + 1], ids=str
)
def test_builder_matches_reference_around_the_fan_out(chunks: int) -> None:
    """The real fan-out (174) at the level boundaries, with 4-byte chunks: only counts matter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ipfs, "CHUNK", 4)
        data = bytes(i % 251 for i in range(chunks * 4))
        assert build(data, [13, len(data) // 2]) == reference_root(data)
        data += b"\x01"
        assert build(data, [len(data) - 1]) == reference_root(data)


# -- the plugin ---------------------------------------------------------------------------------


def test_process_registers_the_links_and_size(tmp_path: Path) -> None:
    data = pattern_bytes("(7i+3)%256", 3 * MIB + 1)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    midhash, size = watcher.midhash_file(path)
    drafts: list[tuple[str, str, str | None]] = []
    FullHash().process(
        LocalFile(midhash, str(path), size, path.stat().st_mtime_ns),
        lambda cid: None,
        lambda c, k, v: drafts.append((c, k, v)),
    )
    digests = hash_file(str(path))
    assert sorted(drafts) == sorted(
        [
            (midhash, f"cids/{digests.sha256}", "true"),
            (midhash, f"cids/{digests.blake3}", "true"),
            (midhash, f"cids/{digests.ipfs}", "true"),
            (midhash, "sizeByte", str(len(data))),
        ]
    )
    assert FullHash.may_link is True


def test_process_refuses_a_file_that_no_longer_has_its_midhash(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"what the file holds now")
    other = cids.midhash_bytes(b"what the watcher hashed")
    drafts: list[tuple[str, str, str | None]] = []
    with pytest.raises(ContentChanged):
        FullHash().process(
            LocalFile(other, str(path), 23, 0),
            lambda cid: None,
            lambda c, k, v: drafts.append((c, k, v)),
        )
    assert drafts == []


def test_hash_file_of_a_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        hash_file(str(tmp_path / "gone.bin"))


def traced(path: Path) -> tuple[Digests, int]:
    """`hash_file(path)` and the peak of Python's allocations while it ran (tracemalloc)."""
    tracemalloc.start()
    try:
        digests = hash_file(str(path))
        return digests, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_small_file_is_read_into_buffers_of_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 4 MiB read buffers, made and zeroed for every file, were most of a 2 KB file's
    run (4 to 6 ms, holding the GIL): a file smaller than a `BLOCK` is read into buffers of
    its own size, and one that grew after its size was read is still read whole."""
    data = random.Random(7).randbytes(2048)
    path = tmp_path / "small.mkv"
    path.write_bytes(data)
    digests, peak = traced(path)
    assert peak < 256 * 1024, f"peak traced memory {peak} B"
    assert digests.sha256 == cids.encode(cids.RAW, cids.SHA2_256, hashlib.sha256(data).digest())
    real = os.fstat

    def fstat_then_grow(fd: int) -> os.stat_result:
        result = real(fd)
        with path.open("ab") as f:
            f.write(data)
        return result

    monkeypatch.setattr(os, "fstat", fstat_then_grow)
    with pytest.raises(ContentChanged, match="is 4096 bytes, not 2048"):
        hash_file(str(path))


def test_memory_is_bounded_on_a_1_gib_file(tmp_path: Path) -> None:
    """A sparse 1 GiB file (zeros) is hashed with at most a few MiB of Python allocations: the
    read buffer (BLOCK), one chunk copy, the 1 MiB midhash sample and the waiting DAG nodes."""
    path = tmp_path / "sparse.bin"
    with path.open("wb") as f:
        f.truncate(GIB)
    digests, peak = traced(path)
    assert peak < 16 * MIB, f"peak traced memory {peak / MIB:.1f} MiB"
    assert BLOCK <= 8 * MIB
    # Known answers for 1 GiB of zeros (sha256sum of /dev/zero's first GiB; midhash by definition).
    zeros_sha256 = "49bc20df15e412a64472421e13fe86ff1c5165e18b2afccf160d4dc19fe68a14"
    assert digests.sha256 == cids.encode(cids.RAW, cids.SHA2_256, bytes.fromhex(zeros_sha256))
    assert digests.midhash == cids.midhash_cid(cids.midhash_digest(GIB, bytes(MIB)))
    assert digests.size == GIB
    assert digests.ipfs.startswith("bafybei")
