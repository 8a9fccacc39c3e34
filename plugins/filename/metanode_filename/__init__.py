"""filename: what a release-style name says — `title`, `year`, `movieYear`, `season`, `episode`,
`videoType`.

guessit parses names like `The.Matrix.1999.1080p.BluRay.x264-GROUP.mkv` or
`Breaking.Bad.S01E02.720p.mkv`. Only fields guessit is sure of are claimed: a single integer year,
season and episode (a multi-episode file claims none of them), `videoType` only for movies and
episodes (and only for video files), and a title only when there is one. Files that are neither
videos nor subtitles get no claims. Its claims weigh little against a curated source:
give this plugin a low weight (`plugin_weights = ["filename=1"]`, others higher) and better
sources win the merge.

This module is the tutorial for a plugin that only looks at the path, never the bytes.
"""

from __future__ import annotations

import os
from typing import Any

from guessit import guessit

from metanode.plugins import LocalFile, Plugin, RecordLookup, Register

__all__ = ["FileName", "parse"]


def _integer(value: Any) -> str | None:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else None


SUBTITLES = frozenset({"srt", "ass", "ssa", "sub", "idx", "vtt", "sup", "smi"})


def parse(path: str) -> dict[str, str]:
    """The claims filename makes about one path (its last component).

    Only videos and their subtitles are parsed: a release name says nothing sure about a zip.
    """
    name = os.path.basename(path)
    extension = os.path.splitext(name)[1][1:].lower()
    guess = guessit(name)
    mime = guess.get("mimetype")  # a list for names like "x.mkv.srt": then not a video
    is_video = isinstance(mime, str) and mime.startswith("video/") and extension not in SUBTITLES
    if not is_video and extension not in SUBTITLES:
        return {}
    kind = guess.get("type") if is_video else None
    out: dict[str, str] = {}
    title = guess.get("title")
    if isinstance(title, str) and title.strip():
        out["title"] = title.strip()
    year = _integer(guess.get("year"))
    if year is not None:
        out["year"] = year
        if kind == "movie":
            out["movieYear"] = year
    if kind in ("movie", "episode"):
        out["videoType"] = kind
    if guess.get("type") == "episode":
        for field in ("season", "episode"):
            value = _integer(guess.get(field))
            if value is not None:
                out[field] = value
    return out


class FileName(Plugin):
    name = "filename"
    version = "1"

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        for key, value in parse(file.path).items():
            register(file.cid, key, value)
