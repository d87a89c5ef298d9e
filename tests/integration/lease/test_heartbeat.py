"""The heartbeat controller on both stores: it runs beside a tool that blocks its event
loop, renews only while the tool runs, and reacts to a store that stops answering by
refusing new actions, then giving up locally so a new owner can take over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from fencegate.lease import Lease, LeaseQueue
from fencegate.lease.drivers import postgres as postgres_driver
from fencegate.lease.drivers import sqlite as sqlite_driver
from fencegate.lease.events import EventLog
from fencegate.lease.execution import Execution, OwnershipUnknown
from fencegate.lease.heartbeat import HeartbeatController
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.testing import PartitionedStore, PartitionSwitch
from tests.support.workers import (
    claim_when_free,
    make_worker,
    names,
    partitioned_heartbeat,
    running,
    wait_for_state,
    wait_until,
)


@contextlib.contextmanager
def rival_claimer(url: str, kind: str) -> Iterator[list[Lease]]:
    """A rival worker on its own thread, loop and connection: once w1 holds a job of this
    kind, it tries to claim it as fast as it can. Yields the leases it won."""
    stop, won = threading.Event(), []

    async def rival() -> None:
        q = await LeaseQueue.connect(url)
        try:
            while not stop.is_set():
                if any(j.owner_id == "w1" for j in await q.list_jobs(state="running", kind=kind)):
                    break
                await asyncio.sleep(0.02)
            while not stop.is_set():
                won.extend(await q.claim("rival", kinds=[kind], limit=1, timeout=10))
                await asyncio.sleep(0.05)
        finally:
            await q.close()

    thread = threading.Thread(target=asyncio.run, args=(rival(),), daemon=True)
    thread.start()
    try:
        yield won
    finally:
        stop.set()
        thread.join(timeout=30)


async def test_a_tool_blocking_its_event_loop_keeps_its_lease(
    store_url: str, queue: LeaseQueue
) -> None:
    lease_seconds, heartbeat_seconds = 1.2, 0.4

    async def blocking(job: JobContext) -> str:
        # A native call or a careless time.sleep: the worker's loop is frozen for three
        # heartbeat periods, longer than the lease itself.
        time.sleep(max(3 * heartbeat_seconds, 1.5 * lease_seconds))  # noqa: ASYNC251
        return "done"

    job_id = await queue.enqueue(
        "blocking",
        {},
        idempotency_key="blocking:1",
        lease_seconds=lease_seconds,
        heartbeat_seconds=heartbeat_seconds,
        jitter_seconds=0.5,
    )
    worker = make_worker(store_url, {"blocking": blocking})
    events = worker.events
    with rival_claimer(store_url, "blocking") as won:
        async with running(worker):
            job = await wait_for_state(queue, job_id, "succeeded", "failed")
    assert won == []  # the rival never got the job
    assert (job.state, job.result, job.attempt) == ("succeeded", "done", 1)
    [claimed] = events.named("job_claimed")
    assert job.fencing_token == claimed["token"]
    assert len(await queue.attempts(job_id)) == 1
    assert len(events.named("heartbeat_ok")) >= 2


async def test_renews_only_while_the_execution_runs(store_url: str, queue: LeaseQueue) -> None:
    extends: list[float] = []

    class Counting:
        def __init__(self, inner: LeaseQueue) -> None:
            self.inner = inner

        async def extend(self, lease: Lease, *, timeout: float) -> Lease | None:
            extends.append(time.monotonic())
            return await self.inner.extend(lease, timeout=timeout)

        async def get(self, job_id: Any, *, timeout: float) -> Any:
            return await self.inner.get(job_id, timeout=timeout)

        async def close(self) -> None:
            await self.inner.close()

    async def connect() -> Counting:
        return Counting(await LeaseQueue.connect(store_url))

    await queue.enqueue(
        "k", {}, idempotency_key="k:1", lease_seconds=2, heartbeat_seconds=0.2, jitter_seconds=1
    )
    [lease] = await queue.claim("w1", kinds=["k"])
    controller = HeartbeatController(
        connect,
        events=EventLog(),
        metrics=WorkerMetrics(registry=CollectorRegistry()),
        worker_id="w1",
    )
    await asyncio.to_thread(controller.start, timeout=10)
    try:
        execution = Execution(lease, confirmed_at=time.monotonic())
        controller.register(execution, kind="k", cancel=lambda: None, margin=0.2)
        await wait_until(lambda: len(extends) >= 3, what="three renewals", timeout=30)
        controller.unregister(execution)
        stopped_at = len(extends)
        await asyncio.sleep(1.0)  # five periods
        assert len(extends) <= stopped_at + 1  # at most the one already in flight
    finally:
        await asyncio.to_thread(controller.stop, timeout=10)


async def test_unknown_ownership_refuses_actions_until_a_renewal_succeeds(
    store_url: str, queue: LeaseQueue
) -> None:
    switch = PartitionSwitch()
    refused = asyncio.Event()

    async def careful(job: JobContext) -> str:
        # Its next step must wait for a confirmed lease: refused now, allowed after renewal.
        await wait_until(lambda: switch.partitioned, what="partition")
        while True:
            try:
                job.guard()
            except OwnershipUnknown:
                refused.set()
                break
            await asyncio.sleep(0.02)
        await job.wait_for_ownership(timeout=30)
        return "acted after renewal"

    job_id = await queue.enqueue(
        "careful",
        {},
        idempotency_key="careful:1",
        lease_seconds=3,
        heartbeat_seconds=0.5,
        jitter_seconds=1,
    )

    worker = make_worker(
        store_url,
        {"careful": careful},
        heartbeat_store=partitioned_heartbeat(store_url, switch),
        ownership_margin_seconds=0.5,
    )
    events = worker.events
    async with running(worker):
        await wait_until(lambda: events.named("job_claimed"), what="claim")
        switch.partition()
        await asyncio.wait_for(refused.wait(), 30)
        switch.heal()
        job = await wait_for_state(queue, job_id, "succeeded", "failed")
    assert (job.state, job.result, job.attempt) == ("succeeded", "acted after renewal", 1)
    flow = names(events.for_job(job_id))
    assert flow.index("heartbeat_failed") < flow.index("ownership_unknown")
    assert "heartbeat_ok" in flow[flow.index("ownership_unknown") :]
    assert "heartbeat_lost" not in flow


async def test_partitioned_worker_gives_up_and_a_new_owner_takes_over(
    store_url: str, queue: LeaseQueue
) -> None:
    switch = PartitionSwitch()
    cancelled = asyncio.Event()

    async def long_call(job: JobContext) -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    job_id = await queue.enqueue(
        "long",
        {},
        idempotency_key="long:1",
        lease_seconds=2,
        heartbeat_seconds=0.5,
        jitter_seconds=0.5,
    )
    w1_queue = await LeaseQueue.connect(store_url)
    worker = make_worker(
        PartitionedStore(w1_queue, switch),
        {"long": long_call},
        heartbeat_store=partitioned_heartbeat(store_url, switch),
    )
    events = worker.events
    try:
        async with running(worker):
            await wait_until(lambda: events.named("job_claimed"), what="claim")
            [claimed] = events.named("job_claimed")
            switch.partition()
            await asyncio.wait_for(cancelled.wait(), 30)
            # W2 claims once the lease has run out on the database clock.
            w2 = await claim_when_free(queue, "w2", "long", timeout=30)
            assert w2.fencing_token > claimed["token"] and w2.attempt == 2
            assert await queue.complete(w2, "done by w2")
            switch.heal()
    finally:
        await w1_queue.close()
    flow = names(events.for_job(job_id))
    assert flow[:3] == ["job_claimed", "heartbeat_failed", "ownership_unknown"]
    [lost] = events.named("heartbeat_lost")
    assert lost["reason"] == "ownership_unknown_past_margin"
    assert "result_rejected" in flow and "result_committed" not in flow
    job = await queue.get(job_id)
    assert (job.state, job.result, job.owner_id) == ("succeeded", "done by w2", "w2")
    history = await queue.attempts(job_id)
    assert [(a.owner_id, a.outcome) for a in history] == [
        ("w1", "lease_expired"),
        ("w2", "succeeded"),
    ]


async def test_a_tool_stuck_past_its_timeout_is_not_kept_alive(
    store_url: str, queue: LeaseQueue
) -> None:
    lease_seconds, heartbeat_seconds = 1.2, 0.4

    async def stuck(job: JobContext) -> str:
        # Blocks the loop, so the worker cannot even cancel it at its 0.5 s tool timeout.
        time.sleep(4 * lease_seconds)  # noqa: ASYNC251
        return "too late"

    job_id = await queue.enqueue(
        "stuck",
        {},
        idempotency_key="stuck:1",
        lease_seconds=lease_seconds,
        heartbeat_seconds=heartbeat_seconds,
        jitter_seconds=0.5,
        tool_timeout_seconds=0.5,
    )
    worker = make_worker(store_url, {"stuck": stuck})
    events = worker.events
    with rival_claimer(store_url, "stuck") as won:
        async with running(worker):
            await wait_until(lambda: events.named("result_rejected"), what="rejection")
    [claimed] = events.named("job_claimed")
    [lost] = events.named("heartbeat_lost")
    assert lost["reason"] == "tool_timeout_overrun"
    assert won and {lease.job_id for lease in won} == {job_id}
    assert won[0].fencing_token > claimed["token"]
    assert events.named("result_committed") == []
    job = await queue.get(job_id)
    assert job.owner_id == "rival" and job.result is None


async def test_a_bug_in_the_renewal_is_not_reported_as_ownership_unknown(
    store_url: str, queue: LeaseQueue, monkeypatch: Any, caplog: Any
) -> None:
    """A renewal statement of ours that is wrong (here: a syntax error, on the real server) is
    a bug, not an unreachable store: the worker gives the lease up at once (reason
    ``internal_error``, traceback logged) instead of waiting it out as "ownership unknown"."""
    caplog.set_level(logging.ERROR, logger="fencegate.worker")
    if store_url.startswith("sqlite"):
        monkeypatch.setattr(sqlite_driver.Q, "lease_extend", "SELEC broken", raising=False)
    else:
        monkeypatch.setattr(postgres_driver.Q, "lease_extend_many", "SELEC broken", raising=False)
    cancelled = asyncio.Event()

    async def long_call(job: JobContext) -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    job_id = await queue.enqueue(
        "long", {}, idempotency_key="long:bug", lease_seconds=30, heartbeat_seconds=0.3,
        jitter_seconds=1,
    )  # fmt: skip
    worker = make_worker(store_url, {"long": long_call})
    events = worker.events
    async with running(worker):
        await asyncio.wait_for(cancelled.wait(), 20)  # long before the 30 s lease ends
        await wait_until(lambda: events.named("result_rejected"), what="the result refused")
    flow = names(events.for_job(job_id))
    assert "heartbeat_failed" not in flow and "ownership_unknown" not in flow
    [lost] = events.named("heartbeat_lost")
    assert lost["reason"] == "internal_error"
    assert lost["error"] in ("PostgresSyntaxError", "OperationalError")
    logged = [r for r in caplog.records if "internal error in heartbeat" in r.getMessage()]
    assert logged and logged[0].exc_info is not None
