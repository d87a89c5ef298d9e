"""The Worker's spans, used only while `fencegate.tracing.TRACER` is set (see there).

One span per attempt, following OpenTelemetry's messaging conventions for a consumer that
processes a message: named ``process <kind>``, kind CONSUMER, with the job's id, kind,
fencing token and attempt, and the attempt's outcome when it ends. The tool runs inside it,
so the fenced clients (aiohttp and httpx) send its context in ``traceparent`` and the
gateway's span is its child.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fencegate import tracing
from fencegate.lease.models import Lease


@contextmanager
def attempt_span(lease: Lease, *, worker_id: str) -> Iterator[Any]:
    from opentelemetry.trace import SpanKind

    attributes = {
        "messaging.system": "fencegate",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": lease.kind,
        "messaging.message.id": str(lease.job_id),
        "messaging.consumer.group.name": lease.kind,
        "fencegate.job.id": lease.job_id,
        "fencegate.job.kind": lease.kind,
        "fencegate.fencing_token": lease.fencing_token,
        "fencegate.attempt": lease.attempt,
        "fencegate.worker": worker_id,
    }
    with tracing.TRACER.start_as_current_span(
        f"process {lease.kind}", kind=SpanKind.CONSUMER, attributes=attributes
    ) as span:
        yield span


def record_outcome(outcome: str) -> None:
    """The attempt's outcome on its span (the current one, where the worker settles it)."""
    from opentelemetry import trace

    span = trace.get_current_span()
    span.set_attribute("fencegate.outcome", outcome)
    if outcome in ("failed", "rejected"):
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, outcome))


def context_headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) for the current span."""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier
