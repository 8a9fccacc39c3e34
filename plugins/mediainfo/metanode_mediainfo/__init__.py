"""mediainfo: what the container says — duration, picture size, codecs, audio channels and
languages, embedded subtitle tracks, bitrate — and an audio file's tags.

Stream facts come from `ffprobe` (Debian's `ffmpeg` package) as JSON, run as a subprocess with
a time limit; it reads the container's headers, not the whole file (docs/benchmarks.md,
"plugins": a fraction of a per cent of a 4 GiB file). Audio tags (artist, album, title, year,
track, disc) come from `mutagen`, which reads only the tag blocks. Where `ffprobe` is missing
(or fails on the file) the run is skipped with the reason recorded (`GET /api/plugins` counts
it as `skipped`); the tags are claimed all the same, and no other plugin waits for this one.

The keys and their value formats are in docs/plugins.md ("mediainfo"). This plugin reads the
bytes, never the name: a rename does not run it again. Its weight (2) is above filename's, for
the few keys both could claim (`title` and `year` of an audio file, which filename never claims).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any

import mutagen

from metanode.plugins import LocalFile, Plugin, RecordLookup, Register, Skip

__all__ = ["MediaInfo", "audio_tags", "ffprobe_argv", "probe", "stream_facts"]

AUDIO = frozenset({"mp3", "flac", "m4a", "aac", "ogg", "oga", "opus", "wav", "wma", "aiff", "ape"})
VIDEO = frozenset(
    {"mkv", "mp4", "m4v", "avi", "mov", "webm", "wmv", "ts", "m2ts", "mpg", "mpeg", "flv", "ogv"}
)
FFPROBE_ENV = "MEDIAINFO_FFPROBE"  # the ffprobe to run: a name on PATH or a path
TIMEOUT_S = 60.0
# ffprobe reads at most this much to find the streams (its default is 5 MB)
PROBE_BYTES = 5_000_000


class ProbeFailed(Exception):
    """ffprobe is missing, timed out or refused the file."""


def ffprobe_argv(tool: str, path: str) -> list[str]:
    """The ffprobe command line (the benchmark measures what this very command reads)."""
    return [
        tool,
        "-v",
        "error",
        "-hide_banner",
        "-probesize",
        str(PROBE_BYTES),
        "-print_format",
        "json",
        "-show_format",
        "-show_streams",
        path,
    ]


def probe(path: str, ffprobe: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """ffprobe's JSON description of the file's format and streams (headers only)."""
    tool = shutil.which(ffprobe)
    if tool is None:
        raise ProbeFailed(f"{ffprobe} not found (install Debian's ffmpeg)")
    if not os.path.isabs(path):
        path = os.path.abspath(path)  # never read as an option
    try:
        done = subprocess.run(
            ffprobe_argv(tool, path), capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"ffprobe took longer than {timeout_s} s") from None
    if done.returncode != 0:
        # the file's path out of the reason (`<path>: Invalid data found …`): the node counts
        # the runs skipped for each reason, and one a file counted nothing (the log names it).
        # Out of the whole text before it is cut into lines: a name holding a line feed left
        # its last part as a reason of its own (`line.mkv: Invalid data …`).
        said = done.stderr.decode("utf-8", "replace").replace(path, "the file")
        message = said.strip().splitlines()
        last = message[-1] if message else done.returncode
        raise ProbeFailed(f"ffprobe failed: {last}")
    try:
        parsed: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise ProbeFailed(f"ffprobe said something that is not JSON: {exc}") from None
    return parsed


def _positive_int(value: Any) -> str | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return str(number) if number > 0 else None


def _seconds(value: Any) -> str | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return f"{number:.3f}" if number > 0 else None


def _language(stream: Mapping[str, Any]) -> str:
    tags = stream.get("tags") or {}
    language = tags.get("language") if isinstance(tags, dict) else None
    return str(language) if language else "und"


def _of_type(streams: Iterable[Any], kind: str) -> list[dict[str, Any]]:
    return [s for s in streams if isinstance(s, dict) and s.get("codec_type") == kind]


def stream_facts(described: Mapping[str, Any]) -> dict[str, str]:
    """The claims made from ffprobe's JSON (see docs/plugins.md for each key)."""
    fmt = described.get("format") or {}
    streams = described.get("streams") or []
    out: dict[str, str] = {}
    for key, value in (
        ("duration", _seconds(fmt.get("duration"))),
        ("bitRate", _positive_int(fmt.get("bit_rate"))),
        ("container", fmt.get("format_name") or None),
    ):
        if value:
            out[key] = str(value)
    video = [
        s
        for s in _of_type(streams, "video")
        if not (s.get("disposition") or {}).get("attached_pic")
    ]
    if video:
        first = video[0]
        for key, value in (
            ("width", _positive_int(first.get("width"))),
            ("height", _positive_int(first.get("height"))),
            ("videoStreamCodec", first.get("codec_name")),
        ):
            if value:
                out[key] = str(value)
    audio = _of_type(streams, "audio")
    if audio:
        channels = _positive_int(audio[0].get("channels"))
        if channels:
            out["audioChannels"] = channels
        if audio[0].get("codec_name"):
            out["audioStreamCodec"] = str(audio[0]["codec_name"])
        out["audioStreams"] = json.dumps(
            [
                {
                    "codec": s.get("codec_name"),
                    "channels": s.get("channels"),
                    "language": _language(s),
                }
                for s in audio
            ]
        )
        out["audioLanguages"] = json.dumps(sorted({_language(s) for s in audio}))
    subtitles = _of_type(streams, "subtitle")
    if subtitles:
        out["subtitleTracks"] = json.dumps(
            [
                {
                    "codec": s.get("codec_name"),
                    "language": _language(s),
                    "forced": bool((s.get("disposition") or {}).get("forced")),
                    "sdh": bool((s.get("disposition") or {}).get("hearing_impaired")),
                }
                for s in subtitles
            ]
        )
    return out


