"""Claims (SPEC §1.4, §2.1, §2.2): signing bytes, signatures, the pure rules, key files."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import nacl.signing
import pytest
import rfc8785
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from multiformats import CID, multibase

from metanode import cid as cids
from metanode import claims, keys
from metanode import rid as rids
from metanode.claims import Claim, Limits
from metanode.errors import (
    BadSignature,
    ClaimError,
    InvalidCid,
    InvalidClaim,
    InvalidKey,
    InvalidKeyFile,
    InvalidMemberCid,
    InvalidTs,
    InvalidUid,
    InvalidValue,
    MetanodeError,
    NoncanonicalCid,
    ReservedKey,
    TsInFuture,
    shown,
)
from tests.helpers.vectors import load_vectors

VECTORS: dict[str, Any] = load_vectors("claims.json")
SEEDS: dict[str, str] = {s["uid"]: s["seed_hex"] for s in VECTORS["signers"]}

DOMAIN = "metanode-claim/1"
TS = 1_764_500_000_000
NOW = TS + 1000
MIN_TS = 946_684_800_000  # 2000-01-01T00:00:00Z
SKEW = 300_000

KEY = nacl.signing.SigningKey(bytes([0x11]) * 32)
OTHER_KEY = nacl.signing.SigningKey(bytes([0x22]) * 32)
CID_A = "bagacbabaea6gwjljwuu3cyxlrwwxgnmlfwd2gfshoi6mrtxysc4mnahe2hsqu"
CID_B = "bafkreibjb5etyrhv2y6qnm3u2cs2xuus7lryxewkwl5ol37p4gyosnd7ky"

# SPEC §2.2, written out here rather than imported, so a change to the module's list shows up.
RESERVED = [
    "filePath",
    "fileSize",
    "mtimeNano",
    "paths",
    "canonical_cid",
    "cids",
    "midhash256",
    "hashId",
    "__fields__",
]


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def uid_for(key: nacl.signing.SigningKey) -> str:
    """did:key spelling, built with multibase directly (independent of claims.uid_of)."""
    return str(multibase.encode(b"\xed\x01" + bytes(key.verify_key), "base58btc"))


UID = uid_for(KEY)
OTHER_UID = uid_for(OTHER_KEY)


def wire(signer: nacl.signing.SigningKey = KEY, **changes: Any) -> dict[str, Any]:
    """A wire claim signed over its own (possibly invalid) fields, so only the field under test
    can break it. `sig` in `changes` replaces the signature as given."""
    body: dict[str, Any] = {
        "uid": uid_for(signer),
        "cid": CID_A,
        "key": "title",
        "value": "The Matrix",
        "ts": TS,
    }
    body.update({k: v for k, v in changes.items() if k != "sig"})
    if "sig" in changes:
        body["sig"] = changes["sig"]
    else:
        try:
            message = rfc8785.dumps(
                [DOMAIN, body["uid"], body["cid"], body["key"], body["value"], body["ts"]]
            )
            body["sig"] = b64url(signer.sign(message).signature)
        except Exception:  # not JSON-encodable (e.g. lone surrogates): any 64 bytes will do
            body["sig"] = b64url(bytes(64))
    return body


def rejects(
    obj: object, error: type[ClaimError], slug: str, now: int = NOW, limits: Limits | None = None
) -> ClaimError:
    with pytest.raises(error) as info:
        if limits is None:
            claims.validate(obj, now)
        else:
            claims.validate(obj, now, limits)
    assert info.value.slug == slug
    assert info.value.status == 400
    return info.value


def accepts(obj: dict[str, Any], now: int = NOW, limits: Limits | None = None) -> Claim:
    claim = claims.validate(obj, now) if limits is None else claims.validate(obj, now, limits)
    assert claim.wire() == obj
    return claim


def test_base_claim_is_valid() -> None:
    claim = accepts(wire())
    assert claim.uid == UID
    assert claim.sig == base64.urlsafe_b64decode(wire()["sig"] + "==")


@settings(max_examples=50)
@given(st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=6), st.data())
def test_each_signer_signs_as_its_own_uid(seeds: list[bytes], data: st.DataObject) -> None:
    """`uid_of` is cached (`sign` needs it for every claim): claims signed by many keys in any
    order still each carry their own key's uid and verify."""
    signers = [nacl.signing.SigningKey(seed) for seed in seeds]
    for n in data.draw(st.lists(st.integers(0, len(signers) - 1), min_size=1, max_size=12)):
        signed = claims.sign(signers[n], cids.midhash_bytes(seeds[n]), "title", "x", 1)
        assert signed.uid == uid_for(signers[n])
        claims.verify(signed)


