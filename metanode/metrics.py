"""Prometheus metrics of one node (GET /metrics).

Counters and histograms are updated where things happen; sizes (records, groups, merges, apply
lag, watcher and plugin state) are read when Prometheus scrapes, so they are never stale and
cost nothing between scrapes (those that count rows on a thread: `Node.metrics_text`). Each
node has its own registry, so several nodes in one process (tests) never share numbers.

Under `serve --workers N` every worker is its own process with its own instruments, yet a scrape
(answered by the owner, workers.py) must count the whole node. prometheus-client's multiprocess
mode does that: the supervisor gives every worker `PROMETHEUS_MULTIPROC_DIR` (a private folder of
the data directory, emptied when `serve` starts); each process's counters and histograms live in
its own memory-mapped files there and a scrape sums them all (`MultiProcessCollector`). Chosen
over the owner asking each reader at scrape time: a reader that died or was restarted keeps its
counts (a counter never goes backwards), no reader needs a door of its own, and a scrape never
waits on a busy reader. The open-feed gauge is summed over the live processes only (`livesum`:
the supervisor drops a dead worker's file, `mark_process_dead`). A dead worker's counters and
histograms are folded into one archive file a kind (`fold_dead`), so restarts keep their
counts without leaving files behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    mmap_dict,
    values,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from metanode.errors import InvalidBatch, MetanodeError
from metanode.merge import Verdict

log = logging.getLogger(__name__)
# The ASGI scope extension through which a response asks the server to watch its writes
# (server.BoundedHttpTools.watch_stalls): a change feed's, handed its `FeedStalls`.
STALL_WATCH = "metanode.stall_watch"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus-client as it is imported


# The latency histograms' bucket bounds, in seconds. prometheus-client's default starts at 5 ms,
# and a record's read takes ≈ 0.2 ms, a one-claim POST ≈ 2–6 ms: every read and most writes fell
# in its first bucket, so no quantile of them could be told apart. As many bounds as the default
# (14 and +Inf: the same scrape size), from 0.5 ms up to 10 s (a POST waits `apply_wait_s`, 5 s).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class AllocatedFile(mmap_dict.MmapedDict):
    """prometheus-client's memory-mapped metric file (multiprocess mode), its blocks allocated
    on the disk before anything is stored through the map. The library sizes the file with
    `truncate`, which leaves a hole, and a store into a hole the file system has no block for
    (the data directory's disk full) is SIGBUS: under `serve --workers N` the owner died of it
    at once, as soon as a request made a new series. Allocated first (`posix_fallocate`), a
    full disk is an `OSError` here instead: a new file refuses to be made (at a worker's start,
    which a full disk refuses anyway), and a new series that needs more room is not recorded
    until there is room (`write_value`), the worker serving on."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        self._said = False  # whether a failure to record was logged (`_not_recorded`)
        if not read_mode and not os.path.exists(filename):
            _allocate(filename, mmap_dict._INITIAL_MMAP_SIZE)
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]

    def _init_value(self, key: str) -> None:
        """Allocate the room the library is about to `truncate` the file to (doubling its size
        until the new entry fits), then let it write the entry. An entry is a 4-byte length,
        the key padded to 8 bytes and two doubles (mmap_dict.py): counted here with the most
        padding, so the room allocated is never less than the size the library picks."""
        entry = 4 + len(key.encode("utf-8")) + 8 + 16
        room = self._capacity
        while self._used + entry > room:
            room *= 2
        if room > self._capacity:
            os.posix_fallocate(self._f.fileno(), 0, room)
        super()._init_value(key)  # type: ignore[no-untyped-call]

    def read_value(self, key: str) -> tuple[float, float]:
        try:
            return super().read_value(key)  # type: ignore[no-any-return,no-untyped-call]
        except OSError as exc:
            self._not_recorded(exc)
            return 0.0, 0.0

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        try:
            super().write_value(key, value, timestamp)  # type: ignore[no-untyped-call]
        except OSError as exc:
            self._not_recorded(exc)

    def has_room(self, keys: list[str]) -> bool:
        """Make an entry for each of `keys` (0 where new): whether every one was made."""
        for key in keys:
            self.read_value(key)
        return not self._said

    def _not_recorded(self, exc: OSError) -> None:
        """Said once per file (a process has three), not at every request of a full disk."""
        if not self._said:
            self._said = True
            log.warning(
                "new metric series are not recorded while %s has no room (%s)", self._fname, exc
            )


def _allocate(filename: str, size: int) -> None:
    """Make the metric file `filename` with `size` bytes allocated, whole or not at all: made
    aside (a name a scrape does not read, `*.db` being what it globs) and linked into place
    once allocated. Made in place, a file the full disk refused its blocks stayed empty, and
    every scrape of the owner failed on it (a 500, until the node restarted)."""
    partial = f"{filename}.partial"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        with contextlib.suppress(FileExistsError):  # made meanwhile: that one is kept
            os.link(partial, filename)
    finally:
        os.close(fd)
        os.unlink(partial)


