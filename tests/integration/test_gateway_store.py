"""One conformance suite for the gateway stores, run against SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import asyncpg
import pytest

from fencegate.errors import StoreUnavailable
from fencegate.lease import LeaseQueue
from fencegate.store import (
    DecideRequest,
    GatewayStore,
    Outcome,
    Reservation,
    Resolution,
    StoredResponse,
    open_gateway_store,
)
from fencegate.store.inspect import Inspector
from fencegate.store.pg import PgDatabase
from fencegate.store.postgres import Q as PG_QUERIES
from fencegate.store.postgres import batch_tenant, split_steps, step_arguments
from tests.support.waits import wait_until

T = 30.0  # generous: the machine is shared

BASE = DecideRequest(
    tenant="t1",
    key="k",
    fingerprint="f" * 64,
    entity=None,
    fence=None,
    owner="gw-a",
    lease_seconds=30.0,
    ttl_seconds=3600.0,
    retry_unknown=True,
)

RESPONSE = StoredResponse(201, [("content-type", "application/json"), ("x-a", "1")], b"{}", "h")


async def wait_for_database_clock(url: str, seconds: float) -> None:
    """Wait until ``seconds`` have passed on the database clock, the one expiry is judged by
    (our own clock may run ahead of or behind it)."""
    inspector = await Inspector.open(url)
    try:
        start = await inspector.now()

        async def passed() -> bool:
            return await inspector.now() > start + seconds

        await wait_until(passed, timeout=T, what=f"{seconds}s on the database clock")
    finally:
        await inspector.close()


def holder(decision_attempt: int | None, request: DecideRequest = BASE) -> Reservation:
    assert decision_attempt is not None
    return Reservation(request.tenant, request.key or "", request.owner, decision_attempt)


async def test_new_key_is_reserved_then_in_flight(store: GatewayStore) -> None:
    first = await store.decide(BASE, timeout=T)
    assert (first.outcome, first.attempt) == (Outcome.RESERVED, 1)
    second = await store.decide(replace(BASE, owner="gw-b"), timeout=T)
    assert second.outcome is Outcome.IN_FLIGHT
    # How long ago the first holder reserved it: the gateway turns it into Retry-After.
    assert second.reserved_age is not None and 0 <= second.reserved_age < T


async def test_completed_key_replays_what_was_stored(store: GatewayStore) -> None:
    first = await store.decide(BASE, timeout=T)
    assert await store.complete(holder(first.attempt), RESPONSE, timeout=T)
    replay = await store.decide(BASE, timeout=T)
    assert replay.outcome is Outcome.REPLAY
    assert replay.response == RESPONSE


async def test_body_too_large_is_recorded_without_body(store: GatewayStore) -> None:
    first = await store.decide(BASE, timeout=T)
    large = replace(RESPONSE, body=None, sha256="abc")
    assert await store.complete(holder(first.attempt), large, timeout=T)
    replay = await store.decide(BASE, timeout=T)
    assert replay.response is not None
    assert (replay.response.body, replay.response.sha256) == (None, "abc")


async def test_other_fingerprint_is_a_mismatch(store: GatewayStore) -> None:
    await store.decide(BASE, timeout=T)
    other = await store.decide(replace(BASE, fingerprint="0" * 64), timeout=T)
    assert other.outcome is Outcome.MISMATCH


async def test_keys_are_per_tenant(store: GatewayStore) -> None:
    await store.decide(BASE, timeout=T)
    other = await store.decide(replace(BASE, tenant="t2", fingerprint="0" * 64), timeout=T)
    assert other.outcome is Outcome.RESERVED


async def test_release_frees_the_key(store: GatewayStore) -> None:
    first = await store.decide(BASE, timeout=T)
    assert await store.release(holder(first.attempt), timeout=T)
    assert (await store.decide(BASE, timeout=T)).outcome is Outcome.RESERVED


async def test_writes_are_conditional_on_the_holder(store: GatewayStore) -> None:
    first = await store.decide(BASE, timeout=T)
    stranger = Reservation("t1", "k", "gw-b", 1)
    old_attempt = Reservation("t1", "k", "gw-a", 7)
    for reservation in (stranger, old_attempt):
        assert not await store.complete(reservation, RESPONSE, timeout=T)
        assert not await store.release(reservation, timeout=T)
        assert not await store.mark_unknown(reservation, timeout=T)
        assert not await store.renew(reservation, 30, timeout=T)
    assert (await store.decide(BASE, timeout=T)).outcome is Outcome.IN_FLIGHT
    assert await store.renew(holder(first.attempt), 30, timeout=T)


async def test_expired_lease_is_taken_over_and_the_old_holder_cannot_record(
    store: GatewayStore, store_url: str
) -> None:
    short = replace(BASE, lease_seconds=0.2)
    first = await store.decide(short, timeout=T)
    await wait_for_database_clock(store_url, 0.2)
    assert not await store.renew(holder(first.attempt), 30, timeout=T)
    taken = await store.decide(replace(BASE, owner="gw-b"), timeout=T)
    assert (taken.outcome, taken.attempt) == (Outcome.TAKEN_OVER, 2)
    late = holder(first.attempt)
    assert not await store.complete(late, RESPONSE, timeout=T)
    new = Reservation("t1", "k", "gw-b", 2)
    assert await store.complete(new, RESPONSE, timeout=T)


@pytest.mark.parametrize(
    ("retry", "outcome"), [(True, Outcome.RETRY_UNKNOWN), (False, Outcome.UNKNOWN)]
)
async def test_outcome_unknown_per_route(
    store: GatewayStore, retry: bool, outcome: Outcome
) -> None:
    first = await store.decide(BASE, timeout=T)
    assert await store.mark_unknown(holder(first.attempt), timeout=T)
    again = await store.decide(replace(BASE, retry_unknown=retry), timeout=T)
    assert again.outcome is outcome
    if retry:
        assert again.attempt == 2


async def test_fence_is_max_and_stale_stores_nothing(store: GatewayStore) -> None:
    fenced = replace(BASE, entity="job:1", fence=5)
    assert (await store.decide(fenced, timeout=T)).last_accepted == 5
    stale = await store.decide(replace(fenced, key="k2", fence=4), timeout=T)
    assert (stale.outcome, stale.last_accepted) == (Outcome.STALE, 5)
    # Nothing was stored for k2: with a good fence it is a new key.
    again = await store.decide(replace(fenced, key="k2", fence=5), timeout=T)
    assert again.outcome is Outcome.RESERVED
    higher = await store.decide(replace(fenced, key=None, fence=9), timeout=T)
    assert (higher.outcome, higher.last_accepted) == (Outcome.FENCE_ONLY, 9)
    assert (await store.decide(replace(fenced, key=None, fence=8), timeout=T)).outcome is (
        Outcome.STALE
    )


async def test_fences_are_per_tenant_and_entity(store: GatewayStore) -> None:
    await store.decide(replace(BASE, key=None, entity="e", fence=100), timeout=T)
    for other in (replace(BASE, tenant="t2"), replace(BASE, entity="e2")):
        decision = await store.decide(
            replace(other, key=None, entity=other.entity or "e", fence=1), timeout=T
        )
        assert decision.outcome is Outcome.FENCE_ONLY


async def test_largest_fence_fits(store: GatewayStore) -> None:
    top = replace(BASE, key=None, entity="e", fence=2**63 - 1)
    assert (await store.decide(top, timeout=T)).last_accepted == 2**63 - 1


async def test_expired_key_is_free_again_and_purged(store: GatewayStore, store_url: str) -> None:
    first = await store.decide(replace(BASE, ttl_seconds=0.2), timeout=T)
    assert await store.complete(holder(first.attempt), RESPONSE, timeout=T)
    await store.decide(replace(BASE, key="gone", ttl_seconds=0.2), timeout=T)
    await store.decide(replace(BASE, key="kept"), timeout=T)
    await wait_for_database_clock(store_url, 0.2)
    assert (await store.decide(BASE, timeout=T)).outcome is Outcome.RESERVED
    counts = await store.purge(fence_ttl_seconds=3600, batch_size=1, timeout=T)
    assert counts.keys == 1  # "gone"; "k" was renewed above, "kept" has a day left
    assert (await store.decide(replace(BASE, key="kept"), timeout=T)).outcome is (Outcome.IN_FLIGHT)


async def test_purge_removes_idle_fences_and_expired_nonces(
    store: GatewayStore, store_url: str
) -> None:
    for entity in ("a", "b", "c"):
        await store.decide(replace(BASE, key=None, entity=entity, fence=3), timeout=T)
    assert await store.remember_nonce("key-1", "n-old", 0.2, tenant="t", timeout=T)
    assert await store.remember_nonce("key-1", "n-new", 3600, tenant="t", timeout=T)
    await wait_for_database_clock(store_url, 0.3)  # the fences' idle time below
    counts = await store.purge(fence_ttl_seconds=0.3, batch_size=2, timeout=T)
    assert (counts.keys, counts.fences, counts.nonces) == (0, 3, 1)
    # A purged fence no longer holds anything back.
    low = await store.decide(replace(BASE, key=None, entity="a", fence=1), timeout=T)
    assert low.outcome is Outcome.FENCE_ONLY
    assert not await store.remember_nonce("key-1", "n-new", 3600, tenant="t", timeout=T)


async def test_nonce_is_remembered_until_it_expires(store: GatewayStore, store_url: str) -> None:
    assert await store.remember_nonce("key-1", "abc", 0.2, tenant="t", timeout=T)
    assert not await store.remember_nonce("key-1", "abc", 0.2, tenant="t", timeout=T)
    assert await store.remember_nonce("key-2", "abc", 0.2, tenant="t", timeout=T)
    await wait_for_database_clock(store_url, 0.2)
    assert await store.remember_nonce("key-1", "abc", 60, tenant="t", timeout=T)


async def test_ping(store: GatewayStore) -> None:
    await store.ping(timeout=T)


async def test_concurrent_decisions_reserve_once(store: GatewayStore) -> None:
    decisions = await asyncio.gather(
        *(store.decide(replace(BASE, owner=f"gw-{i}"), timeout=T) for i in range(20))
    )
    outcomes = [d.outcome for d in decisions]
    assert outcomes.count(Outcome.RESERVED) == 1
    assert outcomes.count(Outcome.IN_FLIGHT) == 19


async def test_concurrent_fences_on_one_entity_end_at_the_highest(store: GatewayStore) -> None:
    decisions = await asyncio.gather(
        *(
            store.decide(replace(BASE, key=f"k{n}", entity="job:1", fence=n), timeout=T)
            for n in range(1, 11)
        )
    )
    for fence, decision in zip(range(1, 11), decisions, strict=True):
        if decision.outcome is Outcome.STALE:
            assert decision.last_accepted is not None and decision.last_accepted > fence
        else:
            assert decision.outcome is Outcome.RESERVED and decision.last_accepted == fence
    final = await store.decide(replace(BASE, key=None, entity="job:1", fence=9), timeout=T)
    assert (final.outcome, final.last_accepted) == (Outcome.STALE, 10)


@pytest.mark.timeout(120)
async def test_two_gateways_racing_on_shared_keys_and_entities_never_fail(store_url: str) -> None:
    """Decisions and records of two gateways (two connection pools) on overlapping keys
    and fences, in batches: every call answers (no deadlock, no error)."""
    stores = [await open_gateway_store(store_url, run_migrations=False) for _ in range(2)]

    async def one(gateway: int, n: int) -> Outcome:
        store = stores[gateway]
        request = replace(BASE, owner=f"gw-{gateway}", key=f"k{n % 7}", entity=f"e{n % 3}", fence=n)
        decision = await store.decide(request, timeout=T)
        if decision.outcome is Outcome.RESERVED or decision.outcome is Outcome.TAKEN_OVER:
            held = Reservation("t1", request.key or "", request.owner, decision.attempt or 1)
            if n % 2:
                assert await store.complete(held, RESPONSE, timeout=T)
            else:
                assert await store.release(held, timeout=T)
        return decision.outcome

    try:
        outcomes = await asyncio.gather(*(one(n % 2, n) for n in range(120)))
    finally:
        for store in stores:
            await store.close()
    assert Outcome.RESERVED in outcomes
    assert set(outcomes) <= {Outcome.RESERVED, Outcome.REPLAY, Outcome.IN_FLIGHT, Outcome.STALE}


# ------------------------------------------------------------------- unknown outcomes


async def test_expired_in_flight_key_is_unknown_unless_the_route_retries(
    store: GatewayStore,
) -> None:
    first = await store.decide(replace(BASE, lease_seconds=0.05), timeout=T)
    await wait_until_unknown(store)
    rejected = replace(BASE, owner="gw-b", retry_unknown=False)
    for _ in range(2):  # read-only: asking again changes nothing
        unknown = await store.decide(rejected, timeout=T)
        assert unknown.outcome is Outcome.UNKNOWN
        assert (unknown.key_state, unknown.attempt) == ("in_flight", first.attempt)
        assert unknown.unknown_since is not None
    taken = await store.decide(replace(BASE, owner="gw-b"), timeout=T)
    assert (taken.outcome, taken.attempt) == (Outcome.TAKEN_OVER, 2)


async def wait_until_unknown(store: GatewayStore) -> None:
    async def unknown() -> bool:
        record = await store.get_key(BASE.tenant, BASE.key or "", timeout=T)
        return record is not None and record.unknown

    await wait_until(unknown, timeout=T, what="the in-flight lease running out")


async def test_a_late_answer_completes_a_key_marked_unknown(store: GatewayStore) -> None:
    first = await store.decide(BASE, timeout=T)
    assert await store.mark_unknown(holder(first.attempt), timeout=T)
    unknown = await store.decide(replace(BASE, retry_unknown=False), timeout=T)
    assert (unknown.outcome, unknown.key_state) == (Outcome.UNKNOWN, "outcome_unknown")
    # The same holder's answer, recorded late (the store was away), still lands.
    assert await store.complete(holder(first.attempt), RESPONSE, timeout=T)
    replay = await store.decide(replace(BASE, retry_unknown=False), timeout=T)
    assert replay.outcome is Outcome.REPLAY and replay.response == RESPONSE


async def test_a_late_answer_never_overwrites_a_new_holder(store: GatewayStore) -> None:
    first = await store.decide(BASE, timeout=T)
    assert await store.mark_unknown(holder(first.attempt), timeout=T)
    retried = await store.decide(replace(BASE, owner="gw-b"), timeout=T)
    assert retried.outcome is Outcome.RETRY_UNKNOWN
    assert not await store.complete(holder(first.attempt), RESPONSE, timeout=T)
    again = await store.decide(replace(BASE, owner="gw-c"), timeout=T)
    assert again.outcome is Outcome.IN_FLIGHT


async def test_an_operator_resolves_only_unknown_keys(store: GatewayStore) -> None:
    async def resolve(answer: StoredResponse | None, by: str = "op") -> Resolution:
        # Margin 0: this test's requests are never on their way (see test_safe_release.py).
        return await store.resolve_key("t1", "k", answer, resolved_by=by, margin=0.0, timeout=T)

    assert (await resolve(RESPONSE)).result == "not_found"
    first = await store.decide(BASE, timeout=T)
    # In flight under a live lease: its gateway may be sending it now.
    live = await resolve(None)
    assert live.result == "blocked"
    assert live.before is not None and live.before.release_blocker == "lease_live"
    assert await store.mark_unknown(holder(first.attempt), timeout=T)
    done = await resolve(RESPONSE, "operator:me")
    assert done.result == "completed"
    record = await store.get_key("t1", "k", timeout=T)
    assert record is not None
    assert (record.state, record.owner, record.response_status, record.resolution) == (
        "completed",
        "operator:me",
        201,
        "operator",
    )
    replay = await store.decide(replace(BASE, retry_unknown=False), timeout=T)
    assert replay.outcome is Outcome.REPLAY and replay.response is not None
    assert replay.response.body == RESPONSE.body
    assert (await resolve(None)).result == "not_unknown"


async def test_an_operator_releases_an_unknown_key_and_the_next_request_runs(
    store: GatewayStore,
) -> None:
    # Each request a gateway reserves has its own owner (instance/request number), so an
    # answer still owed for the released reservation can never complete the next one.
    first = await store.decide(replace(BASE, owner="gw-a/1"), timeout=T)
    stale_holder = holder(first.attempt, replace(BASE, owner="gw-a/1"))
    assert await store.mark_unknown(stale_holder, timeout=T)
    released = await store.resolve_key("t1", "k", None, resolved_by="op", margin=0.0, timeout=T)
    assert released.result == "released" and released.after is None
    assert await store.get_key("t1", "k", timeout=T) is None
    again = await store.decide(replace(BASE, owner="gw-a/2", retry_unknown=False), timeout=T)
    assert (again.outcome, again.attempt) == (Outcome.RESERVED, 1)
    assert not await store.complete(stale_holder, RESPONSE, timeout=T)


async def commit_mode_after_step(
    url: str, items: list[DecideRequest | tuple[Reservation, StoredResponse]]
) -> str:
    """``synchronous_commit`` as the step statement leaves it for its transaction's commit."""
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            args = step_arguments(*split_steps(items), history=True)
            await conn.fetch(PG_QUERIES.step, batch_tenant(items), *args, None)  # no deadline
            mode = await conn.fetchval("SELECT current_setting('synchronous_commit')")
    finally:
        await conn.close()
    return str(mode)


