"""The model and the code agree: the rules of spec/gateway.pml and spec/lease.pml, written
once more here as a small Python reference, drive the real stores (SQLite and PostgreSQL,
each on its own) with the model's actions — the gateway store's decide, complete, release,
mark_unknown, renew and an operator's resolve; the lease queue's claim, extend, commit_stage,
complete and fail; the database clock moved forward — and every answer must be the one the
model's rule gives. On every step the store-level counterparts of the model's properties are
checked:

1. a reject route grants a key for forwarding at most once, unless the holder released it
   (nothing reached the upstream) or an operator released a key the upstream never ran;
2. no fence below one already accepted for its entity is accepted;
3. a job result or stage is accepted only from the owner of the live lease with the current
   token, and every grant's token is larger than all before it;
4. once a client saw an answer for a key, every replay of that key is that answer.

A change to the code that the model would reject (a token check gone from extend/complete, a
fence check gone, a key re-forwarded) fails here. Moving the clock forward by N seconds shifts
every stored time back by N, as the differential tests do; the steps (12 s and 31 s against
30 s leases) keep every comparison at least 6 s from its boundary.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from fencegate.lease import Lease, LeaseQueue
from fencegate.store import (
    DecideRequest,
    GatewayStore,
    Outcome,
    Reservation,
    ResolveResult,
    StoredResponse,
    open_gateway_store,
)
from tests.support.two_stores import (
    GATEWAY_PG_SHIFT,
    GATEWAY_SQLITE_SHIFT,
    GATEWAY_TABLES,
    LEASE_PG_CLEAR,
    LEASE_PG_SHIFT,
    LEASE_SQLITE_CLEAR,
    LEASE_SQLITE_SHIFT,
    migrated_pair,
    run_on_both,
)

# A state machine of a few hundred steps on both stores: a minute or more on a busy machine
# (more with parallel workers). A timeout inside Hypothesis's run is taken for a failure and
# replayed, so the limit is generous.
pytestmark = pytest.mark.timeout(600)

T = TypeVar("T")
TIMEOUT = 30.0
LEASE = 30.0  # the gateway's in-flight lease and the job's lease
TTL = 100_000.0  # keys outlive every test: expiry is not part of the model
TENANT = "t1"
MAX_ATTEMPTS = 3
KEYS = ("k1", "k2")
ENTITIES = ("e1", "e2")
STAGES = ("s1", "s2")
WORKERS = ("w1", "w2")  # few, so that one worker holds a stale and a current lease


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    yield from migrated_pair(tmp_path_factory, "conformance")


# -- the model's rules (spec/gateway.pml: decide and the conditional writes) -----------------
@dataclass
class Key:
    state: str  # in_flight | completed | outcome_unknown
    owner: str
    attempt: int
    until: float  # the in-flight lease's end, model time
    answer: int | None = None


@dataclass
class Grant:
    """One reservation the gateway forwards under: what the test's upstream did with it."""

    reservation: Reservation
    arrived: bool  # the request reached the upstream, which ran it


class GatewayModel:
    def __init__(self) -> None:
        self.now = 0.0
        self.keys: dict[str, Key] = {}
        self.fences: dict[str, int] = {}
        # Ghosts: what the properties speak of.
        self.accepted: dict[str, int] = {}  # highest fence ever accepted per entity
        self.ran: dict[str, int] = dict.fromkeys(KEYS, 0)  # upstream executions per key
        self.answers: dict[str, int] = {}  # the upstream's answer per key
        self.seen: dict[str, int] = {}  # the first answer a client saw per key

    def decide(self, key: str | None, entity: str, fence: int | None, owner: str) -> Outcome:
        if fence is not None:
            if fence < self.fences.get(entity, -1):
                return Outcome.STALE
            self.fences[entity] = max(fence, self.fences.get(entity, fence))
        if key is None:
            return Outcome.FENCE_ONLY
        record = self.keys.get(key)
        if record is None:
            self.keys[key] = Key("in_flight", owner, 1, self.now + LEASE)
            return Outcome.RESERVED
        if record.state == "completed":
            return Outcome.REPLAY
        if record.state == "in_flight" and record.until > self.now:
            return Outcome.IN_FLIGHT
        return Outcome.UNKNOWN  # a reject route: never forwarded again

    def holds(self, r: Reservation, *states: str) -> bool:
        record = self.keys.get(r.key)
        return (
            record is not None
            and record.owner == r.owner
            and record.attempt == r.attempt
            and record.state in states
        )


