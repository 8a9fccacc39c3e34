"""Prometheus metrics of one node (GET /metrics).

Counters and histograms are updated where things happen; sizes (records, groups, merges, apply
lag, watcher and plugin state) are read when Prometheus scrapes, so they are never stale and cost
nothing between scrapes. Each node has its own registry, so several nodes in one process (tests)
never share numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The node's instruments; `snapshot` supplies the scrape-time gauges."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.claims = Counter(
            "metanode_claims", "Claims ingested, by verdict", ["verdict"], registry=self.registry
        )
        self.rejected = Counter(
            "metanode_claims_rejected",
            "Claims rejected, by error slug",
            ["slug"],
            registry=self.registry,
        )
        self.ingest_seconds = Histogram(
            "metanode_ingest_seconds",
            "POST /api/claims batches: validation to cache applied",
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "metanode_request_seconds",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.registry.register(_Gauges(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges(Collector):
    """Gauges computed at scrape time from the node's state."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._snapshot()
        for name, help_text in (
            ("records", "Records (active groups) in the cache"),
            ("groups", "Active rids in the truth"),
            ("merges", "Rids merged into an older one, ever"),
            ("apply_lag", "Truth outbox seq minus the cache's applied seq"),
            ("feed_subscribers", "Open change-feed connections"),
            ("watcher_queue", "Files waiting to settle before hashing"),
            ("watcher_files", "Local files known to the watcher"),
            ("ingest_groups", "Truth transactions that committed ingest batches (group commit)"),
            ("ingest_grouped", "Ingest batches those transactions held"),
        ):
            yield GaugeMetricFamily(f"metanode_{name}", help_text, value=state[name])
        runs = GaugeMetricFamily(
            "metanode_plugin_runs", "Plugin runs by plugin and status", labels=["plugin", "status"]
        )
        for (plugin, status), count in sorted(state["plugin_runs"].items()):
            runs.add_metric([plugin, status], count)
        yield runs