async def test_a_batch_that_changes_nothing_commits_without_waiting_for_the_disk(
    pg_url: str,
) -> None:
    """Replays and refusals write only history rows: their commit may be asynchronous. A
    batch that reserves a key, moves a fence or records an answer must stay durable."""
    store = await open_gateway_store(pg_url)
    try:
        first = await store.decide(BASE, timeout=T)
        await store.complete(holder(first.attempt), RESPONSE, timeout=T)
        other = replace(BASE, key="held")
        held = await store.decide(other, timeout=T)
    finally:
        await store.close()
    replay = replace(BASE, owner="gw-b")
    reused = replace(BASE, fingerprint="0" * 64)
    in_flight = replace(other, owner="gw-b")
    assert await commit_mode_after_step(pg_url, [replay, reused, in_flight]) == "off"
    assert await commit_mode_after_step(pg_url, [replay, replace(BASE, key="new")]) == "on"
    assert await commit_mode_after_step(pg_url, [replace(replay, entity="e", fence=1)]) == "on"
    answer = (holder(held.attempt, other), RESPONSE)
    assert await commit_mode_after_step(pg_url, [replay, answer]) == "on"


async def fence_row(url: str, entity: str) -> tuple[int, str]:
    """The entity's last accepted fence, and the transaction that wrote its row's version."""
    conn = await asyncpg.connect(url)
    try:
        row = await conn.fetchrow(
            "SELECT last_accepted, xmin::text AS xmin FROM fencegate_fences"
            " WHERE tenant = $1 AND entity = $2",
            BASE.tenant,
            entity,
        )
    finally:
        await conn.close()
    assert row is not None
    return int(row["last_accepted"]), str(row["xmin"])


