"""A real, throw-away PostgreSQL server for the tests of the PostgreSQL backend.

Debian's `postgresql` package (installed with apt-get when it is missing and we are root; else
the tests that need it skip, saying why): `initdb` and `pg_ctl` in a temporary directory owned
by an unprivileged user (PostgreSQL refuses to run as root; as root we drop to `nobody` through
`setpriv`), listening on a free loopback port with trust authentication for 127.0.0.1 only and
its Unix socket inside that directory. `fsync=off`: the cluster dies with the test session, and
the tests' two shared cores are better spent elsewhere. Each test gets a database of its own
(`Cluster.database`), made from `template0` and dropped after the test.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.apt import install
from tests.helpers.server import free_port

PACKAGE = "postgresql"
_DROP_TO = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]


def _bin_dir() -> Path | None:
    """Where Debian keeps the server binaries (/usr/lib/postgresql/<version>/bin), newest first."""
    root = Path("/usr/lib/postgresql")
    found = sorted(root.glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]), reverse=True)
    return found[0].parent if found else None


def server_binaries() -> tuple[Path | None, str]:
    """(the directory of initdb and pg_ctl, why there is none)."""
    found = _bin_dir()
    if found is not None:
        return found, ""
    why = install(PACKAGE)
    found = _bin_dir()
    return found, "" if found else (why or "no /usr/lib/postgresql/*/bin after installing")


@dataclass
class Cluster:
    """A running PostgreSQL cluster of our own; `stop()` ends it and removes its files."""

    bin_dir: Path
    root: Path
    port: int = field(default_factory=free_port)
    fsync: bool = False  # on for benchmarks that compare durable commits (tools/bench/scale_out.py)
    _numbers: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, tool: str, *args: str) -> None:
        prefix = _DROP_TO if os.geteuid() == 0 else []
        command = [*prefix, str(self.bin_dir / tool), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def start(self) -> Cluster:
        if os.geteuid() == 0:
            os.chown(self.root, 65534, 65534)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-E", "UTF8", "--no-locale")
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\nhost all all 127.0.0.1/32 trust\n"
        )
        self.resume()
        return self

    def resume(self) -> None:
        """Run the server (again, after `pause`) on the same port and files."""
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.root} -c fsync={'on' if self.fsync else 'off'} "
            "-c max_connections=300"
        )
        log = str(self.root / "server.log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")

    def pause(self) -> None:
        """Stop the server at once, as a crash or an outage would (its files stay)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def sql(self, *statements: str) -> None:
        """Run statements on the `postgres` database, each in autocommit (CREATE DATABASE)."""
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement.encode())

    def database(self) -> str:
        """A new, empty database; its DSN."""
        name = f"t{next(self._numbers)}"
        self.sql(f"CREATE DATABASE {name} TEMPLATE template0")
        return self.dsn(name)

    def drop(self, dsn: str) -> None:
        self.sql(f"DROP DATABASE IF EXISTS {dsn.rsplit('/', 1)[1]} WITH (FORCE)")

    def stop(self) -> None:
        """Stop the server and remove its files."""
        try:
            self.pause()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start_cluster(fsync: bool = False) -> tuple[Cluster | None, str]:
    """A started cluster (`fsync` as asked), or (None, why not)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None, "psycopg is not installed (pip install metanode[postgresql])"
    bin_dir, why = server_binaries()
    if bin_dir is None:
        return None, why
    root = Path(tempfile.mkdtemp(prefix="metanode-pg-"))
    return Cluster(bin_dir, root, fsync=fsync).start(), ""


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
