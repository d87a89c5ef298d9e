"""The gateway store on PostgreSQL (asyncpg pool).

Decisions and recorded answers that queue up while a round trip runs go together in the
next one: one call of the `fencegate_step` function (one round trip, one transaction).
Releasing, marking unknown and renewing are one conditional statement each. asyncpg
caches the prepared statements per connection. Every call is bounded by `timeout=` as a
whole (acquire, query and release), so a partitioned database costs a caller at most that
long.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any, Literal, TypeVar

import asyncpg
import orjson

from fencegate.store.base import (
    DEFAULT_FENCE_TTL_SECONDS,
    DecideRequest,
    Decision,
    KeyRecord,
    Outcome,
    PurgeCounts,
    Reservation,
    ResolveResult,
    StoredResponse,
    StoreUnavailable,
)
from fencegate.store.batching import Batcher

T = TypeVar("T")

# A decision to make, or an answer to record for a reservation.
_Step = DecideRequest | tuple[Reservation, StoredResponse]

_STEP = """
SELECT * FROM fencegate_step(
    $1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[],
    $7::double precision[], $8::double precision[], $9::boolean[],
    $10::text[], $11::text[], $12::text[], $13::integer[], $14::integer[], $15::text[],
    $16::bytea[], $17::text[], $18::boolean[])
"""

_RELEASE = """
DELETE FROM idempotency_keys
WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
"""

# locked_until keeps the moment the outcome became unknown (shown to the caller).
_MARK_UNKNOWN = """
UPDATE idempotency_keys SET state = 'outcome_unknown', locked_until = now()
WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
"""

_RENEW = """
UPDATE idempotency_keys SET locked_until = now() + make_interval(secs => $5)
WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
  AND locked_until > now()
"""

# An unknown outcome: marked so, or in flight with an expired lease.
_UNKNOWN_ROW = "(state = 'outcome_unknown' OR (state = 'in_flight' AND locked_until <= now()))"

_GET_KEY = (
    """
SELECT tenant, key, state::text AS state, owner, attempt, entity, fence, fingerprint,
    extract(epoch FROM locked_until) AS locked_until,
    extract(epoch FROM reserved_at) AS reserved_at,
    extract(epoch FROM created_at) AS created_at,
    extract(epoch FROM completed_at) AS completed_at,
    extract(epoch FROM expires_at) AS expires_at,
    response_status, extract(epoch FROM now()) AS now,
    """
    + _UNKNOWN_ROW
    + """ AS unknown
FROM idempotency_keys WHERE tenant = $1 AND key = $2
"""
)

_RESOLVE_COMPLETED = (
    """
UPDATE idempotency_keys SET state = 'completed', owner = $3, response_status = $4,
    response_headers = $5::jsonb, response_body = $6, response_sha256 = $7,
    body_too_large = false, completed_at = now(), locked_until = NULL
WHERE tenant = $1 AND key = $2 AND """
    + _UNKNOWN_ROW
)

_RESOLVE_RELEASED = (
    """
DELETE FROM idempotency_keys WHERE tenant = $1 AND key = $2 AND """
    + _UNKNOWN_ROW
)

_APPLIED_MIGRATIONS = "SELECT name FROM fencegate_migrations ORDER BY name"

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


def unavailable(exc: BaseException, timeout: float) -> StoreUnavailable:
    """Every failure at the store boundary means the same to the gateway: the store could not
    decide or record, so it fails closed (503). A driver's protocol error (asyncpg's
    ``InternalClientError``), a missing schema and a dropped database included."""
    if isinstance(exc, TimeoutError):
        return StoreUnavailable(f"no answer within {timeout}s")
    return StoreUnavailable(f"{type(exc).__name__}: {exc}")


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
        reserved_age=row["d_reserved_age"],
        key_state=row["d_key_state"],
        unknown_since=row["d_since"].timestamp() if row["d_since"] is not None else None,
        response=response,
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The store never changes session state (no SET, LISTEN or advisory lock), so a
    connection going back to the pool needs no reset query: that would be one more round
    trip for every statement."""


def _plain(value: Any) -> Any:
    """asyncpg answers extract() with Decimal; the record wants floats."""
    return float(value) if isinstance(value, Decimal) else value


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _affected(status: str) -> bool:
    return not status.endswith(" 0")


