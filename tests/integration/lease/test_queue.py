"""LeaseQueue rules, each on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from fencegate.lease import (
    IntervalRuleViolation,
    JobNotFound,
    Lease,
    LeaseQueue,
    UnknownWorkClass,
    WorkClass,
)
from tests.support.waits import wait_until

# Short intervals that still keep the rule: 1.0 > 1 x 0.25 + 0.5.
SHORT: dict[str, Any] = {"lease_seconds": 1.0, "heartbeat_seconds": 0.25, "jitter_seconds": 0.5}


async def wait_for_clock_to_move(queue: LeaseQueue) -> None:
    """Wait until the database clock has moved on from now (SQLite's moves in milliseconds),
    so that a renewal lands later than the claim."""
    start = await queue.now()

    async def moved() -> bool:
        return await queue.now() > start

    await wait_until(moved, timeout=10, what="the database clock to move")


async def wait_until_expired(queue: LeaseQueue, lease: Lease) -> None:
    """Wait on the database clock, not ours, until the lease has run out."""
    for _ in range(200):
        if await queue.now() > lease.lease_until:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the lease never expired on the database clock")


async def claim_one(queue: LeaseQueue, owner: str, kind: str = "create_case") -> Lease:
    leases = await queue.claim(owner, kinds=[kind], limit=1)
    assert len(leases) == 1, f"{owner} expected one lease, got {leases}"
    return leases[0]


async def test_enqueue_is_idempotent_by_key(queue: LeaseQueue) -> None:
    first = await queue.enqueue(
        "create_case", {"customer_id": "c-1048"}, idempotency_key="ticket:c-1048:create"
    )
    again = await queue.enqueue(
        "create_case", {"customer_id": "c-1048"}, idempotency_key="ticket:c-1048:create"
    )
    assert again == first
    assert [job.id for job in await queue.list_jobs()] == [first]
    many = await queue.enqueue_many(
        [
            {"kind": "create_case", "payload": 1, "idempotency_key": "a"},
            {"kind": "create_case", "payload": 2, "idempotency_key": "ticket:c-1048:create"},
            {"kind": "create_case", "payload": 3, "idempotency_key": "a"},
        ]
    )
    assert many[1] == first
    assert many[0] == many[2] != first
    assert len(await queue.list_jobs()) == 2
    job = await queue.get(first)
    assert job.payload == {"customer_id": "c-1048"}
    assert job.state == "queued"
    assert job.idempotency_key == "ticket:c-1048:create"


async def test_concurrent_enqueues_of_one_key_make_one_job(store_url: str) -> None:
    queues = [await LeaseQueue.connect(store_url, timeout=10) for _ in range(3)]
    try:
        ids = await asyncio.gather(
            *(
                queues[n % 3].enqueue("create_case", {"n": n}, idempotency_key="same-key")
                for n in range(12)
            )
        )
        assert len(set(ids)) == 1
        jobs = await queues[0].list_jobs()
        assert [job.id for job in jobs] == [ids[0]]
    finally:
        for q in queues:
            await q.close()


async def test_job_values_come_from_call_then_work_class_then_defaults(queue: LeaseQueue) -> None:
    queue.declare(
        WorkClass(
            kind="export",
            lease_seconds=300,
            heartbeat_seconds=60,
            jitter_seconds=30,
            max_attempts=3,
            stage_timeout_seconds=120,
            tool_timeout_seconds=45,
        )
    )
    from_class = await queue.get(await queue.enqueue("export", None))
    assert (from_class.lease_seconds, from_class.heartbeat_seconds) == (300, 60)
    assert (from_class.jitter_seconds, from_class.max_attempts) == (30, 3)
    assert from_class.stage_timeout_seconds == 120
    assert from_class.tool_timeout_seconds == 45
    from_call = await queue.get(
        await queue.enqueue("export", None, lease_seconds=200, max_attempts=1)
    )
    assert (from_call.lease_seconds, from_call.heartbeat_seconds) == (200, 60)
    assert from_call.max_attempts == 1
    defaults = await queue.get(await queue.enqueue("undeclared", None))
    assert (defaults.lease_seconds, defaults.heartbeat_seconds) == (90, 30)
    assert (defaults.jitter_seconds, defaults.max_attempts) == (20, 5)
    with pytest.raises(UnknownWorkClass, match="undeclared"):
        queue.work_class("undeclared")
    assert queue.work_class("export").max_attempts == 3


async def test_interval_rule_is_checked_with_the_values_in_force(queue: LeaseQueue) -> None:
    with pytest.raises(IntervalRuleViolation, match=r"lease 35s must exceed 1 × heartbeat 30s"):  # noqa: RUF001
        await queue.enqueue("create_case", None, lease_seconds=35)
    queue.declare(WorkClass(kind="slow", lease_seconds=100, heartbeat_seconds=40))
    # 100 > 40 + 20 holds for the class, but not with a per-call heartbeat of 90.
    with pytest.raises(IntervalRuleViolation, match="= 110s"):
        await queue.enqueue("slow", None, heartbeat_seconds=90)
    with pytest.raises(IntervalRuleViolation):
        await queue.enqueue_many([{"kind": "slow", "jitter_seconds": 60}])
    assert await queue.list_jobs() == []


async def test_claim_grants_a_lease_once_with_growing_tokens(queue: LeaseQueue) -> None:
    ids = await queue.enqueue_many([{"kind": "create_case", "payload": i} for i in range(3)])
    before = await queue.now()
    [first] = await queue.claim("w1", kinds=["create_case"], limit=1)
    rest = await queue.claim("w2", kinds=["create_case"], limit=5)
    assert await queue.claim("w3", kinds=["create_case"], limit=5) == []
    assert [first.job_id] + [lease.job_id for lease in rest] == ids
    tokens = [first.fencing_token] + [lease.fencing_token for lease in rest]
    assert tokens == sorted(set(tokens))
    assert first.owner_id == "w1" and {lease.owner_id for lease in rest} == {"w2"}
    assert first.attempt == 1 and first.max_attempts == 5
    assert first.payload == 0
    assert first.lease_until.tzinfo is not None
    assert first.lease_until.utcoffset() == timedelta(0)
    assert before + timedelta(seconds=80) < first.lease_until < before + timedelta(seconds=100)
    job = await queue.get(first.job_id)
    assert job.state == "running"
    assert (job.owner_id, job.fencing_token) == ("w1", first.fencing_token)
    [attempt] = await queue.attempts(first.job_id)
    assert (attempt.owner_id, attempt.fencing_token, attempt.attempt) == ("w1", tokens[0], 1)
    assert attempt.ended_at is None and attempt.outcome is None


async def test_claim_takes_only_the_kinds_asked_for(queue: LeaseQueue) -> None:
    await queue.enqueue("ocr", None)
    assert await queue.claim("w1", kinds=["create_case"], limit=5) == []
    assert await queue.claim("w1", kinds=[], limit=5) == []
    with pytest.raises(TypeError, match=r"kinds=\['ocr'\]"):
        await queue.claim("w1", kinds="ocr")
    [lease] = await queue.claim("w1", limit=5)
    assert lease.kind == "ocr"


async def test_run_after_delays_the_job(queue: LeaseQueue) -> None:
    job_id = await queue.enqueue("create_case", None, run_after=3600)
    assert await queue.claim("w1", limit=1) == []
    job = await queue.get(job_id)
    assert job.run_after > await queue.now() + timedelta(seconds=3000)


async def test_extend_renews_only_for_the_current_owner(queue: LeaseQueue) -> None:
    await queue.enqueue("create_case", None, **SHORT)
    lease = await claim_one(queue, "w1")
    await wait_for_clock_to_move(queue)
    renewed = await queue.extend(lease)
    assert renewed is not None
    assert renewed.lease_until > lease.lease_until
    assert renewed.fencing_token == lease.fencing_token
    job = await queue.get(lease.job_id)
    assert job.lease_until == renewed.lease_until
    assert await queue.extend(_with(lease, owner_id="w2")) is None
    assert await queue.extend(_with(lease, fencing_token=lease.fencing_token + 1)) is None
    await wait_until_expired(queue, renewed)
    assert await queue.extend(renewed) is None  # expired: zero rows even with no new owner


async def test_extend_many_answers_per_lease(queue: LeaseQueue) -> None:
    await queue.enqueue_many([{"kind": "create_case", "payload": i} for i in range(3)])
    leases = await queue.claim("w1", limit=3)
    await wait_for_clock_to_move(queue)
    stale = _with(leases[1], fencing_token=leases[1].fencing_token + 100)
    renewed = await queue.extend_many([leases[0], stale, leases[2]])
    assert renewed[1] is None
    for old, new in ((leases[0], renewed[0]), (leases[2], renewed[2])):
        assert new is not None
        assert (new.job_id, new.fencing_token) == (old.job_id, old.fencing_token)
        assert new.lease_until > old.lease_until
        assert (await queue.get(new.job_id)).lease_until == new.lease_until
    assert (await queue.get(leases[1].job_id)).lease_until == leases[1].lease_until
    assert await queue.extend_many([]) == []


async def test_expired_lease_is_reclaimed_and_the_old_owner_is_fenced(queue: LeaseQueue) -> None:
    job_id = await queue.enqueue("create_case", {"n": 1}, **SHORT)
    old = await claim_one(queue, "w1")
    await wait_until_expired(queue, old)
    new = await claim_one(queue, "w2")
    assert (new.job_id, new.attempt) == (job_id, 2)
    assert new.fencing_token > old.fencing_token
    assert await queue.extend(old) is None
    assert await queue.complete(old, {"from": "w1"}) is False
    assert await queue.fail(old, "late") is False
    assert await queue.release(old) is False
    assert await queue.commit_stage(old, "draft", {"from": "w1"}) is False
    assert await queue.complete(new, {"from": "w2"}) is True
    job = await queue.get(job_id)
    assert (job.state, job.result, job.owner_id) == ("succeeded", {"from": "w2"}, "w2")
    first, second = await queue.attempts(job_id)
    assert (first.owner_id, first.outcome) == ("w1", "lease_expired")
    assert first.error == "lease expired on attempt 1 of 5"
    assert first.ended_at is not None
    assert (second.owner_id, second.outcome, second.attempt) == ("w2", "succeeded", 2)


async def test_an_expired_lease_commits_nothing_before_anyone_reclaims_it(
    queue: LeaseQueue,
) -> None:
    job_id = await queue.enqueue("create_case", None, **SHORT)
    lease = await claim_one(queue, "w1")
    await wait_until_expired(queue, lease)
    # Same owner, same token, nobody else took the job: the lease ran out all the same.
    assert await queue.extend_many([lease]) == [None]
    assert await queue.complete_many([(lease, {"late": True})]) == [False]
    assert await queue.fail(lease, "late") is False
    assert await queue.release(lease) is False
    assert await queue.commit_stage(lease, "draft", {"late": True}) is False
    job = await queue.get(job_id)
    assert (job.state, job.owner_id, job.result, job.error) == ("running", "w1", None, None)
    assert await queue.stage_result(lease, "draft") is None
    [attempt] = await queue.attempts(job_id)
    assert attempt.outcome is None


async def test_expired_lease_with_no_attempt_left_fails_the_job(queue: LeaseQueue) -> None:
    job_id = await queue.enqueue("create_case", None, max_attempts=2, **SHORT)
    for owner in ("w1", "w2"):
        lease = await claim_one(queue, owner)
        await wait_until_expired(queue, lease)
    assert await queue.claim("w3", kinds=["create_case"], limit=1) == []
    job = await queue.get(job_id)
    assert job.state == "failed"
    assert job.error == "lease expired on attempt 2 of 2"
    assert job.lease_until is None
    outcomes = [a.outcome for a in await queue.attempts(job_id)]
    assert outcomes == ["lease_expired", "lease_expired"]
    assert await queue.extend(lease) is None


async def test_complete_stores_the_result_once(queue: LeaseQueue) -> None:
    job_id = await queue.enqueue("create_case", None)
    lease = await claim_one(queue, "w1")
    assert await queue.complete(_with(lease, fencing_token=lease.fencing_token - 1), 1) is False
    result = {"case_id": "CASE-7", "notes": ["Проверить", None, 1.5]}
    assert await queue.complete(lease, result) is True
    assert await queue.complete(lease, {"again": True}) is False
    job = await queue.get(job_id)
    assert (job.state, job.result, job.lease_until) == ("succeeded", result, None)
    [attempt] = await queue.attempts(job_id)
    assert attempt.outcome == "succeeded" and attempt.ended_at is not None


@pytest.mark.parametrize("value", [["a", "b"], [], [[1, 2], {"x": []}], "text", 0, None])
async def test_any_json_value_round_trips_as_payload_and_result(
    queue: LeaseQueue, value: Any
) -> None:
    job_id = await queue.enqueue("create_case", value, idempotency_key="json-shapes")
    lease = await claim_one(queue, "w1")
    assert lease.payload == value
    assert await queue.complete(lease, value) is True
    job = await queue.get(job_id)
    assert (job.payload, job.result) == (value, value)


async def test_complete_many_answers_per_lease(queue: LeaseQueue) -> None:
    await queue.enqueue_many([{"kind": "create_case", "payload": i} for i in range(3)])
    leases = await queue.claim("w1", limit=3)
    stale = _with(leases[1], owner_id="someone-else")
    answers = await queue.complete_many([(leases[0], "a"), (stale, "b"), (leases[2], "c")])
    assert answers == [True, False, True]
    states = {job.id: (job.state, job.result) for job in await queue.list_jobs()}
    assert states[leases[0].job_id] == ("succeeded", "a")
    assert states[leases[1].job_id] == ("running", None)


async def test_fail_retries_after_backoff_until_attempts_run_out(queue: LeaseQueue) -> None:
    queue.declare(
        WorkClass(kind="flaky", max_attempts=3, backoff_base_seconds=40, backoff_max_seconds=60)
    )
    job_id = await queue.enqueue("flaky", None)
    lease = await claim_one(queue, "w1", "flaky")
    now = await queue.now()
    assert await queue.fail(lease, {"code": "upstream_503"}) is True
    job = await queue.get(job_id)
    assert (job.state, job.error, job.owner_id) == ("queued", {"code": "upstream_503"}, None)
    # Attempt 1: between half and all of 40s.
    assert now + timedelta(seconds=19) < job.run_after < now + timedelta(seconds=41)
    assert await queue.claim("w1", kinds=["flaky"]) == []
    assert [a.outcome for a in await queue.attempts(job_id)] == ["retry_scheduled"]

    assert await queue.fail(lease, "late") is False  # the first fail ended the lease


async def test_failed_attempts_are_retried_until_none_is_left(queue: LeaseQueue) -> None:
    queue.declare(
        WorkClass(kind="flaky", max_attempts=3, backoff_base_seconds=0.05, backoff_max_seconds=0.1)
    )
    job_id = await queue.enqueue("flaky", None)
    for attempt in (1, 2, 3):
        lease = await _claim_when_due(queue, f"w{attempt}", "flaky")
        assert (lease.job_id, lease.attempt) == (job_id, attempt)
        assert await queue.fail(lease, f"error {attempt}") is True
    job = await queue.get(job_id)
    assert (job.state, job.error, job.attempt) == ("failed", "error 3", 3)
    outcomes = [a.outcome for a in await queue.attempts(job_id)]
    assert outcomes == ["retry_scheduled", "retry_scheduled", "failed"]
    assert await queue.claim("w9", kinds=["flaky"]) == []


async def _claim_when_due(queue: LeaseQueue, owner: str, kind: str) -> Lease:
    for _ in range(100):
        leases = await queue.claim(owner, kinds=[kind], limit=1)
        if leases:
            return leases[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {kind} job became due")


async def test_fail_with_retry_in_and_permanent(queue: LeaseQueue) -> None:
    job_id = await queue.enqueue("create_case", None)
    lease = await claim_one(queue, "w1")
    assert await queue.fail(lease, "try again now", retry_in=0) is True
    lease = await claim_one(queue, "w2")
    assert lease.attempt == 2
    assert await queue.fail(lease, {"code": "validation"}, permanent=True) is True
    job = await queue.get(job_id)
    assert (job.state, job.error) == ("failed", {"code": "validation"})
    assert await queue.claim("w3", limit=1) == []


async def test_cancel_voids_a_running_lease(queue: LeaseQueue) -> None:
    queued = await queue.enqueue("create_case", None, idempotency_key="q")
    running = await queue.enqueue("create_case", None, idempotency_key="r")
    first = await claim_one(queue, "w1")
    assert first.job_id == queued
    assert await queue.cancel(queued, reason="customer withdrew") is True
    lease = await claim_one(queue, "w1")
    assert lease.job_id == running
    assert await queue.cancel(running, reason="operator") is True
    assert await queue.extend(lease) is None
    assert await queue.complete(lease, "done") is False
    assert await queue.cancel(running) is False  # already finished
    job = await queue.get(running)
    assert (job.state, job.error, job.lease_until) == ("cancelled", "operator", None)
    outcomes = {a.job_id: a.outcome for a in await queue.attempts(queued)}
    outcomes |= {a.job_id: a.outcome for a in await queue.attempts(running)}
    assert outcomes == {queued: "cancelled", running: "cancelled"}
    with pytest.raises(JobNotFound):
        await queue.cancel(10_000)
    with pytest.raises(JobNotFound):
        await queue.get(10_000)


async def test_release_gives_work_back_without_counting_the_attempt(queue: LeaseQueue) -> None:
    job_id = await queue.enqueue("create_case", None, max_attempts=1)
    lease = await claim_one(queue, "w1")
    assert await queue.release(lease) is True
    assert await queue.extend(lease) is None
    job = await queue.get(job_id)
    assert (job.state, job.attempt, job.owner_id) == ("queued", 0, None)
    again = await claim_one(queue, "w2")
    assert (again.attempt, again.max_attempts) == (1, 1)
    assert again.fencing_token > lease.fencing_token
    assert [a.outcome for a in await queue.attempts(job_id)] == ["released", None]


async def test_stages_are_committed_only_by_the_owner_and_survive_a_retry(
    queue: LeaseQueue,
) -> None:
    await queue.enqueue("report", None, idempotency_key="report:42", **SHORT)
    first = await claim_one(queue, "w1", "report")
    assert await queue.stage_result(first, "fetch") is None
    assert await queue.commit_stage(first, "fetch", {"rows": 3}) is True
    assert await queue.commit_stage(first, "fetch", {"rows": 3}) is True  # same owner again
    assert await queue.commit_stage(_with(first, owner_id="w9"), "draft", 1) is False
    await wait_until_expired(queue, first)
    second = await claim_one(queue, "w2", "report")
    stored = await queue.stage_result(second, "fetch")
    assert stored is not None
    assert (stored.result, stored.fencing_token) == ({"rows": 3}, first.fencing_token)
    assert stored.idempotency_key == "report:42:fetch"
    assert stored.committed_at.tzinfo is not None
    # The stage is committed already: a later attempt cannot overwrite it.
    assert await queue.commit_stage(second, "fetch", {"rows": 4}) is False
    assert await queue.commit_stage(first, "draft", "stale") is False
    assert await queue.commit_stage(second, "draft", "ok") is True
    assert await queue.stage_result(second, "draft") is not None


async def test_values_that_are_not_json_are_refused_before_the_store(queue: LeaseQueue) -> None:
    with pytest.raises(TypeError, match="payload must be JSON"):
        await queue.enqueue("create_case", {"ids": {1, 2}})
    assert await queue.list_jobs() == []
    await queue.enqueue("create_case", None)
    lease = await claim_one(queue, "w1")
    with pytest.raises(TypeError, match="result must be JSON"):
        await queue.complete(lease, {1: "not a string key"})
    with pytest.raises(TypeError, match="error must be JSON"):
        await queue.fail(lease, object())
    assert await queue.complete(lease, {"ok": True}) is True


async def test_list_jobs_filters_newest_first(queue: LeaseQueue) -> None:
    a = await queue.enqueue("a", None)
    b = await queue.enqueue("b", None)
    c = await queue.enqueue("a", None)
    await claim_one(queue, "w1", "b")
    assert [j.id for j in await queue.list_jobs()] == [c, b, a]
    assert [j.id for j in await queue.list_jobs(kind="a")] == [c, a]
    assert [j.id for j in await queue.list_jobs(state="running")] == [b]
    assert [j.id for j in await queue.list_jobs(limit=1)] == [c]
    with pytest.raises(ValueError, match="unknown job state"):
        await queue.list_jobs(state="done")  # type: ignore[arg-type]


async def test_now_is_the_database_clock_in_utc(queue: LeaseQueue) -> None:
    now = await queue.now()
    assert now.tzinfo is not None and now.utcoffset() == timedelta(0)
    assert abs(now - datetime.now(UTC)) < timedelta(minutes=5)


async def test_wait_for_work_wakes_when_work_is_queued(queue: LeaseQueue) -> None:
    # The first wait may return at once (PostgreSQL: the listener was just set up).
    await queue.wait_for_work(["create_case"], timeout=2)
    await queue.claim("w1", kinds=["create_case"])
    assert await queue.wait_for_work(["create_case"], timeout=0.3) is False
    waiter = asyncio.create_task(queue.wait_for_work(["create_case"], timeout=30))
    # Nothing to wake it yet, and work of another kind does not either: the waiter must
    # still be waiting a while after each.
    assert not (await asyncio.wait({waiter}, timeout=0.2))[0]
    await queue.enqueue("other_kind", None)
    assert not (await asyncio.wait({waiter}, timeout=0.2))[0]
    await queue.enqueue("create_case", None)
    assert await asyncio.wait_for(waiter, 40) is True
    [lease] = await queue.claim("w1", kinds=["create_case"])
    # Work given back is announced as well.
    assert await queue.wait_for_work(["create_case"], timeout=0.3) is False
    waiter = asyncio.create_task(queue.wait_for_work(["create_case"], timeout=30))
    assert not (await asyncio.wait({waiter}, timeout=0.2))[0]
    assert await queue.release(lease) is True
    assert await asyncio.wait_for(waiter, 40) is True


def _with(lease: Lease, **changes: Any) -> Lease:
    return replace(lease, **changes)


async def test_queue_remembers_its_url_for_the_heartbeat_connection(
    queue: LeaseQueue, store_url: str
) -> None:
    assert queue.url == store_url