FOLDED = ("counter", "histogram")  # the kinds a scrape sums over every file, a dead process's too
FOLD_LOCK = "fold.lock"  # not `*.db`: a scrape holds it shared, a fold whole


@contextlib.contextmanager
def _fold_lock(folder: str, how: int) -> Iterator[None]:
    """The metric folder's lock, held `how` (`fcntl.LOCK_SH` or `LOCK_EX`) while inside."""
    fd = os.open(os.path.join(folder, FOLD_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def fold_dead(folder: str, pid: int) -> None:
    """Add dead process `pid`'s counters and histograms to the folder's archive files (one a
    kind, summed key by key, as a scrape sums them) and remove its files. Each worker that died
    left two 64 KiB files in memory (`/dev/shm`) until `serve` stopped, every scrape reading
    them all: a worker dying every 30 s (its slowest restart) added 360 MiB a day. Under
    the lock a scrape takes (`FoldedCollector`), so none sees the counts twice or not at all.
    A file whose keys find no room in the archive (memory full) stays, counted as it was."""
    with _fold_lock(folder, fcntl.LOCK_EX):
        for kind in FOLDED:
            dead = os.path.join(folder, f"{kind}_{pid}.db")
            if os.path.exists(dead) and _added(dead, os.path.join(folder, f"{kind}_archive.db")):
                os.unlink(dead)


def _added(dead: str, archive_path: str) -> bool:
    """Whether every value of the file `dead` was added to the archive file at `archive_path`
    (nothing is added unless each has an entry there)."""
    entries = list(mmap_dict.MmapedDict.read_all_values_from_file(dead))  # type: ignore[no-untyped-call]
    try:
        archive = AllocatedFile(archive_path)
    except OSError as exc:
        log.warning("a dead worker's metrics stay in %s: no room to fold them (%s)", dead, exc)
        return False
    try:
        if not archive.has_room([key for key, _, _, _ in entries]):
            return False
        for key, value, timestamp, _ in entries:
            archive.write_value(key, archive.read_value(key)[0] + value, timestamp)
        return True
    finally:
        archive.close()  # type: ignore[no-untyped-call]


class FoldedCollector(MultiProcessCollector):
    """prometheus-client's sum over the folder's files, read under the lock `fold_dead` takes
    whole."""

    def collect(self) -> Iterable[Metric]:
        with _fold_lock(self._path, fcntl.LOCK_SH):
            return list(super().collect())  # type: ignore[no-untyped-call]


# Every multiprocess value's file is made through this name (prometheus_client.values).
values.MmapedDict = AllocatedFile  # type: ignore[attr-defined]
# No `_created` series (each counter's and histogram's start time, as a sample of its own): in
# the text format `metanode_claims_created{verdict="accepted"} 1.79e+09` read as a count of
# claims, and only `--workers 1` wrote them (multiprocess mode has none), so a dashboard
# made on one mode broke on the other.
disable_created_metrics()  # type: ignore[no-untyped-call]


class Metrics:
    """The node's instruments, and the scrape-time gauges `render` is given."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()  # what a scrape renders
        shared = os.environ.get(MULTIPROCESS_ENV)
        # In multiprocess mode the instruments' values are in the shared files, which the
        # collector renders: registered here too, each would be rendered twice.
        own = None if shared else self.registry
        self.claims = Counter(
            "metanode_claims", "Claims ingested, by verdict", ["verdict"], registry=own
        )
        # Each verdict's series made once: `labels()` is a locked lookup, 2.5 µs a call, and
        # every POST /api/claims counts all three.
        self.verdicts = {v: self.claims.labels(v) for v in get_args(Verdict)}
        self.rejected = Counter(
            "metanode_claims_rejected", "Claims rejected, by error slug", ["slug"], registry=own
        )
        self.ingest_seconds = Histogram(
            "metanode_ingest_seconds",
            "POST /api/claims batches: validation to cache applied",
            registry=own,
            buckets=LATENCY_BUCKETS,
        )
        self.request_seconds = Histogram(
            "metanode_request_seconds",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=own,
            buckets=LATENCY_BUCKETS,
        )
        self.subscribers = Gauge(
            "metanode_feed_subscribers",
            "Open change-feed connections",
            registry=own,
            multiprocess_mode="livesum",
        )
        self.feed_behind = Gauge(
            "metanode_feed_behind_events",
            "The most events an open change feed has not been sent yet (its table's newest "
            "seq less its position)",
            registry=own,
            multiprocess_mode="livemax",
        )
        self.feed_stalls = FeedStalls(own)
        # Counted as they happen (not read from the owner's state at scrape): a restarted owner
        # worker's counts stay in the sums, where at scrape time they went back to 0.
        self.ingest_groups = Counter(
            "metanode_ingest_groups",
            "Truth transactions that committed ingest batches (group commit)",
            registry=own,
        )
        self.ingest_grouped = Counter(
            "metanode_ingest_grouped", "Ingest batches those transactions held", registry=own
        )
        self.applied_ahead = Counter(
            "metanode_applied_ahead",
            "Of those, the ones the cache applied during their COMMIT",
            registry=own,
        )
        if shared:
            FoldedCollector(self.registry, shared)  # type: ignore[no-untyped-call]
        self._gauges = _Gauges()
        self.registry.register(self._gauges)

    def refused(self, exc: MetanodeError) -> None:
        """A POST /api/claims refused with `exc`: each failing claim of an `invalid_batch`
        under its own slug, any other refusal of the batch (its body not JSON, too large, a
        signer not allowed…) under the error's. A body that was not JSON went uncounted when
        only the node's part of the request counted, so an alert on rejections missed a client
        that sent nothing but garbage."""
        if isinstance(exc, InvalidBatch):
            for item in exc.items:
                self.rejected.labels(item["error"]).inc()
        else:
            self.rejected.labels(exc.slug).inc()

    def grouped(self, jobs: int) -> None:
        """A truth transaction of `jobs` ingest batches was run (`db.Writer.on_group`, on the
        writer's thread: the instruments take their own locks)."""
        self.ingest_groups.inc()
        self.ingest_grouped.inc(jobs)

    def register(self, collector: Collector) -> None:
        """More scrape-time numbers (the supervisor's worker restarts, workers.py)."""
        self.registry.register(collector)

    def render(self, gauges: dict[str, Any]) -> bytes:
        """The scrape: every instrument, and `gauges` (`Node.metrics_text` reads them)."""
        self._gauges.state = gauges
        return generate_latest(self.registry)


class FeedStalls:
    """The change-feed connections whose client takes no bytes (its socket's buffers full),
    and those cut for it (`feed_stall_s`), as the server sees them: it calls `stalled` when
    a feed's writes must wait for the client, `cleared` when they may go on again (or the
    connection is gone), `cut` when it disconnects one that took nothing for `feed_stall_s`.
    Both are instruments (not scrape-time numbers), so under `serve --workers N` every
    worker's streams count."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.waiting = Gauge(
            "metanode_feed_stalled",
            "Open change-feed connections whose client takes no bytes now (buffers full)",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.cuts = Counter(
            "metanode_feed_cut_stalled",
            "Change-feed connections cut after their client took no bytes for feed_stall_s",
            registry=registry,
        )

    def stalled(self) -> None:
        self.waiting.inc()

    def cleared(self) -> None:
        self.waiting.dec()

    def cut(self) -> None:
        self.cuts.inc()


class _Gauges(Collector):
    """Gauges computed at scrape time from the node's state: those of the scrape being
    rendered (`Metrics.render`, synchronous, so one scrape's never mix with another's)."""

    state: dict[str, Any]  # set by `render` before each scrape

    def collect(self) -> Iterator[Metric]:
        state = self.state
        for name, help_text in (
            ("records", "Records (active groups) in the cache"),
            ("groups", "Active rids in the truth"),
            ("merges", "Rids merged into an older one, ever"),
            ("apply_lag", "Truth outbox seq minus the cache's applied seq"),
            ("replans", "Signers whose records are still being recomputed (block, weight)"),
            ("watcher_queue", "Files waiting to settle before hashing"),
            ("watcher_files", "Local files known to the watcher"),
            ("health_problems", "What makes /health degraded now (0: ok)"),
            ("health_warnings", "What /health warns of now (a plugin that does not load…)"),
        ):
            yield GaugeMetricFamily(f"metanode_{name}", help_text, value=state[name])
        yield from _peer_families(state["peers"])
        runs = GaugeMetricFamily(
            "metanode_plugin_runs", "Plugin runs by plugin and status", labels=["plugin", "status"]
        )
        for (plugin, status), count in sorted(state["plugin_runs"].items()):
            runs.add_metric([plugin, status], count)
        yield runs


def _peer_families(peers: dict[str, tuple[float, bool]]) -> Iterator[GaugeMetricFamily]:
    """Each followed peer's lag and whether its last pull failed, by name: a peer that stopped
    answering was in /health and `peers list` alone, nothing Prometheus could alert on."""
    lag = GaugeMetricFamily(
        "metanode_peer_lag_seconds",
        "Seconds since the follower last had every claim the peer had shown it (0: caught up)",
        labels=["peer"],
    )
    failing = GaugeMetricFamily(
        "metanode_peer_failing", "1 while the peer's last pull failed, else 0", labels=["peer"]
    )
    for name, (lag_s, failed) in sorted(peers.items()):
        lag.add_metric([name], lag_s)
        failing.add_metric([name], float(failed))
    yield lag
    yield failing
