"""The decision engine: steps 2 to 7 of the gateway's decision order (docs/protocol.md §3).

It knows nothing of HTTP frameworks or database drivers. It receives an
`IncomingRequest`, the route's policy, the tenant (step 1 happened before), a store and a
``forward`` callable, and returns the answer to send with a decision label for metrics.
The reverse proxy and the ASGI middleware both call it; only their ``forward`` differs.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import shlex
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from fencegate.gateway import headers as h
from fencegate.gateway.answers import AnswerCache, CachedAnswer
from fencegate.gateway.decisions import DecisionTrace, decision_of
from fencegate.gateway.deferred_history import DeferredHistory
from fencegate.gateway.fingerprint import request_fingerprint
from fencegate.gateway.headers import NOT_REPLAYED
from fencegate.gateway.health import DecisionOutcomes
from fencegate.gateway.latency import RouteLatency, retry_after_seconds
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.recorder import ABANDON, OwedWrite, PendingWrites, Write
from fencegate.gateway.routes import RoutePolicy, entity_missing
from fencegate.gateway.send_deadline import (
    CLOCK_RATE_MARGIN,
    SEND_BY,
    LeaseClock,
    LeaseDeadlinePassed,
)
from fencegate.gateway.upstream import (
    Forward,
    UpstreamOutcomeUnknown,
    UpstreamRefused,
    UpstreamResponse,
)
from fencegate.internal_errors import InternalErrors
from fencegate.problems import Problem
from fencegate.store.base import (
    DecideRequest,
    Decision,
    DeferredDecision,
    GatewayStore,
    KeyRecord,
    Outcome,
    Reservation,
    StoredResponse,
    StoreUnavailable,
)
from fencegate.store.key_states import LEASE_EXPIRED, operator_state
from fencegate.store.release import utc
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN
from fencegate.types import IncomingRequest

logger = logging.getLogger("fencegate.gateway")

# 424 Failed Dependency: this request depends on an earlier attempt whose outcome is
# unknown. Neither the idempotency draft nor the common SDKs (Stripe, urllib3, httpx retry
# transports) treat it as "retry later".
OUTCOME_UNKNOWN_STATUS = 424


@dataclass(frozen=True, slots=True)
class GatewayResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    decision: str  # a word, for fencegate_gateway_requests_total and the decision log
    # The gateway's own error answer, kept so that a route can render it in another
    # format (e.g. Stripe's); None for answers that are not problems.
    problem: Problem | None = None


def problem_response(problem: Problem, decision: str | None = None) -> GatewayResponse:
    return GatewayResponse(
        problem.status,
        problem.response_headers(),
        problem.body(),
        decision or decision_of(problem),
        problem,
    )


def instance_owner() -> str:
    """Who holds a reservation: unique per gateway process, readable in the table."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Engine:
    def __init__(
        self,
        store: GatewayStore,
        *,
        owner: str | None = None,
        lease_seconds: float = 30.0,
        store_timeout: float = 2.0,
        metrics: GatewayMetrics | None = None,
        store_argument: str = "",
        release_margin: float = DEFAULT_RELEASE_MARGIN,
        answers: AnswerCache | None = None,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("the in-flight lease must be longer than zero seconds")
        self.store = store
        self.owner = owner or instance_owner()
        self.lease_seconds = float(lease_seconds)
        # Renew at a third of the lease: two renewals may fail before the lease runs out.
        self.renew_every = self.lease_seconds / 3
        self.store_timeout = float(store_timeout)
        # How long a request may still be on its way after its lease ended: releasing a key
        # waits that long (store/release_rule.py); the 424 says when that is.
        self.release_margin = float(release_margin)
        self.metrics = metrics
        # How long each route's requests take upstream: the 409's Retry-After follows it.
        self.latency = RouteLatency()
        # How the resolve commands in a 424 name this store (`operator_store_argument`).
        self.store_argument = store_argument
        # Whether the store took the latest decision (``/healthz`` reports it).
        self.decisions = DecisionOutcomes()
        # Faults in fencegate's own code: logged once per kind, counted (a bug, not an outage).
        self.internal_errors = InternalErrors(
            logger, count=metrics.internal_error if metrics is not None else None
        )
        # Writes owed to the store after the upstream acted, kept trying in the background.
        self.pending = PendingWrites(look_up=self._look_up, internal=self.internal_errors)
        # Each reservation gets its own holder name (instance/request number): attempts
        # restart at 1 once a key is released, and an answer still owed for an earlier
        # reservation must never complete a later one.
        self._reservations = itertools.count(1)
        # Completed answers kept in memory (None: off): replays without a fence are answered
        # from them, their history rows written in the background (`answers.py`).
        self.answers = answers
        self.deferred = (
            DeferredHistory(store, timeout=store_timeout, internal=self.internal_errors)
            if answers is not None and store.history
            else None
        )

    async def handle(
        self,
        request: IncomingRequest,
        policy: RoutePolicy,
        tenant: str,
        forward: Forward,
        *,
        trace: DecisionTrace | None = None,
    ) -> GatewayResponse:
        """The answer, with its decision label (the pipeline counts it). The request's body
        is already within the route's limit (the pipeline checked it while reading).
        ``trace`` receives the key, fence and entity for the decision log."""
        try:
            return await self._handle(request, policy, tenant, forward, trace)
        except Problem as problem:
            return problem_response(problem)

    async def _handle(
        self,
        request: IncomingRequest,
        policy: RoutePolicy,
        tenant: str,
        forward: Forward,
        trace: DecisionTrace | None,
    ) -> GatewayResponse:
        if not policy.guards(request.method):
            return await self._relay(forward, policy, "passthrough")

        # Step 2: headers and body.
        key = h.parse_idempotency_key(request.header_values(h.IDEMPOTENCY_KEY))
        fence = h.parse_fence(request.header_values(h.EXECUTION_FENCE))
        entity_header = h.parse_entity(request.header_values(h.EXECUTION_ENTITY))
        if trace is not None:
            trace.key, trace.fence = key, fence
        if key is None and policy.key_required:
            raise Problem(
                400,
                "key-required",
                "Idempotency-Key required",
                f"{request.method} {request.path} requires an Idempotency-Key header",
            )
        if fence is None and policy.fence_required:
            raise Problem(
                428,
                "fence-required",
                "Fence required",
                f"{request.method} {request.path} requires an X-Execution-Fence header",
            )
        entity = policy.entity.derive(request.route_path, request.body, entity_header)
        if trace is not None:
            trace.entity = entity
        if fence is not None and entity is None:
            raise entity_missing(policy.entity)
        if key is None and fence is None:
            return await self._relay(forward, policy, "passthrough")
        fingerprint = (
            request_fingerprint(request.method, request.path, request.query_string, request.body)
            if key is not None
            else ""
        )
        owner = f"{self.owner}/{next(self._reservations)}"
        if key is not None and fence is None and self.answers is not None:
            cached = self.answers.get(tenant, key)
            if cached is not None:
                return self._from_copy(
                    cached, request, policy, tenant, key, entity, fingerprint, owner
                )

        # Steps 3 and 4: one transaction in the store. The lease is timed from before its
        # round trip: the database's lease can only end later than this clock says.
        started = time.monotonic()
        decision = await self._decide(
            DecideRequest(
                tenant=tenant,
                key=key,
                fingerprint=fingerprint,
                entity=entity,
                fence=fence,
                owner=owner,
                lease_seconds=self.lease_seconds,
                ttl_seconds=policy.key_ttl_seconds,
                retry_unknown=policy.on_unknown == "retry",
                request_id=request.request_id,
                method=request.method,
                target=request.path,  # never the query: it may carry secrets
                reconcile=policy.reconcile is not None,
                request_body=request.body if policy.reconcile is not None else None,
            )
        )
        outcome = decision.outcome
        if outcome is Outcome.STALE:
            raise stale_fence(fence, decision.last_accepted, entity)
        if outcome is Outcome.FENCE_ONLY:
            return await self._relay(forward, policy, "forwarded")
        assert key is not None
        if outcome is Outcome.REPLAY:
            assert decision.response is not None
            return replay(decision.response, key)
        if outcome is Outcome.MISMATCH:
            raise key_reused()
        if outcome is Outcome.IN_FLIGHT:
            raise in_flight(decision, policy.timeout, self.latency.typical(policy.prefix))
        if outcome is Outcome.PENDING or (
            outcome is Outcome.UNKNOWN and self.pending.owes(tenant, key)
        ):
            # Its gateway (this one, or another that is alive) still owes the key a write.
            raise outcome_pending()
        if outcome is Outcome.UNKNOWN:
            raise outcome_unknown(
                decision,
                tenant,
                key,
                store_argument=self.store_argument,
                release_margin=self.release_margin,
            )
        if outcome is Outcome.TAKEN_OVER:
            logger.warning("took over in-flight key %r whose lease had expired", key)
        assert decision.attempt is not None
        reservation = Reservation(tenant, key, owner, decision.attempt, request.request_id)
        lease = LeaseClock(self.lease_seconds, started=started)
        # A new reservation's key expires at its transaction's now() plus the TTL, and that
        # transaction began after ``started``: a copy of its answer may be kept until then.
        # (A key taken over keeps the expiry of its first reservation: no copy.)
        copy_until = (
            started + policy.key_ttl_seconds * (1.0 - CLOCK_RATE_MARGIN)
            if outcome is Outcome.RESERVED and self.answers is not None
            else None
        )
        return await self._execute(reservation, forward, policy, lease, fingerprint, copy_until)

    def _from_copy(
        self,
        cached: CachedAnswer,
        request: IncomingRequest,
        policy: RoutePolicy,
        tenant: str,
        key: str,
        entity: str | None,
        fingerprint: str,
        owner: str,
    ) -> GatewayResponse:
        """A replay (or a key reused) answered from the copy of a completed answer: what the
        store would answer, without its round trip. The history row follows in the
        background (`DeferredHistory`)."""
        same = cached.fingerprint == fingerprint
        if self.deferred is not None:
            self.deferred.add(
                DeferredDecision(
                    tenant=tenant,
                    key=key,
                    decision=Outcome.REPLAY.value if same else Outcome.MISMATCH.value,
                    entity=entity,
                    attempt=cached.attempt,
                    owner=owner,
                    request_id=request.request_id,
                    method=request.method,
                    target=request.path,
                    ttl_seconds=policy.key_ttl_seconds,
                )
            )
        if self.metrics is not None:
            self.metrics.answer_cache_hit()
        if not same:
            raise key_reused()
        return replay(cached.response, key)

    async def _decide(self, request: DecideRequest) -> Decision:
        started = time.perf_counter()
        try:
            decision = await self.store.decide(request, timeout=self.store_timeout)
        except StoreUnavailable as exc:
            # The store could not decide: fail closed.
            logger.error("store unavailable, refusing the request: %s", describe(exc))
            self.decisions.failed(describe(exc))
            if request.key is not None and exc.reached_store:
                self._release_abandoned(request, request.key)
            raise store_unavailable() from exc
        except Exception as exc:
            # A bug, not an outage: 500, and whatever the decision may have reserved under
            # this request's owner (it may have committed before the fault) is released.
            self.internal_errors.report(exc, where="decide", about=f"request {request.request_id}")
            if request.key is not None:
                self._release_abandoned(request, request.key)
            raise internal_error(request.request_id) from exc
        finally:
            self._store_latency("decide", started)
        self.decisions.succeeded()
        return decision

    def _release_abandoned(self, request: DecideRequest, key: str) -> None:
        """The 503 says nothing was forwarded and nothing is left behind, but the decision's
        statement may still commit after this gateway stopped waiting (the store sets a
        deadline on it, a commit can still land after it). Whatever it reserved under this
        request's own owner is released in the background, retried with backoff like an
        owed answer, so that the client's retry runs normally."""
        reservation = Reservation(request.tenant, key, request.owner, 0, request.request_id)
        store, timeout = self.store, self.store_timeout
        self.pending.keep_trying(
            OwedWrite(
                ABANDON,
                reservation,
                lambda: store.release_abandoned(reservation, timeout=timeout),
                give_up_at=time.monotonic() + request.ttl_seconds,
                # Past the lease, a reservation that commits that late reads as an unknown
                # outcome anyway; until then the store is asked again with backoff.
                watch_until=time.monotonic() + self.lease_seconds,
            )
        )

    async def close(self, *, grace: float = 0.0) -> int:
        """Stop the engine's background writes (cancelled and awaited, so none outlives the
        store it writes to), after up to ``grace`` seconds for the answers still owed;
        returns how many were left, each logged for an operator to resolve."""
        left = await self.pending.drain(grace=grace)
        if self.deferred is not None:
            await self.deferred.close()
        return left

    async def _look_up(self, tenant: str, key: str) -> KeyRecord | None:
        return await self.store.get_key(tenant, key, timeout=self.store_timeout)

    async def _relay(self, forward: Forward, policy: RoutePolicy, label: str) -> GatewayResponse:
        """Forward without a reservation: nothing to record either way."""
        try:
            answer = await forward(policy.timeout)
        except UpstreamRefused as exc:
            raise upstream_unreachable(exc, released=False) from exc
        except UpstreamOutcomeUnknown as exc:
            raise upstream_timeout(exc, recorded=False) from exc
        return GatewayResponse(answer.status, answer.headers, answer.body, label)

    async def _execute(
        self,
        reservation: Reservation,
        forward: Forward,
        policy: RoutePolicy,
        lease: LeaseClock,
        fingerprint: str,
        copy_until: float | None,
    ) -> GatewayResponse:
        """Steps 5 and 6: forward while holding the lease, then record what happened."""
        timeout = self.store_timeout
        store = self.store
        try:
            answer = await self._forward_holding(reservation, forward, policy, lease)
        except LeaseDeadlinePassed as exc:
            # Nothing left: the key may already be someone else's. Answered as a store
            # outage (the gateway could not hold its reservation in time); a retry runs.
            logger.warning(
                "did not send key %r (tenant %r, attempt %d): %s",
                reservation.key,
                reservation.tenant,
                reservation.attempt,
                exc,
            )
            await self._record(
                "release", reservation, lambda: store.release(reservation, timeout=timeout), policy
            )
            raise store_unavailable() from exc
        except UpstreamRefused as exc:
            released = await self._record(
                "release", reservation, lambda: store.release(reservation, timeout=timeout), policy
            )
            raise upstream_unreachable(exc, released=released) from exc
        except UpstreamOutcomeUnknown as exc:
            reason = str(exc)
            marked = await self._record(
                "mark_unknown",
                reservation,
                lambda: store.mark_unknown(reservation, reason=reason, timeout=timeout),
                policy,
            )
            raise upstream_timeout(exc, reservation, recorded=marked) from exc
        except Exception:
            # An in-process app that raised is a 500 that was not stored: a retry runs again.
            await self._record(
                "release", reservation, lambda: store.release(reservation, timeout=timeout), policy
            )
            raise

        if not policy.stores(answer.status):
            status = answer.status
            await self._record(
                "release",
                reservation,
                lambda: store.release(reservation, upstream_status=status, timeout=timeout),
                policy,
            )
            return GatewayResponse(answer.status, answer.headers, answer.body, "released")

        stored = StoredResponse(
            status=answer.status,
            headers=[(k, v) for k, v in answer.headers if k.lower() not in NOT_REPLAYED],
            body=answer.body if len(answer.body) <= policy.max_stored_body_bytes else None,
            sha256=hashlib.sha256(answer.body).hexdigest(),
        )
        completed = await self._record(
            "complete",
            reservation,
            lambda: store.complete(reservation, stored, timeout=timeout),
            policy,
        )
        if completed and copy_until is not None and self.answers is not None:
            self.answers.put(
                reservation.tenant,
                reservation.key,
                CachedAnswer(fingerprint, stored, reservation.attempt, copy_until),
            )
        return GatewayResponse(answer.status, answer.headers, answer.body, "forwarded")

    async def _record(
        self, operation: str, reservation: Reservation, write: Write, policy: RoutePolicy
    ) -> bool:
        """Record what the upstream did. It has already acted, so the answer goes to the
        client whatever happens here; a write the store could not take is kept and tried
        again in the background (never dropped), conditional on still holding the key."""
        started = time.perf_counter()
        try:
            if await write():
                return True
            logger.warning(
                "could not %s key %r: its lease expired and another holder took it over",
                operation,
                reservation.key,
            )
            return False
        except Exception as exc:
            if isinstance(exc, StoreUnavailable):
                logger.error(
                    "store unavailable, will keep trying to %s key %r (tenant %r): %s",
                    operation,
                    reservation.key,
                    reservation.tenant,
                    describe(exc),
                )
            else:
                # A bug: the client still gets the upstream's answer, and the write is
                # still owed (a fault that depends on the moment may not come back).
                self.internal_errors.report(
                    exc, where="record", about=f"request {reservation.request_id}"
                )
            self.pending.keep_trying(
                OwedWrite(
                    operation,
                    reservation,
                    write,
                    give_up_at=time.monotonic() + policy.key_ttl_seconds,
                )
            )
            return False
        finally:
            self._store_latency(operation, started)

    async def _forward_holding(
        self, reservation: Reservation, forward: Forward, policy: RoutePolicy, lease: LeaseClock
    ) -> UpstreamResponse:
        # Checked here and again where the bytes are about to be written (SEND_BY).
        lease.check()
        # Most upstream calls finish well within a third of the lease, so the renewal task
        # is only created for the slow ones.
        loop = asyncio.get_running_loop()
        renewer: asyncio.Task[None] | None = None

        def start_renewing() -> None:
            nonlocal renewer
            renewer = loop.create_task(self._renew_loop(reservation, lease))

        timer = loop.call_later(self.renew_every, start_renewing)
        started = loop.time()
        sending = SEND_BY.set(lease)
        try:
            answer = await forward(policy.timeout)
            self.latency.observe(policy.prefix, loop.time() - started)
            return answer
        finally:
            SEND_BY.reset(sending)
            timer.cancel()
            if renewer is not None:
                renewer.cancel()

    async def _renew_loop(self, reservation: Reservation, lease: LeaseClock) -> None:
        while True:
            started = time.perf_counter()
            asked = time.monotonic()
            try:
                renewed = await self.store.renew(
                    reservation, self.lease_seconds, timeout=self.store_timeout
                )
            except StoreUnavailable as exc:
                logger.warning(
                    "could not renew the in-flight lease of %r: %s", reservation.key, describe(exc)
                )
            except Exception as exc:
                self.internal_errors.report(
                    exc, where="renew", about=f"request {reservation.request_id}"
                )
            else:
                if not renewed:
                    logger.warning(
                        "in-flight lease of %r lost while waiting on the upstream", reservation.key
                    )
                    return
                lease.renewed(started=asked)
            finally:
                self._store_latency("renew", started)
            await asyncio.sleep(self.renew_every)

    def _store_latency(self, operation: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.store_latency(operation).observe(time.perf_counter() - started)


def describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, StoreUnavailable) else f"{type(exc).__name__}: {exc}"


def replay(stored: StoredResponse, key: str) -> GatewayResponse:
    if stored.body is None:
        problem = Problem(
            410,
            "response-not-stored",
            "Response too large to replay",
            "this Idempotency-Key already ran; its response was too large to store, so only "
            "its status and SHA-256 were kept. The request is not executed again.",
            headers={"Idempotent-Replayed": "true"},
            original_status=stored.status,
            body_sha256=stored.sha256,
        )
        return problem_response(problem, "replayed")
    headers = [(k, v) for k, v in stored.headers if k.lower() not in NOT_REPLAYED]
    headers.append(("idempotent-replayed", "true"))
    return GatewayResponse(stored.status, headers, stored.body, "replayed")


def key_reused() -> Problem:
    return Problem(
        422,
        "key-reused",
        "Idempotency-Key reused",
        "this Idempotency-Key was first used with a different method, path, query or body",
    )


def body_too_large(limit: int) -> Problem:
    return Problem(
        413,
        "body-too-large",
        "Request body too large",
        f"the request body is larger than this route's limit of {limit} bytes",
        max_body_bytes=limit,
    )


def stale_fence(fence: int | None, last_accepted: int | None, entity: str | None) -> Problem:
    return Problem(
        412,
        "stale-fence",
        "Stale fencing token",
        f"X-Execution-Fence {fence} is lower than {last_accepted}, the last fence accepted "
        f"for entity {entity!r}: a newer holder owns this work",
        last_accepted_fence=last_accepted,
        fence=fence,
    )


def in_flight(decision: Decision, upstream_timeout: float, typical: float | None = None) -> Problem:
    """Retry-After is when the first request has probably finished (``typical``: how long
    this route's requests take, `RouteLatency`) or, once it has outlived that, longer the
    longer it has overrun it; within its upstream deadline, at least a second: never the
    whole lease, nor the whole timeout, which a client would wait out for nothing."""
    seconds = retry_after_seconds(
        age=decision.reserved_age or 0.0, timeout=upstream_timeout, typical=typical
    )
    return Problem(
        409,
        "in-flight",
        "Request in flight",
        "a request with this Idempotency-Key is still being processed; retry after it ends",
        headers={"Retry-After": str(seconds)},
        retry_after=seconds,
    )


def outcome_unknown(
    decision: Decision,
    tenant: str,
    key: str,
    *,
    store_argument: str = "",
    release_margin: float = DEFAULT_RELEASE_MARGIN,
) -> Problem:
    """Not "retry later" (409) nor a server error (5xx): common SDKs retry both on their own,
    and a retry cannot help until the key is settled: by the reconciler asking the upstream
    (when the route declares how), else by an operator. The reason and the state use the
    operator's vocabulary (`fencegate.store.key_states`); the body says from when settling it
    by hand is safe (the release rule: its outcome became unknown, or its lease ended, longer
    ago than ``release_margin``), and whether fencegate is asking the upstream itself."""
    state, reason = operator_state(
        decision.key_state or "outcome_unknown", lease_expired=decision.key_state == "in_flight"
    )
    if reason == LEASE_EXPIRED:
        why = (
            "the gateway that forwarded it stopped, or could not record the answer, before "
            "its in-flight lease ran out"
        )
    else:
        why = "the upstream did not answer in time, or the connection was lost after sending"
    since = (
        datetime.fromtimestamp(decision.unknown_since, UTC).isoformat(timespec="seconds")
        if decision.unknown_since is not None
        else None
    )
    safe_from = (
        utc(decision.unknown_since + release_margin) if decision.unknown_since is not None else None
    )
    # When the reconciler looks next (None: the route does not reconcile): epoch seconds.
    reconcile_after = decision.reconcile_after
    command = f"fencegate keys resolve {shlex.quote(key)} --tenant {shlex.quote(tenant)}"
    where = f" {store_argument}" if store_argument else ""
    when_safe = (
        f"Settling it by hand is safe from {safe_from}, when no copy of the request can still "
        f"be on its way to the upstream (release margin {release_margin:g} s); until then "
        f"the resolve command refuses. Read the upstream's records only after that time: "
        f"a copy still on its way may arrive after an earlier look. "
        if safe_from is not None
        else ""
    )
    if reconcile_after is not None:
        settle = (
            f"fencegate is asking the upstream whether it ran (next check at "
            f"{utc(reconcile_after)}): the key will be completed with the upstream's answer, "
            f"or released so that a retry runs, without an operator. Only if the upstream "
            f"cannot tell does an operator resolve it, by recording"
        )
    else:
        settle = "An operator resolves the key by recording"
    problem = Problem(
        OUTCOME_UNKNOWN_STATUS,
        "outcome-unknown",
        "Outcome unknown",
        f"an earlier attempt with this Idempotency-Key was forwarded and may have run "
        f"upstream, but its answer was never recorded: {why}. It is not forwarded again. "
        f"{settle} the upstream's real answer "
        f"(fencegate keys resolve KEY --tenant TENANT --completed --status N --body @FILE) "
        f"or by releasing it so that the next request runs again "
        f"(fencegate keys resolve KEY --tenant TENANT --release). {when_safe}".rstrip(),
        key=key,
        tenant=tenant,
        key_state=state,
        reason=reason,
        since=since,
        attempt=decision.attempt,
        release_safe_from=safe_from,
        release_margin=release_margin,
        resolve=[
            f"{command} --completed --status N --body @answer.json{where}",
            f"{command} --release{where}",
        ],
    )
    if reconcile_after is not None:
        problem.extensions["reconcile_after"] = utc(reconcile_after)
    return problem


def outcome_pending() -> Problem:
    """The key's outcome is not settled yet, but will be without an operator: the gateway
    that forwarded it is alive and still owes the store its answer or its release. Never a
    424 (an operator need not act), and a 5xx so that retrying clients retry."""
    return Problem(
        503,
        "outcome-pending",
        "Outcome pending",
        "an earlier request with this Idempotency-Key is still being settled by the gateway "
        "that forwarded it (its answer or its release is being recorded); retry shortly",
        headers={"Retry-After": "1"},
        retry_after=1,
    )


def internal_error(request_id: str, *, forwarded: bool = False) -> Problem:
    """A fault in fencegate's own code. The body names nothing of it (the log does, under
    the request id)."""
    happened = (
        "after the request was forwarded to the upstream"
        if forwarded
        else "before anything was forwarded to the upstream"
    )
    return Problem(
        500,
        "internal-error",
        "Internal error",
        f"the gateway failed on this request {happened}; the error is logged under request "
        f"id {request_id}",
        request_id=request_id,
    )


def store_unavailable() -> Problem:
    return Problem(
        503,
        "store-unavailable",
        "Store unavailable",
        "the gateway cannot reach its store, so it forwards nothing it could not record",
        headers={"Retry-After": "1"},
        retry_after=1,
    )


def upstream_unreachable(exc: BaseException, *, released: bool) -> Problem:
    # The cause names internal hosts: it goes to the log, not to the client.
    logger.warning("upstream unreachable: %s", exc)
    after = "; the key was released so that a retry runs again" if released else ""
    return Problem(
        502,
        "upstream-unreachable",
        "Upstream unreachable",
        f"the upstream could not be reached and nothing was sent{after}",
    )


def upstream_timeout(
    exc: BaseException, reservation: Reservation | None = None, *, recorded: bool
) -> Problem:
    if reservation is None:
        logger.warning("upstream outcome unknown (no key): %s", exc)
    else:
        logger.warning(
            "upstream outcome unknown for key %r (tenant %r, attempt %d): %s",
            reservation.key,
            reservation.tenant,
            reservation.attempt,
            exc,
        )
    after = "; the key is marked outcome unknown" if recorded else ""
    return Problem(
        504,
        "upstream-timeout",
        "Upstream outcome unknown",
        f"the request was sent but no answer came back in time, so it may have run upstream{after}",
    )
