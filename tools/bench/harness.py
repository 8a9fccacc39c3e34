"""Shared plumbing of the server benchmarks: free ports, server subprocesses, signers, stats.

Imported by `ingest.py`, `read.py` and `scale.py` as a sibling module: run those scripts as
`.venv/bin/python tools/bench/<name>.py` (the script's directory is then on `sys.path`).
Every server binds 127.0.0.1 and is stopped (SIGTERM, then SIGKILL after a bounded wait) when
its `with` block ends, whatever happened inside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import nacl.signing

from metanode import claims, config

T = TypeVar("T")

HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
REPO = Path(__file__).resolve().parents[2]


# The keys the read benchmarks give their records (a record has the first N of them).
RECORD_KEYS = (
    "title",
    "year",
    "genre",
    "director",
    "language",
    "runtime",
    "country",
    "rating",
    "description",
    "studio",
)


def bench_settings(data_dir: Path, **overrides: object) -> config.Settings:
    """The settings of a node started in a bench's own process: no watcher, no plugins, and
    an answer waited for however long a busy core delays it (never turned into a 202);
    `overrides` on top."""
    return config.load(
        env={},
        overrides={
            "data_dir": data_dir,
            "watch_enabled": False,
            "plugins_enabled": False,
            "apply_wait_s": 120.0,
            **overrides,
        },
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a server: ours without any METANODE_* setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    env.update(extra)
    return env


@dataclass
class ServerProc:
    """A server subprocess on a loopback port (metanode serve, or the bare baseline app)."""

    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=clean_env)
    cwd: Path | None = None
    log_path: Path | None = None  # the server's stdout and stderr (else discarded)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, ready_path: str, ready: Any = None) -> ServerProc:
        """Start and wait (bounded) until GET `ready_path` answers 200 and `ready(json)` holds."""
        log = self.log_path
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT
            )
        finally:
            if not isinstance(out, int):
                out.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.argv[:4]} exited with {self.proc.returncode}{self.log_tail()}"
                )
            try:
                r = httpx.get(self.url + ready_path, timeout=2)
                if r.status_code == 200 and (ready is None or ready(r.json())):
                    return self
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{self.argv[:4]} did not come up in {START_TIMEOUT_S:.0f} s{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "; its output ends:\n" + "\n".join(tail)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def status(self, field_name: str) -> str:
        """A line of /proc/<pid>/status, e.g. `VmRSS` → '123456 kB'."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return line.split(":", 1)[1].strip()
        return "?"

    def rss_mib(self, field_name: str = "VmRSS") -> float:
        parts = self.status(field_name).split()
        return int(parts[0]) / 1024 if parts and parts[0].isdigit() else math.nan


def metanode_argv(data_dir: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "metanode",
        "serve",
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
    ]


@contextmanager
def metanode_server(data_dir: Path, **env: str) -> Iterator[ServerProc]:
    """A real `metanode serve` (uvicorn) on a fresh port, ready once its cache is ready; one
    process unless `env` sets `METANODE_WORKERS` (tools/bench/workers.py)."""
    port = free_port()
    server = ServerProc(
        metanode_argv(data_dir, port),
        port,
        clean_env(**{"METANODE_WORKERS": "1", **env}),
        cwd=data_dir.parent,
        log_path=data_dir.parent / f"serve-{port}.log",
    )
    try:
        server.start("/health", lambda body: bool(body.get("cache_ready")))
        yield server
    finally:
        server.stop()


def token(data_dir: Path) -> str:
    return (data_dir / "api-token").read_text(encoding="ascii").strip()


def auth(data_dir: Path) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(data_dir)}"}


def register_signer(server: ServerProc, data_dir: Path, key: nacl.signing.SigningKey) -> str:
    """POST /api/signers for `key`; returns its uid."""
    uid = str(claims.uid_of(bytes(key.verify_key)))
    r = httpx.post(
        server.url + "/api/signers",
        headers=auth(data_dir),
        timeout=30,
        json={"uid": uid, "name": "bench", "weight": 1, "may_link": False},
    )
    if r.status_code != 200:
        raise RuntimeError(f"POST /api/signers answered {r.status_code}: {r.text}")
    return uid


