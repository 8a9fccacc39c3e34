"""filename: what a release-style path says — title, year, season, episode, episode title,
resolution, source, codecs, release group, edition, languages, `Sample` — and which subtitle
files beside a video belong to it.

guessit parses the path relative to its watch root, so folders inform the name:
`Inception (2010)/movie.mkv` is the film Inception of 2010, `Breaking Bad/Season 01/S01E02.mkv`
an episode of Breaking Bad. Only videos and subtitles are parsed: a release name says nothing
sure about a zip. The keys and their value formats are in docs/plugins.md ("filename").

The path is all it reads, so it is `path_dependent`: a rename or a move runs it again, and what
the new name no longer says is retracted. A video's subtitles are its `sidecars`: `Name.en.srt`
or `Name.forced.de.ass` beside `Name.mkv` is listed on the video's record as
`subtitles/<language>[.forced][.sdh]`, whichever of the two arrives first.

Its claims weigh little against a curated source: give this plugin a low weight
(`plugin_weights = ["filename=1"]`, others higher) and better sources win the merge.

This module is the tutorial for a plugin that only looks at the path, never the bytes.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from babelfish import Error as LanguageError
from babelfish import Language
from guessit import guessit

from metanode.plugins import LocalFile, Plugin, RecordLookup, Register

__all__ = ["FileName", "Subtitle", "parse", "subtitle_of"]

SUBTITLES = frozenset({"srt", "ass", "ssa", "sub", "idx", "vtt", "sup", "smi"})
# guessit property → claim key, for the properties that are one plain string
PLAIN = {
    "episode_title": "episodeTitle",
    "screen_size": "resolution",
    "source": "source",
    "video_codec": "videoCodec",
    "audio_codec": "audioCodec",
    "audio_channels": "audioChannels",
    "release_group": "releaseGroup",
    "streaming_service": "streamingService",
}
# guessit property → claim key, for those that may hold several values: always a JSON array
LISTS = {
    "edition": "edition",
    "language": "language",
    "subtitle_language": "subtitleLanguage",
    "other": "other",
}
CONTAINERS = frozenset({"mkv", "mp4", "avi", "m4v", "mov", "wmv", "ts", "webm", "mpg", "flv"})
FORCED = frozenset({"forced"})
SDH = frozenset({"sdh", "hi", "cc"})


def _integer(value: Any) -> str | None:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    """A guessit value as text: a Language as its IETF tag, a list by its first element."""
    if isinstance(value, list):
        return _text(value[0]) if value else None
    text = str(value).strip() if value is not None else ""
    return text or None


def _texts(value: Any) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [t for t in (_text(v) for v in values) if t is not None]


# What a file name may hold that no release name means (docs/plugins.md, "filename"): control
# characters (a line feed, a tab, an escape sequence), the line and paragraph separators, and
# a backslash (guessit takes it for a Windows folder separator; on Linux it is part of a name)
# read as the spaces they stand between; invisible formatting characters (a byte-order mark, a
# zero-width space, a word joiner, the left-to-right and right-to-left marks, and the
# bidirectional embeddings, overrides and isolates) dropped. The zero-width joiner and
# non-joiner stay: emoji sequences and Persian words are made of them.
SPACED = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\\\\]")
DROPPED = re.compile("[\u200b\u200e\u200f\u202a-\u202e\u2060\u2066-\u2069\ufeff]")


def cleaned(path: str) -> str:
    """`path` as a release name is read: what no release name means spaced or dropped, and in
    NFC, so a name written decomposed (macOS writes `é` as `e` and a combining acute accent)
    gives the title a composed one does."""
    return unicodedata.normalize("NFC", DROPPED.sub("", SPACED.sub(" ", path)))


def extension_of(name: str) -> str:
    return os.path.splitext(name)[1][1:].lower()


def parse(path: str) -> dict[str, str]:
    """The claims filename makes about one path (relative to its watch root, or a name)."""
    path = cleaned(path)
    extension = extension_of(path)
    guess = guessit(path)
    mime = guess.get("mimetype")  # a list for names like "x.mkv.srt": then not a video
    is_video = isinstance(mime, str) and mime.startswith("video/") and extension not in SUBTITLES
    if not is_video and extension not in SUBTITLES:
        return {}
    kind = guess.get("type") if is_video else None
    out: dict[str, str] = {}
    title = _text(guess.get("title"))
    if title is not None:
        out["title"] = title
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
    for field in ("part", "volume"):  # `Dune.Part.Two`, `Kill.Bill.Vol.2`: not in the title
        value = _integer(guess.get(field))
        if value is not None:
            out[field] = value
    for prop, key in PLAIN.items():
        text = _text(guess.get(prop))
        if text is not None:
            out[key] = text
    for prop, key in LISTS.items():
        texts = _texts(guess.get(prop))
        if texts:
            out[key] = json.dumps(texts, ensure_ascii=False)
    if "Sample" in _texts(guess.get("other")):
        out["sample"] = "true"
    if extension in SUBTITLES:
        out.update(_own_subtitle(os.path.basename(path)))
    return out


@dataclass(frozen=True)
class Subtitle:
    """What a subtitle file's name says beside its video's: `Name.forced.de.ass`."""

    file: str
    language: str  # an IETF tag ("en", "pt-BR"), "und" if the name gives none
    forced: bool
    sdh: bool
    format: str

    @property
    def key(self) -> str:
        flags = (".forced" if self.forced else "") + (".sdh" if self.sdh else "")
        return f"subtitles/{self.language}{flags}"

    def value(self) -> str:
        return json.dumps(
            {
                "file": self.file,
                "language": self.language,
                "forced": self.forced,
                "sdh": self.sdh,
                "format": self.format,
            },
            ensure_ascii=False,
        )


def _language(token: str) -> str | None:
    """A language code in a subtitle name (`en`, `eng`, `pt-BR`), as an IETF tag."""
    if token.lower() in CONTAINERS:
        return None  # `Name.mkv.srt`
    for parse_code in (Language.fromietf, Language.fromalpha3b):
        try:
            return str(parse_code(token))
        except (LanguageError, ValueError, KeyError):
            continue
    return None


def _subtitle(name: str, tokens: list[str]) -> Subtitle:
    """A subtitle from the name's tokens between its video's stem and its extension."""
    lowered = {t.lower() for t in tokens}
    languages = [code for code in map(_language, tokens) if code is not None]
    return Subtitle(
        name,
        languages[0] if languages else "und",
        bool(lowered & FORCED),
        bool(lowered & SDH),
        extension_of(name),
    )


def subtitle_of(stem: str, name: str) -> Subtitle | None:
    """The subtitle `name` as one of the video `stem`'s, or None if it is not one of them."""
    extension = extension_of(name)
    if extension not in SUBTITLES or not name.startswith(stem + "."):
        return None
    return _subtitle(name, [t for t in name[len(stem) + 1 : -len(extension) - 1].split(".") if t])


def _own_subtitle(name: str) -> dict[str, str]:
    """A subtitle file's flags from the last tokens of its own name (`Name.forced.de.ass`);
    its language is guessit's `subtitleLanguage`."""
    found = _subtitle(name, name.split(".")[1:-1][-3:])
    out: dict[str, str] = {}
    if found.forced:
        out["forced"] = "true"
    if found.sdh:
        out["sdh"] = "true"
    return out


def subtitles_beside(path: str) -> list[Subtitle]:
    """The subtitle files in a video's folder that carry its name."""
    folder, name = os.path.split(path)
    stem = os.path.splitext(name)[0]
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = [subtitle_of(stem, n) for n in names if not n.startswith(".")]
    return [s for s in found if s is not None]


class FileName(Plugin):
    name = "filename"
    version = "4"
    path_dependent = True
    sidecars = SUBTITLES

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        claimed = parse(file.in_root)
        for key, value in claimed.items():
            register(file.cid, key, value)
        if claimed and extension_of(file.path) not in SUBTITLES:
            for subtitle in subtitles_beside(file.path):
                register(file.cid, subtitle.key, subtitle.value())
