"""The lease queue on PostgreSQL through asyncpg.

Every operation is one statement (data-modifying CTEs), so it is one short transaction whose
time comparisons all use the database's ``now()``. Every call is bounded twice: asyncpg's own
``timeout=`` on the statement, and an outer ``asyncio.timeout`` over the whole call (waiting
for a pooled connection, opening one, the statement, the release). A connection whose call
did not finish cleanly is terminated, never handed back to the pool as healthy: after a
silent network partition its protocol state is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import asyncpg
import orjson

from fencegate.lease.drivers.base import JOB_COLUMNS, LEASE_COLUMNS
from fencegate.lease.errors import StoreUnavailable
from fencegate.lease.models import Attempt, Job, JobState, Lease, NewJob, StageRecord
from fencegate.migrations import migrate_postgres

T = TypeVar("T")

CHANNEL = "fencegate_jobs"

# Errors that mean "the database did not answer", as opposed to "it answered no".
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.InternalClientError,
)


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, _UNAVAILABLE):
        return True
    # InterfaceError covers "connection is closed" and similar; its DataError and
    # ClientConfigurationError subclasses are mistakes in the call, not an outage.
    return isinstance(exc, asyncpg.InterfaceError) and not isinstance(
        exc, (asyncpg.exceptions.DataError, asyncpg.exceptions.ClientConfigurationError)
    )


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=_dumps, decoder=orjson.loads, schema="pg_catalog", format="text"
    )


async def _no_reset(conn: asyncpg.Connection) -> None:
    # The queue keeps no session state (no LISTEN, locks or settings on pooled connections),
    # so the default reset round trip on every release buys nothing.
    return None


# Rows that still belong to the presenter of a lease: $1 id, $2 owner, $3 token.
_HELD = """id = $1 AND state = 'running' AND owner_id = $2 AND fencing_token = $3
    AND lease_until > now()"""

ENQUEUE = """
WITH input AS (
    SELECT *
      FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::float8[], $6::float8[],
                  $7::float8[], $8::float8[], $9::float8[], $10::float8[]) WITH ORDINALITY
           AS t(kind, payload, idempotency_key, max_attempts, lease_seconds, heartbeat_seconds,
                jitter_seconds, stage_timeout_seconds, tool_timeout_seconds, run_after_seconds,
                ord)
),
inserted AS (
    INSERT INTO fencegate_jobs (kind, payload, idempotency_key, max_attempts, lease_seconds,
                                heartbeat_seconds, jitter_seconds, stage_timeout_seconds,
                                tool_timeout_seconds, run_after)
    SELECT kind, COALESCE(payload::jsonb, 'null'::jsonb), idempotency_key, max_attempts,
           lease_seconds, heartbeat_seconds,
           jitter_seconds, stage_timeout_seconds, tool_timeout_seconds,
           now() + make_interval(secs => run_after_seconds)
      FROM input
     ORDER BY ord
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id, idempotency_key
)
SELECT i.ord, COALESCE(n.id, j.id) AS id
  FROM input AS i
  LEFT JOIN inserted AS n ON n.idempotency_key = i.idempotency_key
  LEFT JOIN fencegate_jobs AS j ON j.idempotency_key = i.idempotency_key
 ORDER BY i.ord
