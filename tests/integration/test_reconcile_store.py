"""The reconciler's statements on both stores: which keys a poll claims (due, unknown, release
safe by the one release rule), that two reconcilers never both get one key, and that each
settling statement acts only on a key still as claimed.

Keys are reserved by the store's own decision (for a reconciling route: it keeps the request
and schedules the key), then given the state, lease end and schedule a test needs in one
UPDATE, relative to the database clock."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace
from typing import Any

import asyncpg
import pytest

from fencegate.store import (
    DecideRequest,
    GatewayStore,
    Outcome,
    Reservation,
    StoredResponse,
    open_gateway_store,
)
from fencegate.store.dburl import parse_database_url
from fencegate.store.reconcile import ClaimedKey, ReconcileStore, reconcile_store

T = 30.0
MARGIN = 30.0
DEAD = "gw-dead:1:0000dead"  # a gateway instance with no live row
BODY = b'{"amount": 1250, "customer": "c-1"}'
ANSWER = StoredResponse(200, [("content-type", "application/json")], b'{"id":"ch_1"}', "s" * 64)

REQUEST = DecideRequest(
    tenant="t1",
    key="k",
    fingerprint="f" * 64,
    entity="invoice:7",
    fence=None,
    owner=f"{DEAD}/1",
    lease_seconds=30.0,
    ttl_seconds=3600.0,
    retry_unknown=False,
    method="POST",
    target="/v1/charges",
    reconcile=True,  # the route reconciles: the step keeps the body and schedules the key
    request_body=BODY,
)


class Rows:
    """Direct reads and writes of the key table, in each store's dialect and clock."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.target = parse_database_url(url)
        self.pg = self.target.kind == "postgresql"

    async def run(self, pg: str, lite: str, *args: Any) -> list[dict[str, Any]]:
        if self.pg:
            conn = await asyncpg.connect(self.url, timeout=T)
            try:
                return [dict(r) for r in await conn.fetch(pg, *args)]
            finally:
                await conn.close()

        def run() -> list[dict[str, Any]]:
            assert self.target.sqlite_path is not None
            conn = sqlite3.connect(self.target.sqlite_path, timeout=T, isolation_level=None)
            conn.row_factory = sqlite3.Row
            try:
                return [dict(r) for r in conn.execute(lite, args).fetchall()]
            finally:
                conn.close()

        return await asyncio.to_thread(run)

    async def shape(
        self,
        key: str,
        *,
        state: str = "outcome_unknown",
        locked_ago: float = 60.0,
        due_in: float | None = 0.0,
        expires_in: float = 3600.0,
        tenant: str = "t1",
    ) -> None:
        """The key's state, lease end (seconds ago), next look (seconds from now, None: the
        route does not reconcile) and expiry, as a gateway and time would have left them."""
        await self.run(
            """UPDATE fencegate_idempotency_keys SET state = $3::fencegate_key_state,
                   locked_until = now() - make_interval(secs => $4),
                   reconcile_after = now() + make_interval(secs => $5::float8),
                   expires_at = now() + make_interval(secs => $6)
               WHERE tenant = $1 AND key = $2""",
            """UPDATE fencegate_idempotency_keys SET state = ?3,
                   locked_until = (julianday('now') - 2440587.5) * 86400.0 - ?4,
                   reconcile_after = (julianday('now') - 2440587.5) * 86400.0 + ?5,
                   expires_at = (julianday('now') - 2440587.5) * 86400.0 + ?6
               WHERE tenant = ?1 AND key = ?2""",
            tenant,
            key,
            state,
            locked_ago,
            due_in,
            expires_in,
        )

    async def row(self, key: str, tenant: str = "t1") -> dict[str, Any] | None:
        rows = await self.run(
            """SELECT state::text AS state, owner, attempt, resolution, reconcile_tries,
                   reconcile_note, response_status, response_body,
                   extract(epoch FROM reconcile_after - now())::float8 AS next_look,
                   extract(epoch FROM reconcile_after)::float8 AS reconcile_after
               FROM fencegate_idempotency_keys WHERE tenant = $1 AND key = $2""",
            """SELECT state, owner, attempt, resolution, reconcile_tries, reconcile_note,
                   response_status, response_body,
                   reconcile_after - (julianday('now') - 2440587.5) * 86400.0 AS next_look,
                   reconcile_after
               FROM fencegate_idempotency_keys WHERE tenant = ?1 AND key = ?2""",
            tenant,
            key,
        )
        return rows[0] if rows else None

    async def history(self, key: str) -> list[dict[str, Any]]:
        return await self.run(
            "SELECT decision, owner, upstream_status, method, target FROM fencegate_decisions"
            " WHERE key = $1 ORDER BY id",
            "SELECT decision, owner, upstream_status, method, target FROM fencegate_decisions"
            " WHERE key = ?1 ORDER BY id",
            key,
        )

    async def gateway_alive(self, instance: str, *, seconds: float = 60.0) -> None:
        await self.run(
            "INSERT INTO fencegate_gateways (instance, host, pid, alive_until)"
            " VALUES ($1, 'h', 1, now() + make_interval(secs => $2))",
            "INSERT INTO fencegate_gateways"
            " (instance, host, pid, started_at, heartbeat_at, alive_until)"
            " VALUES (?1, 'h', 1, 0, 0, (julianday('now') - 2440587.5) * 86400.0 + ?2)",
            instance,
            seconds,
        )


