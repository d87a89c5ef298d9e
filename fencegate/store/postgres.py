"""The gateway store on PostgreSQL (asyncpg pool).

One decision is one call of the `fencegate_decide` function (one round trip, one
transaction); each record is one conditional statement. asyncpg caches the prepared
statements per connection. Every call is bounded by `timeout=` as a whole (acquire, query
and release), so a partitioned database costs a caller at most that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import orjson

from fencegate.store.base import (
    DEFAULT_FENCE_TTL_SECONDS,
    DecideRequest,
    Decision,
    Outcome,
    PurgeCounts,
    Reservation,
    StoredResponse,
    StoreUnavailable,
)
from fencegate.store.batching import Batcher

T = TypeVar("T")

_DECIDE_MANY = """
SELECT * FROM fencegate_decide_many(
    $1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6, $7,
    $8::double precision[], $9::boolean[])
"""

# Rows are locked in key order, as decisions lock them, so that the two never deadlock.
_COMPLETE_MANY = """
WITH answer AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::integer[], $5::integer[],
                         $6::text[], $7::bytea[], $8::text[], $9::boolean[])
        AS a(tenant, key, owner, attempt, status, headers, body, sha256, too_large)
), held AS (
    SELECT k.tenant, k.key FROM idempotency_keys k
    JOIN answer a ON k.tenant = a.tenant AND k.key = a.key AND k.owner = a.owner
        AND k.attempt = a.attempt
    WHERE k.state = 'in_flight'
    ORDER BY k.tenant, k.key
    FOR UPDATE OF k
)
UPDATE idempotency_keys k
SET state = 'completed', response_status = a.status, response_headers = a.headers::jsonb,
    response_body = a.body, response_sha256 = a.sha256, body_too_large = a.too_large,
    completed_at = now(), locked_until = NULL
FROM held, answer a
WHERE k.tenant = held.tenant AND k.key = held.key AND a.tenant = k.tenant AND a.key = k.key
RETURNING k.tenant, k.key
"""

_RELEASE = """
DELETE FROM idempotency_keys
WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
"""

_MARK_UNKNOWN = """
UPDATE idempotency_keys SET state = 'outcome_unknown', locked_until = NULL
WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
"""

_RENEW = """
UPDATE idempotency_keys SET locked_until = now() + make_interval(secs => $5)
WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
  AND locked_until > now()
"""

# A nonce row that has expired may be reused; an unexpired one is a replayed signature.
_REMEMBER_NONCE = """
INSERT INTO signature_nonces AS n (key_id, nonce, expires_at)
VALUES ($1, $2, now() + make_interval(secs => $3))
ON CONFLICT (key_id, nonce) DO UPDATE SET expires_at = EXCLUDED.expires_at
    WHERE n.expires_at <= now()
RETURNING 1
"""

_PURGE_KEYS = """
DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency_keys WHERE expires_at <= now() LIMIT $1))
"""
_PURGE_FENCES = """
DELETE FROM fences WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM fences WHERE updated_at <= now() - make_interval(secs => $2) LIMIT $1))
"""
_PURGE_NONCES = """
DELETE FROM signature_nonces WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM signature_nonces WHERE expires_at <= now() LIMIT $1))
"""

# Errors that mean "the store did not answer", as opposed to a bug in a statement.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
)


def _decision(row: asyncpg.Record) -> Decision:
    outcome = Outcome(row["d_outcome"])
    response = None
    if outcome is Outcome.REPLAY:
        headers = [(str(k), str(v)) for k, v in orjson.loads(row["d_response_headers"])]
        response = StoredResponse(
            status=row["d_response_status"],
            headers=headers,
            body=None if row["d_body_too_large"] else bytes(row["d_response_body"] or b""),
            sha256=row["d_response_sha256"],
        )
    return Decision(
        outcome=outcome,
        last_accepted=row["d_last_accepted"],
        attempt=row["d_attempt"],
        retry_after=row["d_retry_after"],
        response=response,
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The store never changes session state (no SET, LISTEN or advisory lock), so a
    connection going back to the pool needs no reset query: that would be one more round
    trip for every statement."""


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _affected(status: str) -> bool:
    return not status.endswith(" 0")


class PostgresGatewayStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._deciders: dict[tuple[str, float], Batcher[DecideRequest, Decision]] = {}
        self._completer: Batcher[tuple[Reservation, StoredResponse], bool] = Batcher(
            self._complete_many
        )

    @classmethod
    async def connect(
        cls, url: str, *, min_size: int = 2, max_size: int = 20, timeout: float = 10.0
    ) -> PostgresGatewayStore:
        pool = await asyncpg.create_pool(
            url,
            min_size=min_size,
            max_size=max_size,
            timeout=timeout,
            # Bare statements, no JIT: the decision must stay a sub-millisecond call.
            server_settings={"jit": "off", "application_name": "fencegate-gateway"},
            reset=_keep_session,
        )
        assert pool is not None
        return cls(pool)

    async def _run(self, fn: Callable[[asyncpg.Connection], Awaitable[T]], *, timeout: float) -> T:
        deadline = time.monotonic() + timeout
        try:
            conn = await self._pool.acquire(timeout=timeout)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + _left(deadline)):
                return await fn(conn)
        except BaseException as exc:
            # The connection is in an unknown state (a query may still run on a silent
            # network): close it at once rather than wait to reset it for the next caller.
            with contextlib.suppress(asyncpg.InterfaceError):  # already dropped by the pool
                conn.terminate()
            if isinstance(exc, TimeoutError):
                raise StoreUnavailable(f"no answer within {timeout}s") from exc
            if isinstance(exc, _UNAVAILABLE):
                raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            with contextlib.suppress(asyncpg.InterfaceError, *_UNAVAILABLE):
                await self._pool.release(conn, timeout=max(_left(deadline), 0.1))

    async def decide(self, request: DecideRequest, *, timeout: float) -> Decision:
        group = (request.owner, request.lease_seconds)
        batcher = self._deciders.get(group)
        if batcher is None:
            batcher = self._deciders[group] = Batcher(self._decide_many)
        return await batcher.submit(request, timeout=timeout)

    async def _decide_many(self, requests: list[DecideRequest], timeout: float) -> list[Decision]:
        first = requests[0]
        rows = await self._run(
            lambda conn: conn.fetch(
                _DECIDE_MANY,
                [r.tenant for r in requests],
                [r.key for r in requests],
                [r.fingerprint for r in requests],
                [r.entity for r in requests],
                [r.fence for r in requests],
                first.owner,
                float(first.lease_seconds),
                [float(r.ttl_seconds) for r in requests],
                [r.retry_unknown for r in requests],
            ),
            timeout=timeout,
        )
        decisions: list[Decision | None] = [None] * len(requests)
        for row in rows:
            decisions[row["d_index"] - 1] = _decision(row)
        if any(d is None for d in decisions):
            raise StoreUnavailable("the store answered a batch of decisions incompletely")
        return decisions  # type: ignore[return-value]

    async def complete(
        self,
        reservation: Reservation,
        response: StoredResponse,
        *,
        timeout: float,
    ) -> bool:
        return await self._completer.submit((reservation, response), timeout=timeout)

    async def _complete_many(
        self, items: list[tuple[Reservation, StoredResponse]], timeout: float
    ) -> list[bool]:
        rows = await self._run(
            lambda conn: conn.fetch(
                _COMPLETE_MANY,
                [r.tenant for r, _ in items],
                [r.key for r, _ in items],
                [r.owner for r, _ in items],
                [r.attempt for r, _ in items],
                [a.status for _, a in items],
                [orjson.dumps(a.headers).decode() for _, a in items],
                [a.body for _, a in items],
                [a.sha256 for _, a in items],
                [a.body is None for _, a in items],
            ),
            timeout=timeout,
        )
        done = {(row["tenant"], row["key"]) for row in rows}
        return [(r.tenant, r.key) in done for r, _ in items]

    async def _conditional(self, sql: str, r: Reservation, *extra: Any, timeout: float) -> bool:
        status = await self._run(
            lambda conn: conn.execute(sql, r.tenant, r.key, r.owner, r.attempt, *extra),
            timeout=timeout,
        )
        return _affected(status)

    async def release(self, reservation: Reservation, *, timeout: float) -> bool:
        return await self._conditional(_RELEASE, reservation, timeout=timeout)

    async def mark_unknown(self, reservation: Reservation, *, timeout: float) -> bool:
        return await self._conditional(_MARK_UNKNOWN, reservation, timeout=timeout)

    async def renew(
        self, reservation: Reservation, lease_seconds: float, *, timeout: float
    ) -> bool:
        return await self._conditional(_RENEW, reservation, float(lease_seconds), timeout=timeout)

    async def remember_nonce(
        self, key_id: str, nonce: str, ttl_seconds: float, *, timeout: float
    ) -> bool:
        row = await self._run(
            lambda conn: conn.fetchrow(_REMEMBER_NONCE, key_id, nonce, float(ttl_seconds)),
            timeout=timeout,
        )
        return row is not None

    async def purge(
        self,
        *,
        fence_ttl_seconds: float = DEFAULT_FENCE_TTL_SECONDS,
        batch_size: int = 1000,
        timeout: float,
    ) -> PurgeCounts:
        """Delete in batches so that no single statement holds many row locks for long;
        `timeout` bounds each batch."""
        keys = await self._purge_table(_PURGE_KEYS, batch_size, timeout=timeout)
        fences = await self._purge_table(
            _PURGE_FENCES, batch_size, float(fence_ttl_seconds), timeout=timeout
        )
        nonces = await self._purge_table(_PURGE_NONCES, batch_size, timeout=timeout)
        return PurgeCounts(keys=keys, fences=fences, nonces=nonces)

    async def _purge_table(self, sql: str, batch_size: int, *extra: Any, timeout: float) -> int:
        total = 0
        while True:
            status = await self._run(
                lambda conn: conn.execute(sql, batch_size, *extra), timeout=timeout
            )
            deleted = int(status.rsplit(" ", 1)[-1])
            total += deleted
            if deleted < batch_size:
                return total

    async def ping(self, *, timeout: float) -> None:
        await self._run(lambda conn: conn.fetchval("SELECT 1"), timeout=timeout)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._pool.close(), 5.0)
        except _UNAVAILABLE:
            self._pool.terminate()
