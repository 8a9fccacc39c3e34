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
    "fold",
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
# the CJK ideographs (with their extensions and compatibility forms); Thai, Lao, Khmer and
# Myanmar. A full-text tokenizer (SQLite's unicode61, PostgreSQL's parser) reads a run of them
# as one word, so `巨人` inside `進撃の巨人` (or `ไทย` inside `ภาพยนตร์ไทย`) was never found; each
# is made a word of its own, and a search for several is the phrase of them, in order: a
# substring of the title, as a reader of these scripts means.
UNSPACED = re.compile(
    "[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u19e0-\u19ff"
    "\u1100-\u11ff\u3040-\u30ff\u3100-\u312f\u3130-\u318f\u31a0-\u31ff"
    "\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0003134f]"
)


# Marks a reader of the script leaves out when typing, removed from what is indexed and from
# what is typed alike, so the search ignores them: the accents of Latin, Greek and Cyrillic
# letters (after NFKD: `é` is `e` and U+0301), Hebrew points and cantillation, Arabic harakat and
# the tatweel that only stretches a word; the variation selectors and skin tones of an emoji
# (`❤️` is `❤`). The marks that make a letter of other scripts (an Indic vowel sign, a kana's
# voicing mark) stay part of their word.
DIACRITICS = re.compile(
    "[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"
    "\u0591-\u05bd\u05bf\u05c1\u05c2\u05c4\u05c5\u05c7"
    "\u0610-\u061a\u0640\u064b-\u065f\u0670\u06d6-\u06dc\u06df-\u06e4\u06e7\u06e8\u06ea-\u06ed"
    "\ufe00-\ufe0f\U000e0100-\U000e01ef\U0001f3fb-\U0001f3ff]"
)
# The punctuation inside a word made of parts, `Spider-Man`, `WALL·E`, `Schindler's`,
# `M*A*S*H`, `S.H.I.E.L.D.`, `AC/DC`: the parts are words, and the index holds them run
# together too (`spiderman`, `walle`, `schindlers`, `mash`), as a reader may type them.
JOINERS = frozenset("-\u2010\u2011'\u2019\u00b7.*/")
COMPOUND_PARTS = 3  # the most parts of one run together, unless each is one letter
# The longest word the index holds, in characters (a longer one is its first `WORD_CHARS`):
# PostgreSQL refuses a word of over 2,046 bytes in a tsvector or tsquery.
WORD_CHARS = 255
# The vulgar fractions, which NFKC writes as digits (`½` is `1⁄2`) that would join the number
# before them: `9½` is read as `9 1/2` is, not as `91 2`.
FRACTIONS = re.compile("[\u00bc-\u00be\u2150-\u215f\u2189]")
# Letters no decomposition takes an accent off, written as a reader without them types them
# (as PostgreSQL's `unaccent` does): `Søren` is found by `soren`, `Łódź` by `lodz`.
LETTERS = {
    "æ": "ae",
    "œ": "oe",
    "ø": "o",
    "ł": "l",
    "đ": "d",
    "ð": "d",
    "þ": "th",
    "ı": "i",
    "ħ": "h",
    "ŧ": "t",
}
SPELLED = re.compile(f"[{''.join(LETTERS)}]")


def fold(text: str) -> str:
    """`text` as the search compares it: its compatibility form (NFKC: fullwidth `ＡＢＣ` is
    `ABC`, `²` is `2`, a decomposed `é` as macOS writes names is one letter; `9½` is `9 1⁄2`),
    case folded (`Straße` is `strasse`, `İ` is `i`), without `DIACRITICS`, with `LETTERS`
    spelled out. ASCII, most titles and file names, is only lowered."""
    if text.isascii():
        return text.lower()
    spaced = FRACTIONS.sub(r" \g<0>", text)
    decomposed = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", spaced).casefold())
    composed = unicodedata.normalize("NFC", DIACRITICS.sub("", decomposed))
    return SPELLED.sub(lambda letter: LETTERS[letter[0]], composed)


