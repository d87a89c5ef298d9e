"""A small asyncio front for one `sqlite3` connection.

SQLite allows one writer at a time, so each store owns one connection driven by one thread;
other processes on the host share the file through WAL and the busy timeout. Every call goes
through `SQLiteDatabase.run`, which holds SQLite's one deadline and error rule: it keeps work
from running (or committing) after its caller gave up, and raises a store fault (locked,
busy, I/O, full, unable to open; `fencegate.store.faults`) as `StoreUnavailable`; anything
else is a bug and propagates as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fencegate.errors import FencegateError, StoreClosed, StoreTimedOut, StoreUnavailable
from fencegate.store.faults import sqlite_fault

T = TypeVar("T")


class CallerGaveUp(FencegateError):
    """The caller's deadline passed before the work could start (or take the write lock)."""


class SQLiteDatabase:
    def __init__(self, path: Path | str, *, busy_timeout: float = 5.0) -> None:
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencegate-sqlite")
        self._conn: sqlite3.Connection | None = None
        self.closed = False

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
        except sqlite3.DatabaseError as exc:
            if sqlite_fault(exc):
                # A broken handle (file removed, disk error) is reopened on the next call.
                self._close_now()
            raise

    async def run(
        self, fn: Callable[[sqlite3.Connection], T], *, timeout: float, write: bool = False
    ) -> T:
        """``fn`` on the connection's thread, bounded and classified: the one rule every
        SQLite caller (gateway store, lease driver, inspector, migrations) goes through. With
        ``write``, ``fn`` runs in one BEGIN IMMEDIATE transaction (rolled back if it raises).
        A store fault (a timeout, a locked, busy, unreadable, full or missing file, a missing
        table) is raised as `StoreUnavailable` (`StoreTimedOut` for the deadline, `StoreClosed`
        once closed): the store could not say yes or no. Anything else is a bug in ``fn`` or
        its SQL and propagates as it is."""
        if self.closed:
            raise StoreClosed(f"the SQLite store {self.path} is closed")
        # The connection's thread gives up a little before the caller does, and checks again
        # once it holds the write lock: work that waited for the lock past the caller's
        # patience is rolled back instead of done behind the caller's back.
        deadline = time.monotonic() + timeout - min(0.2, timeout * 0.2)

        def bounded(conn: sqlite3.Connection) -> T:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CallerGaveUp
            conn.execute(f"PRAGMA busy_timeout={max(int(remaining * 1000), 1)}")
            if not write:
                return fn(conn)
            with write_transaction(conn):
                if time.monotonic() > deadline:
                    raise CallerGaveUp
                return fn(conn)

        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._executor, self._call, bounded)
        except RuntimeError as exc:  # the executor shut down: closed meanwhile
            raise StoreClosed(f"the SQLite store {self.path} is closed") from exc
        try:
            return await asyncio.wait_for(future, timeout)
        except (TimeoutError, CallerGaveUp) as exc:
            raise StoreTimedOut(f"SQLite did not answer within {timeout:g}s") from exc
        except StoreUnavailable:
            raise
        except Exception as exc:
            if not sqlite_fault(exc):
                raise
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def fetch(self, sql: str, args: Sequence[Any], *, timeout: float) -> list[dict[str, Any]]:
        """A named query's rows as dictionaries (the inspector's reads)."""

        def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            return [dict(zip(r.keys(), tuple(r), strict=True)) for r in conn.execute(sql, args)]

        return await self.run(read, timeout=timeout)

    async def execute(self, sql: str, args: Sequence[Any], *, timeout: float) -> int:
        """One statement in its own transaction; the number of rows it touched."""
        return await self.run(
            lambda conn: conn.execute(sql, args).rowcount, timeout=timeout, write=True
        )

    def _close_now(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
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
