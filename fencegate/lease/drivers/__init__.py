"""Store drivers: each only runs the lease queue's SQL on one database and turns rows into
records. The rules live in `fencegate.lease.queue`."""

from __future__ import annotations

from fencegate.lease.drivers.base import Driver
from fencegate.lease.drivers.postgres import PostgresDriver, init_connection
from fencegate.lease.drivers.sqlite import SQLiteDriver
from fencegate.store.backends import Part, open_part
from fencegate.store.dburl import DatabaseURL

__all__ = ["LEASE", "Driver", "open_driver"]

# The lease driver per backend, and its pool on PostgreSQL.
LEASE: Part[Driver] = Part(
    "fencegate-lease",
    postgresql=PostgresDriver,
    sqlite=SQLiteDriver,
    pg_options={
        "init": init_connection,
        # No connection is kept for ever: one that has lived through an unnoticed partition
        # is replaced within minutes even when idle.
        "max_inactive_connection_lifetime": 60.0,
        # A queue's tables grow from empty faster than autovacuum analyzes them: a generic
        # plan made while they were small joined each batch to a sequential scan of the
        # attempts, so every commit got slower as the queue drained. Planning every call
        # instead cost the claim about 1 ms per batch; with sequential scans off, the plan
        # kept is an index plan at any size (tests/integration/lease/test_claim_plan.py).
        "index_scans": True,
        # And the generic plan always: left to choose, the server kept planning the claim
        # on every call where most jobs had finished (their rows skew its estimates), at
        # twice the cost of the kept plan (benchmarks/README.md, the backlog table).
        "generic_plans": True,
    },
)


async def open_driver(
    target: DatabaseURL,
    *,
    timeout: float,
    min_size: int = 1,
    max_size: int = 10,
    require_synchronous_replication: bool = False,
) -> Driver:
    """The driver for the store ``target`` names, checked to answer; the pool sizes and the
    replication check apply to PostgreSQL."""
    driver = await open_part(
        LEASE,
        target,
        timeout=timeout,
        min_size=min_size,
        max_size=max_size,
        require_synchronous_replication=require_synchronous_replication,
    )
    try:
        await driver.opened(timeout=timeout)
    except BaseException:
        await driver.close()
        raise
    return driver
