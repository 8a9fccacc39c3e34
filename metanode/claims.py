"""Claims: the wire form, validation (SPEC §2.2), the signed bytes, signing and verifying.

A claim is `(uid, cid, key) → value` at `ts`, signed with Ed25519 by the key that `uid` names.
`signing_bytes` is the only definition of what a signature covers. Everything here is pure; the
signer policy (registered, blocked, may link) needs the truth and lives in `truth.py`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeGuard

import nacl.exceptions
import nacl.signing
import rfc8785

from metanode import cid as cids
from metanode.clock import iso
from metanode.errors import (
    BadSignature,
    ClaimError,
    ClockBehind,
    InvalidBatch,
    InvalidClaim,
    InvalidKey,
    InvalidMemberCid,
    InvalidTs,
    InvalidUid,
    InvalidValue,
    ReservedKey,
    TsInFuture,
    shown,
)

DOMAIN = "metanode-claim/1"
ED25519_PUB = b"\xed\x01"
MIN_TS = 946_684_800_000  # 2000-01-01T00:00:00Z
MAX_KEY_BYTES = 1024
LINK_PREFIX = "cids/"
# The keys a node synthesises from its own local files (SPEC §2.5 step 5); no claim may set them.
LOCAL_KEYS = ("filePath", "fileSize", "mtimeNano")
RESERVED_KEYS = frozenset(
    {*LOCAL_KEYS, "paths", "canonical_cid", "cids", "midhash256", "hashId", "__fields__"}
)
WIRE_FIELDS = ("uid", "cid", "key", "value", "ts", "sig")
_CONTROL = frozenset(chr(c) for c in [*range(0x20), 0x7F])


@dataclass(frozen=True, slots=True)
class Limits:
    """The configurable bounds of validation."""

    max_value_bytes: int = 65_536
    max_skew_ms: int = 300_000


@dataclass(frozen=True, slots=True)
class Claim:
    """One signed claim. `value` None is a retraction (tombstone); `sig` is the raw 64 bytes."""

    uid: str
    cid: str
    key: str
    value: str | None
    ts: int
    sig: bytes

    @property
    def is_link(self) -> bool:
        """A `cids/<member>` vote: links the member's group with this claim's cid's group."""
        return self.key.startswith(LINK_PREFIX)

    @property
    def member(self) -> str | None:
        """The CID a link vote names (None for other keys)."""
        return self.key[len(LINK_PREFIX) :] if self.is_link else None

    def wire(self) -> dict[str, Any]:
        """The JSON wire form."""
        return {
            "uid": self.uid,
            "cid": self.cid,
            "key": self.key,
            "value": self.value,
            "ts": self.ts,
            "sig": encode_sig(self.sig),
        }

    def signing_bytes(self) -> bytes:
        return signing_bytes(self.uid, self.cid, self.key, self.value, self.ts)


def signing_bytes(uid: str, cid: str, key: str, value: str | None, ts: int) -> bytes:
    """The bytes a claim signature covers: RFC 8785 JSON of the domain-tagged tuple, UTF-8."""
    return rfc8785.dumps([DOMAIN, uid, cid, key, value, ts])


# -- uids ---------------------------------------------------------------------------------------


# base58btc (the did:key spelling of a uid), written out for the one shape a uid has: `multibase`
# (the `bases` package, generic and type-checked at every call) took ≈ 230 µs to encode a key
# and ≈ 31 µs to decode one, against ≈ 7 and ≈ 4 µs here (benchmarks.md, "Session 23"); every
# claim of a signer past the key caches (a peer's thousands) paid the decode before its 55 µs
# verify. tests/test_claims.py checks both against `multibase` on arbitrary keys and strings.
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_BASE58_DIGITS = {char: digit for digit, char in enumerate(_BASE58)}
_KEY_BITS = 256
_UID_LENGTH = 48  # "z" + 47 digits: every number 0xed01 · 2^256 + key has 47 base58 digits
_MULTIKEY_PREFIX = int.from_bytes(ED25519_PUB, "big")


@lru_cache(maxsize=1024)
def uid_of(public_key: bytes) -> str:
    """`z` + base58btc(0xed 0x01 || key): the did:key spelling of an Ed25519 public key.

    Cached: `sign` needs it for every claim it signs, and a signer signs many. The multikey
    begins with 0xed, so it has no leading zero byte (no leading `1` digit) to spell."""
    number = int.from_bytes(ED25519_PUB + bytes(public_key), "big")
    digits = []
    while number:
        number, digit = divmod(number, 58)
        digits.append(_BASE58[digit])
    return "z" + "".join(reversed(digits))


def public_key(uid: object) -> nacl.signing.VerifyKey:
    """The verify key a uid names; raises `InvalidUid`."""
    if not isinstance(uid, str) or not uid.startswith("z"):
        # a `did:key:z6Mk…` (an author who knows DIDs): the uid is its part after the prefix
        hint = f" (a uid is {uid[8:]!r}, without 'did:key:')" if did_key(uid) else ""
        raise InvalidUid(f"not an ed25519 multikey uid: {shown(uid)}{hint}")
    return _public_key(uid)


