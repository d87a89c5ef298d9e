"""Prometheus metrics for workers, by work class (`kind`).

A "running jobs" count says little; these say who owns what and how close it is to losing
it: the age of the last successful heartbeat and the remaining lease (both computed when
scraped, over the leases this process holds), expired leases, failed renewals, reclaimed
jobs and outcomes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fencegate.lease.execution import Execution


class _LiveLeases(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[str, Execution]] = {}

    def add(self, kind: str, execution: Execution) -> None:
        with self._lock:
            self._live[id(execution)] = (kind, execution)

    def remove(self, execution: Execution) -> None:
        with self._lock:
            self._live.pop(id(execution), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.monotonic()
        with self._lock:
            live = list(self._live.values())
        age = GaugeMetricFamily(
            "fencegate_worker_heartbeat_age_seconds",
            "Age of the oldest last successful claim or renewal among held leases",
            labels=["kind"],
        )
        remaining = GaugeMetricFamily(
            "fencegate_worker_lease_remaining_seconds",
            "Smallest remaining lease time among held leases (local conservative estimate)",
            labels=["kind"],
        )
        held = GaugeMetricFamily(
            "fencegate_worker_leases_held", "Leases this process is working on", labels=["kind"]
        )
        by_kind: dict[str, list[Execution]] = {}
        for kind, execution in live:
            by_kind.setdefault(kind, []).append(execution)
        for kind, executions in sorted(by_kind.items()):
            age.add_metric([kind], max(e.confirmed_age(now=now) for e in executions))
            remaining.add_metric([kind], min(e.remaining(now=now) for e in executions))
            held.add_metric([kind], len(executions))
        yield age
        yield remaining
        yield held

    def describe(self) -> Iterator[Any]:
        return iter(())


class WorkerMetrics:
    """Pass ``registry=CollectorRegistry()`` for an isolated set (tests, several workers)."""

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.live = _LiveLeases()
        self.registry.register(self.live)
        self.expired_leases = Counter(
            "fencegate_worker_expired_leases",
            "Leases lost while working (zero rows on renewal, or given up locally)",
            ["kind"],
            registry=self.registry,
        )
        self.failed_renewals = Counter(
            "fencegate_worker_failed_renewals",
            "Renewal attempts that got no answer from the store",
            ["kind"],
            registry=self.registry,
        )
        self.reclaimed_jobs = Counter(
            "fencegate_worker_reclaimed_jobs",
            "Jobs claimed for a second or later attempt",
            ["kind"],
            registry=self.registry,
        )
        self.outcomes = Counter(
            "fencegate_worker_outcomes",
            "How executions ended: succeeded, retry, failed, rejected, lost, released",
            ["kind", "outcome"],
            registry=self.registry,
        )

    def close(self) -> None:
        for collector in (
            self.live,
            self.expired_leases,
            self.failed_renewals,
            self.reclaimed_jobs,
            self.outcomes,
        ):
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass
