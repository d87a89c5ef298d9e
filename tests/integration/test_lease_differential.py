"""The lease queue's rules are written twice: once as PostgreSQL statements (data-modifying
CTEs) and once as SQLite statements driven from Python. This differential test holds the two
together: random sequences of enqueues, claims, renewals, completions, failures (with and
without a retry), releases, an operator's cancels and retries, stage commits and moves of the
database clock run against both stores side by side, under the same scheduling (priorities, a
limit per kind and per key, a provider's bucket), and every answer must be the same:
True/False/None, which job each claim returns, job states and attempts, the attempt history,
the order of the fencing tokens relative to each other, and what the operator's `Inspector`
reads (jobs by state, the queue's depth, running leases, ownership by work class, reclaimed
leases).

Job ids are compared by the order the jobs were created in (PostgreSQL's identity skips a
value on a repeated idempotency key, SQLite's does not), tokens by their rank.

Moving the clock forward by N seconds is done by shifting every stored time back by N on both
stores: the same effect, with no test hook in the stores. Intervals are chosen so that no
comparison is ever within a few seconds of its boundary, whatever real time passes.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fencegate.lease import JobNotFound, Lease, LeaseQueue, RateLimit, WorkClass
from fencegate.store.inspect import JOB_STATES, Inspector
from tests.support.two_stores import (
    LEASE_PG_CLEAR,
    LEASE_PG_SHIFT,
    LEASE_SQLITE_CLEAR,
    LEASE_SQLITE_SHIFT,
    migrated_pair,
    run_on_both,
)
from tests.support.waits import wait_until_sync

# A state machine of a few hundred steps on both stores: a minute or more on a busy machine
# (more with parallel workers). A timeout inside Hypothesis's run is taken for a failure and
# replayed, so the limit is generous.
pytestmark = pytest.mark.timeout(600)

T = TypeVar("T")
TIMEOUT = 30.0
# The clock moves in steps of 10 s: a lease of 35 s is either 5 s from expiring or 5 s past
# it, and a retry in 5 s is either 5 s away or due.
LEASE = 35.0
HEARTBEAT = 10.0
JITTER = 5.0
DELAY = 5.0
KINDS = ("a", "b")
STAGES = ("s1", "s2")
MAX_JOBS = 8
# Scheduling: kind a runs at most two at once and takes a token from provider p's bucket
# (three tokens, refilled so slowly that none comes back during a run); kind b runs one job
# per concurrency key at once.
LIMITED = (
    WorkClass(
        kind="a",
        max_running=2,
        provider="p",
        lease_seconds=LEASE,
        heartbeat_seconds=HEARTBEAT,
        jitter_seconds=JITTER,
    ),
    WorkClass(
        kind="b",
        max_running_per_key=1,
        lease_seconds=LEASE,
        heartbeat_seconds=HEARTBEAT,
        jitter_seconds=JITTER,
    ),
)
BUCKET = RateLimit("p", 3, per_seconds=31_536_000.0)  # three a year

_SQLITE_NOW = "SELECT julianday('now')"
# Ownership gauges measured on each store's own clock.
_CLOCK_READINGS = ("lease_remaining_min", "heartbeat_age_max")


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    yield from migrated_pair(tmp_path_factory, "lease-differential")


class TwoQueues(RuleBasedStateMachine):
    pg_url = ""
    sqlite_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.keys = itertools.count(1)
        self.queues: tuple[LeaseQueue, LeaseQueue] | None = None
        self.inspectors: tuple[Inspector, Inspector] | None = None
        # Per store, its job ids in the order the jobs were created.
        self.ids: tuple[list[int], list[int]] = ([], [])
        # Every lease either store ever granted (as a pair), current or long stale.
        self.leases: list[tuple[Lease, Lease]] = []

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def both(self, call: Any) -> tuple[Any, Any]:
        assert self.queues is not None
        lite, pg = self.queues
        return self.run(call(lite, 0)), self.run(call(pg, 1))

    def next_clock_step(self) -> None:
        """SQLite's clock moves in millisecond steps: leases granted in different steps must
        not share a lease_until, or the expired-first order could tie on one store only. So
        wait until SQLite's own clock has moved on."""
        path = Path(self.sqlite_url.removeprefix("sqlite:///"))
        with sqlite3.connect(path) as db:
            start = db.execute(_SQLITE_NOW).fetchone()[0]
            wait_until_sync(
                lambda: db.execute(_SQLITE_NOW).fetchone()[0] > start,
                timeout=5,
                what="the SQLite clock's next step",
                interval=0.001,
            )

    def job(self, side: int, job_id: int) -> int:
        return self.ids[side].index(job_id)

    @initialize()
    def open_empty_queues(self) -> None:
        self.run(self._clear())
        self.queues = (
            self.run(LeaseQueue.connect(self.sqlite_url, timeout=TIMEOUT)),
            self.run(LeaseQueue.connect(self.pg_url, timeout=TIMEOUT, pool_max_size=2)),
        )
        self.inspectors = (
            self.run(Inspector.open(self.sqlite_url, timeout=TIMEOUT)),
            self.run(Inspector.open(self.pg_url, timeout=TIMEOUT)),
        )
        for queue in self.queues:
            for work_class in LIMITED:
                queue.declare(work_class)
            queue.declare_rate_limit(BUCKET)

    async def _clear(self) -> None:
        await run_on_both(self.pg_url, self.sqlite_url, LEASE_PG_CLEAR, LEASE_SQLITE_CLEAR)

    @precondition(lambda self: len(self.ids[0]) < MAX_JOBS)
    @rule(
        jobs=st.lists(
            st.tuples(
                st.sampled_from(KINDS),
                st.sampled_from(["k1", "k2", None, None, None]),
                st.integers(1, 3),
                st.booleans(),
                st.sampled_from([0, 0, 1, -1]),
                st.sampled_from(["c1", "c2", None]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def enqueue(self, jobs: list[tuple[str, str | None, int, bool, int, str | None]]) -> None:
        specs = [
            {
                "kind": kind,
                "payload": {"n": index},
                "idempotency_key": key or f"fresh-{next(self.keys)}",
                "max_attempts": max_attempts,
                "lease_seconds": LEASE,
                "heartbeat_seconds": HEARTBEAT,
                "jitter_seconds": JITTER,
                "run_after": DELAY if delayed else None,
                "priority": priority,
                "concurrency_key": concurrency_key,
            }
            for index, (kind, key, max_attempts, delayed, priority, concurrency_key) in enumerate(
                jobs
            )
        ]
        lite, pg = self.both(lambda q, _: q.enqueue_many(specs, timeout=TIMEOUT))
        for lite_id, pg_id in zip(lite, pg, strict=True):
            known = (lite_id in self.ids[0], pg_id in self.ids[1])
            assert known[0] == known[1], (specs, lite, pg)
            if known[0]:
                assert self.job(0, lite_id) == self.job(1, pg_id), (specs, lite, pg)
            else:
                self.ids[0].append(lite_id)
                self.ids[1].append(pg_id)

    @rule(
        owner=st.sampled_from(["w1", "w2"]),
        kinds=st.sampled_from([None, ["a"], ["b"], ["a", "b"]]),
        limit=st.integers(1, 3),
    )
    def claim(self, owner: str, kinds: list[str] | None, limit: int) -> None:
        lite, pg = self.both(lambda q, _: q.claim(owner, kinds=kinds, limit=limit, timeout=TIMEOUT))
        granted = []
        for side, leases in enumerate((lite, pg)):
            jobs = [self.job(side, lease.job_id) for lease in leases]
            tokens = [lease.fencing_token for lease in leases]
            # The rule of one batch: ascending job id, ascending token.
            assert jobs == sorted(jobs) and tokens == sorted(tokens), (side, leases)
            granted.append(
                [(j, lease.attempt, lease.owner_id) for j, lease in zip(jobs, leases, strict=True)]
            )
        assert granted[0] == granted[1], (owner, kinds, limit, lite, pg)
        self.leases.extend(zip(lite, pg, strict=True))
        self.next_clock_step()

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50))
    def extend(self, index: int) -> None:
        pair = self.leases[index % len(self.leases)]
        lite, pg = self.both(lambda q, side: q.extend(pair[side], timeout=TIMEOUT))
        assert (lite is None) == (pg is None), pair
        self.next_clock_step()

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50), result=st.sampled_from([None, "ok", {"n": 1}, [1, 2]]))
    def complete(self, index: int, result: Any) -> None:
        pair = self.leases[index % len(self.leases)]
        lite, pg = self.both(lambda q, side: q.complete(pair[side], result, timeout=TIMEOUT))
        assert lite == pg, pair

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50), retry_in=st.sampled_from([None, 0.0, DELAY]))
    def fail(self, index: int, retry_in: float | None) -> None:
        pair = self.leases[index % len(self.leases)]
        lite, pg = self.both(
            lambda q, side: q.fail(
                pair[side],
                {"code": "boom"},
                retry_in=retry_in,
                permanent=retry_in is None,
                timeout=TIMEOUT,
            )
        )
        assert lite == pg, pair

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        pair = self.leases[index % len(self.leases)]
        lite, pg = self.both(lambda q, side: q.release(pair[side], timeout=TIMEOUT))
        assert lite == pg, pair

    @rule(job=st.one_of(st.integers(0, 50), st.none()), action=st.sampled_from(["cancel", "retry"]))
    def operator(self, job: int | None, action: str) -> None:
        """An operator cancels a job, or retries a failed or cancelled one (the console's and
        the command line's actions both go through these `LeaseQueue` methods). None: a job
        that does not exist."""

        async def attempt(q: LeaseQueue, side: int) -> bool | None:
            ids = self.ids[side]
            job_id = ids[job % len(ids)] if job is not None and ids else 10**9
            try:
                if action == "cancel":
                    return await q.cancel(job_id, reason="stop", timeout=TIMEOUT)
                return await q.retry(job_id, timeout=TIMEOUT)
            except JobNotFound:
                return None

        lite, pg = self.both(attempt)
        assert lite == pg, (job, action)

    @rule(index=st.integers(0, 50))
    def retry_ended(self, index: int) -> None:
        """An operator retries a job that failed or was cancelled (chosen among those, so
        that a retry finds one often, its attempts used up or not)."""
        assert self.queues is not None

        async def ended(q: LeaseQueue) -> list[int]:
            jobs = await q.list_jobs(limit=100, timeout=TIMEOUT)
            return sorted(self.job(0, j.id) for j in jobs if j.state in ("failed", "cancelled"))

        candidates = self.run(ended(self.queues[0]))
        if not candidates:
            return
        job = candidates[index % len(candidates)]
        lite, pg = self.both(lambda q, side: q.retry(self.ids[side][job], timeout=TIMEOUT))
        assert lite == pg is True, job

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50), name=st.sampled_from(STAGES), result=st.integers(0, 3))
    def commit_stage(self, index: int, name: str, result: int) -> None:
        pair = self.leases[index % len(self.leases)]
        lite, pg = self.both(
            lambda q, side: q.commit_stage(pair[side], name, {"r": result}, timeout=TIMEOUT)
        )
        assert lite == pg, (pair, name)

    @rule(seconds=st.sampled_from([10.0, 40.0, 40.0]))
    def advance_clock(self, seconds: float) -> None:
        self.run(self._shift(seconds))

    async def _shift(self, seconds: float) -> None:
        await run_on_both(
            self.pg_url, self.sqlite_url, LEASE_PG_SHIFT, LEASE_SQLITE_SHIFT, seconds=seconds
        )

    async def _snapshot(self, q: LeaseQueue, side: int) -> list[Any]:
        jobs = await q.list_jobs(limit=100, timeout=TIMEOUT)
        rows: list[tuple[Any, ...]] = []
        tokens: list[int] = []
        for job in sorted(jobs, key=lambda j: j.id):
            history = await q.attempts(job.id, timeout=TIMEOUT)
            stages = []
            for name in STAGES:
                stage = await q.stage_result(_ByJobId(job.id), name, timeout=TIMEOUT)  # type: ignore[arg-type]
                stages.append(None if stage is None else (stage.result, stage.fencing_token))
            rows.append(
                (
                    self.job(side, job.id),
                    job.kind,
                    job.priority,
                    job.concurrency_key,
                    job.state,
                    job.owner_id,
                    job.attempt,
                    job.max_attempts,
                    job.result,
                    job.error,
                    job.lease_until is None,
                    job.fencing_token,
                    [(a.attempt, a.owner_id, a.outcome, a.error, a.fencing_token) for a in history],
                    stages,
                )
            )
            tokens += [t for t in [job.fencing_token] if t is not None]
            tokens += [a.fencing_token for a in history]
        order = sorted(set(tokens))
        place = {token: order.index(token) for token in order}

        def rank(token: int | None) -> int | None:
            return None if token is None else place[token]

        return [
            (
                *row[:11],
                rank(row[11]),
                [(*a[:4], rank(a[4])) for a in row[12]],
                [None if s is None else (s[0], rank(s[1])) for s in row[13]],
            )
            for row in rows
        ]

    @invariant()
    def same_jobs(self) -> None:
        if self.queues is None:
            return
        lite, pg = self.both(self._snapshot)
        assert lite == pg

    async def _operator_reads(self, inspector: Inspector, side: int) -> list[Any]:
        found: list[Any] = []
        for state in (None, *JOB_STATES):
            page = await inspector.jobs(state=state, limit=100, timeout=TIMEOUT)
            found.append(
                [
                    (
                        self.job(side, row["id"]),
                        row["kind"],
                        row["state"],
                        row["owner_id"],
                        row["attempt"],
                        row["max_attempts"],
                        row["has_error"],
                    )
                    for row in page.rows
                ]
            )
        overview = await inspector.overview(timeout=TIMEOUT)
        found.append(overview["queue_depth"])
        found.append(overview["reclaimed_leases"])
        found.append(
            sorted((self.job(side, r["id"]), r["owner_id"]) for r in overview["running_leases"])
        )
        found.append(
            [
                {
                    k: v
                    for k, v in row.items()
                    if k not in ("lease_remaining_min", "heartbeat_age_max")
                }
                for row in await inspector.ownership(timeout=TIMEOUT)
            ]
        )
        found.append(await inspector.limits(timeout=TIMEOUT))
        return found

    # A rule rather than an invariant: reading everything after every step would cost more
    # than the steps; as a rule it runs between random steps, with the clock moved or not.
    @rule()
    def same_operator_reads(self) -> None:
        if self.inspectors is None:
            return
        lite_inspector, pg_inspector = self.inspectors
        lite = self.run(self._operator_reads(lite_inspector, 0))
        pg = self.run(self._operator_reads(pg_inspector, 1))
        assert lite == pg

    def teardown(self) -> None:
        for inspector in self.inspectors or ():
            self.run(inspector.close())
        if self.queues is not None:
            for queue in self.queues:
                self.run(queue.close())
        self.loop.close()


