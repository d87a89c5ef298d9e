"""Claim cost against the backlog: one ``claim(kinds=[k], limit=10)`` then ``complete_many``
on queues of 5,000, 50,000 and 500,000 queued jobs, and of 1,000 queued behind 1,000,000
finished ones. A claim is served from an index, so the worst p50 should stay within 1.5x of
the best. Beside it, the same claim with limits in force (a kind whose work class has
``max_running``, ``max_running_per_key`` and a provider with a token bucket, none of them
reached: what counting them costs), on the same number of jobs of that kind.

Each queue is its own database, seeded in bulk (``generate_series``, then ``VACUUM
ANALYZE``); the claims alternate between the queues in rounds so that a busy machine hurts
all alike. Part of ``python -m benchmarks.queue``; alone: ``python -m benchmarks.queue
--only backlog``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg

from benchmarks.stats import percentile
from fencegate.lease import LeaseQueue, RateLimit, WorkClass

KIND = "backlog"
LIMITED = "limited"
LIMIT = 10
# Limits that count but are not reached: the claim does all the work of enforcing them.
LIMITS = WorkClass(kind=LIMITED, max_running=100_000, max_running_per_key=5, provider="bench")
BUCKET = RateLimit("bench", 1_000_000, per_seconds=1.0)
# The worst p50 over the best: the bar.
BAR = 1.5

# The columns a bulk-loaded job needs; the rest take their defaults.
_INSERT = """
INSERT INTO fencegate_jobs (kind, state, owner_id, fencing_token, attempt, idempotency_key,
                            max_attempts, lease_seconds, heartbeat_seconds, jitter_seconds,
                            concurrency_key)
SELECT $1, $2, CASE WHEN $2 = 'queued' THEN NULL ELSE 'w' END,
       CASE WHEN $2 = 'queued' THEN NULL ELSE $3 + g END,
       CASE WHEN $2 = 'queued' THEN 0 ELSE 1 END,
       $1 || ':' || $2 || ':' || ($3 + g), 5, 90, 30, 20, 'customer:' || (g % 1000)
  FROM generate_series(1, $4::int) AS g
"""
_ATTEMPTS = """
INSERT INTO fencegate_job_attempts (fencing_token, job_id, attempt, owner_id, ended_at, outcome)
SELECT fencing_token, id, 1, 'w', now(), 'succeeded' FROM fencegate_jobs
 WHERE state = 'succeeded'
"""


@dataclass(frozen=True, slots=True)
class Backlog:
    name: str
    queued: int
    finished: int = 0


BACKLOGS = (
    Backlog("5,000 queued", 5_000),
    Backlog("50,000 queued", 50_000),
    Backlog("500,000 queued", 500_000),
    Backlog("1,000 queued behind 1,000,000 finished", 1_000, 1_000_000),
)


@dataclass
class Timings:
    backlog: Backlog
    claims_ms: list[float] = field(default_factory=list)
    limited_ms: list[float] = field(default_factory=list)


async def seed(url: str, backlog: Backlog) -> None:
    """Bulk-load the finished jobs (and their attempts) first, then the queued ones."""
    conn = await asyncpg.connect(url, timeout=30)
    try:
        if backlog.finished:
            await conn.execute(_INSERT, KIND, "succeeded", 0, backlog.finished, timeout=600)
            await conn.execute(_ATTEMPTS, timeout=600)
            await conn.execute(
                "SELECT setval('fencegate_fencing_tokens', $1)", backlog.finished, timeout=30
            )
        for kind in (KIND, LIMITED):
            await conn.execute(
                _INSERT, kind, "queued", backlog.finished, backlog.queued, timeout=600
            )
        await conn.execute("VACUUM ANALYZE fencegate_jobs", timeout=600)
        await conn.execute("VACUUM ANALYZE fencegate_job_attempts", timeout=600)
    finally:
        await conn.close()


async def claim_round(queue: LeaseQueue, timings: Timings, claims: int) -> None:
    """``claims`` times, for the plain kind and for the limited one: claim a batch (timed),
    then complete it (not timed)."""
    for _ in range(claims):
        for kind, into in ((KIND, timings.claims_ms), (LIMITED, timings.limited_ms)):
            start = time.perf_counter()
            leases = await queue.claim("bench", kinds=[kind], limit=LIMIT)
            into.append((time.perf_counter() - start) * 1000)
            assert len(leases) == LIMIT, f"{timings.backlog.name}: ran out of {kind} jobs"
            await queue.complete_many([(lease, None) for lease in leases])


@contextlib.asynccontextmanager
async def seeded_queues(
    databases: list[str], backlogs: tuple[Backlog, ...]
) -> AsyncIterator[list[LeaseQueue]]:
    queues: list[LeaseQueue] = []
    try:
        for url, backlog in zip(databases, backlogs, strict=True):
            queue = await LeaseQueue.connect(url, pool_min_size=1, pool_max_size=1)
            queue.declare(LIMITS)
            queue.declare_rate_limit(BUCKET)
            queues.append(queue)
            await queue.migrate()
            await seed(url, backlog)
        yield queues
    finally:
        for queue in queues:
            await queue.close()


async def measure(
    databases: list[str], *, rounds: int = 25, claims: int = 2, warmup: int = 5
) -> list[Timings]:
    """Claim timings per backlog, interleaved: ``rounds`` rounds of ``claims`` claims each,
    after ``warmup`` untimed claims per queue (plans cached, pages in memory)."""
    timings = [Timings(backlog) for backlog in BACKLOGS]
    async with seeded_queues(databases, BACKLOGS) as queues:
        for queue, timing in zip(queues, timings, strict=True):
            await claim_round(queue, Timings(timing.backlog), warmup)
        for _ in range(rounds):
            for queue, timing in zip(queues, timings, strict=True):
                await claim_round(queue, timing, claims)
    return timings


def print_table(timings: list[Timings]) -> float:
    """Print the backlog table; returns the worst p50 over the best (plain claims)."""
    p50s = [percentile(t.claims_ms, 0.5) for t in timings]
    limited = [percentile(t.limited_ms, 0.5) for t in timings]
    best, best_limited = min(p50s), min(limited)
    print()
    print(f"Claim cost against the backlog: claim(kinds=[k], limit={LIMIT}) then complete_many,")
    print(f"{len(timings[0].claims_ms)} claims per queue and kind, interleaved (PostgreSQL);")
    print("with limits: max_running, max_running_per_key and a provider bucket, none reached")
    print()
    print(
        "| queue | claim p50 ms | claim p99 ms | p50 x best "
        "| with limits p50 ms | with limits p99 ms | p50 x best | limits x plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for timing, p50, p50_limited in zip(timings, p50s, limited, strict=True):
        p99 = percentile(timing.claims_ms, 0.99)
        p99_limited = percentile(timing.limited_ms, 0.99)
        print(
            f"| {timing.backlog.name} | {p50:.2f} | {p99:.2f} | {p50 / best:.2f} "
            f"| {p50_limited:.2f} | {p99_limited:.2f} | {p50_limited / best_limited:.2f} "
            f"| {p50_limited / p50:.2f} |"
        )
    worst = max(p50s) / best
    worst_limited = max(limited) / best_limited
    print()
    for name, ratio in (("plain", worst), ("with limits", worst_limited)):
        verdict = "within" if ratio <= BAR else "NOT within"
        print(f"{name}: worst p50 / best p50 = {ratio:.2f} ({verdict} the {BAR}x bar).")
    return max(worst, worst_limited)
