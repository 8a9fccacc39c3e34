"""The examples of README.md, docs/api.md and docs/protocol.md, as written.

A reader copies them: the README tour's shell steps and docs/api.md's curl line are run by bash,
unchanged but for the node's port, against a real `metanode serve` (with its plugins) in a
folder laid out as the tour's checkout (`./data`, `./media`, a `$HOME` of its own), and what
they print must be the output the text shows; the JSON examples must be what the schemas
allow, and the member names shown in an example with placeholders exactly those of the body
it stands for. So a change of the CLI, an answer or a schema that leaves the text behind
fails here rather than in a reader's terminal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metanode import claims as wire
from tests.helpers.contract import SCHEMAS, check, file_schema
from tests.helpers.server import Server
from tests.helpers.vectors import load_vectors
from tests.helpers.wait import poll
from tools import openapi_sync

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
DOCUMENTED_ADDRESS = "127.0.0.1:9000"  # the default address the examples name
RUN_S = 120.0  # a bound on a hang of one step, not a measurement


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of `text` in `language` (`""`: those that name none)."""
    found, block, opened = [], [], None
    for line in text.splitlines(keepends=True):
        if opened is None and line.startswith("```"):
            opened, block = line[3:].strip(), []
        elif opened is not None and line.rstrip() == "```":
            if opened == language:
                found.append("".join(block))
            opened = None
        elif opened is not None:
            block.append(line)
    return found


def block_with(text: str, language: str, needle: str) -> str:
    """The one `language` block of `text` that holds `needle`."""
    found = [block for block in blocks(text, language) if needle in block]
    assert len(found) == 1, f"{len(found)} {language} blocks hold {needle!r}"
    return found[0]


def shown_json(block: str) -> list[Any]:
    """The output a shell block shows: its comment lines that are a JSON value (`# {…}`)."""
    shown = []
    for line in block.splitlines():
        comment = line.strip().removeprefix("# ")
        if line.strip().startswith("# {"):
            shown.append(json.loads(comment))
    return shown


def members(example: str) -> set[str]:
    """The member names of the outermost object of an example with placeholders (`…`,
    `// comments`), which is not JSON: the names at nesting depth one."""
    names, depth = set(), 0
    for token in re.finditer(r'"((?:[^"\\]|\\.)*)"\s*(:)?|[{}\[\]]', example):
        if token.group(0) in "{[":
            depth += 1
        elif token.group(0) in "}]":
            depth -= 1
        elif token.group(2) and depth == 1:
            names.add(token.group(1))
    return names


def schema_members(name: str) -> tuple[set[str], set[str]]:
    """(required, all) member names of a schema file's top-level object (through its own
    `$ref` to one of its `$defs`, as document.schema.json's)."""
    schema = openapi_sync.load(SCHEMAS / name)
    if schema.get("$ref", "").startswith("#/$defs/"):
        schema = schema["$defs"][schema["$ref"].removeprefix("#/$defs/")]
    return set(schema.get("required", ())), set(schema["properties"])


# -- the JSON examples ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("needle", "schema"),
    [
        ('"error": "invalid_batch"', "error.schema.json"),
        ('"results": [', "claims-response.schema.json"),
    ],
)
def test_every_json_example_of_the_api_validates(needle: str, schema: str) -> None:
    check(file_schema(schema), json.loads(block_with(API, "json", needle)))


def test_the_api_examples_are_each_checked() -> None:
    """A new ```json example in docs/api.md gets its row above."""
    assert len(blocks(API, "json")) == 2


@pytest.mark.parametrize(
    ("text", "language", "needle", "schema"),
    [
        (API, "jsonc", '"canonical_cid"', "document.schema.json"),
        (PROTOCOL, "json", '"sig"', "claim.schema.json"),
        (PROTOCOL, "json", '"<slug>"', "error.schema.json"),
    ],
    ids=["document", "claim", "error"],
)
def test_an_example_with_placeholders_names_the_members_of_its_body(
    text: str, language: str, needle: str, schema: str
) -> None:
    required, allowed = schema_members(schema)
    shown = members(block_with(text, language, needle))
    assert required <= shown <= allowed, (sorted(shown), sorted(required), sorted(allowed))


def test_the_feed_example_frames_are_feed_events() -> None:
    """docs/api.md's `GET /api/events` frames, parsed as an SSE client does."""
    example = block_with(API, "", "event: set")
    frames = [frame for frame in example.strip().split("\n\n") if frame]
    assert len(frames) == 2
    for frame in frames:
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        event = {"event": fields["event"], "id": fields["id"], "data": json.loads(fields["data"])}
        check(file_schema("events.schema.json"), event)