# -- vectors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("signer", VECTORS["signers"], ids=lambda s: s["uid"][:12])
def test_signer_vector(signer: dict[str, str]) -> None:
    key = nacl.signing.SigningKey(bytes.fromhex(signer["seed_hex"]))
    assert bytes(key.verify_key).hex() == signer["public_key_hex"]
    assert claims.uid_of(bytes.fromhex(signer["public_key_hex"])) == signer["uid"]
    assert keys.uid_of_key(key) == signer["uid"]
    assert signer["uid"].startswith("z6Mk")
    assert bytes(claims.public_key(signer["uid"])) == bytes.fromhex(signer["public_key_hex"])


CLAIM_VECTORS: list[dict[str, Any]] = VECTORS["vectors"]


@pytest.mark.parametrize("vector", CLAIM_VECTORS, ids=[str(i) for i in range(len(CLAIM_VECTORS))])
def test_claim_vector(vector: dict[str, Any]) -> None:
    w = vector["claim"]
    expected = bytes.fromhex(vector["signing_bytes_hex"])
    assert vector["signing_bytes_utf8"].encode("utf-8") == expected
    got = claims.signing_bytes(w["uid"], w["cid"], w["key"], w["value"], w["ts"])
    assert got == expected
    # The signature reproduces byte for byte from the seed (Ed25519 is deterministic).
    key = nacl.signing.SigningKey(bytes.fromhex(SEEDS[w["uid"]]))
    sig = key.sign(expected).signature
    assert b64url(sig) == w["sig"]
    assert claims.decode_sig(w["sig"]) == sig
    assert claims.encode_sig(sig) == w["sig"]
    signed = claims.sign(key, w["cid"], w["key"], w["value"], w["ts"])
    assert signed.wire() == w
    assert signed.signing_bytes() == expected
    # validate() accepts it and the wire form round-trips.
    claim = claims.validate(w, NOW)
    assert claim == signed
    assert claim.wire() == w
    assert json.loads(json.dumps(claim.wire())) == w
    assert claims.validate(json.loads(json.dumps(w)), NOW) == claim


def test_vector_link_claim_names_its_member() -> None:
    link = next(v["claim"] for v in CLAIM_VECTORS if v["claim"]["key"].startswith("cids/"))
    claim = claims.validate(link, NOW)
    assert claim.is_link
    assert claim.member == link["key"][len("cids/") :]
    plain = claims.validate(CLAIM_VECTORS[0]["claim"], NOW)
    assert not plain.is_link
    assert plain.member is None


def test_vector_retraction_has_null_value() -> None:
    tomb = next(v["claim"] for v in CLAIM_VECTORS if v["claim"]["value"] is None)
    claim = claims.validate(tomb, NOW)
    assert claim.value is None
    assert claim.wire()["value"] is None


# -- invalid_uid ---------------------------------------------------------------------------------

X25519_UID = str(multibase.encode(b"\xec\x01" + bytes(KEY.verify_key), "base58btc"))
SHORT_UID = str(multibase.encode(b"\xed\x01" + bytes(KEY.verify_key)[:31], "base58btc"))
LONG_UID = str(multibase.encode(b"\xed\x01" + bytes(KEY.verify_key) + b"\x00", "base58btc"))
BASE32_UID = str(multibase.encode(b"\xed\x01" + bytes(KEY.verify_key), "base32"))


