"""fileinfo: what kind of file this is — `fileName`, `extension`, `mimeType`, `fileType`.

The MIME type comes from the file's first bytes (puremagic) where they are recognised, else from
the extension; for containers whose bytes cannot tell audio from video (Matroska, Ogg, MPEG-TS)
a curated table by extension decides. `fileType` is one of audio, video, image, document,
archive, subtitle, torrent, other. Subtitles and torrents are text or bencode that content
sniffing cannot tell apart from other text, so for them the extension decides.

This module is the tutorial for the simplest kind of plugin: a pure function of the file, a
handful of `register` calls.
"""

from __future__ import annotations

import mimetypes
import os

import puremagic

from metanode.plugins import LocalFile, Plugin, RecordLookup, Register

__all__ = ["FileInfo", "describe", "file_type", "sniff_mime"]

SUBTITLES = frozenset({"srt", "ass", "ssa", "sub", "idx", "vtt", "sup", "smi", "ttml"})
ARCHIVES = frozenset(
    {"zip", "rar", "7z", "tar", "gz", "tgz", "bz2", "xz", "zst", "lz", "cab", "iso", "dmg"}
)
DOCUMENTS = frozenset(
    {
        "pdf",
        "epub",
        "mobi",
        "azw3",
        "djvu",
        "doc",
        "docx",
        "odt",
        "rtf",
        "txt",
        "md",
        "nfo",
        "xls",
        "xlsx",
        "ods",
        "ppt",
        "pptx",
        "odp",
        "cbz",
        "cbr",
    }
)
EXTRA_TYPES = {
    "mkv": "video/x-matroska",
    "mka": "audio/x-matroska",
    "srt": "application/x-subrip",
    "ass": "text/x-ssa",
    "ssa": "text/x-ssa",
    "vtt": "text/vtt",
    "torrent": "application/x-bittorrent",
    "nfo": "text/plain",
    "flac": "audio/flac",
    "opus": "audio/opus",
    "webm": "video/webm",
    "m4b": "audio/mp4",
    "7z": "application/x-7z-compressed",
    "epub": "application/epub+zip",
    "ogg": "audio/ogg",
    "oga": "audio/ogg",
    "ogv": "video/ogg",
    "ts": "video/mp2t",
    "m2ts": "video/mp2t",
    "mts": "video/mp2t",
}
# Containers whose magic bytes cannot tell audio from video (Matroska, Ogg) or that sniffing
# misses (MPEG-TS): for these the extension decides the kind and the MIME type.
AUDIO = frozenset({"mka", "ogg", "oga", "opus", "flac", "mp3", "m4a", "m4b", "aac", "wav", "wma"})
VIDEO = frozenset(
    {
        "mkv",
        "ogv",
        "ts",
        "m2ts",
        "mts",
        "mp4",
        "m4v",
        "avi",
        "mov",
        "webm",
        "wmv",
        "mpg",
        "mpeg",
        "vob",
        "flv",
    }
)
ARCHIVE_MIMES = frozenset(
    {
        "application/zip",
        "application/x-rar-compressed",
        "application/vnd.rar",
        "application/x-7z-compressed",
        "application/gzip",
        "application/x-bzip2",
        "application/x-xz",
        "application/x-tar",
        "application/zstd",
        "application/x-iso9660-image",
    }
)
DOCUMENT_MIMES = frozenset(
    {
        "application/pdf",
        "application/epub+zip",
        "application/msword",
        "application/rtf",
        "text/plain",
        "text/markdown",
    }
)


def extension_of(name: str) -> str:
    return os.path.splitext(name)[1][1:].lower()


def sniff_mime(path: str) -> str | None:
    """The MIME type the content's magic bytes give, the most confident match first."""
    try:
        matches = puremagic.magic_file(path)
    except (puremagic.PureError, OSError, ValueError):
        return None
    typed = [m for m in matches if m.mime_type]
    return max(typed, key=lambda m: m.confidence).mime_type if typed else None


def guess_mime(name: str) -> str | None:
    ext = extension_of(name)
    return EXTRA_TYPES.get(ext) or mimetypes.guess_type(name, strict=False)[0]


def file_type(extension: str, mime: str | None) -> str:
    """The coarse kind of a file from its extension and MIME type."""
    if extension in SUBTITLES:
        return "subtitle"
    if extension == "torrent" or mime == "application/x-bittorrent":
        return "torrent"
    if extension in AUDIO:
        return "audio"
    if extension in VIDEO:
        return "video"
    top = (mime or "").split("/")[0]
    if top in ("audio", "video", "image"):
        return top
    if extension in ARCHIVES or mime in ARCHIVE_MIMES:
        return "archive"
    if extension in DOCUMENTS or mime in DOCUMENT_MIMES:
        return "document"
    return "other"


def describe(path: str) -> dict[str, str]:
    """The claims fileinfo makes about one file."""
    name = os.path.basename(path)
    extension = extension_of(name)
    mime = EXTRA_TYPES.get(extension)
    if mime is None and extension not in SUBTITLES:
        mime = sniff_mime(path)
    mime = mime or guess_mime(name)
    out = {"fileName": name, "fileType": file_type(extension, mime)}
    if extension:
        out["extension"] = extension
    if mime:
        out["mimeType"] = mime
    return out


class FileInfo(Plugin):
    name = "fileinfo"
    version = "1"
    path_dependent = True  # `fileName` and `extension` follow a rename or a move

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        for key, value in describe(file.path).items():
            register(file.cid, key, value)
