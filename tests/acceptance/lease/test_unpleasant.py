"""The unpleasant test (from the article): W1 claims a job and sends its side effect through
a real gateway; then W1 loses the store (PostgreSQL: a real TCP relay goes silent; SQLite:
W1's store calls stop answering); the lease expires; W2 claims with a larger token and
retries the side effect, which the gateway replays; the network heals. W1 cannot renew,
cannot commit, and its late request is refused with 412. The upstream executed once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from fencegate.lease import LeaseQueue
from fencegate.lease.events import EventLog
from fencegate.lease.execution import OwnershipLost
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.testing import PartitionedStore, PartitionSwitch
from fencegate.lease.worker import Worker
from tests.support.gateway import GatewayProcess
from tests.support.net import TcpRelay
from tests.support.upstream import UpstreamProcess
from tests.support.workers import running, wait_for_state, wait_until

STEP = "capture"


@dataclass
class Partition:
    """How W1 reaches the store, and how the test cuts it off."""

    worker_queue: Any  # a URL or a queue object for W1's worker
    heartbeat_store: Callable[[], Any] | None
    silence: Callable[[], None]
    heal: Callable[[], None]
    how: str


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


@pytest.fixture
async def partition(store_kind: str, store_url: str) -> AsyncIterator[Partition]:
    if store_kind == "postgresql":
        with TcpRelay.to_database(store_url) as relay:
            yield Partition(
                relay.url_for(store_url), None, relay.silence, relay.heal, "TCP relay silenced"
            )
        return
    switch = PartitionSwitch()
    w1_queue = await LeaseQueue.connect(store_url)

    async def heartbeat_store() -> PartitionedStore:
        return PartitionedStore(await LeaseQueue.connect(store_url), switch)

    try:
        yield Partition(
            PartitionedStore(w1_queue, switch),
            heartbeat_store,
            switch.partition,
            switch.heal,
            "W1's store calls stop answering",
        )
    finally:
        await w1_queue.close()


async def test_old_owner_is_fenced_off_after_a_partition(
    store_url: str, partition: Partition, upstream: UpstreamProcess
) -> None:
    # One upstream serves both stores' runs: each run captures its own invoice.
    invoice = f"inv-{uuid.uuid4().hex[:8]}"
    key = f"payment:{invoice}:capture"
    queue = await LeaseQueue.connect(store_url)
    gateway = GatewayProcess(upstream=upstream.url, database_url=store_url)
    await asyncio.to_thread(gateway.start)
    answers: list[dict[str, Any]] = []
    w1_jobs: list[JobContext] = []
    capture_url = f"{gateway.url}/payments/{invoice}/capture?delay=0.5"

    async def capture(job: JobContext) -> dict[str, Any]:
        if job.worker_id == "w1":
            w1_jobs.append(job)
        response = await job.http().post(capture_url, json={"amount": 4200}, step=STEP)
        body = await response.json()
        answers.append(
            {
                "worker": job.worker_id,
                "token": job.fencing_token,
                "status": response.status,
                "replayed": response.headers.get("Idempotent-Replayed"),
                "execution": body.get("execution"),
            }
        )
        return {"execution": body.get("execution"), "status": response.status}

    def worker(name: str, store: Any, heartbeat_store: Any = None) -> Worker:
        return Worker(
            store,
            tools={"capture": capture},
            worker_id=name,
            events=EventLog(),
            metrics=WorkerMetrics(registry=CollectorRegistry()),
            heartbeat_store=heartbeat_store,
            store_timeout=1.0,
            grace_seconds=2.0,
        )

    try:
        job_id = await queue.enqueue(
            "capture",
            {"invoice": invoice, "amount": 4200},
            idempotency_key=key,
            lease_seconds=3.0,
            heartbeat_seconds=0.5,
            jitter_seconds=1.0,
        )
        w1 = worker("w1", partition.worker_queue, partition.heartbeat_store)
        async with running(w1):
            await wait_until(lambda: w1.events.named("tool_request_started"), what="W1 sends")
            partition.silence()  # W1's capture is in flight; W1 can no longer reach the store
            await wait_until(lambda: w1.events.named("result_rejected"), what="W1 gives up")

            w2 = worker("w2", store_url)
            async with running(w2):
                job = await wait_for_state(queue, job_id, "succeeded", "failed")
            partition.heal()

            # W1 wakes up and tries everything an old owner could try.
            [w1_job] = w1_jobs
            w1_lease = w1_job.lease
            assert await w1.queue.extend(w1_lease, timeout=10) is None  # type: ignore[union-attr]
            assert not await w1.queue.complete(  # type: ignore[union-attr]
                w1_lease, {"execution": 1, "status": 200}, timeout=10
            )
            with pytest.raises(OwnershipLost):  # its own client refuses first...
                await w1_job.http().post(capture_url, json={"amount": 4200}, step=STEP)
            async with aiohttp.ClientSession() as session:  # ...and if it was on the wire:
                async with session.post(
                    capture_url,
                    json={"amount": 4200},
                    headers={
                        "Idempotency-Key": f"{key}:{STEP}",
                        "X-Execution-Fence": str(w1_lease.fencing_token),
                        "X-Execution-Entity": f"job:{job_id}",
                    },
                ) as late:
                    late_status = late.status
                    late_problem = await late.json(content_type=None)
    finally:
        await asyncio.to_thread(gateway.terminate)
        await queue.close()

    w2_tokens = {a["token"] for a in answers if a["worker"] == "w2"}
    assert w2_tokens and min(w2_tokens) > w1_lease.fencing_token
    [w1_answer] = [a for a in answers if a["worker"] == "w1"]
    [w2_answer] = [a for a in answers if a["worker"] == "w2"]
    assert (w1_answer["status"], w1_answer["replayed"]) == (200, None)
    assert (w2_answer["status"], w2_answer["replayed"]) == (200, "true")
    assert w2_answer["execution"] == w1_answer["execution"] == 1
    assert (job.state, job.owner_id, job.result["execution"]) == ("succeeded", "w2", 1)
    assert late_status == 412, late_problem
    assert late_problem["type"].endswith("stale-fence")
    assert await upstream.acount(f"{key}:{STEP}") == 1  # one capture, whatever happened
    w1_events = [e["event"] for e in w1.events.records]
    assert "ownership_unknown" in w1_events
    assert "result_committed" not in w1_events
    assert "result_rejected" in w1_events
