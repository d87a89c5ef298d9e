"""httpx integration: an `httpx.Auth` that fences and signs each request of a job.

httpx is an optional extra (``pip install fencegate[httpx]``); this module is imported only
when used::

    async with httpx.AsyncClient(auth=job.httpx_auth()) as client:
        await client.post(url, json=..., extensions={"fencegate_step": "capture"})

The step of the ``Idempotency-Key`` comes from the request's ``fencegate_step`` extension,
else the one given to the auth, else method and path (as with the aiohttp client).
"""

from __future__ import annotations

import uuid
from collections.abc import Generator

import httpx

from fencegate.lease.client import (
    REQUEST_ID,
    FencedJob,
    default_step,
    fence_headers,
    start_request,
)
from fencegate.types import RequestSigner

STEP_EXTENSION = "fencegate_step"
ENTITY_EXTENSION = "fencegate_entity"


class FencedAuth(httpx.Auth):
    requires_request_body = True  # the signature covers the exact body bytes

    def __init__(
        self,
        job: FencedJob,
        *,
        step: str | None = None,
        entity: str | None = None,
        signer: RequestSigner | None = None,
    ) -> None:
        self.job = job
        self.step = step
        self.entity = entity
        self.signer = signer

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        step = (
            request.extensions.get(STEP_EXTENSION)
            or self.step
            or default_step(self.job, request.method, request.url.path)
        )
        entity = request.extensions.get(ENTITY_EXTENSION) or self.entity
        headers = fence_headers(self.job, step=str(step), entity=entity)
        headers[REQUEST_ID] = request.headers.get(REQUEST_ID) or "req-" + uuid.uuid4().hex[:12]
        body = request.content
        if self.signer is not None:
            # Sign over what is sent: the caller's headers plus the fence headers.
            signed = dict(request.headers)
            signed.update(headers)
            self.signer.sign(request.method, str(request.url), signed, body)
            headers = signed
        for name, value in headers.items():
            request.headers[name] = value
        start_request(
            self.job,
            method=request.method,
            url=str(request.url.copy_with(query=None)),
            step=str(step),
            headers=headers,
            body=body,
        )
        yield request