@pytest.mark.parametrize(
    "uid",
    [
        "",
        "z",
        "not-a-uid",
        "z6Mk0OIl",
        "did:key:" + UID,
        X25519_UID,
        SHORT_UID,
        LONG_UID,
        BASE32_UID,
        UID + "a",
        UID[:-1],
        None,
        123,
        [UID],
    ],
    ids=[
        "empty",
        "z",
        "garbage",
        "non-base58",
        "did-key",
        "x25519",
        "short",
        "long",
        "base32",
        "extra-char",
        "truncated",
        "none",
        "int",
        "list",
    ],
)
def test_invalid_uid(uid: Any) -> None:
    rejects(wire(uid=uid), InvalidUid, "invalid_uid")
    with pytest.raises(InvalidUid):
        claims.public_key(uid)


def test_a_did_key_is_refused_with_the_uid_it_holds() -> None:
    """An external plugin's author who knows DIDs sent `did:key:z6Mk…`; the refusal names the
    uid to send instead."""
    refused = rejects(wire(uid="did:key:" + UID), InvalidUid, "invalid_uid")
    assert refused.message.endswith(f" (a uid is {UID!r}, without 'did:key:')")
    other = rejects(wire(uid="did:key:z6Mkbogus"), InvalidUid, "invalid_uid")  # holds none
    assert other.message == "not an ed25519 multikey uid: 'did:key:z6Mkbogus'"


BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


@given(
    st.one_of(
        st.binary(min_size=32, max_size=32).map(claims.uid_of),
        st.text(BASE58, min_size=40, max_size=52).map(lambda tail: "z" + tail),
    ),
    st.integers(min_value=0, max_value=47),
    st.sampled_from(BASE58),
)
def test_a_uid_is_accepted_only_in_its_one_spelling(uid: str, at: int, char: str) -> None:
    """`public_key` accepts a string only if it is the did:key spelling of the key it decodes
    to (checked by decoding, without encoding back): so a uid with any one character changed,
    added or removed names another key or none."""
    for text in (uid, uid[: at + 1] + char + uid[at + 1 :], uid[: at + 1] + uid[at + 2 :]):
        try:
            key = claims.public_key(text)
        except InvalidUid:
            continue
        assert claims.uid_of(bytes(key)) == text


@given(st.binary(min_size=32, max_size=32))
def test_a_uid_is_the_multibase_spelling_of_its_key(key: bytes) -> None:
    """`uid_of` and `public_key` (base58 written out, not through `multibase`) agree with
    `multibase` both ways."""
    uid = claims.uid_of(key)
    assert uid == multibase.encode(claims.ED25519_PUB + key, "base58btc")
    assert bytes(claims.public_key(uid)) == key


def multibase_key(text: str) -> bytes | None:
    """The key `multibase` decodes `text` to, or None where it is no ed25519-pub multikey."""
    try:
        raw = bytes(multibase.decode(text))
    except Exception:
        return None
    return raw[2:] if len(raw) == 34 and raw[:2] == claims.ED25519_PUB else None


@given(
    st.one_of(
        st.binary(min_size=32, max_size=32).map(claims.uid_of),
        st.text(BASE58 + "0OIl+/ é", min_size=0, max_size=52).map(lambda tail: "z" + tail),
        st.text(BASE58, min_size=1, max_size=47).map(lambda tail: "z1" + tail),
    ),
    st.integers(min_value=0, max_value=47),
    st.sampled_from(BASE58 + "0"),
)
def test_public_key_accepts_exactly_what_multibase_decodes_to_a_key(
    uid: str, at: int, char: str
) -> None:
    """A string and its one-character edits: `public_key` gives the key `multibase` decodes it
    to, and refuses it where `multibase` gives no ed25519-pub multikey (a leading `1`, a
    wrong length, a character outside the alphabet)."""
    for text in (uid, uid[: at + 1] + char + uid[at + 1 :], uid[: at + 1] + uid[at + 2 :]):
        expected = multibase_key(text)
        try:
            found: bytes | None = bytes(claims.public_key(text))
        except InvalidUid:
            found = None
        assert found == expected