@pytest.fixture
def rows(store_url: str) -> Rows:
    return Rows(store_url)


@pytest.fixture
def reconciler(store: GatewayStore) -> ReconcileStore:
    return reconcile_store(store)


async def reserve(store: GatewayStore, key: str, **changes: Any) -> DecideRequest:
    request = replace(REQUEST, key=key, **changes)
    decision = await store.decide(request, timeout=T)
    assert decision.outcome is Outcome.RESERVED
    return request


async def claim(r: ReconcileStore, *, hold: float = 5.0, limit: int = 50) -> list[ClaimedKey]:
    return await r.claim(margin=MARGIN, hold=hold, limit=limit, timeout=T)


async def test_a_due_key_is_claimed_once_and_pushed_past_its_probe_and_a_backoff(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    await reserve(store, "k1")
    await rows.shape("k1")
    [claimed] = await claim(reconciler, hold=5.0)
    assert (claimed.tenant, claimed.key, claimed.owner) == ("t1", "k1", f"{DEAD}/1")
    assert (claimed.attempt, claimed.state, claimed.tries) == (1, "outcome_unknown", 1)
    assert (claimed.method, claimed.target, claimed.body) == ("POST", "/v1/charges", BODY)
    assert (claimed.entity, claimed.fence) == ("invoice:7", None)
    row = await rows.row("k1")
    assert row is not None and row["reconcile_tries"] == 1
    assert 5.0 < row["next_look"] <= 6.5  # the probe's hold and the first backoff (1 s)
    assert await claim(reconciler) == []  # not due again before then

    await rows.shape("k1")  # time passes
    [again] = await claim(reconciler, hold=5.0)
    assert again.tries == 2
    row = await rows.row("k1")
    assert row is not None and 6.0 < row["next_look"] <= 7.5  # backoff doubled: 2 s


async def test_a_poll_claims_at_most_its_batch_oldest_first(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    for n in range(5):
        await reserve(store, f"b{n}")
        await rows.shape(f"b{n}", due_in=-10.0 + n)
    first = await claim(reconciler, limit=3)
    assert [c.key for c in first] == ["b0", "b1", "b2"]
    assert [c.key for c in await claim(reconciler, limit=3)] == ["b3", "b4"]


async def test_two_reconcilers_never_claim_one_key(
    store_url: str, store: GatewayStore, rows: Rows
) -> None:
    keys = [f"c{n:02d}" for n in range(40)]
    for key in keys:
        await reserve(store, key)
        await rows.shape(key)
    other = await open_gateway_store(store_url, run_migrations=False)
    try:
        a, b = reconcile_store(store), reconcile_store(other)
        seen: list[list[str]] = [[], []]
        # Both claims of a round are in flight at once, so each round is a race; rounds go on
        # until neither finds a key. Each claims in the first round whatever the order, since
        # a claim of 3 leaves 37 due for the other (a free-running pair let one take all 40
        # while the other's first query was still opening its connection).
        for _round in range(len(keys)):  # bounded: each round claims at least one key or ends
            batches = await asyncio.gather(claim(a, limit=3), claim(b, limit=3))
            if not any(batches):
                break
            for into, batch in zip(seen, batches, strict=True):
                into.extend(c.key for c in batch)
    finally:
        await other.close()
    assert sorted(seen[0] + seen[1]) == keys  # every key once, none twice
    assert seen[0] and seen[1], "one reconciler got everything: the race was not run"


@pytest.mark.parametrize(
    ("case", "shape", "owner_alive"),
    [
        ("lease live", {"state": "in_flight", "locked_ago": -10.0}, False),
        ("within the margin", {"locked_ago": MARGIN - 5}, False),
        ("in flight, owner alive", {"state": "in_flight"}, True),
        ("completed", {"state": "completed"}, False),
        ("route does not reconcile", {"due_in": None}, False),
        ("not yet due", {"due_in": 60.0}, False),
        ("expired", {"expires_in": -1.0}, False),
    ],
)
async def test_a_key_whose_release_is_not_safe_or_not_due_is_not_touched(
    store: GatewayStore,
    reconciler: ReconcileStore,
    rows: Rows,
    case: str,
    shape: dict[str, Any],
    owner_alive: bool,
) -> None:
    await reserve(store, "blocked")
    await rows.shape("blocked", **shape)
    if owner_alive:
        await rows.gateway_alive(DEAD)
    before = await rows.row("blocked")
    assert await claim(reconciler) == [], case
    after = await rows.row("blocked")
    assert before is not None and after is not None
    assert after["reconcile_tries"] == 0 and after["state"] == before["state"]

    # A key as that one but safe (its gateway is not alive): claimed, so the case above was
    # refused for its reason alone.
    await reserve(store, "safe", owner="gw-gone:3:0000gone/1")
    await rows.shape("safe", state="in_flight" if owner_alive else "outcome_unknown")
    assert [c.key for c in await claim(reconciler)] == ["safe"]


async def test_only_a_reconciling_routes_key_is_scheduled_and_keeps_its_body(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    await reserve(store, "plain", reconcile=False, request_body=None)
    await reserve(store, "kept")
    plain, kept = await rows.row("plain"), await rows.row("kept")
    assert plain is not None and plain["reconcile_after"] is None
    assert kept is not None and -5.0 < kept["next_look"] <= 0.0
    await rows.run(  # both past their lease and margin, as after a crash
        "UPDATE fencegate_idempotency_keys SET locked_until = now() - interval '1 hour'",
        "UPDATE fencegate_idempotency_keys SET locked_until = locked_until - 3600",
    )
    [claimed] = await claim(reconciler)
    assert (claimed.key, claimed.state, claimed.body) == ("kept", "in_flight", BODY)


async def test_an_in_flight_key_whose_gateway_died_is_claimed_after_lease_and_margin(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    await reserve(store, "crashed")
    await rows.gateway_alive("gw-other:2:00000002")  # another gateway's life says nothing
    await rows.shape("crashed", state="in_flight", locked_ago=MARGIN + 1)
    [claimed] = await claim(reconciler)
    assert claimed.state == "in_flight"


async def test_executed_completes_the_key_with_the_upstreams_answer(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    request = await reserve(store, "ran")
    await rows.shape("ran")
    [claimed] = await claim(reconciler)
    done = await reconciler.complete(
        claimed, ANSWER, note="GET /x answered 200", by="reconciler:me", timeout=T
    )
    assert done
    row = await rows.row("ran")
    assert row is not None
    assert (row["state"], row["resolution"], row["next_look"]) == ("completed", "reconciled", None)
    assert row["reconcile_note"] == "GET /x answered 200" and row["response_status"] == 200
    replay = await store.decide(replace(request, owner="gw-b/1"), timeout=T)
    assert replay.outcome is Outcome.REPLAY and replay.response == ANSWER
    history = await rows.history("ran")
    assert {
        "decision": "reconciled_completed",
        "owner": "reconciler:me",
        "upstream_status": 200,
        "method": "POST",
        "target": "/v1/charges",
    } in history


async def test_a_too_large_answer_keeps_its_digest_only(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    request = await reserve(store, "large")
    await rows.shape("large")
    [claimed] = await claim(reconciler)
    large = replace(ANSWER, body=None)
    assert await reconciler.complete(claimed, large, note="", by="reconciler:me", timeout=T)
    replay = await store.decide(request, timeout=T)
    assert replay.outcome is Outcome.REPLAY and replay.response == large


async def test_not_executed_releases_the_key(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    request = await reserve(store, "never-ran")
    await rows.shape("never-ran")
    [claimed] = await claim(reconciler)
    assert await reconciler.release(claimed, margin=MARGIN, by="reconciler:me", timeout=T)
    assert await rows.row("never-ran") is None
    assert (await rows.history("never-ran"))[-1]["decision"] == "reconciled_released"
    again = await store.decide(replace(request, owner="gw-b/1"), timeout=T)
    assert again.outcome is Outcome.RESERVED


async def test_unknown_notes_why_and_waits_a_backoff(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    await reserve(store, "unsure")
    await rows.shape("unsure")
    [claimed] = await claim(reconciler, hold=60.0)
    when = await reconciler.later(claimed, note="GET /x answered 503", after=4.0, timeout=T)
    assert when is not None
    row = await rows.row("unsure")
    assert row is not None
    assert (row["state"], row["reconcile_tries"]) == ("outcome_unknown", 1)
    assert row["reconcile_note"] == "GET /x answered 503" and 3.0 < row["next_look"] <= 4.0
    assert row["resolution"] is None


async def settle_all(r: ReconcileStore, claimed: ClaimedKey) -> list[object]:
    return [
        await r.complete(claimed, ANSWER, note="", by="reconciler:me", timeout=T),
        await r.release(claimed, margin=MARGIN, by="reconciler:me", timeout=T),
        await r.later(claimed, note="n", after=1.0, timeout=T),
    ]


OWNER_ANSWER = StoredResponse(201, [], b"owner's", "o" * 64)


@pytest.mark.parametrize(
    "change",
    [
        "its gateway recorded the answer",
        "taken over",
        "resolved by an operator",
        "claimed again",
        "expired and reserved again",
    ],
)
async def test_a_key_changed_since_the_claim_is_left_alone(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows, change: str
) -> None:
    request = await reserve(store, "moving")
    await rows.shape("moving", state="in_flight")
    [claimed] = await claim(reconciler)
    if change == "its gateway recorded the answer":
        held = Reservation("t1", "moving", request.owner, 1)
        assert await store.complete(held, OWNER_ANSWER, timeout=T)
    elif change == "taken over":
        taken = await store.decide(replace(request, owner="gw-b/9", retry_unknown=True), timeout=T)
        assert taken.outcome is Outcome.TAKEN_OVER
    elif change == "resolved by an operator":
        await store.resolve_key("t1", "moving", None, resolved_by="operator:o", timeout=T)
        await reserve(store, "moving", owner=request.owner)  # same owner and attempt, anew
    elif change == "claimed again":
        await rows.shape("moving", state="in_flight")
        [second] = await claim(reconciler)
        assert second.tries == claimed.tries + 1
    else:
        await rows.shape("moving", state="in_flight", expires_in=-1.0)
        await reserve(store, "moving", owner="gw-b/10")
    before = await rows.row("moving")
    assert await settle_all(reconciler, claimed) == [False, False, None]
    after = await rows.row("moving")
    assert before is not None and after is not None
    del before["next_look"], after["next_look"]  # relative to the clock, which moved on
    assert after == before
    assert not [h for h in await rows.history("moving") if h["decision"].startswith("reconciled")]


async def test_a_release_the_rule_forbids_by_now_is_not_made(
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    await reserve(store, "held")
    await rows.shape("held", state="in_flight")
    [claimed] = await claim(reconciler)
    await rows.gateway_alive(DEAD)  # its gateway turns out to be alive (e.g. it was paused)
    assert not await reconciler.release(claimed, margin=MARGIN, by="reconciler:me", timeout=T)
    # A larger margin than the claim's: not safe either.
    await reserve(store, "margin")
    await rows.shape("margin", locked_ago=MARGIN + 1)
    [late] = await claim(reconciler)
    assert not await reconciler.release(late, margin=MARGIN + 60, by="reconciler:me", timeout=T)
    assert await rows.row("held") is not None and await rows.row("margin") is not None
    assert await reconciler.release(late, margin=MARGIN, by="reconciler:me", timeout=T)