def _shape(char: str) -> str:
    """What `char` is to the search: `m` a mark (Unicode's M*: it belongs to the character
    before it); `a` a word alone (a character of an unspaced script, or a symbol, So: emoji,
    `★`, `♪`); `w` a letter or digit of a word (L*, N*); `j` one of `JOINERS`; else ` ` (it
    parts words: punctuation, `_`, math and currency signs, an emoji sequence's joiner)."""
    category = unicodedata.category(char)
    if category[0] == "M":
        return "m"
    if category[0] in "LN":
        return "a" if UNSPACED.match(char) else "w"
    if category == "So":
        return "a"
    return "j" if char in JOINERS else " "


class _Shapes(dict[int, str]):
    """`_shape` of each code point, worked out the first time it is seen: `str.translate`
    reads a text's shapes at C speed (per character in Python, a title cost 300 µs). Kept
    for planes 0 to 2 only (at most 196,608 entries, ≈ 13 MB), so that titles made of every
    code point there is cannot make it hold the 1.1 million."""

    def __missing__(self, point: int) -> str:
        shape = _shape(chr(point))
        if point < 0x30000:
            self[point] = shape
        return shape


SHAPES = _Shapes()
PART = re.compile("am*|[wm]+")  # an index word: one alone with its marks, or a run of others
# Words joined by `JOINERS` only (possessive, from a word's start: each character is tried once)
JOINED = re.compile("(?<![wma])[wma]++(?:j++[wma]++)+")
JOINER = re.compile(f"[{re.escape(''.join(sorted(JOINERS)))}]")


def _folded(text: str) -> tuple[str, str]:
    """`text` folded, and the shape of each of its characters."""
    folded = fold(text)
    return folded, folded.translate(SHAPES)


def _phrases(folded: str, shape: str) -> list[list[str]]:
    """Each word as the phrase of its index words (`PART`s with nothing between them), each at
    most `WORD_CHARS` long."""
    phrases: list[list[str]] = []
    end = -1
    for part in PART.finditer(shape):
        word = folded[part.start() : part.end()][:WORD_CHARS]
        if part.start() == end:
            phrases[-1].append(word)
        else:
            phrases.append([word])
        end = part.end()
    return phrases


def _compounds(folded: str, shape: str) -> list[str]:
    """The words whose parts only `JOINERS` part, run together (`spiderman`): of at most
    `COMPOUND_PARTS` parts, or of letters each alone (`S.H.I.E.L.D.`), but for those with a
    word alone in them. A file name's dotted run (`The.Movie.2001.1080p.x264`) is none: run
    together it is a word no one types, one a file, which made the index 23 % larger."""
    return [
        JOINER.sub("", folded[run.start() : run.end()])[:WORD_CHARS]
        for run in JOINED.finditer(shape)
        if "a" not in run[0] and _compound(run[0].split("j"))
    ]


def _compound(parts: list[str]) -> bool:
    parts = [part for part in parts if part]  # `j+` parts them: no empty part is one
    return len(parts) <= COMPOUND_PARTS or all(len(part) == 1 for part in parts)


def search_words(text: str) -> str:
    """What the library's full-text index holds of a title or a file name: the words of `text`
    as the search compares them (`fold`), one space apart, with each character of an unspaced
    script or symbol a word (with the marks that follow it: Thai `ร์` is one, as a mark alone
    is no word a reader types); then its `_compounds`. Both backends only split it at its
    spaces (SQLite's `ascii` tokenizer; PostgreSQL's tsvector is made of them as they are, no
    parser), so they find the same rows."""
    folded, shape = _folded(text)
    words = [word for phrase in _phrases(folded, shape) for word in phrase]
    return " ".join(words + _compounds(folded, shape))


def search_phrases(text: str) -> list[list[str]]:
    """What a person typed as the index reads it: each word of `text` (read as `search_words`
    does) as the phrase of its index words, in order (`進撃の巨人` is 進 撃 の 巨 人)."""
    return _phrases(*_folded(text))
