"""Prometheus metrics of one gateway, in its own registry so that several gateways (or a
gateway and its host application) in one process never clash.

Under ``fencegate serve --workers N`` each worker process writes its values to the directory
named by ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, chosen when the
library is imported), and ``/metrics`` sums every process's files, so whichever worker
answers a scrape, the counters are the gateway's, and they never go down.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from fencegate.counters import CachedCounter

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "fencegate_gateway_requests",
            "Requests the gateway answered, by decision (a word) and problem type (empty "
            "for answers that are not problems).",
            ["decision", "problem"],
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "fencegate_upstream_latency_seconds",
            "Time from forwarding a request to the upstream's full answer.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._store_latency = Histogram(
            "fencegate_store_latency_seconds",
            "Time of one store operation, by operation.",
            ["operation"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reconciliations = Counter(
            "fencegate_reconciliations",
            "Keys whose unknown outcome the reconciler asked the upstream about, by route "
            "prefix and result: completed (it ran; its answer is stored), released (it never "
            "ran), unknown (no answer either way; tried again later), changed (the key changed "
            "meanwhile and was left alone).",
            ["route", "result"],
            registry=self.registry,
        )
        self.internal_errors = Counter(
            "fencegate_internal_errors",
            "Faults in fencegate's own code (bugs, answered 500 internal-error; never a store "
            "outage), by where they were caught: decide, record, renew, owed_write, "
            "authenticate, request, reconcile.",
            ["where"],
            registry=self.registry,
        )
        self.tool_calls = Counter(
            "fencegate_mcp_tool_calls",
            "MCP tools/call requests of guarded tools the gateway answered, by tool, decision "
            "and problem type (empty for answers that are not problems).",
            ["tool", "decision", "problem"],
            registry=self.registry,
        )
        self.answer_cache_hits = Counter(
            "fencegate_answer_cache_hits",
            "Requests answered from this process's copy of a completed answer (a replay, or "
            "a key reused), without a round trip to the store.",
            registry=self.registry,
        )
        # Label children are cached: looking one up per request is most of the cost.
        self._decisions = CachedCounter(self.requests)
        self._tool_calls = CachedCounter(self.tool_calls)
        self._operations: dict[str, Histogram] = {}
        # Read once: the value class prometheus_client chose at import depends on it too.
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None

    def count(self, decision: str, problem: str = "") -> None:
        self._decisions.inc(decision, problem)

    def count_tool_call(self, tool: str, decision: str, problem: str = "") -> None:
        self._tool_calls.inc(tool, decision, problem)

    def answer_cache_hit(self) -> None:
        self.answer_cache_hits.inc()

    def reconciled(self, route: str, result: str) -> None:
        self.reconciliations.labels(route=route, result=result).inc()

    def internal_error(self, where: str) -> None:
        self.internal_errors.labels(where=where).inc()

    def store_latency(self, operation: str) -> Histogram:
        child = self._operations.get(operation)
        if child is None:
            child = self._operations[operation] = self._store_latency.labels(operation=operation)
        return child

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        # Every worker's values, summed; a fresh registry per scrape, as the library asks.
        registry = CollectorRegistry()
        registry.register(_WrittenFilesCollector(self.multiprocess_dir))
        return generate_latest(registry)


class _WrittenFilesCollector(Collector):
    """`MultiProcessCollector`, over the files that hold something. A process creates its
    file before it sizes it: a scrape in between (or after the process died there) found an
    empty file, and the library's reader failed the whole scrape on it (a 500 for /metrics;
    prometheus/client_python#1199). An empty file has nothing recorded yet."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterable[Metric]:
        files = [f for f in glob.glob(os.path.join(self.path, "*.db")) if os.path.getsize(f)]
        merged: Iterable[Metric] = MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]  # untyped in prometheus-client
        return merged
