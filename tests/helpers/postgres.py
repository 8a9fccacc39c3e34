"""A real, throw-away PostgreSQL server for the tests of the PostgreSQL backend.

The cluster itself is `tools/bench/pgcluster.py` (shared with the scale-out benchmark):
Debian's `postgresql` package (installed with apt-get when it is missing and we are root; else
the tests that need it skip, saying why), `initdb` and `pg_ctl` as an unprivileged user on a
free loopback port. Here in a temporary directory and with `fsync=off`: the cluster dies with
the test session, and the tests' two shared cores are better spent elsewhere. Each test gets a
database of its own (`Cluster.database`), made from `template0` and dropped after the test.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.helpers.server import free_port
from tools.bench import pgcluster
from tools.bench.pgcluster import Cluster

__all__ = ["BACKENDS", "Cluster", "Storages", "every_row", "start_cluster"]


def start_cluster(options: tuple[str, ...] = ()) -> tuple[Cluster | None, str]:
    """A started cluster in a new temporary directory (`stop()` removes it), with more server
    settings (`name=value`) if given, or (None, why not)."""
    root = Path(tempfile.mkdtemp(prefix="metanode-pg-"))
    return pgcluster.start_cluster(root, free_port(), options=options)


BACKENDS: Sequence[str] = ("sqlite", "postgresql")


class Storages:
    """Fresh `storage` settings for a test that needs several stores, or one per hypothesis
    example (the `storages` fixture): `with storages() as storage:` gives `sqlite`, or a new
    PostgreSQL database dropped at the end of the block."""

    def __init__(self, cluster: Cluster | None) -> None:
        self._cluster = cluster

    @contextlib.contextmanager
    def __call__(self) -> Iterator[str]:
        if self._cluster is None:
            yield "sqlite"
            return
        dsn = self._cluster.database()
        try:
            yield dsn
        finally:
            self._cluster.drop(dsn)


def every_row(node: Any) -> dict[str, list[Any]]:
    """schema.table → its rows, sorted, of both stores of a node on PostgreSQL: what "nothing
    was written" compares (SQLite's tests compare the files' bytes)."""
    out: dict[str, list[Any]] = {}
    for store in (node.truth, node.cache):
        conn = store.conn
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = current_schema() ORDER BY table_name"
        ).fetchall()
        for (table,) in tables:
            rows = conn.execute(f"SELECT * FROM {table}").fetchall()
            out[f"{store.name}.{table}"] = sorted(rows, key=repr)
    return out
