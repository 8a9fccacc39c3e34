"""CIDs: parsing, the canonical spelling, alias spellings, the rank ladder and midhash256.

Pure: no I/O (reading a file's sample is `watcher.midhash_file`).

Three spellings matter (SPEC §1.1):

* *canonical*: CIDv1 in multibase base32 lower (`b…`). The only form allowed inside a claim.
* *lookup*: any multibase and CIDv0 (`Qm…`) are accepted on lookup routes and converted to
  the canonical form by `normalise`.
* *alias*: a raw-codec (0x55) CID and one whose codec equals its multihash code name the same
  digest; `alias` gives the other spelling so a lookup that misses can retry.

The MetaMesh codes (midhash256, BitTorrent, locators) are not in the multicodec table, so they are
registered below at import, which lets `multiformats` decode them like any other CID.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

from multiformats import CID, multicodec
from multiformats.multicodec import Multicodec
from multiformats.multihash import raw as multihash_raw
from multiformats.multihash.raw import Hashfun

from metanode.errors import InvalidCid, NoncanonicalCid, clipped, shown

RAW = 0x55
DAG_PB = 0x70
SHA2_256 = 0x12
SHA3_256 = 0x16
SHA3_384 = 0x15
BLAKE3 = 0x1E
MIDHASH256 = 0x1000
BTIH_V1_FILE = 0x1001
BTIH_V2_FILE = 0x1002
NZB_POSTING = 0x1003
LOCATORS = range(0x1005, 0x100B)
BTIH_V2 = 0x10B7
BT_PIECES_ROOT = 0xB702
BITTORRENT = frozenset({BTIH_V1_FILE, BTIH_V2_FILE, BTIH_V2})
DIGESTS = frozenset({SHA2_256, SHA3_256, SHA3_384})

MIDHASH_SAMPLE = 1 << 20
MIDHASH_PREFIX = "bagacbabae"


def _midhash_of_bytes(data: bytes, size: int | None = None) -> bytes:
    """multiformats' hash-function signature: the midhash digest of a whole content."""
    start = midhash_offset(len(data))
    return midhash_digest(len(data), bytes(data[start : start + MIDHASH_SAMPLE]))


def _not_computable(name: str) -> Any:
    def hashfun(data: bytes, size: int | None = None) -> bytes:
        raise ValueError(f"{name} cannot be computed from bytes alone")

    return hashfun


# (code, name, tag, digest size or None). Tag "multihash" codes may sit in either CID slot;
# "ipld" codes are content codecs only (the locators, whose multihash is identity).
_CUSTOM_CODES: tuple[tuple[int, str, str, int | None], ...] = (
    (MIDHASH256, "midhash256", "multihash", 32),
    (BTIH_V1_FILE, "btih-v1-file", "multihash", None),
    (BTIH_V2_FILE, "btih-v2-file", "multihash", None),
    (BTIH_V2, "btih-v2", "multihash", 32),
    (BT_PIECES_ROOT, "bittorrent-pieces-root", "multihash", 32),
    (NZB_POSTING, "nzb-posting", "ipld", None),
    (0x1005, "nzb-release", "ipld", None),
    (0x1006, "url-locator", "ipld", None),
    (0x1007, "card-locator", "ipld", None),
    (0x1008, "yt-video-locator", "ipld", None),
    (0x1009, "ext-play-locator", "ipld", None),
    (0x100A, "provider-file-locator", "ipld", None),
)


def _register_custom_codes() -> None:
    """Teach multiformats the MetaMesh codes; idempotent so re-imports are harmless."""
    for code, name, tag, size in _CUSTOM_CODES:
        if not multicodec.exists(code=code):
            multicodec.register(Multicodec(name=name, tag=tag, code=code, status="draft"))
        if tag == "multihash" and not multihash_raw.exists(name):
            fun = _midhash_of_bytes if code == MIDHASH256 else _not_computable(name)
            multihash_raw.register(name, cast(Hashfun, fun), size)


_register_custom_codes()


@dataclass(frozen=True, slots=True)
class ParsedCid:
    """A decoded CID: its canonical spelling and the numbers that rank and alias it."""

    canonical: str
    version: int
    codec: int
    mh_code: int
    digest: bytes

    def as_json(self) -> dict[str, Any]:
        """The `metanode cid parse` view of this CID."""
        return {
            "canonical": self.canonical,
            "version": self.version,
            "codec": self.codec,
            "codec_hex": hex(self.codec),
            "multihash": self.mh_code,
            "multihash_hex": hex(self.mh_code),
            "digest_hex": self.digest.hex(),
            "rank": rank(self.canonical),
            "alias": alias(self.canonical),
        }


