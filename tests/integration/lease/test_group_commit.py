"""Group commit on both stores: concurrent conditional writes on one queue share round trips,
yet each row is still checked on its own and each caller gets its own answer; a caller's
``timeout=`` holds even when its call is queued behind a batch in flight."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import asyncpg
import pytest

from fencegate.lease import LeaseQueue, StoreUnavailable
from fencegate.lease.models import Lease
from tests.support.workers import wait_until

LONG = {"lease_seconds": 60.0, "heartbeat_seconds": 20.0, "jitter_seconds": 5.0}


async def claim_jobs(queue: LeaseQueue, kind: str, count: int) -> list[Lease]:
    await queue.enqueue_many([{"kind": kind, "payload": {"n": n}, **LONG} for n in range(count)])
    leases = await queue.claim("w1", kinds=[kind], limit=count)
    assert len(leases) == count
    return leases


async def test_concurrent_completes_make_fewer_round_trips(queue: LeaseQueue) -> None:
    leases = await claim_jobs(queue, "bulk", 20)
    before = queue.round_trips
    answers = await asyncio.gather(
        *(queue.complete(lease, {"n": i}) for i, lease in enumerate(leases))
    )
    trips = queue.round_trips - before
    assert answers == [True] * 20
    assert trips < 20 // 2, f"{trips} round trips for 20 concurrent completes"
    for i, lease in enumerate(leases):
        job = await queue.get(lease.job_id)
        assert (job.state, job.result) == ("succeeded", {"n": i})
    [attempt] = await queue.attempts(leases[7].job_id)
    assert attempt.outcome == "succeeded"


async def test_a_deep_backlog_of_completions_goes_in_few_statements(queue: LeaseQueue) -> None:
    """Jobs end in bursts as large as the claims that brought them (four Workers of
    concurrency 50 sharing a queue: hundreds). The first completion goes at once; the 199
    made meanwhile, more than two batches' worth, go together as one statement, not four;
    100 (one Worker's burst) go as 64 and 36, the first 64 answered sooner."""
    leases = await claim_jobs(queue, "burst", 301)
    before = queue.round_trips
    answers = await asyncio.gather(
        *(queue.complete(lease, {"n": i}) for i, lease in enumerate(leases[:200]))
    )
    assert answers == [True] * 200
    assert queue.round_trips - before == 2
    assert (await queue.get(leases[150].job_id)).result == {"n": 150}
    before = queue.round_trips
    answers = await asyncio.gather(*(queue.complete(lease, None) for lease in leases[200:]))
    assert answers == [True] * 101
    assert queue.round_trips - before == 3


async def test_concurrent_extends_make_fewer_round_trips(queue: LeaseQueue) -> None:
    leases = await claim_jobs(queue, "renew", 12)
    before = queue.round_trips
    renewed = await asyncio.gather(*(queue.extend(lease) for lease in leases))
    assert queue.round_trips - before < 12 // 2
    for lease, new in zip(leases, renewed, strict=True):
        assert new is not None and new.job_id == lease.job_id
        assert new.lease_until >= lease.lease_until


async def test_batched_completion_rejects_only_the_lost_lease(queue: LeaseQueue) -> None:
    first, lost, third, stale = await claim_jobs(queue, "mixed", 4)
    assert await queue.cancel(lost.job_id, reason="operator")  # its lease is void now
    wrong_token = replace(stale, fencing_token=stale.fencing_token + 1000)
    before = queue.round_trips
    answers = await asyncio.gather(
        queue.complete(first, "a"),
        queue.complete(lost, "b"),
        queue.complete(third, "c"),
        queue.complete(wrong_token, "d"),
    )
    assert list(answers) == [True, False, True, False]
    assert queue.round_trips - before < 4  # they did share a statement
    assert (await queue.get(first.job_id)).result == "a"
    assert (await queue.get(third.job_id)).result == "c"
    lost_job = await queue.get(lost.job_id)
    assert (lost_job.state, lost_job.result) == ("cancelled", None)
    stale_job = await queue.get(stale.job_id)
    assert (stale_job.state, stale_job.result) == ("running", None)
    # The rightful holder of the last one can still finish it.
    assert await queue.complete(stale, "e")


async def test_batched_failures_answer_each_job(queue: LeaseQueue) -> None:
    retry, lost, final = await claim_jobs(queue, "flaky", 3)
    assert await queue.cancel(lost.job_id)
    answers = await asyncio.gather(
        queue.fail(retry, {"type": "Boom"}, retry_in=30),
        queue.fail(lost, {"type": "Boom"}, retry_in=30),
        queue.fail(final, {"type": "Fatal"}, permanent=True),
    )
    assert list(answers) == [True, False, True]
    retried = await queue.get(retry.job_id)
    assert (retried.state, retried.owner_id, retried.error) == ("queued", None, {"type": "Boom"})
    assert retried.run_after > await queue.now()
    failed = await queue.get(final.job_id)
    assert (failed.state, failed.error) == ("failed", {"type": "Fatal"})
    assert [a.outcome for a in await queue.attempts(retry.job_id)] == ["retry_scheduled"]
    assert [a.outcome for a in await queue.attempts(final.job_id)] == ["failed"]
    assert [a.outcome for a in await queue.attempts(lost.job_id)] == ["cancelled"]


async def test_batched_stage_commits_answer_each_stage(queue: LeaseQueue) -> None:
    one, lost, two = await claim_jobs(queue, "staged", 3)
    assert await queue.cancel(lost.job_id)
    answers = await asyncio.gather(
        queue.commit_stage(one, "fetch", {"rows": 1}),
        queue.commit_stage(lost, "fetch", {"rows": 2}),
        queue.commit_stage(two, "fetch", {"rows": 3}),
        queue.commit_stage(one, "draft", {"pages": 4}),  # a second stage of one job
    )
    assert list(answers) == [True, False, True, True]
    assert (await queue.stage_result(one, "fetch")).result == {"rows": 1}  # type: ignore[union-attr]
    assert (await queue.stage_result(one, "draft")).result == {"pages": 4}  # type: ignore[union-attr]
    assert await queue.stage_result(lost, "fetch") is None
    # Committed again by the same holder: still True (it is recorded under this lease).
    assert await queue.commit_stage(two, "fetch", {"rows": 3})


async def test_batched_extend_loses_only_the_lost_lease(queue: LeaseQueue) -> None:
    kept, lost = await claim_jobs(queue, "beat", 2)
    assert await queue.cancel(lost.job_id)
    renewed = await asyncio.gather(queue.extend(kept), queue.extend(lost))
    assert renewed[0] is not None and renewed[1] is None


@pytest.fixture
async def write_blocker(store_url: str) -> AsyncIterator[Any]:
    """Holds the store's write lock (SQLite) or a job row's lock (PostgreSQL) on a
    connection of its own, until released."""
    if store_url.startswith("sqlite:///"):
        conn = sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None)

        class SQLiteBlocker:
            async def block(self, job_id: int) -> None:
                conn.execute("BEGIN IMMEDIATE")

            async def release(self) -> None:
                conn.execute("ROLLBACK")

        try:
            yield SQLiteBlocker()
        finally:
            conn.close()
        return
    pg = await asyncpg.connect(store_url)
    transaction = pg.transaction()

    class PostgresBlocker:
        async def block(self, job_id: int) -> None:
            await transaction.start()
            await pg.execute("SELECT 1 FROM fencegate_jobs WHERE id = $1 FOR UPDATE", job_id)

        async def release(self) -> None:
            await transaction.rollback()

    try:
        yield PostgresBlocker()
    finally:
        await pg.close()