async def test_a_fenced_replay_whose_fence_is_already_accepted_writes_no_fence(
    pg_url: str,
) -> None:
    """A worker's retry of a completed call carries the fence it was accepted with: it raises
    nothing and forwards nothing, so the step reads the fence instead of rewriting it. A new
    key with the same fence, or another request under the same key, still writes (and locks)
    it; a higher fence on a replay is still raised, a lower one is still stale."""
    fenced = replace(BASE, key="fenced", entity="job:7", fence=3)
    store = await open_gateway_store(pg_url)
    try:
        first = await store.decide(fenced, timeout=T)
        await store.complete(holder(first.attempt, fenced), RESPONSE, timeout=T)
        before = await fence_row(pg_url, "job:7")
        retry = replace(fenced, owner="gw-b")
        replayed = await store.decide(retry, timeout=T)
        assert (replayed.outcome, replayed.last_accepted) == (Outcome.REPLAY, 3)
        assert replayed.response == RESPONSE
        assert await fence_row(pg_url, "job:7") == before  # not even rewritten as it was
        reserved = await store.decide(replace(fenced, key="next"), timeout=T)
        assert (reserved.outcome, reserved.last_accepted) == (Outcome.RESERVED, 3)
        written = await fence_row(pg_url, "job:7")
        assert written[1] != before[1]
        reused = await store.decide(replace(retry, fingerprint="0" * 64), timeout=T)
        assert reused.outcome is Outcome.MISMATCH
        assert (await fence_row(pg_url, "job:7"))[1] != written[1]
        raised = await store.decide(replace(retry, fence=4), timeout=T)
        assert (raised.outcome, raised.last_accepted) == (Outcome.REPLAY, 4)
        assert (await fence_row(pg_url, "job:7"))[0] == 4
        stale = await store.decide(retry, timeout=T)
        assert (stale.outcome, stale.last_accepted) == (Outcome.STALE, 4)
    finally:
        await store.close()