"""

# One statement: fail the expired jobs that have no attempt left, grant leases on ready or
# expired jobs (tokens from the one sequence), close the expired attempts and open new ones.
# {kinds} is replaced by a filter on $2 or by nothing.
_CLAIM_TEMPLATE = """
WITH exhausted AS (
    UPDATE fencegate_jobs AS j
       SET state = 'failed', lease_until = NULL, updated_at = now(),
           error = to_jsonb(format('lease expired on attempt %s of %s', j.attempt,
                                   j.max_attempts))
     WHERE j.id IN (SELECT id FROM fencegate_jobs
                     WHERE state = 'running' AND lease_until < now()
                       AND attempt >= max_attempts {kinds}
                       FOR UPDATE SKIP LOCKED)
    RETURNING j.fencing_token, j.error
),
-- Expired leases first (they have waited longest), then queued work in id order, each from
-- its own partial index; the queued scan only looks for (and locks) what is still missing.
expired AS (
    SELECT id, fencing_token AS previous_token,
           to_jsonb(format('lease expired on attempt %s of %s', attempt, max_attempts))
               AS expiry_error
      FROM fencegate_jobs
     WHERE state = 'running' AND lease_until < now() AND attempt < max_attempts {kinds}
     ORDER BY lease_until
     LIMIT $3
       FOR UPDATE SKIP LOCKED
),
queued AS (
    SELECT id, fencing_token AS previous_token, NULL::jsonb AS expiry_error
      FROM fencegate_jobs
     WHERE state = 'queued' AND run_after <= now() {kinds}
     ORDER BY id
     LIMIT $3 - (SELECT count(*) FROM expired)
       FOR UPDATE SKIP LOCKED
),
candidates AS (
    SELECT * FROM expired UNION ALL SELECT * FROM queued
),
granted AS (
    UPDATE fencegate_jobs AS j
       SET state = 'running', owner_id = $1,
           fencing_token = nextval('fencegate_fencing_tokens'),
           lease_until = now() + make_interval(secs => j.lease_seconds),
           heartbeat_at = now(), attempt = j.attempt + 1, updated_at = now(),
           error = COALESCE(c.expiry_error, j.error)
      FROM candidates AS c
     WHERE j.id = c.id
    RETURNING j.*, c.previous_token, c.expiry_error
),
expired_attempts AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'lease_expired', error = e.error
      FROM (SELECT fencing_token, error FROM exhausted
            UNION ALL
            SELECT previous_token, expiry_error FROM granted
             WHERE expiry_error IS NOT NULL) AS e
     WHERE a.fencing_token = e.fencing_token AND a.ended_at IS NULL
),
opened AS (
    INSERT INTO fencegate_job_attempts (fencing_token, job_id, attempt, owner_id, claimed_at)
    SELECT fencing_token, id, attempt, owner_id, now() FROM granted
)
SELECT {lease_columns} FROM granted ORDER BY id
"""
# One kind (the common case) walks the (kind, id) index in order; several kinds or any kind
# walk the (id) index and filter.
CLAIM_ONE_KIND = _CLAIM_TEMPLATE.format(kinds="AND kind = $2::text", lease_columns=LEASE_COLUMNS)
CLAIM_KINDS = _CLAIM_TEMPLATE.format(
    kinds="AND kind = ANY($2::text[])", lease_columns=LEASE_COLUMNS
)
CLAIM_ANY = _CLAIM_TEMPLATE.format(kinds="AND $2::text[] IS NULL", lease_columns=LEASE_COLUMNS)

EXTEND = f"""
UPDATE fencegate_jobs
   SET lease_until = now() + make_interval(secs => lease_seconds), heartbeat_at = now(),
       updated_at = now()
 WHERE {_HELD}
RETURNING lease_until
"""

EXTEND_MANY = """
UPDATE fencegate_jobs AS j
   SET lease_until = now() + make_interval(secs => j.lease_seconds), heartbeat_at = now(),
       updated_at = now()
  FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS i(id, owner_id, fencing_token)
 WHERE j.id = ANY($1::bigint[]) AND j.id = i.id AND j.state = 'running'
   AND j.owner_id = i.owner_id AND j.fencing_token = i.fencing_token AND j.lease_until > now()