def did_key(uid: object) -> TypeGuard[str]:
    """Whether `uid` is a did:key of an Ed25519 key: `did:key:` and a uid."""
    if not isinstance(uid, str) or not uid.startswith("did:key:z"):
        return False
    try:
        _public_key(uid[8:])
    except InvalidUid:
        return False
    return True


@lru_cache(maxsize=4096)
def _public_key(uid: str) -> nacl.signing.VerifyKey:
    """Decode a `z…` uid. Cached: a signer sends many claims.

    No encode-back to check the spelling is canonical: 34 bytes that begin 0xed 0x01 have
    exactly one base58 spelling. A string decodes to a number and one zero byte per leading
    `1`; the first byte being 0xed, there is no leading `1`, and a number has one spelling
    without leading zero digits (tests/test_claims.py checks it on arbitrary strings). Every
    such number has 47 digits, so the length is checked first (a long string costs no long
    multiplication), and a leading `1` leaves 46, a number below 0xed01 · 2^256: refused."""
    if len(uid) != _UID_LENGTH:
        raise InvalidUid(f"not an ed25519-pub multikey: {shown(uid)}")
    number = 0
    try:
        for char in uid[1:]:
            number = number * 58 + _BASE58_DIGITS[char]
    except KeyError:
        raise InvalidUid(f"not base58btc: {shown(uid)}") from None
    if number >> _KEY_BITS != _MULTIKEY_PREFIX:
        raise InvalidUid(f"not an ed25519-pub multikey: {shown(uid)}")
    return nacl.signing.VerifyKey((number & ((1 << _KEY_BITS) - 1)).to_bytes(32, "big"))


# -- signatures ---------------------------------------------------------------------------------


def encode_sig(sig: bytes) -> str:
    return base64.urlsafe_b64encode(sig).rstrip(b"=").decode("ascii")


