"""The PostgreSQL connection layer every fencegate store shares: one asyncpg pool, every call
bounded by ``timeout=`` as a whole (acquire, query, release), and one error rule.

A store fault at this boundary (a lost or refused connection, a timeout, a server shutting
down or out of connections, a conflict, a missing schema, asyncpg's broken protocol state;
`fencegate.store.faults`) is raised as `StoreUnavailable`: to a gateway that means fail
closed (503), to a worker that its ownership is unknown; its connection is closed. Anything
else (a syntax error, a wrong argument, a Python exception in the caller's function) is a bug
and propagates as it is, and its connection, which is sound, goes back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

import asyncpg

from fencegate.errors import StoreClosed, StoreTimedOut, StoreUnavailable, unsent
from fencegate.store import pool_log
from fencegate.store.dburl import POOL_MODE_OPTION, DatabaseURL
from fencegate.store.faults import pg_fault
from fencegate.store.replication import ReplicationGuard, ReplicationNotSynchronous

T = TypeVar("T")


def unavailable(
    exc: BaseException, timeout: float, *, connection_closed: bool = False
) -> StoreUnavailable | None:
    """``exc`` as `StoreUnavailable` when it is a store fault (the store could not decide or
    record: `fencegate.store.faults.pg_fault`), None when it is a bug."""
    if isinstance(exc, TimeoutError):
        return StoreTimedOut(f"no answer within {timeout:g}s")
    if isinstance(exc, StoreUnavailable):
        return exc
    if not pg_fault(exc, connection_closed=connection_closed):
        return None
    if isinstance(
        exc, asyncpg.DuplicatePreparedStatementError | asyncpg.InvalidSQLStatementNameError
    ):
        return StoreUnavailable(f"{type(exc).__name__}: {exc}; {_POOLER_HINT}")
    return StoreUnavailable(f"{type(exc).__name__}: {exc}")


# Whether the database has the Citus extension (a Citus coordinator's, or a worker's).
CITUS_INSTALLED = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')"

_POOLER_HINT = (
    "prepared statements do not survive a transaction-pooling connection pooler "
    f"(PgBouncer pool_mode = transaction): add ?{POOL_MODE_OPTION}=transaction to the database URL"
)

# Start-up parameters PgBouncer 1.18 passes on; any other one it refuses at connect.
_POOLER_STARTUP = ("application_name",)
# Settings that only make statements faster: left to the server's defaults behind a
# transaction pooler (an unnamed statement is planned per call anyway, and JIT never
# triggers on fencegate's by-key statements), rather than one more round trip per call.
_SPEED_ONLY = ("jit", "plan_cache_mode", "enable_seqscan", "enable_bitmapscan")


def _split_settings(
    settings: dict[str, str], *, transaction_pooling: bool
) -> tuple[dict[str, str], LocalSettings]:
    """(start-up parameters, what each call sets first): behind a transaction pooler a
    session setting would stay on a server connection other clients share, so what must
    hold for fencegate's statements is set per transaction."""
    if not transaction_pooling:
        return settings, LocalSettings({})
    startup = {k: v for k, v in settings.items() if k in _POOLER_STARTUP}
    local = {k: v for k, v in settings.items() if k not in _POOLER_STARTUP + _SPEED_ONLY}
    return startup, LocalSettings(local)