RETURNING j.id, j.fencing_token, j.lease_until
"""

COMPLETE_MANY = """
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[])
           AS t(id, owner_id, fencing_token, result)
),
done AS (
    UPDATE fencegate_jobs AS j
       SET state = 'succeeded', result = i.result::jsonb, error = NULL, lease_until = NULL,
           updated_at = now()
      FROM input AS i
     WHERE j.id = ANY($1::bigint[]) AND j.id = i.id AND j.state = 'running'
       AND j.owner_id = i.owner_id AND j.fencing_token = i.fencing_token
       AND j.lease_until > now()
    RETURNING j.id, j.fencing_token
),
ended AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'succeeded'
      FROM done
     WHERE a.fencing_token = ANY($3::bigint[]) AND a.fencing_token = done.fencing_token
)
SELECT id FROM done
"""

FAIL = f"""
WITH ended AS (
    UPDATE fencegate_jobs
       SET state = CASE WHEN $5::float8 IS NULL OR attempt >= max_attempts
                        THEN 'failed' ELSE 'queued' END,
           run_after = CASE WHEN $5::float8 IS NULL OR attempt >= max_attempts
                            THEN run_after ELSE now() + make_interval(secs => $5::float8) END,
           owner_id = CASE WHEN $5::float8 IS NULL OR attempt >= max_attempts
                           THEN owner_id END,
           error = $4::jsonb, lease_until = NULL, updated_at = now()
     WHERE {_HELD}
    RETURNING fencing_token, state
),
closed AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), error = $4::jsonb,
           outcome = CASE WHEN e.state = 'failed' THEN 'failed' ELSE 'retry_scheduled' END
      FROM ended AS e
     WHERE a.fencing_token = $3 AND a.fencing_token = e.fencing_token
)
SELECT state FROM ended
"""

# `FAIL` for many leases: each row is still matched on its own id, owner, token and live
# lease; a NULL retry_in fails that job for good.
FAIL_MANY = """
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::float8[])
           AS t(id, owner_id, fencing_token, error, retry_in)
),
ended AS (
    UPDATE fencegate_jobs AS j
       SET state = CASE WHEN i.retry_in IS NULL OR j.attempt >= j.max_attempts
                        THEN 'failed' ELSE 'queued' END,
           run_after = CASE WHEN i.retry_in IS NULL OR j.attempt >= j.max_attempts
                            THEN j.run_after ELSE now() + make_interval(secs => i.retry_in) END,
           owner_id = CASE WHEN i.retry_in IS NULL OR j.attempt >= j.max_attempts
                           THEN j.owner_id END,
           error = i.error::jsonb, lease_until = NULL, updated_at = now()
      FROM input AS i
     WHERE j.id = ANY($1::bigint[]) AND j.id = i.id AND j.state = 'running'
       AND j.owner_id = i.owner_id AND j.fencing_token = i.fencing_token
       AND j.lease_until > now()
    RETURNING j.id, j.fencing_token, j.state, i.error
),
closed AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), error = e.error::jsonb,
           outcome = CASE WHEN e.state = 'failed' THEN 'failed' ELSE 'retry_scheduled' END
      FROM ended AS e
     WHERE a.fencing_token = ANY($3::bigint[]) AND a.fencing_token = e.fencing_token
)
SELECT id, fencing_token, state FROM ended
"""

# Released work is not a failure: the attempt is given back so it does not count.
RELEASE = f"""
WITH released AS (
    UPDATE fencegate_jobs
       SET state = 'queued', owner_id = NULL, lease_until = NULL, attempt = attempt - 1,
           run_after = now(), updated_at = now()
     WHERE {_HELD}
    RETURNING fencing_token
),
closed AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'released'
      FROM released AS r
     WHERE a.fencing_token = $3 AND a.fencing_token = r.fencing_token
)
SELECT count(*) FROM released
"""

CANCEL = """
WITH target AS (
    SELECT id, state, fencing_token FROM fencegate_jobs WHERE id = $1 FOR UPDATE
),
cancelled AS (
    UPDATE fencegate_jobs AS j
       SET state = 'cancelled', lease_until = NULL, error = $2::jsonb, updated_at = now()
      FROM target AS t
     WHERE j.id = t.id AND t.state IN ('queued', 'running')
    RETURNING t.state AS previous_state, t.fencing_token
),
closed AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'cancelled', error = $2::jsonb
      FROM cancelled AS c
     WHERE c.previous_state = 'running'
       AND a.fencing_token = (SELECT fencing_token FROM target)
       AND a.fencing_token = c.fencing_token AND a.ended_at IS NULL
)
SELECT (SELECT count(*) FROM target) AS found, (SELECT count(*) FROM cancelled) AS cancelled
"""

GET = f"SELECT {JOB_COLUMNS} FROM fencegate_jobs WHERE id = $1"

LIST_JOBS = f"""
SELECT {JOB_COLUMNS} FROM fencegate_jobs
 WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR kind = $2)
 ORDER BY id DESC
 LIMIT $3
"""

ATTEMPTS = """
SELECT job_id, attempt, fencing_token, owner_id, claimed_at, ended_at, outcome, error
  FROM fencegate_job_attempts WHERE job_id = $1 ORDER BY fencing_token
"""

STAGE_RESULT = """
SELECT job_id, name, idempotency_key, result, fencing_token, committed_at
  FROM fencegate_job_stages WHERE job_id = $1 AND name = $2
