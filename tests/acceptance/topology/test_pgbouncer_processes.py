"""fencegate's processes through PgBouncer 1.18 in transaction pooling: migrations, `fencegate
serve`, the operator commands and a Worker all work with ``?pool_mode=transaction``, and
without it the gateway is refused with one line naming that option."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import replace
from urllib.parse import urlsplit

import asyncpg
import orjson
import pytest

from fencegate.errors import StoreUnavailable
from fencegate.lease import JobContext, LeaseQueue
from fencegate.store import Outcome, open_gateway_store
from tests.integration.test_gateway_store import BASE
from tests.support import postgres
from tests.support.gateway import GatewayProcess
from tests.support.processes import fencegate
from tests.support.topology import PgBouncer
from tests.support.upstream import UpstreamProcess
from tests.support.workers import SHORT, make_worker


@pytest.fixture
async def database(pg_server_url: str) -> AsyncIterator[str]:
    """A new, empty database (not migrated): its name."""
    direct = await postgres.create_database(pg_server_url)
    try:
        yield urlsplit(direct).path.lstrip("/")
    finally:
        await postgres.drop_database(pg_server_url, direct)


def post(url: str, key: str) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url,
        data=b'{"amount": 1}',
        method="POST",
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=20) as response:
        return response.status, response.read()


async def test_without_the_option_the_gateway_is_refused_in_one_line_naming_it(
    pgbouncer: PgBouncer, database: str
) -> None:
    with pytest.raises(StoreUnavailable) as refused:
        await open_gateway_store(pgbouncer.url(database), run_migrations=False)
    message = str(refused.value)
    assert "\n" not in message
    assert "pool_mode=transaction" in message
    assert "unsupported startup parameter" in message


def test_migrate_serve_and_the_operator_commands_work_through_the_pooler(
    pgbouncer: PgBouncer, database: str
) -> None:
    url = pgbouncer.url(database, query="pool_mode=transaction")
    migrated = fencegate("migrate", "--database-url", url)
    assert migrated.returncode == 0, migrated.stderr
    with (
        UpstreamProcess() as upstream,
        GatewayProcess(upstream=upstream.url, database_url=url) as gateway,
    ):
        answers = [post(gateway.url + "/charges", f"key-{i % 20}") for i in range(60)]
        assert {status for status, _ in answers} == {200}
        for i in range(20):
            assert upstream.count(f"key-{i}") == 1
            # Every answer to one key is the first one, replayed.
            assert len({body for j, (_, body) in enumerate(answers) if j % 20 == i}) == 1
    shown = fencegate("keys", "show", "key-3", "--database-url", url, "--json")
    assert shown.returncode == 0, shown.stderr
    assert orjson.loads(shown.stdout)["state"] == "completed"
    listed = fencegate("keys", "list", "--database-url", url, "--json", "--limit", "100")
    assert listed.returncode == 0, listed.stderr
    assert "key-19" in listed.stdout


async def test_a_worker_runs_every_job_once_through_the_pooler(
    pgbouncer: PgBouncer, database: str
) -> None:
    url = pgbouncer.url(database, query="pool_mode=transaction")
    runs: dict[int, int] = {}

    async def double(job: JobContext) -> dict[str, int]:
        n = int(job.payload["n"])
        runs[n] = runs.get(n, 0) + 1
        return {"double": n * 2}

    async with await LeaseQueue.connect(url, timeout=10) as queue:
        await queue.migrate()
        ids = [
            await queue.enqueue("double", {"n": n}, idempotency_key=f"double:{n}", **SHORT)
            for n in range(30)
        ]
        worker = make_worker(url, {"double": double}, concurrency=4)
        await asyncio.wait_for(worker.run_until_idle(), 60)
        for n, job_id in enumerate(ids):
            job = await queue.get(job_id)
            assert (job.state, job.result, job.attempt) == ("succeeded", {"double": n * 2}, 1)
    assert runs == {n: 1 for n in range(30)}


async def test_a_schema_in_the_url_holds_through_the_pooler(
    pgbouncer: PgBouncer, database: str, pg_server_url: str
) -> None:
    """``schema=`` is a per-transaction setting behind the pooler: migrations and decisions
    land in that schema and nowhere else, though the server connections are shared."""
    url = pgbouncer.url(database, query="pool_mode=transaction&schema=fg_pooled")
    migrated = fencegate("migrate", "--database-url", url)
    assert migrated.returncode == 0, migrated.stderr
    store = await open_gateway_store(url, run_migrations=False)
    try:
        decision = await store.decide(replace(BASE, key="in-schema"), timeout=10)
        assert decision.outcome == Outcome.RESERVED
    finally:
        await store.close()
    direct = await asyncpg.connect(postgres.with_database(pg_server_url, database))
    try:
        keys = await direct.fetch("SELECT key FROM fg_pooled.fencegate_idempotency_keys")
        public = await direct.fetchval("SELECT to_regclass('public.fencegate_idempotency_keys')")
    finally:
        await direct.close()
    assert [r["key"] for r in keys] == ["in-schema"]
    assert public is None