class LocalSettings:
    """Settings each call makes with SET LOCAL behind a transaction pooler (a transaction
    around the call: BEGIN and COMMIT are two more round trips, the SET a third). One the
    server already has as its default (``ALTER ROLE … SET``, or the database's) is left out,
    and with none left a call is one bare statement again."""

    def __init__(self, wanted: dict[str, str]) -> None:
        self.wanted = dict(wanted)
        self.sql = self._sql(self.wanted)

    @staticmethod
    def _sql(settings: dict[str, str]) -> str:
        return "; ".join(
            f"SET LOCAL {name} = '{value.replace(chr(39), chr(39) * 2)}'"
            for name, value in settings.items()
        )

    async def leave_out_defaults(self, conn: asyncpg.Connection) -> None:
        if not self.wanted:
            return
        names = list(self.wanted)
        current = await conn.fetch(
            "SELECT n, current_setting(n) AS v FROM unnest($1::text[]) AS n", names
        )
        missing = {r["n"]: self.wanted[r["n"]] for r in current if r["v"] != self.wanted[r["n"]]}
        self.sql = self._sql(missing)


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The stores never change session state (no SET, LISTEN or advisory lock on a pooled
    connection), so a connection going back to the pool needs no reset query: that would be
    one more round trip for every statement."""


def statement_cache(target: DatabaseURL) -> dict[str, Any]:
    """asyncpg's options for ``target``: behind a transaction pooler no named prepared
    statement (it would stay on a server connection the next client gets)."""
    return {"statement_cache_size": 0} if target.transaction_pooling else {}


@contextlib.asynccontextmanager
async def single_connection(
    target: DatabaseURL, *, timeout: float, settings: dict[str, str] | None = None
) -> AsyncIterator[asyncpg.Connection]:
    """One connection outside any pool (a command's check, the migrations), with
    ``settings``: start-up parameters, or behind a transaction pooler SET LOCAL in a
    transaction around the block."""
    startup, local = _split_settings(settings or {}, transaction_pooling=target.transaction_pooling)
    conn = await asyncpg.connect(
        target.dsn, timeout=timeout, server_settings=startup or None, **statement_cache(target)
    )
    try:
        async with _pinned(conn, pinned=bool(local.sql)):
            if local.sql:
                await conn.execute(local.sql)
            yield conn
    finally:
        await conn.close(timeout=timeout)


@contextlib.asynccontextmanager
async def _pinned(conn: asyncpg.Connection, *, pinned: bool) -> AsyncIterator[None]:
    if not pinned:
        yield
        return
    async with conn.transaction():
        yield


def _terminate(conn: Any) -> None:
    """After a store fault the connection is in an unknown state (a query may still run on a
    silent network): close it at once rather than reset it for the next caller."""
    with contextlib.suppress(Exception):  # already dropped by the pool
        conn.terminate()


def _explain(exc: BaseException, timeout: float) -> StoreUnavailable | None:
    if "unsupported startup parameter" in str(exc):
        return StoreUnavailable(
            f"{type(exc).__name__}: {exc}: this is a connection pooler (PgBouncer); add "
            f"?{POOL_MODE_OPTION}=transaction to the database URL"
        )
    return unavailable(exc, timeout)


async def check_client(conn: asyncpg.Connection) -> None:
    """A statement whose caller gave up is abandoned by closing its connection (see
    `PgDatabase.run`); from PostgreSQL 14 on, the server then stops it at its next check
    (every 100 ms) rather than finish it, and commit it, once the lock it waits for is free.
    Set once per connection, not as a start-up parameter (an older server refuses an unknown
    one), and not behind a transaction pooler, whose server connections outlive clients."""
    if conn.get_server_version().major >= 14:
        await conn.execute("SET client_connection_check_interval = '100ms'")


async def _warm(pool: asyncpg.Pool, count: int, timeout: float) -> None:
    """``count`` connections opened (and set up) at once and given back to the pool, so
    that callers find them ready; one that fails or is late is left to the first caller."""
    tasks = [asyncio.ensure_future(pool.acquire()) for _ in range(count)]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    for task in done:
        if not task.cancelled() and task.exception() is None:
            with contextlib.suppress(Exception):
                await pool.release(task.result())


def _closed(conn: Any) -> bool:
    """Whether a pooled connection is closed; the pool takes back one that closes while
    held, and its proxy then refuses every call."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def affected(status: str) -> bool:
    """Whether a command tag (``UPDATE 1``, ``DELETE 0``) says a row was touched."""
    return not status.endswith(" 0")


class PgDatabase:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        target: DatabaseURL | None = None,
        server_settings: dict[str, str] | None = None,
        local_settings: LocalSettings | None = None,
        replication: ReplicationGuard | None = None,
    ) -> None:
        self.pool = pool
        self.target = target
        self._server_settings = dict(server_settings or {})
        self.transaction_pooling = target is not None and target.transaction_pooling
        self._local = local_settings or LocalSettings({})
        # What the last new connection found about replication (None: not checked).
        self.replication = replication
        self.closed = False
        # Whether the database is a Citus coordinator's (the extension is installed): the
        # gateway store then batches per tenant (fencegate/store/postgres.py).
        self.citus = False
        # The connection `run_held` keeps between its calls (None: none taken yet), and
        # whether a call is running on it (closing then leaves it to that call).
        self._held: Any = None
        self._held_busy = False

    @classmethod
    async def connect(
        cls,
        target: DatabaseURL,
        *,
        application_name: str,
        min_size: int = 2,
        max_size: int = 20,
        timeout: float = 10.0,
        reset_sessions: bool = False,
        init: Callable[[asyncpg.Connection], Coroutine[Any, Any, None]] | None = None,
        max_inactive_connection_lifetime: float = 300.0,
        generic_plans: bool = False,
        citus_warm: Sequence[str] = (),
        citus_warm_connections: int = 0,
        index_scans: bool = False,
        require_synchronous_replication: bool = False,
    ) -> PgDatabase:
        """A pool on ``target``. ``generic_plans`` for callers whose statements find their
        rows by key or through an index whatever the values (the gateway, the lease queue):
        PostgreSQL then plans each prepared statement once. Statements with optional filters
        over large tables (``$1 IS NULL OR col = $1``, the operator's reads) need the
        default, a plan for the values given. ``index_scans`` for statements that reach
        every row of their growing tables through an index (the lease queue): no sequential
        scans (``enable_seqscan = off``), so that a plan made while the tables were small
        cannot scan them whole once they have grown.

        Every new connection (at start, and each one opened after a failure or a failover)
        checks the server's replication: asynchronous standbys are warned about once, or with
        ``require_synchronous_replication`` the connection is refused."""
        settings = {"jit": "off", "application_name": application_name}
        if generic_plans:
            settings["plan_cache_mode"] = "force_generic_plan"
        if index_scans:
            settings["enable_seqscan"] = "off"
            # A bitmap scan reads every row it matches before an ORDER BY ... LIMIT can stop
            # it: a claim's kept plan picked one over the ordered partial index once it
            # estimated the filtered rows at one, and read and sorted the whole backlog.
            settings["enable_bitmapscan"] = "off"
        if target.schema is not None:
            settings["search_path"] = target.schema
        startup, local = _split_settings(settings, transaction_pooling=target.transaction_pooling)
        guard = ReplicationGuard(target.where, require=require_synchronous_replication)

        found = {"citus": False}

        async def setup(conn: asyncpg.Connection) -> None:
            async with _pinned(conn, pinned=target.transaction_pooling):
                if await conn.fetchval(CITUS_INSTALLED):
                    found["citus"] = True
                    if generic_plans and not target.transaction_pooling:
                        # Citus plans most distributed statements only with their values,
                        # and its fast-path router planner crashes the backend on a
                        # forced generic plan of an upsert (docs/operations/citus.md).
                        await conn.execute("SET plan_cache_mode = auto")
                    for sql in citus_warm:
                        # A new backend on a Citus coordinator loads Citus's metadata and
                        # asyncpg introspects the statement's composite types: a third of a
                        # second, paid here rather than by a caller's deadline.
                        await conn.prepare(sql)
                if init is not None:
                    await init(conn)
                if not target.transaction_pooling:
                    await check_client(conn)
                await guard.check(conn)
                await local.leave_out_defaults(conn)

        try:
            pool_log.install()
            pool = await asyncpg.create_pool(
                target.dsn,
                min_size=min_size,
                max_size=max_size,
                timeout=timeout,
                # Bare statements, no JIT: a decision must stay a sub-millisecond call.
                server_settings=startup,
                init=setup,
                max_inactive_connection_lifetime=max_inactive_connection_lifetime,
                reset=None if reset_sessions else _keep_session,
                **statement_cache(target),
            )
        except ReplicationNotSynchronous:
            raise
        except Exception as exc:
            fault = _explain(exc, timeout)
            if fault is None:
                raise  # a bug (in `init`, say): not "PostgreSQL did not answer"
            # Said plainly: the first thing a misconfigured URL produces is this message.
            raise StoreUnavailable(f"PostgreSQL did not answer: {fault}") from exc
        assert pool is not None
        warm = min(citus_warm_connections, max_size)
        if found["citus"] and warm > min_size:
            await _warm(pool, warm, timeout)
        db = cls(
            pool, target=target, server_settings=startup, local_settings=local, replication=guard
        )
        db.citus = found["citus"]
        return db

    async def listen(
        self,
        channel: str,
        on_notify: Callable[[Any, int, str, Any], None],
        *,
        on_terminate: Callable[[object], None],
        timeout: float,
    ) -> asyncpg.Connection:
        """A connection of its own, outside the pool and with the pool's settings, listening
        on ``channel``: LISTEN is session state, which a pooled connection would hand to the
        next caller. The caller closes it; `StoreUnavailable` when it cannot be set up."""
        if self.target is None:
            raise StoreUnavailable("this database was not opened from a URL")
        if self.transaction_pooling:
            raise StoreUnavailable("LISTEN does not work through a transaction pooler")
        try:
            conn = await asyncpg.connect(
                self.target.dsn, timeout=timeout, server_settings=self._server_settings
            )
        except Exception as exc:
            fault = unavailable(exc, timeout)
            if fault is None:
                raise
            raise fault from exc
        try:
            async with asyncio.timeout(timeout):
                await conn.add_listener(channel, on_notify)
        except BaseException as exc:
            conn.terminate()
            fault = unavailable(exc, timeout) if isinstance(exc, Exception) else None
            if fault is None:
                raise
            raise fault from exc
        conn.add_termination_listener(on_terminate)
        return conn

    async def run(self, fn: Callable[[asyncpg.Connection], Awaitable[T]], *, timeout: float) -> T:
        if self.closed:
            raise StoreClosed("the PostgreSQL pool is closed")
        deadline = time.monotonic() + timeout
        loop_deadline = asyncio.get_running_loop().time() + timeout
        conn = await self._acquire(loop_deadline, timeout)
        try:
            return await self._call(conn, fn, loop_deadline)
        except Exception as exc:
            fault = unavailable(exc, timeout, connection_closed=_closed(conn))
            if fault is None:
                # A bug: the connection is sound. Released below, which rolls back a
                # transaction the call may have left open.
                raise
            _terminate(conn)
            raise fault from exc
        except BaseException:
            _terminate(conn)
            raise
        finally:
            with contextlib.suppress(Exception):
                await self.pool.release(conn, timeout=max(_left(deadline), 0.1))

    async def run_held(
        self, fn: Callable[[asyncpg.Connection], Awaitable[T]], *, timeout: float
    ) -> T:
        """`run` on one connection kept from call to call, for a caller that never makes two
        calls at once (the gateway's batch of steps): taking a connection from the pool and
        giving it back costs more client CPU than a short statement (a task, timers and
        several turns of the event loop, each time). The same bound and error rule as `run`:
        after a store fault the connection is closed and given back, after a bug given back
        as it is (the pool's reset rolls back what the call left open), and the next call
        takes another from the pool; so does one found closed while it waited. A pool of
        one connection keeps none (every other statement would wait for it)."""
        if self.closed or self.pool.get_max_size() < 2:
            return await self.run(fn, timeout=timeout)
        loop_deadline = asyncio.get_running_loop().time() + timeout
        if self._held is not None and _closed(self._held):
            await self._give_back_held()
        if self._held is None:
            self._held = await self._acquire(loop_deadline, timeout)
        conn = self._held
        self._held_busy = True
        try:
            return await self._call(conn, fn, loop_deadline)
        except BaseException as exc:
            bug = False
            fault = None
            if isinstance(exc, Exception):
                fault = unavailable(exc, timeout, connection_closed=_closed(conn))
                bug = fault is None
            if not bug:  # a store fault, or a cancellation mid-call
                _terminate(conn)
            await self._give_back_held()
            if fault is None:
                raise
            raise fault from exc
        finally:
            self._held_busy = False
            if self.closed:
                # Closed while this call ran: the pool's close waits for the connection.
                await self._give_back_held()

    async def _acquire(self, loop_deadline: float, timeout: float) -> Any:
        """A pooled connection within the call's bound: acquire(timeout=) would bound it
        again at the price of a task per call."""
        try:
            async with asyncio.timeout_at(loop_deadline):
                return await self.pool.acquire()
        except Exception as exc:
            fault = unavailable(exc, timeout)
            if fault is None:
                raise  # a bug in a new connection's set-up
            raise unsent(fault) from exc

    async def _call(
        self, conn: Any, fn: Callable[[asyncpg.Connection], Awaitable[T]], loop_deadline: float
    ) -> T:
        async with asyncio.timeout_at(loop_deadline):
            # A pooled connection is a proxy with the connection's whole interface.
            local_sql = self._local.sql
            if not local_sql:
                return await fn(cast(asyncpg.Connection, conn))
            # Behind a transaction pooler a setting the server lacks holds only in a
            # transaction: BEGIN, SET LOCAL, the call, COMMIT (see `LocalSettings`).
            async with conn.transaction():
                await conn.execute(local_sql)
                return await fn(cast(asyncpg.Connection, conn))

    async def _give_back_held(self) -> None:
        conn, self._held = self._held, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self.pool.release(conn, timeout=1.0)

    async def fetch(self, sql: str, args: Sequence[Any], *, timeout: float) -> list[dict[str, Any]]:
        """A named query's rows as dictionaries (the inspector's reads)."""

        async def fetch(conn: asyncpg.Connection) -> list[dict[str, Any]]:
            return [dict(r.items()) for r in await conn.fetch(sql, *args)]

        return await self.run(fetch, timeout=timeout)

    async def execute(self, sql: str, args: Sequence[Any], *, timeout: float) -> int:
        """One statement in its own transaction; the number of rows it touched."""
        status = await self.run(lambda conn: conn.execute(sql, *args), timeout=timeout)
        return int(str(status).rsplit(" ", 1)[-1])

    async def close(self) -> None:
        self.closed = True
        if not self._held_busy:
            await self._give_back_held()
        try:
            await asyncio.wait_for(self.pool.close(), 5.0)
        except Exception:
            self.pool.terminate()
