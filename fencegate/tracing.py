"""OpenTelemetry traces, an optional extra (``pip install 'fencegate[otel]'``).

Off and free unless asked for: without the OpenTelemetry SDK installed, or without
``OTEL_TRACES_EXPORTER`` (``console`` or ``otlp``, as the SDK reads it) and without a tracer
provider the application installed itself, `TRACER` stays None and the gateway's hot path
tests one module attribute per request; nothing is imported, nothing allocated.

When on, the gateway continues an incoming W3C ``traceparent``: a SERVER span per request,
named by method and route, with the decision, problem, tenant, entity and fence as
attributes (never a body, a key's payload or another header's value), and a CLIENT span
for the upstream call whose context the upstream receives in ``traceparent``. The
exporter's own settings come from the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES`` …), read by the SDK.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("fencegate.tracing")

# The tracer when traces are on, else None: checked on the hot path.
TRACER: Any = None

_EXPORTERS = ("console", "otlp")


def configure(*, service_name: str) -> bool:
    """Turn traces on if the environment asks for them and the SDK is installed. Returns
    whether they are on. Safe to call more than once."""
    global TRACER
    if TRACER is not None:
        return True
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    wanted = [
        name.strip()
        for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
        if name.strip() and name.strip() != "none"
    ]
    if not wanted and "opentelemetry.trace" not in sys.modules:
        return False  # nothing asked for, and no application set a provider up: no import
    try:
        from opentelemetry import trace
    except ImportError:
        if wanted:
            logger.warning(
                "OTEL_TRACES_EXPORTER is set but OpenTelemetry is not installed: "
                "pip install 'fencegate[otel]'"
            )
        return False
    provider = trace.get_tracer_provider()
    installed = type(provider).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider")
    if not installed:
        if not wanted:
            return False
        unknown = [name for name in wanted if name not in _EXPORTERS]
        if unknown:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not supported "
                f"(use {' or '.join(_EXPORTERS)})"
            )
        provider = _sdk_provider(wanted, service_name)
        trace.set_tracer_provider(provider)
    TRACER = trace.get_tracer("fencegate")
    return True


def _sdk_provider(exporters: Iterable[str], service_name: str) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, which win.
    resource = Resource.create({SERVICE_NAME: service_name}).merge(Resource.create())
    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    return provider


def _otlp_exporter() -> Any:
    """OTLP over HTTP/protobuf (the SDK's default), or gRPC when the standard variables
    say so; endpoint, headers and timeout are read by the exporter itself."""
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()


def flush() -> None:
    """Export the spans still buffered (a worker or gateway stopping); the SDK's own exit
    hook shuts the provider down."""
    if TRACER is None:
        return
    from opentelemetry import trace

    force_flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if force_flush is not None:
        force_flush()


def reset_for_tests() -> None:
    global TRACER
    TRACER = None


def current_trace_id() -> str | None:
    """The trace id of the current span (32 hex digits), or None when traces are off."""
    if TRACER is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def extract_context(headers: Iterable[tuple[str, str]]) -> Any:
    """The caller's trace context from ``traceparent``/``tracestate`` (lower-case names)."""
    from opentelemetry.propagate import extract

    carrier = {name: value for name, value in headers if name in ("traceparent", "tracestate")}
    return extract(carrier)


def inject_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """``headers`` with the current context as ``traceparent`` (and ``tracestate``) in place
    of the caller's: the upstream's parent is the gateway's client span."""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    kept = tuple((k, v) for k, v in headers if k not in ("traceparent", "tracestate"))
    return kept + tuple(carrier.items())
