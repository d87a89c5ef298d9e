"""The lease queue on PostgreSQL through asyncpg.

Every operation is one statement (data-modifying CTEs, in ``sql/postgres/queries/lease.sql``),
so it is one short transaction whose time comparisons all use the database's ``now()``.
Connections, the bound on each call and the error rule are `PgDatabase`'s: whatever fails is
`StoreUnavailable`, which to a worker means its ownership is unknown.
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

from fencegate.errors import StoreUnavailable
from fencegate.lease.drivers.base import Decoding, Driver, Row, lease_from, split_by_slots
from fencegate.lease.models import JobState, Lease, NewJob, Scheduling
from fencegate.store.audit import JobAudit
from fencegate.store.migrations import migrate_postgres
from fencegate.store.pg import PgDatabase
from fencegate.store.queries import Queries

T = TypeVar("T")

CHANNEL = "fencegate_jobs"

Q = Queries("postgresql")


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=_dumps, decoder=orjson.loads, schema="pg_catalog", format="text"
    )


def _same(value: Any) -> Any:
    return value


# asyncpg already gives aware datetimes, and JSON decoded by the codec set on each connection.
DECODING = Decoding(time=_same, json=_same)


class _Notifications:
    """LISTEN on a dedicated connection; wakes waiters whose kinds were notified.

    A sequence number per kind lets `wait_for_work` return at once when a notification came
    in after the last claim of those kinds, so a wake-up between "claim found nothing" and
    "wait" is not lost.
    """

    def __init__(self, db: PgDatabase) -> None:
        self._db = db
        self._conn: asyncpg.Connection | None = None
        # The listener being set up, shared by every waiter meanwhile.
        self._connecting: asyncio.Task[asyncpg.Connection] | None = None
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
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect(timeout))
            self._connecting.add_done_callback(_retrieved)
        # Shielded: a worker cancels its wait whenever a slot frees, often before a new
        # connection is up; the set-up goes on for the next waiter instead of being dropped
        # half-way (a server process started for nothing, every time).
        await asyncio.shield(self._connecting)
        return True

    async def _connect(self, timeout: float) -> asyncpg.Connection:
        conn = await self._db.listen(
            CHANNEL, self._on_notify, on_terminate=self._on_terminate, timeout=timeout
        )
        self._conn = conn
        self._last_heard = time.monotonic()
        return conn

    async def wait(self, kinds: Sequence[str] | None, *, timeout: float) -> bool:
        if self._db.transaction_pooling:
            # No LISTEN through a transaction pooler: the worker's claims poll instead.
            await asyncio.sleep(timeout)
            return False
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
        except StoreUnavailable:
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
                await conn.fetchval(Q.lease_ping, timeout=5.0)
                self._last_heard = time.monotonic()
            except BaseException:
                conn.terminate()
                if self._conn is conn:
                    self._conn = None

        self._probe = asyncio.get_running_loop().create_task(probe())

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
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


def _retrieved(task: asyncio.Task[Any]) -> None:
    # Its failure is each waiter's to see; with none left, it is not an unhandled error.
    if not task.cancelled():
        task.exception()


def _key(kinds: Sequence[str] | None) -> frozenset[str] | None:
    return None if kinds is None else frozenset(kinds)


def _audited(
    sql: str, args: tuple[Any, ...], job_id: int, done: str, audit: JobAudit | None
) -> Callable[[asyncpg.Connection], Awaitable[Any]]:
    """An operator's action on one job (its row: ``found`` and the column ``done``), and
    with ``audit`` its audit row in the same transaction, from the job as it was (read
    under its row lock) and as the action left it."""
    if audit is None:
        return lambda conn: conn.fetchrow(sql, *args)

    async def run(conn: asyncpg.Connection) -> Any:
        async with conn.transaction():
            before = await conn.fetchrow(Q.lease_job_summary_for_update, job_id)
            row = await conn.fetchrow(sql, *args)
            if before is not None and row is not None and row[done]:
                after = await conn.fetchrow(Q.lease_job_summary, job_id)
                assert after is not None  # the row is locked: it cannot have gone
                entry = audit(dict(before.items()), dict(after.items()))
                await conn.execute(Q.lease_audit, *entry.arguments())
            return row

    return run


class PostgresDriver(Driver):
    queries = Q
    decoding = DECODING

    _db: PgDatabase

    def __init__(self, db: PgDatabase) -> None:
        super().__init__(db)
        self._notifications = _Notifications(db)

    async def close(self) -> None:
        await self._notifications.close()
        await self._db.close()

    async def _run(
        self,
        fn: Callable[[asyncpg.Connection], Awaitable[T]],
        *,
        timeout: float,
        held: bool = False,
    ) -> T:
        self.round_trips += 1
        if held:
            return await self._db.run_held(fn, timeout=timeout)
        return await self._db.run(fn, timeout=timeout)

    async def _fetch(self, sql: str, args: Sequence[Any], *, timeout: float) -> list[Row]:
        rows = await self._run(lambda conn: conn.fetch(sql, *args), timeout=timeout)
        return list(rows)

    async def migrate(self, *, timeout: float) -> list[str]:
        schema = None if self._db.target is None else self._db.target.schema
        return await self._run(lambda conn: migrate_postgres(conn, schema=schema), timeout=timeout)

    async def now(self, *, timeout: float) -> datetime:
        value = await self._run(lambda conn: conn.fetchval(Q.lease_now), timeout=timeout)
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
            [j.priority for j in jobs],
            [j.concurrency_key for j in jobs],
            [j.model for j in jobs],
        )

        async def call(conn: asyncpg.Connection) -> list[int]:
            # A key inserted by a transaction that committed after this statement's snapshot
            # is neither inserted nor visible here; the next run sees it.
            for _ in range(5):
                rows = await conn.fetch(Q.lease_enqueue, *args)
                ids = [row["id"] for row in rows]
                if all(i is not None for i in ids):
                    return ids
            raise StoreUnavailable("enqueue raced with concurrent inserts of the same keys")

        return await self._run(call, timeout=timeout)

    async def declare(self, scheduling: Scheduling, *, timeout: float) -> None:
        classes, rates = scheduling.classes, scheduling.rates

        async def call(conn: asyncpg.Connection) -> None:
            async with conn.transaction():
                await conn.execute(
                    Q.lease_declare_work_classes,
                    [c.kind for c in classes],
                    [c.max_running for c in classes],
                    [c.max_running_per_key for c in classes],
                    [c.provider for c in classes],
                )
                await conn.execute(
                    Q.lease_declare_rate_limits,
                    [r.provider for r in rates],
                    [float(r.limit) for r in rates],
                    [r.per_seconds for r in rates],
                )

        await self._run(call, timeout=timeout)

    async def claim(
        self,
        wanted: Sequence[tuple[str, int]],
        kinds: Sequence[str] | None,
        *,
        locks: Sequence[str],
        timeout: float,
    ) -> list[list[Lease]]:
        self._notifications.mark_claimed(kinds)
        query: str
        kind_arg: str | list[str] | None
        if kinds is None:
            query, kind_arg = Q.lease_claim_any, None
        elif len(kinds) == 1:
            query, kind_arg = Q.lease_claim_one_kind, kinds[0]
        else:
            query, kind_arg = Q.lease_claim_kinds, list(kinds)
        # One slot per lease wanted, each named by its owner: the statement hands the n-th
        # job it grants (in id order, as it returns them) to the n-th slot.
        slots = [owner for owner, limit in wanted for _ in range(limit)]

        async def taking_turns(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            # The claim's own statement must start after the locks are held, so that its
            # snapshot counts what the claims before it committed.
            async with conn.transaction():
                await conn.execute(Q.lease_claim_lock, list(locks))
                return list(await conn.fetch(query, slots, kind_arg, len(slots)))

        if locks:
            rows = await self._run(taking_turns, timeout=timeout)
        else:
            rows = await self._run(
                lambda conn: conn.fetch(query, slots, kind_arg, len(slots)), timeout=timeout
            )
        return split_by_slots([lease_from(row, DECODING) for row in rows], wanted)

    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float
    ) -> list[datetime | None]:
        rows = await self._run(
            lambda conn: conn.fetch(
                Q.lease_extend_many,
                [lease.job_id for lease in leases],
                [lease.owner_id for lease in leases],
                [lease.fencing_token for lease in leases],
            ),
            timeout=timeout,
        )
        renewed = {(row["id"], row["fencing_token"]): row["lease_until"] for row in rows}
        return [renewed.get((lease.job_id, lease.fencing_token)) for lease in leases]

    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float, held: bool = False
    ) -> list[bool]:
        args = (
            [lease.job_id for lease, _ in items],
            [lease.owner_id for lease, _ in items],
            [lease.fencing_token for lease, _ in items],
            [_dumps(result) for _, result in items],
        )

        def fetch(conn: asyncpg.Connection) -> Awaitable[list[asyncpg.Record]]:
            return conn.fetch(Q.lease_complete_many, *args)

        # held: one call at a time (the queue's batcher), on a kept connection: taking one
        # from the pool and giving it back would cost more client CPU than the statement.
        rows = await self._run(fetch, timeout=timeout, held=held)
        done = {row["id"] for row in rows}
        return [lease.job_id in done for lease, _ in items]

    async def fail_many(
        self, items: Sequence[tuple[Lease, Any, float | None]], *, timeout: float
    ) -> list[JobState | None]:
        rows = await self._run(
            lambda conn: conn.fetch(
                Q.lease_fail_many,
                [lease.job_id for lease, _, _ in items],
                [lease.owner_id for lease, _, _ in items],
                [lease.fencing_token for lease, _, _ in items],
                [_dumps(error) for _, error, _ in items],
                [retry_in for _, _, retry_in in items],
            ),
            timeout=timeout,
        )
        states = {(row["id"], row["fencing_token"]): row["state"] for row in rows}
        return [states.get((lease.job_id, lease.fencing_token)) for lease, _, _ in items]

    async def release(self, lease: Lease, *, timeout: float) -> bool:
        count = await self._run(
            lambda conn: conn.fetchval(
                Q.lease_release, lease.job_id, lease.owner_id, lease.fencing_token
            ),
            timeout=timeout,
        )
        return bool(count)

    async def cancel(
        self, job_id: int, reason: Any, *, audit: JobAudit | None = None, timeout: float
    ) -> bool | None:
        row = await self._run(
            _audited(Q.lease_cancel, (job_id, _dumps(reason)), job_id, "cancelled", audit),
            timeout=timeout,
        )
        assert row is not None
        if not row["found"]:
            return None
        return bool(row["cancelled"])

    async def retry(
        self, job_id: int, *, audit: JobAudit | None = None, timeout: float
    ) -> bool | None:
        row = await self._run(
            _audited(Q.lease_retry, (job_id,), job_id, "retried", audit), timeout=timeout
        )
        assert row is not None
        if not row["found"]:
            return None
        return bool(row["retried"])

    async def commit_stage_many(
        self, items: Sequence[tuple[Lease, str, str, Any]], *, timeout: float
    ) -> list[bool]:
        rows = await self._run(
            lambda conn: conn.fetch(
                Q.lease_commit_stage_many,
                [lease.job_id for lease, _, _, _ in items],
                [lease.owner_id for lease, _, _, _ in items],
                [lease.fencing_token for lease, _, _, _ in items],
                [name for _, name, _, _ in items],
                [key for _, _, key, _ in items],
                [_dumps(result) for _, _, _, result in items],
            ),
            timeout=timeout,
        )
        return [bool(row["committed"]) for row in rows]

    async def wait_for_work(self, kinds: Sequence[str] | None, *, timeout: float) -> bool:
        return await self._notifications.wait(kinds, timeout=timeout)
