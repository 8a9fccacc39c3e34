"""The cache's pure decisions (metanode/plan.py): property tests, no database."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from metanode.merge import LocalFile
from metanode.plan import Event, FileEvent, Touched, diff, file_events, resolve, touched
from metanode.view import Change

KEYS = st.sampled_from(["title", "year", "genre", "cids/x", "filePath"])
VALUES = st.sampled_from(["a", "b", "c"])
ROWS = st.dictionaries(KEYS, VALUES, max_size=5)


def applied(old: dict[str, str], events: list[Event]) -> dict[str, str]:
    """`old` with the events played on it, as a subscriber's replica does."""
    rows = dict(old)
    for event in events:
        if event.op == "set":
            assert event.value is not None
            rows[event.key] = event.value
        else:
            assert event.key in rows, "a del of a key the record does not have"
            del rows[event.key]
    return rows


@given(old=ROWS, new=ROWS)
def test_diff_events_turn_the_old_rows_into_the_new(
    old: dict[str, str], new: dict[str, str]
) -> None:
    events = diff("r", old, new, set(old) | set(new))
    assert applied(old, events) == new
    assert [e.key for e in events] == sorted({e.key for e in events}), "one per key, in order"
    assert all(old.get(e.key) != new.get(e.key) for e in events), "only changed keys"


@given(old=ROWS, new=ROWS, keys=st.sets(KEYS))
def test_diff_touches_only_the_keys_asked(
    old: dict[str, str], new: dict[str, str], keys: set[str]
) -> None:
    after = applied(old, diff("r", old, new, keys))
    assert {k: v for k, v in after.items() if k not in keys} == {
        k: v for k, v in old.items() if k not in keys
    }
    assert {k: after[k] for k in keys if k in after} == {k: new[k] for k in keys if k in new}


PATHS = st.sampled_from(["/m/a.mkv", "/m/x/a.mkv", "/m/b.mkv", "/m/y/b.mkv", "/m/c.mkv"])
MIDHASHES = st.sampled_from(["M1", "M2", "M3"])
REMOVED = st.dictionaries(
    PATHS, st.tuples(MIDHASHES, st.integers(0, 9), st.integers(0, 9)), max_size=4
)
WRITTEN = st.dictionaries(PATHS, st.tuples(MIDHASHES, st.integers(0, 9), st.booleans()), max_size=4)


@given(removed=REMOVED, written=WRITTEN)
def test_file_events_pair_each_removed_path_at_most_once(
    removed: dict[str, tuple[str, int, int]], written: dict[str, tuple[str, int, bool]]
) -> None:
    files = [
        (LocalFile(path, midhash, size, 0, 1), new)
        for path, (midhash, size, new) in sorted(written.items())
    ]
    events = file_events(removed, files)
    renames = [e for e in events if e.op == "rename"]
    deletes = [e for e in events if e.op == "delete"]
    sources = [e.old_path for e in renames] + [e.path for e in deletes]
    assert sorted(p for p in sources if p is not None) == sorted(removed), (
        "every removed path is deleted or renamed away, exactly once"
    )
    assert [e.path for e in events if e.op != "delete"] == [f.path for f, _ in files], (
        "one event per written file, in order"
    )
    for event in renames:
        assert event.old_path is not None and removed[event.old_path][0] == event.midhash
    for (file, is_new), event in zip(files, [e for e in events if e.op != "delete"], strict=True):
        if event.op != "rename":
            assert event == FileEvent(
                "add" if is_new else "change", file.path, None, file.size, file.midhash
            )
            assert all(
                row[0] != file.midhash or path in {e.old_path for e in renames}
                for path, row in removed.items()
            ), "an unpaired write had no free removed path of its content"


CHANGES = st.lists(
    st.builds(
        Change,
        seq=st.integers(1, 99),
        kind=st.sampled_from(["claim", "group", "merge", "signer"]),
        rid=st.sampled_from(["R1", "R2", "R3"]),
        cid=st.sampled_from(["C1", "C2"]),
        key=KEYS,
        uid=st.sampled_from(["U1"]),
        survivor=st.sampled_from(["R1", "R2"]),
    ),
    max_size=8,
)


@given(changes=CHANGES)
def test_a_plan_scopes_every_touched_record_and_never_merges_a_link(changes: list[Change]) -> None:
    work = touched(changes)
    groups = {"C1": "R1", "C2": "R2"}
    survivors = {rid: "R1" for rid in work.regrouped + work.survived}
    plan = resolve(work, work.claimed, groups, survivors)
    assert plan.losers == [c.rid for c in changes if c.kind == "merge"]
    for change in changes:
        if change.kind == "claim" and not (change.key or "").startswith("cids/"):
            assert change.key in plan.scopes[groups[change.cid or ""]].keys
        if change.kind in ("group", "merge"):
            assert plan.scopes["R1"].regroups
    assert all(not key.startswith("cids/") for scope in plan.scopes.values() for key in scope.keys)
    assert work.signers == [c.uid for c in changes if c.kind == "signer"]


def test_touched_sorts_by_kind() -> None:
    changes = [
        Change(1, "claim", None, "C1", "title", "U1", None),
        Change(2, "group", "R2", "C2", None, None, None),
        Change(3, "merge", "R3", None, None, None, "R1"),
        Change(4, "signer", None, None, None, "U1", None),
    ]
    assert touched(changes) == Touched(
        claimed=[("C1", "title")], regrouped=["R2"], losers=["R3"], survived=["R1"], signers=["U1"]
    )