"""

# FOR SHARE holds the job row while the stage is written, so a concurrent reclaim cannot
# slip in between the ownership check and the insert.
COMMIT_STAGE = f"""
WITH holder AS (
    SELECT id, fencing_token FROM fencegate_jobs WHERE {_HELD} FOR SHARE
),
inserted AS (
    INSERT INTO fencegate_job_stages (job_id, name, idempotency_key, result, fencing_token)
    SELECT id, $4, $5, $6::jsonb, fencing_token FROM holder
    ON CONFLICT (job_id, name) DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM inserted)
    OR EXISTS (SELECT 1 FROM holder AS h JOIN fencegate_job_stages AS s
                 ON s.job_id = h.id AND s.name = $4 AND s.fencing_token = h.fencing_token)
"""

# `COMMIT_STAGE` for many stages (of one or several jobs). Each job row is held FOR SHARE
# once, whatever number of its stages the batch carries.
COMMIT_STAGE_MANY = """
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::text[],
                         $6::text[]) WITH ORDINALITY
           AS t(id, owner_id, fencing_token, name, idempotency_key, result, ord)
),
holder AS (
    SELECT j.id, j.fencing_token FROM fencegate_jobs AS j
     WHERE j.id = ANY($1::bigint[]) AND j.state = 'running' AND j.lease_until > now()
       AND EXISTS (SELECT 1 FROM input AS i WHERE i.id = j.id AND i.owner_id = j.owner_id
                                              AND i.fencing_token = j.fencing_token)
       FOR SHARE
),
inserted AS (
    INSERT INTO fencegate_job_stages (job_id, name, idempotency_key, result, fencing_token)
    SELECT i.id, i.name, i.idempotency_key, i.result::jsonb, h.fencing_token
      FROM input AS i JOIN holder AS h ON h.id = i.id AND h.fencing_token = i.fencing_token
    ON CONFLICT (job_id, name) DO NOTHING
    RETURNING job_id, name
)
SELECT i.ord,
       EXISTS (SELECT 1 FROM inserted AS n WHERE n.job_id = i.id AND n.name = i.name)
    OR EXISTS (SELECT 1 FROM holder AS h JOIN fencegate_job_stages AS s
                 ON s.job_id = h.id AND s.name = i.name AND s.fencing_token = h.fencing_token
                WHERE h.id = i.id AND h.fencing_token = i.fencing_token) AS committed
  FROM input AS i
 ORDER BY i.ord