def test_the_signed_bytes_example_is_the_first_vectors() -> None:
    """docs/protocol.md shows exactly what the first claim of tests/vectors/claims.json signs."""
    example = next(b for b in blocks(PROTOCOL, "") if b.startswith('["metanode-claim/1"'))
    claim = load_vectors("claims.json")["vectors"][0]["claim"]
    signed = wire.signing_bytes(
        claim["uid"], claim["cid"], claim["key"], claim["value"], claim["ts"]
    )
    assert example.strip().encode("utf-8") == signed


# -- the shell steps, run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Server]]:
    """The tour's folder (`./data`, `./media`, a `$HOME`) and `make serve`'s node in it, its
    plugins on."""
    folder = tmp_path_factory.mktemp("checkout")
    (folder / "home").mkdir()
    server = Server(folder / "data", env={"METANODE_PLUGINS_ENABLED": "true"}).start()
    try:
        yield folder, server
    finally:
        server.stop()


def run(step: str, folder: Path, server: Server, **env: str) -> list[str]:
    """Run a shell step as written (its `. .venv/bin/activate` done by PATH, the node's address
    its port) in bash, stopping at the first failing command; its output lines. No
    METANODE_PORT: as in the tour's terminals, the client commands find the node, on a port
    other than the default, through `./data` (where it recorded its address)."""
    script = step.replace(". .venv/bin/activate\n", "").replace(DOCUMENTED_ADDRESS, server.url[7:])
    environment = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    environment |= {
        "HOME": str(folder / "home"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{environment['PATH']}",
        **env,
    }
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert done.returncode == 0, f"{script}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    assert done.stderr == "", done.stderr  # nothing a reader would not expect
    return done.stdout.splitlines()


def test_the_readme_tour_and_the_api_curl_example_print_what_they_show(
    checkout: tuple[Path, Server],
) -> None:
    folder, server = checkout
    drop = block_with(README, "sh", "head -c 3000000 /dev/urandom")
    printed = run(drop, folder, server)
    record = json.loads(printed[-1])  # `metanode get $CID --wait 30`
    cid = record["cid"]
    assert record["paths"] == [str((folder / "media").resolve() / Path(record["filePath"]).name)]

    claim = block_with(README, "sh", "metanode keygen")
    printed = run(claim, folder, server, CID=cid)
    assert [json.loads(line) for line in printed if line.startswith('{"results"')] == shown_json(
        claim
    )
    value = re.search(r'--value "([^"]+)"', claim)
    assert value is not None
    assert json.loads(printed[-1])["metadata"]["title"] == value.group(1)  # weight 2 wins

    curl = block_with(API, "sh", "curl -s")
    printed = run(curl, folder, server, CID=cid)
    assert [json.loads(line) for line in printed] == shown_json(curl)


def test_the_readme_library_step_reads_what_it_shows(checkout: tuple[Path, Server]) -> None:
    """The TV episode and the film made with ffmpeg: once the plugins are done with them, their
    records hold every key and value the tour shows (`…` standing for the rest)."""
    if shutil.which("ffmpeg") is None or shutil.which("ffprobe") is None:
        pytest.skip("Debian's ffmpeg is not installed (apt-get install ffmpeg)")
    folder, server = checkout
    step = block_with(README, "sh", "ffmpeg -v error")
    run(step, folder, server)
    expected = shown_metadata(step)
    assert len(expected) == 2
    for path, shown in zip(("Breaking Bad/Season 01", "Inception (2010)"), expected, strict=True):
        (movie,) = (folder / "media" / path).glob("*.mkv")
        record = poll(lambda m=movie: settled(server, m), f"the plugins' keys of {movie.name}")
        assert {key: record.get(key) for key in shown} == shown


def shown_metadata(step: str) -> list[dict[str, str]]:
    """The `"metadata": {…}` each `metanode get` of a step is shown to print: the comment lines
    after it, the trailing `…` (the keys not shown) taken off."""
    shown: list[dict[str, str]] = []
    for part in re.split(r"^metanode get .*$", step, flags=re.M)[1:]:
        lines = [line.removeprefix("# ") for line in part.splitlines() if line.startswith("# ")]
        text = " ".join(lines).removeprefix('"metadata": ').rstrip(" …").rstrip(",")
        shown.append(json.loads(text + "}"))
    return shown


def settled(server: Server, movie: Path) -> dict[str, str] | None:
    """The record of `movie` once no plugin run is pending, else None."""
    plugins = httpx.get(f"{server.url}/api/plugins", headers=server.headers, timeout=10).json()
    if any(plugin["runs"]["pending"] for plugin in plugins["plugins"]):
        return None
    listed = httpx.get(
        f"{server.url}/api/files", params={"prefix": str(movie.resolve())}, headers=server.headers
    ).json()["files"]
    if not listed:
        return None
    record = server.meta(listed[0]["midhash"])
    return None if record is None else dict(record["metadata"])
