"""The API contract as a validator: schemas/*.schema.json and schemas/openapi.json registered
under their ids, and `check` of an instance against one of them (tests/test_schemas.py,
tests/test_docs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tools import openapi_sync

SCHEMAS = Path(__file__).parents[2] / "schemas"
OPENAPI_FILE = SCHEMAS / "openapi.json"
BASE = "https://metanode.invalid/schemas/"
OPENAPI_URI = "urn:metanode:openapi"
FILES = sorted(path.name for path in SCHEMAS.glob("*.schema.json"))
OPENAPI: dict[str, Any] = json.loads(OPENAPI_FILE.read_text(encoding="utf-8"))


def _registry() -> Registry[Any]:
    resources = [
        (BASE + name, DRAFT202012.create_resource(openapi_sync.load(SCHEMAS / name)))
        for name in FILES
    ]
    # The OpenAPI document itself, so a pointer into it resolves its #/components/... refs.
    resources.append(
        (OPENAPI_URI, Resource.from_contents(OPENAPI, default_specification=DRAFT202012))
    )
    return Registry().with_resources(resources)


REGISTRY = _registry()


def check(ref: str, instance: Any) -> None:
    """Validate `instance` against the schema at `ref` (a URI, `#/pointer` allowed)."""
    validator = Draft202012Validator({"$ref": ref}, registry=REGISTRY)
    error = best_match(validator.iter_errors(instance))
    assert error is None, (
        f"{ref}: {error.message} at {list(error.absolute_path)} "
        f"(schema path {list(error.absolute_schema_path)})\n{instance!r}"
    )


def file_schema(name: str, pointer: str = "") -> str:
    return f"{BASE}{name}#{pointer}" if pointer else BASE + name
