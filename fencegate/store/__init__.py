"""Gateway stores: PostgreSQL for production, SQLite as the embedded default."""

from __future__ import annotations

from fencegate.store.backends import Part, open_part
from fencegate.store.base import (
    DecideRequest,
    Decision,
    GatewayRow,
    GatewayStore,
    KeyRecord,
    Outcome,
    PurgeCounts,
    Reservation,
    Resolution,
    ResolveResult,
    StoredResponse,
    StoreUnavailable,
)
from fencegate.store.dburl import parse_database_url
from fencegate.store.migrations import migrate
from fencegate.store.postgres import PER_TENANT_IN_FLIGHT, PostgresGatewayStore
from fencegate.store.postgres import Q as POSTGRES_QUERIES
from fencegate.store.sqlite import SQLiteGatewayStore

__all__ = [
    "DecideRequest",
    "Decision",
    "GatewayRow",
    "GatewayStore",
    "KeyRecord",
    "Outcome",
    "PurgeCounts",
    "Reservation",
    "Resolution",
    "ResolveResult",
    "StoreUnavailable",
    "StoredResponse",
    "open_gateway_store",
]

# The gateway store's class per backend, and its pool on PostgreSQL.
GATEWAY: Part[GatewayStore] = Part(
    "fencegate-gateway",
    postgresql=PostgresGatewayStore,
    sqlite=SQLiteGatewayStore,
    # The batch statement (arrays of parameters) was otherwise planned again on every call,
    # which cost more than running it; every gateway statement is by key.
    # On Citus: each new connection introspects the step's types before a caller needs it,
    # and as many connections as per-tenant batches go at once are opened at start.
    pg_options={
        "generic_plans": True,
        "citus_warm": (POSTGRES_QUERIES.step,),
        "citus_warm_connections": PER_TENANT_IN_FLIGHT + 1,
    },
)


async def open_gateway_store(
    url: str | None,
    *,
    run_migrations: bool | None = None,
    pool_max_size: int = 20,
    timeout: float = 30.0,
    history: bool = True,
    require_synchronous_replication: bool = False,
) -> GatewayStore:
    """Open the store a database URL names (no URL: SQLite ``./fencegate.db``).

    ``history`` keeps the decision history (one row per keyed or fenced decision, written in
    the decision's own transaction). ``run_migrations`` None means the default: migrate an
    SQLite file (the embedded store should just work), leave PostgreSQL alone (its schema is
    an operator's decision, ``fencegate migrate``). ``require_synchronous_replication``
    refuses a PostgreSQL server with standbys none of which is synchronous (otherwise that is
    one warning line).
    """
    target = parse_database_url(url)
    if run_migrations is None:
        run_migrations = target.kind == "sqlite"
    if run_migrations:
        await migrate(target.url, timeout=timeout)
    return await open_part(
        GATEWAY,
        target,
        timeout=timeout,
        min_size=min(2, pool_max_size),
        max_size=pool_max_size,
        require_synchronous_replication=require_synchronous_replication,
        history=history,
    )