async def test_queued_call_honours_its_own_timeout(queue: LeaseQueue, write_blocker: Any) -> None:
    held, other = await claim_jobs(queue, "slow", 2)
    await write_blocker.block(held.job_id)
    # The first commit goes out and waits on the lock; the second, queued behind it, must
    # give up at its own deadline, not at the first one's.
    before = queue.round_trips
    first = asyncio.create_task(queue.complete(held, "slow", timeout=8.0))
    await wait_until(lambda: queue.round_trips > before, timeout=5, what="first commit sent")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await queue.complete(other, "fast", timeout=0.5)
    waited = time.monotonic() - started
    assert waited < 2.0, f"a 0.5 s call waited {waited:.2f}s"
    await write_blocker.release()
    assert await asyncio.wait_for(first, 10)


async def test_sequential_completes_keep_one_connection_and_survive_losing_it(
    pg_url: str,
) -> None:
    """`complete()` awaited one at a time (the obvious loop) runs on one connection kept
    between calls, not one taken from the pool each time; when that connection dies, the
    call on it fails as a store fault and the next one takes another."""
    queue = await LeaseQueue.connect(pg_url, timeout=10, pool_max_size=4)
    try:
        leases = await claim_jobs(queue, "one-by-one", 8)
        for lease in leases[:4]:
            assert await queue.complete(lease, None)
        pool = queue._driver._db.pool  # type: ignore[attr-defined]
        # Every pooled connection is idle but the one the completions keep.
        assert pool.get_idle_size() == pool.get_size() - 1
        conn = await asyncpg.connect(pg_url)
        try:
            # The backends whose last statement was a completion: one, however many calls.
            pids = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE '%SET state = ''succeeded''%' AND pid <> pg_backend_pid()"
            )
            assert len(pids) == 1, pids
            await conn.execute("SELECT pg_terminate_backend($1)", pids[0]["pid"])
        finally:
            await conn.close()
        answers: list[bool | str] = []
        for lease in leases[4:]:
            try:
                answers.append(await queue.complete(lease, None))
            except StoreUnavailable:
                answers.append("unavailable")
                answers.append(await queue.complete(lease, None))
        assert answers[-3:] == [True, True, True] and answers.count(True) == 4, answers
        assert answers.count("unavailable") <= 1, answers  # only the call on the lost one
    finally:
        await queue.close()