class _ByJobId:
    """`stage_result` reads a stage by job id alone."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id


def test_sqlite_and_postgres_lease_alike(databases: tuple[str, str]) -> None:
    TwoQueues.pg_url, TwoQueues.sqlite_url = databases
    state_machine = TwoQueues.TestCase
    state_machine.settings = settings(
        max_examples=40,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    state_machine().runTest()


async def _operator_story(url: str) -> list[Any]:
    """Retries and cancels in the order an operator meets them: a job failed for good on its
    last attempt, retried and claimed again; a queued job cancelled and retried; a running job
    cancelled under its holder, whose completion is then refused. What each step answered,
    and the jobs as they stand after it."""
    queue = await LeaseQueue.connect(url, timeout=TIMEOUT)
    seen: list[Any] = []

    async def jobs() -> list[Any]:
        found = await queue.list_jobs(limit=10, timeout=TIMEOUT)
        return [
            (j.state, j.attempt, j.max_attempts, j.error) for j in sorted(found, key=lambda j: j.id)
        ]

    try:
        spec = {
            "kind": "a",
            "payload": {},
            "lease_seconds": LEASE,
            "heartbeat_seconds": HEARTBEAT,
            "jitter_seconds": JITTER,
        }
        first, second, third = await queue.enqueue_many(
            [spec | {"idempotency_key": k, "max_attempts": 1} for k in ("j1", "j2", "j3")],
            timeout=TIMEOUT,
        )
        [lease] = await queue.claim("w1", limit=1, timeout=TIMEOUT)
        steps = [
            queue.fail(lease, {"code": "boom"}, retry_in=None, permanent=True, timeout=TIMEOUT),
            queue.retry(first, timeout=TIMEOUT),
            queue.retry(first, timeout=TIMEOUT),  # queued now: nothing to retry
            queue.cancel(second, timeout=TIMEOUT),
            queue.retry(second, timeout=TIMEOUT),
        ]
        for step in steps:
            seen.append((await step, await jobs()))
        leases = await queue.claim("w2", limit=3, timeout=TIMEOUT)
        seen.append(([(lease.attempt, lease.owner_id) for lease in leases], await jobs()))
        running = next(lease for lease in leases if lease.job_id == third)
        seen.append((await queue.cancel(third, timeout=TIMEOUT), await jobs()))
        seen.append((await queue.complete(running, "late", timeout=TIMEOUT), await jobs()))
        seen.append((await queue.retry(third, timeout=TIMEOUT), await jobs()))
        try:
            await queue.retry(10**9, timeout=TIMEOUT)
        except JobNotFound:
            seen.append("not found")
    finally:
        await queue.close()
    return seen


async def test_an_operators_retries_and_cancels_alike(pg_url: str, sqlite_url: str) -> None:
    lite, pg = await _operator_story(sqlite_url), await _operator_story(pg_url)
    assert lite == pg
    # And what they say: the job failed on its last attempt got one more.
    assert lite[1][0] is True and lite[1][1][0] == ("queued", 1, 2, None)
