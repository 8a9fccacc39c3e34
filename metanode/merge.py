"""The merge rules: which stored claim wins (SPEC §2.3) and the merged record (SPEC §2.5).

Pure and deterministic: every function here gives the same answer for any order of its inputs,
which is what lets every node that holds the same claims converge on the same records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from metanode import cid as cids
from metanode.claims import LINK_PREFIX, LOCAL_KEYS, Claim

Verdict = Literal["accepted", "duplicate", "stale"]
DEFAULT_WEIGHT = 1
MAX_WEIGHT = 1_000_000  # a signer's weight: an integer from 0 to this (schemas/signer*.json)


def resolve(stored: Claim | None, incoming: Claim) -> Verdict:
    """What an incoming claim does against the stored one for the same (uid, cid, key).

    Newer ts wins; at equal ts identical content is a duplicate, and different content (the signer
    equivocated) goes to the lexicographically smaller raw signature, so every node keeps the same
    claim whatever order the two arrive in.
    """
    if stored is None or incoming.ts > stored.ts:
        return "accepted"
    if incoming.ts < stored.ts:
        return "stale"
    if incoming.value == stored.value and incoming.sig == stored.sig:
        return "duplicate"
    return "accepted" if incoming.sig < stored.sig else "stale"


def _newest(a: Claim, b: Claim) -> Claim:
    """The vote that counts when one signer voted on a key through several CIDs of a group:
    the newer, then the smaller signature (SPEC §2.5 rule 2). Two verified votes on two CIDs
    never share a signature (Ed25519 signs the CID), but stored rows are not re-verified and
    a test's claims carry made-up ones: then the smaller CID decides, so the merge never
    depends on the order the votes are read in."""
    if a.ts != b.ts:
        return a if a.ts > b.ts else b
    return min(a, b, key=lambda vote: (vote.sig, vote.cid))


@dataclass(frozen=True, slots=True)
class Signer:
    """What the merge needs to know about a signer."""

    weight: int = DEFAULT_WEIGHT
    blocked: bool = False


def counted_votes(votes: Iterable[Claim], signers: Mapping[str, Signer]) -> dict[str, Claim]:
    """Rules 1 and 2 of `merge_key`: uid → the one vote of that signer that counts on a key
    (the provenance the web page shows is these votes, by value)."""
    per_signer: dict[str, Claim] = {}
    for vote in votes:
        signer = signers.get(vote.uid, Signer())
        if vote.value is None or signer.blocked or signer.weight <= 0:
            continue
        held = per_signer.get(vote.uid)
        per_signer[vote.uid] = vote if held is None else _newest(held, vote)
    return per_signer


def merge_key(votes: Iterable[Claim], signers: Mapping[str, Signer]) -> str | None:
    """The merged value of one key from every claim on it across a group's CIDs (None: no value).

    1. live votes only: non-null values from signers that are not blocked and weigh above 0
       (a weight-0 signer's claims are stored and listed, never counted);
    2. one signer counts once: its newest vote;
    3. a value scores the sum of its voters' weights; highest wins, then the value whose newest
       vote is newest, then the smaller string.

    (Rule 4 of SPEC §2.5, a viewer's own vote, is `seen_by`.)
    """
    per_signer = counted_votes(votes, signers)
    if not per_signer:
        return None
    score: dict[str, int] = {}
    newest: dict[str, int] = {}
    for vote in per_signer.values():
        value = vote.value
        assert value is not None
        score[value] = score.get(value, 0) + signers.get(vote.uid, Signer()).weight
        newest[value] = max(newest.get(value, vote.ts), vote.ts)
    return min(score, key=lambda value: (-score[value], -newest[value], value))


def merge_record(votes: Iterable[Claim], signers: Mapping[str, Signer]) -> dict[str, str]:
    """The merged claims of a record: `merge_key` for every key, link votes left out.

    `cids/…` votes link groups; membership is synthesised from the group itself (`group_keys`).
    """
    by_key: dict[str, list[Claim]] = {}
    for vote in votes:
        if not vote.is_link:
            by_key.setdefault(vote.key, []).append(vote)
    merged = {key: merge_key(kv, signers) for key, kv in by_key.items()}
    return {key: value for key, value in merged.items() if value is not None}


def seen_by(
    record: Mapping[str, str], votes: Iterable[Claim], signers: Mapping[str, Signer], viewer: str
) -> dict[str, str]:
    """The merged `record` as `viewer` sees it with `?as=<uid>` (SPEC §2.5 rule 4): a key on
    which the viewer has a live vote takes that vote's value (their newest, as rule 2 picks it;
    none if they are blocked). `votes` may be the group's or only the viewer's: the node reads
    just the viewer's, and the merged record comes from the cache. The viewer's weight does not
    matter here: a weight-0 signer asking for its own view sees its own votes."""
    own = merge_record(
        [vote for vote in votes if vote.uid == viewer],
        {viewer: Signer(weight=1, blocked=signers.get(viewer, Signer()).blocked)},
    )
    return {**record, **own}


@dataclass(frozen=True, slots=True)
class LocalFile:
    """A box-local fact from the watcher: a path holding content with this midhash.

    `ino` is the inode the watcher read the content from (0: not recorded, a row from before
    inodes were kept): serving the bytes checks the file opened is still that one. `ctime_ns`
    is that inode's change time when it was read (0: not recorded, a row from before change
    times were kept): a write moves it, even one that puts the size and mtime back.
    """

    path: str
    midhash: str
    size: int
    mtime_ns: int
    ino: int = 0
    ctime_ns: int = 0


def group_keys(group_cids: Iterable[str], files: Iterable[LocalFile]) -> dict[str, str]:
    """The synthesised, unsigned keys of a record (SPEC §2.5 step 5).

    `cids/<cid>` = "true" for every CID of the group; `filePath`, `fileSize` and `mtimeNano` from
    the lexicographically first local path whose midhash is in the group.
    """
    members = set(group_cids)
    keys = {f"{LINK_PREFIX}{member}": "true" for member in members}
    local = [f for f in files if f.midhash in members]
    if local:
        first = min(local, key=lambda f: f.path)
        keys.update(
            zip(LOCAL_KEYS, (first.path, str(first.size), str(first.mtime_ns)), strict=True)
        )
    return keys


def is_group_key(key: str) -> bool:
    """Whether `group_keys` computes `key` (from the group's members and local files), rather
    than the claims."""
    return key.startswith(LINK_PREFIX) or key in LOCAL_KEYS


def document(
    asked: str, group_cids: Iterable[str], record: Mapping[str, str], paths: Iterable[str]
) -> dict[str, object]:
    """The `GET /api/meta/{cid}` body: the MetaMesh envelope, rid-free (SPEC §4)."""
    ranked = cids.by_rank(group_cids)
    body: dict[str, object] = {
        "cid": asked,
        "canonical_cid": ranked[0] if ranked else None,
        "cids": ranked,
    }
    if "filePath" in record:
        body["filePath"] = record["filePath"]
    body["paths"] = sorted(paths)
    body["metadata"] = dict(sorted(record.items()))
    return body