async def test_a_batch_of_fenced_replays_commits_without_waiting_for_the_disk(
    pg_url: str,
) -> None:
    """Fenced replays whose fence is already accepted change nothing: their batch's commit
    may be asynchronous, unlike one that also reserves a key with that fence."""
    fenced = replace(BASE, key="fenced", entity="job:7", fence=3)
    store = await open_gateway_store(pg_url)
    try:
        first = await store.decide(fenced, timeout=T)
        await store.complete(holder(first.attempt, fenced), RESPONSE, timeout=T)
    finally:
        await store.close()
    retry = replace(fenced, owner="gw-b")
    assert await commit_mode_after_step(pg_url, [retry, retry]) == "off"
    assert await commit_mode_after_step(pg_url, [retry, replace(fenced, key="next")]) == "on"


async def test_each_pool_plans_its_statements_as_its_tables_need(pg_url: str) -> None:
    """The gateway's statements are lookups by key, planned once (generic plans); the
    operator's reads filter on optional values (``$1 IS NULL OR state = $1``) and keep a
    plan for the values given, or they would scan whole tables; the lease queue plans each
    statement once too, but never a plan that scans a table whole (its tables grow from
    empty faster than they are analyzed, and a plan made while they were small would scan
    them once they have grown)."""
    store = await open_gateway_store(pg_url)
    inspector = await Inspector.open(pg_url)
    queue = await LeaseQueue.connect(pg_url, timeout=T)
    try:
        modes: list[tuple[str, str]] = []
        for owner in (store, inspector, getattr(queue, "_driver")):  # noqa: B009
            db = getattr(owner, "_db")  # noqa: B009 - the pool behind each one
            assert isinstance(db, PgDatabase)
            row = await db.run(
                lambda conn: conn.fetchrow(
                    "SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan')"
                ),
                timeout=T,
            )
            assert row is not None
            modes.append((row[0], row[1]))
    finally:
        await queue.close()
        await inspector.close()
        await store.close()
    assert modes == [("force_generic_plan", "on"), ("auto", "on"), ("force_generic_plan", "off")]


