"""The gateway's spans, used only while `fencegate.tracing.TRACER` is set (see there).

A SERVER span per request continues the caller's ``traceparent``; it is named by method and
route (``POST /v1/charges``) and ends with the decision's facts as attributes. The upstream
call is a CLIENT span whose context replaces the caller's ``traceparent`` on the forwarded
request, so the upstream's spans are its children.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from fencegate import tracing

if TYPE_CHECKING:
    from fencegate.gateway.decisions import DecisionTrace
    from fencegate.gateway.routes import RoutePolicy
    from fencegate.gateway.upstream import ResponseSink, Upstream, UpstreamResponse
    from fencegate.types import IncomingRequest, Receive, Scope


@asynccontextmanager
async def server_span(
    scope: Scope, policy: RoutePolicy, trace: DecisionTrace
) -> AsyncIterator[Any]:
    from opentelemetry.trace import SpanKind

    headers = ((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"])
    parent = tracing.extract_context(headers)
    attributes = {
        "http.request.method": trace.method,
        "http.route": policy.prefix,
        "url.path": trace.target.split("?", 1)[0],  # never the query: it may carry secrets
        "fencegate.request_id": trace.request_id,
    }
    with tracing.TRACER.start_as_current_span(
        f"{trace.method} {policy.prefix}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
    ) as span:
        trace.span = span
        yield span


def end_server_span(trace: DecisionTrace, *, decision: str, problem: str, status: int) -> None:
    """The decision's facts on the request's span: no body, no other header's value."""
    span = trace.span
    facts = {
        "fencegate.decision": decision,
        "fencegate.problem": problem or None,
        "fencegate.tenant": trace.tenant,
        "fencegate.entity": trace.entity,
        "fencegate.fence": trace.fence,
        "fencegate.idempotency_key": trace.key,
        "http.response.status_code": status,
    }
    span.set_attributes({k: v for k, v in facts.items() if v is not None})
    if status >= 500:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, problem or str(status)))


async def send_upstream(
    upstream: Upstream,
    request: IncomingRequest,
    policy: RoutePolicy,
    scope: Scope,
    receive: Receive,
    *,
    timeout: float,
    sink: ResponseSink | None = None,
) -> UpstreamResponse:
    """The upstream call as a CLIENT span; the upstream receives its context."""
    from opentelemetry.trace import SpanKind

    from fencegate.gateway.upstream import streaming

    with tracing.TRACER.start_as_current_span(
        f"{request.method} {policy.prefix} upstream",
        kind=SpanKind.CLIENT,
        attributes={"http.request.method": request.method, "http.route": policy.prefix},
    ) as span:
        traced = dataclasses.replace(request, headers=tracing.inject_headers(request.headers))
        streams = streaming(upstream) if sink is not None else None
        if streams is None:
            response = await upstream.send(traced, policy, scope, receive, timeout=timeout)
        else:
            response = await streams.send(
                traced, policy, scope, receive, timeout=timeout, sink=sink
            )
        span.set_attribute("http.response.status_code", response.status)
        return response


@contextmanager
def reconcile_span(
    *, route: str, method: str, tenant: str, key: str, attempt: int
) -> Iterator[Any]:
    """One INTERNAL span per key the reconciler probes; an HTTP probe carries its context to
    the upstream in ``traceparent``, so the upstream's spans are its children."""
    from opentelemetry.trace import SpanKind

    attributes = {
        "http.route": route,
        "fencegate.tenant": tenant,
        "fencegate.idempotency_key": key,
        "fencegate.attempt": attempt,
    }
    with tracing.TRACER.start_as_current_span(
        f"reconcile {method} {route}",
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        record_exception=False,
    ) as span:
        yield span


def end_reconcile_span(span: Any, *, result: str, probe_status: int | None, note: str) -> None:
    facts = {
        "fencegate.reconcile.result": result,
        "fencegate.reconcile.note": note or None,
        "http.response.status_code": probe_status,
    }
    span.set_attributes({k: v for k, v in facts.items() if v is not None})
