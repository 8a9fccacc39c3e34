"""JSON lines: the one reader and the one writer of claims and events one JSON value a line.

A line ends at b"\\n" and nowhere else. `str.splitlines` (and anything built on it) also ends
lines at \\r, \\x0b, \\x0c, \\x1c-\\x1e, \\x85, U+2028 and U+2029, and a JSON string may hold the
last three raw: a claim whose value held one was stored fine but its export could not be
imported. A JSON encoder never writes a raw \\n inside a string, so b"\\n" is always safe; a
trailing \\r (a CRLF file) is JSON whitespace and is tolerated.

The writer escapes U+0085, U+2028 and U+2029 (`\\u2028`, the same JSON value), so that what we
write also survives readers that split on them: older metanode versions, other people's scripts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import IO, Any

from metanode.errors import InvalidJson, shown

WHITESPACE = b" \t\r\n"  # JSON's whitespace: a line of only these is blank
_ESCAPES = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def escape_breaks(text: str) -> str:
    """JSON `text` with U+0085, U+2028 and U+2029 escaped (the same JSON value), so no reader
    that honours them as line ends splits it (the change feed's frames too: `sse`). A search
    for the three where none is, which is nearly always: `str.translate` took twice as long as
    encoding the JSON."""
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return text.translate(_ESCAPES)
    return text


def dumps(value: object, default: Callable[[Any], Any] | None = None) -> str:
    """One JSON line without its newline: UTF-8 readable (not ASCII-escaped), and safe to split
    on any line ending a reader may honour."""
    return escape_breaks(json.dumps(value, ensure_ascii=False, default=default))


def encode(value: object) -> bytes:
    """One JSON line with its b"\\n", as UTF-8 bytes (what a binary sink takes)."""
    return dumps(value).encode("utf-8") + b"\n"


class NotNodeJson(ValueError):
    """JSON Python's parser takes but the node does not read: its message says why."""


class DuplicateMember(NotNodeJson):
    """An object names one member twice."""


class NonFinite(NotNodeJson):
    """`NaN`, `Infinity` or `-Infinity`: Python's parser takes them, RFC 8259 has no such
    numbers, and a claim holding one could not be written back out as JSON."""


def _no_constant(name: str) -> Any:
    raise NonFinite(f"{name} is not a JSON number")


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing a name given twice: RFC 8259 leaves the meaning open, and
    Python keeps the last where other parsers keep the first, so a claim could verify here and
    read otherwise to whatever stands in front of the node. Costs ≈ 0.4 µs a claim."""
    members = dict(pairs)
    if len(members) != len(pairs):
        names = [name for name, _ in pairs]
        twice = next(name for n, name in enumerate(names) if name in names[:n])
        raise DuplicateMember(f"member {shown(twice)} is given twice")
    return members


# every JSON the node reads goes here
DECODER = json.JSONDecoder(object_pairs_hook=_members, parse_constant=_no_constant)


def loads(raw: bytes | str, where: str) -> object:
    """One JSON value; `InvalidJson` naming `where` (e.g. "line 3") if it is not UTF-8 JSON, if
    an object in it names a member twice, if it holds NaN or an infinity, or if it nests deeper
    than Python's parser recurses (`[` a hundred thousand times: the RecursionError escaped,
    a traceback from `claim verify`, and a peer answering so ended its follower silently)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return DECODER.decode(text)
    except UnicodeDecodeError as exc:
        raise InvalidJson(f"{where} is not UTF-8: {exc}") from None
    except (json.JSONDecodeError, NotNodeJson) as exc:
        raise InvalidJson(f"{where} is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidJson(f"{where} is not JSON the node reads: it nests too deep") from None


def read(stream: IO[bytes]) -> Iterator[tuple[int, object]]:
    """`(position, value)` for each value of a binary stream holding JSON lines or one JSON
    array; blank lines are skipped.

    `position` is the 1-based line number for JSON lines and the 1-based element number for an
    array, so an error can name where it is. JSON lines are read a line at a time (memory stays
    flat whatever the size); an array is one JSON text and is read whole.
    """
    first = True
    for number, raw in enumerate(stream, 1):
        if not raw.strip(WHITESPACE):
            continue
        if first and raw.lstrip(WHITESPACE).startswith(b"["):
            yield from _array(raw + stream.read())
            return
        first = False
        yield number, loads(raw, f"line {number}")


def _array(raw: bytes) -> Iterator[tuple[int, object]]:
    value = loads(raw, "the input (a JSON array)")
    if not isinstance(value, list):
        raise InvalidJson("the input starts with '[' but is not one JSON array")
    yield from enumerate(value, 1)
