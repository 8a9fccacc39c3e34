"""Merge rules (SPEC §2.3 storing, §2.5 the merged record)."""

from __future__ import annotations

import functools
from typing import Any

import nacl.signing
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metanode import claims
from metanode.claims import Claim
from metanode.merge import (
    LocalFile,
    Signer,
    document,
    group_keys,
    merge_key,
    merge_record,
    resolve,
    seen_by,
)

TS = 1_764_500_000_000
KEYS = [nacl.signing.SigningKey(bytes([n]) * 32) for n in (0x31, 0x32, 0x33, 0x34)]
KA, KB, KC, _ = KEYS  # D signs nothing: the viewer with no vote
A, B, C, D = (claims.uid_of(bytes(k.verify_key)) for k in KEYS)

MIDHASH_1 = "bagacbabaea6gwjljwuu3cyxlrwwxgnmlfwd2gfshoi6mrtxysc4mnahe2hsqu"
MIDHASH_2 = "bagacbabaec6bis2zt3sy7r6idel2bwbbbtp4edn3sseu5brraxm2u2xdqu4cm"
SHA = "bafkreibjb5etyrhv2y6qnm3u2cs2xuus7lryxewkwl5ol37p4gyosnd7ky"
DAGPB = "bafybeiaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
GROUP_CIDS = [MIDHASH_1, SHA, MIDHASH_2]
OUTSIDE = "bagacbabaeaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"


@functools.lru_cache(maxsize=4096)
def sign(
    key: nacl.signing.SigningKey, cid: str, key_name: str, value: str | None, ts: int
) -> Claim:
    """A real signed claim (cached: hypothesis asks for the same ones again and again)."""
    return claims.sign(key, cid, key_name, value, ts)


def vote(
    key: nacl.signing.SigningKey,
    value: str | None,
    ts: int,
    cid: str = MIDHASH_1,
    key_name: str = "title",
) -> Claim:
    return sign(key, cid, key_name, value, ts)


# -- resolve (SPEC §2.3) ------------------------------------------------------------------------


def test_nothing_stored_is_accepted() -> None:
    assert resolve(None, vote(KA, "x", TS)) == "accepted"
    assert resolve(None, vote(KA, None, TS)) == "accepted"  # a first tombstone is kept too


def test_newer_replaces() -> None:
    assert resolve(vote(KA, "x", TS), vote(KA, "y", TS + 1)) == "accepted"
    assert resolve(vote(KA, "x", TS), vote(KA, None, TS + 1)) == "accepted"
    assert resolve(vote(KA, None, TS), vote(KA, "x", TS + 1)) == "accepted"


def test_older_is_stale() -> None:
    assert resolve(vote(KA, "y", TS + 1), vote(KA, "x", TS)) == "stale"
    # An old vote can never be replayed over a tombstone.
    assert resolve(vote(KA, None, TS + 1), vote(KA, "x", TS)) == "stale"


def test_identical_is_duplicate() -> None:
    claim = vote(KA, "x", TS)
    again = claims.sign(KA, MIDHASH_1, "title", "x", TS)  # a fresh but identical object
    assert claim is not again
    assert resolve(claim, again) == "duplicate"
    tomb = vote(KA, None, TS)
    assert resolve(tomb, claims.sign(KA, MIDHASH_1, "title", None, TS)) == "duplicate"


@pytest.mark.parametrize(("one", "two"), [("x", "y"), ("x", None), ("The Matrix", "Matrix, The")])
def test_equivocation_goes_to_the_smaller_signature(one: str | None, two: str | None) -> None:
    a, b = vote(KA, one, TS), vote(KA, two, TS)
    assert a.sig != b.sig
    low, high = (a, b) if a.sig < b.sig else (b, a)
    assert resolve(high, low) == "accepted"
    assert resolve(low, high) == "stale"
    # Whatever arrives first, the smaller signature ends up stored; never "duplicate".
    for first, second in ((a, b), (b, a)):
        stored = first
        if resolve(stored, second) == "accepted":
            stored = second
        assert stored == low
        assert resolve(first, second) != "duplicate"


def _fold(order: list[Claim]) -> Claim | None:
    stored: Claim | None = None
    for incoming in order:
        if resolve(stored, incoming) == "accepted":
            stored = incoming
    return stored


@settings(max_examples=100, database=None)
@given(
    specs=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=3),
            st.sampled_from(["a", "b", "c", "The Matrix", None]),
        ),
        min_size=1,
        max_size=8,
    ),
    data=st.data(),
)
def test_any_arrival_order_converges(specs: list[tuple[int, str | None]], data: Any) -> None:
    batch = [vote(KA, value, TS + dt) for dt, value in specs]
    expected = min(batch, key=lambda c: (-c.ts, c.sig))  # newest, then smallest signature
    order = data.draw(st.permutations(batch))
    assert _fold(batch) == expected
    assert _fold(order) == expected
    assert _fold(list(reversed(batch))) == expected
    # Replaying everything again changes nothing: every claim is now duplicate or stale.
    for claim in order:
        assert resolve(expected, claim) in ("duplicate", "stale")


