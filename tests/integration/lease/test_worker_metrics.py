"""Worker metrics by work class, provider and model, read from a real Prometheus registry:
ownership (heartbeat age, remaining lease), trouble (failed renewals, expired leases),
reclaims and outcomes."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from fencegate.lease import LeaseQueue, WorkClass
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.testing import PartitionSwitch
from tests.support.workers import (
    SHORT,
    make_worker,
    partitioned_heartbeat,
    running,
    wait_for_state,
    wait_until,
)

# A work class that declares no provider or model labels its jobs with "".
NONE = {"provider": "", "model": ""}


async def test_ownership_gauges_reclaims_and_outcomes(store_url: str, queue: LeaseQueue) -> None:
    registry = CollectorRegistry()
    release = asyncio.Event()

    async def tool(job: JobContext) -> str:
        await release.wait()
        return "ok"

    # A ghost claims the job and dies: the worker gets it back as attempt 2.
    job_id = await queue.enqueue("report", {}, idempotency_key="report:1", **SHORT)
    await queue.claim("ghost", kinds=["report"])
    worker = make_worker(
        store_url, {"report": tool}, metrics=WorkerMetrics(registry=registry), poll_seconds=0.2
    )
    sample = registry.get_sample_value
    async with running(worker):
        await wait_until(lambda: worker.events.named("heartbeat_ok"), what="a renewal")
        assert sample("fencegate_worker_leases_held", {"kind": "report", **NONE}) == 1
        age = sample("fencegate_worker_heartbeat_age_seconds", {"kind": "report", **NONE})
        remaining = sample("fencegate_worker_lease_remaining_seconds", {"kind": "report", **NONE})
        assert age is not None and 0 <= age < SHORT["lease_seconds"]
        assert remaining is not None and 0 < remaining <= SHORT["lease_seconds"]
        release.set()
        await wait_for_state(queue, job_id, "succeeded")
        await wait_until(lambda: worker.events.named("result_committed"), what="commit")
    assert sample("fencegate_worker_reclaimed_jobs_total", {"kind": "report", **NONE}) == 1
    assert (
        sample(
            "fencegate_worker_outcomes_total", {"kind": "report", "outcome": "succeeded", **NONE}
        )
        == 1
    )
    assert sample("fencegate_worker_leases_held", {"kind": "report", **NONE}) is None
    assert b"fencegate_worker_failed_renewals" in generate_latest(registry)


async def test_failed_renewals_and_expired_leases(store_url: str, queue: LeaseQueue) -> None:
    registry = CollectorRegistry()
    switch = PartitionSwitch()

    async def tool(job: JobContext) -> str:
        await asyncio.sleep(60)
        return "never"

    await queue.enqueue("browse", {}, idempotency_key="browse:1", **SHORT)
    worker = make_worker(
        store_url,
        {"browse": tool},
        metrics=WorkerMetrics(registry=registry),
        heartbeat_store=partitioned_heartbeat(store_url, switch),
    )
    async with running(worker):
        await wait_until(lambda: worker.events.named("job_claimed"), what="claim")
        switch.partition()
        await wait_until(lambda: worker.events.named("result_rejected"), what="giving up")
    sample = registry.get_sample_value
    failed = sample("fencegate_worker_failed_renewals_total", {"kind": "browse", **NONE})
    assert failed is not None and failed >= 1
    assert failed == len(worker.events.named("heartbeat_failed"))
    assert sample("fencegate_worker_expired_leases_total", {"kind": "browse", **NONE}) == 1
    assert (
        sample("fencegate_worker_outcomes_total", {"kind": "browse", "outcome": "rejected", **NONE})
        == 1
    )


async def test_metrics_and_events_carry_the_declared_provider_and_model(
    store_url: str, queue: LeaseQueue
) -> None:
    registry = CollectorRegistry()
    summarize = WorkClass(kind="summarize", provider="openai", model="small", models=("large",))
    queue.declare(summarize)
    large = await queue.enqueue("summarize", {}, model="large")
    small = await queue.enqueue("summarize", {})

    async def tool(job: JobContext) -> str:
        return "ok"

    worker = make_worker(
        store_url,
        {"summarize": tool},
        work_classes=[summarize],
        metrics=WorkerMetrics(registry=registry),
        poll_seconds=0.2,
    )
    async with running(worker):
        await wait_for_state(queue, large, "succeeded")
        await wait_for_state(queue, small, "succeeded")
        await wait_until(
            lambda: len(worker.events.named("result_committed")) == 2, what="both commits"
        )
    sample = registry.get_sample_value
    for model in ("large", "small"):
        labels = {"kind": "summarize", "provider": "openai", "model": model}
        assert sample("fencegate_worker_outcomes_total", labels | {"outcome": "succeeded"}) == 1
    claimed = {e["job"]: (e["provider"], e["model"]) for e in worker.events.named("job_claimed")}
    assert claimed == {str(large): ("openai", "large"), str(small): ("openai", "small")}