"""


def _lease(row: asyncpg.Record) -> Lease:
    return Lease(
        job_id=row["id"],
        kind=row["kind"],
        owner_id=row["owner_id"],
        fencing_token=row["fencing_token"],
        lease_until=row["lease_until"],
        lease_seconds=row["lease_seconds"],
        heartbeat_seconds=row["heartbeat_seconds"],
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        payload=row["payload"],
        idempotency_key=row["idempotency_key"],
        stage_timeout_seconds=row["stage_timeout_seconds"],
        tool_timeout_seconds=row["tool_timeout_seconds"],
    )


def _job(row: asyncpg.Record) -> Job:
    return Job(**dict(row.items()))


def _attempt(row: asyncpg.Record) -> Attempt:
    return Attempt(**dict(row.items()))


def _stage(row: asyncpg.Record) -> StageRecord:
    return StageRecord(**dict(row.items()))


class _Notifications:
    """LISTEN on a dedicated connection; wakes waiters whose kinds were notified.

    A sequence number per kind lets `wait_for_work` return at once when a notification came
    in after the last claim of those kinds, so a wake-up between "claim found nothing" and
    "wait" is not lost.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: asyncpg.Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._sequence = 0
        self._kind_sequence: dict[str, int] = {}
        self._seen: dict[frozenset[str] | None, int] = {}
        self._waiters: set[tuple[frozenset[str] | None, asyncio.Event]] = set()
        self._last_heard = 0.0
        self._probe: asyncio.Task[None] | None = None

    def mark_claimed(self, kinds: Sequence[str] | None) -> None:
        self._seen[_key(kinds)] = self._sequence

    def _notified_since_seen(self, kinds: Sequence[str] | None) -> bool:
        key = _key(kinds)
        seen = self._seen.get(key, 0)
        if key is None:
            return self._sequence > seen
        return any(self._kind_sequence.get(kind, 0) > seen for kind in key)

    def _on_notify(self, conn: object, pid: int, channel: str, payload: str) -> None:
        self._sequence += 1
        self._kind_sequence[payload] = self._sequence
        self._last_heard = time.monotonic()
        for kinds, event in self._waiters:
            if kinds is None or payload in kinds:
                event.set()

    def _on_terminate(self, conn: object) -> None:
        self._conn = None

    async def _ensure_connected(self, timeout: float) -> bool:
        """True when a new listener was set up (notifications may have been missed)."""
        if self._conn is not None and not self._conn.is_closed():
            return False
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is not None and not self._conn.is_closed():
                return False
            conn = await asyncpg.connect(self._url, timeout=timeout)
            try:
                await conn.add_listener(CHANNEL, self._on_notify)
            except BaseException:
                conn.terminate()
                raise
            conn.add_termination_listener(self._on_terminate)
            self._conn = conn
            self._last_heard = time.monotonic()
            return True

    async def wait(self, kinds: Sequence[str] | None, *, timeout: float) -> bool:
        key = _key(kinds)
        event = asyncio.Event()
        waiter = (key, event)
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                if await self._ensure_connected(timeout) or self._notified_since_seen(kinds):
                    self._seen[key] = self._sequence
                    return True
                self._waiters.add(waiter)
                await event.wait()
                self._seen[key] = self._sequence
                return True
        except TimeoutError:
            self._probe_quietly()
            return False
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            # No listener (the server refused at once): wait out the timeout all the same, so
            # that a caller looping on wait-then-claim does not spin while the store is down.
            await asyncio.sleep(max(deadline - time.monotonic(), 0))
            return False
        finally:
            self._waiters.discard(waiter)

    def _probe_quietly(self) -> None:
        """After a quiet wait, check the listener still answers; a silent partition would
        otherwise leave it looking alive forever. A dead listener is replaced next time."""
        conn = self._conn
        if conn is None or (self._probe is not None and not self._probe.done()):
            return
        if time.monotonic() - self._last_heard < 5.0:
            return

        async def probe() -> None:
            try:
                await conn.fetchval("SELECT 1", timeout=5.0)
                self._last_heard = time.monotonic()
            except BaseException:
                conn.terminate()
                if self._conn is conn:
                    self._conn = None

        self._probe = asyncio.get_running_loop().create_task(probe())

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(BaseException):
                await self._probe
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await asyncio.wait_for(conn.close(), 2.0)
            except BaseException:
                conn.terminate()


def _key(kinds: Sequence[str] | None) -> frozenset[str] | None:
    return None if kinds is None else frozenset(kinds)