@pytest.mark.parametrize("field", ["uid", "cid", "key", "value", "ts", "sig"])
def test_a_missing_field_is_invalid_claim(field: str) -> None:
    # notably "value": a retraction says null; leaving it out is a mistake, not a tombstone
    body = wire()
    del body[field]
    rejects(body, InvalidClaim, "invalid_claim")


# -- invalid_cid / noncanonical_cid --------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["not-a-cid", "", "midhash256:" + CID_A, CID_A[:-3], None, 5, [CID_A]],
    ids=["garbage", "empty", "token-form", "truncated", "none", "int", "list"],
)
def test_invalid_cid(value: Any) -> None:
    rejects(wire(cid=value), InvalidCid, "invalid_cid")


@pytest.mark.parametrize("base", ["base58btc", "base36", "base32upper"])
def test_noncanonical_cid_names_the_canonical(base: str) -> None:
    spelling = CID.decode(CID_A).encode(base)
    error = rejects(wire(cid=spelling), NoncanonicalCid, "noncanonical_cid")
    assert error.extra["canonical"] == CID_A
    assert CID_A in error.message


def test_cidv0_in_a_claim_is_noncanonical() -> None:
    v0 = "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG"
    error = rejects(wire(cid=v0), NoncanonicalCid, "noncanonical_cid")
    assert error.extra["canonical"] == cids.normalise(v0)


# -- invalid_key ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "",
        "a" * 1025,
        "é" * 513,
        "a//b",
        "/a",
        "a/",
        "/",
        ".",
        "..",
        "a/./b",
        "a/../b",
        "./a",
        "a/..",
        "a\x00b",
        "a\x1fb",
        "a\x7fb",
        "\n",
        "tab\there",
        "\ud800",
        None,
        1,
        ["title"],
        {"title": 1},
    ],
    ids=[
        "empty",
        "1025-bytes",
        "1026-utf8-bytes",
        "empty-segment",
        "leading-slash",
        "trailing-slash",
        "slash",
        "dot",
        "dotdot",
        "inner-dot",
        "inner-dotdot",
        "leading-dot-seg",
        "trailing-dotdot",
        "nul",
        "us-0x1f",
        "del-0x7f",
        "newline",
        "tab",
        "surrogate",
        "none",
        "int",
        "list",
        "dict",
    ],
)
def test_invalid_key(key: Any) -> None:
    rejects(wire(key=key), InvalidKey, "invalid_key")
    with pytest.raises(InvalidKey):
        claims.check_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "title",
        "a" * 1024,
        "é" * 512,
        "titles/jpn/マトリックス",
        "a.b",
        ".hidden",
        "...",
        "a b",
        "cidx",
        "cids2",
        "x/cids",
        "x/filePath",
        "FilePath",
        "cids/" + CID_B,
    ],
)
def test_valid_keys(key: str) -> None:
    assert claims.check_key(key) == key
    accepts(wire(key=key))


# -- reserved_key --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [*RESERVED, "cid_x", "cid_", "cid_midhash256", "cid_sha2-256"])
def test_reserved_key(key: str) -> None:
    rejects(wire(key=key), ReservedKey, "reserved_key")


# -- invalid_member_cid --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "member",
    [
        "garbage",
        CID.decode(CID_B).encode("base58btc"),
        CID.decode(CID_B).encode("base36"),
        "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG",
        "midhash256:" + CID_A,
        CID_B[:-2],
    ],
    ids=["garbage", "base58btc", "base36", "cidv0", "token-form", "truncated"],
)
def test_invalid_member_cid(member: str) -> None:
    rejects(wire(key="cids/" + member, value="true"), InvalidMemberCid, "invalid_member_cid")


def test_link_member_in_canonical_form_is_accepted() -> None:
    claim = accepts(wire(key="cids/" + CID_B, value="true"))
    assert claim.member == CID_B


def test_cids_slash_alone_is_an_invalid_key() -> None:
    rejects(wire(key="cids/"), InvalidKey, "invalid_key")


# -- invalid_value -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [123, 1.5, True, ["x"], {"a": "b"}, "x" * 65_537, "é" * 32_769, "\udc00"],
    ids=["int", "float", "bool", "list", "dict", "65537-bytes", "65538-utf8-bytes", "surrogate"],
)
def test_invalid_value(value: Any) -> None:
    rejects(wire(value=value), InvalidValue, "invalid_value")


