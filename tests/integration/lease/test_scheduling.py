"""Scheduling decided by the database, on SQLite and on PostgreSQL: priorities, a limit per work
class and per concurrency key, and a provider's token bucket."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fencegate.lease import LeaseQueue, RateLimit, WorkClass
from tests.integration.lease.test_queue import SHORT, wait_until_expired
from tests.support.waits import wait_until


async def claimed_payloads(queue: LeaseQueue, kind: str, limit: int = 10) -> set[Any]:
    """What one claim took (a batch comes back in job id order, whatever chose it)."""
    leases = await queue.claim("w1", kinds=[kind], limit=limit)
    return {lease.payload for lease in leases}


async def test_higher_priority_first_ties_in_enqueue_order(queue: LeaseQueue) -> None:
    for name, priority in [("low", -1), ("a", 0), ("urgent", 10), ("b", 0), ("high", 5)]:
        await queue.enqueue("send", name, priority=priority)
    assert await claimed_payloads(queue, "send", limit=3) == {"urgent", "high", "a"}
    assert await claimed_payloads(queue, "send") == {"b", "low"}


async def test_an_expired_lease_comes_back_first_within_its_priority(queue: LeaseQueue) -> None:
    await queue.enqueue("send", "expired", **SHORT)
    [lease] = await queue.claim("w1", kinds=["send"])
    await queue.enqueue("send", "queued")
    await queue.enqueue("send", "urgent", priority=1)
    await wait_until_expired(queue, lease)
    assert await claimed_payloads(queue, "send", limit=1) == {"urgent"}
    assert await claimed_payloads(queue, "send", limit=1) == {"expired"}
    assert await claimed_payloads(queue, "send", limit=1) == {"queued"}


async def test_at_most_max_running_hold_a_live_lease(queue: LeaseQueue) -> None:
    queue.declare(WorkClass(kind="browse", max_running=2))
    for n in range(5):
        # Job 1's lease will run out; the others' outlast the test.
        await queue.enqueue("browse", n, **(SHORT if n == 1 else {}))
    first = await queue.claim("w1", kinds=["browse"], limit=10)
    assert [lease.payload for lease in first] == [0, 1]
    assert await claimed_payloads(queue, "browse") == set()
    # Finishing one frees one place.
    assert await queue.complete(first[0], "done")
    assert await claimed_payloads(queue, "browse") == {2}
    # A lease that expired stops counting (and comes back itself, first).
    await wait_until_expired(queue, first[1])
    assert await claimed_payloads(queue, "browse") == {1}
    jobs = await queue.list_jobs(kind="browse", state="queued")
    assert sorted(job.payload for job in jobs) == [3, 4]


async def test_other_kinds_are_not_held_back(queue: LeaseQueue) -> None:
    queue.declare(WorkClass(kind="browse", max_running=1))
    for n in range(3):
        await queue.enqueue("browse", f"b{n}")
    await queue.enqueue("mail", "m0")
    leases = await queue.claim("w1", kinds=["browse", "mail"], limit=10)
    assert sorted(lease.payload for lease in leases) == ["b0", "m0"]
    leases = await queue.claim("w1", limit=10)
    assert leases == []


async def test_at_most_max_running_per_key_without_head_of_line_blocking(
    queue: LeaseQueue,
) -> None:
    queue.declare(WorkClass(kind="case", max_running_per_key=1))
    for n in range(6):
        await queue.enqueue("case", f"a{n}", concurrency_key="customer:a")
    await queue.enqueue("case", "b0", concurrency_key="customer:b")
    await queue.enqueue("case", "b1", concurrency_key="customer:b")
    await queue.enqueue("case", "free")  # no key: no limit
    first = await queue.claim("w1", kinds=["case"], limit=10)
    assert [lease.payload for lease in first] == ["a0", "b0", "free"]
    # Customer a is full: its other jobs wait, b's next one goes once b0 is done.
    assert await claimed_payloads(queue, "case") == set()
    assert await queue.complete(first[1], None)
    assert await claimed_payloads(queue, "case") == {"b1"}
    job = await queue.get(first[0].job_id)
    assert job.concurrency_key == "customer:a"


async def test_a_provider_bucket_grants_one_job_per_token(queue: LeaseQueue) -> None:
    queue.declare(WorkClass(kind="charge", provider="stripe"))
    queue.declare(WorkClass(kind="refund", provider="stripe"))
    # Three tokens, refilled at three per hour: none come back during the test.
    queue.declare_rate_limit(RateLimit("stripe", 3, per_seconds=3600.0))
    for n in range(3):
        await queue.enqueue("charge", f"c{n}")
        await queue.enqueue("refund", f"r{n}")
    leases = await queue.claim("w1", kinds=["charge", "refund"], limit=10)
    assert [lease.payload for lease in leases] == ["c0", "r0", "c1"]
    assert await queue.claim("w1", limit=10) == []
    # A job waiting for a token holds no lease.
    waiting = await queue.list_jobs(state="queued")
    assert len(waiting) == 3
    assert all(job.owner_id is None and job.lease_until is None for job in waiting)


async def test_a_bucket_refills_at_its_rate(queue: LeaseQueue) -> None:
    queue.declare(WorkClass(kind="charge", provider="stripe"))
    queue.declare_rate_limit(RateLimit("stripe", 2, per_seconds=0.5))
    for n in range(4):
        await queue.enqueue("charge", n)
    assert await claimed_payloads(queue, "charge") == {0, 1}
    got: set[Any] = set()

    async def both_claimed() -> bool:
        got.update(await claimed_payloads(queue, "charge"))
        return len(got) == 2

    # 4 tokens a second: both remaining jobs within a second or so.
    await wait_until(both_claimed, timeout=10, interval=0.05, what="the two jobs left claimed")
    assert got == {2, 3}


async def test_concurrent_claims_never_exceed_the_limit(store_url: str) -> None:
    """Many queues (connections) claim at the same moment: each must count the running jobs
    after the claims before it committed, or two would both see room and both take it."""
    queues = [await LeaseQueue.connect(store_url) for _ in range(6)]
    try:
        for q in queues:
            q.declare(WorkClass(kind="browse", max_running=3))
            q.declare(WorkClass(kind="case", max_running_per_key=2))
        for n in range(40):
            await queues[0].enqueue("browse", n)
            await queues[0].enqueue("case", n, concurrency_key=f"customer:{n % 2}")
        for _ in range(4):
            rounds = await asyncio.gather(
                *(q.claim(f"w{i}", kinds=["browse", "case"], limit=4) for i, q in enumerate(queues))
            )
            leases = [lease for got in rounds for lease in got]
            browsing = [lease for lease in leases if lease.kind == "browse"]
            cases = [lease for lease in leases if lease.kind == "case"]
            assert len(browsing) == 3, browsing
            assert sorted(str(lease.concurrency_key) for lease in cases) == [
                "customer:0",
                "customer:0",
                "customer:1",
                "customer:1",
            ]
            await queues[0].complete_many([(lease, None) for lease in leases])
    finally:
        for q in queues:
            await q.close()


async def test_a_job_names_a_model_only_from_its_work_class(queue: LeaseQueue) -> None:
    queue.declare(WorkClass(kind="summarize", model="small", models=("large",)))
    job_id = await queue.enqueue("summarize", None, model="large")
    default = await queue.enqueue("summarize", None)
    assert (await queue.get(job_id)).model == "large"
    assert (await queue.get(default)).model == "small"
    with pytest.raises(ValueError, match="model 'whatever the model said' is not declared"):
        await queue.enqueue("summarize", None, model="whatever the model said")
    leases = await queue.claim("w1", kinds=["summarize"], limit=2)
    assert [lease.model for lease in leases] == ["large", "small"]
