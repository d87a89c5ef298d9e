"""The fenced HTTP client (aiohttp): every side-effecting call a job makes goes through it.

Before each request it checks, with a margin, that the job still owns its lease; then it
sends ``Idempotency-Key`` (the job's key plus a step), ``X-Execution-Fence`` (the token) and
``X-Execution-Entity``, signs the exact bytes it sends, and logs ``tool_request_started``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp
import orjson
from yarl import URL

from fencegate import tracing
from fencegate.lease import spans as lease_spans
from fencegate.lease.events import digest
from fencegate.types import RequestSigner

IDEMPOTENCY_KEY = "Idempotency-Key"
EXECUTION_FENCE = "X-Execution-Fence"
EXECUTION_ENTITY = "X-Execution-Entity"
REQUEST_ID = "X-Request-Id"

_NO_JSON: Any = object()


class FencedJob(Protocol):
    """What a fenced client needs of the job it sends for (`fencegate.lease.job.JobContext`
    has it): the key and fence to send, the last ownership check, the event log."""

    @property
    def fencing_token(self) -> int: ...

    @property
    def default_entity(self) -> str: ...

    @property
    def current_stage(self) -> str | None: ...

    def step_key(self, step: str) -> str: ...

    def guard(self) -> None: ...

    def emit(self, event: str, **fields: Any) -> None: ...


def fence_headers(job: FencedJob, *, step: str, entity: str | None) -> dict[str, str]:
    headers = {
        IDEMPOTENCY_KEY: job.step_key(step),
        EXECUTION_FENCE: str(job.fencing_token),
        EXECUTION_ENTITY: entity or job.default_entity,
    }
    if tracing.TRACER is not None:  # the attempt's span is the parent of the gateway's
        headers.update(lease_spans.context_headers())
    return headers


def start_request(
    job: FencedJob,
    *,
    method: str,
    url: str,
    step: str,
    headers: Mapping[str, str],
    body: bytes,
) -> None:
    """The last ownership check right before the bytes leave (the fence at the receiver
    covers the rest), then ``tool_request_started``: ids and a hash, never the body."""
    job.guard()
    job.emit(
        "tool_request_started",
        request=headers[REQUEST_ID],
        method=method,
        url=url,
        step=step,
        idempotency_key=headers[IDEMPOTENCY_KEY],
        entity=headers[EXECUTION_ENTITY],
        body_sha256=digest(body) if body else None,
    )


def default_step(job: FencedJob, method: str, path: str) -> str:
    step = f"{method.upper()} {path or '/'}"
    return f"{job.current_stage}:{step}" if job.current_stage else step


class FencedClient:
    """``job.http()``: request/get/post/put/patch/delete over the worker's pooled session.

    Each call returns the `aiohttp.ClientResponse` with its body already read (so
    ``await resp.json()`` works after the connection went back to the pool).
    """

    def __init__(
        self,
        job: FencedJob,
        session: aiohttp.ClientSession,
        *,
        entity: str | None = None,
        signer: RequestSigner | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.job = job
        self.session = session
        self.entity = entity
        self.signer = signer
        self.timeout = timeout

    async def request(
        self,
        method: str,
        url: str,
        *,
        step: str | None = None,
        entity: str | None = None,
        json: Any = _NO_JSON,
        data: bytes | str | None = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> aiohttp.ClientResponse:
        method = method.upper()
        target = URL(url)
        if params:
            target = target.update_query(params)
        out: dict[str, str] = dict(headers or {})
        body = b""
        if json is not _NO_JSON:
            body = orjson.dumps(json)
            out.setdefault("Content-Type", "application/json")
        elif isinstance(data, str):
            body = data.encode()
            out.setdefault("Content-Type", "text/plain; charset=utf-8")
        elif data is not None:
            body = bytes(data)
            out.setdefault("Content-Type", "application/octet-stream")
        step = step or default_step(self.job, method, target.path)
        fenced = fence_headers(self.job, step=step, entity=entity or self.entity)
        out.update(fenced)
        out.setdefault(REQUEST_ID, "req-" + uuid.uuid4().hex[:12])
        if self.signer is not None:
            self.signer.sign(method, str(target), out, body)
        start_request(
            self.job,
            method=method,
            url=str(target.with_query(None)),
            step=step,
            headers=out,
            body=body,
        )
        async with self.session.request(
            method,
            target,
            data=body if body else None,
            headers=out,
            timeout=aiohttp.ClientTimeout(total=timeout or self.timeout),
        ) as response:
            await response.read()
        return response

    async def get(self, url: str, **options: Any) -> aiohttp.ClientResponse:
        return await self.request("GET", url, **options)

    async def post(self, url: str, **options: Any) -> aiohttp.ClientResponse:
        return await self.request("POST", url, **options)

    async def put(self, url: str, **options: Any) -> aiohttp.ClientResponse:
        return await self.request("PUT", url, **options)

    async def patch(self, url: str, **options: Any) -> aiohttp.ClientResponse:
        return await self.request("PATCH", url, **options)

    async def delete(self, url: str, **options: Any) -> aiohttp.ClientResponse:
        return await self.request("DELETE", url, **options)
