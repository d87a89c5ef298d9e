"""The decision log: one structured line per gateway answer, on its own logger
(``fencegate.decisions``) so that operators can route, keep or silence it apart from the rest.

A line names who asked (tenant, request id), what for (method, target as sent, key, entity,
fence), what the gateway decided and answered, and what the upstream did when it was called.
Never a body, a payload, or any other header value: keys and entities are the caller's own
names for its operations, and they are what an operator searches by.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from fencegate.problems import Problem
from fencegate.types import DEFAULT_TENANT

decision_logger = logging.getLogger("fencegate.decisions")

# Problem kinds grouped under one decision word: the exact kind is the `problem` label.
_INVALID_REQUEST = frozenset(
    {"invalid-target", "invalid-header", "key-required", "entity-required"}
)


def decision_of(problem: Problem) -> str:
    """The decision word for a problem answer: ``stale-fence`` → ``stale_fence``; every 401
    → ``unauthorized``; malformed requests → ``invalid_request``."""
    if problem.status == 401:
        return "unauthorized"
    if problem.kind in _INVALID_REQUEST:
        return "invalid_request"
    return problem.kind.replace("-", "_")


@dataclass(slots=True)
class DecisionTrace:
    """What one request's log line says, filled in as the request goes through the gateway."""

    request_id: str
    method: str
    target: str
    tenant: str = DEFAULT_TENANT
    key: str | None = None
    entity: str | None = None
    fence: int | None = None
    upstream_status: int | None = None
    upstream_seconds: float | None = None
    span: Any = None  # the request's span, only while traces are on (fencegate.tracing)
    tool: str | None = None  # an MCP route's tools/call: the tool it calls

    def upstream_called(self, started: float, status: int | None) -> None:
        self.upstream_seconds = time.perf_counter() - started
        self.upstream_status = status


def log_decision(
    trace: DecisionTrace, *, decision: str, problem: str, status: int, owner: str
) -> None:
    """One INFO record on ``fencegate.decisions``; nothing is built when it is disabled."""
    if not decision_logger.isEnabledFor(logging.INFO):
        return
    fields: dict[str, Any] = {
        "event": "decision",
        "decision": decision,
        "problem": problem or None,
        "status": status,
        "tenant": trace.tenant,
        "key": trace.key,
        "method": trace.method,
        "target": trace.target,
        **({"tool": trace.tool} if trace.tool is not None else {}),
        "entity": trace.entity,
        "fence": trace.fence,
        "upstream_status": trace.upstream_status,
        "upstream_ms": (
            round(trace.upstream_seconds * 1000, 3) if trace.upstream_seconds is not None else None
        ),
        "request_id": trace.request_id,
        "owner": owner,
    }
    if trace.span is not None:
        fields["trace_id"] = format(trace.span.get_span_context().trace_id, "032x")
    decision_logger.info(
        "decision %s", TextFields(fields, skip=("event",)), extra={"fields": fields}
    )


class TextFields:
    """The text format's ``name=value`` pairs, built only if a handler formats the message
    (the JSON format writes the fields themselves)."""

    __slots__ = ("fields", "skip")

    def __init__(self, fields: dict[str, Any], *, skip: tuple[str, ...] = ()) -> None:
        self.fields = fields
        self.skip = skip

    def __str__(self) -> str:
        return text_fields(self.fields, skip=self.skip)


# A text value written bare must not contain what separates or quotes fields. Plain ASCII
# (the common case) is recognised by one match; anything else is looked at more closely.
_PLAIN = re.compile(r"[!#-<>-\[\]-~]+")
_NEEDS_QUOTES = re.compile(r'[ "=\\]')


def _bare(text: str) -> bool:
    return bool(
        _PLAIN.fullmatch(text) or (text and not _NEEDS_QUOTES.search(text) and text.isprintable())
    )


def text_fields(fields: dict[str, Any], *, skip: tuple[str, ...] = ()) -> str:
    """``name=value`` pairs for the text format; absent values are left out, and a value
    with spaces, quotes or ``=`` is written as a JSON string so the line stays parseable."""
    parts = []
    for name, value in fields.items():
        if value is None or name in skip:
            continue
        # A number or a flag has nothing to quote.
        if isinstance(value, str) and not _bare(value):
            value = json.dumps(value)
        parts.append(f"{name}={value}")
    return " ".join(parts)


def log_reconciliation(fields: dict[str, Any]) -> None:
    """One INFO record on ``fencegate.decisions`` per key the reconciler settled or tried
    (``event=reconciliation``): the key, what the probe said, and what became of the key."""
    if not decision_logger.isEnabledFor(logging.INFO):
        return
    fields = {"event": "reconciliation", **fields}
    decision_logger.info(
        "reconciliation %s", TextFields(fields, skip=("event",)), extra={"fields": fields}
    )
