"""Prometheus metrics of one gateway, in its own registry so that several gateways (or a
gateway and its host application) in one process never clash."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "fencegate_gateway_requests",
            "Requests the gateway answered, by decision.",
            ["decision"],
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
        # Label children are cached: looking one up per request is most of the cost.
        self._decisions: dict[str, Counter] = {}
        self._operations: dict[str, Histogram] = {}

    def count(self, decision: str) -> None:
        child = self._decisions.get(decision)
        if child is None:
            child = self._decisions[decision] = self.requests.labels(decision=decision)
        child.inc()

    def store_latency(self, operation: str) -> Histogram:
        child = self._operations.get(operation)
        if child is None:
            child = self._operations[operation] = self._store_latency.labels(operation=operation)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)
