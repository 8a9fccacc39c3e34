"""JSON lines (metanode/jsonl.py) and the commands that read and write them: a claim value holding
any character comes back through export → import, `claim verify` and `claim post`; `import`
streams, verifies everything before it writes anything and names each failing line."""

from __future__ import annotations

import io
import json
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metanode import cache, db, jsonl
from metanode import cid as cids
from metanode.cli import main
from metanode.errors import InvalidJson
from tests.helpers.claims import Signer
from tests.helpers.server import Server

# Every character str.splitlines ends a line at, which JSON lines must not.
LINE_BREAKERS = [
    "\u2028",
    "\u2029",
    "\x85",
    "\x1c",
    "\x1d",
    "\x1e",
    "\x0b",
    "\x0c",
    "\r",
    "\n",
    "\r\n",
]
MIXED = "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg\x0bh\x0ci\rj\nk\r\nl"
values = st.text()


def with_breakers(test: Any) -> Any:
    """`@example`s of a value made of (or holding) each line breaker, and all of them mixed."""
    for breaker in LINE_BREAKERS:
        test = example(value=breaker)(example(value=f"x{breaker}y")(test))
    return example(value=MIXED)(test)


def run(*args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, result.output
    return result


def raw_line(wire: dict[str, Any]) -> bytes:
    """A claim as another writer (and metanode before jsonl.dumps) writes it: UTF-8, nothing
    escaped that JSON does not require, so U+2028 and friends are raw in the line."""
    return json.dumps(wire, ensure_ascii=False).encode("utf-8") + b"\n"


# -- the reader and writer, pure ------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def read_all(data: bytes) -> list[tuple[int, object]]:
    return list(jsonl.read(io.BytesIO(data)))


@given(st.lists(json_values.filter(lambda v: not isinstance(v, list)), max_size=8))
@settings(max_examples=200, database=None)
def test_what_the_writer_writes_the_reader_reads(items: list[object]) -> None:
    data = b"".join(jsonl.encode(item) for item in items)
    assert [value for _, value in read_all(data)] == items
    assert len(data.decode("utf-8").splitlines()) == len(items)  # safe for naive readers too


@given(values)
@with_breakers
@settings(max_examples=200, database=None)
def test_a_raw_line_breaker_inside_a_string_does_not_end_the_line(value: str) -> None:
    line = raw_line({"value": value})
    assert read_all(line + line.rstrip(b"\n") + b"\r\n") == [
        (1, {"value": value}),
        (2, {"value": value}),
    ]


def test_blank_lines_are_skipped_and_positions_are_line_numbers() -> None:
    assert read_all(b'\n{"a": 1}\n \t\r\n{"b": 2}') == [(2, {"a": 1}), (4, {"b": 2})]


def test_an_array_is_one_json_text_numbered_by_element() -> None:
    assert read_all(b'\n [{"a": 1},\n {"b": 2}]\n') == [(1, {"a": 1}), (2, {"b": 2})]
    # Only the first value may open an array; later, a line holding one is just that value.
    assert read_all(b'{"a": 1}\n[{"b": 2}]\n') == [(1, {"a": 1}), (2, [{"b": 2}])]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"a": 1}\n{"a": \n', "line 2 is not JSON"),
        (b'{"a": 1}\n\n{"a": "\xff"}\n', "line 3 is not UTF-8"),
        (b"[1, 2", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "is not JSON the node reads: it nests too deep"),
    ],
)
def test_bad_input_names_where(data: bytes, message: str) -> None:
    with pytest.raises(InvalidJson, match=message):
        read_all(data)


# -- sign → export → import ------------------------------------------------------------------------


SIGNER = Signer()


def import_file(data_dir: Path, source: Path, *extra: str) -> Result:
    """`import` into the node at `data_dir`, made first if there is none (import refuses)."""
    if not (data_dir / "truth.db").exists():
        ok(run("init", "--data-dir", str(data_dir)))
    return run("import", str(source), "--data-dir", str(data_dir), *extra)


def export_bytes(data_dir: Path, out: Path) -> bytes:
    ok(run("export", "--out", str(out), "--data-dir", str(data_dir)))
    return out.read_bytes()