# -- merge_key (SPEC §2.5 rules 1-4) -------------------------------------------------------------


def test_no_votes_no_value() -> None:
    assert merge_key([], {}) is None
    assert merge_key([vote(KA, None, TS)], {}) is None


def test_plain_majority() -> None:
    votes = [vote(KA, "x", TS), vote(KB, "x", TS), vote(KC, "y", TS + 5)]
    assert merge_key(votes, {}) == "x"


def test_weight_beats_head_count() -> None:
    votes = [vote(KA, "x", TS), vote(KB, "x", TS + 1), vote(KC, "y", TS)]
    assert merge_key(votes, {C: Signer(weight=3)}) == "y"
    assert merge_key(votes, {C: Signer(weight=1)}) == "x"
    assert merge_key(votes, {A: Signer(weight=5), C: Signer(weight=3)}) == "x"


def test_score_tie_goes_to_newest_vote() -> None:
    # x scores 2 (A, B), y scores 2 (C weight 2): the value with the newest vote wins.
    newer_y = [vote(KA, "x", TS), vote(KB, "x", TS + 1), vote(KC, "y", TS + 2)]
    assert merge_key(newer_y, {C: Signer(weight=2)}) == "y"
    newer_x = [vote(KA, "x", TS + 3), vote(KB, "x", TS + 1), vote(KC, "y", TS + 2)]
    assert merge_key(newer_x, {C: Signer(weight=2)}) == "x"


def test_full_tie_goes_to_smaller_string() -> None:
    votes = [vote(KA, "b", TS), vote(KB, "a", TS)]
    assert merge_key(votes, {}) == "a"
    assert merge_key(list(reversed(votes)), {}) == "a"
    assert merge_key([vote(KA, "a", TS), vote(KB, "B", TS)], {}) == "B"  # code-point order


def test_blocked_signers_are_ignored() -> None:
    votes = [vote(KA, "x", TS), vote(KC, "y", TS)]
    assert merge_key(votes, {C: Signer(weight=3)}) == "y"
    assert merge_key(votes, {C: Signer(weight=3, blocked=True)}) == "x"
    assert merge_key([vote(KC, "y", TS)], {C: Signer(blocked=True)}) is None


def test_weight_zero_signers_are_listed_never_counted() -> None:
    """SPEC §2.5 rule 1: a vote needs a weight above 0, even when it is the only value."""
    assert merge_key([vote(KA, "zero", TS + 5)], {A: Signer(weight=0)}) is None
    votes = [vote(KA, "zero", TS + 5), vote(KB, "one", TS)]
    assert merge_key(votes, {A: Signer(weight=0)}) == "one"  # not the newest-vote tie-break
    assert merge_record(votes, {A: Signer(weight=0), B: Signer(weight=0)}) == {}


def test_one_signer_counts_once_across_the_group() -> None:
    # A voted "x" through two CIDs long ago, then "y" through a third; only "y" counts for A.
    votes = [
        vote(KA, "x", TS, cid=MIDHASH_1),
        vote(KA, "x", TS + 1, cid=SHA),
        vote(KA, "y", TS + 2, cid=MIDHASH_2),
        vote(KB, "z", TS + 3, cid=SHA),
    ]
    # y: 1 (A), z: 1 (B); tie -> z has the newest vote. Counting A twice would give x.
    assert merge_key(votes, {}) == "z"
    assert merge_key(votes[:3], {}) == "y"


def test_one_signer_same_ts_on_two_cids_takes_smaller_signature() -> None:
    one, two = vote(KA, "x", TS, cid=MIDHASH_1), vote(KA, "y", TS, cid=SHA)
    winner = one if one.sig < two.sig else two
    assert merge_key([one, two], {}) == winner.value
    assert merge_key([two, one], {}) == winner.value
    # It weighs once: with B voting the other value, the score is 1-1 and the string decides.
    loser_value = "y" if winner.value == "x" else "x"
    assert merge_key([one, two, vote(KB, loser_value, TS)], {}) == "x"


def test_one_signer_same_ts_and_signature_on_two_cids_takes_the_smaller_cid() -> None:
    """Verified votes never share a signature across CIDs, but stored rows are not re-verified
    (and test claims carry made-up ones): the merge still does not depend on the order it
    reads them in (found by `test_groups.py::test_batches_agree_with_one_claim_at_a_time`)."""
    sig = bytes([2]) * 64
    low, high = sorted([MIDHASH_1, SHA])
    on_low = Claim(A, low, "year", "y", TS, sig)
    on_high = Claim(A, high, "year", "x", TS, sig)
    assert merge_key([on_low, on_high], {}) == merge_key([on_high, on_low], {}) == "y"


