"""A 409 ``in-flight`` says when to ask again from how long the route's requests really take
(measured per route), bounded by the first request's deadline and never under one second —
not the route's whole timeout, which clients that honour Retry-After would wait out. Once the
request has outlived the estimate, the hint grows with how long it has overrun it."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencegate.gateway.latency import RouteLatency, retry_after_seconds
from fencegate.gateway.routes import RoutePolicy
from fencegate.store import GatewayStore
from tests.integration.test_middleware import assert_problem, gateway, keyed
from tests.support.asgi import call
from tests.support.echo_app import EchoApp


@pytest.mark.parametrize(
    ("age", "timeout", "typical", "expected"),
    [
        (0.2, 30.0, None, 30),  # nothing measured yet: the deadline
        (0.2, 30.0, 1.5, 2),  # about 1.3 s more
        (2.0, 30.0, 1.5, 1),  # slower than usual: ask again soon, not never
        (3.5, 30.0, 1.5, 2),  # ... and later the more it has overrun the estimate
        (7.6, 30.0, 0.1, 8),  # a slow outlier on a fast route: not 1 s on every poll
        (25.0, 30.0, 0.1, 5),  # the deadline still bounds it
        (0.5, 3.0, 10.0, 3),  # usually slower than the deadline: the deadline bounds it
        (29.9, 30.0, None, 1),
    ],
)
def test_the_hint_follows_the_measured_latency_within_the_deadline(
    age: float, timeout: float, typical: float | None, expected: int
) -> None:
    assert retry_after_seconds(age=age, timeout=timeout, typical=typical) == expected


@given(st.floats(0.0, 60.0), st.floats(0.01, 60.0), st.floats(0.0, 10.0))
def test_the_hint_never_asks_before_the_estimate_and_grows_past_it(
    age: float, typical: float, extra: float
) -> None:
    timeout = 1000.0  # far: the deadline bounds nothing here (see the table above)
    hint = retry_after_seconds(age=age, timeout=timeout, typical=typical)
    assert hint >= 1
    assert hint >= typical - age  # never before what remains of the estimate
    if age >= typical:  # past it: an older request waits at least as long
        older = retry_after_seconds(age=age + extra, timeout=timeout, typical=typical)
        assert older >= hint


@given(st.floats(0.0, 60.0), st.floats(0.1, 60.0), st.one_of(st.none(), st.floats(0.01, 60.0)))
def test_the_hint_never_goes_past_the_deadline(
    age: float, timeout: float, typical: float | None
) -> None:
    hint = retry_after_seconds(age=age, timeout=timeout, typical=typical)
    assert hint <= max(1, math.ceil(timeout - age))


def test_the_estimate_is_per_route_and_follows_change() -> None:
    latency = RouteLatency()
    assert latency.typical("/a") is None
    for _ in range(50):
        latency.observe("/a", 0.2)
        latency.observe("/b", 4.0)
    typical_a, typical_b = latency.typical("/a"), latency.typical("/b")
    assert typical_a is not None and typical_b is not None
    assert 0.19 < typical_a < 0.25 and 3.9 < typical_b < 4.2
    for _ in range(50):
        latency.observe("/a", 2.0)
    moved = latency.typical("/a")
    assert moved is not None and 1.9 < moved < 2.3


async def test_a_409_on_a_fast_route_asks_again_soon_not_at_the_timeout(
    store: GatewayStore,
) -> None:
    echo = EchoApp()
    app = gateway(echo, store, RoutePolicy(prefix="/", timeout=30.0))
    for n in range(3):  # what requests on this route take: about 0.2 s
        answer = await call(app, "POST", "/pay", headers=keyed(f"warm-{n}"), query="delay=0.2")
        assert answer.status == 200
    echo.started.clear()
    first = asyncio.create_task(call(app, "POST", "/pay", headers=keyed("k"), query="delay=1.5"))
    await asyncio.wait_for(echo.started.wait(), 20)
    second = await call(app, "POST", "/pay", headers=keyed("k"), query="delay=1.5")
    problem = assert_problem(second, 409, "in-flight")
    assert second.header("retry-after") == "1"  # not 30
    assert problem["retry_after"] == 1
    assert (await first).status == 200