@pytest.mark.parametrize(
    "value",
    ["x" * 65_536, "é" * 32_768, "", None, "\x00 \x1f ok"],
    ids=["65536-bytes", "65536-utf8-bytes", "empty", "null", "controls"],
)
def test_valid_values(value: str | None) -> None:
    assert accepts(wire(value=value)).value == value


def test_custom_value_limit() -> None:
    limits = Limits(max_value_bytes=10)
    accepts(wire(value="x" * 10), limits=limits)
    accepts(wire(value="éééééé"[:5]), limits=limits)  # 10 bytes
    refused = rejects(wire(value="x" * 11), InvalidValue, "invalid_value", limits=limits)
    assert refused.message == "value is 11 bytes, the limit is 10 (max_value_bytes)"  # the setting
    rejects(wire(value="é" * 6), InvalidValue, "invalid_value", limits=limits)
    big = Limits(max_value_bytes=100_000)
    accepts(wire(value="x" * 65_537), limits=big)


# -- invalid_ts / ts_in_future -------------------------------------------------------------------


@pytest.mark.parametrize(
    "ts",
    [True, False, float(TS), 1.5, str(TS), None, [TS], MIN_TS - 1, 0, -1],
    ids=[
        "true",
        "false",
        "float",
        "fraction",
        "string",
        "none",
        "list",
        "before-2000",
        "zero",
        "negative",
    ],
)
def test_invalid_ts(ts: Any) -> None:
    error = rejects(wire(ts=ts), InvalidTs, "invalid_ts")
    assert not error.retryable


def test_earliest_ts_is_accepted() -> None:
    accepts(wire(ts=MIN_TS))


def test_ts_in_future() -> None:
    error = rejects(wire(ts=NOW + SKEW + 1), TsInFuture, "ts_in_future")
    assert error.retryable
    accepts(wire(ts=NOW + SKEW))  # exactly now + skew is fine


def test_custom_skew() -> None:
    limits = Limits(max_skew_ms=0)
    accepts(wire(ts=NOW), limits=limits)
    rejects(wire(ts=NOW + 1), TsInFuture, "ts_in_future", limits=limits)
    wide = Limits(max_skew_ms=10 * SKEW)
    accepts(wire(ts=NOW + 10 * SKEW), limits=wide)


# -- bad_signature -------------------------------------------------------------------------------


def _flip_bit(raw: bytes, bit: int) -> bytes:
    out = bytearray(raw)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


GOOD_SIG: str = wire()["sig"]
GOOD_RAW: bytes = base64.urlsafe_b64decode(GOOD_SIG + "==")
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
# The 86th char carries 2 data bits and 4 zero pad bits; setting a pad bit keeps the bytes.
PAD_BITS_SIG = GOOD_SIG[:-1] + ALPHABET[ALPHABET.index(GOOD_SIG[-1]) ^ 1]


@pytest.mark.parametrize(
    "sig",
    [
        b64url(GOOD_RAW[:63]),
        b64url(GOOD_RAW + b"\x00"),
        GOOD_SIG + "==",
        PAD_BITS_SIG,
        "",
        "!" * 86,
        GOOD_SIG[:-1],
        GOOD_SIG + "A",
        b64url(_flip_bit(GOOD_RAW, 0)),
        b64url(_flip_bit(GOOD_RAW, 511)),
        b64url(bytes(64)),
        wire(value="other")["sig"],
        wire(signer=OTHER_KEY)["sig"],
        None,
        123,
        GOOD_RAW,
    ],
    ids=[
        "63-bytes",
        "65-bytes",
        "padded",
        "pad-bits",
        "empty",
        "not-base64",
        "85-chars",
        "87-chars",
        "flip-first-bit",
        "flip-last-bit",
        "zeros",
        "other-claim",
        "other-key",
        "none",
        "int",
        "raw-bytes",
    ],
)
def test_bad_signature(sig: Any) -> None:
    rejects(wire(sig=sig), BadSignature, "bad_signature")