def test_tombstone_drops_the_signer_vote() -> None:
    # Stored rows: A's tombstone (it replaced A's "x"), B's "y".
    assert merge_key([vote(KA, None, TS + 1), vote(KB, "y", TS)], {A: Signer(weight=9)}) == "y"
    assert merge_key([vote(KA, None, TS + 1)], {}) is None


def test_a_tombstone_ends_the_vote_on_its_own_cid_only() -> None:
    """docs/protocol.md, "The merged record": an external plugin retracted on the midhash what
    it had said on the canonical CID, and its word stayed; a retraction of its newer vote even
    brings back an older one it made on another CID of the group."""
    said_on_sha = [vote(KA, "x", TS, cid=SHA), vote(KA, None, TS + 1, cid=MIDHASH_1)]
    assert merge_key(said_on_sha, {}) == "x"
    older_elsewhere = [vote(KA, "x", TS, cid=SHA), vote(KA, None, TS + 2, cid=MIDHASH_1)]
    assert merge_key([*older_elsewhere[:1], vote(KA, "y", TS + 1, cid=MIDHASH_1)], {}) == "y"
    assert merge_key(older_elsewhere, {}) == "x"
    assert merge_key([vote(KA, None, TS + 1, cid=SHA), vote(KA, None, TS + 2)], {}) is None


def seen(votes: list[Claim], signers: dict[str, Signer], viewer: str) -> dict[str, str]:
    """The record as `viewer` sees it: `seen_by` over the merged record, as the node does."""
    return seen_by(merge_record(votes, signers), votes, signers, viewer)


def test_viewer_sees_their_own_vote() -> None:
    votes = [vote(KA, "mine", TS), vote(KB, "theirs", TS), vote(KC, "theirs", TS)]
    assert merge_key(votes, {}) == "theirs"
    assert seen(votes, {}, A)["title"] == "mine"
    assert seen(votes, {}, B)["title"] == "theirs"
    assert seen(votes, {}, D)["title"] == "theirs"  # no vote: the merged value


def test_viewer_sees_their_newest_vote() -> None:
    votes = [vote(KA, "old", TS, cid=SHA), vote(KA, "new", TS + 1), vote(KB, "x", TS)]
    assert seen(votes, {}, A)["title"] == "new"


def test_viewer_without_a_live_vote_gets_the_merge() -> None:
    votes = [vote(KA, None, TS), vote(KB, "x", TS)]
    assert seen(votes, {}, A)["title"] == "x"
    blocked = [vote(KA, "mine", TS), vote(KB, "x", TS)]
    assert seen(blocked, {A: Signer(blocked=True)}, A)["title"] == "x"


def test_a_weight_zero_viewer_sees_their_own_vote() -> None:
    """A weight-0 signer counts in no one's record, yet `?as=` shows it its own vote."""
    votes = [vote(KA, "mine", TS), vote(KB, "x", TS)]
    assert seen(votes, {A: Signer(weight=0)}, A)["title"] == "mine"
    assert merge_record(votes, {A: Signer(weight=0)})["title"] == "x"


def test_viewer_votes_alone_give_the_same_view() -> None:
    """The node passes `seen_by` only the viewer's votes (and the cached record)."""
    votes = [vote(KA, "mine", TS), vote(KA, "1999", TS, key_name="year"), vote(KB, "x", TS)]
    own = [v for v in votes if v.uid == A]
    assert seen_by(merge_record(votes, {}), own, {}, A) == seen(votes, {}, A)


# -- merge_record --------------------------------------------------------------------------------


def test_merge_record_per_key_and_no_link_values() -> None:
    votes = [
        vote(KA, "The Matrix", TS),
        vote(KB, "The Matrix", TS, cid=SHA),
        vote(KC, "Matrix", TS),
        vote(KA, "1999", TS, key_name="year"),
        vote(KB, None, TS, key_name="year"),
        vote(KB, None, TS, key_name="gone"),
        vote(KA, "true", TS, key_name="cids/" + SHA),
        vote(KB, "true", TS, key_name="cids/" + DAGPB),
    ]
    record = merge_record(votes, {})
    assert record == {"title": "The Matrix", "year": "1999"}
    assert not any(k.startswith("cids/") for k in record)
    assert merge_record(votes, {C: Signer(weight=5)})["title"] == "Matrix"
    assert seen(votes, {}, C)["title"] == "Matrix"
    assert merge_record([], {}) == {}


MERGE_SIGNERS = [KA, KB, KC]
MERGE_KEYS = ["title", "year", "cids/" + SHA]