async def hold_fence_row(url: str, tenant: str, entity: str) -> asyncpg.Connection:
    """A connection in an open transaction holding ``entity``'s fence row lock, as a stalled
    writer would."""
    conn = await asyncpg.connect(url)
    await conn.execute("BEGIN")
    await conn.execute(
        "SELECT 1 FROM fencegate_fences WHERE tenant = $1 AND entity = $2 FOR UPDATE",
        tenant,
        entity,
    )
    return conn


async def test_a_step_past_its_deadline_rolls_back_instead_of_committing(pg_url: str) -> None:
    """The server checks the caller's remaining time before it lets a step commit."""
    store = await open_gateway_store(pg_url)
    await store.close()  # migrated and reachable
    conn = await asyncpg.connect(pg_url)
    try:
        args = step_arguments(*split_steps([BASE]), history=True)
        with pytest.raises(asyncpg.QueryCanceledError, match="deadline passed"):
            await conn.fetch(PG_QUERIES.step, BASE.tenant, *args, 0.001)  # a microsecond to spend
        assert await conn.fetchval("SELECT count(*) FROM fencegate_idempotency_keys") == 0
    finally:
        await conn.close()


async def test_a_decision_stalled_past_its_timeout_leaves_no_reservation(pg_url: str) -> None:
    """Another transaction holds the entity's fence row past the store timeout: the decision
    fails (503 to the client), and once the row is free nothing of it commits late."""
    store = await open_gateway_store(pg_url)
    fenced = replace(BASE, entity="acct-1", fence=1)
    try:
        first = await store.decide(replace(fenced, key="first"), timeout=T)
        assert first.outcome is Outcome.RESERVED
        lock = await hold_fence_row(pg_url, "t1", "acct-1")
        try:
            with pytest.raises(StoreUnavailable):
                await store.decide(fenced, timeout=1.0)
        finally:
            await lock.execute("COMMIT")
            await lock.close()

        async def stalled_step_ended() -> bool:
            return await store_busy(pg_url) == 0

        await wait_until(stalled_step_ended, timeout=T, what="the stalled step to end")
        assert await store.get_key("t1", "k", timeout=T) is None
    finally:
        await store.close()