class PostgresGatewayStore:
    kind: Literal["postgresql", "sqlite"] = "postgresql"

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        # One round trip at a time: what arrives meanwhile waits for it and goes in the next,
        # so each commit (and its WAL flush) carries more requests. A second concurrent round
        # trip would mostly wait for the same flush, and costs its own commit.
        self._steps: Batcher[_Step, Decision | bool] = Batcher(self._step, max_in_flight=1)

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
        except Exception as exc:
            raise unavailable(exc, timeout) from exc
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + _left(deadline)):
                return await fn(conn)
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
                await self._pool.release(conn, timeout=max(_left(deadline), 0.1))

    async def decide(self, request: DecideRequest, *, timeout: float) -> Decision:
        result = await self._steps.submit(request, timeout=timeout)
        assert isinstance(result, Decision)
        return result

    async def complete(
        self,
        reservation: Reservation,
        response: StoredResponse,
        *,
        timeout: float,
    ) -> bool:
        result = await self._steps.submit((reservation, response), timeout=timeout)
        assert isinstance(result, bool)
        return result

    async def _step(self, items: list[_Step], timeout: float) -> list[Decision | bool]:
        """One round trip for every decision and recorded answer that queued up."""
        decides = [item for item in items if isinstance(item, DecideRequest)]
        records = [item for item in items if not isinstance(item, DecideRequest)]
        rows = await self._run(
            lambda conn: conn.fetch(
                _STEP,
                [r.tenant for r in decides],
                [r.key for r in decides],
                [r.fingerprint for r in decides],
                [r.entity for r in decides],
                [r.fence for r in decides],
                [r.owner for r in decides],
                [float(r.lease_seconds) for r in decides],
                [float(r.ttl_seconds) for r in decides],
                [r.retry_unknown for r in decides],
                [r.tenant for r, _ in records],
                [r.key for r, _ in records],
                [r.owner for r, _ in records],
                [r.attempt for r, _ in records],
                [a.status for _, a in records],
                [orjson.dumps(a.headers).decode() for _, a in records],
                [a.body for _, a in records],
                [a.sha256 for _, a in records],
                [a.body is None for _, a in records],
            ),
            timeout=timeout,
        )
        decisions: dict[int, Decision] = {}
        recorded: dict[int, bool] = {}
        for row in rows:
            index = row["d_index"]
            if index > 0:
                decisions[index - 1] = _decision(row)
            else:
                recorded[-index - 1] = row["d_outcome"] == "completed"
        if len(decisions) != len(decides) or len(recorded) != len(records):
            raise StoreUnavailable("the store answered a batch incompletely")
        results: list[Decision | bool] = []
        next_decide = next_record = 0
        for item in items:
            if isinstance(item, DecideRequest):
                results.append(decisions[next_decide])
                next_decide += 1
            else:
                results.append(recorded[next_record])
                next_record += 1
        return results

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

    async def applied_migrations(self, *, timeout: float) -> list[str] | None:
        async def read(conn: asyncpg.Connection) -> list[str] | None:
            if await conn.fetchval("SELECT to_regclass('fencegate_migrations')") is None:
                return None
            return [str(r["name"]) for r in await conn.fetch(_APPLIED_MIGRATIONS)]

        return await self._run(read, timeout=timeout)

    async def get_key(self, tenant: str, key: str, *, timeout: float) -> KeyRecord | None:
        row = await self._run(lambda conn: conn.fetchrow(_GET_KEY, tenant, key), timeout=timeout)
        if row is None:
            return None
        return KeyRecord(**{name: _plain(row[name]) for name in row.keys()})

    async def resolve_key(
        self,
        tenant: str,
        key: str,
        response: StoredResponse | None,
        *,
        resolved_by: str,
        timeout: float,
    ) -> ResolveResult:
        if response is None:
            status = await self._run(
                lambda conn: conn.execute(_RESOLVE_RELEASED, tenant, key), timeout=timeout
            )
            done = ResolveResult.RELEASED
        else:
            status = await self._run(
                lambda conn: conn.execute(
                    _RESOLVE_COMPLETED,
                    tenant,
                    key,
                    resolved_by,
                    response.status,
                    orjson.dumps(response.headers).decode(),
                    response.body,
                    response.sha256,
                ),
                timeout=timeout,
            )
            done = ResolveResult.COMPLETED
        if _affected(status):
            return done
        found = await self.get_key(tenant, key, timeout=timeout)
        return ResolveResult.NOT_FOUND if found is None else ResolveResult.NOT_UNKNOWN

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._pool.close(), 5.0)
        except Exception:
            self._pool.terminate()
