"""`LeaseQueue`: the one place that knows the lease queue's rules.

It resolves each job's policy (per-call values over the work class over the defaults) and
refuses intervals that break ``lease > R * heartbeat + jitter``; decides between retry and
failure; and hands each operation to the store's driver, which runs it as one transaction on
the database clock. Every call that waits takes ``timeout=`` and raises `StoreUnavailable`
rather than wait past it.

The conditional writes a worker makes per job (``complete``, ``fail``, ``extend``,
``commit_stage``) are coalesced: calls made while earlier ones are in flight go to the store
together, one statement per batch, each row still checked on its own against owner, token
and lease, each caller still getting its own answer. An idle queue sends a call at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypedDict, Unpack

import orjson

from fencegate.lease.drivers import Driver, open_driver
from fencegate.lease.errors import JobNotFound, UnknownWorkClass
from fencegate.lease.models import (
    JOB_STATES,
    Attempt,
    ClassLimits,
    Job,
    JobState,
    Lease,
    NewJob,
    Scheduling,
    StageRecord,
)
from fencegate.lease.policy import (
    RateLimit,
    WorkClass,
    backoff_seconds,
    check_intervals,
    fails_for_good,
)
from fencegate.store.audit import JobAudit
from fencegate.store.batching import Batcher
from fencegate.store.dburl import parse_database_url

DEFAULT_TIMEOUT = 10.0


# Items per coalesced statement, and statements of one kind in flight at once: one, so that
# a batch fills up while the previous one is on the wire (and the completions can keep one
# connection between their batches).
BATCH_MAX = 64
BATCH_IN_FLIGHT = 1
# Completions per statement when more than two batches are queued: jobs end in bursts as large
# as the claims that brought them, and Workers sharing a queue claim together. At 64, four
# Workers of concurrency 50 kept some 440 finished jobs queued behind the completion in
# flight, each still holding its lease, task and coroutines, which the garbage collector then
# went through again and again. A burst of one Worker's (up to 2 x concurrency) keeps
# BATCH_MAX: one statement of 100 instead of 64 + 36 cost a Worker of concurrency 50 about
# 11% of its jobs per second (its first jobs answered later).
COMPLETIONS_DEEP_MAX = 256
# Claims sent together at most (each up to its own limit of leases).
CLAIMS_MAX = 16


class JobOptions(TypedDict, total=False):
    """The per-job options of `LeaseQueue.new_job` and `LeaseQueue.enqueue`."""

    idempotency_key: str | None
    max_attempts: int | None
    lease_seconds: float | None
    heartbeat_seconds: float | None
    jitter_seconds: float | None
    stage_timeout_seconds: float | None
    tool_timeout_seconds: float | None
    run_after: float | None
    priority: int
    concurrency_key: str | None
    model: str | None


class LeaseQueue:
    """A durable job table with leases, heartbeats, fencing tokens and stages.

    Create one with `LeaseQueue.connect(url)`; share it between the tasks of a process.
    """

    def __init__(self, driver: Driver, *, rng: random.Random | None = None) -> None:
        self._driver = driver
        self._classes: dict[str, WorkClass] = {}
        self._rates: dict[str, RateLimit] = {}
        # The limits as last written to the store (None: not yet).
        self._written: Scheduling | None = None
        self._rng = rng or random.Random()
        # The URL this queue was opened with, so a Worker can open the heartbeat's own
        # connection to the same store.
        self.url: str | None = None
        self._completions: Batcher[tuple[Lease, Any], bool] = Batcher(
            self._complete_batch,
            max_batch=BATCH_MAX,
            max_deep_batch=COMPLETIONS_DEEP_MAX,
            max_in_flight=BATCH_IN_FLIGHT,
        )
        self._failures: Batcher[tuple[Lease, Any, float | None], JobState | None] = Batcher(
            self._fail_batch, max_batch=BATCH_MAX, max_in_flight=BATCH_IN_FLIGHT
        )
        self._renewals: Batcher[Lease, datetime | None] = Batcher(
            self._extend_batch, max_batch=BATCH_MAX, max_in_flight=BATCH_IN_FLIGHT
        )
        self._giving_back: set[asyncio.Task[None]] = set()
        # Per kinds claimed (and the limits they count): claims of other kinds do not wait.
        self._claims: dict[
            tuple[tuple[str, ...] | None, tuple[str, ...]], Batcher[tuple[str, int], list[Lease]]
        ] = {}
        self._stages: Batcher[tuple[Lease, str, str, Any], bool] = Batcher(
            self._stage_batch, max_batch=BATCH_MAX, max_in_flight=BATCH_IN_FLIGHT
        )

    @property
    def round_trips(self) -> int:
        """Statements (PostgreSQL) or transactions (SQLite) this queue has sent."""
        return self._driver.round_trips

    @classmethod
    async def connect(
        cls,
        url: str | None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        require_synchronous_replication: bool = False,
    ) -> LeaseQueue:
        """Open the store a URL names: ``postgresql://…`` or ``sqlite:///path.db``.

        The pool sizes apply to PostgreSQL; a SQLite store uses one connection.
        ``require_synchronous_replication`` refuses a PostgreSQL whose standbys all replicate
        asynchronously (a failover would lose fencing tokens and completions); without it
        that is one warning line.
        """
        target = parse_database_url(url)
        driver = await open_driver(
            target,
            timeout=timeout,
            min_size=pool_min_size,
            max_size=pool_max_size,
            require_synchronous_replication=require_synchronous_replication,
        )
        queue = cls(driver)
        queue.url = target.url
        return queue

    async def close(self) -> None:
        if self._giving_back:  # leases of cancelled claims, being released
            await asyncio.wait(self._giving_back, timeout=DEFAULT_TIMEOUT)
        await self._driver.close()

    async def __aenter__(self) -> LeaseQueue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def migrate(self, *, timeout: float = 60.0) -> list[str]:
        """Apply pending SQL migrations; returns the names applied."""
        return await self._driver.migrate(timeout=timeout)

    # -- work classes ---------------------------------------------------------------------

    def declare(self, work_class: WorkClass) -> WorkClass:
        """Register the policy of one kind of job (checked when the WorkClass was built).
        Its limits (``max_running``, ``max_running_per_key``, ``provider``) are written to the
        store before this queue's next claim, and hold for every worker of the fleet."""
        self._classes[work_class.kind] = work_class
        return work_class

    def declare_rate_limit(self, rate_limit: RateLimit) -> RateLimit:
        """Declare a provider's token bucket (kept in the store, shared by the fleet)."""
        self._rates[rate_limit.provider] = rate_limit
        return rate_limit

    def scheduling(self) -> Scheduling:
        """The limits this queue declared."""
        classes = tuple(
            ClassLimits(c.kind, c.max_running, c.max_running_per_key, c.provider)
            for c in self._classes.values()
            if c.max_running or c.max_running_per_key or c.provider
        )
        return Scheduling(classes, tuple(self._rates.values()))

    def work_class(self, kind: str) -> WorkClass:
        """The declared policy of a kind; `UnknownWorkClass` if it was never declared."""
        try:
            return self._classes[kind]
        except KeyError:
            raise UnknownWorkClass(
                f"work class {kind!r} was not declared on this queue "
                f"(declared: {sorted(self._classes) or 'none'})"
            ) from None

    def _policy(self, kind: str) -> WorkClass:
        # A kind nobody declared runs with the documented defaults.
        return self._classes.get(kind) or WorkClass(kind=kind)

    # -- producing work -------------------------------------------------------------------

    def new_job(
        self,
        kind: str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        lease_seconds: float | None = None,
        heartbeat_seconds: float | None = None,
        jitter_seconds: float | None = None,
        stage_timeout_seconds: float | None = None,
        tool_timeout_seconds: float | None = None,
        run_after: float | None = None,
        priority: int | None = None,
        concurrency_key: str | None = None,
        model: str | None = None,
    ) -> NewJob:
        """Resolve and check one job's policy without storing it (see `enqueue`).

        Each option left out (None) comes from the kind's work class, else the defaults.
        """
        policy = self._policy(kind)
        lease = policy.lease_seconds if lease_seconds is None else lease_seconds
        heartbeat = policy.heartbeat_seconds if heartbeat_seconds is None else heartbeat_seconds
        jitter = policy.jitter_seconds if jitter_seconds is None else jitter_seconds
        check_intervals(
            lease_seconds=lease,
            heartbeat_seconds=heartbeat,
            tolerated_misses=policy.tolerated_misses,
            jitter_seconds=jitter,
        )
        attempts = policy.max_attempts if max_attempts is None else max_attempts
        if attempts < 1:
            raise ValueError(f"max_attempts {attempts} must be at least 1")
        if run_after is not None and run_after < 0:
            raise ValueError(f"run_after {run_after:g}s must not be negative")
        if idempotency_key is not None and not idempotency_key:
            raise ValueError("idempotency_key must not be empty")
        if priority is not None and (
            not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > 2**31 - 1
        ):
            raise ValueError(f"priority {priority!r} must be a whole number (32 bits)")
        if concurrency_key is not None and not concurrency_key:
            raise ValueError("concurrency_key must not be empty")
        if model is not None and not (kind in self._classes and policy.allows_model(model)):
            declared = sorted({m for m in (policy.model, *policy.models) if m is not None})
            raise ValueError(
                f"model {model!r} is not declared for work class {kind!r} "
                f"(declared: {declared or 'none'}): a model is a label from a fixed set"
            )
        _check_json(payload, "payload")
        return NewJob(
            kind=kind,
            payload=payload,
            # Without a key from the caller the job is its own operation: a fresh key.
            idempotency_key=idempotency_key or f"{kind}:{uuid.uuid4()}",
            max_attempts=attempts,
            lease_seconds=float(lease),
            heartbeat_seconds=float(heartbeat),
            jitter_seconds=float(jitter),
            stage_timeout_seconds=(
                policy.stage_timeout_seconds
                if stage_timeout_seconds is None
                else stage_timeout_seconds
            ),
            tool_timeout_seconds=(
                policy.tool_timeout_seconds
                if tool_timeout_seconds is None
                else tool_timeout_seconds
            ),
            run_after_seconds=float(run_after or 0.0),
            priority=priority or 0,
            concurrency_key=concurrency_key,
            model=model or policy.model,
        )

    async def enqueue(
        self,
        kind: str,
        payload: Any = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        **options: Unpack[JobOptions],
    ) -> int:
        """Store one job; returns its id. The same idempotency key again returns the same id
        and stores nothing. The options are `new_job`'s (`JobOptions`): ``idempotency_key``,
        ``max_attempts``, the intervals, ``run_after``, which delays the job by that many
        seconds, ``priority`` (higher first, default 0; ties in enqueue order),
        ``concurrency_key`` (for the work class's ``max_running_per_key``) and ``model`` (a
        metric label: one of the names the declared work class allows)."""
        job = self.new_job(kind, payload, **options)
        [job_id] = await self._driver.enqueue([job], timeout=timeout)
        return job_id

    async def enqueue_many(
        self,
        jobs: Sequence[NewJob | Mapping[str, Any]],
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> list[int]:
        """Store many jobs in one statement; ids in the order given.

        Each item is a `NewJob` (from `new_job`) or a mapping of `enqueue`'s arguments,
        e.g. ``{"kind": "create_case", "payload": {...}, "idempotency_key": "..."}``.
        """
        resolved = [job if isinstance(job, NewJob) else self.new_job(**job) for job in jobs]
        if not resolved:
            return []
        return await self._driver.enqueue(resolved, timeout=timeout)

    # -- working --------------------------------------------------------------------------

    async def claim(
        self,
        owner_id: str,
        *,
        kinds: Sequence[str] | None = None,
        limit: int = 1,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> list[Lease]:
        """Lease up to ``limit`` ready jobs (queued and due, or running with an expired
        lease) to ``owner_id``. ``kinds=None`` takes any kind."""
        if not owner_id:
            raise ValueError("owner_id must not be empty")
        _check_kinds(kinds)
        if limit < 1:
            raise ValueError(f"limit {limit} must be at least 1")
        if kinds is not None and not kinds:
            return []
        scheduling = self.scheduling()
        if scheduling != self._written:
            await self._driver.declare(scheduling, timeout=timeout)
            self._written = scheduling
        return await self._claims_of(kinds, scheduling.lock_names(kinds)).submit(
            (owner_id, limit), timeout=timeout
        )

    def _claims_of(
        self, kinds: Sequence[str] | None, locks: Sequence[str]
    ) -> Batcher[tuple[str, int], list[Lease]]:
        """The batcher of the claims of these kinds: claims made while one of them is in
        flight (several workers sharing this queue) go together as one statement."""
        group = (None if kinds is None else tuple(kinds), tuple(locks))
        claims = self._claims.get(group)
        if claims is None:

            async def run(wanted: list[tuple[str, int]], timeout: float) -> list[list[Lease]]:
                return await self._driver.claim(wanted, kinds, locks=locks, timeout=timeout)

            claims = self._claims[group] = Batcher(
                run, max_batch=CLAIMS_MAX, max_in_flight=1, abandoned=self._give_back, inline=True
            )
        return claims

    def _give_back(self, wanted: tuple[str, int], leases: list[Lease]) -> None:
        """Leases granted to a claim whose caller was cancelled meanwhile: released, so that
        they are not held, unworked, until they expire (and cost an attempt)."""
        if leases:
            task = asyncio.get_running_loop().create_task(self._release_all(leases))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

    async def _release_all(self, leases: list[Lease]) -> None:
        for lease in leases:
            with contextlib.suppress(Exception):  # unreleased, it expires
                await self._driver.release(lease, timeout=DEFAULT_TIMEOUT)

    async def extend(self, lease: Lease, *, timeout: float = DEFAULT_TIMEOUT) -> Lease | None:
        """Renew a lease for its own duration from now. None means the lease is lost (expired,
        taken over, cancelled or finished): stop, and commit nothing."""
        lease_until = await self._renewals.submit(lease, timeout=timeout)
        if lease_until is None:
            return None
        return replace(lease, lease_until=lease_until)

    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float = DEFAULT_TIMEOUT
    ) -> list[Lease | None]:
        """`extend` for many leases in one transaction (a worker renewing all it holds);
        one answer per lease, None where that lease is lost."""
        if not leases:
            return []
        renewed = await self._driver.extend_many(leases, timeout=timeout)
        return [
            None if until is None else replace(lease, lease_until=until)
            for lease, until in zip(leases, renewed, strict=True)
        ]

    async def complete(
        self, lease: Lease, result: Any = None, *, timeout: float = DEFAULT_TIMEOUT
    ) -> bool:
        """Store the result and mark the job succeeded, only while the lease is held.
        False means rejected: the result was not stored."""
        _check_json(result, "result")
        return await self._completions.submit((lease, result), timeout=timeout)

    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float = DEFAULT_TIMEOUT
    ) -> list[bool]:
        """`complete` for many leases in one transaction; one answer per item."""
        if not items:
            return []
        for _, result in items:
            _check_json(result, "result")
        return await self._driver.complete_many(items, timeout=timeout)

    async def fail(
        self,
        lease: Lease,
        error: Any,
        *,
        retry_in: float | None = None,
        permanent: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> bool:
        """End this attempt with an error, only while the lease is held.

        The job is retried after ``retry_in`` seconds, or after a capped exponential backoff
        with jitter from its work class, unless ``permanent`` or its attempts are used up:
        then it is `failed` with this error. False means rejected.
        """
        if retry_in is not None and retry_in < 0:
            raise ValueError(f"retry_in {retry_in:g}s must not be negative")
        _check_json(error, "error")
        delay: float | None
        if fails_for_good(lease.attempt, lease.max_attempts, permanent=permanent):
            delay = None
        elif retry_in is not None:
            delay = float(retry_in)
        else:
            policy = self._policy(lease.kind)
            delay = backoff_seconds(
                lease.attempt,
                base=policy.backoff_base_seconds,
                cap=policy.backoff_max_seconds,
                rng=self._rng,
            )
        state = await self._failures.submit((lease, error, delay), timeout=timeout)
        return state is not None

    async def release(self, lease: Lease, *, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """Give unfinished work back (graceful shutdown): queued again at once, and this
        attempt does not count against ``max_attempts``. False if the lease was not held."""
        return await self._driver.release(lease, timeout=timeout)

    async def cancel(
        self,
        job_id: int,
        *,
        reason: Any = "cancelled",
        audit: JobAudit | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> bool:
        """Cancel a queued or running job (a running owner's lease becomes void). False when
        the job had already finished; `JobNotFound` when there is no such job. ``audit``
        (an operator's action) gives the audit row, written in the cancel's transaction from
        the job before and after: both land or neither."""
        _check_json(reason, "reason")
        cancelled = await self._driver.cancel(job_id, reason, audit=audit, timeout=timeout)
        if cancelled is None:
            raise JobNotFound(f"no job with id {job_id}")
        return cancelled

    async def retry(
        self, job_id: int, *, audit: JobAudit | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> bool:
        """Queue a failed or cancelled job again now, with one more attempt than it has had
        (its attempts and stages kept). False when the job is not failed or cancelled;
        `JobNotFound` when there is no such job. ``audit`` as for `cancel`."""
        retried = await self._driver.retry(job_id, audit=audit, timeout=timeout)
        if retried is None:
            raise JobNotFound(f"no job with id {job_id}")
        return retried

    # -- reading --------------------------------------------------------------------------

    async def get(self, job_id: int, *, timeout: float = DEFAULT_TIMEOUT) -> Job:
        job = await self._driver.get(job_id, timeout=timeout)
        if job is None:
            raise JobNotFound(f"no job with id {job_id}")
        return job

    async def list_jobs(
        self,
        *,
        state: JobState | None = None,
        kind: str | None = None,
        limit: int = 100,
        before: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> list[Job]:
        """Newest first, a page at a time: pass the last id of a page as ``before`` for the
        next one."""
        if state is not None and state not in JOB_STATES:
            raise ValueError(f"unknown job state {state!r}; one of {', '.join(JOB_STATES)}")
        if limit < 1:
            raise ValueError(f"limit {limit} must be at least 1")
        return await self._driver.list_jobs(
            state=state, kind=kind, limit=limit, before=before, timeout=timeout
        )

    async def attempts(self, job_id: int, *, timeout: float = DEFAULT_TIMEOUT) -> list[Attempt]:
        """Every lease ever granted on a job, oldest first."""
        return await self._driver.attempts(job_id, timeout=timeout)

    async def now(self, *, timeout: float = DEFAULT_TIMEOUT) -> datetime:
        """The database clock, the only clock the queue compares times with."""
        return await self._driver.now(timeout=timeout)

    # -- stages ---------------------------------------------------------------------------

    @staticmethod
    def stage_key(lease: Lease, name: str) -> str:
        """The idempotency key of one stage of a job."""
        return f"{lease.idempotency_key}:{name}"

    async def stage_result(
        self, lease: Lease, name: str, *, timeout: float = DEFAULT_TIMEOUT
    ) -> StageRecord | None:
        """The stage's committed result (by any attempt), or None if not committed yet."""
        return await self._driver.stage_result(lease.job_id, name, timeout=timeout)

    async def commit_stage(
        self, lease: Lease, name: str, result: Any, *, timeout: float = DEFAULT_TIMEOUT
    ) -> bool:
        """Record a stage's result, only while the lease is held. True when the stage is now
        recorded under this lease; False when the lease is not held or an earlier attempt
        had already committed the stage (read it with `stage_result`)."""
        if not name:
            raise ValueError("a stage needs a name")
        _check_json(result, "stage result")
        item = (lease, name, self.stage_key(lease, name), result)
        return await self._stages.submit(item, timeout=timeout)

    # -- coalesced writes: one driver call per batch ---------------------------------------

    async def _complete_batch(self, items: list[tuple[Lease, Any]], timeout: float) -> list[bool]:
        # A kept connection only serves calls made one at a time.
        return await self._driver.complete_many(items, timeout=timeout, held=BATCH_IN_FLIGHT == 1)

    async def _fail_batch(
        self, items: list[tuple[Lease, Any, float | None]], timeout: float
    ) -> list[JobState | None]:
        return await self._driver.fail_many(items, timeout=timeout)

    async def _extend_batch(self, leases: list[Lease], timeout: float) -> list[datetime | None]:
        return await self._driver.extend_many(leases, timeout=timeout)

    async def _stage_batch(
        self, items: list[tuple[Lease, str, str, Any]], timeout: float
    ) -> list[bool]:
        return await self._driver.commit_stage_many(items, timeout=timeout)

    # -- waking up ------------------------------------------------------------------------

    async def wait_for_work(
        self, kinds: Sequence[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT
    ) -> bool:
        """Wait until work of these kinds may be ready, or ``timeout`` passes.

        True: try `claim` now (PostgreSQL: a notification arrived since the last claim of
        these kinds; SQLite: a short poll found ready work). False: the timeout passed; a
        job delayed by ``run_after`` or an expired lease is found by the next claim anyway.
        Never raises `StoreUnavailable`: an unreachable store just means no news.
        """
        _check_kinds(kinds)
        return await self._driver.wait_for_work(kinds, timeout=timeout)


def _check_json(value: Any, what: str) -> None:
    # Refused here, the same way on both stores, before anything reaches the database.
    try:
        orjson.dumps(value)
    except TypeError as exc:
        raise TypeError(f"{what} must be JSON: {exc}") from None


def _check_kinds(kinds: Sequence[str] | None) -> None:
    # A bare string is a sequence too: "ocr" would silently mean the kinds "o", "c" and "r".
    if isinstance(kinds, str):
        raise TypeError(f"kinds must be a list of kinds, e.g. kinds=[{kinds!r}]")
