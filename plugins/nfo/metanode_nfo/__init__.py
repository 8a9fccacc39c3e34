"""nfo: what a Kodi/Jellyfin `.nfo` beside a video says about it — title, year, plot and the
provider ids `imdb`, `tmdb`, `tvdb`.

It runs on the video, not on the `.nfo`: for `Film.mkv` it reads `Film.nfo`, else the folder's
`movie.nfo`; a `tvshow.nfo` in the folder or the one above (`Show/tvshow.nfo` over
`Show/Season 01/`) gives the series' keys (`series/title`, `series/tvdb`, …). So its claims are
about the video's own CID, and `.nfo` is one of its `sidecars`: the host runs it again on the
videos of a folder whenever an `.nfo` appears, changes or goes there, in whichever order the
video and the `.nfo` arrive, and what an edited `.nfo` no longer says is retracted.

The XML is parsed with `defusedxml`: a document that declares entities (the "billion laughs"
expansion, external entities) is refused — that `.nfo` gives nothing, the run is recorded as
skipped with the reason, and everything else about the video stands. An `.nfo` that is not XML
but a bare link (Kodi allows one) gives the IMDb id it names.

The keys and value formats are in docs/plugins.md ("nfo"). Its weight (5) is above filename's
and mediainfo's: a curated `.nfo` wins the title over a guess from the name.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring

from metanode.plugins import LocalFile, Plugin, RecordLookup, Register, Skip

__all__ = ["Nfo", "parse_nfo", "sidecars_of"]

VIDEO = frozenset(
    {"mkv", "mp4", "m4v", "avi", "mov", "webm", "wmv", "ts", "m2ts", "mpg", "mpeg", "flv", "ogv"}
)
MAX_BYTES = 1 << 20  # an .nfo is a few KiB; a larger one is not read
PROVIDERS = ("imdb", "tmdb", "tvdb")
IMDB_ID = re.compile(r"\btt\d{7,9}\b")
LEGACY_IDS = {"imdbid": "imdb", "tmdbid": "tmdb", "tvdbid": "tvdb"}


class Refused(Exception):
    """This .nfo cannot be read safely (entities, not well-formed, too large)."""


@dataclass(frozen=True)
class Sidecar:
    path: str
    prefix: str  # "" for the video's own .nfo or movie.nfo, "series/" for tvshow.nfo


def sidecars_of(video: str) -> list[Sidecar]:
    """The .nfo files that describe `video`, most specific first: `<stem>.nfo`, `movie.nfo`,
    then `tvshow.nfo` here or in the folder above."""
    folder, name = os.path.split(video)
    stem = os.path.splitext(name)[0]
    candidates = [
        Sidecar(os.path.join(folder, stem + ".nfo"), ""),
        Sidecar(os.path.join(folder, "movie.nfo"), ""),
        Sidecar(os.path.join(folder, "tvshow.nfo"), "series/"),
        Sidecar(os.path.join(os.path.dirname(folder), "tvshow.nfo"), "series/"),
    ]
    found: list[Sidecar] = []
    for candidate in candidates:
        if os.path.isfile(candidate.path) and not any(f.prefix == candidate.prefix for f in found):
            found.append(candidate)
    return found


def _text(root: ET.Element, tag: str) -> str | None:
    node = root.find(tag)
    text = (node.text or "").strip() if node is not None else ""
    return text or None


def _ids(root: ET.Element) -> dict[str, str]:
    """Provider ids: `<uniqueid type="imdb">`, and the older `<imdbid>`/`<id>` forms."""
    out: dict[str, str] = {}
    for node in root.iter("uniqueid"):
        kind = (node.get("type") or "").lower()
        text = (node.text or "").strip()
        if kind in PROVIDERS and text and kind not in out:
            out[kind] = text
    for tag, kind in LEGACY_IDS.items():
        older = _text(root, tag)
        if older and kind not in out:
            out[kind] = older
    legacy = _text(root, "id")
    if legacy and IMDB_ID.fullmatch(legacy) and "imdb" not in out:
        out["imdb"] = legacy
    return out


def parse_nfo(data: bytes) -> dict[str, str]:
    """title, year, plot and provider ids of one .nfo (XML, or a bare link with an IMDb id)."""
    if not data.lstrip().startswith(b"<"):
        found = IMDB_ID.search(data.decode("utf-8", "replace"))
        return {"imdb": found.group(0)} if found else {}
    try:
        root = fromstring(data)  # entity declarations and external references: refused
    except DefusedXmlException as exc:
        raise Refused(f"{type(exc).__name__}: entity declarations are refused") from None
    except ET.ParseError as exc:
        raise Refused(f"not well-formed XML: {exc}") from None
    out: dict[str, str] = {}
    for key in ("title", "plot"):
        text = _text(root, key)
        if text:
            out[key] = text
    year = _text(root, "year") or (_text(root, "premiered") or "")[:4]
    if year and year.isdigit():
        out["year"] = year
    out.update(_ids(root))
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise Refused(f"larger than {MAX_BYTES} bytes")
    return data


class Nfo(Plugin):
    name = "nfo"
    version = "1"
    weight = 5
    path_dependent = True  # which .nfo files describe a video depends on where it is
    sidecars = frozenset({"nfo"})

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        if os.path.splitext(file.path)[1][1:].lower() not in VIDEO:
            return
        refused: list[str] = []
        for sidecar in sidecars_of(file.path):
            try:
                said = parse_nfo(_read(sidecar.path))
            except (Refused, OSError) as exc:
                refused.append(f"{os.path.basename(sidecar.path)}: {exc}")
                continue
            for key, value in said.items():
                register(file.cid, sidecar.prefix + key, value)
        if refused:
            raise Skip("refused " + "; ".join(refused))