async def store_busy(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'fencegate-gateway' AND state = 'active'"
            )
        )
    finally:
        await conn.close()


async def test_a_lease_runs_from_when_the_reservation_is_written(pg_url: str) -> None:
    """A decision that waited for a lock is not born with its lease already run down."""
    store = await open_gateway_store(pg_url)
    fenced = replace(BASE, entity="acct-1", fence=1, lease_seconds=2.0)
    try:
        await store.decide(replace(fenced, key="first"), timeout=T)
        lock = await hold_fence_row(pg_url, "t1", "acct-1")
        deciding = asyncio.create_task(store.decide(fenced, timeout=T))
        await wait_until(lambda: store_busy(pg_url), timeout=T, what="the step to wait")
        await wait_for_database_clock(pg_url, 2.5)  # longer than the lease
        freed_at = await lock.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
        await lock.execute("COMMIT")
        await lock.close()
        decision = await deciding
        assert decision.outcome is Outcome.RESERVED
        record = await store.get_key("t1", "k", timeout=T)
        assert record is not None and record.reserved_at is not None
        assert record.locked_until is not None
        assert record.reserved_at >= freed_at
        assert record.locked_until >= freed_at + 2.0
    finally:
        await store.close()


async def test_an_abandoned_decision_is_released_by_its_owner_whatever_the_attempt(
    store: GatewayStore,
) -> None:
    """A gateway that gave up on a decision knows the owner it named, not the attempt the
    store gave it: the release goes by owner, and leaves anyone else's reservation alone."""
    first = await store.decide(replace(BASE, owner="gw-a/1"), timeout=T)
    assert await store.mark_unknown(holder(first.attempt, replace(BASE, owner="gw-a/1")), timeout=T)
    retried = await store.decide(replace(BASE, owner="gw-a/2"), timeout=T)
    assert (retried.outcome, retried.attempt) == (Outcome.RETRY_UNKNOWN, 2)
    assert not await store.release_abandoned(Reservation("t1", "k", "gw-a/1", 0), timeout=T)
    assert await store.get_key("t1", "k", timeout=T) is not None
    assert await store.release_abandoned(Reservation("t1", "k", "gw-a/2", 0), timeout=T)
    assert await store.get_key("t1", "k", timeout=T) is None
    assert not await store.release_abandoned(Reservation("t1", "k", "gw-a/2", 0), timeout=T)


