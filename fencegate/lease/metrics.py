"""Prometheus metrics for workers, by work class (`kind`), `provider` and `model`: the
provider is the work class's, the model the job's (one of the names its work class declares)
or the work class's; both are empty when not declared. Never free text.

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

from fencegate.counters import CachedCounter
from fencegate.lease.execution import Execution
from fencegate.lease.models import Lease
from fencegate.lease.policy import WorkClass

LABELS = ["kind", "provider", "model"]


class _LiveLeases(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[tuple[str, ...], Execution]] = {}

    def add(self, labels: tuple[str, ...], execution: Execution) -> None:
        with self._lock:
            self._live[id(execution)] = (labels, execution)

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
            labels=LABELS,
        )
        remaining = GaugeMetricFamily(
            "fencegate_worker_lease_remaining_seconds",
            "Smallest remaining lease time among held leases (local conservative estimate)",
            labels=LABELS,
        )
        held = GaugeMetricFamily(
            "fencegate_worker_leases_held", "Leases this process is working on", labels=LABELS
        )
        by_labels: dict[tuple[str, ...], list[Execution]] = {}
        for labels, execution in live:
            by_labels.setdefault(labels, []).append(execution)
        for labels, executions in sorted(by_labels.items()):
            values = list(labels)
            age.add_metric(values, max(e.confirmed_age(now=now) for e in executions))
            remaining.add_metric(values, min(e.remaining(now=now) for e in executions))
            held.add_metric(values, len(executions))
        yield age
        yield remaining
        yield held

    def describe(self) -> Iterator[Any]:
        return iter(())


class WorkerMetrics:
    """Pass ``registry=CollectorRegistry()`` for an isolated set (tests, several workers)."""

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        self._classes: dict[str, WorkClass] = {}
        self.live = _LiveLeases()
        self.registry.register(self.live)
        self.expired_leases = Counter(
            "fencegate_worker_expired_leases",
            "Leases lost while working (zero rows on renewal, or given up locally)",
            LABELS,
            registry=self.registry,
        )
        self.failed_renewals = Counter(
            "fencegate_worker_failed_renewals",
            "Renewal attempts that got no answer from the store",
            LABELS,
            registry=self.registry,
        )
        self.reclaimed_jobs = Counter(
            "fencegate_worker_reclaimed_jobs",
            "Jobs claimed for a second or later attempt",
            LABELS,
            registry=self.registry,
        )
        self.outcomes = Counter(
            "fencegate_worker_outcomes",
            "How executions ended: succeeded, retry, failed, rejected, lost, released",
            [*LABELS, "outcome"],
            registry=self.registry,
        )
        # Looked up once per label set: `labels()` validates and locks on every call.
        self._outcomes = CachedCounter(self.outcomes)

    def declare(self, work_classes: list[WorkClass]) -> None:
        """The work classes whose provider and model label their jobs' metrics."""
        self._classes.update({c.kind: c for c in work_classes})

    def labels_of(self, lease: Lease) -> tuple[str, str, str]:
        """(kind, provider, model) for one lease; "" where nothing is declared."""
        work_class = self._classes.get(lease.kind)
        provider = work_class.provider if work_class is not None else None
        model = lease.model or (work_class.model if work_class is not None else None)
        return (lease.kind, provider or "", model or "")

    def outcome(self, lease: Lease, outcome: str) -> None:
        self.count_outcome(self.labels_of(lease), outcome)

    def count_outcome(self, labels: tuple[str, str, str], outcome: str) -> None:
        """`outcome` for labels already worked out with `labels_of`."""
        self._outcomes.inc(*labels, outcome)

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
