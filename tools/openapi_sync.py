"""Keep schemas/openapi.json in step with the JSON Schemas beside it, and its packaged copy.

    python tools/openapi_sync.py           # rewrite what is out of date
    python tools/openapi_sync.py --check   # exit 1 (and say what) if anything is out of date

`schemas/*.schema.json` are the canonical JSON Schemas (draft 2020-12), each with an `$id` and
relative `$ref`s to its siblings. `schemas/openapi.json` is edited by hand except for
`components.schemas`, which this tool fills: one component per schema file, named by its
`title`, with `$id`/`$schema` dropped and every `$ref` rewritten to point inside the document
(`claim.schema.json` → `#/components/schemas/Claim`; `#/$defs/x` in error.schema.json →
`#/components/schemas/Error/$defs/x`), so the document is self-contained and tools (schemathesis)
never fetch anything.

The server answers `GET /openapi.json` with `metanode/openapi.json`, package data shipped in the
wheel and the container; it is a byte copy of `schemas/openapi.json`, written here too. The tests
run `--check`'s comparison, so a change to either side that is not synced fails them.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"
PACKAGED = ROOT / "metanode" / "openapi.json"
COMPONENTS = "#/components/schemas/"
_TITLE = re.compile(r"[A-Z][A-Za-z0-9]*")


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def dump(document: Any) -> str:
    """The one spelling of every JSON file this tool writes."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def schema_files(directory: Path = SCHEMAS) -> dict[str, Any]:
    """Every `*.schema.json` of `directory`, by file name."""
    return {path.name: load(path) for path in sorted(directory.glob("*.schema.json"))}


def component_names(schemas: dict[str, Any]) -> dict[str, str]:
    """File name → component name (the schema's `title`, which must be a unique identifier)."""
    names: dict[str, str] = {}
    for file, schema in schemas.items():
        title = schema.get("title")
        if not isinstance(title, str) or not _TITLE.fullmatch(title):
            raise ValueError(f"{file}: its title {title!r} must be a CamelCase identifier")
        if title in names.values():
            raise ValueError(f"{file}: title {title!r} is used twice")
        names[file] = title
    return names


def _rewrite(node: Any, own: str, names: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                target, _, pointer = value.partition("#")
                if target and target not in names:
                    raise ValueError(f"{own}: $ref {value!r} names no schema file")
                out[key] = COMPONENTS + names[target or own] + pointer
            else:
                out[key] = _rewrite(value, own, names)
        return out
    if isinstance(node, list):
        return [_rewrite(item, own, names) for item in node]
    return node


def components(directory: Path = SCHEMAS) -> dict[str, Any]:
    """`components.schemas` of the OpenAPI document: every schema file, inlined."""
    schemas = schema_files(directory)
    names = component_names(schemas)
    out = {}
    for file, schema in schemas.items():
        body = {k: v for k, v in schema.items() if k not in ("$id", "$schema")}
        out[names[file]] = _rewrite(body, file, names)
    return dict(sorted(out.items()))


def expected_openapi(directory: Path = SCHEMAS) -> str:
    """The text schemas/openapi.json should have: as edited, with its components synced."""
    document = load(directory / "openapi.json")
    document.setdefault("components", {})["schemas"] = components(directory)
    return dump(document)


def stale(directory: Path = SCHEMAS, packaged: Path = PACKAGED) -> list[str]:
    """The files that are out of date, with why."""
    expected = expected_openapi(directory)
    problems = []
    if (directory / "openapi.json").read_text(encoding="utf-8") != expected:
        problems.append(
            f"{directory / 'openapi.json'}: components.schemas differ from the "
            "schema files (or it is not in the canonical JSON spelling)"
        )
    if not packaged.exists() or packaged.read_text(encoding="utf-8") != expected:
        problems.append(f"{packaged}: not a copy of {directory / 'openapi.json'}")
    return problems


def sync(directory: Path = SCHEMAS, packaged: Path = PACKAGED) -> None:
    expected = expected_openapi(directory)
    for path in (directory / "openapi.json", packaged):
        if not path.exists() or path.read_text(encoding="utf-8") != expected:
            path.write_text(expected, encoding="utf-8")
            print(f"wrote {path}")


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        problems = stale()
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run: python tools/openapi_sync.py", file=sys.stderr)
        return 1 if problems else 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    sync()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
