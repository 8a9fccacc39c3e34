"""`POST /api/claims` handed from a reader worker to the owner worker (`serve --workers N`).

A reader worker answers `POST /api/claims` itself up to the write: it reads the body (its size
and time limits), checks the perimeter, parses the JSON and the batch's shape. Only the wire
claims cross to the owner, as plain values over a Unix socket of their own in the data
directory (`Server`, `Client`); the owner takes them where its own requests' claims go
(`Node.ingest_wire`: validated, stored in its group commit, applied to the cache) and answers
the verdicts. Before, the reader handed the owner the whole HTTP request, so the owner parsed
and routed every write a second time, and `serve --workers 2` ingested one-claim requests at
about half of `--workers 1`'s rate; now at 0.82 of it (docs/benchmarks.md, "Writes handed to
the owner as values").

The claims are validated in the owner, not the reader: a small batch is validated on the
truth writer as its group is gathered, and the requests that arrive meanwhile, from any
worker, join that group (db.Writer); claims validated in the reader arrived at the writer
ready, found nobody queued, and committed in groups half the size (measured, same section).

The frame is a 4-byte big-endian length and a `marshal` of plain values: a request is the
list of wire claims as JSON parsed them; an answer is `(status, body)` or
`("error", errors.portable(exc))`. `marshal`, not JSON or pickle: both ends are the same build
of metanode (the supervisor starts every worker from one interpreter), a one-claim batch makes
the round trip in 1.9 µs (pickle 2.0, json 6.2), and it builds values only, never objects of
arbitrary classes. The socket is the owner's alone, mode 0600 in the data directory (0700), like
`owner.sock`: who can reach it could write the databases themselves.

One request at a time on a connection; a reader keeps a pool of them, one per request in
flight. The owner answers only after the claims are committed and applied (or the apply wait
ran out: 202), as for a request it received itself. A reader that loses the owner
mid-request answers 503 `unavailable`: the claims may or may not be stored, and posting them
again is safe (a stored claim comes back `duplicate`); nothing is acknowledged before it is
durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from metanode.errors import (
    InternalError,
    MetanodeError,
    UnavailableError,
    portable,
    rebuilt,
)

log = logging.getLogger(__name__)
HEADER = 4  # bytes of a frame's length
STOP_S = 10.0  # what the requests being answered may take to finish when the owner stops
# What the owner does with handed-over wire claims: answer (status, body) as `POST /api/claims`
# would.
Ingest = Callable[[list[Any]], Awaitable[tuple[int, dict[str, Any]]]]


def frame(value: Any) -> bytes:
    """`value` as one frame: its length, then its `marshal`. Wire claims always fit: JSON
    parsing refuses nesting past about 1,000 levels (`invalid_json`), `marshal` takes 2,000."""
    data = marshal.dumps(value)
    return len(data).to_bytes(HEADER, "big") + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's value; `asyncio.IncompleteReadError` at the end of the stream."""
    size = int.from_bytes(await reader.readexactly(HEADER), "big")
    return marshal.loads(await reader.readexactly(size))


class Server:
    """The owner's end: takes handed-over batches on `path` and answers each with `ingest`'s
    answer, or the error it raised (a bug as `internal_error`, logged here)."""

    def __init__(self, path: Path, ingest: Ingest) -> None:
        self.path = path
        self.ingest = ingest
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._busy: set[asyncio.Task[None]] = set()  # ...those answering a request now
        self._stopping = False

    async def start(self) -> None:
        """Listen on `path`, a stale socket from a killed owner replaced."""
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, str(self.path))
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        """Stop listening; let the requests being answered finish (up to `STOP_S`), as uvicorn
        lets its own, and end the idle connections. A request cut off after that still
        commits if its transaction began; its reader answers 503, and its client may post it
        again."""
        if self._server is None:
            return
        self._stopping = True
        self._server.close()
        for task in self._connections - self._busy:
            task.cancel()
        if self._busy:
            await asyncio.wait(self._busy, timeout=STOP_S)
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve_frames(reader, writer, task)
        except asyncio.CancelledError:
            # `stop` cancelled it: ended here, not re-raised, as Python 3.11's stream callback
            # asks a cancelled connection task for its exception and logs the CancelledError
            # as an error with its traceback (Ctrl-C on `make serve` after one handed claim)
            return
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve_frames(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, task: asyncio.Task[None]
    ) -> None:
        """Answer the frames of one reader's connection until it closes or the server stops."""
        while not self._stopping:
            try:
                items = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the reader closed it
            self._busy.add(task)
            try:
                writer.write(frame(await self._answer(items)))
                await writer.drain()
            finally:
                self._busy.discard(task)

    async def _answer(self, items: list[Any]) -> tuple[Any, ...]:
        try:
            return await self.ingest(items)
        except MetanodeError as exc:
            return ("error", portable(exc))
        except Exception:
            log.exception("handed-over claims failed in the owner")
            return ("error", portable(InternalError("the owner worker failed; see its log")))


class Client:
    """A reader's end: hands a batch to the owner and returns its answer, or raises the error
    the owner raised; 503 `unavailable` when the owner does not answer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def ingest(self, items: list[Any]) -> tuple[int, dict[str, Any]]:
        data = frame(items)
        try:
            reader, writer = await self._connection()
        except OSError as exc:
            raise UnavailableError(
                "the owner worker is not answering (restarting?); nothing was written, retry"
            ) from exc
        try:
            writer.write(data)
            await writer.drain()
            answer = await read_frame(reader)
        except (OSError, asyncio.IncompleteReadError) as exc:
            writer.close()
            raise UnavailableError(
                "the owner worker stopped answering; the claims may or may not be stored: "
                "post them again (a stored claim comes back as a duplicate)"
            ) from exc
        except BaseException:  # cancelled mid-request: the connection's state is unknown
            writer.close()
            raise
        self._idle.append((reader, writer))
        if answer[0] == "error":
            raise rebuilt(answer[1])
        status, body = answer
        return status, body

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A pooled connection the owner has not closed (one a restarted owner left behind
        reads end-of-file), or a new one."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_unix_connection(str(self.path))

    def close(self) -> None:
        while self._idle:
            _, writer = self._idle.pop()
            with contextlib.suppress(Exception):
                writer.close()