def claims_body(batch: Sequence[claims.Claim]) -> bytes:
    """A POST /api/claims body, serialised once up front so the client does no JSON work."""
    return json.dumps({"claims": [c.wire() for c in batch]}, ensure_ascii=False).encode()


def post_all(server: ServerProc, data_dir: Path, bodies: Sequence[bytes]) -> None:
    """Post bodies one after another (used to populate a node, untimed); all must be 200."""
    headers = {**auth(data_dir), "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
        for body in bodies:
            r = client.post("/api/claims", content=body)
            if r.status_code != 200:
                raise RuntimeError(f"POST /api/claims answered {r.status_code}: {r.text[:500]}")


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def dir_size(path: Path, names: Sequence[str]) -> int:
    """Bytes on disk of the named files in `path` (their -wal/-shm companions included)."""
    total = 0
    for name in names:
        for suffix in ("", "-wal", "-shm"):
            f = path / (name + suffix)
            if f.exists():
                total += f.stat().st_blocks * 512
    return total


@contextmanager
def py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """Sample `pid` with py-spy (if `out` is set) for the duration of the block.

    Writes py-spy's raw (collapsed-stack) output to `out`, one line per thread and stack.
    """
    if out is None:
        yield
        return
    exe = Path(sys.executable).with_name("py-spy")
    spy = subprocess.Popen(
        [
            str(exe),
            "record",
            "--pid",
            str(pid),
            "--rate",
            "200",
            "--threads",
            "--nonblocking",
            "--format",
            "raw",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # let it attach before the measured phase starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait(timeout=STOP_TIMEOUT_S)


def profile_summary(path: Path, top: int = 25) -> str:
    """Inclusive share of samples per thread and per function (file:function) of a raw profile."""
    threads: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    leaf: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        threads[frames[0]] = threads.get(frames[0], 0) + count
        seen: set[str] = set()
        label = "?"
        for frame in frames[1:]:
            name, _, where = frame.partition(" (")
            label = f"{where.split(':')[0].rsplit('/', 1)[-1]}:{name}"
            if label not in seen:
                seen.add(label)
                inclusive[label] = inclusive.get(label, 0) + count
        leaf[label] = leaf.get(label, 0) + count
    if not total:
        return "no samples"

    def ranked(table: dict[str, int], limit: int) -> list[str]:
        return [
            f"  {n / total:6.1%}  {k}"
            for k, n in sorted(table.items(), key=lambda kv: -kv[1])[:limit]
        ]

    out = [f"{total} samples; by thread:", *ranked(threads, 20)]
    out += ["inclusive (function and everything it calls):", *ranked(inclusive, top)]
    out += ["self (the innermost Python frame; C calls count to their caller):", *ranked(leaf, top)]
    return "\n".join(out)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a supervisor and its workers), from /proc's children lists."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(child) for child in task.read_text().split()]
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds so far of `pid` and its descendants' threads (exited ones not counted)."""
    total = 0.0
    for each in process_tree(pid):
        with contextlib.suppress(OSError):
            total += sum(task_cpu(each).values())
    return total


def task_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of every thread of `pid`, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


@dataclass
class CpuMeter:
    """CPU seconds a process's threads spent during a `with` block, and the block's wall time;
    with `tree`, its descendants' threads too (`serve --workers N`: the supervisor's workers)."""

    pid: int
    wall: float = 0.0
    by_tid: dict[int, float] = field(default_factory=dict)
    tree: bool = False

    def _tasks(self) -> dict[int, float]:
        if not self.tree:
            return task_cpu(self.pid)
        out: dict[int, float] = {}
        for each in process_tree(self.pid):
            with contextlib.suppress(OSError):
                out.update(task_cpu(each))
        return out

    def __enter__(self) -> CpuMeter:
        self._before = self._tasks()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._start
        after = self._tasks()
        self.by_tid = {tid: t - self._before.get(tid, 0.0) for tid, t in after.items()}

    @property
    def total(self) -> float:
        return sum(self.by_tid.values())

    def report(self, names: dict[int, str] | None = None) -> str:
        """`server CPU 9.1 s over 7.4 s wall (1.23 cores): truth-writer 2.1 s, …`."""
        names = names or {}
        busy = sorted(((t, tid) for tid, t in self.by_tid.items() if t >= 0.01), reverse=True)
        parts = [f"{names.get(tid, f'tid {tid}')} {t:.2f} s" for t, tid in busy]
        return (
            f"server CPU {self.total:.2f} s over {self.wall:.2f} s wall "
            f"({self.total / self.wall:.2f} cores): " + ", ".join(parts)
        )


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id → Python thread name, from `py-spy dump` (empty if py-spy is missing)."""
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        return {}
    try:
        dump = subprocess.run(
            [str(exe), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names: dict[int, str] = {}
    for line in dump.splitlines():  # 'Thread 18426 (idle): "MainThread"'
        words = line.split(None, 2)
        if len(words) == 3 and words[0] == "Thread" and words[1].isdigit() and '"' in words[2]:
            names[int(words[1])] = words[2].split('"')[1]
    return names


async def post_batches(
    url: str, headers: dict[str, str], bodies: Sequence[bytes], sizes: Sequence[int], clients: int
) -> float:
    """Post every body with `clients` concurrent keep-alive clients; seconds first post → last."""
    queue: asyncio.Queue[tuple[bytes, int]] = asyncio.Queue()
    for item in zip(bodies, sizes, strict=True):
        queue.put_nowait(item)
    failures: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                body, size = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            r = await client.post("/api/claims", content=body)
            if r.status_code != 200:
                failures.append(f"{r.status_code}: {r.text[:300]}")
            elif r.json().get("accepted") != size:
                failures.append(f"200 but not all accepted: {r.text[:300]}")

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    pool = [
        httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits)
        for _ in range(clients)
    ]
    try:
        # Open every connection before the clock starts, so the timing is of ingest, not TCP setup.
        await asyncio.gather(*(c.get("/health") for c in pool))
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in pool))
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.aclose() for c in pool))
    if failures:
        raise RuntimeError(f"{len(failures)} batch(es) failed; first: {failures[0]}")
    return elapsed


# The Lua `done` of every wrk script: one `BENCH` line that `run_wrk` reads.
WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH %d %d %d %d %d %d %d %d %d\\n", summary.requests,
    summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class Run:
    rate: float  # requests per second
    p50_ms: float
    p99_ms: float
    requests: int


def run_wrk(url: str, script: Path, duration: float, connections: int, threads: int) -> Run:
    seconds = max(1, round(duration))
    proc = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{connections}",
            f"-d{seconds}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{proc.stdout}\n{proc.stderr}")
    requests, duration_us, *errors, p50_us, p99_us = (int(x) for x in line.split()[1:])
    if any(errors):
        raise RuntimeError(f"wrk saw errors (connect, read, write, non-2xx, timeout) = {errors}")
    return Run(requests / (duration_us / 1e6), p50_us / 1e3, p99_us / 1e3, requests)


async def max_stall_ms(work: Awaitable[T]) -> tuple[T, float]:
    """`work`'s result, and the longest the loop went without running a 1 ms ticker meanwhile."""
    worst = 0.0
    done = False

    async def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    try:
        result = await work
    finally:
        done = True
        await ticker
    return result, worst * 1e3


def add_hot_documents(parser: argparse.ArgumentParser) -> None:
    """`--hot-documents N`: the servers' `hot_documents` setting (default: its default)."""
    parser.add_argument(
        "--hot-documents",
        type=int,
        default=config.Settings().hot_documents,
        metavar="N",
        help="the servers' hot_documents setting (default: its default)",
    )