async def test_concurrent_claims_of_several_owners_share_a_statement(queue: LeaseQueue) -> None:
    """Workers sharing a queue claim together: claims made while one is in flight go as one
    statement, and each owner still gets its own leases, at most its own limit, the first
    claims first."""
    await queue.enqueue_many([{"kind": "shared", "payload": {"n": n}, **LONG} for n in range(9)])
    assert await queue.claim("w0", kinds=["other"]) == []  # the queue's limits are written
    owners = [f"w{i}" for i in range(6)]
    before = queue.round_trips
    granted = await asyncio.gather(
        *(queue.claim(owner, kinds=["shared"], limit=2) for owner in owners)
    )
    trips = queue.round_trips - before
    assert trips < len(owners) // 2, f"{trips} round trips for {len(owners)} concurrent claims"
    # Nine jobs for six claims of two: the first four are filled, the fifth gets one.
    assert [len(leases) for leases in granted] == [2, 2, 2, 2, 1, 0]
    for owner, leases in zip(owners, granted, strict=True):
        for lease in leases:
            assert lease.owner_id == owner
            job = await queue.get(lease.job_id)
            assert (job.state, job.owner_id, job.fencing_token) == (
                "running",
                owner,
                lease.fencing_token,
            )
            [attempt] = await queue.attempts(lease.job_id)
            assert (attempt.owner_id, attempt.fencing_token) == (owner, lease.fencing_token)
    leases = [lease for claim in granted for lease in claim]
    assert len({lease.job_id for lease in leases}) == 9
    assert len({lease.fencing_token for lease in leases}) == 9
    # Each owner's lease is its own: another owner's commit of it is refused.
    assert not await queue.complete(replace(granted[0][0], owner_id="w1"), "stolen")
    assert await queue.complete(granted[0][0], "mine")


async def test_a_claim_given_up_while_in_flight_gives_its_leases_back(
    queue: LeaseQueue,
) -> None:
    """A claim whose caller is cancelled once its statement is on the way still grants (the
    statement runs for the claims sent with it): those leases are released at once, their
    attempt not counted, instead of being held by nobody until they expire."""
    await queue.enqueue_many([{"kind": "given", "payload": {"n": n}, **LONG} for n in range(3)])
    assert await queue.claim("w0", kinds=["other"]) == []  # the queue's limits are written
    before = queue.round_trips
    # Made together: the first goes at once, the other two queue behind it and are sent
    # together as soon as it is answered.
    first = asyncio.ensure_future(queue.claim("w1", kinds=["given"], limit=1))
    behind = asyncio.ensure_future(queue.claim("w2", kinds=["given"], limit=1))
    kept = asyncio.ensure_future(queue.claim("w3", kinds=["given"], limit=1))
    [mine] = await first
    assert queue.round_trips == before + 2  # the second batch is on its way
    behind.cancel()
    [theirs] = await kept
    released = await wait_until(
        lambda: _queued_again(queue, {mine.job_id, theirs.job_id}), what="the release"
    )
    assert released.attempt == 0, released  # the given-back lease did not cost an attempt
    assert [a.outcome for a in await queue.attempts(released.id)] == ["released"]


async def _queued_again(queue: LeaseQueue, taken: set[int]) -> Any:
    for job in await queue.list_jobs(kind="given"):
        if job.id not in taken and job.state == "queued" and await queue.attempts(job.id):
            return job
    return None
