"""WebDAV requests as meta-fuse and meta-sort make them, read back as plain values."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import defusedxml.ElementTree as SafeET
import httpx

DAV = "{DAV:}"


def propfind(
    url: str, depth: str, headers: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """PROPFIND `url`: {unquoted href: {"collection": bool, "length": int | None, "modified"}}."""
    response = httpx.request(
        "PROPFIND", url, headers={"Depth": depth, **(headers or {})}, timeout=30
    )
    assert response.status_code == 207, response.text
    found = {}
    for item in SafeET.fromstring(response.content).iter(f"{DAV}response"):
        prop = item.find(f"{DAV}propstat/{DAV}prop")
        assert prop is not None
        length = prop.findtext(f"{DAV}getcontentlength")
        found[unquote(item.findtext(f"{DAV}href") or "")] = {
            "collection": prop.find(f"{DAV}resourcetype/{DAV}collection") is not None,
            "length": None if length is None else int(length),
            "modified": prop.findtext(f"{DAV}getlastmodified"),
        }
    return found
