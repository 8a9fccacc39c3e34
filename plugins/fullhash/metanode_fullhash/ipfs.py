"""The IPFS CIDv1 of a file, as `ipfs add --cid-version=1 --raw-leaves=true
--chunker=size-262144` computes it, streaming and in bounded memory.

The file is cut into 256 KiB chunks; each chunk is a raw leaf (codec raw, sha2-256). Leaves are
grouped 174 at a time into UnixFS `file` nodes (dag-pb), those again 174 at a time, until one node
is left: the "balanced" layout. A file of at most one chunk is its raw leaf.

Only the nodes still waiting for siblings are kept: at most 174 per level, and a 10 GiB file has
3 levels, so memory does not grow with the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from metanode import cid as cids

CHUNK = 262_144
MAX_LINKS = 174
DAG_PB = 0x70


@dataclass(frozen=True, slots=True)
class Node:
    """A finished DAG node as its parent links to it."""

    cid: bytes  # binary CIDv1
    file_size: int  # bytes of file content below it
    tsize: int  # bytes of blocks below it, itself included (the link's Tsize)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return cids.varint(number << 3 | 2) + cids.varint(len(payload)) + payload


def _binary_cid(codec: int, digest: bytes) -> bytes:
    return b"\x01" + cids.varint(codec) + b"\x12\x20" + digest


def leaf(chunk: bytes | memoryview) -> Node:
    """A raw leaf: the chunk itself, addressed by its sha2-256."""
    return Node(_binary_cid(cids.RAW, hashlib.sha256(chunk).digest()), len(chunk), len(chunk))


def parent(children: list[Node]) -> Node:
    """A UnixFS file node linking `children` (dag-pb: links first, then the UnixFS data)."""
    links = b"".join(
        _field(2, _field(1, child.cid) + _field(2, b"") + b"\x18" + cids.varint(child.tsize))
        for child in children
    )
    file_size = sum(child.file_size for child in children)
    unixfs = (
        b"\x08\x02"
        + b"\x18"
        + cids.varint(file_size)
        + b"".join(b"\x20" + cids.varint(child.file_size) for child in children)
    )
    block = links + _field(1, unixfs)
    tsize = len(block) + sum(child.tsize for child in children)
    return Node(_binary_cid(DAG_PB, hashlib.sha256(block).digest()), file_size, tsize)


class Builder:
    """Feed the file's bytes in order with `update`; `finish` gives the root CID."""

    def __init__(self) -> None:
        self._levels: list[list[Node]] = [[]]
        self._counts: list[int] = [0]
        self._carry = bytearray()  # the start of a chunk not yet complete

    def update(self, data: bytes | memoryview) -> None:
        """Cut `data` into 256 KiB chunks, whatever the sizes of the pieces it arrives in."""
        view = memoryview(data)
        if self._carry:
            take = min(CHUNK - len(self._carry), len(view))
            self._carry += view[:take]
            view = view[take:]
            if len(self._carry) < CHUNK:
                return
            self._push(0, leaf(bytes(self._carry)))
            self._carry.clear()
        whole = len(view) - len(view) % CHUNK
        for i in range(0, whole, CHUNK):
            self._push(0, leaf(view[i : i + CHUNK]))  # hashed in place: no copy of the chunk
        self._carry += view[whole:]

    def _push(self, level: int, node: Node) -> None:
        if level == len(self._levels):
            self._levels.append([])
            self._counts.append(0)
        self._levels[level].append(node)
        self._counts[level] += 1
        if len(self._levels[level]) == MAX_LINKS:
            self._flush(level)

    def _flush(self, level: int) -> None:
        waiting, self._levels[level] = self._levels[level], []
        self._push(level + 1, parent(waiting))

    def finish(self) -> str:
        """Close every level bottom-up, as the balanced builder's recursion does: a level that
        produced one node in all is the root; otherwise its last batch gets a parent too."""
        if self._carry or self._counts[0] == 0:  # the last, short chunk; or an empty file's one
            self._push(0, leaf(bytes(self._carry)))
            self._carry.clear()
        level = 0
        while True:
            if self._counts[level] == 1:
                root = self._levels[level][0]
                return cids._b32encode(root.cid)
            if self._levels[level]:
                self._flush(level)
            level += 1
