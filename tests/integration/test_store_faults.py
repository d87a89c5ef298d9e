"""The one error classification against real servers: what the store raises when it cannot
answer is `StoreUnavailable` (and only then is a PostgreSQL connection closed); what a bug in
fencegate's code or SQL raises propagates as it is, and leaves the connection in use."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from fencegate.errors import StoreUnavailable
from fencegate.store.dburl import parse_database_url
from fencegate.store.faults import pg_fault, sqlite_fault
from fencegate.store.pg import PgDatabase
from fencegate.store.sqlite_db import SQLiteDatabase
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(60)

Call = Callable[[asyncpg.Connection], Awaitable[Any]]


@pytest.fixture
async def db(pg_url: str) -> AsyncIterator[PgDatabase]:
    database = await PgDatabase.connect(
        parse_database_url(pg_url), application_name="test-faults", min_size=2, max_size=2
    )
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture(params=["run", "run_held"])
def runner(request: pytest.FixtureRequest, db: PgDatabase) -> Callable[[Call], Awaitable[Any]]:
    """A call through `PgDatabase.run` or `run_held` (the gateway's kept connection)."""
    method = getattr(db, request.param)

    async def run(fn: Call) -> Any:
        return await method(fn, timeout=5)

    return run


async def backend(run: Callable[[Call], Awaitable[Any]]) -> int:
    return int(await run(lambda conn: conn.fetchval("SELECT pg_backend_pid()")))


async def _insert_then_fail(conn: asyncpg.Connection) -> None:
    async with conn.transaction():
        await conn.execute("INSERT INTO fencegate_migrations (name, applied_at) VALUES ('x', '')")
        raise KeyError("a bug in our code, inside a transaction")


BUGS: dict[str, tuple[Call, type[BaseException]]] = {
    "syntax": (lambda conn: conn.execute("SELEC 1"), asyncpg.PostgresSyntaxError),
    "division": (lambda conn: conn.fetchval("SELECT 1 / 0"), asyncpg.DivisionByZeroError),
    "column": (
        lambda conn: conn.fetch("SELECT no_such_column FROM fencegate_migrations"),
        asyncpg.UndefinedColumnError,
    ),
    "argument": (lambda conn: conn.fetchval("SELECT $1::int", "one"), asyncpg.DataError),
    "duplicate": (
        lambda conn: conn.execute(
            "INSERT INTO fencegate_migrations (name, applied_at)"
            " SELECT name, applied_at FROM fencegate_migrations LIMIT 1"
        ),
        asyncpg.UniqueViolationError,
    ),
    "python": (_insert_then_fail, KeyError),
}


@pytest.mark.parametrize("bug", list(BUGS))
async def test_a_bug_propagates_as_itself_and_keeps_its_connection(
    runner: Callable[[Call], Awaitable[Any]], bug: str
) -> None:
    call, error = BUGS[bug]
    pid = await backend(runner)
    with pytest.raises(error) as raised:
        await runner(call)
    assert not isinstance(raised.value, StoreUnavailable)
    assert not pg_fault(raised.value)
    assert await backend(runner) == pid  # the same server process: not terminated
    # Whatever the call had begun was rolled back.
    rows = await runner(lambda conn: conn.fetchval("SELECT count(*) FROM fencegate_migrations"))
    assert rows == len(
        await runner(lambda conn: conn.fetch("SELECT name FROM fencegate_migrations"))
    )
    assert (
        await runner(
            lambda conn: conn.fetchval("SELECT count(*) FROM fencegate_migrations WHERE name = 'x'")
        )
        == 0
    )


async def test_a_backend_killed_during_a_call_is_store_unavailable_and_the_next_call_works(
    runner: Callable[[Call], Awaitable[Any]], pg_url: str
) -> None:
    pid = await backend(runner)
    sleeping = asyncio.ensure_future(runner(lambda conn: conn.execute("SELECT pg_sleep(30)")))
    admin = await asyncpg.connect(pg_url)
    try:

        async def asleep() -> bool:
            query = await admin.fetchval(
                "SELECT query FROM pg_stat_activity WHERE pid = $1 AND state = 'active'", pid
            )
            return query is not None and "pg_sleep" in query

        await wait_until(asleep, timeout=10, what="the call to run on the server")
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()
    with pytest.raises(StoreUnavailable) as raised:
        await asyncio.wait_for(sleeping, 10)
    assert pg_fault(raised.value.__cause__ or raised.value)
    assert await backend(runner) != pid


async def test_a_statement_timeout_is_store_unavailable(
    runner: Callable[[Call], Awaitable[Any]],
) -> None:
    async def slow(conn: asyncpg.Connection) -> None:
        async with conn.transaction():
            await conn.execute("SET LOCAL statement_timeout = '50ms'")
            await conn.execute("SELECT pg_sleep(5)")

    with pytest.raises(StoreUnavailable) as raised:
        await runner(slow)
    assert isinstance(raised.value.__cause__, asyncpg.QueryCanceledError)
    assert await runner(lambda conn: conn.fetchval("SELECT 2")) == 2


async def test_a_lock_timeout_is_store_unavailable(
    runner: Callable[[Call], Awaitable[Any]], pg_url: str
) -> None:
    holder = await asyncpg.connect(pg_url)
    try:
        await holder.execute("BEGIN")
        await holder.execute("LOCK TABLE fencegate_migrations IN ACCESS EXCLUSIVE MODE")

        async def blocked(conn: asyncpg.Connection) -> None:
            async with conn.transaction():
                await conn.execute("SET LOCAL lock_timeout = '50ms'")
                await conn.fetch("SELECT * FROM fencegate_migrations")

        with pytest.raises(StoreUnavailable) as raised:
            await runner(blocked)
        assert isinstance(raised.value.__cause__, asyncpg.LockNotAvailableError)
    finally:
        await holder.close()


async def test_a_serialization_failure_is_store_unavailable(
    runner: Callable[[Call], Awaitable[Any]], pg_url: str
) -> None:
    """Retryable (40001): another transaction changed the row after this one's snapshot."""
    other = await asyncpg.connect(pg_url)
    try:

        async def conflicting(conn: asyncpg.Connection) -> None:
            async with conn.transaction(isolation="repeatable_read"):
                await conn.fetch("SELECT * FROM fencegate_migrations")  # the snapshot
                await other.execute("UPDATE fencegate_migrations SET applied_at = 'changed'")
                await conn.execute("UPDATE fencegate_migrations SET applied_at = 'mine'")

        with pytest.raises(StoreUnavailable) as raised:
            await runner(conflicting)
        assert isinstance(raised.value.__cause__, asyncpg.SerializationError)
    finally:
        await other.close()


async def test_a_dropped_table_is_store_unavailable(
    runner: Callable[[Call], Awaitable[Any]], pg_url: str
) -> None:
    await runner(lambda conn: conn.execute("CREATE TABLE scratch (id int)"))
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute("DROP TABLE scratch")
    finally:
        await admin.close()
    with pytest.raises(StoreUnavailable) as raised:
        await runner(lambda conn: conn.fetch("SELECT * FROM scratch"))
    assert isinstance(raised.value.__cause__, asyncpg.UndefinedTableError)


def _with_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    netloc = f"{user}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


async def test_refused_connections_are_store_unavailable(pg_url: str, pg_server_url: str) -> None:
    """A role over its connection limit (53300), a database that accepts no connections
    (FATAL 55000), a port nobody listens on (OSError): each a store fault at connect."""
    role = f"fg_limited_{uuid.uuid4().hex[:8]}"
    name = urlsplit(pg_url).path.lstrip("/")
    server = await asyncpg.connect(pg_server_url)
    try:
        await server.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 0")
        with pytest.raises(asyncpg.TooManyConnectionsError) as too_many:
            await asyncpg.connect(_with_user(pg_url, role))
        assert pg_fault(too_many.value)
        with pytest.raises(StoreUnavailable, match="PostgreSQL did not answer"):
            await PgDatabase.connect(
                parse_database_url(_with_user(pg_url, role)), application_name="t", timeout=5
            )
        await server.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        with pytest.raises(StoreUnavailable) as refused:
            await PgDatabase.connect(parse_database_url(pg_url), application_name="t", timeout=5)
        assert isinstance(refused.value.__cause__, asyncpg.ObjectNotInPrerequisiteStateError)
    finally:
        await server.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await server.execute(f"DROP ROLE IF EXISTS {role}")
        await server.close()
    with pytest.raises(StoreUnavailable):
        await PgDatabase.connect(
            parse_database_url("postgresql://postgres@127.0.0.1:1/none"),
            application_name="t",
            timeout=5,
        )


# -- SQLite ---------------------------------------------------------------------------------


@pytest.fixture
async def lite(sqlite_url: str) -> AsyncIterator[SQLiteDatabase]:
    database = SQLiteDatabase(urlsplit(sqlite_url).path[1:])
    try:
        yield database
    finally:
        await database.close()


def _sqlite_insert_then_fail(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO fencegate_migrations (name, applied_at) VALUES ('x', '')")
    raise KeyError("a bug in our code, inside the write transaction")


SQLITE_BUGS: dict[str, tuple[Callable[[sqlite3.Connection], Any], type[BaseException]]] = {
    "syntax": (lambda conn: conn.execute("SELEC 1"), sqlite3.OperationalError),
    "column": (
        lambda conn: conn.execute("SELECT no_such_column FROM fencegate_migrations"),
        sqlite3.OperationalError,
    ),
    "duplicate": (
        lambda conn: conn.execute(
            "INSERT INTO fencegate_migrations SELECT * FROM fencegate_migrations LIMIT 1"
        ),
        sqlite3.IntegrityError,
    ),
    "argument": (lambda conn: conn.execute("SELECT ?", (object(),)), sqlite3.ProgrammingError),
    "python": (_sqlite_insert_then_fail, KeyError),
}


@pytest.mark.parametrize("bug", list(SQLITE_BUGS))
async def test_a_bug_on_sqlite_propagates_as_itself(lite: SQLiteDatabase, bug: str) -> None:
    call, error = SQLITE_BUGS[bug]
    with pytest.raises(error) as raised:
        await lite.run(call, timeout=5, write=True)
    assert not isinstance(raised.value, StoreUnavailable) and not sqlite_fault(raised.value)
    count = await lite.run(
        lambda conn: conn.execute(
            "SELECT count(*) FROM fencegate_migrations WHERE name = 'x'"
        ).fetchone()[0],
        timeout=5,
    )
    assert count == 0  # rolled back


async def test_a_locked_sqlite_file_is_store_unavailable(
    lite: SQLiteDatabase, sqlite_url: str
) -> None:
    blocker = sqlite3.connect(urlsplit(sqlite_url).path[1:], timeout=1, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreUnavailable):
            await lite.run(
                lambda conn: conn.execute("SELECT 1").fetchone(), timeout=0.5, write=True
            )
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert await lite.run(lambda conn: conn.execute("SELECT 2").fetchone()[0], timeout=5) == 2


async def test_sqlite_files_that_cannot_serve_are_store_unavailable(tmp_path: Path) -> None:
    """A missing directory (unable to open), a file that is not a database, a missing table."""
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not an SQLite database, only text " * 100)
    for path in (tmp_path / "missing" / "fencegate.db", garbage):
        database = SQLiteDatabase(path)
        try:
            with pytest.raises(StoreUnavailable) as raised:
                await database.run(lambda conn: conn.execute("SELECT 1").fetchone(), timeout=5)
            assert sqlite_fault(raised.value.__cause__ or raised.value)
        finally:
            await database.close()
    database = SQLiteDatabase(tmp_path / "empty.db")
    try:
        with pytest.raises(StoreUnavailable, match="no such table"):
            await database.run(lambda conn: conn.execute("SELECT * FROM fencegate_jobs"), timeout=5)
    finally:
        await database.close()


async def test_a_closed_sqlite_store_is_store_closed(lite: SQLiteDatabase) -> None:
    await lite.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        await lite.run(lambda conn: None, timeout=5)


def test_classification_needs_no_server() -> None:
    """Kept cheap: the functions take any exception, including ones from elsewhere."""
    assert not pg_fault(KeyError("x")) and not sqlite_fault(KeyError("x"))
    assert pg_fault(TimeoutError()) and sqlite_fault(ConnectionResetError())