def test_signature_by_someone_else_is_bad() -> None:
    # Well-formed uid and signature, but the uid is not the signer.
    body = wire()
    body["uid"] = OTHER_UID
    rejects(body, BadSignature, "bad_signature")


def test_decode_sig_wants_canonical_unpadded_base64url() -> None:
    raw = bytes([0xFB, 0xFF]) * 32  # encodes to '-' and '_' in base64url, '+' and '/' in base64
    url = b64url(raw)
    assert "-" in url and "_" in url
    assert claims.decode_sig(url) == raw
    standard = base64.b64encode(raw).rstrip(b"=").decode("ascii")
    assert standard != url
    with pytest.raises(BadSignature):
        claims.decode_sig(standard)
    with pytest.raises(BadSignature):
        claims.decode_sig(PAD_BITS_SIG)
    assert claims.decode_sig(GOOD_SIG) == GOOD_RAW
    with pytest.raises(BadSignature):
        claims.decode_sig(GOOD_SIG + "==")


# -- invalid_claim -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [[], "claim", None, 1, [wire()], json.dumps(wire())],
    ids=["list", "string", "none", "int", "list-of-claim", "json-text"],
)
def test_not_an_object(obj: Any) -> None:
    rejects(obj, InvalidClaim, "invalid_claim")


@pytest.mark.parametrize("field", ["extra", "Sig", "signature", "rid"])
def test_unknown_field(field: str) -> None:
    body = wire()
    body[field] = "x"
    error = rejects(body, InvalidClaim, "invalid_claim")
    assert field in error.message


# -- tampering: any change to the signed content breaks the signature ----------------------------

BASE = claims.sign(KEY, CID_A, "title", "The Matrix", TS)
FIELDS = ["uid", "cid", "key", "value", "ts", "sig"]
# Explicit alphabets (no Unicode-category lookups, which are slow on a cold Hypothesis cache).
KEY_ALPHABET = "abcxyzABZ0189/._- éßマトリ\u2028😀"
VALUE_ALPHABET = KEY_ALPHABET + '\x00\x01\x1f\x7f\n\t"\\'


def _valid_key(text: str) -> bool:
    try:
        claims.check_key(text)
    except ClaimError:
        return False
    return True


@st.composite
def tampered(draw: st.DrawFn) -> Claim:
    field = draw(st.sampled_from(FIELDS))
    new: Any
    if field == "uid":
        seed = draw(st.binary(min_size=32, max_size=32))
        new = uid_for(nacl.signing.SigningKey(seed))
    elif field == "cid":
        codec = draw(st.sampled_from([cids.RAW, cids.DAG_PB, cids.MIDHASH256]))
        mh = draw(st.sampled_from([cids.SHA2_256, cids.BLAKE3, cids.MIDHASH256]))
        new = cids.encode(codec, mh, draw(st.binary(min_size=32, max_size=32)))
    elif field == "key":
        new = draw(st.text(KEY_ALPHABET, min_size=1, max_size=40))
        assume(_valid_key(new))
    elif field == "value":
        new = draw(st.none() | st.text(VALUE_ALPHABET, max_size=60))
    elif field == "ts":
        new = draw(st.integers(min_value=MIN_TS, max_value=NOW))
    else:
        new = _flip_bit(BASE.sig, draw(st.integers(min_value=0, max_value=511)))
    assume(new != getattr(BASE, field))
    return dataclasses.replace(BASE, **{field: new})


def test_untampered_base_verifies() -> None:
    claims.verify(BASE)
    assert claims.validate(BASE.wire(), NOW) == BASE


@settings(max_examples=200, database=None)
@given(tampered())
def test_any_single_change_breaks_the_signature(claim: Claim) -> None:
    with pytest.raises(BadSignature):
        claims.verify(claim)
    with pytest.raises(BadSignature):
        claims.validate(claim.wire(), NOW)


