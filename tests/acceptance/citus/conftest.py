"""The Citus tier: fencegate on a distributed PostgreSQL, a Citus coordinator and two
workers on loopback (tests/support/citus.py), one cluster for the tier, its tests on one
pytest-xdist worker. Run it alone with ``python -m pytest -q tests/acceptance/citus`` (or
``-m citus``). It skips, saying why, where Citus is not installed into the machine's
PostgreSQL.

One database (migrated, so distributed by tenant) serves the tier: each test gets it with
every fencegate table emptied (``pg_url``), so the store's contract tests of
tests/integration/ run here unchanged, against the coordinator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from fencegate.store.migrations import migrate
from tests.support.citus import CitusCluster, missing_citus
from tests.support.tiers import needs

DATABASE = "fencegate"

# Every fencegate table a test may have written, emptied before the next test.
TABLES = (
    "fencegate_idempotency_keys",
    "fencegate_fences",
    "fencegate_decisions",
    "fencegate_signature_nonces",
    "fencegate_gateways",
    "fencegate_audit",
    "fencegate_job_stages",
    "fencegate_job_attempts",
    "fencegate_job_keys",
    "fencegate_jobs",
    "fencegate_rate_limits",
    "fencegate_work_classes",
)


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[CitusCluster]:
    reason = missing_citus()
    needs(reason, "citus")
    cluster = CitusCluster(workers=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def citus_database(citus_cluster: CitusCluster) -> str:
    """The tier's database on the coordinator, migrated (hence distributed)."""

    async def create() -> str:
        url = await citus_cluster.create_database(DATABASE)
        await migrate(url, citus=True)
        return url

    return asyncio.run(create())


@pytest.fixture
async def pg_url(citus_database: str) -> AsyncIterator[str]:
    """The coordinator's database, every fencegate table empty."""
    conn = await asyncpg.connect(citus_database, timeout=30)
    try:
        await conn.execute(f"TRUNCATE {', '.join(TABLES)}")
    finally:
        await conn.close()
    yield citus_database


@pytest.fixture
def store_kind() -> str:
    """The contract tests' store: PostgreSQL, here Citus's coordinator."""
    return "postgresql"
