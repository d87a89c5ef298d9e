"""The fenced client (aiohttp and httpx) against a real upstream on a real socket: the
headers it adds, the signature over the exact body, and its refusal to send once ownership
is lost or unknown."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx
import pytest

from fencegate.lease.events import EventLog
from fencegate.lease.execution import Execution, OwnershipLost, OwnershipUnknown
from fencegate.lease.job import JobContext
from fencegate.lease.models import Lease
from fencegate.signing import HttpSigner
from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess

KEY = "payment:inv-1042:capture"
WORKER_SECRET = b"worker-one-secret-of-32-bytes-or-more"


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def make_job(
    session: aiohttp.ClientSession | None,
    *,
    signer: HttpSigner | None = None,
    lease_seconds: float = 30.0,
    confirmed_at: float | None = None,
) -> JobContext:
    lease = Lease(
        job_id=7,
        kind="capture_payment",
        owner_id="w1",
        fencing_token=42,
        lease_until=dt.datetime.now(dt.UTC),
        lease_seconds=lease_seconds,
        heartbeat_seconds=5.0,
        attempt=1,
        max_attempts=3,
        payload={"card": "4242424242424242"},
        idempotency_key=KEY,
        stage_timeout_seconds=None,
        tool_timeout_seconds=None,
    )
    execution = Execution(
        lease, confirmed_at=time.monotonic() if confirmed_at is None else confirmed_at
    )
    return JobContext(
        execution,
        queue=None,  # type: ignore[arg-type]  # stages are not used here
        events=EventLog(),
        worker_id="w1",
        ownership_margin=2.0,
        signer=signer,
        session=(lambda: session) if session is not None else None,
    )


def received(answer: dict[str, Any]) -> dict[str, str]:
    return {k.lower(): v for k, v in answer["headers"]}


async def test_adds_key_fence_and_entity(
    upstream: UpstreamProcess, session: aiohttp.ClientSession
) -> None:
    job = make_job(session)
    response = await job.http().post(f"{upstream.url}/payments/inv-1042/capture", json={"a": 1})
    assert response.status == 200
    headers = received(await response.json())
    assert headers["idempotency-key"] == f"{KEY}:POST /payments/inv-1042/capture"
    assert headers["x-execution-fence"] == "42"
    assert headers["x-execution-entity"] == "job:7"

    response = await job.http(entity="invoice:inv-1042").post(
        f"{upstream.url}/capture", json={"a": 1}, step="capture"
    )
    headers = received(await response.json())
    assert headers["idempotency-key"] == f"{KEY}:capture"
    assert headers["x-execution-entity"] == "invoice:inv-1042"

    [started, _] = job.events.named("tool_request_started")
    assert started["token"] == 42 and started["job"] == "7"
    assert started["idempotency_key"] == f"{KEY}:POST /payments/inv-1042/capture"
    assert "4242" not in str(job.events.records)  # the payload never reaches the log


async def test_same_step_gives_same_key_on_every_attempt(
    upstream: UpstreamProcess, session: aiohttp.ClientSession
) -> None:
    first = await make_job(session).http().post(f"{upstream.url}/x", json={}, step="s")
    second = await make_job(session).http().post(f"{upstream.url}/x", json={}, step="s")
    first_key = received(await first.json())["idempotency-key"]
    assert first_key == received(await second.json())["idempotency-key"] == f"{KEY}:s"


async def test_signs_the_exact_body_after_the_fence_headers(
    upstream: UpstreamProcess, session: aiohttp.ClientSession
) -> None:
    signer = HttpSigner(key_id="worker-1", secret=b"s" * 32)
    job = make_job(session, signer=signer)
    response = await job.http().post(f"{upstream.url}/capture", json={"amount": 4200})
    headers = received(await response.json())
    sent_body = b'{"amount":4200}'
    expected = base64.b64encode(hashlib.sha256(sent_body).digest()).decode()
    assert headers["content-digest"] == f"sha-256=:{expected}:"
    assert 'keyid="worker-1"' in headers["signature-input"]
    for covered in ('"idempotency-key"', '"x-execution-fence"', '"x-execution-entity"'):
        assert covered in headers["signature-input"]
    assert headers["signature"].startswith("sig1=:")


async def test_refuses_once_the_lease_is_lost(
    upstream: UpstreamProcess, session: aiohttp.ClientSession
) -> None:
    job = make_job(session)
    before = upstream.total_requests()
    job.execution.mark_lost("zero_rows")
    with pytest.raises(OwnershipLost):
        await job.http().post(f"{upstream.url}/capture", json={})
    assert upstream.total_requests() == before
    assert job.events.named("tool_request_started") == []


async def test_refuses_while_ownership_is_unknown_and_resumes_after_renewal(
    upstream: UpstreamProcess, session: aiohttp.ClientSession
) -> None:
    job = make_job(session)
    before = upstream.total_requests()
    job.execution.mark_unknown()
    with pytest.raises(OwnershipUnknown):
        await job.http().post(f"{upstream.url}/capture", json={})
    assert upstream.total_requests() == before
    job.execution.renewed(job.lease, sent_at=time.monotonic())
    response = await job.http().post(f"{upstream.url}/capture", json={})
    assert response.status == 200


async def test_refuses_when_the_confirmed_lease_is_inside_the_margin(
    upstream: UpstreamProcess, session: aiohttp.ClientSession
) -> None:
    # Claimed 29 s ago with a 30 s lease and no renewal since: 1 s left, margin 2 s.
    job = make_job(session, lease_seconds=30.0, confirmed_at=time.monotonic() - 29.0)
    with pytest.raises(OwnershipUnknown, match="margin"):
        await job.http().get(f"{upstream.url}/status")
    with pytest.raises(OwnershipUnknown):
        job.ensure_owner()
    job.ensure_owner(margin=0.0)  # an explicit smaller margin is the caller's choice


async def test_httpx_auth_fences_signs_and_refuses(upstream: UpstreamProcess) -> None:
    signer = HttpSigner(key_id="worker-1", secret=b"s" * 32)
    job = make_job(None, signer=signer)
    async with httpx.AsyncClient(auth=job.httpx_auth()) as client:
        response = await client.post(
            f"{upstream.url}/capture",
            json={"amount": 4200},
            extensions={"fencegate_step": "capture"},
        )
        headers = received(response.json())
        assert headers["idempotency-key"] == f"{KEY}:capture"
        assert headers["x-execution-fence"] == "42"
        assert headers["x-execution-entity"] == "job:7"
        body = response.request.content
        expected = base64.b64encode(hashlib.sha256(body).digest()).decode()
        assert headers["content-digest"] == f"sha-256=:{expected}:"

        response = await client.get(f"{upstream.url}/status")
        assert received(response.json())["idempotency-key"] == f"{KEY}:GET /status"

        before = upstream.total_requests()
        job.execution.mark_lost("zero_rows")
        with pytest.raises(OwnershipLost):
            await client.post(f"{upstream.url}/capture", json={})
        assert upstream.total_requests() == before


def test_httpx_sync_client_is_fenced_too(upstream: UpstreamProcess) -> None:
    job = make_job(None)
    with httpx.Client(auth=job.httpx_auth(step="lookup", entity="customer:c-1048")) as client:
        headers = received(client.get(f"{upstream.url}/customers/c-1048").json())
    assert headers["idempotency-key"] == f"{KEY}:lookup"
    assert headers["x-execution-entity"] == "customer:c-1048"


@pytest.fixture(scope="module")
def signing_gateway(
    upstream: UpstreamProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    directory = tmp_path_factory.mktemp("worker-signing")
    keys = directory / "keys.toml"
    keys.write_text(
        "[[keys]]\n"
        'id = "worker-1"\n'
        'tenant = "billing"\n'
        'alg = "hmac-sha256"\n'
        f'secret = "{base64.b64encode(WORKER_SECRET).decode()}"\n'
    )
    with GatewayProcess(
        upstream=upstream.url,
        database_url=f"sqlite:///{directory / 'gateway.db'}",
        extra_args=["--keys", str(keys)],
    ) as gateway:
        yield gateway


@pytest.mark.parametrize("library", ["aiohttp", "httpx"])
async def test_signed_requests_pass_a_real_gateway_and_forgeries_do_not(
    upstream: UpstreamProcess,
    signing_gateway: GatewayProcess,
    session: aiohttp.ClientSession,
    library: str,
) -> None:
    async def send(signer: HttpSigner, step: str) -> tuple[int, dict[str, Any]]:
        job = make_job(session, signer=signer)
        url = f"{signing_gateway.url}/payments/inv-1042/capture?currency=EUR"
        if library == "aiohttp":
            response = await job.http().post(url, json={"amount": 4200}, step=step)
            return response.status, await response.json(content_type=None)
        async with httpx.AsyncClient(auth=job.httpx_auth(step=step)) as client:
            answer = await client.post(url, json={"amount": 4200})
            return answer.status_code, answer.json()

    step = f"signed-{library}"
    status, answer = await send(HttpSigner(key_id="worker-1", secret=WORKER_SECRET), step)
    assert status == 200, answer
    forwarded = received(answer)
    assert forwarded["idempotency-key"] == f"{KEY}:{step}"
    assert forwarded["x-execution-fence"] == "42"
    assert "signature" not in forwarded  # verified and stripped by the gateway

    forged = HttpSigner(key_id="worker-1", secret=b"x" * 32)
    status, problem = await send(forged, f"forged-{library}")
    assert status == 401, problem
    assert await upstream.acount(f"{KEY}:forged-{library}") == 0
