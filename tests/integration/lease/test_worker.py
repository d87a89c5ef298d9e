"""The Worker on both stores: success, retries and backoff, permanent errors, exhausted
attempts, tool timeouts, cancellation, stages, graceful shutdown, waking on new work."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from fencegate.lease import Lease, LeaseQueue, RateLimit, StoreUnavailable, WorkClass
from fencegate.lease.events import EventLog, digest
from fencegate.lease.execution import PermanentError
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.testing import PartitionedStore, PartitionSwitch
from fencegate.lease.worker import Worker
from fencegate.lease.young_generation import OBJECTS_PER_LEASE
from tests.support.net import TcpRelay
from tests.support.workers import (
    SHORT,
    claim_when_free,
    make_worker,
    names,
    running,
    wait_for_state,
    wait_until,
)


async def test_runs_jobs_and_commits_results(store_url: str, queue: LeaseQueue) -> None:
    async def double(job: JobContext) -> dict[str, int]:
        return {"double": job.payload["n"] * 2}

    ids = [
        await queue.enqueue("double", {"n": n}, idempotency_key=f"double:{n}", **SHORT)
        for n in range(6)
    ]
    worker = make_worker(store_url, {"double": double}, concurrency=3)
    await asyncio.wait_for(worker.run_until_idle(), 60)
    for n, job_id in enumerate(ids):
        job = await queue.get(job_id)
        assert (job.state, job.result, job.attempt) == ("succeeded", {"double": n * 2}, 1)
    committed = worker.events.named("result_committed")
    assert len(committed) == 6
    assert {e["result_sha256"] for e in committed} == {digest({"double": n * 2}) for n in range(6)}
    claimed = worker.events.named("job_claimed")
    assert all("payload" not in e for e in claimed)


async def test_retries_with_backoff_then_succeeds(store_url: str, queue: LeaseQueue) -> None:
    calls: list[int] = []

    async def flaky(job: JobContext) -> str:
        calls.append(job.attempt)
        if job.attempt < 3:
            raise ConnectionError("provider answered 503")
        return "ok"

    job_id = await queue.enqueue("flaky", {}, idempotency_key="flaky:1", **SHORT)
    fast = WorkClass(kind="flaky", backoff_base_seconds=0.05, backoff_max_seconds=0.2, **SHORT)
    worker = make_worker(store_url, {"flaky": flaky}, work_classes=[fast], poll_seconds=0.2)
    async with running(worker):
        job = await wait_for_state(queue, job_id, "succeeded", "failed")
    assert (job.state, job.attempt, calls) == ("succeeded", 3, [1, 2, 3])
    retries = worker.events.named("retry_scheduled")
    assert [e["attempt"] for e in retries] == [1, 2]
    assert retries[0]["error"] == "ConnectionError"
    history = await queue.attempts(job_id)
    assert [a.outcome for a in history] == ["retry_scheduled", "retry_scheduled", "succeeded"]
    assert [a.fencing_token for a in history] == sorted({a.fencing_token for a in history})


async def test_exhausted_attempts_end_failed(store_url: str, queue: LeaseQueue) -> None:
    async def broken(job: JobContext) -> None:
        raise RuntimeError("still broken")

    job_id = await queue.enqueue("broken", {}, idempotency_key="broken:1", max_attempts=2, **SHORT)
    fast = WorkClass(kind="broken", backoff_base_seconds=0.05, backoff_max_seconds=0.1, **SHORT)
    worker = make_worker(store_url, {"broken": broken}, work_classes=[fast], poll_seconds=0.2)
    async with running(worker):
        job = await wait_for_state(queue, job_id, "failed", "succeeded")
    assert (job.state, job.attempt) == ("failed", 2)
    assert job.error["type"] == "RuntimeError"
    assert names(worker.events.for_job(job_id)).count("retry_scheduled") == 1
    [failed] = worker.events.named("job_failed")
    assert failed["attempt"] == 2


async def test_a_tools_error_message_reaches_the_log_only_as_a_hash(
    store_url: str, queue: LeaseQueue
) -> None:
    secret = "card 4111-1111-1111-1111 declined"

    async def leaky(job: JobContext) -> None:
        raise PermanentError(secret) if job.attempt > 1 else RuntimeError(secret)

    job_id = await queue.enqueue("leaky", {}, idempotency_key="leaky:1", max_attempts=2, **SHORT)
    fast = WorkClass(kind="leaky", backoff_base_seconds=0.05, backoff_max_seconds=0.1, **SHORT)
    worker = make_worker(store_url, {"leaky": leaky}, work_classes=[fast], poll_seconds=0.2)
    async with running(worker):
        await wait_for_state(queue, job_id, "failed", "succeeded")
    events = worker.events.for_job(job_id)
    assert "tool_failed" in names(events)
    assert secret not in repr(events)
    [tool_failed] = [e for e in events if e["event"] == "tool_failed"]
    assert tool_failed["detail_sha256"] == digest(secret)


async def test_a_scheduled_retry_is_reported_as_such_whatever_happens_next(
    store_url: str, queue: LeaseQueue
) -> None:
    class RivalActsFirst:
        """The worker's own queue, except that between this worker's fail and its next read
        of the job a rival claims the retry and fails the job for good."""

        def __init__(self, inner: LeaseQueue) -> None:
            self.inner, self.acted, self.claimed = inner, False, False

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        async def claim(self, owner: str, **options: Any) -> list[Lease]:
            # The retry is the rival's: with free slots and a 50 ms backoff this worker's
            # own claim loop could otherwise win it while the rival is still polling, and
            # then report a second attempt of its own.
            if self.claimed:
                return []
            leases: list[Lease] = await self.inner.claim(owner, **options)
            self.claimed = bool(leases)
            return leases

        async def get(self, job_id: int, *, timeout: float) -> Any:
            if not self.acted:
                self.acted = True
                lease = await claim_when_free(queue, "rival", "flaky", timeout=30)
                assert await queue.fail(lease, "rival gave up", permanent=True)
            return await self.inner.get(job_id, timeout=timeout)

    async def flaky(job: JobContext) -> str:
        raise ConnectionError("provider answered 503")

    job_id = await queue.enqueue("flaky", {}, idempotency_key="flaky:rival", **SHORT)
    fast = WorkClass(kind="flaky", backoff_base_seconds=0.05, backoff_max_seconds=0.1, **SHORT)
    worker_queue = await LeaseQueue.connect(store_url)
    try:
        worker = make_worker(RivalActsFirst(worker_queue), {"flaky": flaky}, work_classes=[fast])
        await asyncio.wait_for(worker.run_until_idle(), 60)
    finally:
        await worker_queue.close()
    assert (await queue.get(job_id)).state == "failed"  # by the rival, on attempt 2
    # This worker's attempt ended with a retry scheduled; what the rival did later is not
    # this worker's job_failed.
    [retry] = worker.events.named("retry_scheduled")
    assert retry["attempt"] == 1
    assert worker.events.named("job_failed") == []


async def test_permanent_errors_are_not_retried(store_url: str, queue: LeaseQueue) -> None:
    calls = 0

    async def reject(job: JobContext) -> None:
        nonlocal calls
        calls += 1
        raise PermanentError("card declined: do not retry")

    job_id = await queue.enqueue("reject", {}, idempotency_key="reject:1", **SHORT)
    worker = make_worker(store_url, {"reject": reject})
    await asyncio.wait_for(worker.run_until_idle(), 60)
    job = await queue.get(job_id)
    assert (job.state, job.attempt, calls) == ("failed", 1, 1)
    assert job.error == {
        "type": "PermanentError",
        "summary": "card declined: do not retry",
        "message": "card declined: do not retry",
    }
    [failed] = worker.events.named("job_failed")
    assert failed["permanent"] is True
    assert worker.events.named("retry_scheduled") == []


async def test_tool_timeout_cancels_a_live_but_useless_tool(
    store_url: str, queue: LeaseQueue
) -> None:
    async def hangs_first_time(job: JobContext) -> str:
        if job.attempt == 1:
            await asyncio.sleep(60)
        return "done"

    job_id = await queue.enqueue(
        "hang", {}, idempotency_key="hang:1", tool_timeout_seconds=0.5, **SHORT
    )
    fast = WorkClass(
        kind="hang",
        backoff_base_seconds=0.05,
        backoff_max_seconds=0.1,
        tool_timeout_seconds=0.5,
        **SHORT,
    )
    worker = make_worker(store_url, {"hang": hangs_first_time}, work_classes=[fast])
    async with running(worker):
        job = await wait_for_state(queue, job_id, "succeeded", "failed")
    assert (job.state, job.attempt, job.result) == ("succeeded", 2, "done")
    [timeout] = worker.events.named("tool_timeout")
    assert timeout["token"] < job.fencing_token
    assert names(worker.events.for_job(job_id)).index("tool_timeout") < names(
        worker.events.for_job(job_id)
    ).index("retry_scheduled")


async def test_cancel_stops_a_running_job(store_url: str, queue: LeaseQueue) -> None:
    started = asyncio.Event()
    finished_normally = False

    async def long_call(job: JobContext) -> str:
        nonlocal finished_normally
        started.set()
        await asyncio.sleep(60)
        finished_normally = True
        return "never"

    job_id = await queue.enqueue("long", {}, idempotency_key="long:1", **SHORT)
    worker = make_worker(store_url, {"long": long_call})
    async with running(worker):
        await asyncio.wait_for(started.wait(), 30)
        assert await queue.cancel(job_id, reason="operator: customer withdrew")
        await wait_until(
            lambda: worker.events.named("result_rejected"), what="result_rejected", timeout=30
        )
    job = await queue.get(job_id)
    assert job.state == "cancelled" and not finished_normally
    [lost] = worker.events.named("heartbeat_lost")
    assert (lost["reason"], lost["job_state"]) == ("zero_rows", "cancelled")
    assert worker.events.named("result_committed") == []


async def test_a_commit_retried_after_an_outage_is_rejected_if_the_job_was_cancelled(
    store_url: str, queue: LeaseQueue
) -> None:
    switch = PartitionSwitch()

    async def answer(job: JobContext) -> dict[str, str]:
        switch.partition()  # the store stops answering just as the result is ready
        return {"card": "4242 4242 4242 4242"}

    async def cancel_while_the_commit_hangs() -> None:
        await wait_until(lambda: switch.blocked_calls >= 1, what="the commit blocked")
        assert await queue.cancel(job_id, reason="operator: customer withdrew")
        switch.heal()

    job_id = await queue.enqueue(
        "answer",
        {},
        idempotency_key="answer:1",
        lease_seconds=30.0,
        heartbeat_seconds=10.0,
        jitter_seconds=5.0,
    )
    worker_queue = await LeaseQueue.connect(store_url)
    try:
        # concurrency=1: the first call that meets the partition is the commit itself.
        worker = make_worker(
            PartitionedStore(worker_queue, switch),
            {"answer": answer},
            concurrency=1,
            store_timeout=1.0,
        )
        async with running(worker):
            await asyncio.wait_for(cancel_while_the_commit_hangs(), 30)
            await wait_until(
                lambda: names(worker.events.for_job(job_id))[-1].startswith("result_"),
                what="an outcome",
            )
    finally:
        await worker_queue.close()
    assert (await queue.get(job_id)).state == "cancelled"
    # The retried commit found zero rows; a job that ended some other way under the same
    # token must not be taken for an earlier try that landed.
    assert worker.events.named("result_committed") == []
    [rejected] = worker.events.named("result_rejected")
    assert (rejected["reason"], rejected["result_sha256"]) == (
        "zero_rows",
        digest({"card": "4242 4242 4242 4242"}),
    )
    assert "4242" not in str(worker.events.records)  # a hash, never the result itself


async def test_stages_run_once_per_job_across_attempts(store_url: str, queue: LeaseQueue) -> None:
    fetched = 0

    async def fetch_statement() -> dict[str, int]:
        nonlocal fetched
        fetched += 1
        return {"lines": 12}

    async def report(job: JobContext) -> dict[str, Any]:
        statement = await job.stage("fetch_statement", fetch_statement)
        if job.attempt == 1:
            raise ConnectionError("review service down")
        draft = await job.stage("draft", lambda: {"pages": statement["lines"] // 4})
        return {"draft": draft}

    job_id = await queue.enqueue("report", {}, idempotency_key="report:1", **SHORT)
    fast = WorkClass(kind="report", backoff_base_seconds=0.05, backoff_max_seconds=0.1, **SHORT)
    worker = make_worker(store_url, {"report": report}, work_classes=[fast])
    async with running(worker):
        job = await wait_for_state(queue, job_id, "succeeded", "failed")
    assert (job.state, job.attempt, job.result) == ("succeeded", 2, {"draft": {"pages": 3}})
    assert fetched == 1
    skipped = worker.events.named("stage_skipped")
    assert [(e["stage"], e["token"]) for e in skipped] == [("fetch_statement", job.fencing_token)]


async def test_stage_timeout_is_separate_from_the_lease(store_url: str, queue: LeaseQueue) -> None:
    async def stuck_browser(job: JobContext) -> str:
        await job.stage("wait_for_modal", lambda: asyncio.sleep(60), timeout=0.3)
        return "unreachable"

    job_id = await queue.enqueue("browse", {}, idempotency_key="browse:1", max_attempts=1, **SHORT)
    worker = make_worker(store_url, {"browse": stuck_browser})
    await asyncio.wait_for(worker.run_until_idle(), 60)
    job = await queue.get(job_id)
    assert (job.state, job.error["type"]) == ("failed", "StageTimeout")
    assert names(worker.events.for_job(job_id))[:3] == [
        "job_claimed",
        "stage_timeout",
        "tool_failed",
    ]


async def test_graceful_stop_releases_what_cannot_finish(store_url: str, queue: LeaseQueue) -> None:
    started = asyncio.Event()

    async def slow(job: JobContext) -> str:
        if job.payload == "quick":
            return "quick done"
        started.set()
        await asyncio.sleep(60)
        return "never"

    slow_id = await queue.enqueue("slow", "slow", idempotency_key="slow:1", **SHORT)
    worker = make_worker(store_url, {"slow": slow}, grace_seconds=0.5)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), 30)
    worker.stop()
    await asyncio.wait_for(task, 30)
    job = await queue.get(slow_id)
    assert (job.state, job.owner_id) == ("queued", None)
    [released] = worker.events.named("job_released")
    assert released["released"] is True
    # Released work does not use up an attempt: the next owner still has all of them.
    [lease] = await queue.claim("w2", kinds=["slow"], limit=1)
    assert lease.attempt == 1 and lease.fencing_token > released["token"]


async def test_wakes_on_new_work_without_waiting_for_the_poll(
    store_url: str, queue: LeaseQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = asyncio.Event()
    waiting = asyncio.Event()

    async def note(job: JobContext) -> None:
        done.set()

    worker_queue = await LeaseQueue.connect(store_url)
    wait_for_work = worker_queue.wait_for_work

    async def noted_wait(kinds: Sequence[str] | None = None, *, timeout: float = 10.0) -> bool:
        waiting.set()
        return await wait_for_work(kinds, timeout=timeout)

    monkeypatch.setattr(worker_queue, "wait_for_work", noted_wait)
    # A poll this long would make the test time out: only the wake-up can finish it.
    worker = make_worker(worker_queue, {"note": note}, poll_seconds=300.0)
    try:
        async with running(worker):
            await asyncio.wait_for(waiting.wait(), 30)  # the worker is waiting for work
            began = time.monotonic()
            await queue.enqueue("note", {}, idempotency_key="note:1", **SHORT)
            await asyncio.wait_for(done.wait(), 60)
    finally:
        await worker_queue.close()
    assert time.monotonic() - began < 300.0


async def test_a_plain_function_can_be_a_tool(store_url: str, queue: LeaseQueue) -> None:
    def classify(job: JobContext) -> str:
        return "invoice" if "total" in job.payload else "other"

    job_id = await queue.enqueue("classify", {"total": 12}, idempotency_key="c:1", **SHORT)
    worker = make_worker(store_url, {"classify": classify})
    await asyncio.wait_for(worker.run_until_idle(), 60)
    job = await queue.get(job_id)
    assert (job.state, job.result) == ("succeeded", "invoice")


async def test_a_plain_function_tool_runs_without_a_task_of_its_own(
    store_url: str, queue: LeaseQueue
) -> None:
    """A plain function holds the loop until it returns, so it runs in its job's own task:
    one task per job, not two (the worker's own tasks, claims and commits, are shared)."""
    jobs = 400
    await queue.enqueue_many([{"kind": "plain", "payload": n, **SHORT} for n in range(jobs)])
    loop = asyncio.get_running_loop()
    created = 0
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        nonlocal created
        created += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    worker = make_worker(store_url, {"plain": lambda job: job.payload}, concurrency=10)
    loop.set_task_factory(counting)
    try:
        await asyncio.wait_for(worker.run_until_idle(), 60)
    finally:
        loop.set_task_factory(factory)
    assert len(worker.events.named("result_committed")) == jobs
    assert created < jobs * 3 // 2, f"{created} tasks for {jobs} jobs"


async def test_a_worker_claims_in_batches_not_one_job_at_a_time(
    store_url: str, queue: LeaseQueue
) -> None:
    """A worker claims again only once half its concurrency of leases is free: every claim
    costs a round trip, and one worker of concurrency 10 running short jobs used to claim
    19 jobs, then 1, then 19, in turn."""
    jobs = 400
    await queue.enqueue_many([{"kind": "plain", "payload": n, **SHORT} for n in range(jobs)])
    limits: list[int] = []
    claim = queue.claim

    async def recorded(*args: Any, **kwargs: Any) -> list[Lease]:
        limits.append(kwargs["limit"])
        return await claim(*args, **kwargs)

    queue.claim = recorded  # type: ignore[method-assign]
    worker = make_worker(queue, {"plain": lambda job: job.payload}, concurrency=10)
    await asyncio.wait_for(worker.run_until_idle(), 60)
    assert len(worker.events.named("result_committed")) == jobs
    assert min(limits) >= 5, f"claims asked for {sorted(limits)[:10]}..."


async def test_a_plain_function_may_return_an_awaitable_or_raise(
    store_url: str, queue: LeaseQueue
) -> None:
    async def later(n: int) -> int:
        await asyncio.sleep(0)
        return n * 3

    def tool(job: JobContext) -> Any:
        if job.payload == "permanent":
            raise PermanentError("no")
        if job.payload == "stop":
            raise StopIteration
        return later(job.payload)

    ids = [
        await queue.enqueue("mixed", payload, idempotency_key=f"m:{payload}", **SHORT)
        for payload in (2, "permanent", "stop")
    ]
    worker = make_worker(store_url, {"mixed": tool})
    await asyncio.wait_for(worker.run_until_idle(), 60)
    awaited, permanent, stopped = [await queue.get(job_id) for job_id in ids]
    assert (awaited.state, awaited.result) == ("succeeded", 6)
    assert (permanent.state, permanent.attempt) == ("failed", 1)
    # Not a permanent error: retried like any other, until the attempts run out.
    assert stopped.state in ("queued", "failed")


async def test_a_result_the_store_cannot_hold_fails_the_job(
    store_url: str, queue: LeaseQueue
) -> None:
    async def unserialisable(job: JobContext) -> object:
        return {"when": object()}

    job_id = await queue.enqueue("odd", {}, idempotency_key="odd:1", **SHORT)
    worker = make_worker(store_url, {"odd": unserialisable})
    await asyncio.wait_for(worker.run_until_idle(), 60)
    job = await queue.get(job_id)
    assert (job.state, job.attempt) == ("failed", 1)
    [failed] = worker.events.named("job_failed")
    assert failed["error"] == "result_not_storable"


async def test_an_unreachable_store_fails_the_start_with_one_clear_error() -> None:
    async def never(job: JobContext) -> None:
        raise AssertionError("no job can be claimed")

    worker = Worker(
        "postgresql://postgres@127.0.0.1:1/nowhere",
        tools={"k": never},
        events=EventLog(),
        metrics=WorkerMetrics(registry=CollectorRegistry()),
        store_timeout=2.0,
    )
    with pytest.raises(StoreUnavailable, match="did not answer"):
        await asyncio.wait_for(worker.run(), 30)
    assert [e["event"] for e in worker.events.records] == ["worker_stopped"]


async def test_a_commit_whose_answer_was_lost_past_the_lease_is_reported_committed(
    pg_url: str,
) -> None:
    """A failover can lose a commit's answer and not the commit: the statement reaches the
    server and commits, its answer never comes back, and the store stays away until the lease
    has run out. The job succeeded; once the store answers again, the attempt's own record
    says so, and the worker reports ``result_committed``, not "ownership unknown"."""
    result = {"receipt": "rcpt-lost-answer-7f3a"}  # only the commit carries it

    with TcpRelay.to_database(pg_url) as relay:
        relay.deafen_on(result["receipt"].encode())
        queue = await LeaseQueue.connect(pg_url, timeout=10)
        worker = make_worker(
            relay.url_for(pg_url),
            {"answer": lambda job: result},
            store_timeout=1.0,
            outcome_wait_seconds=30.0,  # longer than the store is away here
        )
        remaining = _lease_remaining(worker)
        try:
            async with running(worker):
                job_id = await queue.enqueue("answer", {}, **SHORT)
                job = await wait_for_state(queue, job_id, "succeeded")
                assert job.result == result  # it landed; the worker heard nothing
                # Well past the lease as the worker counts it: every try since has failed,
                # and the worker has given the lease up without an answer.
                await wait_until(
                    lambda: remaining() <= -1.5 or _outcomes(worker, job_id),
                    what="the lease run out",
                )
                assert _outcomes(worker, job_id) == []  # not given up while the store is away
                relay.heal()
                await wait_until(lambda: _outcomes(worker, job_id), what="an outcome")
        finally:
            await queue.close()
    assert _outcomes(worker, job_id) == ["result_committed"]
    [committed] = [e for e in worker.events.for_job(job_id) if e["event"] == "result_committed"]
    assert committed["result_sha256"] == digest(result)


def _outcomes(worker: Worker, job_id: int) -> list[str]:
    return [n for n in names(worker.events.for_job(job_id)) if n.startswith("result_")]


def _lease_remaining(worker: Worker) -> Callable[[], float]:
    """The worker's own count of its held lease's remaining seconds (its metrics gauge)."""

    def remaining() -> float:
        value = worker.metrics.registry.get_sample_value(
            "fencegate_worker_lease_remaining_seconds",
            {"kind": "answer", "provider": "", "model": ""},
        )
        return float("inf") if value is None else value  # None: no lease held

    return remaining


async def test_until_idle_claims_again_when_its_own_jobs_ended_during_an_empty_claim(
    pg_url: str,
) -> None:
    """`run_until_idle` stops when a claim finds nothing and nothing runs. A claim that
    found nothing because the worker's own job filled its kind's limit, while that job
    ended before the answer came, is no such proof: the worker claims once more. (With
    several worker processes the last one standing met this, and left the rest of the
    queue unworked.)

    The claim is held up inside its statement, after it has read the jobs: the bucket of
    the kind's provider is locked by the test, and the claim updates it."""
    queue = await LeaseQueue.connect(pg_url)
    holder = await asyncpg.connect(pg_url)
    try:
        queue.declare(WorkClass(kind="metered", max_running=1, provider="meter"))
        queue.declare_rate_limit(RateLimit(provider="meter", limit=1000))
        await queue.enqueue("metered", "first", **SHORT)
        await queue.enqueue("metered", "second", **SHORT)
        first_started, first_may_end = asyncio.Event(), asyncio.Event()

        async def tool(job: JobContext) -> str:
            if job.payload == "first":
                first_started.set()
                await first_may_end.wait()
            return str(job.payload)

        worker = make_worker(queue, {"metered": tool}, concurrency=2, poll_seconds=0.2)
        run = asyncio.create_task(worker.run_until_idle())
        try:
            await asyncio.wait_for(first_started.wait(), 30)
            # The next claim (every poll) reads "first" running, so finds the kind full,
            # then waits here for the bucket.
            transaction = holder.transaction()
            await transaction.start()
            await holder.execute("SELECT 1 FROM fencegate_rate_limits FOR UPDATE")

            async def claim_waits_for_the_bucket() -> bool:
                return bool(
                    await holder.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
                    )
                )

            await wait_until(claim_waits_for_the_bucket, timeout=30)
            first_may_end.set()
            await wait_until(lambda: bool(worker.events.named("result_committed")), timeout=30)
            await transaction.rollback()  # the claim goes on: it found nothing
            await asyncio.wait_for(asyncio.shield(run), 30)
        finally:
            first_may_end.set()
            if not run.done():
                worker.stop()
                await asyncio.wait_for(run, 30)
        states = {job.payload: job.state for job in await queue.list_jobs(kind="metered")}
        assert states == {"first": "succeeded", "second": "succeeded"}
    finally:
        await holder.close()
        await queue.close()


async def test_the_youngest_generation_holds_a_running_workers_leases(
    store_url: str, queue: LeaseQueue
) -> None:
    """While it runs, a Worker's leases (up to 4 x concurrency, some 25 tracked objects
    each) fit in the collector's youngest generation, so that a claim does not set off
    collections of objects that are all alive; the threshold is put back when it stops."""
    before = gc.get_threshold()
    seen: list[int] = []

    def look(job: JobContext) -> None:
        seen.append(gc.get_threshold()[0])

    await queue.enqueue("look", {}, **SHORT)
    worker = make_worker(store_url, {"look": look}, concurrency=50)
    await asyncio.wait_for(worker.run_until_idle(), 60)
    assert seen and seen[0] >= 4 * 50 * OBJECTS_PER_LEASE
    assert gc.get_threshold() == before
