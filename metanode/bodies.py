"""Request bodies, read defensively: a size limit enforced before the whole body is in memory,
JSON that never raises anything but `InvalidJson`, and numbers from headers and queries that
are plain ASCII digits (`"²".isdigit()` is true, yet `int("²")` fails)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from metanode.errors import InvalidJson, TooLarge


def ascii_number(text: str) -> int | None:
    """The value of a string of ASCII digits, else None."""
    return int(text) if text.isascii() and text.isdigit() else None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes (by the declared length or while reading)."""
    declared = ascii_number(request.headers.get("content-length", ""))
    if declared is not None and declared > limit:
        raise TooLarge(f"body is {declared} bytes; at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"body is over {limit} bytes")
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """JSON from bytes; bad encoding, bad syntax and absurd nesting are all `invalid_json`."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidJson(f"body is not JSON: {type(exc).__name__}") from None


async def read_json(request: Request, limit: int) -> Any:
    return parse_json(await read_body(request, limit))
