"""The Worker's group commit and claiming ahead, on both stores: one renewal statement per
interval for every lease held, a lost lease rejected alone among jobs committed together,
and leases claimed ahead that are renewed while they wait and given back if never run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

from fencegate.lease import Lease, LeaseQueue
from fencegate.lease.job import JobContext
from tests.support.workers import SHORT, make_worker, running, wait_for_state, wait_until


class CountingRenewals:
    """A heartbeat connection that records the size of every renewal statement."""

    def __init__(self, inner: LeaseQueue, sizes: list[int]) -> None:
        self.inner = inner
        self.sizes = sizes

    async def extend(self, lease: Lease, *, timeout: float) -> Lease | None:
        self.sizes.append(1)
        return await self.inner.extend(lease, timeout=timeout)

    async def extend_many(self, leases: Sequence[Lease], *, timeout: float) -> list[Lease | None]:
        self.sizes.append(len(leases))
        return await self.inner.extend_many(leases, timeout=timeout)

    async def get(self, job_id: Any, *, timeout: float) -> Any:
        return await self.inner.get(job_id, timeout=timeout)

    async def close(self) -> None:
        await self.inner.close()


def counting(store_url: str, sizes: list[int]) -> Callable[[], Awaitable[CountingRenewals]]:
    async def connect() -> CountingRenewals:
        return CountingRenewals(await LeaseQueue.connect(store_url), sizes)

    return connect


async def test_heartbeats_for_all_held_jobs_go_in_one_statement(
    store_url: str, queue: LeaseQueue
) -> None:
    release = asyncio.Event()

    async def hold(job: JobContext) -> str:
        await release.wait()
        return "done"

    ids = await queue.enqueue_many(
        [{"kind": "hold", "payload": {"n": n}, **SHORT} for n in range(5)]
    )
    sizes: list[int] = []
    worker = make_worker(
        store_url, {"hold": hold}, concurrency=5, heartbeat_store=counting(store_url, sizes)
    )
    async with running(worker):
        await wait_until(lambda: len(sizes) >= 3, what="three renewal rounds", timeout=20)
        rounds = list(sizes)
        release.set()
        for job_id in ids:
            await wait_for_state(queue, job_id, "succeeded")
    # Five leases, renewed together: one statement carries all five each round.
    assert rounds.count(5) >= 2, rounds
    assert len(worker.events.named("heartbeat_ok")) >= 10


async def test_lost_lease_is_rejected_alone_among_jobs_committed_together(
    store_url: str, queue: LeaseQueue
) -> None:
    release = asyncio.Event()

    async def hold(job: JobContext) -> dict[str, int]:
        await release.wait()
        return {"n": job.payload["n"]}

    ids = await queue.enqueue_many(
        [{"kind": "batch", "payload": {"n": n}, **SHORT} for n in range(4)]
    )
    worker = make_worker(store_url, {"batch": hold}, concurrency=4)
    async with running(worker):
        await wait_until(
            lambda: len(worker.events.named("job_claimed")) == 4, what="four jobs held"
        )
        assert await queue.cancel(ids[2], reason="operator")
        release.set()
        for job_id in (ids[0], ids[1], ids[3]):
            await wait_for_state(queue, job_id, "succeeded")
        await wait_until(
            lambda: worker.events.named("result_rejected"), what="the lost job rejected"
        )
    committed = {e["job"] for e in worker.events.named("result_committed")}
    assert committed == {str(ids[0]), str(ids[1]), str(ids[3])}
    [rejected] = worker.events.named("result_rejected")
    assert rejected["job"] == str(ids[2])
    job = await queue.get(ids[2])
    assert (job.state, job.result) == ("cancelled", None)


async def test_claims_ahead_renews_waiting_leases_and_gives_them_back_unstarted(
    store_url: str, queue: LeaseQueue
) -> None:
    started: list[int] = []

    async def block(job: JobContext) -> None:
        started.append(job.id)
        await asyncio.Event().wait()  # runs until the worker stops and cancels it

    ids = await queue.enqueue_many([{"kind": "wait", "payload": {}, **SHORT} for _ in range(4)])
    worker = make_worker(store_url, {"wait": block}, concurrency=2, grace_seconds=0.5)
    async with running(worker):
        # Two tools run; two more leases are claimed ahead and wait for a slot.
        await wait_until(
            lambda: len(worker.events.named("job_claimed")) == 4, what="four leases held"
        )
        assert len(started) == 2
        waiting = [i for i in ids if i not in started]
        first: dict[int, datetime] = {}
        for job_id in waiting:
            lease_until = (await queue.get(job_id)).lease_until
            assert lease_until is not None
            first[job_id] = lease_until
        # Held, so renewed like the running ones: their leases move forward.
        await wait_until(
            lambda: len(worker.events.named("heartbeat_ok")) >= 8, what="renewals", timeout=20
        )
        for job_id in waiting:
            job = await queue.get(job_id)
            assert job.state == "running" and job.lease_until is not None
            assert job.lease_until > first[job_id]
    assert len(started) == 2  # the waiting ones never ran
    for job_id in ids:
        job = await queue.get(job_id)
        # Given back at shutdown, and the attempt is not counted.
        assert (job.state, job.owner_id, job.attempt) == ("queued", None, 0)
    released = worker.events.named("job_released")
    assert sorted(int(e["job"]) for e in released) == sorted(ids)
