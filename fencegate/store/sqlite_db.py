"""A small asyncio front for one `sqlite3` connection.

SQLite allows one writer at a time, so each store owns one connection driven by one thread;
other processes on the host share the file through WAL and the busy timeout. Every call
takes `timeout=` and raises `asyncio.TimeoutError` instead of waiting past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# The database clock in epoch seconds with sub-second precision; every time comparison on
# SQLite uses it, never the caller's clock.
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


class SQLiteDatabase:
    def __init__(self, path: Path | str, *, busy_timeout: float = 5.0) -> None:
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencegate-sqlite")
        self._conn: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(
                self.path,
                isolation_level=None,  # we issue BEGIN IMMEDIATE ourselves
                check_same_thread=False,
                timeout=self.busy_timeout,
            )
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")
            self._conn = conn
        return self._conn

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return fn(self._connect())
        except sqlite3.OperationalError:
            # A broken handle (file removed, disk error) is reopened on the next call.
            self._close_now()
            raise

    async def run(self, fn: Callable[[sqlite3.Connection], T], *, timeout: float | None) -> T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._call, fn)
        return await asyncio.wait_for(future, timeout)

    def _close_now(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._close_now)
        self._executor.shutdown(wait=False)


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE takes the write lock up front, so a read-then-write inside the
    transaction cannot interleave with another process's write (no check-then-act)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    else:
        conn.execute("COMMIT")
