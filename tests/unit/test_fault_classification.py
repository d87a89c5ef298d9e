"""The error classification by SQLSTATE and SQLite result code, for the classes a test
server cannot easily be made to raise (a shutdown, a crash, a full disk): store faults are
`StoreUnavailable`, everything else is a bug. The real servers' errors are in
tests/integration/test_store_faults.py."""

from __future__ import annotations

import sqlite3

import asyncpg
import pytest

from fencegate.store.faults import pg_fault, sqlite_fault

PG_FAULTS = [
    asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    asyncpg.ConnectionFailureError("x"),
    asyncpg.ProtocolViolationError("unsupported startup parameter"),
    asyncpg.AdminShutdownError("terminating connection due to administrator command"),
    asyncpg.CrashShutdownError("terminating connection because of crash of another process"),
    asyncpg.CannotConnectNowError("the database system is starting up"),
    asyncpg.DatabaseDroppedError("x"),
    asyncpg.IdleSessionTimeoutError("x"),
    asyncpg.QueryCanceledError("canceling statement due to statement timeout"),
    asyncpg.TooManyConnectionsError("sorry, too many clients already"),
    asyncpg.DiskFullError("could not extend file"),
    asyncpg.OutOfMemoryError("x"),
    asyncpg.LockNotAvailableError("canceling statement due to lock timeout"),
    asyncpg.SerializationError("could not serialize access"),
    asyncpg.DeadlockDetectedError("deadlock detected"),
    asyncpg.ReadOnlySQLTransactionError("cannot execute UPDATE in a read-only transaction"),
    asyncpg.InvalidCatalogNameError('database "x" does not exist'),
    asyncpg.UndefinedTableError('relation "fencegate_idempotency_keys" does not exist'),
    asyncpg.InvalidPasswordError("password authentication failed"),
    asyncpg.PostgresIOError("x"),
    asyncpg.InternalClientError("cannot switch to state 12; another operation is in progress"),
    asyncpg.InterfaceError("cannot perform operation: connection is closed"),
    asyncpg.InterfaceError("pool is closing"),
    asyncpg.InterfaceError("cannot perform operation: another operation is cancelling"),
    ConnectionRefusedError(111, "Connection refused"),
    TimeoutError(),
]
PG_BUGS = [
    asyncpg.PostgresSyntaxError('syntax error at or near "SELEC"'),
    asyncpg.UndefinedColumnError("column does not exist"),
    asyncpg.UndefinedFunctionError("function does not exist"),
    asyncpg.DivisionByZeroError("division by zero"),
    asyncpg.UniqueViolationError("duplicate key value"),
    asyncpg.NotNullViolationError("null value"),
    asyncpg.InvalidTextRepresentationError("invalid input syntax for type integer"),
    asyncpg.RaiseError("an exception raised by a function of ours"),
    asyncpg.DataError("invalid input for query argument $1"),
    asyncpg.InterfaceError("cannot call Connection.fetch(): connection has been released"),
    KeyError("x"),
    TypeError("x"),
]


@pytest.mark.parametrize("exc", PG_FAULTS, ids=lambda e: type(e).__name__)
def test_postgres_store_faults(exc: BaseException) -> None:
    assert pg_fault(exc)


@pytest.mark.parametrize("exc", PG_BUGS, ids=lambda e: type(e).__name__)
def test_postgres_bugs(exc: BaseException) -> None:
    assert not pg_fault(exc)
    # Whatever it is, an error on a connection that is closed now is the connection's.
    if isinstance(exc, asyncpg.PostgresError):
        assert pg_fault(exc, connection_closed=True)


def _sqlite(kind: type[sqlite3.Error], text: str, code: int | None) -> sqlite3.Error:
    exc = kind(text)
    if code is not None:
        exc.sqlite_errorcode = code
    return exc


SQLITE_FAULTS = [
    _sqlite(sqlite3.OperationalError, "database is locked", 5),
    _sqlite(sqlite3.OperationalError, "database table is locked", 6),
    _sqlite(sqlite3.OperationalError, "disk I/O error", 10 | (3 << 8)),  # SQLITE_IOERR_WRITE
    _sqlite(sqlite3.OperationalError, "database or disk is full", 13),
    _sqlite(sqlite3.OperationalError, "unable to open database file", 14),
    _sqlite(sqlite3.OperationalError, "attempt to write a readonly database", 8),
    _sqlite(sqlite3.DatabaseError, "database disk image is malformed", 11),
    _sqlite(sqlite3.DatabaseError, "file is not a database", 26),
    _sqlite(sqlite3.OperationalError, "no such table: fencegate_jobs", 1),
    _sqlite(sqlite3.OperationalError, "database is locked", None),
    OSError(28, "No space left on device"),
]
SQLITE_BUGS = [
    _sqlite(sqlite3.OperationalError, 'near "SELEC": syntax error', 1),
    _sqlite(sqlite3.OperationalError, "no such column: x", 1),
    _sqlite(sqlite3.IntegrityError, "UNIQUE constraint failed: fencegate_jobs.id", 19),
    _sqlite(sqlite3.ProgrammingError, "Incorrect number of bindings supplied", None),
    sqlite3.InterfaceError("Error binding parameter 1"),
    KeyError("x"),
]


@pytest.mark.parametrize("exc", SQLITE_FAULTS, ids=str)
def test_sqlite_store_faults(exc: BaseException) -> None:
    assert sqlite_fault(exc)


@pytest.mark.parametrize("exc", SQLITE_BUGS, ids=str)
def test_sqlite_bugs(exc: BaseException) -> None:
    assert not sqlite_fault(exc)