async def test_each_decision_and_recorded_answer_leaves_its_history_row(
    store: GatewayStore, store_url: str
) -> None:
    """Written by the decision's own statement or transaction: who asked, with which key,
    entity and fence, what was decided, and the status of the answer recorded."""
    fenced = replace(
        BASE,
        key="hk",
        entity="inv:1",
        fence=7,
        request_id="req-1",
        method="POST",
        target="/charges",
    )
    first = await store.decide(fenced, timeout=T)
    reservation = Reservation("t1", "hk", "gw-a", first.attempt or 0, "req-2")
    assert await store.complete(reservation, RESPONSE, timeout=T)
    again = replace(fenced, owner="gw-b", entity=None, fence=None, request_id="req-3")
    assert (await store.decide(again, timeout=T)).outcome is Outcome.REPLAY
    inspector = await Inspector.open(store_url)
    try:
        trace = await inspector.trace("hk", tenant="t1", timeout=T)
    finally:
        await inspector.close()
    rows = [
        (
            e["what"],
            e["entity"],
            e["token"],
            e["attempt"],
            e["owner"],
            e["request_id"],
            e["method"],
            e["target"],
            e["status"],
        )
        for e in trace.events
        if e["source"] == "gateway"
    ]
    assert rows == [
        ("reserved", "inv:1", 7, 1, "gw-a", "req-1", "POST", "/charges", None),
        ("completed", "inv:1", 7, 1, "gw-a", "req-2", None, None, 201),
        ("replay", None, None, 1, "gw-b", "req-3", "POST", "/charges", None),
    ]


