"""An answer a client may keep and must revalidate, made one way for every route that answers
a document (`GET /api/meta/{cid}` and its claims, `/api/metadata/{rid}` and its claims,
`/openapi.json`, the MetaMesh `/meta…` reads): a strong `ETag` of its bytes, `Cache-Control:
no-cache` (`private, no-cache` on a token route), and a 304 without the body to an
`If-None-Match` that names the tag. Below both edges that use it (`api`, `compat`), so
neither keeps a copy."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse, Response

JSON = "application/json"
NO_CACHE = (b"cache-control", b"no-cache")
# A token route's document: a browser may keep it to revalidate (it is the public record's
# content, and its rid), a shared cache none, which a session's cookie would not keep out.
PRIVATE_NO_CACHE = (b"cache-control", b"private, no-cache")


def entity_tag(body: bytes) -> bytes:
    """A strong `ETag` of an answer's bytes: the same document has the same tag in every worker
    of `serve --workers N`, after a restart and after `rebuild-cache` (which renders the same
    bytes), where a version kept in a process or counted by the cache would not be. SHA-256 (the
    CPU's own instructions: 0.8 µs for a document of 1 KB, blake2b 1.5), 96 bits of it."""
    return b'"' + hashlib.sha256(body).hexdigest()[:24].encode("ascii") + b'"'


def not_modified(tag: bytes, headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether the request's `If-None-Match` names `tag` (or is `*`), by the weak comparison
    RFC 9110 §13.1.2 asks for: the client's copy is current, a 304 says so without the body."""
    for name, given in headers:
        if name == b"if-none-match":
            tags = [t.strip().removeprefix(b"W/") for t in given.split(b",")]
            if b"*" in tags or tag in tags:
                return True
    return False


def revalidated(
    body: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    media_type: str = JSON,
    extra: Sequence[tuple[bytes, bytes]] = (),
    caching: tuple[bytes, bytes] = NO_CACHE,
) -> Response:
    """An answer a client may keep and must revalidate (`Cache-Control: no-cache`: a record
    changes whenever its group does), with its `ETag` and the route's `extra` headers; a 304
    without the body when the client's `If-None-Match` (in the request's `headers`) holds that
    tag already; `caching` is its `Cache-Control` (`PRIVATE_NO_CACHE` for a token route's).
    Its headers made as bytes: through a `headers` dict, 2.7 µs more than the
    plain answer a read, now 0.6."""
    tag = entity_tag(body)
    if not_modified(tag, headers):
        response = Response(status_code=304)
    else:
        response = Response(body, media_type=media_type)
    response.raw_headers += [(b"etag", tag), caching, *extra]
    return response


def revalidated_json(
    document: Any, headers: Sequence[tuple[bytes, bytes]], caching: tuple[bytes, bytes] = NO_CACHE
) -> Response:
    """`revalidated` for a document rendered as Starlette's `JSONResponse` renders it (compact,
    UTF-8), so a route's bytes, and with them its tag, are what they were without one."""
    return revalidated(bytes(JSONResponse(document).body), headers, caching=caching)