MAX_CHARS = 1019  # `cids/<cid>` must fit a key's 1,024 bytes (claims.MAX_KEY_BYTES)


def parse(text: str) -> ParsedCid:
    """Decode any CID spelling (any multibase, CIDv0) or raise `InvalidCid`.

    A CID longer than `MAX_CHARS` is refused before it is decoded: no hash a content is named
    by comes near it (a SHA-512 CID is ≈ 110), it could never be linked (its `cids/` key would
    be too long), and an identity multihash can otherwise carry megabytes into every record,
    document and event that names it, and into the parse cache."""
    if not isinstance(text, str) or not text:
        raise InvalidCid(f"not a CID: {shown(text)}")
    if len(text) > MAX_CHARS:
        raise InvalidCid(f"a CID is at most {MAX_CHARS} characters; this one has {len(text)}")
    return _parse(text)


@lru_cache(maxsize=65536)
def _parse(text: str) -> ParsedCid:
    """Decode a non-empty string; cached because the same CIDs come back in claim after claim.

    The canonical spelling (`b…`, base32 lower) is decoded here with the standard library and a
    varint loop; other spellings go through multiformats. Why not multiformats for everything:
    measured at ≈600 µs per CID (its per-character type validation), 7× an Ed25519 verify, while
    this path takes ≈10 µs. `tests/test_cid.py` checks the two decoders agree.
    """
    try:
        if text[0] == "b":
            # _b32decode accepts exactly one spelling of each byte string, so the text is canonical
            return _parse_binary(_b32decode(text[1:]), text)
        data = _multiformats_bytes(text)
        return _parse_binary(data, _b32encode(data))
    except InvalidCid:
        raise
    except Exception as exc:  # binascii and multiformats raise a zoo of types for bad input
        raise InvalidCid(f"not a CID: {shown(text)} ({clipped(str(exc))})") from None


# RFC 4648 base32 lower → the digits of int(x, 32), so decoding runs in C (base64.b32decode is
# pure Python and was a third of a claim's validation time).
_B32_TO_INT = str.maketrans("abcdefghijklmnopqrstuvwxyz234567", "0123456789abcdefghijklmnopqrstuv")
_B32_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")


def _b32decode(body: str) -> bytes:
    """Unpadded base32 lower; non-zero trailing bits (a non-canonical spelling) are refused."""
    if not body or not _B32_ALPHABET.issuperset(body):
        raise InvalidCid("base32 multibase 'b' is lowercase a-z2-7 without padding")
    nbytes, spare = divmod(len(body) * 5, 8)
    value = int(body.translate(_B32_TO_INT), 32)
    if spare >= 5 or value & ((1 << spare) - 1):
        raise InvalidCid("base32 has trailing bits set or an impossible length")
    return (value >> spare).to_bytes(nbytes, "big")