class PostgresDriver:
    def __init__(self, url: str, pool: asyncpg.Pool) -> None:
        self._url = url
        self._pool = pool
        self._notifications = _Notifications(url)
        # Statements sent, so that batching can be observed (tests, benchmarks).
        self.round_trips = 0

    @classmethod
    async def connect(
        cls, url: str, *, timeout: float, min_size: int = 1, max_size: int = 10
    ) -> PostgresDriver:
        try:
            async with asyncio.timeout(timeout):
                pool = await asyncpg.create_pool(
                    url,
                    min_size=min_size,
                    max_size=max_size,
                    init=_init_connection,
                    reset=_no_reset,
                    timeout=timeout,
                    # No connection is kept for ever: one that has lived through an
                    # unnoticed partition is replaced within minutes even when idle.
                    max_inactive_connection_lifetime=60.0,
                )
        except BaseException as exc:
            if _is_unavailable(exc):
                raise StoreUnavailable(f"PostgreSQL did not answer: {exc!r}") from exc
            raise
        return cls(url, pool)

    async def close(self) -> None:
        await self._notifications.close()
        try:
            await asyncio.wait_for(self._pool.close(), 5.0)
        except BaseException:
            self._pool.terminate()

    async def _run(
        self, call: Callable[[asyncpg.Connection, float], Awaitable[T]], *, timeout: float
    ) -> T:
        deadline = time.monotonic() + timeout
        self.round_trips += 1
        try:
            async with asyncio.timeout(timeout):
                # The outer timeout bounds the wait for a connection (and its opening);
                # acquire(timeout=) would bound it again at the price of a task per call.
                conn = await self._pool.acquire()
                healthy = False
                try:
                    result = await call(conn, max(deadline - time.monotonic(), 0.001))
                    healthy = True
                except asyncpg.PostgresError as exc:
                    healthy = not _is_unavailable(exc)
                    raise
                finally:
                    if not healthy:
                        conn.terminate()
                    await self._pool.release(conn, timeout=max(deadline - time.monotonic(), 0.1))
                return result
        except BaseException as exc:
            if _is_unavailable(exc):
                raise StoreUnavailable(
                    f"PostgreSQL did not answer within {timeout:g}s: {type(exc).__name__}"
                ) from exc
            raise

    async def migrate(self, *, timeout: float) -> list[str]:
        return await self._run(lambda conn, _t: migrate_postgres(conn), timeout=timeout)

    async def now(self, *, timeout: float) -> datetime:
        value = await self._run(
            lambda conn, t: conn.fetchval("SELECT clock_timestamp()", timeout=t), timeout=timeout
        )
        assert isinstance(value, datetime)
        return value

    async def enqueue(self, jobs: Sequence[NewJob], *, timeout: float) -> list[int]:
        args = (
            [j.kind for j in jobs],
            [_dumps(j.payload) for j in jobs],
            [j.idempotency_key for j in jobs],
            [j.max_attempts for j in jobs],
            [j.lease_seconds for j in jobs],
            [j.heartbeat_seconds for j in jobs],
            [j.jitter_seconds for j in jobs],
            [j.stage_timeout_seconds for j in jobs],
            [j.tool_timeout_seconds for j in jobs],
            [j.run_after_seconds for j in jobs],
        )

        async def call(conn: asyncpg.Connection, t: float) -> list[int]:
            # A key inserted by a transaction that committed after this statement's snapshot
            # is neither inserted nor visible here; the next run sees it.
            for _ in range(5):
                rows = await conn.fetch(ENQUEUE, *args, timeout=t)
                ids = [row["id"] for row in rows]
                if all(i is not None for i in ids):
                    return ids
            raise StoreUnavailable("enqueue raced with concurrent inserts of the same keys")

        return await self._run(call, timeout=timeout)

    async def claim(
        self, owner_id: str, kinds: Sequence[str] | None, limit: int, *, timeout: float
    ) -> list[Lease]:
        self._notifications.mark_claimed(kinds)
        query: str
        kind_arg: str | list[str] | None
        if kinds is None:
            query, kind_arg = CLAIM_ANY, None
        elif len(kinds) == 1:
            query, kind_arg = CLAIM_ONE_KIND, kinds[0]
        else:
            query, kind_arg = CLAIM_KINDS, list(kinds)
        rows = await self._run(
            lambda conn, t: conn.fetch(query, owner_id, kind_arg, limit, timeout=t),
            timeout=timeout,
        )
        return [_lease(row) for row in rows]

    async def extend(self, lease: Lease, *, timeout: float) -> datetime | None:
        value = await self._run(
            lambda conn, t: conn.fetchval(
                EXTEND, lease.job_id, lease.owner_id, lease.fencing_token, timeout=t
            ),
            timeout=timeout,
        )
        assert value is None or isinstance(value, datetime)
        return value

    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float
    ) -> list[datetime | None]:
        rows = await self._run(
            lambda conn, t: conn.fetch(
                EXTEND_MANY,
                [lease.job_id for lease in leases],
                [lease.owner_id for lease in leases],
                [lease.fencing_token for lease in leases],
                timeout=t,
            ),
            timeout=timeout,
        )
        renewed = {(row["id"], row["fencing_token"]): row["lease_until"] for row in rows}
        return [renewed.get((lease.job_id, lease.fencing_token)) for lease in leases]

    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float
    ) -> list[bool]:
        rows = await self._run(
            lambda conn, t: conn.fetch(
                COMPLETE_MANY,
                [lease.job_id for lease, _ in items],
                [lease.owner_id for lease, _ in items],
                [lease.fencing_token for lease, _ in items],
                # JSON text, not jsonb[]: asyncpg would read a list result as a nested array.
                [_dumps(result) for _, result in items],
                timeout=t,
            ),
            timeout=timeout,
        )
        done = {row["id"] for row in rows}
        return [lease.job_id in done for lease, _ in items]

    async def fail(
        self, lease: Lease, error: Any, *, retry_in: float | None, timeout: float
    ) -> JobState | None:
        state = await self._run(
            lambda conn, t: conn.fetchval(
                FAIL,
                lease.job_id,
                lease.owner_id,
                lease.fencing_token,
                error,
                retry_in,
                timeout=t,
            ),
            timeout=timeout,
        )
        return state

    async def fail_many(
        self, items: Sequence[tuple[Lease, Any, float | None]], *, timeout: float
    ) -> list[JobState | None]:
        rows = await self._run(
            lambda conn, t: conn.fetch(
                FAIL_MANY,
                [lease.job_id for lease, _, _ in items],
                [lease.owner_id for lease, _, _ in items],
                [lease.fencing_token for lease, _, _ in items],
                [_dumps(error) for _, error, _ in items],
                [retry_in for _, _, retry_in in items],
                timeout=t,
            ),
            timeout=timeout,
        )
        states = {(row["id"], row["fencing_token"]): row["state"] for row in rows}
        return [states.get((lease.job_id, lease.fencing_token)) for lease, _, _ in items]

    async def release(self, lease: Lease, *, timeout: float) -> bool:
        count = await self._run(
            lambda conn, t: conn.fetchval(
                RELEASE, lease.job_id, lease.owner_id, lease.fencing_token, timeout=t
            ),
            timeout=timeout,
        )
        return bool(count)

    async def cancel(self, job_id: int, reason: Any, *, timeout: float) -> bool | None:
        row = await self._run(
            lambda conn, t: conn.fetchrow(CANCEL, job_id, reason, timeout=t), timeout=timeout
        )
        assert row is not None
        if not row["found"]:
            return None
        return bool(row["cancelled"])

    async def get(self, job_id: int, *, timeout: float) -> Job | None:
        row = await self._run(
            lambda conn, t: conn.fetchrow(GET, job_id, timeout=t), timeout=timeout
        )
        return None if row is None else _job(row)

    async def list_jobs(
        self, *, state: JobState | None, kind: str | None, limit: int, timeout: float
    ) -> list[Job]:
        rows = await self._run(
            lambda conn, t: conn.fetch(LIST_JOBS, state, kind, limit, timeout=t),
            timeout=timeout,
        )
        return [_job(row) for row in rows]

    async def attempts(self, job_id: int, *, timeout: float) -> list[Attempt]:
        rows = await self._run(
            lambda conn, t: conn.fetch(ATTEMPTS, job_id, timeout=t), timeout=timeout
        )
        return [_attempt(row) for row in rows]

    async def stage_result(self, job_id: int, name: str, *, timeout: float) -> StageRecord | None:
        row = await self._run(
            lambda conn, t: conn.fetchrow(STAGE_RESULT, job_id, name, timeout=t),
            timeout=timeout,
        )
        return None if row is None else _stage(row)

    async def commit_stage(
        self, lease: Lease, name: str, idempotency_key: str, result: Any, *, timeout: float
    ) -> bool:
        value = await self._run(
            lambda conn, t: conn.fetchval(
                COMMIT_STAGE,
                lease.job_id,
                lease.owner_id,
                lease.fencing_token,
                name,
                idempotency_key,
                result,
                timeout=t,
            ),
            timeout=timeout,
        )
        return bool(value)

    async def commit_stage_many(
        self, items: Sequence[tuple[Lease, str, str, Any]], *, timeout: float
    ) -> list[bool]:
        rows = await self._run(
            lambda conn, t: conn.fetch(
                COMMIT_STAGE_MANY,
                [lease.job_id for lease, _, _, _ in items],
                [lease.owner_id for lease, _, _, _ in items],
                [lease.fencing_token for lease, _, _, _ in items],
                [name for _, name, _, _ in items],
                [key for _, _, key, _ in items],
                [_dumps(result) for _, _, _, result in items],
                timeout=t,
            ),
            timeout=timeout,
        )
        return [bool(row["committed"]) for row in rows]

    async def wait_for_work(self, kinds: Sequence[str] | None, *, timeout: float) -> bool:
        return await self._notifications.wait(kinds, timeout=timeout)
