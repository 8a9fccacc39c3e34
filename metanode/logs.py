"""Logging: one JSON object per line for machines, readable lines on a terminal; request ids.

Every log record made while a request is handled carries that request's id (from its
`X-Request-ID` header, or a fresh one), so the lines of one request can be found together.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import time
from typing import Any

from metanode import jsonl

log = logging.getLogger(__name__)
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", "request_id", …extra}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return jsonl.dumps(entry, default=str)


# C0 and C1 control characters and DEL, as Python writes them in a string (`\n`, `\x1b`): what
# a terminal takes for a line end or a command, written so that it is neither
CONTROLS = {code: ascii(chr(code))[1:-1] for code in (*range(0x20), *range(0x7F, 0xA0))}


class ReadableFormatter(logging.Formatter):
    """`<time> <level> <logger> [<request id>] <message>`, a line whose message cannot end it
    or command the terminal: its control characters are written escaped (`CONTROLS`).
    A message quotes what others chose (a request's path in the access line, a file name of
    the media a plugin failed on): a line feed there wrote a line of the attacker's wording,
    an escape sequence recoloured or retitled the terminal. A traceback keeps its lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(CONTROLS)


def configure(level: str, json_lines: bool | None = None) -> None:
    """Send all logs (uvicorn's too) to stderr, as JSON unless stderr is a terminal."""
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if json_lines else ReadableFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # httpx logs every request at info: a peer follower polling each second would fill the log
    # (its failures are logged by metanode.peers); watchfiles logs `N changes detected` at info
    # for every batch of file events: a library being written to (a download) filled the log
    # with them, where the watcher logs what it does with them itself
    for chatty in ("httpx", "watchfiles"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))


def progress_bar(sizes: bool = False) -> Any:
    """A transient rich progress bar on stderr (description, bar, done of total, time left): the
    one look of every long command's progress (export, import, the MetaMesh migration tool).
    With `sizes` the task counts bytes (shown as sizes, with a speed) and carries a `files`
    field, e.g. "3/12 files" (`scan`). rich is imported here, lazily, so a command that shows
    no bar never pays for it."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    counts = (
        (DownloadColumn(), TransferSpeedColumn(), TextColumn("{task.fields[files]}"))
        if sizes
        else (MofNCompleteColumn(),)
    )
    console = Console(stderr=True)
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        *counts,
        TimeRemainingColumn(),
        transient=True,
        console=console,
        disable=not console.is_terminal,  # to a file or a pipe, it left blank lines behind
    )


def said_if_failed(task: asyncio.Task[Any]) -> None:
    """A done-callback for a task that runs as long as the node (retention, the watcher, the
    plugin host, a peer's follower): an unforeseen exception that ends it is logged at once,
    with its traceback, where it waited, unseen, for the node's stop to gather it (/health
    said only that it had stopped)."""
    if not task.cancelled() and (failure := task.exception()) is not None:
        log.error("%s stopped: %s", task.get_name(), failure, exc_info=failure)
