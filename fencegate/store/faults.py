"""The one error classification: which failures at the store boundary mean the store could
not answer (a store fault, raised as `StoreUnavailable`: the gateway answers 503
``store-unavailable``, a worker's ownership is unknown) and which are a bug in fencegate's
own code or SQL (propagated as they are: the gateway answers 500 ``internal-error``).

A store fault is what retrying later, or an operator fixing the database, can cure: the
connection could not be made or was lost, no answer in time, the server is shutting down,
starting, out of connections, disk or memory, a lock or serialization conflict, the
database, schema or a table is gone, the file is locked, busy, unreadable or full. A syntax
error, a wrong argument type, a constraint our statements should never break, or any Python
exception is a bug: calling again would fail the same way, and calling it an outage would
hide it (and, on PostgreSQL, throw away a sound connection).
"""

from __future__ import annotations

import sqlite3

import asyncpg

from fencegate.errors import StoreUnavailable

# SQLSTATE classes that are a store fault whatever the code in them.
_PG_CLASSES = frozenset(
    {
        "08",  # connection exception
        "53",  # insufficient resources: disk full, out of memory, too many connections
        "57",  # operator intervention: shutdown, crash, cannot connect now, statement timeout
        "58",  # system error: I/O error, undefined file
        "40",  # transaction rollback: serialization failure, deadlock (retryable)
        "28",  # the server refuses this role (password changed, pg_hba)
    }
)
# Single SQLSTATEs of other classes that are a store fault.
_PG_STATES = frozenset(
    {
        "55P03",  # lock_not_available: lock_timeout
        "25006",  # read_only_sql_transaction: a standby after failover, or a read-only server
        "3D000",  # invalid_catalog_name: the database is gone
        "3F000",  # invalid_schema_name: the schema is gone
        "42P01",  # undefined_table: the schema was dropped or never migrated
        "42501",  # insufficient_privilege: the role lost its grants
        "XX001",  # data_corrupted
        "XX002",  # index_corrupted
        # Prepared statements behind a transaction pooler (a configuration fault; see pg.py).
        "26000",  # invalid_sql_statement_name
        "42P05",  # duplicate_prepared_statement
    }
)
# asyncpg's wording for a connection it can no longer use.
_PG_BROKEN = ("closed", "closing", "cancelling")


def pg_fault(exc: BaseException, *, connection_closed: bool = False) -> bool:
    """Whether ``exc``, raised by asyncpg (or around it), is a store fault.
    ``connection_closed``: the connection the call ran on is closed now."""
    if isinstance(exc, StoreUnavailable | TimeoutError | OSError):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", "") or "")
        if state[:2] in _PG_CLASSES or state in _PG_STATES:
            return True
        # FATAL or PANIC: the server ended the session after saying why.
        return getattr(exc, "severity", None) in ("FATAL", "PANIC") or connection_closed
    if isinstance(exc, asyncpg.InternalClientError):
        # The protocol is in a state asyncpg cannot continue from (or, for
        # TargetServerAttributeNotMatched, no server of the URL's kind is up).
        return True
    if isinstance(exc, asyncpg.ClientConfigurationError):
        return True  # the URL's connection options: configuration, not code
    if isinstance(exc, asyncpg.InterfaceError) and not isinstance(exc, asyncpg.DataError):
        return connection_closed or any(word in str(exc) for word in _PG_BROKEN)
    return False


# SQLite's primary result codes that are a store fault.
_SQLITE_CODES = frozenset(
    {
        5,  # SQLITE_BUSY: another connection holds the write lock past the busy timeout
        6,  # SQLITE_LOCKED
        7,  # SQLITE_NOMEM
        8,  # SQLITE_READONLY: the file or its directory became read-only
        9,  # SQLITE_INTERRUPT
        10,  # SQLITE_IOERR: disk I/O error
        11,  # SQLITE_CORRUPT
        13,  # SQLITE_FULL: database or disk is full
        14,  # SQLITE_CANTOPEN: unable to open database file
        15,  # SQLITE_PROTOCOL: WAL lock protocol error
        26,  # SQLITE_NOTADB: the file is not a database
    }
)
# The wording of the same faults, for an error raised without a result code.
_SQLITE_WORDS = (
    "locked",
    "busy",
    "disk i/o",
    "is full",
    "unable to open",
    "readonly",
    "malformed",
    "not a database",
)


def sqlite_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by sqlite3 (or around it), is a store fault."""
    if isinstance(exc, StoreUnavailable | TimeoutError | OSError):
        return True
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(
        exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.DataError
    ):
        return False  # not the database's (an IntegrityError: a statement of ours)
    code = getattr(exc, "sqlite_errorcode", None)
    text = str(exc).lower()
    if isinstance(code, int) and code & 0xFF in _SQLITE_CODES:
        return True
    if text.startswith("no such table"):
        return True  # the table was dropped or never migrated (as 42P01 above)
    return code is None and any(word in text for word in _SQLITE_WORDS)