@st.composite
def vote_sets(draw: st.DrawFn) -> list[Claim]:
    specs = draw(
        st.lists(
            st.tuples(
                st.integers(min_value=0, max_value=2),  # signer
                st.sampled_from([MIDHASH_1, SHA]),
                st.sampled_from(MERGE_KEYS),
                st.sampled_from(["a", "b", "c", None]),
                st.integers(min_value=0, max_value=2),  # ts: small range, so ties happen
            ),
            max_size=10,
            unique_by=lambda s: (s[0], s[1], s[2]),  # the truth stores one row per (uid, cid, key)
        )
    )
    return [
        vote(MERGE_SIGNERS[s], value, TS + dt, cid=c, key_name=k) for s, c, k, value, dt in specs
    ]


signer_tables = st.fixed_dictionaries(
    {},
    optional={
        A: st.builds(Signer, weight=st.integers(1, 3), blocked=st.booleans()),
        B: st.builds(Signer, weight=st.integers(1, 3), blocked=st.booleans()),
        C: st.builds(Signer, weight=st.integers(1, 3), blocked=st.booleans()),
    },
)


@settings(max_examples=150, database=None)
@given(
    votes=vote_sets(),
    signers=signer_tables,
    viewer=st.sampled_from([None, A, B, D]),
    data=st.data(),
)
def test_merge_record_ignores_vote_order(
    votes: list[Claim], signers: dict[str, Signer], viewer: str | None, data: Any
) -> None:
    def view(these: list[Claim]) -> dict[str, str]:
        return merge_record(these, signers) if viewer is None else seen(these, signers, viewer)

    expected = view(votes)
    order = data.draw(st.permutations(votes))
    assert view(order) == expected
    assert view(list(reversed(votes))) == expected
    assert not any(k.startswith("cids/") for k in expected)
    # Every merged value is one that a live, unblocked vote carries for that key.
    for key, value in expected.items():
        assert any(
            v.key == key and v.value == value and not signers.get(v.uid, Signer()).blocked
            for v in votes
        )


# -- group_keys and document (SPEC §2.5 rule 5, §4) ----------------------------------------------


def test_group_keys_members_and_first_local_path() -> None:
    files = [
        LocalFile("/media/b/movie.mkv", MIDHASH_1, 734003200, 1_700_000_000_000_000_001),
        LocalFile("/media/a/movie.mkv", MIDHASH_2, 734003201, 1_700_000_000_000_000_002),
        LocalFile("/media/0/other.mkv", OUTSIDE, 5, 6),  # first path, but not in the group
    ]
    keys = group_keys(GROUP_CIDS, files)
    assert keys == {
        "cids/" + MIDHASH_1: "true",
        "cids/" + SHA: "true",
        "cids/" + MIDHASH_2: "true",
        "filePath": "/media/a/movie.mkv",
        "fileSize": "734003201",
        "mtimeNano": "1700000000000000002",
    }
    assert group_keys(GROUP_CIDS, list(reversed(files))) == keys


def test_group_keys_without_a_local_file() -> None:
    keys = group_keys([SHA, DAGPB], [LocalFile("/x", MIDHASH_1, 1, 2)])
    assert keys == {"cids/" + SHA: "true", "cids/" + DAGPB: "true"}
    assert group_keys([SHA], []) == {"cids/" + SHA: "true"}
    assert group_keys([], []) == {}


def test_group_keys_path_order_is_lexicographic() -> None:
    files = [
        LocalFile("/m/b", MIDHASH_1, 1, 1),
        LocalFile("/m/B", MIDHASH_1, 2, 2),
        LocalFile("/m/a/z", MIDHASH_1, 3, 3),
    ]
    assert group_keys([MIDHASH_1], files)["filePath"] == "/m/B"  # 'B' < 'a' < 'b'


def test_document_ranks_cids_and_elects_the_canonical() -> None:
    record = {"title": "The Matrix", "filePath": "/media/a.mkv", "fileSize": "3"}
    body = document(
        MIDHASH_2, [MIDHASH_2, SHA, MIDHASH_1, DAGPB], record, ["/media/b.mkv", "/media/a.mkv"]
    )
    assert body["cid"] == MIDHASH_2
    assert body["canonical_cid"] == DAGPB
    assert body["cids"] == [DAGPB, SHA, MIDHASH_1, MIDHASH_2]
    assert body["filePath"] == "/media/a.mkv"
    assert body["paths"] == ["/media/a.mkv", "/media/b.mkv"]
    assert body["metadata"] == record
    assert list(body["metadata"]) == sorted(record)  # type: ignore[call-overload]


def test_document_without_file_or_cids() -> None:
    body = document(SHA, [], {"title": "x"}, [])
    assert body["canonical_cid"] is None
    assert body["cids"] == []
    assert "filePath" not in body
    assert body["paths"] == []
