"""Store drivers: each only runs the lease queue's SQL on one database and turns rows into
records. The rules live in `fencegate.lease.queue`."""

from __future__ import annotations

from fencegate.lease.drivers.base import Driver
from fencegate.store.dburl import DatabaseURL

__all__ = ["Driver", "open_driver"]


async def open_driver(
    target: DatabaseURL,
    *,
    timeout: float,
    min_size: int = 1,
    max_size: int = 10,
    require_synchronous_replication: bool = False,
) -> Driver:
    """The driver for the store ``target`` names; the pool sizes and the replication check
    apply to PostgreSQL."""
    if target.kind == "postgresql":
        from fencegate.lease.drivers.postgres import PostgresDriver

        return await PostgresDriver.connect(
            target,
            timeout=timeout,
            min_size=min_size,
            max_size=max_size,
            require_synchronous_replication=require_synchronous_replication,
        )
    from fencegate.lease.drivers.sqlite import SQLiteDriver

    assert target.sqlite_path is not None
    return await SQLiteDriver.connect(target.sqlite_path, timeout=timeout)
