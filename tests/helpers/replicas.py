"""Several `metanode serve` replicas on one PostgreSQL database (docs/scale-out.md, "Replicas").

Each replica has a data directory of its own (its lock, its owner socket) holding copies of the
first one's keys and API token, as the operator's guide says to lay them out; each watches an
empty media folder of its own.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.server import Server
from tests.helpers.wait import poll

LOCK_NAME = "lock"  # metanode/datadir.py's: never copied (it names the holder's pid)


def health(server: Server) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{server.url}/health", timeout=10).json()
    return body


def clone(server: Server, data_dir: Path, dsn: str) -> Server:
    """A replica of `server`: its data directory copied (keys, token), the same database."""
    shutil.copytree(server.data_dir, data_dir, ignore=shutil.ignore_patterns(LOCK_NAME, "*.sock"))
    return Server(data_dir, env={"METANODE_STORAGE": dsn})


@contextmanager
def replicas(root: Path, dsn: str, count: int) -> Iterator[list[Server]]:
    """`count` started replicas on the database `dsn`; the first holds the applier lock (it
    started alone), the others follow it. Each is SIGKILLed at the end if still running."""
    (root / "r0").mkdir(parents=True, exist_ok=True)
    first = Server(root / "r0" / "data", env={"METANODE_STORAGE": dsn})
    started = [first]
    try:
        first.start()
        poll(lambda: health(first)["applier"] or None, "the first replica to take the lock")
        for n in range(1, count):
            started.append(clone(first, root / f"r{n}" / "data", dsn).start())
        yield started
    finally:
        for server in started:
            if server.proc is not None:
                server.stop(9)


def applier_of(servers: list[Server]) -> Server:
    """The one replica that says it applies (exactly one must), waiting for a takeover."""

    def one() -> Server | None:
        live = [s for s in servers if s.proc is not None and s.proc.poll() is None]
        leading = [s for s in live if health(s)["applier"]]
        assert len(leading) <= 1, f"{len(leading)} replicas apply at once"
        return leading[0] if leading else None

    return poll(one, "one replica to hold the applier lock")
