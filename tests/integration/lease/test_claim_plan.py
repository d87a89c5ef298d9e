"""A claim costs the same whatever the backlog: read the plans the stores make for every claim
variant (one kind, several, any) on a table of a few thousand queued jobs, a few thousand
finished ones and some expired leases, after ANALYZE.

What must never come back: a sequential scan of the jobs (or attempts) table, or a write fed
by a row estimate that grows with the backlog (the planner once guessed a tenth of the table
for a computed LIMIT and hash-joined the whole table into the claim's UPDATE).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from fencegate.lease import Lease, LeaseQueue
from fencegate.store.queries import queries

QUEUED = 4000
FINISHED = 3000
EXPIRED = 20
LIMIT = 10
# A claim of LIMIT jobs touches tens of rows; a tenth of the backlog is hundreds.
SMALL = 100
# The claim's first argument: the owner of each of its LIMIT slots.
SLOTS = f"array_fill('w'::text, ARRAY[{LIMIT}])"

JOB_COLUMNS = (
    "kind, state, owner_id, lease_until, fencing_token, attempt, idempotency_key, max_attempts,"
    " lease_seconds, heartbeat_seconds, jitter_seconds"
)

# Each PostgreSQL variant, its kind filter's type, and the argument given.
PG_VARIANTS = {
    "lease_claim_one_kind": ("text", "'k'"),
    "lease_claim_kinds": ("text[]", "ARRAY['k', 'other']"),
    "lease_claim_any": ("text[]", "NULL"),
}


def _nodes(
    node: dict[str, Any], *, under_limit: bool = False
) -> Iterator[tuple[dict[str, Any], bool]]:
    """Every plan node, and whether a Limit above it stops it (an index scan under a Limit
    estimates all the rows of its index, but is read only until the Limit is met)."""
    yield node, under_limit
    below = under_limit or node["Node Type"] == "Limit"
    for child in node.get("Plans", []):
        yield from _nodes(child, under_limit=below)


def _describe(node: dict[str, Any]) -> str:
    where = node.get("Relation Name") or node.get("Subplan Name") or ""
    return f"{node['Node Type']} {where} (rows={node['Plan Rows']})"


async def _seed_postgres(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            f"""
            INSERT INTO fencegate_jobs ({JOB_COLUMNS})
            SELECT CASE WHEN g % 2 = 0 THEN 'k' ELSE 'other' END, 'queued', NULL, NULL, NULL,
                   0, 'q:' || g, 5, 90, 30, 20
              FROM generate_series(1, {QUEUED}) AS g;
            INSERT INTO fencegate_jobs ({JOB_COLUMNS})
            SELECT 'k', 'succeeded', 'w', NULL, g, 1, 's:' || g, 5, 90, 30, 20
              FROM generate_series(1, {FINISHED}) AS g;
            INSERT INTO fencegate_jobs ({JOB_COLUMNS})
            SELECT 'k', 'running', 'w', now() - interval '1 minute', {FINISHED} + g,
                   CASE WHEN g % 2 = 0 THEN 5 ELSE 1 END, 'r:' || g, 5, 90, 30, 20
              FROM generate_series(1, {EXPIRED}) AS g;
            INSERT INTO fencegate_job_attempts (fencing_token, job_id, attempt, owner_id)
            SELECT fencing_token, id, attempt, owner_id FROM fencegate_jobs
             WHERE fencing_token IS NOT NULL;
            SELECT setval('fencegate_fencing_tokens', {FINISHED + EXPIRED});
            INSERT INTO fencegate_work_classes (kind, max_running, max_running_per_key, provider)
            VALUES ('k', 1000, 100, 'p');
            INSERT INTO fencegate_rate_limits (provider, capacity, per_seconds, tokens)
            VALUES ('p', 1000, 1, 1000);
            ANALYZE fencegate_jobs;
            ANALYZE fencegate_job_attempts;
            ANALYZE fencegate_work_classes;
            ANALYZE fencegate_rate_limits;
            """  # noqa: S608 (constants of this module)
        )
    finally:
        await conn.close()


async def _pg_plan(url: str, name: str, mode: str) -> dict[str, Any]:
    kind_type, kind_arg = PG_VARIANTS[name]
    conn = await asyncpg.connect(url)
    try:
        # A custom plan is what the server makes for a statement's first executions (the
        # values known); a generic plan is what it may switch to after them.
        await conn.execute(f"SET plan_cache_mode = {mode}")
        await conn.execute(
            f"PREPARE claim(text[], {kind_type}, int) AS {queries('postgresql')[name]}"
        )
        raw = await conn.fetchval(
            f"EXPLAIN (FORMAT JSON) EXECUTE claim({SLOTS}, {kind_arg}, {LIMIT})"
        )
    finally:
        await conn.close()
    plan: dict[str, Any] = json.loads(raw)[0]["Plan"]
    return plan


@pytest.fixture
async def seeded_pg(pg_url: str) -> str:
    await _seed_postgres(pg_url)
    return pg_url


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", sorted(PG_VARIANTS))
async def test_postgres_claims_from_indexes_only(seeded_pg: str, name: str, mode: str) -> None:
    plan = await _pg_plan(seeded_pg, name, mode)
    nodes = list(_nodes(plan))
    scanned = [
        _describe(node)
        for node, _ in nodes
        if node["Node Type"] == "Seq Scan"
        and node.get("Relation Name") in ("fencegate_jobs", "fencegate_job_attempts")
    ]
    assert not scanned, f"{name} ({mode}) reads a whole table: {scanned}"
    writes = [
        _describe(node)
        for node, _ in nodes
        if node["Node Type"] == "ModifyTable" and node["Plan Rows"] > SMALL
    ]
    assert not writes, (
        f"{name} ({mode}) expects to write rows in proportion to the backlog: {writes}"
    )
    # Expired leases come from a range of the running jobs' index (kind, lease end), not from
    # reading every running job (a Worker claiming ahead holds many) to check its lease.
    every_running = [
        _describe(node)
        for node, _ in nodes
        if node.get("Relation Name") == "fencegate_jobs" and "lease_until" in node.get("Filter", "")
    ]
    assert not every_running, f"{name} ({mode}) reads every running job: {every_running}"
    if mode == "force_custom_plan":
        # With the limit known, nothing but the index walks a Limit stops may expect more
        # than a batch's worth of rows.
        large = [
            _describe(node) for node, stopped in nodes if not stopped and node["Plan Rows"] > SMALL
        ]
        assert not large, f"{name} expects rows in proportion to the backlog: {large}"


# The queue's pool lets the server keep a generic plan (made once, without the values) when it
# costs no more than planning each call. Kept from when the tables were a few rows, such a
# plan must still reach rows through indexes once they have grown: each statement, its
# parameters' types and arguments that match nothing.
PG_KEPT = {
    "lease_claim_one_kind": "(text[], text, int) AS {} ; EXECUTE s('{{w}}', 'k', 10)",
    "lease_claim_kinds": "(text[], text[], int) AS {} ; EXECUTE s('{{w}}', ARRAY['k'], 10)",
    "lease_claim_any": "(text[], text[], int) AS {} ; EXECUTE s('{{w}}', NULL, 10)",
    "lease_extend_many": (
        "(bigint[], text[], bigint[]) AS {} ; EXECUTE s('{{0}}', '{{w}}', '{{0}}')"
    ),
    "lease_complete_many": (
        "(bigint[], text[], bigint[], text[]) AS {} ; EXECUTE s('{{0}}', '{{w}}', '{{0}}', '{{1}}')"
    ),
    "lease_fail_many": (
        "(bigint[], text[], bigint[], text[], float8[]) AS {} ;"
        " EXECUTE s('{{0}}', '{{w}}', '{{0}}', '{{1}}', '{{1}}')"
    ),
    "lease_release": "(bigint, text, bigint) AS {} ; EXECUTE s(0, 'w', 0)",
    "lease_commit_stage_many": (
        "(bigint[], text[], bigint[], text[], text[], text[]) AS {} ;"
        " EXECUTE s('{{0}}', '{{w}}', '{{0}}', '{{n}}', '{{n}}', '{{1}}')"
    ),
}


async def _analyze(url: str) -> None:
    """Statistics now, as autovacuum would gather them at some point."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


@pytest.fixture
async def small_queue(pg_url: str) -> AsyncIterator[LeaseQueue]:
    """A queue whose tables were analyzed while they held a few rows (as autovacuum does
    soon after a queue starts): the state a kept plan is most likely made in."""
    queue = await LeaseQueue.connect(pg_url, timeout=30)
    try:
        await queue.enqueue_many([{"kind": "k", "payload": n} for n in range(4)], timeout=30)
        for lease in await queue.claim("w", kinds=["k"], limit=2, timeout=30):
            await queue.complete(lease, None, timeout=30)
        await _analyze(pg_url)
        yield queue
    finally:
        await queue.close()


@pytest.mark.parametrize("name", sorted(PG_KEPT))
async def test_postgres_kept_plans_never_scan_a_table_whole(
    small_queue: LeaseQueue, name: str
) -> None:
    prepare, execute = PG_KEPT[name].format(queries("postgresql")[name]).split(" ; ")

    async def generic_plan(conn: asyncpg.Connection) -> str:
        # On one of the queue's own connections (its settings), the plan kept after the
        # first executions, made now.
        async with conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await conn.execute(f"PREPARE s{prepare}")
            try:
                return str(await conn.fetchval(f"EXPLAIN (FORMAT JSON) {execute}"))
            finally:
                await conn.execute("DEALLOCATE s")

    db = getattr(getattr(small_queue, "_driver"), "_db")  # noqa: B009 - the queue's pool
    plan = json.loads(await db.run(generic_plan, timeout=30))[0]["Plan"]
    scanned = [
        _describe(node)
        for node, _ in _nodes(plan)
        if node["Node Type"] == "Seq Scan"
        and node.get("Relation Name", "").startswith("fencegate_job")
    ]
    assert not scanned, f"{name}'s kept plan reads a whole table once it has grown: {scanned}"


