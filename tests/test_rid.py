"""rids (SPEC §1.3): UUIDv7 as 26-char Crockford base32, and the monotonic minter."""

from __future__ import annotations

import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metanode import rid
from metanode.errors import InvalidRid
from tests.helpers.vectors import load_vectors

VECTORS: list[dict[str, str]] = load_vectors("rids.json")["vectors"]
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
SAMPLE = "01H455VB4PEX5VSKNK084SN02Q"


def as_uuid(text: str) -> uuid.UUID:
    """The UUID a rid spells (the inverse of `rid.from_uuid`)."""
    return uuid.UUID(int=rid.decode(text))


def _uuid7_int(ms: int, rand_a: int, rand_b: int) -> int:
    """A UUIDv7 from its fields, written out from RFC 9562 independently of the module."""
    return (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b


def _ms(text: str) -> int:
    return uuid.UUID(int=rid.decode(text)).int >> 80


# -- vectors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("vector", VECTORS, ids=[v["rid"] for v in VECTORS])
def test_vector_both_ways(vector: dict[str, str]) -> None:
    u = uuid.UUID(vector["uuid"])
    assert rid.from_uuid(vector["uuid"]) == vector["rid"]
    assert rid.from_uuid(u) == vector["rid"]
    assert as_uuid(vector["rid"]) == u
    assert as_uuid(vector["rid"].lower()) == u
    assert rid.parse(vector["rid"]) == vector["rid"]
    assert rid.parse(vector["rid"].lower()) == vector["rid"]
    assert rid.decode(vector["rid"]) == u.int
    assert rid.encode(u.int) == vector["rid"]


def test_vector_format() -> None:
    for vector in VECTORS:
        assert len(vector["rid"]) == 26
        assert set(vector["rid"]) <= set(CROCKFORD)
        assert uuid.UUID(vector["uuid"]).version == 7


# -- rejects -------------------------------------------------------------------------------------


def _replace(text: str, index: int, char: str) -> str:
    return text[:index] + char + text[index + 1 :]


BAD_SPELLINGS = [
    pytest.param(SAMPLE[:-1], id="25-chars"),
    pytest.param(SAMPLE + "0", id="27-chars"),
    pytest.param("", id="empty"),
    pytest.param(_replace(SAMPLE, 10, "U"), id="U"),
    pytest.param(_replace(SAMPLE, 10, "I"), id="I"),
    pytest.param(_replace(SAMPLE, 10, "L"), id="L"),
    pytest.param(_replace(SAMPLE, 10, "O"), id="O"),
    pytest.param(_replace(SAMPLE, 10, "u"), id="lower-u"),
    pytest.param(_replace(SAMPLE, 10, "-"), id="dash"),
    pytest.param(_replace(SAMPLE, 10, " "), id="space"),
    pytest.param(_replace(SAMPLE, 0, "8"), id="first-8"),
    pytest.param(_replace(SAMPLE, 0, "Z"), id="first-Z"),
    pytest.param(" " + SAMPLE[1:], id="leading-space"),
    pytest.param("01890a5d-ac96-774b-bcce-b302099a8057", id="uuid-spelling"),
]


@pytest.mark.parametrize("text", BAD_SPELLINGS)
def test_bad_spellings_are_invalid(text: str) -> None:
    with pytest.raises(InvalidRid) as info:
        rid.parse(text)
    assert info.value.slug == "invalid_rid"
    with pytest.raises(InvalidRid):
        rid.decode(text)


@pytest.mark.parametrize(
    "u",
    [
        uuid.UUID("0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d"),  # v4
        uuid.UUID("01890a5d-ac96-674b-bcce-b302099a8057"),  # v6
        uuid.UUID("01890a5d-ac96-874b-bcce-b302099a8057"),  # v8
        uuid.UUID("01890a5d-ac96-774b-7cce-b302099a8057"),  # v7 digit, NCS variant (0b0…)
        uuid.UUID("01890a5d-ac96-774b-ccce-b302099a8057"),  # v7 digit, Microsoft variant (0b110)
        uuid.UUID(int=0),
    ],
    ids=["v4", "v6", "v8", "variant-ncs", "variant-microsoft", "nil"],
)
def test_non_v7_uuids_are_invalid(u: uuid.UUID) -> None:
    spelled = rid.from_uuid(u)
    assert len(spelled) == 26
    assert as_uuid(spelled) == u  # the spelling itself round-trips
    with pytest.raises(InvalidRid):
        rid.parse(spelled)
    with pytest.raises(InvalidRid):
        rid.parse(spelled.lower())


@pytest.mark.parametrize("value", [None, 123, [], b"01H455VB4PEX5VSKNK084SN02Q", 1.5])
def test_non_strings_are_invalid(value: Any) -> None:
    with pytest.raises(InvalidRid):
        rid.parse(value)
    with pytest.raises(InvalidRid):
        rid.decode(value)


@pytest.mark.parametrize(
    "text",
    ["0000000000E0080000000000\u00df", "0000000000E00800000000000\u017f"],
    ids=["sharp-s", "long-s"],
)
def test_non_ascii_is_invalid(text: str) -> None:
    with pytest.raises(InvalidRid):
        rid.parse(text)


# -- properties ----------------------------------------------------------------------------------


@settings(max_examples=200, database=None)
@given(st.integers(min_value=0, max_value=(1 << 128) - 1))
def test_encode_decode_round_trip(value: int) -> None:
    text = rid.encode(value)
    assert len(text) == 26
    assert set(text) <= set(CROCKFORD)
    assert text[0] <= "7"
    assert rid.decode(text) == value
    assert rid.decode(text.lower()) == value
    assert as_uuid(text) == uuid.UUID(int=value)
    assert rid.from_uuid(uuid.UUID(int=value)) == text


@settings(max_examples=200, database=None)
@given(
    st.integers(min_value=0, max_value=(1 << 128) - 1),
    st.integers(min_value=0, max_value=(1 << 128) - 1),
)
def test_string_order_is_numeric_order(a: int, b: int) -> None:
    """'The older rid survives' compares strings, so the spelling must sort like the number."""
    assert (rid.encode(a) < rid.encode(b)) == (a < b)


@settings(max_examples=200, database=None)
@given(
    ms=st.integers(min_value=0, max_value=(1 << 48) - 1),
    rand_a=st.integers(min_value=0, max_value=(1 << 12) - 1),
    rand_b=st.integers(min_value=0, max_value=(1 << 62) - 1),
)
def test_every_uuid7_parses(ms: int, rand_a: int, rand_b: int) -> None:
    u = uuid.UUID(int=_uuid7_int(ms, rand_a, rand_b))
    assert u.version == 7
    text = rid.from_uuid(u)
    assert rid.parse(text) == text
    assert rid.parse(text.lower()) == text
    assert as_uuid(text) == u


# -- the minter ----------------------------------------------------------------------------------


def _frozen(ms: int) -> Callable[[], int]:
    return lambda: ms


def _sequence(values: list[int]) -> Callable[[], int]:
    it: Iterator[int] = iter(values)
    last = values[-1]
    return lambda: next(it, last)


def test_frozen_clock_mints_strictly_increasing() -> None:
    ms = 1_764_500_000_000
    minter = rid.Minter(_frozen(ms))
    minted = [minter.mint() for _ in range(10_000)]
    assert all(a < b for a, b in itertools.pairwise(minted))
    assert len(set(minted)) == len(minted)
    for text in minted[:50] + minted[-50:]:
        assert rid.parse(text) == text
        assert _ms(text) == ms
        assert as_uuid(text).version == 7


def test_clock_stepping_back_still_increases() -> None:
    clock = [5_000, 5_000, 4_000, 3_999, 1, 5_000, 6_000, 2_000, 6_000, 7_000]
    minter = rid.Minter(_sequence(clock))
    minted = [minter.mint() for _ in clock]
    assert all(a < b for a, b in itertools.pairwise(minted))
    # While the clock is behind, minting stays on the newest millisecond it has seen.
    assert [_ms(t) for t in minted] == [
        5_000,
        5_000,
        5_000,
        5_000,
        5_000,
        5_000,
        6_000,
        6_000,
        6_000,
        7_000,
    ]
    for text in minted:
        assert rid.parse(text) == text


def test_fresh_millisecond_follows_the_clock() -> None:
    minter = rid.Minter(_sequence([1_000, 2_000, 3_000]))
    assert [_ms(minter.mint()) for _ in range(3)] == [1_000, 2_000, 3_000]


def test_default_clock_is_wall_clock() -> None:
    before = time.time_ns() // 1_000_000
    text = rid.Minter().mint()
    after = time.time_ns() // 1_000_000
    assert before <= _ms(text) <= after


def test_observe_raises_the_floor() -> None:
    floor = rid.from_uuid(uuid.UUID(int=_uuid7_int(9_000, 0xABC, 12345)))
    minter = rid.Minter(_frozen(1_000))
    minter.observe(floor)
    minted = [minter.mint() for _ in range(100)]
    assert minted[0] > floor
    assert all(a < b for a, b in itertools.pairwise(minted))
    assert all(_ms(t) == 9_000 for t in minted)


def test_observe_accepts_lowercase_and_never_lowers() -> None:
    minter = rid.Minter(_frozen(1_000))
    high = rid.from_uuid(uuid.UUID(int=_uuid7_int(50_000, 0, 0)))
    low = rid.from_uuid(uuid.UUID(int=_uuid7_int(10, 0, 0)))
    minter.observe(high.lower())
    minter.observe(low)
    assert minter.mint() > high


def test_observe_invalid_raises() -> None:
    minter = rid.Minter(_frozen(1_000))
    with pytest.raises(InvalidRid):
        minter.observe("not-a-rid")


def test_counter_exhaustion_borrows_the_next_millisecond() -> None:
    full = rid.from_uuid(uuid.UUID(int=_uuid7_int(7_000, 0xFFF, (1 << 62) - 1)))
    minter = rid.Minter(_frozen(7_000))
    minter.observe(full)
    nxt = minter.mint()
    assert nxt > full
    assert rid.parse(nxt) == nxt
    assert _ms(nxt) == 7_001


def test_mint_after_the_largest_rid_never_returns_an_invalid_rid() -> None:
    largest = "7ZZZZZZZZZFZZVZZZZZZZZZZZZ"
    minter = rid.Minter(_frozen(1_000))
    minter.observe(largest)
    try:
        minted = minter.mint()
    except (InvalidRid, OverflowError, ValueError, RuntimeError):
        return  # refusing is an acceptable answer
    assert rid.parse(minted) == minted
    assert minted > largest


def test_concurrent_minting_is_unique() -> None:
    minter = rid.Minter()
    per_thread: list[list[str]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(out: list[str]) -> None:
        start.wait()
        for _ in range(2_000):
            out.append(minter.mint())

    threads = [threading.Thread(target=work, args=(out,)) for out in per_thread]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    every = [text for out in per_thread for text in out]
    assert len(every) == 8_000
    assert len(set(every)) == 8_000
    for out in per_thread:  # each thread sees its own mints in increasing order
        assert all(a < b for a, b in itertools.pairwise(out))
    for text in every[::97]:
        assert rid.parse(text) == text
