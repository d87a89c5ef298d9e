"""The decision order has one reference (the SQLite store's Python, `decide_in`) and one copy
(the PostgreSQL function ``fencegate_step``). This differential test holds them together: random
sequences of decisions (one at a time, and batches of mixed calls that travel together),
recorded answers, releases, unknown marks, renewals, an operator's resolutions and moves of
the database clock run against both stores side by side, and every answer must be the same;
so must the decision history each store wrote (``fencegate_decisions``) and what the
operator's `Inspector` reads from it (keys by state, the "unknown" count, the recent
decisions).

Moving the clock forward by N seconds is done by shifting every stored time back by N on both
stores: the same effect, with no test hook in the stores.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fencegate.store import (
    DecideRequest,
    Decision,
    GatewayStore,
    Reservation,
    StoredResponse,
    open_gateway_store,
)
from fencegate.store.inspect import Inspector
from fencegate.store.key_states import KEY_STATES
from tests.support.two_stores import (
    GATEWAY_PG_SHIFT,
    GATEWAY_SQLITE_SHIFT,
    GATEWAY_TABLES,
    migrated_pair,
    rows_on_both,
    run_on_both,
)

# A state machine of a few hundred steps on both stores: a minute or more on a busy machine
# (more with parallel workers). A timeout inside Hypothesis's run is taken for a failure and
# replayed, so the limit is generous.
pytestmark = pytest.mark.timeout(600)

T = TypeVar("T")
TIMEOUT = 30.0
LEASE = 10.0
TTL = 100.0

# A history row without its times (each store's own clock) and id (each store's sequence).
_HISTORY = (
    "SELECT decision, tenant, entity, key, fence, attempt, owner, request_id, method, target,"
    " upstream_status FROM fencegate_decisions"
)
# What an operator reads of a key, without its times.
_KEY_FIELDS = (
    "tenant",
    "key",
    "state",
    "reason",
    "owner",
    "attempt",
    "entity",
    "fence",
    "response_status",
)


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    yield from migrated_pair(tmp_path_factory, "differential")


def comparable(decision: Decision) -> tuple[Any, ...]:
    """Everything a decision says, but the seconds measured on each store's own clock."""
    return (
        decision.outcome,
        decision.last_accepted,
        decision.attempt,
        decision.key_state,
        decision.response,
        decision.reserved_age is not None,
        decision.unknown_since is not None,
    )