def documents(data_dir: Path) -> dict[str, dict[str, Any]]:
    """Every CID's document as GET /api/meta/{cid} gives it (no viewer), read from cache.db."""
    conn = db.connect(data_dir / "cache.db", readonly=True)
    try:
        every = [row[0] for row in conn.execute("SELECT cid FROM cid_index ORDER BY cid")]
        found = {c: cache.group_by_cid(conn, c) for c in every}
        return {c: cache.document(group, c) for c, group in found.items() if group is not None}
    finally:
        conn.close()


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A directory for the property tests' examples (function-scoped fixtures and @given do not
    mix): each example makes its own data directories below it."""
    with tempfile.TemporaryDirectory(prefix="metanode-jsonl-") as path:
        yield Path(path)


@given(value=values)
@with_breakers
@settings(max_examples=25, deadline=None, database=None)
def test_any_value_survives_export_then_import(scratch: Path, value: str) -> None:
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        here, there, source = Path(tmp) / "here", Path(tmp) / "there", Path(tmp) / "in.jsonl"
        cid = cids.midhash_bytes(value.encode("utf-8"))
        source.write_bytes(
            raw_line(SIGNER.claim(cid, "title", value))
            + raw_line(SIGNER.claim(cid, "note", f"[{value}]"))
        )
        ok(import_file(here, source, "--register-signers"))
        exported = export_bytes(here, Path(tmp) / "here.jsonl")
        ok(import_file(there, Path(tmp) / "here.jsonl", "--register-signers"))
        assert export_bytes(there, Path(tmp) / "there.jsonl") == exported
        ours = documents(here)
        assert ours[cid]["metadata"]["title"] == value
        assert documents(there) == ours


@given(value=values)
@with_breakers
@settings(max_examples=100, deadline=None, database=None)
def test_claim_verify_reads_every_line(value: str) -> None:
    cid = cids.midhash_bytes(b"verify")
    claim = SIGNER.claim(cid, "title", value)
    both = raw_line(claim) + jsonl.encode(claim)  # raw, and as metanode writes it
    result = ok(run("claim", "verify", stdin=both))
    assert result.stdout.split("\n") == ["ok", "ok", ""]


@pytest.fixture(scope="module")
def live(scratch: Path) -> Iterator[Server]:
    """One real server for the module, with SIGNER registered (may link)."""
    server = Server(scratch / "live" / "data")
    server.data_dir.parent.mkdir()
    server.start()
    try:
        ok(
            run(
                "signers",
                "add",
                SIGNER.uid,
                "--name",
                "t",
                "--may-link",
                "--data-dir",
                str(server.data_dir),
            )
        )
        yield server
    finally:
        server.stop()
        server.print_log()


@given(value=values)
@with_breakers
@settings(max_examples=25, deadline=None, database=None)
def test_claim_post_on_stdin_stores_any_value(live: Server, value: str) -> None:
    cid = cids.midhash_bytes(b"post " + value.encode("utf-8"))
    lines = raw_line(SIGNER.claim(cid, "title", value)) + raw_line(
        SIGNER.claim(cid, "note", value + "!")
    )
    result = ok(run("claim", "post", "--url", live.url, "--token", live.token, stdin=lines))
    answer = json.loads(result.stdout)
    assert answer["accepted"] == 2 or answer["duplicate"] == 2
    document = live.meta(cid)
    assert document is not None
    assert (document["metadata"]["title"], document["metadata"]["note"]) == (value, value + "!")


@pytest.mark.parametrize("stdin", [b"", b"\n \r\n"])
def test_claim_post_with_nothing_to_post_is_an_error(stdin: bytes) -> None:
    result = run("claim", "post", "--url", "http://127.0.0.1:9", "--token", "t", stdin=stdin)
    assert result.exit_code == 2
    assert "error: invalid_request: no claims to post" in result.stderr


def test_claim_post_names_an_argument_that_is_not_json() -> None:
    result = run("claim", "post", "--url", "http://127.0.0.1:9", "--token", "t", "{}", "{")
    assert result.exit_code == 2
    assert "error: invalid_json: argument 2 is not JSON" in result.stderr


def test_claim_verify_names_input_nested_too_deep_instead_of_a_traceback() -> None:
    result = run("claim", "verify", stdin=b"[" * 100_000 + b"]" * 100_000)
    assert result.exit_code == 2, result.output
    assert "error: invalid_json: the input (a JSON array) is not JSON the node reads: it nests" in (
        result.stderr
    )


# -- import: all or nothing, streamed ------------------------------------------------------------


def claim_count(data_dir: Path) -> int:
    conn = sqlite3.connect(f"{(data_dir / 'truth.db').as_uri()}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM claims").fetchone()[0])
    finally:
        conn.close()


def failures(result: Result) -> list[str]:
    """The `  claim N: slug: message` lines (`claims N, M…` of one reason) of a failed import,
    without their indent."""
    return [line.strip() for line in result.stderr.splitlines() if line.startswith("  claim")]


def claim_lines(n: int, tag: str) -> list[bytes]:
    return [
        raw_line(SIGNER.claim(cids.midhash_bytes(f"{tag}{i}".encode()), "title", f"{i}"))
        for i in range(n)
    ]


def test_one_bad_claim_in_the_middle_writes_nothing_and_names_its_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ok(run("init", "--data-dir", str(data)))
    ok(run("signers", "add", SIGNER.uid, "--name", "t", "--data-dir", str(data)))
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(claim_lines(3, "before")))
    ok(import_file(data, source))
    before = export_bytes(data, tmp_path / "before.jsonl")
    good = claim_lines(2000, "good")  # two chunks of verification either side of the bad one
    bad = json.loads(good[1200])
    bad["value"] = "tampered"
    lines = [*good[:1200], b"\n", raw_line(bad), *good[1200:]]
    source.write_bytes(b"".join(lines))
    result = import_file(data, source)
    assert result.exit_code == 2
    assert [line.split(": ")[:2] for line in failures(result)] == [["claim 1202", "bad_signature"]]
    assert "error: invalid_batch: 1 claim(s) rejected; nothing was written" in result.stderr
    assert claim_count(data) == 3
    assert export_bytes(data, tmp_path / "after.jsonl") == before


def test_a_signer_the_node_refuses_fails_the_import_before_anything_is_written(
    tmp_path: Path,
) -> None:
    source = tmp_path / "in.jsonl"
    stranger = Signer()
    cid = cids.midhash_bytes(b"s")
    source.write_bytes(
        b"".join(claim_lines(2, "known")) + raw_line(stranger.claim(cid, "title", "x"))
    )
    data = tmp_path / "data"
    ok(run("init", "--data-dir", str(data)))
    ok(run("signers", "add", SIGNER.uid, "--name", "t", "--data-dir", str(data)))
    result = import_file(data, source)
    assert result.exit_code == 2
    assert failures(result) == [
        f"claim 3: unknown_signer: signer {stranger.uid} is not registered (POST /api/signers or "
        "`metanode signers add` registers it)"
    ]
    assert claim_count(data) == 0


def test_many_failures_are_listed_up_to_a_cap_and_counted(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(
        b"".join(line.replace(b'"title"', b'"titel"') for line in claim_lines(150, "bad"))
    )
    result = import_file(tmp_path / "data", source, "--register-signers")
    assert result.exit_code == 2
    [listed] = failures(result)  # a hundred of one reason: one line
    assert listed.startswith("claims 1, 2, 3, 4, 5, 6, 7, 8, … (100): bad_signature: ")
    assert "  … and 50 more" in result.stderr
    assert result.stderr.startswith("error: invalid_batch: 150 claim(s) rejected")
    assert claim_count(tmp_path / "data") == 0


def test_import_reads_standard_input(tmp_path: Path) -> None:
    lines = b"".join(claim_lines(1500, "stdin")) + raw_line(
        SIGNER.claim(cids.midhash_bytes(b"odd"), "title", MIXED)
    )
    ok(run("init", "--data-dir", str(tmp_path / "data")))
    result = ok(
        run("import", "-", "--register-signers", "--data-dir", str(tmp_path / "data"), stdin=lines)
    )
    assert "imported 1501 claims: 1501 accepted" in result.stdout
    assert claim_count(tmp_path / "data") == 1501
    again = ok(run("import", "-", "--data-dir", str(tmp_path / "data"), stdin=lines))
    assert "1501 duplicate" in again.stdout


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_the_infinities_are_refused_in_files_and_stdin_too(constant: str) -> None:
    """`import` and `claims post` read through the same decoder as the bodies."""
    with pytest.raises(InvalidJson, match=f"line 1 is not JSON: {constant} is not a JSON number"):
        list(jsonl.read(io.BytesIO(f'{{"ts": {constant}}}\n'.encode())))
