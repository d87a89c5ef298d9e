"""The gateway store's contract tests (tests/integration/test_gateway_store.py) on a Citus
coordinator whose gateway tables are distributed by tenant: this package's conftest gives
them the coordinator's database as ``pg_url``, and PostgreSQL as their only store kind.

Three are replaced or left out here, because Citus changes what they look at:
- the pools' plan settings: on Citus no pool forces generic plans;
- the commit mode a batch leaves (two tests): on Citus the step runs on the tenant's worker, in a
  transaction of its own there, whose settings the coordinator's session never sees (the
  test ran it inside a transaction block, which Citus does not delegate).
"""

from __future__ import annotations

from fencegate.lease import LeaseQueue
from fencegate.store import open_gateway_store
from fencegate.store.inspect import Inspector
from fencegate.store.pg import PgDatabase
from tests.integration.test_gateway_store import *  # noqa: F403

T = 10.0

del test_a_batch_that_changes_nothing_commits_without_waiting_for_the_disk  # noqa: F821
del test_a_batch_of_fenced_replays_commits_without_waiting_for_the_disk  # noqa: F821


async def test_each_pool_plans_its_statements_as_its_tables_need(  # type: ignore[no-redef]
    pg_url: str,
) -> None:
    """On Citus no pool forces generic plans: Citus plans most distributed statements only
    with their values, delegates a distributed function only with its tenant's value, and
    its fast-path router planner crashes the backend on a forced generic plan of an upsert.
    The lease queue keeps its index plans (its tables are the coordinator's own)."""
    store = await open_gateway_store(pg_url)
    inspector = await Inspector.open(pg_url)
    queue = await LeaseQueue.connect(pg_url, timeout=T)
    try:
        modes: list[tuple[str, str]] = []
        for owner in (store, inspector, getattr(queue, "_driver")):  # noqa: B009
            db = getattr(owner, "_db")  # noqa: B009 - the pool behind each one
            assert isinstance(db, PgDatabase)
            assert db.citus
            row = await db.run(
                lambda conn: conn.fetchrow(
                    "SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan')"
                ),
                timeout=T,
            )
            assert row is not None
            modes.append((row[0], row[1]))
    finally:
        await queue.close()
        await inspector.close()
        await store.close()
    assert modes == [("auto", "on"), ("auto", "on"), ("auto", "off")]
