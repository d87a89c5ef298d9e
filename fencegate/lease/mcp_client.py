"""The fenced MCP client: a job's tool calls to an MCP server, fenced like its HTTP calls.

It wraps the ``mcp`` SDK's client (``pip install fencegate[mcp]``; this module is imported
only when used). Each ``call_tool`` first checks, with a margin, that the job still owns its
lease, then puts the job's key (its key plus a step), its fencing token and its entity in
the call's ``_meta`` (``dev.fencegate/idempotency-key``, ``/fence``, ``/entity``), where an
MCP route of the gateway reads them, and logs ``tool_request_started``. Every POST of the
connection carries an ``X-Request-Id`` and is signed when the worker has keys::

    async with job.mcp("https://gateway.internal/mcp") as tools:
        result = await tools.call_tool("charge", {"order": "o-1", "amount": 5})

A retry of the job (a later attempt, maybe another worker) sends the same key for the
same step, so the tool runs once; an owner whose lease was taken over sends a lower fence
and is refused before the tool runs.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from contextlib import asynccontextmanager
from typing import Any, Protocol, cast

import httpx2
import orjson
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, RequestParamsMeta

from fencegate import tracing
from fencegate.lease import spans as lease_spans
from fencegate.lease.client import REQUEST_ID, FencedJob
from fencegate.lease.events import digest
from fencegate.types import RequestSigner

# The names an MCP route reads (fencegate.gateway.mcp): the contract between the two halves.
META_KEY = "dev.fencegate/idempotency-key"
META_FENCE = "dev.fencegate/fence"
META_ENTITY = "dev.fencegate/entity"

ProgressCallback = Callable[[float, float | None, str | None], Awaitable[None]]


class ToolCaller(Protocol):
    """What is wrapped: ``mcp.client.client.Client`` or ``mcp.client.session.ClientSession``."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        progress_callback: Any = None,
        *,
        meta: RequestParamsMeta | None = None,
    ) -> Any: ...


def tool_step(job: FencedJob, name: str) -> str:
    """The default step of a tool call: the tool's name (within the current stage)."""
    step = f"tools/call {name}"
    return f"{job.current_stage}:{step}" if job.current_stage else step


class FencedMcpSession:
    """``call_tool`` with the job's key, fence and entity in ``_meta``."""

    def __init__(
        self, job: FencedJob, session: ToolCaller, *, url: str = "", entity: str | None = None
    ) -> None:
        self.job = job
        self.session = session
        self.url = url
        self.entity = entity

    def fence_meta(
        self, name: str, *, step: str | None = None, entity: str | None = None
    ) -> dict[str, Any]:
        job = self.job
        return {
            META_KEY: job.step_key(step or tool_step(job, name)),
            META_FENCE: job.fencing_token,
            META_ENTITY: entity or self.entity or job.default_entity,
        }

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        step: str | None = None,
        entity: str | None = None,
        read_timeout_seconds: float | None = None,
        progress_callback: ProgressCallback | None = None,
        meta: dict[str, Any] | None = None,
    ) -> CallToolResult:
        """Call a tool; a fencegate refusal (stale fence, in flight, outcome unknown…)
        raises the SDK's ``MCPError`` whose ``error.data`` is the gateway's problem body."""
        fenced = self.fence_meta(name, step=step, entity=entity)
        self.job.guard()
        self.job.emit(
            "tool_request_started",
            method="tools/call",
            tool=name,
            url=self.url,
            step=step or tool_step(self.job, name),
            idempotency_key=fenced[META_KEY],
            entity=fenced[META_ENTITY],
            body_sha256=digest(orjson.dumps(arguments or {}, option=orjson.OPT_SORT_KEYS)),
        )
        given = cast(RequestParamsMeta, {**(meta or {}), **fenced})
        result = await self.session.call_tool(
            name, arguments, read_timeout_seconds, progress_callback, meta=given
        )
        return cast(CallToolResult, result)


class SigningAuth(httpx2.Auth):
    """Every request of the MCP connection: an ``X-Request-Id``, the trace context, and a
    signature over the exact bytes when the worker has keys."""

    requires_request_body = True

    def __init__(self, signer: RequestSigner | None) -> None:
        self.signer = signer

    def auth_flow(
        self, request: httpx2.Request
    ) -> Generator[httpx2.Request, httpx2.Response, None]:
        headers = {REQUEST_ID: request.headers.get(REQUEST_ID) or "req-" + uuid.uuid4().hex[:12]}
        if tracing.TRACER is not None:
            headers.update(lease_spans.context_headers())
        if self.signer is not None:
            signed = dict(request.headers)
            signed.update(headers)
            self.signer.sign(request.method, str(request.url), signed, request.content)
            headers = signed
        for name, value in headers.items():
            request.headers[name] = value
        yield request


@asynccontextmanager
async def connect(
    job: FencedJob,
    url: str,
    *,
    entity: str | None = None,
    signer: RequestSigner | None = None,
    timeout: float = 30.0,
    read_timeout: float = 300.0,
) -> AsyncIterator[FencedMcpSession]:
    """An MCP connection (streamable HTTP) for one job, closed on leaving. What the body
    raises comes out as it is (``OwnershipLost``, the SDK's ``MCPError``), not wrapped in
    the exception group of the SDK's task group."""
    job.guard()
    http = httpx2.AsyncClient(
        auth=SigningAuth(signer), timeout=httpx2.Timeout(timeout, read=read_timeout)
    )
    try:
        async with http, Client(streamable_http_client(url, http_client=http)) as session:
            yield FencedMcpSession(job, cast(ToolCaller, session), url=url, entity=entity)
    except BaseExceptionGroup as group:
        leaf = _only(group)
        if leaf is None:
            raise
        raise leaf from group


def _only(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception a (nested) group holds, or None when it holds several."""
    seen: BaseException = group
    while isinstance(seen, BaseExceptionGroup):
        if len(seen.exceptions) != 1:
            return None
        seen = seen.exceptions[0]
    return seen
