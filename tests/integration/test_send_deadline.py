"""The gateway's send deadline in-process (issue 25): a reservation whose request could only
leave after its in-flight lease may have ended is not sent at all. It gets 503
store-unavailable, the reservation is released, and the retry runs once.

The store is real (both backends) and so is the upstream (a socket server on its own thread,
which notes every request head that reaches it). What is injected is time: the decision's
answer arriving late (a slow round trip, a paused process), or the event loop stalling right
after the last check before the request's bytes are written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from fencegate.gateway import upstream as upstream_module
from fencegate.gateway.engine import Engine, GatewayResponse
from fencegate.gateway.routes import RoutePolicy
from fencegate.gateway.upstream import HttpUpstream, UpstreamResponse
from fencegate.store import DecideRequest, Decision, GatewayStore
from fencegate.types import IncomingRequest, Message
from tests.support.raw_upstream import RawUpstream

LEASE = 0.2  # seconds
PAUSE = 0.35  # longer than the lease
TENANT = "default"


def request(key: str) -> IncomingRequest:
    return IncomingRequest(
        "POST", "http", "gw", "/v1/charges", "", (("idempotency-key", key),), b'{"amount": 5}'
    )


def problem_type(response: GatewayResponse) -> str:
    return str(orjson.loads(response.body)["type"]).rsplit("/", 1)[-1]


async def no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


@pytest.fixture
def upstream() -> Any:
    with RawUpstream() as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[HttpUpstream]:
    client = HttpUpstream()
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def forward_with(
    http: HttpUpstream, policy: RoutePolicy, incoming: IncomingRequest
) -> Callable[[float], Awaitable[UpstreamResponse]]:
    async def forward(timeout: float) -> UpstreamResponse:
        return await http.send(incoming, policy, {}, no_body, timeout=timeout)

    return forward


def decide_late_once(store: GatewayStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The store's real ``decide``, whose first answer reaches the gateway ``PAUSE`` seconds
    after the store committed it. Returns the outcomes the store gave."""
    real = store.decide
    outcomes: list[str] = []

    async def late(request: DecideRequest, *, timeout: float) -> Decision:
        decision = await real(request, timeout=timeout)
        outcomes.append(decision.outcome.value)
        if len(outcomes) == 1:
            await asyncio.sleep(PAUSE)
        return decision

    monkeypatch.setattr(store, "decide", late)
    return outcomes


async def assert_not_sent_then_released_then_run_once(
    engine: Engine,
    store: GatewayStore,
    forward: Callable[[float], Awaitable[UpstreamResponse]],
    policy: RoutePolicy,
    key: str,
    sent: Callable[[], int],
) -> None:
    first = await engine.handle(request(key), policy, TENANT, forward)
    assert first.status == 503, first
    assert problem_type(first) == "store-unavailable", first.body
    assert first.decision == "store_unavailable"
    assert sent() == 0, "the request left after its lease could have ended"
    # Released: nothing of the reservation is left, so the retry runs normally.
    assert await store.get_key(TENANT, key, timeout=10) is None
    retried = await engine.handle(request(key), policy, TENANT, forward)
    assert retried.status == 200 and retried.decision == "forwarded", retried.body
    assert sent() == 1
    record = await store.get_key(TENANT, key, timeout=10)
    assert record is not None and record.state == "completed"


async def test_a_reservation_answered_after_its_lease_is_not_forwarded(
    store: GatewayStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own check, whatever the upstream is (an in-process app included)."""
    calls: list[float] = []

    async def forward(timeout: float) -> UpstreamResponse:
        calls.append(timeout)
        return UpstreamResponse(200, [("content-type", "text/plain")], b"charged")

    outcomes = decide_late_once(store, monkeypatch)
    engine = Engine(store, lease_seconds=LEASE, store_timeout=10)
    try:
        await assert_not_sent_then_released_then_run_once(
            engine, store, forward, RoutePolicy(), "late-decision", lambda: len(calls)
        )
    finally:
        await engine.close()
    assert outcomes == ["reserved", "reserved"]


async def test_a_reservation_answered_after_its_lease_is_not_sent_upstream(
    store: GatewayStore,
    upstream: RawUpstream,
    http: HttpUpstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the real HTTP client to a real socket: nothing reaches the upstream."""
    policy = RoutePolicy(upstream=upstream.url)
    key = "late-decision-http"
    decide_late_once(store, monkeypatch)
    engine = Engine(store, lease_seconds=LEASE, store_timeout=10)
    try:
        await assert_not_sent_then_released_then_run_once(
            engine,
            store,
            forward_with(http, policy, request(key)),
            policy,
            key,
            lambda: len(upstream.received),
        )
    finally:
        await engine.close()


async def test_a_loop_stalled_after_the_last_check_does_not_write_the_request(
    store: GatewayStore, upstream: RawUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HTTP client checks the deadline once the connection is ready, but writes the
    request's bytes (the head together with the body) a step later, from another task. A
    process paused in between (SIGSTOP, a long GC pause) must not write them when it wakes:
    here the event loop stalls past the lease right after that check."""
    checked = upstream_module._check_before_writing
    stalls: list[float] = []

    def check_then_stall() -> None:
        checked()
        if not stalls:
            stalls.append(PAUSE)
            # Nothing of this request has been written yet; the loop stalls before it is.
            asyncio.get_running_loop().call_soon(time.sleep, PAUSE)

    monkeypatch.setattr(upstream_module, "_check_before_writing", check_then_stall)
    http = HttpUpstream()
    await http.start()
    policy = RoutePolicy(upstream=upstream.url)
    key = "stalled-before-writing"
    engine = Engine(store, lease_seconds=LEASE, store_timeout=10)
    try:
        await assert_not_sent_then_released_then_run_once(
            engine,
            store,
            forward_with(http, policy, request(key)),
            policy,
            key,
            lambda: len(upstream.received),
        )
    finally:
        await engine.close()
        await http.close()
    assert stalls == [PAUSE]