# -- the model's rules (spec/lease.pml: claim and the conditional writes) --------------------
@dataclass
class JobModel:
    now: float = 0.0
    state: str = "queued"
    owner: str | None = None
    token: int | None = None
    until: float = 0.0
    attempt: int = 0
    run_after: float = 0.0
    stages: dict[str, int] | None = None  # stage -> the token it was committed under

    def claimable(self) -> bool:
        expired = self.state == "running" and self.until < self.now
        return (self.state == "queued" and self.run_after <= self.now) or (
            expired and self.attempt < MAX_ATTEMPTS
        )

    def holds(self, lease: Lease) -> bool:
        return (
            self.state == "running"
            and self.owner == lease.owner_id
            and self.token == lease.fencing_token
            and self.until > self.now
        )


class ConformanceMachine(RuleBasedStateMachine):
    """One store, driven with the model's actions; `url` is set by the test."""

    url = ""
    pg_url = ""
    sqlite_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.names = itertools.count(1)
        self.gw = GatewayModel()
        self.grants: list[Grant] = []
        self.job = JobModel(stages={})
        self.job_id = 0
        self.leases: list[Lease] = []
        self.tokens: list[int] = []
        self.store: GatewayStore | None = None
        self.queue: LeaseQueue | None = None

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    @initialize()
    def open_empty_store(self) -> None:
        self.run(
            run_on_both(
                self.pg_url,
                self.sqlite_url,
                [f"TRUNCATE {', '.join(GATEWAY_TABLES)}", *LEASE_PG_CLEAR],
                [f"DELETE FROM {t}" for t in GATEWAY_TABLES] + LEASE_SQLITE_CLEAR,  # noqa: S608
            )
        )
        self.store = self.run(open_gateway_store(self.url, run_migrations=False, pool_max_size=2))
        self.queue = self.run(LeaseQueue.connect(self.url, timeout=TIMEOUT, pool_max_size=2))
        self.job_id = self.run(
            self.queue.enqueue(
                "tool",
                {"customer": "c-1"},
                idempotency_key="job-1",
                max_attempts=MAX_ATTEMPTS,
                lease_seconds=LEASE,
                heartbeat_seconds=5.0,
                jitter_seconds=5.0,
                timeout=TIMEOUT,
            )
        )

    def gateway(self) -> GatewayStore:
        assert self.store is not None
        return self.store

    def lease_queue(self) -> LeaseQueue:
        assert self.queue is not None
        return self.queue

    # -- the gateway store ---------------------------------------------------------------------
    @rule(
        key=st.sampled_from([*KEYS, None]),
        entity=st.sampled_from(ENTITIES),
        fence=st.one_of(st.none(), st.integers(0, 4)),
        arrived=st.booleans(),
    )
    def decide(self, key: str | None, entity: str, fence: int | None, arrived: bool) -> None:
        if key is None and fence is None:
            fence = 0  # the gateway asks the store only about a keyed or fenced request
        owner = f"gw/{next(self.names)}"
        request = DecideRequest(
            tenant=TENANT,
            key=key,
            fingerprint=f"fp-{key}",
            entity=entity,
            fence=fence,
            owner=owner,
            lease_seconds=LEASE,
            ttl_seconds=TTL,
            retry_unknown=False,  # on_unknown = "reject"
            request_id=owner,
            method="POST",
            target="/x",
        )
        decision = self.run(self.gateway().decide(request, timeout=TIMEOUT))
        expected = self.gw.decide(key, entity, fence, owner)
        assert decision.outcome == expected, (request, decision, expected)
        if fence is not None and decision.outcome is not Outcome.STALE:
            # Property 2: an accepted fence is never below one accepted before.
            assert fence >= self.gw.accepted.get(entity, fence), (entity, fence, self.gw.accepted)
            self.gw.accepted[entity] = max(fence, self.gw.accepted.get(entity, fence))
        if key is None:
            return
        if decision.outcome is Outcome.REPLAY:
            assert decision.response is not None
            answer = int(decision.response.body or b"0")
            # Property 4: a replay is the answer a client saw first.
            assert self.gw.seen.setdefault(key, answer) == answer, (key, answer, self.gw.seen)
        if decision.outcome.forwards:
            assert decision.attempt is not None
            if arrived:
                self.gw.ran[key] += 1
                # Property 1: a reject route never runs a key twice.
                assert self.gw.ran[key] <= 1, (key, self.gw.ran)
                self.gw.answers[key] = 100 * self.gw.ran[key] + len(self.grants)
            reservation = Reservation(TENANT, key, owner, decision.attempt, owner)
            self.grants.append(Grant(reservation, arrived))

    @precondition(lambda self: self.grants)
    @rule(index=st.integers(0, 50))
    def complete(self, index: int) -> None:
        """The holder records the upstream's answer (the client got it whatever happens)."""
        grant = self.grants[index % len(self.grants)]
        r = grant.reservation
        if not grant.arrived:
            return  # nothing came back from an upstream that never got the request
        answer = self.gw.answers[r.key]
        stored = StoredResponse(200, [("content-type", "text/plain")], str(answer).encode(), "h")
        done = self.run(self.gateway().complete(r, stored, timeout=TIMEOUT))
        holds = self.gw.holds(r, "in_flight", "outcome_unknown")
        assert done == holds, (r, done, self.gw.keys.get(r.key))
        if done:
            self.gw.keys[r.key].state, self.gw.keys[r.key].answer = "completed", answer
        # Property 4: the answer this client saw is the one every client sees for the key.
        assert self.gw.seen.setdefault(r.key, answer) == answer, (r.key, answer, self.gw.seen)

    @precondition(lambda self: self.grants)
    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        """Nothing reached the upstream (refused before sending, or a 5xx not stored)."""
        grant = self.grants[index % len(self.grants)]
        r = grant.reservation
        if grant.arrived:
            return  # the upstream ran it: the gateway records, it does not release
        done = self.run(self.gateway().release(r, timeout=TIMEOUT))
        assert done == self.gw.holds(r, "in_flight"), (r, done, self.gw.keys.get(r.key))
        if done:
            del self.gw.keys[r.key]

    @precondition(lambda self: self.grants)
    @rule(index=st.integers(0, 50))
    def mark_unknown(self, index: int) -> None:
        r = self.grants[index % len(self.grants)].reservation
        done = self.run(self.gateway().mark_unknown(r, timeout=TIMEOUT))
        assert done == self.gw.holds(r, "in_flight"), (r, done, self.gw.keys.get(r.key))
        if done:
            self.gw.keys[r.key].state = "outcome_unknown"

    @precondition(lambda self: self.grants)
    @rule(index=st.integers(0, 50))
    def renew(self, index: int) -> None:
        r = self.grants[index % len(self.grants)].reservation
        done = self.run(self.gateway().renew(r, LEASE, timeout=TIMEOUT))
        record = self.gw.keys.get(r.key)
        live = self.gw.holds(r, "in_flight") and record is not None and record.until > self.gw.now
        assert done == live, (r, done, record)
        if done and record is not None:
            record.until = self.gw.now + LEASE

    @rule(key=st.sampled_from(KEYS))
    def operator_resolves(self, key: str) -> None:
        """An honest operator: the upstream's real answer if it ran the key, else release.
        (The test's upstream has no request still on its way: every grant arrived or not at
        once; so the release margin is 0, and no gateway process is registered alive.)"""
        record = self.gw.keys.get(key)
        ran = self.gw.ran[key] > 0
        answer = self.gw.answers.get(key)
        response = (
            StoredResponse(200, [("content-type", "text/plain")], str(answer).encode(), "h")
            if ran
            else None
        )
        result = self.run(
            self.gateway().resolve_key(
                TENANT, key, response, resolved_by="operator:test", margin=0.0, timeout=TIMEOUT
            )
        ).result
        unknown = record is not None and (
            record.state == "outcome_unknown"
            or (record.state == "in_flight" and record.until <= self.gw.now)
        )
        if record is None:
            assert result is ResolveResult.NOT_FOUND, (key, result)
        elif record.state == "completed":
            assert result is ResolveResult.NOT_UNKNOWN, (key, result, record)
        elif not unknown:
            # In flight under a live lease: the release rule refuses (its gateway may be
            # sending it now).
            assert result is ResolveResult.BLOCKED, (key, result, record)
        elif ran:
            assert result is ResolveResult.COMPLETED, (key, result)
            record.state, record.answer, record.owner = "completed", answer, "operator:test"
            assert answer is not None
            assert self.gw.seen.setdefault(key, answer) == answer, (key, answer, self.gw.seen)
        else:
            assert result is ResolveResult.RELEASED, (key, result)
            del self.gw.keys[key]

    # -- the lease queue -----------------------------------------------------------------------
    @rule(owner=st.sampled_from(WORKERS))
    def claim(self, owner: str) -> None:
        job = self.job
        expected = job.claimable()
        exhausted = job.state == "running" and job.until < job.now and job.attempt >= MAX_ATTEMPTS
        leases = self.run(self.lease_queue().claim(owner, limit=1, timeout=TIMEOUT))
        assert bool(leases) == expected, (owner, leases, job)
        if exhausted:
            job.state = "failed"
        if not leases:
            return
        [lease] = leases
        # Property 3's ground: every grant's token is larger than every token before it.
        assert all(lease.fencing_token > t for t in self.tokens), (lease, self.tokens)
        self.tokens.append(lease.fencing_token)
        job.state, job.owner, job.token = "running", owner, lease.fencing_token
        job.until, job.attempt = job.now + LEASE, job.attempt + 1
        assert lease.attempt == job.attempt, (lease, job)
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50))
    def extend(self, index: int) -> None:
        lease = self.leases[index % len(self.leases)]
        renewed = self.run(self.lease_queue().extend(lease, timeout=TIMEOUT))
        assert (renewed is not None) == self.job.holds(lease), (lease, renewed, self.job)
        if renewed is not None:
            self.job.until = self.job.now + LEASE

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50), name=st.sampled_from(STAGES))
    def commit_stage(self, index: int, name: str) -> None:
        lease = self.leases[index % len(self.leases)]
        stages = self.job.stages
        assert stages is not None
        done = self.run(self.lease_queue().commit_stage(lease, name, {"r": 1}, timeout=TIMEOUT))
        holds = self.job.holds(lease)
        expected = holds and stages.get(name, lease.fencing_token) == lease.fencing_token
        # Property 3: a stage result only from the owner of the live lease, current token.
        assert done == expected, (lease, name, done, self.job)
        if done:
            stages[name] = lease.fencing_token

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50))
    def complete_job(self, index: int) -> None:
        lease = self.leases[index % len(self.leases)]
        done = self.run(self.lease_queue().complete(lease, {"ok": True}, timeout=TIMEOUT))
        # Property 3: a job result only from the owner of the live lease, current token.
        assert done == self.job.holds(lease), (lease, done, self.job)
        if done:
            self.job.state = "succeeded"

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 50), permanent=st.booleans())
    def fail_job(self, index: int, permanent: bool) -> None:
        lease = self.leases[index % len(self.leases)]
        done = self.run(
            self.lease_queue().fail(
                lease, {"code": "boom"}, retry_in=0.0, permanent=permanent, timeout=TIMEOUT
            )
        )
        assert done == self.job.holds(lease), (lease, done, self.job)
        if done:
            for_good = permanent or lease.attempt >= MAX_ATTEMPTS
            self.job.state = "failed" if for_good else "queued"
            self.job.run_after = self.job.now

    # -- the database clock --------------------------------------------------------------------
    @rule(seconds=st.sampled_from([12.0, 31.0]))
    def advance_clock(self, seconds: float) -> None:
        self.run(
            run_on_both(
                self.pg_url,
                self.sqlite_url,
                [*GATEWAY_PG_SHIFT, *LEASE_PG_SHIFT],
                [*GATEWAY_SQLITE_SHIFT, *LEASE_SQLITE_SHIFT],
                seconds=seconds,
            )
        )
        self.gw.now += seconds
        self.job.now += seconds

    def teardown(self) -> None:
        if self.store is not None:
            self.run(self.store.close())
        if self.queue is not None:
            self.run(self.queue.close())
        self.loop.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_store_follows_the_model(databases: tuple[str, str], kind: str) -> None:
    pg_url, sqlite_url = databases
    ConformanceMachine.pg_url, ConformanceMachine.sqlite_url = pg_url, sqlite_url
    ConformanceMachine.url = sqlite_url if kind == "sqlite" else pg_url
    machine = ConformanceMachine.TestCase
    machine.settings = settings(
        max_examples=40,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine().runTest()
