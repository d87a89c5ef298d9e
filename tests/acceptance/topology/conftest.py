"""The topology tier: fencegate on the PostgreSQL deployments users run (a transaction pooler,
a Patroni cluster, hosts in network namespaces). Run it alone with
``python -m pytest -q tests/acceptance/topology`` (or ``-m topology``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.tiers import needs
from tests.support.topology import PgBouncer, missing


@pytest.fixture(scope="session")
def pgbouncer(pg_server_url: str) -> Iterator[PgBouncer]:
    """PgBouncer 1.18 in transaction pooling in front of the tests' PostgreSQL server."""
    reason = missing("pgbouncer")
    needs(reason, "topology")
    bouncer = PgBouncer(pg_server_url, pool_mode="transaction")
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()