async def test_postgres_steps_survive_their_connection_closing_while_idle(pg_url: str) -> None:
    """The steps keep one connection between batches; one the server closed while it was
    idle (a restart, an idle timeout, an operator's pg_terminate_backend) is replaced before
    the next batch, as a pooled connection would be, rather than failing it."""
    store = await open_gateway_store(pg_url)
    try:
        first = await store.decide(replace(BASE, key="held-1"), timeout=T)
        assert first.outcome is Outcome.RESERVED
        db = getattr(store, "_db")  # noqa: B009 - the pool behind the store
        pids = await db.run(
            lambda conn: conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND application_name = 'fencegate-gateway'"
            ),
            timeout=T,
        )
        killer = await asyncpg.connect(pg_url)
        try:
            for row in pids:
                await killer.execute("SELECT pg_terminate_backend($1::integer)", row["pid"])
        finally:
            await killer.close()

        async def gone() -> bool:
            left = await db.run(
                lambda conn: conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = any($1::int[])",
                    [row["pid"] for row in pids],
                ),
                timeout=T,
            )
            return bool(left == 0)

        assert pids
        await wait_until(gone, timeout=T, what="the killed connections gone")
        second = await store.decide(replace(BASE, key="held-2"), timeout=T)
        assert second.outcome is Outcome.RESERVED
    finally:
        await store.close()


async def test_postgres_closing_lets_a_step_in_flight_finish(pg_url: str) -> None:
    """Closing the store while a step runs on the connection the steps keep waits for that
    step, as closing the pool waits for a connection in use, instead of taking the
    connection from under it."""
    store = await open_gateway_store(pg_url)
    closing: asyncio.Task[None] | None = None
    try:
        first = replace(BASE, key="k-first", entity="acct-close", fence=1)
        assert (await store.decide(first, timeout=T)).outcome is Outcome.RESERVED
        lock = await hold_fence_row(pg_url, "t1", "acct-close")
        try:
            fenced = replace(BASE, key="k-close", entity="acct-close", fence=2)
            deciding = asyncio.create_task(store.decide(fenced, timeout=T))
            await wait_until(lambda: store_busy(pg_url), timeout=T, what="the step to wait")
            closing = asyncio.create_task(store.close())
            db = getattr(store, "_db")  # noqa: B009 - the pool behind the store
            await wait_until(lambda: db.closed, timeout=T, what="the store to start closing")
        finally:
            await lock.execute("COMMIT")
            await lock.close()
        decision = await deciding
        assert decision.outcome is Outcome.RESERVED
    finally:
        if closing is None:
            await store.close()
        else:
            await asyncio.wait_for(closing, T)
