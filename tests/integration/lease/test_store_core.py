"""The lease queue on the one storage core: the fencing-token order within a claimed batch,
a PostgreSQL schema named in the URL, and the one error rule."""

from __future__ import annotations

from typing import Any

import asyncpg

from fencegate.errors import StoreUnavailable
from fencegate.lease import LeaseQueue
from fencegate.lease import errors as lease_errors
from fencegate.store.dburl import parse_database_url
from fencegate.store.migrations import migrate
from fencegate.store.pg import PgDatabase
from tests.support.waits import wait_until

SHORT: dict[str, Any] = {"lease_seconds": 0.3, "heartbeat_seconds": 0.1, "jitter_seconds": 0.05}


async def test_a_batch_gets_ascending_tokens_in_job_id_order(queue: LeaseQueue) -> None:
    first = await queue.enqueue("x", 1, **SHORT)
    second = await queue.enqueue("x", 2, **SHORT)
    third = await queue.enqueue("y", 3, **SHORT)
    # The job with the highest id is claimed first, and its lease runs out: the next claim
    # takes it first (expired leases come first), but its token still follows the job id.
    [held] = await queue.claim("w1", kinds=["y"])
    assert held.job_id == third

    async def expired() -> bool:  # on the database clock, the one claims are judged by
        return await queue.now() > held.lease_until

    await wait_until(expired, timeout=30, what="the held lease to run out")
    batch = await queue.claim("w2", limit=3)
    assert [lease.job_id for lease in batch] == [first, second, third]
    tokens = [lease.fencing_token for lease in batch]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert min(tokens) > held.fencing_token


async def test_a_queue_works_in_the_schema_its_url_names(pg_url: str) -> None:
    url = f"{pg_url}?schema=fg_lease_test"
    await migrate(url)
    queue = await LeaseQueue.connect(url, timeout=10)
    try:
        job_id = await queue.enqueue("x", {"n": 1})
        [lease] = await queue.claim("w1", kinds=["x"])
        assert lease.job_id == job_id
        assert await queue.extend(lease) is not None
        assert await queue.commit_stage(lease, "s1", {"r": 1})
        assert await queue.complete(lease, {"ok": True})
        assert (await queue.get(job_id)).state == "succeeded"
        # The worker's heartbeat opens its own connection from the same URL.
        assert queue.url == url
        other = await LeaseQueue.connect(queue.url, timeout=10)
        try:
            assert (await other.get(job_id)).result == {"ok": True}
            # LISTEN runs on a connection of its own, in the same schema's database.
            await queue.wait_for_work(["x"], timeout=2)  # a new listener: True at once
            assert await queue.claim("w1", kinds=["x"]) == []
            await other.enqueue("x", {"n": 2})
            assert await queue.wait_for_work(["x"], timeout=5)
        finally:
            await other.close()
    finally:
        await queue.close()
    conn = await asyncpg.connect(parse_database_url(pg_url).dsn)
    try:
        rows = await conn.fetch(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_name LIKE 'fencegate_job%' ORDER BY 1, 2"
        )
        in_schema = {r["table_name"] for r in rows if r["table_schema"] == "fg_lease_test"}
        assert in_schema == {
            "fencegate_jobs",
            "fencegate_job_keys",
            "fencegate_job_attempts",
            "fencegate_job_stages",
        }
        count = await conn.fetchval("SELECT count(*) FROM fg_lease_test.fencegate_jobs")
        assert count == 2
        # The fresh database's own tables in public were not touched.
        assert await conn.fetchval("SELECT count(*) FROM public.fencegate_jobs") == 0
    finally:
        await conn.close()


async def test_a_server_error_of_our_sql_is_a_bug_not_store_unavailable(pg_url: str) -> None:
    """A statement that fails on the server because of what it says (here a division by
    zero) is a bug, not an outage: it propagates as the driver's exception, and the
    connection, which is sound, is kept. A connection the server closed is an outage."""
    assert lease_errors.StoreUnavailable is StoreUnavailable
    db = await PgDatabase.connect(
        parse_database_url(pg_url), application_name="test", min_size=1, max_size=1
    )
    try:
        pid = await db.run(lambda conn: conn.fetchval("SELECT pg_backend_pid()"), timeout=5)
        try:
            await db.run(
                lambda conn: conn.execute("SELECT 1 / (SELECT count(*) FROM fencegate_jobs)"),
                timeout=5,
            )
        except asyncpg.DivisionByZeroError:
            pass
        else:
            raise AssertionError("the division by zero was not raised")
        assert await db.run(lambda conn: conn.fetchval("SELECT pg_backend_pid()"), timeout=5) == pid

        async def killed(conn: asyncpg.Connection) -> None:
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

        try:
            await db.run(killed, timeout=5)
        except StoreUnavailable as exc:
            assert isinstance(exc.__cause__, asyncpg.PostgresError | OSError)
        else:
            raise AssertionError("a terminated connection was not StoreUnavailable")
        # The pool replaced the connection it lost: the next call works.
        assert await db.run(lambda conn: conn.fetchval("SELECT 2"), timeout=5) == 2
    finally:
        await db.close()