def _multiformats_bytes(text: str) -> bytes:
    """Binary CIDv1 of a non-canonical spelling (other multibase, or CIDv0 upgraded to v1)."""
    cid = CID.decode(text)
    if cid.version == 0:
        cid = cid.set(version=1)
    return bytes(cid)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """Unsigned LEB128 varint at `pos` (at most 9 bytes, minimal): (value, next position)."""
    value = shift = 0
    for i in range(pos, min(pos + 9, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and i > pos:
                raise InvalidCid("varint is not minimally encoded")
            return value, i + 1
        shift += 7
    raise InvalidCid("truncated or overlong varint")


@lru_cache(maxsize=1024)
def _tag(code: int) -> str | None:
    return multicodec.get(code=code).tag if multicodec.exists(code=code) else None


def _parse_binary(data: bytes, canonical: str) -> ParsedCid:
    version, pos = _varint(data, 0)
    if version != 1:
        raise InvalidCid(f"CID version {version} is not supported")
    codec, pos = _varint(data, pos)
    mh_code, pos = _varint(data, pos)
    length, pos = _varint(data, pos)
    digest = data[pos:]
    if len(digest) != length:
        raise InvalidCid(f"multihash says {length} digest bytes, {len(digest)} follow")
    if _tag(codec) is None:
        raise InvalidCid(f"unknown codec {codec:#x}")
    if _tag(mh_code) != "multihash":
        raise InvalidCid(f"{mh_code:#x} is not a multihash code")
    return ParsedCid(canonical, 1, codec, mh_code, bytes(digest))


def _b32encode(data: bytes) -> str:
    return "b" + base64.b32encode(data).decode("ascii").rstrip("=").lower()


def varint(value: int) -> bytes:
    """Unsigned LEB128, as multiformats writes codes and lengths."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(codec: int, mh_code: int, digest: bytes) -> str:
    """The canonical spelling of the CIDv1 (codec, multihash code, digest)."""
    head = b"\x01" + varint(codec) + varint(mh_code) + varint(len(digest))
    return _b32encode(head + digest)


def normalise(text: str) -> str:
    """The canonical spelling of any accepted spelling: what lookup routes do with their input."""
    return parse(text).canonical


def require_canonical(text: str) -> ParsedCid:
    """Accept only the canonical spelling, as claims must; name the right spelling otherwise."""
    parsed = parse(text)
    if parsed.canonical != text:
        raise NoncanonicalCid(
            f"CID {shown(text)} is not canonical; use {parsed.canonical!r}",
            canonical=parsed.canonical,
        )
    return parsed


def alias(text: str) -> str | None:
    """The other spelling of the same digest (raw codec ⇄ codec = multihash code), if any."""
    parsed = parse(text)
    if parsed.codec == RAW:
        other = parsed.mh_code
    elif parsed.codec == parsed.mh_code:
        other = RAW
    else:
        return None
    return encode(other, parsed.mh_code, parsed.digest)


def spellings(canonical: str) -> Iterator[str]:
    """What a lookup tries: the CID, then (only if asked for) its alias spelling."""
    yield canonical
    other = alias(canonical)
    if other is not None:
        yield other


def _rank_of(parsed: ParsedCid) -> int:
    """The MetaMesh interop ladder, rules evaluated in the fixture's order."""
    codec, mh = parsed.codec, parsed.mh_code
    if codec == DAG_PB:
        return 40
    if codec in BITTORRENT or mh in BITTORRENT:
        return 20
    if codec in LOCATORS:
        return 5
    if codec == NZB_POSTING:
        return 25
    if mh in DIGESTS:
        return 30
    if mh == BLAKE3:
        return 29  # this project's extension of the ladder
    if mh == MIDHASH256:
        return 10
    return 0


def rank(text: str) -> int:
    """Rank of a CID string; only canonical spellings rank above 0 (CIDv0, token form: 0)."""
    return _rank(text) if isinstance(text, str) else 0


@lru_cache(maxsize=65536)
def _rank(text: str) -> int:
    """`rank` of a string, cached as `_parse` is: each write into a group ranks every CID of
    it again to render its document (`by_rank`), ≈ 2 µs a CID uncached: 4–5 ms a write into a
    group of 2,000."""
    try:
        return _rank_of(require_canonical(text))
    except (InvalidCid, NoncanonicalCid):
        return 0


def sort_key(text: str) -> tuple[int, str]:
    """Sort key that puts the best CID first: higher rank, then the smaller string."""
    return (-rank(text), text)


def by_rank(cids: Iterable[str]) -> list[str]:
    """CIDs best first. A group of one (most records) is not ranked: ranking parses each CID,
    ≈ 19 µs of the cache writer's time a new record."""
    listed = list(cids)
    return listed if len(listed) < 2 else sorted(listed, key=sort_key)


def canonical_cid(cids: Iterable[str]) -> str | None:
    """The group's canonical CID: the best-ranked member, or None for an empty group."""
    ranked = by_rank(cids)
    return ranked[0] if ranked else None


# -- midhash256 (SPEC §1.2) ---------------------------------------------------------------------


def midhash_offset(size: int) -> int:
    """Where the 1 MiB sample starts: 0 for small files, else the middle."""
    return 0 if size <= MIDHASH_SAMPLE else (size - MIDHASH_SAMPLE) // 2


def midhash_digest(size: int, sample: bytes) -> bytes:
    """sha256(uint64_be(size) || sample), without copying the sample."""
    digest = hashlib.sha256(size.to_bytes(8, "big"))
    digest.update(sample)
    return digest.digest()


def midhash_cid(digest: bytes) -> str:
    """The CIDv1 (codec = multihash = 0x1000) of a midhash digest, base32 lower."""
    return encode(MIDHASH256, MIDHASH256, digest)


def midhash_bytes(data: bytes) -> str:
    """midhash256 CID of an in-memory file content."""
    return midhash_cid(_midhash_of_bytes(data))
