"""A PostgreSQL server of our own: the tests' throw-away cluster and the scale-out benchmark's.

Debian's `postgresql` package (installed with apt-get when it is missing and we are root; else
the caller is told why there is none): `initdb` and `pg_ctl` in a directory owned by an
unprivileged user (PostgreSQL refuses to run as root; as root we drop to `nobody` through
`setpriv`), listening on a loopback port with trust authentication for 127.0.0.1 only and its
Unix socket inside that directory. The tests run it with `fsync=off` (the cluster dies with the
session); the benchmark with PostgreSQL's durable defaults, as SQLite's `synchronous=FULL` is
durable, and on a directory it keeps between runs (`resume` on the same files).

Self-contained (no sibling imports): `tests/helpers/postgres.py` imports it as
`tools.bench.pgcluster`, the bench scripts as `pgcluster`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "postgresql"
_DROP_TO = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
_NOBODY = 65534


def _bin_dir() -> Path | None:
    """Where Debian keeps the server binaries (/usr/lib/postgresql/<version>/bin), newest first."""
    root = Path("/usr/lib/postgresql")
    found = sorted(root.glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]), reverse=True)
    return found[0].parent if found else None


def install(package: str) -> str:
    """`apt-get install` a Debian package (an `apt-get update` first only if the plain install
    fails); the reason it could not be installed, or ''. PostgreSQL's here; the tests install
    theirs (ffmpeg, chromium, redis-server) through it too, so there is one copy of it."""
    if shutil.which("apt-get") is None:
        return f"{package} is not installed and there is no apt-get to install it"
    if os.geteuid() != 0:
        return f"{package} is not installed and installing it needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-qq", package]
    for steps in ([command], [["apt-get", "update", "-qq"], command]):
        try:
            runs = (subprocess.run(s, env=env, capture_output=True, timeout=900) for s in steps)
            if all(run.returncode == 0 for run in runs):
                return ""
        except (OSError, subprocess.TimeoutExpired):
            continue
    return f"apt-get install {package} failed"


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
    """A PostgreSQL cluster of our own in `root`; `stop()` ends it and removes its files,
    `pause()` ends it and keeps them (`resume()` runs it again)."""

    bin_dir: Path
    root: Path
    port: int
    durable: bool = False  # fsync on (the benchmark) or off (the tests)
    options: tuple[str, ...] = ()  # more `-c name=value` settings
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
        """Make the cluster (unless `root` already holds one) and run it."""
        if os.geteuid() == 0:
            os.chown(self.root, _NOBODY, _NOBODY)
        if not (self.data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "-E", "UTF8", "--no-locale")
            (self.data / "pg_hba.conf").write_text(
                "local all all trust\nhost all all 127.0.0.1/32 trust\n"
            )
        self.resume()
        return self

    def resume(self) -> None:
        """Run the server (again, after `pause`) on the same port and files."""
        settings = [
            "listen_addresses=127.0.0.1",
            f"port={self.port}",
            f"unix_socket_directories={self.root}",
            f"fsync={'on' if self.durable else 'off'}",
            "max_connections=300",
            *self.options,
        ]
        log = str(self.root / "server.log")
        options = " ".join(f"-c {setting}" for setting in settings)
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")

    def pause(self) -> None:
        """Stop the server at once, as a crash or an outage would (its files stay)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def _processes(self) -> list[int]:
        """The server's processes: the postmaster (its pid file's first line) and its
        children (by their parent, from /proc)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # it ended meanwhile
                continue
            if int(fields[1]) == postmaster:
                children.append(int(stat.parent.name))
        return [postmaster, *children]

    def freeze(self) -> None:
        """Stop every server process where it stands (SIGSTOP), connections left open: a
        server that no longer answers, as a frozen host or a network that drops packets
        looks to its clients. New connections are still accepted by the kernel, and then
        wait. `thaw()` lets it run on."""
        postmaster, *_ = self._processes()
        os.kill(postmaster, signal.SIGSTOP)  # first: stopped, it forks no backend any more
        for pid in self._processes()[1:]:  # listed after: one forked meanwhile is stopped too
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Let a frozen server run on (SIGCONT); harmless on one that is not frozen."""
        for pid in self._processes():
            os.kill(pid, signal.SIGCONT)

    def sql(self, *statements: str) -> list[tuple[object, ...]]:
        """Run statements on the `postgres` database, each in autocommit (CREATE DATABASE); the
        last one's rows."""
        import psycopg

        rows: list[tuple[object, ...]] = []
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            for statement in statements:
                cursor = conn.execute(statement.encode())
                rows = cursor.fetchall() if cursor.description else []
        return rows

    def database_bytes(self, dsn: str) -> int:
        """Bytes on disk of the database of `dsn` (tables, indexes, TOAST: `pg_database_size`)."""
        name = dsn.rsplit("/", 1)[1]
        ((size,),) = self.sql(f"SELECT pg_database_size('{name}')")
        return int(str(size))

    def database(self, name: str | None = None) -> str:
        """A new, empty database (named `name`, else the next `t<n>`); its DSN."""
        name = name or f"t{next(self._numbers)}"
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


def start_cluster(
    root: Path, port: int, durable: bool = False, options: tuple[str, ...] = ()
) -> tuple[Cluster | None, str]:
    """A started cluster in `root` (made there, or the one made there before), or (None, why
    not)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None, "psycopg is not installed (pip install metanode[postgresql])"
    bin_dir, why = server_binaries()
    if bin_dir is None:
        return None, why
    return Cluster(bin_dir, root, port, durable, options).start(), ""
