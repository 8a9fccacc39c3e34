"""A real `metanode serve` subprocess on a loopback port, and the checks made against one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

from tests.helpers.wait import DEADLINE_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A real `metanode serve` process (uvicorn) on a loopback port.

    Hermetic: the caller's `METANODE_*` variables are dropped; the watcher watches
    `<data_dir>/../media` (never the checkout's ./media) and plugins are off, unless `env` says
    otherwise. Its log goes to `log` (default `serve.log` beside the data directory), which
    `print_log` shows, e.g. at the end of a test (pytest shows it if the test failed).
    """

    data_dir: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    workers: int = 1  # `serve --workers`: 1 is the simple mode most tests mean
    prefix: tuple[str, ...] = ()  # a command it runs under (`setpriv …`: root's powers dropped)
    unset: tuple[str, ...] = ()  # variables of `base_env` it runs without (METANODE_WATCH_ROOTS)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.data_dir / "api-token").read_text().strip()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def storage(self) -> str:
        """Where its stores are (`METANODE_STORAGE`): `sqlite` unless `env` says otherwise."""
        return self.env.get("METANODE_STORAGE", "sqlite")

    @property
    def media(self) -> Path:
        return self.data_dir.parent / "media"

    def base_env(self) -> dict[str, str]:
        """The environment `env` is laid over."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
        # A POST answers 200 once the cache has applied it, 202 if that took `apply_wait_s`: a
        # wall-clock limit. Tests assert 200 (read-your-writes), so on a machine whose cores
        # are busy the limit must not be what decides: 120 s instead of the default 5 s (a test
        # of the 202 sets its own). Likewise `feed_stall_s` (60 s by default) cuts a feed whose
        # client took no byte for that long: a test that holds one stream unread while it
        # ingests or reads another (a stalled subscriber, followers read in turn) took longer
        # than that with both cores busy and got a reset, not the events it waits for; a test
        # of the cut (test_feed_stall.py) sets its own.
        env.update(
            {
                "METANODE_WATCH_ROOTS": str(self.media),
                "METANODE_PLUGINS_ENABLED": "false",
                "METANODE_APPLY_WAIT_S": "120",
                "METANODE_FEED_STALL_S": "3600",
            }
        )
        return env

    def start(self) -> Self:
        """Start it and wait until it answers; on another port if the free one was taken."""
        self.log = self.log or self.data_dir.parent / "serve.log"
        for _attempt in range(3):
            with self.log.open("ab") as log:
                self.proc = subprocess.Popen(
                    [
                        *self.prefix,
                        sys.executable,
                        "-m",
                        "metanode",
                        "serve",
                        "--data-dir",
                        str(self.data_dir),
                        "--port",
                        str(self.port),
                        "--workers",
                        str(self.workers),
                    ],
                    env={
                        k: v
                        for k, v in {**self.base_env(), **self.env}.items()
                        if k not in self.unset
                    },
                    cwd=self.data_dir.parent,
                    stdout=log,
                    stderr=log,
                )
            if self._up():
                return self
            self.port = free_port()  # exited at once: the port was taken meanwhile
        raise RuntimeError(f"metanode serve did not start: {self.log_text()}")

    def _up(self) -> bool:
        """Whether it came up (False if it exited); the port must answer with our token, since
        other processes on this machine pick free ports too.

        Bounded by `DEADLINE_S`, a bound on a hang: with both cores busy a start of two workers
        on PostgreSQL took 30 s, past the 30 s this once allowed. One that never came up is
        stopped before the error, never left serving (and spending a core) for the rest of the
        run with its database dropped under it."""
        assert self.proc is not None
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    mine = httpx.get(f"{self.url}/api/signers", headers=self.headers, timeout=5)
                    assert mine.status_code == 200, f"port {self.port} is not our server"
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"metanode serve did not come up in {DEADLINE_S} s: {self.log_text()}")

    def meta(self, cid: str) -> dict[str, Any] | None:
        """GET /api/meta/<cid> (public), or None on 404."""
        response = httpx.get(f"{self.url}/api/meta/{cid}", timeout=DEADLINE_S)
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def register(self, uid: str, name: str, **fields: Any) -> None:
        """POST /api/signers: register `uid` (weight, may_link … as `fields`); it must work."""
        response = httpx.post(
            f"{self.url}/api/signers",
            headers=self.headers,
            json={"uid": uid, "name": name, **fields},
            timeout=DEADLINE_S,
        )
        assert response.status_code == 200, response.text

    def stop(self, sig: int = 15, grace: float = 30.0) -> int:
        """Send `sig`; SIGKILL if it has not exited within `grace` seconds (a wedged node)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)

    def rss_mib(self) -> float:
        """Its resident memory now (`VmRSS`), in MiB."""
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def log_messages(self) -> list[str]:
        """The `msg` of each JSON line of its log (the log's own escapes undone)."""
        lines = self.log_text().splitlines()
        return [json.loads(line)["msg"] for line in lines if line.startswith("{")]

    def print_log(self) -> None:
        print(f"--- {self.log} ---\n{self.log_text()}")


def serve_refused(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`metanode serve ARGS` in `cwd` with exactly `env`, run to its end: a start the test
    expects refused (its exit code and stderr are the test's to check)."""
    return subprocess.run(
        [sys.executable, "-m", "metanode", "serve", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def role_pids(srv: Server) -> dict[str, int]:
    """The live worker processes of a `--workers N` server's supervisor, by role (a killed one
    not yet reaped has no command line any more)."""
    assert srv.proc is not None
    out = {}
    for pid in children(srv.proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--worker" in argv:
            out[argv[argv.index(b"--worker") + 1].decode().split(":")[0]] = pid
    return out


def wait_caught_up(url: str, timeout: float = DEADLINE_S) -> dict[str, Any]:
    """Poll /health until the cache has applied every truth change, or fail saying so (each
    bound a bound on a hang, not a measurement: 15 s and a 5 s read were near what a start's
    catching up takes with both cores busy)."""
    deadline = time.monotonic() + timeout
    health: dict[str, Any] = {}
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=DEADLINE_S).json()
        if health["cache_ready"] and health["apply_lag"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the cache did not catch up within {timeout} s: {health}")


def metanode_check(data_dir: Path, storage: str = "sqlite") -> str:
    """Run `metanode check` on a data directory (its stores on `storage`); it must exit 0 and
    say clean."""
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "check", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "METANODE_STORAGE": storage},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "clean" in done.stdout, done.stdout
    return done.stdout


# The environment of a server that runs the built-in plugins on what its watcher sees, settling
# files quickly (the plugin and page tests drop files and wait for the plugins' claims).
PLUGINS_ON = {"METANODE_PLUGINS_ENABLED": "true", "METANODE_WATCH_SETTLE_S": "0.3"}


@contextlib.contextmanager
def plugins_server(data_dir: Path, **env: str) -> Iterator[Server]:
    """A started server with `PLUGINS_ON` (and `env`) and its media folder made; stopped after."""
    server = Server(data_dir, env={**PLUGINS_ON, **env}).start()
    server.media.mkdir(exist_ok=True)
    try:
        yield server
    finally:
        server.stop()
