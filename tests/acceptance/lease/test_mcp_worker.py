"""Workers whose tools call an MCP server through `fencegate serve`'s MCP route, with the
fenced MCP client (`job.mcp`): the key, fence and entity travel in ``_meta``, the POSTs are
signed, and the unpleasant test over MCP: W1 is cut off from the store in the middle of its
tools/call, W2 takes over and gets W1's result, W1 is fenced off, the tool ran once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from mcp.client.client import Client
from mcp.shared.exceptions import MCPError
from mcp_types import RequestParamsMeta
from prometheus_client import CollectorRegistry

from fencegate.gateway.mcp import ERROR_CODES
from fencegate.lease import LeaseQueue
from fencegate.lease.events import EventLog
from fencegate.lease.execution import OwnershipLost
from fencegate.lease.job import JobContext
from fencegate.lease.mcp_client import META_ENTITY, META_FENCE, META_KEY
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.worker import Worker
from fencegate.signing import HttpSigner
from tests.acceptance.lease.test_unpleasant import Partition, partition
from tests.acceptance.test_signing_gateway import ACME, write_keys
from tests.support.gateway import GatewayProcess
from tests.support.mcp_server import McpServerProcess
from tests.support.workers import running, wait_for_state, wait_until

__all__ = ["partition"]  # the store partition fixture, shared with the HTTP version

CONFIG = """
[[routes]]
prefix = "/mcp"
protocol = "mcp"

