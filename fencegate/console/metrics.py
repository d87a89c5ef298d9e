"""``GET /metrics`` on the console: the queue's ownership gauges by work class, provider and
model, read from the queue itself when scraped, so the console's overview and a Prometheus
see the same numbers.

A worker process's own metrics (fencegate.lease.metrics) describe the leases it holds; these
describe every lease in the store, whoever holds it, including the ones whose holder died.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from fencegate.console.web import Viewer, console_of
from fencegate.problems import Problem
from fencegate.store.inspect import Row

# (metric, help, column)
_GAUGES = (
    ("fencegate_queue_jobs_queued", "Jobs waiting to be claimed", "queued"),
    ("fencegate_queue_leases_running", "Jobs running under a lease", "running"),
    (
        "fencegate_queue_leases_expired",
        "Running jobs whose lease ran out and nobody has reclaimed yet",
        "expired",
    ),
    (
        "fencegate_queue_reclaimed_total",
        "Lease grants that ran out and were granted again (heartbeats lost)",
        "reclaimed",
    ),
    (
        "fencegate_queue_lease_remaining_seconds",
        "Smallest remaining lease among running jobs",
        "lease_remaining_min",
    ),
    (
        "fencegate_queue_heartbeat_age_seconds",
        "Age of the oldest last heartbeat among running jobs",
        "heartbeat_age_max",
    ),
)


class _Snapshot(Collector):
    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def collect(self) -> list[GaugeMetricFamily]:
        families = []
        for name, text, column in _GAUGES:
            family = GaugeMetricFamily(name, text, labels=["kind", "provider", "model"])
            for row in self.rows:
                if row[column] is not None:
                    labels = [str(row["kind"]), str(row["provider"]), str(row["model"])]
                    family.add_metric(labels, float(row[column]))
            families.append(family)
        return families


def render(rows: list[Row]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(rows))
    return generate_latest(registry)


async def metrics(request: Request, viewer: Viewer) -> Response:
    if viewer.tenant is not None:
        raise Problem(
            403,
            "not-for-this-token",
            "Not for this token",
            "jobs carry no tenant: queue metrics are global",
        )
    inspector = await console_of(request).inspector()
    return Response(render(await inspector.ownership()), media_type=CONTENT_TYPE_LATEST)
