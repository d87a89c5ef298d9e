"""The PostgreSQL connection layer every fencegate store shares: one asyncpg pool, every call
bounded by ``timeout=`` as a whole (acquire, query, release), and one error rule.

Whatever fails at this boundary (a lost or refused connection, a timeout, a server error, a
missing schema, asyncpg's own protocol errors) is raised as `StoreUnavailable`: to a gateway
that means fail closed (503), to a worker that its ownership is unknown. Callers never see a
driver exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

import asyncpg

from fencegate.errors import StoreTimedOut, StoreUnavailable, unsent
from fencegate.store.dburl import DatabaseURL

T = TypeVar("T")


def unavailable(exc: BaseException, timeout: float) -> StoreUnavailable:
    """Every failure at the store boundary means the same: the store could not decide or
    record. A driver's protocol error (asyncpg's ``InternalClientError``), a missing schema
    and a dropped database included."""
    if isinstance(exc, TimeoutError):
        return StoreTimedOut(f"no answer within {timeout:g}s")
    return StoreUnavailable(f"{type(exc).__name__}: {exc}")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The stores never change session state (no SET, LISTEN or advisory lock on a pooled
    connection), so a connection going back to the pool needs no reset query: that would be
    one more round trip for every statement."""


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
    ) -> None:
        self.pool = pool
        self.target = target
        self._server_settings = dict(server_settings or {})

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
        custom_plans: bool = False,
    ) -> PgDatabase:
        """A pool on ``target``. ``generic_plans`` for callers whose every statement is a
        lookup by key: PostgreSQL then plans each prepared statement once. Statements with
        optional filters (``$1 IS NULL OR col = $1``, the operator's reads) need the default,
        a plan for the values given. ``custom_plans`` for statements over tables that grow
        fast from empty (the lease queue): a plan kept from when they were small (a
        sequential scan inside a nested loop) would stay until the next ANALYZE."""
        settings = {
            "jit": "off",
            "application_name": application_name,
            # A statement whose caller gave up is abandoned by closing its connection (see
            # `run`); the server then stops it at its next check rather than finish it (and
            # commit it) once the lock it waits for is free.
            "client_connection_check_interval": "100ms",
        }
        if generic_plans:
            settings["plan_cache_mode"] = "force_generic_plan"
        elif custom_plans:
            settings["plan_cache_mode"] = "force_custom_plan"
        if target.schema is not None:
            settings["search_path"] = target.schema
        try:
            pool = await asyncpg.create_pool(
                target.dsn,
                min_size=min_size,
                max_size=max_size,
                timeout=timeout,
                # Bare statements, no JIT: a decision must stay a sub-millisecond call.
                server_settings=settings,
                init=init,
                max_inactive_connection_lifetime=max_inactive_connection_lifetime,
                reset=None if reset_sessions else _keep_session,
            )
        except Exception as exc:
            # Said plainly: the first thing a misconfigured URL produces is this message.
            raise StoreUnavailable(
                f"PostgreSQL did not answer: {unavailable(exc, timeout)}"
            ) from exc
        assert pool is not None
        return cls(pool, target=target, server_settings=settings)

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
        try:
            conn = await asyncpg.connect(
                self.target.dsn, timeout=timeout, server_settings=self._server_settings
            )
        except Exception as exc:
            raise unavailable(exc, timeout) from exc
        try:
            async with asyncio.timeout(timeout):
                await conn.add_listener(channel, on_notify)
        except BaseException as exc:
            conn.terminate()
            if isinstance(exc, Exception):
                raise unavailable(exc, timeout) from exc
            raise
        conn.add_termination_listener(on_terminate)
        return conn

    async def run(self, fn: Callable[[asyncpg.Connection], Awaitable[T]], *, timeout: float) -> T:
        deadline = time.monotonic() + timeout
        loop_deadline = asyncio.get_running_loop().time() + timeout
        try:
            # One bound over the wait for a connection (and its opening) and the call:
            # acquire(timeout=) would bound it again at the price of a task per call.
            async with asyncio.timeout_at(loop_deadline):
                conn = await self.pool.acquire()
        except Exception as exc:
            raise unsent(unavailable(exc, timeout)) from exc
        try:
            async with asyncio.timeout_at(loop_deadline):
                # A pooled connection is a proxy with the connection's whole interface.
                return await fn(cast(asyncpg.Connection, conn))
        except BaseException as exc:
            # The connection is in an unknown state (a query may still run on a silent
            # network): close it at once rather than wait to reset it for the next caller.
            with contextlib.suppress(Exception):  # already dropped by the pool
                conn.terminate()
            if isinstance(exc, Exception):
                raise unavailable(exc, timeout) from exc
            raise
        finally:
            with contextlib.suppress(Exception):
                await self.pool.release(conn, timeout=max(_left(deadline), 0.1))

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.pool.close(), 5.0)
        except Exception:
            self.pool.terminate()