def _first(tags: Mapping[str, Any], name: str) -> str | None:
    values = tags.get(name)
    if isinstance(values, list) and values:
        text = str(values[0]).strip()
        return text or None
    return None


def _number(text: str | None) -> str | None:
    """`3` of a track or disc number written `3/12`."""
    head = (text or "").split("/")[0].strip()
    return str(int(head)) if head.isdigit() and int(head) > 0 else None


def audio_tags(path: str) -> dict[str, str]:
    """artist, album, albumArtist, title, year, track, disc, genre from the file's tags
    (ID3, Vorbis comments, MP4 atoms: mutagen's "easy" names); {} if it has none."""
    try:
        found = mutagen.File(path, easy=True)
    except mutagen.MutagenError:
        return {}
    if found is None or found.tags is None:
        return {}
    tags = {str(k).lower(): v for k, v in dict(found.tags).items()}
    date = _first(tags, "date") or ""
    out = {
        "artist": _first(tags, "artist"),
        "album": _first(tags, "album"),
        "albumArtist": _first(tags, "albumartist"),
        "title": _first(tags, "title"),
        "genre": _first(tags, "genre"),
        "year": date[:4] if date[:4].isdigit() else None,
        "track": _number(_first(tags, "tracknumber")),
        "disc": _number(_first(tags, "discnumber")),
    }
    return {k: v for k, v in out.items() if v is not None}


class MediaInfo(Plugin):
    name = "mediainfo"
    version = "1"
    weight = 2

    def __init__(self, ffprobe: str | None = None) -> None:
        self.ffprobe = ffprobe or os.environ.get(FFPROBE_ENV, "ffprobe")

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        extension = os.path.splitext(file.path)[1][1:].lower()
        if extension not in AUDIO and extension not in VIDEO:
            return
        claims = audio_tags(file.path) if extension in AUDIO else {}
        try:
            claims.update(stream_facts(probe(file.path, self.ffprobe)))
        except ProbeFailed as exc:
            for key, value in claims.items():
                register(file.cid, key, value)
            raise Skip(str(exc)) from None
        for key, value in claims.items():
            register(file.cid, key, value)
