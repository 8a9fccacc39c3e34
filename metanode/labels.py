"""What the web page calls a record and what kind of file it is: its label (`Show Name S01E02
· Pilot`, `Dune Part 2`, else its file name), and the library's type, which tells subtitles,
nfos and artwork (`SIDECARS`) from the media they belong to; and the words a search finds it
by (`search_words`, `search_phrases`).

Pure functions of a merged record, in one place: the cache's library index (`cache.library_row`)
lists and searches by them, and the record page and the Live feed name a record by them, so a
record is called the same everywhere on the page. The API serves records as they are.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping

__all__ = [
    "LABEL_KEYS",
    "SIDECARS",
    "file_name",
    "kind",
    "label",
    "search_phrases",
    "search_words",
    "title",
]

TYPE_KEYS = ("videoType", "fileType")  # a record's type in the library: the first it has
# The library's kinds of a file that belongs to another's record: hidden from the list unless
# asked for (a folder kept for a media server holds a subtitle, an nfo and three pictures a
# film, each a record of its own that the list showed as often as the films).
SIDECARS = ("artwork", "nfo", "subtitle")
# A picture named as media servers (Kodi, Jellyfin, Plex) name a film's, a show's or an album's
# artwork: `poster.jpg`, `Film (2010)-fanart.png`, `season01-poster.jpg`, `folder.jpg`.
ARTWORK = re.compile(
    r"(?:.*[-.])?(?:poster|folder|cover|fanart|backdrop|background|banner|clearart|clearlogo|"
    r"logo|disc|discart|cdart|landscape|thumb|keyart)\d*",
    re.IGNORECASE,
)
# A film's part or volume, with the word a title that already names it uses (`Dune: Part Two`
# from an nfo, `Kill Bill: Volume 2`): such a title is not given the number again.
SEQUELS = (
    ("Part", "part", re.compile(r"\bpart\b", re.IGNORECASE)),
    ("Vol.", "volume", re.compile(r"\bvol(?:ume)?\b", re.IGNORECASE)),
)
# The keys a label is made of: a change to one of them may rename the record.
LABEL_KEYS = (
    "title",
    "season",
    "episode",
    "episodeTitle",
    "part",
    "volume",
    "filePath",
    "fileName",
)


def title(record: Mapping[str, str]) -> str:
    """The title the library lists and searches: an episode's with its number and its own title
    (`Show Name S01E02 · Pilot`), as every episode of a show has the show's `title`; a film's
    part or volume (`Dune Part 2`) unless its title names it; empty when no title is known. A
    season or episode that is no number (a signer's free text) is left out rather than shown
    as `S` + text."""
    name = record.get("title", "")
    if not name:
        return ""
    number = "".join(
        f"{letter}{int(record[key]):02d}"
        for letter, key in (("S", "season"), ("E", "episode"))
        if _is_number(record.get(key, ""))
    )
    sequel = " ".join(
        f"{word} {record[key]}"
        for word, key, named in SEQUELS
        if _is_number(record.get(key, "")) and not named.search(name)
    )
    episode_title = record.get("episodeTitle", "") if number else ""
    named = " ".join(word for word in (name, sequel, number) if word)
    return " · ".join(part for part in (named, episode_title) if part)


def file_name(record: Mapping[str, str]) -> str:
    """The name of the record's file: its local file's, else (no local file left) the name it
    last had (`fileName`); empty if neither is known."""
    return record.get("filePath", "").rsplit("/", 1)[-1] or record.get("fileName", "")


def label(record: Mapping[str, str], fallback: str) -> str:
    """What the page calls a record: its `title`, else its file name, else `fallback` (its
    rid)."""
    return title(record) or file_name(record) or fallback


def kind(record: Mapping[str, str], name: str) -> str:
    """The type the library lists for a record whose file is called `name`: one of `SIDECARS`
    for a subtitle (fileinfo's `fileType`), an nfo or a picture named as artwork, whatever a
    signer says its `videoType` is (guessit reads `Film.en.srt` as a film too); else its
    `videoType` or `fileType`."""
    stem, dot, extension = name.rpartition(".")
    if record.get("fileType") == "subtitle":
        return "subtitle"
    if dot and extension.lower() == "nfo":
        return "nfo"
    if dot and record.get("fileType") == "image" and ARTWORK.fullmatch(stem):
        return "artwork"
    return next((record[key] for key in TYPE_KEYS if key in record), "")


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


# The characters of scripts written without spaces between words: Hangul, the kana, Bopomofo and
# the CJK ideographs (with their extensions and compatibility forms). A full-text tokenizer
# (SQLite's unicode61, PostgreSQL's parser) reads a run of them as one word, so `巨人` inside
# `進撃の巨人` was never found; each is made a word of its own, and a search for several is
# the phrase of them, in order: a substring of the title, as a reader of these scripts means.
UNSPACED = re.compile(
    "[\u1100-\u11ff\u3040-\u30ff\u3100-\u312f\u3130-\u318f\u31a0-\u31ff"
    "\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0003134f]"
)


def search_words(text: str) -> str:
    """What the library's full-text index holds of a title or a file name: `text` in its
    compatibility form (NFKC: fullwidth `ＡＢＣ` is `ABC`, `²` is `2`, a decomposed `é` as
    macOS writes names is one letter), with each character of an unspaced script a word."""
    return UNSPACED.sub(r" \g<0> ", unicodedata.normalize("NFKC", text))


def search_phrases(text: str) -> list[list[str]]:
    """What a person typed as the index reads it: each word of `text` (read as `search_words`
    does) as the phrase of its index words, in order (`進撃の巨人` is 進 撃 の 巨 人)."""
    return [
        search_words(word).split()
        for word in re.findall(r"\w+", unicodedata.normalize("NFKC", text))
    ]
