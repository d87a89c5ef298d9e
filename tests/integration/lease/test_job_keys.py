"""PostgreSQL keeps each job's idempotency key unique in a table of its own
(`fencegate_job_keys`), written once when the job is queued: a job's row is rewritten at its
claim and at its end, and a unique index on the jobs table took a new entry for the unchanged
key at each rewrite, checked against the job's earlier versions. The rules stay: one job per
key, whoever enqueues it and however concurrently, and a purged job's key may be used again."""

from __future__ import annotations

import asyncio

import asyncpg

from fencegate.lease import LeaseQueue
from fencegate.store.inspect import Inspector


async def test_the_jobs_table_has_no_unique_index_beyond_its_primary_key(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        unique = await conn.fetch(
            "SELECT indexrelid::regclass::text AS name FROM pg_index"
            " WHERE indrelid = 'fencegate_jobs'::regclass AND indisunique AND NOT indisprimary"
        )
    finally:
        await conn.close()
    assert [row["name"] for row in unique] == []


async def test_one_job_per_key_however_many_enqueue_it_at_once(pg_url: str) -> None:
    queues = [await LeaseQueue.connect(pg_url, timeout=30) for _ in range(4)]
    try:
        batches = [
            [
                {"kind": "k", "payload": {"by": q, "n": n}, "idempotency_key": f"key:{n}"}
                for n in range(50)
            ]
            for q in range(4)
        ]
        answers = await asyncio.gather(
            *(
                queue.enqueue_many(batch, timeout=30)
                for queue, batch in zip(queues, batches, strict=True)
            )
        )
        assert all(ids == answers[0] for ids in answers)
        assert len(set(answers[0])) == 50
        jobs = await queues[0].list_jobs(limit=1000)
        assert sorted(job.id for job in jobs) == sorted(answers[0])
        # Each key's job carries the payload of one enqueue, whole.
        assert all(job.payload["n"] == int(job.idempotency_key[4:]) for job in jobs)
    finally:
        for queue in queues:
            await queue.close()


async def test_the_first_of_a_key_given_twice_in_one_batch_is_queued_in_batch_order(
    pg_url: str,
) -> None:
    queue = await LeaseQueue.connect(pg_url, timeout=30)
    try:
        ids = await queue.enqueue_many(
            [
                {"kind": "k", "payload": "b", "idempotency_key": "b"},
                {"kind": "k", "payload": "a", "idempotency_key": "a"},
                {"kind": "k", "payload": "b again", "idempotency_key": "b"},
            ],
            timeout=30,
        )
        assert ids[0] == ids[2] and ids[0] < ids[1]
        assert (await queue.get(ids[0])).payload == "b"
        assert await queue.enqueue("k", "a again", idempotency_key="a") == ids[1]
    finally:
        await queue.close()


async def test_a_purged_jobs_key_may_be_used_again(pg_url: str) -> None:
    queue = await LeaseQueue.connect(pg_url, timeout=30)
    try:
        first = await queue.enqueue("k", 1, idempotency_key="once")
        [lease] = await queue.claim("w", kinds=["k"], limit=1)
        assert await queue.complete(lease, None)
        inspector = await Inspector.open(pg_url)
        try:
            assert await inspector.purge_jobs(older_than_seconds=0, actor="test") == 1
        finally:
            await inspector.close()
        again = await queue.enqueue("k", 2, idempotency_key="once")
        assert again != first
        assert (await queue.get(again)).payload == 2
    finally:
        await queue.close()