def decode_sig(text: object) -> bytes:
    """64 raw bytes from 86 chars of unpadded base64url; any other spelling is `bad_signature`."""
    if not isinstance(text, str) or len(text) != 86:
        raise BadSignature("sig must be 86 chars of unpadded base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "==")
    except (binascii.Error, ValueError):
        raise BadSignature("sig is not base64url") from None
    if len(raw) != 64 or encode_sig(raw) != text:
        raise BadSignature("sig is not canonical base64url of 64 bytes")
    return raw


def sign(
    key: nacl.signing.SigningKey, cid: str, key_name: str, value: str | None, ts: int
) -> Claim:
    """Sign a claim with `key` (no validation: callers validate what they sign before sending)."""
    uid = uid_of(bytes(key.verify_key))
    sig = key.sign(signing_bytes(uid, cid, key_name, value, ts)).signature
    return Claim(uid, cid, key_name, value, ts, sig)


def verify(claim: Claim) -> None:
    """Raise `BadSignature` unless `claim.sig` is the uid's signature over its signing bytes.

    The error carries those bytes (`signed`, as text): a signer written in another language
    that serialised the array its own way (spaces, `ts` as a string, `\\u00e9`) could only
    learn that its signature "does not verify", never against what; now it compares."""
    signed = claim.signing_bytes()
    try:
        public_key(claim.uid).verify(signed, claim.sig)
    except nacl.exceptions.BadSignatureError:
        raise BadSignature(
            "signature does not verify against uid", signed=signed.decode("utf-8")
        ) from None


# -- field rules (SPEC §2.2) --------------------------------------------------------------------


def utf8_size(text: str) -> int | None:
    """Bytes of `text` in UTF-8, or None if it has none (lone surrogates: JSON and a decoded
    file name can carry them, UTF-8 and SQLite cannot)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def check_key(key: object) -> str:
    """Raise `InvalidKey`/`ReservedKey`/`InvalidMemberCid` unless `key` may be claimed."""
    if not isinstance(key, str):
        raise InvalidKey("key must be a string")
    size = utf8_size(key)
    if size is None:
        raise InvalidKey("key is not valid Unicode")
    if not 1 <= size <= MAX_KEY_BYTES:
        raise InvalidKey(f"key must be 1-{MAX_KEY_BYTES} UTF-8 bytes")
    if not _CONTROL.isdisjoint(key):
        raise InvalidKey("key contains a control character")
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        raise InvalidKey("key has an empty, '.' or '..' segment")
    if key in RESERVED_KEYS or key.startswith("cid_"):
        raise ReservedKey(f"key {key!r} is reserved")
    if key.startswith(LINK_PREFIX):
        member = key[len(LINK_PREFIX) :]
        try:
            cids.require_canonical(member)
        except ClaimError as exc:
            raise InvalidMemberCid(f"cids/ member: {exc.message}") from None
    return key


def check_value(value: object, limits: Limits) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidValue("value must be a string or null")
    size = utf8_size(value)
    if size is None:
        raise InvalidValue("value is not valid Unicode")
    if size > limits.max_value_bytes:
        raise InvalidValue(
            f"value is {size} bytes, the limit is {limits.max_value_bytes} (max_value_bytes)"
        )
    return value


def check_ts(ts: object, now_ms: int, limits: Limits) -> int:
    if not isinstance(ts, int) or isinstance(ts, bool):
        raise InvalidTs("ts must be an integer of milliseconds")
    if ts < MIN_TS:
        raise InvalidTs(f"ts {ts} is before 2000-01-01 (ts counts milliseconds, not seconds)")
    if ts > now_ms + limits.max_skew_ms:
        raise TsInFuture(f"ts {ts} is more than {limits.max_skew_ms} ms ahead of this node's clock")
    return ts


def next_ts(now_ms: int, newest: Claim | None, limits: Limits) -> int:
    """The ts of a new word of a signer this node holds the key of, given that signer's `newest`
    stored claim on the same keys in the same groups: the clock's reading, or just after
    `newest`. Newest wins per signer (SPEC §2.3, §2.5), so a word dated by a clock that stepped
    back below the signer's last one would be stale: the person's edit, or a plugin's new
    reading of a renamed file, silently ignored. Raises `ClockBehind` when no such ts is one
    this node would take: the clock reads before 2000 (it has not been set), or `newest` is
    further ahead of it than `max_skew_ms` (the clock stepped back, or was ahead when `newest`
    was signed)."""
    if now_ms < MIN_TS:
        raise ClockBehind(
            f"this box's clock reads {iso(now_ms)}, before 2000: it has not been set (no "
            f"network time yet?), and no claim can be dated then",
            valid_from=MIN_TS,
        )
    if newest is None or newest.ts < now_ms:
        return now_ms
    if newest.ts + 1 > now_ms + limits.max_skew_ms:
        raise ClockBehind(
            f"the last word on {newest.key!r} is dated {iso(newest.ts)}, ahead of this box's "
            f"clock ({iso(now_ms)}): a new one must be dated after it to count, and this node "
            f"takes claims dated at most {limits.max_skew_ms} ms ahead of its clock, so from "
            f"{iso(newest.ts + 1 - limits.max_skew_ms)} on (the clock stepped back, or was "
            "ahead when that word was said)",
            valid_from=newest.ts + 1 - limits.max_skew_ms,
        )
    return newest.ts + 1


def parse(obj: object, now_ms: int, limits: Limits = Limits()) -> Claim:
    """A `Claim` from its wire JSON, every field rule checked except the signature."""
    if not isinstance(obj, Mapping):
        raise InvalidClaim("a claim is a JSON object")
    extra = set(obj) - set(WIRE_FIELDS)
    if extra:
        raise InvalidClaim(f"unknown claim field(s): {', '.join(sorted(map(str, extra)))}")
    missing = [name for name in WIRE_FIELDS if name not in obj]
    if missing:  # a retraction says "value": null; a missing value is a mistake, not a tombstone
        raise InvalidClaim(f"missing claim field(s): {', '.join(missing)}")
    uid, cid = obj.get("uid"), obj.get("cid")
    public_key(uid)
    cids.require_canonical(cid)  # type: ignore[arg-type]  # rejects non-strings too
    return Claim(
        uid=uid,  # type: ignore[arg-type]  # checked by public_key
        cid=cid,  # type: ignore[arg-type]
        key=check_key(obj.get("key")),
        value=check_value(obj.get("value"), limits),
        ts=check_ts(obj.get("ts"), now_ms, limits),
        sig=decode_sig(obj.get("sig")),
    )


def validate(obj: object, now_ms: int, limits: Limits = Limits()) -> Claim:
    """Parse and verify one wire claim: the complete pure part of SPEC §2.2."""
    claim = parse(obj, now_ms, limits)
    verify(claim)
    return claim


def validate_items(
    items: Sequence[object], first_index: int, now_ms: int, limits: Limits = Limits()
) -> tuple[list[Claim], list[dict[str, Any]]]:
    """Validate a run of wire claims: the valid ones, and one error item per invalid one.

    `first_index` is the position of `items[0]` in its batch, so a batch validated in chunks on
    several threads still reports each error at its batch index.
    """
    valid: list[Claim] = []
    errors: list[dict[str, Any]] = []
    for index, item in enumerate(items, first_index):
        try:
            valid.append(validate(item, now_ms, limits))
        except ClaimError as exc:
            errors.append({"index": index, "error": exc.slug, "message": exc.message, **exc.extra})
    return valid, errors


def validate_batch(items: Sequence[object], now_ms: int, limits: Limits = Limits()) -> list[Claim]:
    """A whole batch validated: every claim, or `InvalidBatch` naming each invalid one at its
    index (a batch is all or nothing)."""
    valid, errors = validate_items(items, 0, now_ms, limits)
    if errors:
        raise InvalidBatch(errors)
    return valid
