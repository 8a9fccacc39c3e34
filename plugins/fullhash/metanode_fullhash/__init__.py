"""fullhash: link a file's midhash to the content hashes peers and IPFS understand.

One read pass computes sha2-256 (`bafkrei…`), blake3 (`bafkr4i…`) and the IPFS CIDv1
of the whole file, and claims `cids/<each>` = "true" plus `sizeByte` about the file's midhash. The
`cids/` claims link the four CIDs into one group, so `GET /api/meta/<any of them>` finds the same
record, and its `canonical_cid` becomes the IPFS CID.

The same pass re-derives the midhash from the bytes it reads: if the file changed since the watcher
fingerprinted it, the run fails (and is retried) instead of linking hashes of other content — a
link, once made, is permanent.

This module is also the tutorial for a plugin that computes something expensive: subclass
`metanode.plugins.Plugin`, give it a name and a version, do the work in `process` (it runs on its
own thread) and `register` what you found.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import blake3

from metanode import cid as cids
from metanode.plugins import LocalFile, Plugin, RecordLookup, Register
from metanode_fullhash.ipfs import CHUNK, Builder

__all__ = ["Digests", "FullHash", "hash_file"]

BLOCK: int = 16 * CHUNK  # 4 MiB reads, two buffers: bounded memory, few syscalls


class ContentChanged(Exception):
    """The file is no longer the content its midhash names."""


@dataclass(frozen=True)
class Digests:
    size: int
    midhash: str
    sha256: str
    blake3: str
    ipfs: str


def hash_file(path: str) -> Digests:
    """Every digest of a file from one sequential read, in memory bounded by two `BLOCK`s.

    The file is read into two buffers in turn. While one is read, the other is hashed by three
    streams at once: sha2-256 and the IPFS leaves (sha2-256 too) on two worker threads, blake3 on
    this one (hashlib and blake3 release the GIL). One after the other, the two sha2-256 passes
    took twice as long as `openssl dgst -sha256` (docs/benchmarks.md, "fullhash").
    """
    sha = hashlib.sha256()
    b3 = blake3.blake3()
    dag = Builder()
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(2) as pool:
        size = os.fstat(f.fileno()).st_size
        buffers = (bytearray(buffer_size(size)), bytearray(buffer_size(size)))
        views = tuple(memoryview(buffer) for buffer in buffers)
        start = cids.midhash_offset(size)
        sample = bytearray()
        want = min(size, cids.MIDHASH_SAMPLE)
        offset = turn = 0
        hashing: list[Future[None]] = []
        while True:
            got = f.readinto(buffers[turn])  # while the other buffer is still being hashed
            for job in hashing:
                job.result()
            if not got:
                break
            block = views[turn][:got]
            hashing = [pool.submit(sha.update, block), pool.submit(dag.update, block)]
            b3.update(block)
            lo, hi = max(start, offset), min(start + want, offset + got)
            if lo < hi:
                sample += block[lo - offset : hi - offset]
            offset += got
            turn = 1 - turn
    if offset != size:
        raise ContentChanged(f"{path} is {offset} bytes, not {size}, while being read")
    return Digests(
        size=size,
        midhash=cids.midhash_cid(cids.midhash_digest(size, bytes(sample))),
        sha256=cids.encode(cids.RAW, cids.SHA2_256, sha.digest()),
        blake3=cids.encode(cids.RAW, cids.BLAKE3, b3.digest()),
        ipfs=dag.finish(),
    )


def buffer_size(size: int) -> int:
    """The read buffers' size for a file of `size` bytes: a `BLOCK`, or the file if smaller.
    Two 4 MiB buffers made (zeroed) for every file took 4 to 6 ms of a 2 KB file's run, holding
    the GIL, the plugin host's loop and the other plugins' threads waiting
    (docs/benchmarks.md, "Plugin backlog"); a file that grew is still read whole, a buffer
    at a time."""
    return max(1, min(BLOCK, size))


class FullHash(Plugin):
    name = "fullhash"
    version = "1"
    may_link = True  # it hashes the very bytes the midhash samples: its links are safe

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        digests = hash_file(file.path)
        if digests.midhash != file.cid:
            raise ContentChanged(f"{file.path} no longer has midhash {file.cid}")
        for other in (digests.sha256, digests.blake3, digests.ipfs):
            register(file.cid, f"cids/{other}", "true")
        register(file.cid, "sizeByte", str(digests.size))
