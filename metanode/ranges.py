"""A `Range` header read one way for every route that serves a file's bytes: the native
`/file/{cid}` (`compat.range_refused`) and WebDAV's GET (`webdav.Ranges`).

The reading is Starlette's `FileResponse` parser, the one that serves `/file/{cid}`, so the
routes never disagree on which bytes a header names; what each route does with a header it
cannot serve is its own (RFC 9110 §14.2 lets a server ignore a malformed one, Go's
`http.ServeContent`, which MetaMesh consumers know from meta-core, refuses it).
"""

from __future__ import annotations

import enum
import re

from starlette.responses import FileResponse, MalformedRangeHeader, RangeNotSatisfiable


class Unserved(enum.Enum):
    """Why a `Range` header names no bytes to send."""

    MALFORMED = "malformed"  # not `bytes=<first>-<last>` (another unit, last before first…)
    UNSATISFIABLE = "unsatisfiable"  # well formed, but no byte of the file is in it (416)


# RFC 9110 §14.1.1's `ranges-specifier`: the unit, then a list of `first-last`, `first-` or
# `-suffix`, each number ASCII digits alone (Starlette's parser reads them with `int`, which
# takes `+5`, `1_0` and `٣`, an Arabic-Indic three, as numbers)
SPECIFIER = re.compile(
    r"bytes[ \t]*=[ \t]*(?:\d+-\d*|-\d+)?(?:[ \t]*,[ \t]*(?:\d+-\d*|-\d+)?)*[ \t]*",
    re.IGNORECASE | re.ASCII,
)


def byte_ranges(header: str, size: int) -> list[tuple[int, int]] | Unserved:
    """The ranges `header` asks of a file of `size` bytes, as [start, end) pairs, merged where
    they overlap (more than Starlette's `max_ranges` of them: none, the whole file)."""
    if not SPECIFIER.fullmatch(header):
        return Unserved.MALFORMED
    try:
        return FileResponse._parse_range_header(header, size)
    except MalformedRangeHeader:
        return Unserved.MALFORMED
    except RangeNotSatisfiable:
        return Unserved.UNSATISFIABLE
