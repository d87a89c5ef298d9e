"""Small helpers for the worker tests: build a worker with its own events and metrics, run it
in the background, wait for a job state (bounded in time), short intervals that satisfy the
lease rule, a heartbeat connection behind a partition switch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from fencegate.lease import Job, Lease, LeaseQueue
from fencegate.lease.events import EventLog
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.testing import PartitionedStore, PartitionSwitch
from fencegate.lease.worker import Worker
from tests.support.waits import wait_until as wait_until

# lease 2 s > 1 x heartbeat 0.5 s + jitter 0.5 s
SHORT: dict[str, Any] = {"lease_seconds": 2.0, "heartbeat_seconds": 0.5, "jitter_seconds": 0.5}


def make_worker(store: Any, tools: dict[str, Any], **options: Any) -> Worker:
    """A worker ``w1`` with its own event log and metrics registry (tests read both)."""
    options.setdefault("events", EventLog())
    options.setdefault("metrics", WorkerMetrics(registry=CollectorRegistry()))
    options.setdefault("worker_id", "w1")
    options.setdefault("grace_seconds", 5.0)
    return Worker(store, tools=tools, **options)


def partitioned_heartbeat(
    store_url: str, switch: PartitionSwitch
) -> Callable[[], Awaitable[PartitionedStore]]:
    """A ``heartbeat_store=`` whose connection the switch can cut off."""

    async def connect() -> PartitionedStore:
        return PartitionedStore(await LeaseQueue.connect(store_url), switch)

    return connect


@contextlib.asynccontextmanager
async def running(worker: Worker, *, timeout: float = 30.0) -> AsyncIterator[Worker]:
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, timeout)


async def wait_for_state(
    queue: LeaseQueue, job_id: int, *states: str, timeout: float = 30.0
) -> Job:
    deadline = asyncio.get_running_loop().time() + timeout
    job = await queue.get(job_id)
    while job.state not in states:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"job {job_id} still {job.state} after {timeout}s, not {states}")
        await asyncio.sleep(0.05)
        job = await queue.get(job_id)
    return job


async def claim_when_free(
    queue: LeaseQueue, owner: str, kind: str, *, timeout: float = 60.0
) -> Lease:
    """Claim one job of ``kind`` as soon as it can be had (its lease ran out on the
    database clock); fail the test if it cannot be had within ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        leases = await queue.claim(owner, kinds=[kind], limit=1)
        if leases:
            return leases[0]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{owner} could not claim a {kind} job within {timeout}s")
        await asyncio.sleep(0.05)


def names(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events]