async def _executed_plan(queue: LeaseQueue, prepare: str, execute: str) -> dict[str, Any]:
    """The plan of ``EXECUTE s...`` as it ran (``PREPARE s...`` kept as a generic plan), on
    one of the queue's own connections (its settings), in a transaction rolled back after:
    nothing it wrote is kept."""

    async def run(conn: asyncpg.Connection) -> str:
        statement = conn.transaction()
        await statement.start()
        try:
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await conn.execute(f"PREPARE s{prepare}")
            return str(await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE s{execute}"))
        finally:
            await statement.rollback()
            await conn.execute("DEALLOCATE s")

    db = getattr(getattr(queue, "_driver"), "_db")  # noqa: B009 - the queue's pool
    plan: dict[str, Any] = json.loads(await db.run(run, timeout=30))[0]["Plan"]
    return plan


async def _backlog(pg_url: str, *, queued: int, finished: int) -> AsyncIterator[LeaseQueue]:
    """A queue whose jobs are all of one kind: ``queued`` waiting, ``finished`` done,
    analyzed (both multiples of 500)."""
    queue = await LeaseQueue.connect(pg_url, timeout=30)
    try:
        for start in range(0, queued + finished, 500):
            await queue.enqueue_many(
                [{"kind": "k", "payload": n} for n in range(start, start + 500)], timeout=30
            )
        for _ in range(finished // 500):
            leases = await queue.claim("w", kinds=["k"], limit=500, timeout=30)
            await queue.complete_many([(lease, None) for lease in leases], timeout=30)
        await _analyze(pg_url)
        yield queue
    finally:
        await queue.close()


@pytest.fixture
async def one_kind_backlog(pg_url: str) -> AsyncIterator[LeaseQueue]:
    """A queue in use whose jobs are all of one kind (a common queue: a selectivity of 1
    for the kind, and 0 for "not this kind"): QUEUED jobs waiting, FINISHED done, analyzed."""
    async for queue in _backlog(pg_url, queued=QUEUED, finished=FINISHED):
        yield queue


# A claim of each variant, run against a backlog of one kind.
ONE_KIND_ARGS = {
    "lease_claim_one_kind": "'k'",
    "lease_claim_kinds": "ARRAY['k']",
    "lease_claim_any": "NULL",
}


async def _granted_claim(queue: LeaseQueue, name: str, limit: int) -> list[dict[str, Any]]:
    """The nodes of an executed claim (statement ``name``, one kind) of ``limit`` slots of one
    job each, on the queue's own connection; asserts that it ran and granted the whole batch."""
    kind_type, _ = PG_VARIANTS[name]
    plan = await _executed_plan(
        queue,
        f"(text[], {kind_type}, int) AS {queries('postgresql')[name]}",
        f"(array_fill('w'::text, ARRAY[{limit}]), {ONE_KIND_ARGS[name]}, {limit})",
    )
    nodes = [node for node, _ in _nodes(plan)]
    granted = [n["Actual Rows"] for n in nodes if n["Node Type"] == "ModifyTable"]
    assert limit in granted, f"{name} granted no batch: {granted}"  # it ran, and claimed
    return nodes


@pytest.mark.parametrize("name", sorted(PG_VARIANTS))
async def test_postgres_claim_reads_a_batch_not_the_backlog(
    one_kind_backlog: LeaseQueue, name: str
) -> None:
    """Run, not only planned: on the queue's own connection (its settings), the kept plan of
    a claim of LIMIT jobs reads about LIMIT queued rows, whatever the backlog. A bitmap scan
    (the planner's pick once it estimated the filtered rows at one) read and sorted every
    queued job before the limit: 4,000 rows for 10 jobs."""
    nodes = await _granted_claim(one_kind_backlog, name, LIMIT)
    read = [
        f"{_describe(node)}: {node['Actual Rows'] * node['Actual Loops']} rows read"
        for node in nodes
        if node.get("Relation Name") == "fencegate_jobs"
        and node["Actual Rows"] * node["Actual Loops"] > SMALL
    ]
    assert not read, f"{name} reads the backlog to claim {LIMIT} jobs: {read}"


# A Worker's claim: as many slots as half its leases (the claims of the Workers sharing a queue
# go together, so a statement may carry several such batches).
CLAIM_BATCH = 50


@pytest.fixture
async def queued_backlog(pg_url: str) -> AsyncIterator[LeaseQueue]:
    """A queue of QUEUED jobs of one kind, none claimed yet, analyzed: the statistics with
    which the planner once chose to look the whole batch up again for each job granted."""
    async for queue in _backlog(pg_url, queued=QUEUED, finished=0):
        yield queue


@pytest.mark.parametrize("name", sorted(PG_VARIANTS))
async def test_postgres_claim_touches_each_granted_job_once(
    queued_backlog: LeaseQueue, name: str
) -> None:
    """A claim of CLAIM_BATCH jobs finds each job it grants by key once: its reads of the
    jobs table, and the rows its joins throw away, grow with the batch, not with its square.
    The grant once joined the chosen rows to an index lookup of the whole batch, run again for
    each of them (1,400 rows read and 1,225 thrown away for a claim of 50)."""
    nodes = await _granted_claim(queued_backlog, name, CLAIM_BATCH)
    read = sum(
        node["Actual Rows"] * node["Actual Loops"]
        for node in nodes
        if node.get("Relation Name") == "fencegate_jobs"
    )
    removed = sum(node.get("Rows Removed by Join Filter", 0) for node in nodes)
    assert read + removed <= 4 * CLAIM_BATCH, (
        f"{name}: {read} rows of fencegate_jobs read and {removed} removed by join filters "
        f"to claim {CLAIM_BATCH}: {[_describe(n) for n in nodes]}"
    )


# Held leases, and the batch of them each batch statement presents.
HELD = 250
BATCH = 50


@pytest.fixture
async def held_leases(pg_url: str) -> AsyncIterator[tuple[LeaseQueue, list[Lease]]]:
    """HELD running jobs of one kind (a Worker claiming ahead holds many), analyzed."""
    queue = await LeaseQueue.connect(pg_url, timeout=30)
    try:
        await queue.enqueue_many([{"kind": "k", "payload": n} for n in range(HELD)], timeout=30)
        leases: list[Lease] = []
        while len(leases) < HELD:
            leases += await queue.claim("w", kinds=["k"], limit=BATCH, timeout=30)
        await _analyze(pg_url)
        yield queue, leases
    finally:
        await queue.close()


def _batch_arguments(name: str, leases: list[Lease]) -> str:
    def array(values: list[object]) -> str:
        return "'{" + ",".join(str(v) for v in values) + "}'"

    ids = array([lease.job_id for lease in leases])
    owners = array([lease.owner_id for lease in leases])
    tokens = array([lease.fencing_token for lease in leases])
    texts = array(["null"] * len(leases))
    return {
        "lease_extend_many": f"({ids}, {owners}, {tokens})",
        "lease_complete_many": f"({ids}, {owners}, {tokens}, {texts})",
        "lease_fail_many": f"({ids}, {owners}, {tokens}, {texts}, {array([1] * len(leases))})",
    }[name]


@pytest.mark.parametrize("name", ["lease_extend_many", "lease_complete_many", "lease_fail_many"])
async def test_postgres_batch_statements_touch_each_lease_once(
    held_leases: tuple[LeaseQueue, list[Lease]], name: str
) -> None:
    """A heartbeat, completion or failure of BATCH leases, while HELD are held, does work in
    proportion to the batch: each lease found by key, not every lease presented compared with
    every lease held (n² rows through a nested loop: 2,500 for 50 leases)."""
    queue, leases = held_leases
    batch = leases[-BATCH:]
    prepare = PG_KEPT[name].format(queries("postgresql")[name]).split(" ; ")[0]
    plan = await _executed_plan(queue, prepare, _batch_arguments(name, batch))
    nodes = [node for node, _ in _nodes(plan)]
    assert plan["Actual Rows"] == BATCH, f"{name} did not take the batch: {plan['Actual Rows']}"
    rows = sum(n["Actual Rows"] * n["Actual Loops"] for n in nodes)
    removed = sum(n.get("Rows Removed by Join Filter", 0) for n in nodes)
    assert rows + removed <= 10 * BATCH, (
        f"{name}: {rows} rows through its plan and {removed} removed by join filters for "
        f"{BATCH} leases: {[_describe(n) for n in nodes]}"
    )


# SQLite: the claim is a few statements in one transaction; each variant of each.
SQLITE_STATEMENTS = (
    "lease_fail_exhausted",
    "lease_claimable_expired",
    "lease_claimable_queued",
    "lease_ready",
)
SQLITE_KINDS = {"one_kind": '["k"]', "kinds": '["k", "other"]', "any": None}


@pytest.fixture
def seeded_sqlite(sqlite_url: str) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    with conn:
        conn.execute(
            f"""
            INSERT INTO fencegate_jobs ({JOB_COLUMNS}, run_after, created_at, updated_at)
            WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g
                                     WHERE n < {FINISHED + QUEUED})
            SELECT CASE WHEN n % 2 = 0 THEN 'k' ELSE 'other' END,
                   CASE WHEN n <= {FINISHED} THEN 'succeeded' ELSE 'queued' END,
                   NULL, NULL, NULL, 0, 'j:' || n, 5, 90, 30, 20, 0, 0, 0
              FROM g
            """  # noqa: S608 (constants of this module)
        )
        conn.execute("ANALYZE")
    try:
        yield conn
    finally:
        conn.close()


@pytest.mark.parametrize("variant", sorted(SQLITE_KINDS))
@pytest.mark.parametrize("statement", SQLITE_STATEMENTS)
def test_sqlite_claims_from_indexes_only(
    seeded_sqlite: sqlite3.Connection, statement: str, variant: str
) -> None:
    sql = queries("sqlite")[f"{statement}_{variant}"]
    args = {"now": 1e10, "kinds": SQLITE_KINDS[variant], "limit": LIMIT}
    args |= {"full_kinds": "[]", "full_keys": "[]"}
    steps = [row[3] for row in seeded_sqlite.execute(f"EXPLAIN QUERY PLAN {sql}", args)]
    # "SCAN fencegate_jobs" alone reads the whole table (finished jobs too); a temporary
    # B-tree for ORDER BY sorts every match before the LIMIT, which only the running jobs
    # (as many as the fleet runs at once, not the backlog) may cost.
    running = any("fencegate_jobs_running" in s for s in steps)
    whole = [
        s
        for s in steps
        if s == "SCAN fencegate_jobs" or ("TEMP B-TREE FOR ORDER BY" in s and not running)
    ]
    assert not whole, f"{statement}_{variant} reads in proportion to the table: {steps}"


async def test_postgres_queue_keeps_one_plan_per_statement_from_the_first_call(
    pg_url: str,
) -> None:
    """The queue's connections run every statement on its generic plan from the first call.
    Left to the server's choice (``auto``), the first five calls are planned one by one, and
    where most jobs have finished the claim stayed planned on every call, at about twice the
    cost of the kept plan (the backlog benchmark's 1,000 queued behind 1,000,000 finished)."""
    queue = await LeaseQueue.connect(pg_url, timeout=30, pool_min_size=1, pool_max_size=1)
    try:
        await queue.enqueue_many([{"kind": "k", "payload": n} for n in range(40)], timeout=30)
        for _ in range(8):
            leases = await queue.claim("w", kinds=["k"], limit=2, timeout=30)
            await queue.complete_many([(lease, None) for lease in leases], timeout=30)

        async def plans(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            return list(
                await conn.fetch(
                    "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
                    " WHERE statement = $1 OR statement = $2",
                    queries("postgresql")["lease_claim_one_kind"],
                    queries("postgresql")["lease_complete_many"],
                )
            )

        db = getattr(getattr(queue, "_driver"), "_db")  # noqa: B009 - the queue's pool
        rows = await db.run(plans, timeout=30)
    finally:
        await queue.close()
    assert len(rows) == 2, "the claim and the commit were not prepared on the queue's connection"
    for row in rows:
        first_line = row["statement"].strip().splitlines()[0]
        assert (row["generic_plans"], row["custom_plans"]) == (8, 0), first_line