class TwoStores(RuleBasedStateMachine):
    pg_url = ""
    sqlite_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.owners = itertools.count(1)
        self.holders: list[Reservation] = []
        self.stores: tuple[GatewayStore, GatewayStore] | None = None
        self.inspectors: tuple[Inspector, Inspector] | None = None

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    @initialize()
    def open_empty_stores(self) -> None:
        self.run(self._clear())
        self.stores = (
            self.run(open_gateway_store(self.sqlite_url, run_migrations=False)),
            self.run(open_gateway_store(self.pg_url, run_migrations=False, pool_max_size=2)),
        )
        self.inspectors = (
            self.run(Inspector.open(self.sqlite_url, timeout=TIMEOUT)),
            self.run(Inspector.open(self.pg_url, timeout=TIMEOUT)),
        )

    async def _clear(self) -> None:
        await run_on_both(
            self.pg_url,
            self.sqlite_url,
            [f"TRUNCATE {', '.join(GATEWAY_TABLES)}"],
            [f"DELETE FROM {table}" for table in GATEWAY_TABLES],  # noqa: S608 -- fixed table names
        )

    def both(self, call: Any) -> tuple[Any, Any]:
        assert self.stores is not None
        lite, pg = self.stores
        return self.run(call(lite)), self.run(call(pg))

    @rule(
        # Few values, so that random steps meet the same key and entity again and again.
        tenant=st.sampled_from(["t1", "t1", "t1", "t2"]),
        key=st.sampled_from(["k1", "k1", "k2", None]),
        fingerprint=st.sampled_from(["f1", "f1", "f1", "f2"]),
        entity=st.sampled_from(["e1", "e2"]),
        fence=st.one_of(st.none(), st.integers(0, 6)),
        retry_unknown=st.booleans(),
    )
    def decide(
        self,
        tenant: str,
        key: str | None,
        fingerprint: str,
        entity: str,
        fence: int | None,
        retry_unknown: bool,
    ) -> None:
        request = self.request(tenant, key, fingerprint, entity, fence, retry_unknown)
        lite, pg = self.both(lambda store: store.decide(request, timeout=TIMEOUT))
        assert comparable(lite) == comparable(pg), (request, lite, pg)
        self.hold(request, lite)

    def request(
        self,
        tenant: str,
        key: str | None,
        fingerprint: str,
        entity: str,
        fence: int | None,
        retry_unknown: bool,
    ) -> DecideRequest:
        if key is None and fence is None:
            fence = 0  # the gateway only asks the store about a keyed or fenced request
        owner = f"gw/{next(self.owners)}"
        return DecideRequest(
            tenant=tenant,
            key=key,
            fingerprint=fingerprint,
            entity=entity,
            fence=fence,
            owner=owner,
            lease_seconds=LEASE,
            ttl_seconds=TTL,
            retry_unknown=retry_unknown,
            request_id=owner,
            method="POST",
            target="/x",
        )

    def hold(self, request: DecideRequest, decision: Decision) -> None:
        if decision.outcome.forwards and request.key is not None:
            owner = request.owner
            attempt = decision.attempt or 0
            self.holders.append(Reservation(request.tenant, request.key, owner, attempt, owner))

    @rule(
        # Distinct keys and entities within a batch: calls that travel together must not
        # race for one row (on PostgreSQL two batches may run at once, each in its order).
        decisions=st.lists(
            st.tuples(
                st.sampled_from(["t1", "t2"]),
                st.sampled_from(["k1", "k2", "k3", None]),
                st.sampled_from(["f1", "f1", "f2"]),
                st.integers(0, 3),
                st.one_of(st.none(), st.integers(0, 6)),
                st.booleans(),
            ),
            min_size=2,
            max_size=5,
            unique_by=(lambda d: (d[0], d[1] or f"none-{d[3]}"), lambda d: (d[0], d[3])),
        ),
        answers=st.lists(st.integers(0, 50), max_size=3, unique=True),
    )
    def batch(
        self,
        decisions: list[tuple[str, str | None, str, int, int | None, bool]],
        answers: list[int],
    ) -> None:
        """Decisions and recorded answers submitted together, so that each store takes them
        as batches (one transaction on SQLite, one ``fencegate_step`` call on PostgreSQL)."""
        requests = [
            self.request(tenant, key, fingerprint, f"e{entity}", fence, retry_unknown)
            for tenant, key, fingerprint, entity, fence, retry_unknown in decisions
        ]
        busy = {(r.tenant, r.key) for r in requests}
        holders = [self.holders[i % len(self.holders)] for i in answers] if self.holders else []
        holders = [h for h in dict.fromkeys(holders) if (h.tenant, h.key) not in busy]
        answer = StoredResponse(201, [("content-type", "application/json")], b"{}", "h")

        async def together(store: GatewayStore) -> list[Any]:
            calls: list[Any] = [store.decide(r, timeout=TIMEOUT) for r in requests]
            calls += [store.complete(h, answer, timeout=TIMEOUT) for h in holders]
            return list(await asyncio.gather(*calls))

        lite, pg = self.both(together)
        n = len(requests)
        assert [comparable(d) for d in lite[:n]] == [comparable(d) for d in pg[:n]], requests
        assert lite[n:] == pg[n:], holders
        for request, decision in zip(requests, lite[:n], strict=True):
            self.hold(request, decision)

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 50), status=st.sampled_from([200, 201, 402]))
    def complete(self, index: int, status: int) -> None:
        holder = self.holders[index % len(self.holders)]
        answer = StoredResponse(status, [("content-type", "application/json")], b"{}", "h")
        lite, pg = self.both(lambda store: store.complete(holder, answer, timeout=TIMEOUT))
        assert lite == pg, holder

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        holder = self.holders[index % len(self.holders)]
        lite, pg = self.both(lambda store: store.release(holder, timeout=TIMEOUT))
        assert lite == pg, holder

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 50))
    def mark_unknown(self, index: int) -> None:
        holder = self.holders[index % len(self.holders)]
        lite, pg = self.both(lambda store: store.mark_unknown(holder, timeout=TIMEOUT))
        assert lite == pg, holder

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 50))
    def renew(self, index: int) -> None:
        holder = self.holders[index % len(self.holders)]
        lite, pg = self.both(lambda store: store.renew(holder, LEASE, timeout=TIMEOUT))
        assert lite == pg, holder

    @rule(
        tenant=st.sampled_from(["t1", "t2"]),
        key=st.sampled_from(["k1", "k2", "k3"]),
        status=st.sampled_from([None, 200, 409]),
        margin=st.sampled_from([0.0, 30.0]),
        force=st.sampled_from([False, False, False, True]),
    )
    def resolve(
        self, tenant: str, key: str, status: int | None, margin: float, force: bool
    ) -> None:
        """An operator records an answer for a key (or releases it): only a key whose outcome
        is unknown, and only when the release rule allows it (or forced), on both stores
        alike; refused for the same reason."""
        answer = (
            None
            if status is None
            else StoredResponse(status, [("content-type", "text/plain")], b"by hand", "op")
        )
        lite, pg = self.both(
            lambda store: store.resolve_key(
                tenant,
                key,
                answer,
                resolved_by="op",
                margin=margin,
                force=force,
                timeout=TIMEOUT,
            )
        )
        assert (lite.result, lite.forced) == (pg.result, pg.forced), (tenant, key, status)
        blockers = [r.before.release_blocker if r.before else None for r in (lite, pg)]
        assert blockers[0] == blockers[1], (tenant, key, status, margin)

    @rule(alive=st.booleans())
    def gateway_heartbeats(self, alive: bool) -> None:
        """The gateway process that holds every reservation here (owners ``gw/N``) is
        registered alive, or stopped cleanly (its row gone): the release rule's owner_alive."""

        async def beat(store: GatewayStore) -> None:
            if alive:
                await store.heartbeat_gateway(
                    "gw", host="h", pid=1, alive_seconds=3600.0, timeout=TIMEOUT
                )
            else:
                await store.deregister_gateway("gw", timeout=TIMEOUT)

        self.both(beat)

    @rule(seconds=st.sampled_from([3.0, 11.0, 11.0, 60.0, 101.0]))
    def advance_clock(self, seconds: float) -> None:
        self.run(self._shift(seconds))

    async def _shift(self, seconds: float) -> None:
        await run_on_both(
            self.pg_url, self.sqlite_url, GATEWAY_PG_SHIFT, GATEWAY_SQLITE_SHIFT, seconds=seconds
        )

    @invariant()
    def same_keys(self) -> None:
        if self.stores is None:
            return
        for tenant, key in itertools.product(["t1", "t2"], ["k1", "k2"]):
            lite, pg = self.both(lambda store, t=tenant, k=key: store.get_key(t, k, timeout=30))
            assert (lite is None) == (pg is None), (tenant, key, lite, pg)
            if lite is not None and pg is not None:
                assert (
                    lite.state,
                    lite.unknown,
                    lite.owner,
                    lite.attempt,
                    lite.fence,
                    lite.resolution,
                    lite.release_blocker,
                ) == (
                    pg.state,
                    pg.unknown,
                    pg.owner,
                    pg.attempt,
                    pg.fence,
                    pg.resolution,
                    pg.release_blocker,
                ), (tenant, key)

    @rule()
    def same_history(self) -> None:
        """The decision-history rows each store wrote (SQLite's `History`, the PostgreSQL
        step's CTEs), as a multiset: calls that travelled together may be logged in another
        order."""
        if self.stores is None:
            return
        lite, pg = self.run(rows_on_both(self.pg_url, self.sqlite_url, _HISTORY, _HISTORY))
        assert sorted(lite, key=repr) == sorted(pg, key=repr)

    # A rule rather than an invariant: reading everything after every step would cost more
    # than the steps; as a rule it runs between random steps, with the clock moved or not.
    @rule()
    def same_operator_reads(self) -> None:
        """What the `Inspector` shows an operator: keys by state (``outcome_unknown``
        included, an in-flight key whose lease ran out among them, with its reason), the
        unknown count, recent decisions."""
        if self.inspectors is None:
            return

        async def reads(inspector: Inspector) -> list[Any]:
            found: list[Any] = []
            for state in (None, *KEY_STATES):
                page = await inspector.keys(state=state, limit=100, timeout=TIMEOUT)
                found.append([tuple(row[f] for f in _KEY_FIELDS) for row in page.rows])
            overview = await inspector.overview(timeout=TIMEOUT)
            found.append((overview["unknown_keys"], overview["decisions_last_hour"]))
            return found

        lite_inspector, pg_inspector = self.inspectors
        assert self.run(reads(lite_inspector)) == self.run(reads(pg_inspector))

    def teardown(self) -> None:
        for inspector in self.inspectors or ():
            self.run(inspector.close())
        if self.stores is not None:
            for store in self.stores:
                self.run(store.close())
        self.loop.close()


def test_sqlite_and_postgres_decide_alike(databases: tuple[str, str]) -> None:
    TwoStores.pg_url, TwoStores.sqlite_url = databases
    state_machine = TwoStores.TestCase
    state_machine.settings = settings(
        max_examples=60,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    state_machine().runTest()
