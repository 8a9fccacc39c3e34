"""Request bodies, read defensively: a size limit enforced before the whole body is in memory,
a deadline for the whole body, JSON that is UTF-8 only, names no object member twice and never
raises anything but `InvalidJson`, objects refused when they carry members their schema does
not name, and numbers from headers and queries that are plain ASCII digits (`"²".isdigit()`
is true, yet `int("²")` fails)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from starlette.requests import ClientDisconnect, Request

from metanode import jsonl
from metanode.errors import InvalidJson, InvalidRequest, RequestError, RequestTimeout, TooLarge


def ascii_number(text: str) -> int | None:
    """The value of a string of ASCII digits, else None."""
    return int(text) if text.isascii() and text.isdigit() else None


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refusing more than `limit` bytes (by the declared length or while reading) and
    a body that has not arrived whole within `timeout_s` (a slow client would otherwise hold its
    connection, and this request's memory, for as long as it likes)."""
    declared = ascii_number(request.headers.get("content-length", ""))
    if declared is not None and declared > limit:
        raise TooLarge(f"body is {declared} bytes; at most {limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise TooLarge(f"body is over {limit} bytes")
    except ClientDisconnect:  # gone, or its body unreadable (server.py answered it): no traceback
        raise RequestError(
            f"the client left before its body ended ({len(body)} bytes came)"
        ) from None
    except TimeoutError:
        raise RequestTimeout(
            f"the body did not arrive within {timeout_s:g} s ({len(body)} bytes came)"
        ) from None
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """JSON from bytes; bad encoding, bad syntax, absurd nesting, a member named twice and
    NaN or an infinity are all `invalid_json`.

    The API is UTF-8 only (RFC 8259 §8.1): the bytes are decoded strictly first, because
    `json.loads(bytes)` would guess UTF-16 or UTF-32 and skip a BOM. A BOM is refused too."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJson(f"body is not UTF-8 (byte {exc.start}); the API is UTF-8 only") from None
    try:
        return jsonl.DECODER.decode(text)
    except jsonl.NotNodeJson as exc:
        raise InvalidJson(f"body is not JSON the node reads: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidJson(f"body is not JSON: {type(exc).__name__}") from None


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    return parse_json(await read_body(request, limit, timeout_s))


def declares_json(request: Request) -> bool:
    """Whether the request says its body is JSON (`application/json`, or a `+json` type), for
    a route that also takes a body as plain text."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def refuse_unknown(body: dict[Any, Any], allowed: Collection[str]) -> None:
    """Refuse members a schema with `additionalProperties: false` does not name, so that a
    misspelt field (`may_Link`) is an error rather than silently ignored."""
    unknown = sorted(map(str, set(body) - set(allowed)))
    if unknown:
        raise InvalidRequest(
            f"unknown member(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}"
        )