[[routes.tools]]
name = "charge"
require_fence = true
"""


@pytest.fixture(scope="module")
def server() -> Iterator[McpServerProcess]:
    with McpServerProcess(json_response=False) as process:
        yield process


def mcp_gateway(
    server: McpServerProcess, store_url: str, directory: Path, *, signed: bool = False
) -> GatewayProcess:
    config = directory / "mcp.toml"
    config.write_text(CONFIG)
    keys = ["--keys", str(write_keys(directory))] if signed else []
    return GatewayProcess(
        upstream=server.base, database_url=store_url, config=config, extra_args=keys
    )


def worker(
    name: str,
    store: Any,
    tools: dict[str, Any],
    *,
    heartbeat_store: Any = None,
    signer: HttpSigner | None = None,
) -> Worker:
    return Worker(
        store,
        tools=tools,
        worker_id=name,
        events=EventLog(),
        metrics=WorkerMetrics(registry=CollectorRegistry()),
        heartbeat_store=heartbeat_store,
        store_timeout=1.0,
        grace_seconds=2.0,
        signer=signer,
    )


async def test_a_worker_calls_a_tool_fenced_and_signed(
    server: McpServerProcess, store_url: str, tmp_path: Path
) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    gateway = mcp_gateway(server, store_url, tmp_path, signed=True)
    await asyncio.to_thread(gateway.start)
    queue = await LeaseQueue.connect(store_url)
    seen: list[dict[str, Any]] = []

    async def charge(job: JobContext) -> dict[str, Any]:
        async with job.mcp(f"{gateway.url}/mcp", entity=f"order:{order}") as tools:
            result = await tools.call_tool("charge", {"order": order, "amount": 5})
            again = await tools.call_tool("charge", {"order": order, "amount": 5})
        seen.append({"token": job.fencing_token, "key": job.idempotency_key})
        return {"text": result.content[0].text, "again": again.content[0].text}  # type: ignore[union-attr]

    try:
        job_id = await queue.enqueue(
            "charge", {"order": order}, idempotency_key=f"charge:{order}", lease_seconds=90
        )
        w = worker("w1", store_url, {"charge": charge}, signer=ACME)
        async with running(w):
            job = await wait_for_state(queue, job_id, "succeeded", "failed")
        # Unsigned, the connection's first request is refused: a JSON-RPC error.
        with pytest.raises(BaseExceptionGroup) as raised:
            async with Client(f"{gateway.url}/mcp") as unsigned:
                given = cast(RequestParamsMeta, {META_KEY: "x", META_FENCE: 1, META_ENTITY: "e"})
                await unsigned.call_tool("charge", {"order": order, "amount": 5}, meta=given)
        refused = raised.value
        while isinstance(refused, BaseExceptionGroup):
            refused = refused.exceptions[0]
        assert isinstance(refused, MCPError)
        log = gateway.log_text()
    finally:
        await asyncio.to_thread(gateway.terminate)
        await queue.close()
    assert job.state == "succeeded", job.error
    assert job.result == {"text": f"charged {order} 5 #1", "again": f"charged {order} 5 #1"}
    assert await server.acount(order) == 1
    [started, _] = w.events.named("tool_request_started")
    key = f"charge:{order}:tools/call charge"
    assert started["idempotency_key"] == key and started["tool"] == "charge"
    assert started["entity"] == f"order:{order}" and started["token"] == seen[0]["token"]
    # The gateway read them from _meta, under the signing key's tenant.
    assert f'key="{key}"' in log and "tenant=acme" in log and f"entity=order:{order}" in log
    assert f"fence={seen[0]['token']}" in log
    assert refused.error.code == ERROR_CODES["unauthorized"]
    assert refused.error.data["status"] == 401


async def test_old_owner_is_fenced_off_after_a_partition_over_mcp(
    server: McpServerProcess, store_url: str, partition: Partition, tmp_path: Path
) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    gateway = mcp_gateway(server, store_url, tmp_path)
    await asyncio.to_thread(gateway.start)
    queue = await LeaseQueue.connect(store_url)
    url = f"{gateway.url}/mcp"
    answers: list[dict[str, Any]] = []
    w1_jobs: list[JobContext] = []
    arguments = {"order": order, "amount": 42, "delay": 1.0}

    async def charge(job: JobContext) -> dict[str, Any]:
        if job.worker_id == "w1":
            w1_jobs.append(job)
        async with job.mcp(url) as tools:
            result = await tools.call_tool("charge", arguments)
        text = result.content[0].text  # type: ignore[union-attr]
        answers.append({"worker": job.worker_id, "token": job.fencing_token, "text": text})
        return {"text": text}

    try:
        job_id = await queue.enqueue(
            "charge",
            {"order": order},
            idempotency_key=f"charge:{order}",
            lease_seconds=3.0,
            heartbeat_seconds=0.5,
            jitter_seconds=1.0,
        )
        w1 = worker(
            "w1",
            partition.worker_queue,
            {"charge": charge},
            heartbeat_store=partition.heartbeat_store,
        )
        async with running(w1):
            await wait_until(lambda: w1.events.named("tool_request_started"), what="W1 calls")
            partition.silence()  # W1's tools/call is in flight; W1 can no longer reach the store
            await wait_until(lambda: w1.events.named("result_rejected"), what="W1 gives up")

            w2 = worker("w2", store_url, {"charge": charge})
            async with running(w2):
                job = await wait_for_state(queue, job_id, "succeeded", "failed")
            partition.heal()

            [w1_job] = w1_jobs
            w1_lease = w1_job.lease
            with pytest.raises(OwnershipLost):  # its own client refuses first...
                async with w1_job.mcp(url) as tools:
                    await tools.call_tool("charge", arguments)
            async with Client(url) as late:  # ...and if the call was on the wire:
                stale = {
                    META_KEY: f"charge:{order}:tools/call charge",
                    META_FENCE: w1_lease.fencing_token,
                    META_ENTITY: f"job:{job_id}",
                }
                with pytest.raises(MCPError) as refused:
                    await late.call_tool("charge", arguments, meta=cast(RequestParamsMeta, stale))
    finally:
        await asyncio.to_thread(gateway.terminate)
        await queue.close()

    w2_tokens = {a["token"] for a in answers if a["worker"] == "w2"}
    assert w2_tokens and min(w2_tokens) > w1_lease.fencing_token
    assert {a["text"] for a in answers} == {f"charged {order} 42 #1"}
    assert (job.state, job.owner_id) == ("succeeded", "w2")
    assert job.result == {"text": f"charged {order} 42 #1"}
    error = refused.value.error
    assert error.code == ERROR_CODES["stale-fence"], error
    assert error.data["last_accepted_fence"] == min(w2_tokens)
    assert await server.acount(order) == 1  # one charge, whatever happened
    w1_events = [e["event"] for e in w1.events.records]
    assert "ownership_unknown" in w1_events
    assert "result_committed" not in w1_events