@settings(max_examples=50, database=None)
@given(
    seed=st.binary(min_size=32, max_size=32),
    value=st.none() | st.text(VALUE_ALPHABET),
    ts=st.integers(min_value=MIN_TS, max_value=NOW),
)
def test_sign_then_validate_round_trips(seed: bytes, value: str | None, ts: int) -> None:
    key = nacl.signing.SigningKey(seed)
    claim = claims.sign(key, CID_B, "title", value, ts)
    assert claim.uid == uid_for(key)
    back = claims.validate(json.loads(json.dumps(claim.wire())), NOW)
    assert back == claim


# -- key files -----------------------------------------------------------------------------------


def test_create_writes_owner_only_file(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.key"
    uid = keys.create(path)
    assert uid.startswith("z6Mk")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(path.read_text())
    assert data["type"] == "ed25519"
    assert data["uid"] == uid
    assert len(bytes.fromhex(data["seed"])) == 32
    assert uid_for(keys.load(path)) == uid


def test_create_with_given_key_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    assert keys.create(path, KEY) == UID
    loaded = keys.load(path)
    assert bytes(loaded) == bytes(KEY)
    assert bytes(loaded.verify_key) == bytes(KEY.verify_key)
    assert keys.load(str(path)).encode() == KEY.encode()


def test_create_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    keys.create(path, KEY)
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        keys.create(path)
    with pytest.raises(FileExistsError):
        keys.create(path, OTHER_KEY)
    assert path.read_bytes() == before
    assert bytes(keys.load(path)) == bytes(KEY)


def test_create_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = tmp_path / "k.json"
        keys.create(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_or_create(tmp_path: Path) -> None:
    path = tmp_path / "plugin.key"
    first = keys.load_or_create(path)
    second = keys.load_or_create(path)
    assert bytes(first) == bytes(second)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def _good_body() -> dict[str, Any]:
    return {"type": "ed25519", "seed": bytes(KEY).hex(), "uid": UID}


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "",
        "[]",
        "null",
        json.dumps({}),
        json.dumps(_good_body() | {"type": "x25519"}),
        json.dumps({k: v for k, v in _good_body().items() if k != "seed"}),
        json.dumps(_good_body() | {"seed": "zz" * 32}),
        json.dumps(_good_body() | {"seed": bytes(KEY).hex()[:-2]}),
        json.dumps(_good_body() | {"seed": bytes(KEY).hex() + "00"}),
        json.dumps(_good_body() | {"seed": 5}),
        json.dumps(_good_body() | {"uid": OTHER_UID}),
        json.dumps(_good_body() | {"uid": "z6Mk-wrong"}),
    ],
    ids=[
        "not-json",
        "empty",
        "list",
        "null",
        "empty-object",
        "wrong-type",
        "no-seed",
        "non-hex-seed",
        "short-seed",
        "long-seed",
        "int-seed",
        "mismatched-uid",
        "garbage-uid",
    ],
)
def test_load_rejects_broken_files(tmp_path: Path, text: str) -> None:
    path = tmp_path / "k.json"
    path.write_text(text)
    with pytest.raises(InvalidKeyFile) as info:
        keys.load(path)
    assert info.value.slug == "invalid_key_file"


def test_load_without_uid_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"type": "ed25519", "seed": bytes(KEY).hex()}))
    assert bytes(keys.load(path)) == bytes(KEY)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidKeyFile):
        keys.load(tmp_path / "absent.key")


@settings(max_examples=100, database=None)
@given(st.text(min_size=0, max_size=5000))
@example("B\u0cce00000000\x1f\U00012544\U00018cd6\U0002ebe1\U0002ebe1")  # multiformats' words
def test_an_identifier_that_fails_is_quoted_short_however_long_it_is(text: str) -> None:
    """A megabyte of bad uid, CID or rid came back a megabyte long in the error's message; a
    refusal quotes at most 100 characters of it and says how long it was."""
    for check in (claims.public_key, cids.parse, rids.parse):
        try:
            check("z" + text if check is claims.public_key else text)
        except MetanodeError as exc:
            assert len(exc.message) < 200, exc.message
    quoted = shown(text)
    assert quoted == repr(text) if len(repr(text)) <= 100 else quoted.endswith(" characters)")
