"""The backend layer (`fencegate.store.backends`): the one place a URL's kind chooses a
backend, and where a driver's errors become fencegate's, naming the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fencegate.errors import StoreUnavailable
from fencegate.lease import LeaseQueue
from fencegate.lease.drivers.postgres import PostgresDriver
from fencegate.lease.drivers.sqlite import SQLiteDriver
from fencegate.store import GATEWAY, open_gateway_store
from fencegate.store.backends import applied_migrations_read_only
from fencegate.store.dburl import parse_database_url
from fencegate.store.pg import PgDatabase
from fencegate.store.postgres import PostgresGatewayStore
from fencegate.store.sqlite import SQLiteGatewayStore


async def test_a_file_that_is_no_database_is_unavailable_and_named(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"not a database, " * 256)
    with pytest.raises(StoreUnavailable, match="cannot read the SQLite store") as caught:
        await applied_migrations_read_only(parse_database_url(f"sqlite:///{path}"), timeout=5)
    assert str(path.resolve()) in str(caught.value)


async def test_a_refused_connection_is_unavailable_and_named() -> None:
    target = parse_database_url("postgresql://fencegate@127.0.0.1:1/nothing")
    with pytest.raises(StoreUnavailable, match=r"cannot read PostgreSQL at .*127\.0\.0\.1:1"):
        await applied_migrations_read_only(target, timeout=5)


async def settings_of(db: PgDatabase) -> tuple[str, str, str, int]:
    async def read(conn: Any) -> tuple[str, str, str, int]:
        row = await conn.fetchrow(
            "SELECT current_setting('application_name') AS app,"
            " current_setting('plan_cache_mode') AS plans,"
            " current_setting('enable_seqscan') AS seqscan"
        )
        return row["app"], row["plans"], row["seqscan"], db.pool.get_min_size()

    return await db.run(read, timeout=5)


async def test_each_part_is_built_over_the_layer_it_gets_with_its_own_pool(pg_url: str) -> None:
    store = await open_gateway_store(pg_url, pool_max_size=5)
    queue = await LeaseQueue.connect(pg_url, pool_min_size=1, pool_max_size=3)
    try:
        assert isinstance(store, PostgresGatewayStore)
        driver = getattr(queue, "_driver")  # noqa: B009
        assert isinstance(driver, PostgresDriver)
        # The options each part's statements depend on, as `PgDatabase.connect` set them.
        gateway_db, lease_db = getattr(store, "_db"), getattr(driver, "_db")  # noqa: B009
        assert await settings_of(gateway_db) == (
            "fencegate-gateway",
            "force_generic_plan",
            "on",
            2,
        )
        assert await settings_of(lease_db) == ("fencegate-lease", "force_generic_plan", "off", 1)
        assert gateway_db.pool.get_max_size() == 5 and lease_db.pool.get_max_size() == 3
    finally:
        await store.close()
        await queue.close()


async def test_a_sqlite_url_gives_each_part_its_sqlite_class(sqlite_url: str) -> None:
    store = await open_gateway_store(sqlite_url)
    queue = await LeaseQueue.connect(sqlite_url)
    try:
        assert isinstance(store, SQLiteGatewayStore)
        assert isinstance(getattr(queue, "_driver"), SQLiteDriver)  # noqa: B009
        assert queue.round_trips == 1  # opening checked that the file answers
    finally:
        await store.close()
        await queue.close()


def test_a_part_refuses_a_layer_it_has_no_class_for() -> None:
    with pytest.raises(KeyError):
        GATEWAY.over(object())  # type: ignore[arg-type]
