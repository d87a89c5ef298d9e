"""Work classes, the interval rule and the retry backoff."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencegate.lease import IntervalRuleViolation, WorkClass
from fencegate.lease.policy import backoff_seconds, check_intervals


def test_defaults_are_the_documented_ones() -> None:
    wc = WorkClass(kind="create_case")
    assert (wc.lease_seconds, wc.heartbeat_seconds) == (90, 30)
    assert (wc.tolerated_misses, wc.jitter_seconds) == (1, 20)


def test_the_rule_message_shows_the_numbers() -> None:
    with pytest.raises(IntervalRuleViolation) as caught:
        WorkClass(kind="create_case", lease_seconds=35, heartbeat_seconds=30, jitter_seconds=20)
    assert str(caught.value) == "lease 35s must exceed 1 × heartbeat 30s + jitter 20s = 50s"  # noqa: RUF001
    assert isinstance(caught.value, ValueError)


def test_tolerated_misses_count_in_the_rule() -> None:
    WorkClass(
        kind="k", lease_seconds=90, heartbeat_seconds=30, tolerated_misses=2, jitter_seconds=20
    )
    with pytest.raises(IntervalRuleViolation, match="= 110s"):
        WorkClass(
            kind="k", lease_seconds=90, heartbeat_seconds=30, tolerated_misses=3, jitter_seconds=20
        )


def test_the_bound_itself_is_refused() -> None:
    with pytest.raises(IntervalRuleViolation):
        check_intervals(
            lease_seconds=50, heartbeat_seconds=30, tolerated_misses=1, jitter_seconds=20
        )
    check_intervals(lease_seconds=50.5, heartbeat_seconds=30, tolerated_misses=1, jitter_seconds=20)


@pytest.mark.parametrize(
    "values",
    [
        {"heartbeat_seconds": 0},
        {"jitter_seconds": -1},
        {"tolerated_misses": 0},
        {"max_attempts": 0},
        {"backoff_base_seconds": 10, "backoff_max_seconds": 5},
        {"stage_timeout_seconds": 0},
        {"kind": ""},
    ],
)
def test_nonsense_work_classes_are_refused(values: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WorkClass(**{"kind": "k", **values})  # type: ignore[arg-type]


def test_backoff_doubles_and_is_capped() -> None:
    rng = random.Random(7)
    delays = [backoff_seconds(n, base=1, cap=10, rng=rng) for n in range(1, 8)]
    steps = [1, 2, 4, 8, 10, 10, 10]
    for delay, step in zip(delays, steps, strict=True):
        assert step / 2 <= delay <= step


@given(
    attempt=st.integers(min_value=1, max_value=100_000),
    base=st.floats(min_value=0, max_value=100),
    extra=st.floats(min_value=0, max_value=1000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_backoff_stays_within_half_step_and_cap(
    attempt: int, base: float, extra: float, seed: int
) -> None:
    cap = base + extra
    delay = backoff_seconds(attempt, base=base, cap=cap, rng=random.Random(seed))
    step = min(cap, base * 2.0 ** min(attempt - 1, 64))
    assert step / 2 <= delay <= step <= cap


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"max_running": 0}, "max_running 0 must be a whole number of at least 1"),
        ({"max_running_per_key": 1.5}, "max_running_per_key 1.5 must be a whole number"),
        ({"provider": "Stripe Inc"}, "provider 'Stripe Inc' must match"),
        ({"model": "gpt 4o"}, "model 'gpt 4o' must match"),
        ({"models": ("ok", "not ok")}, "models 'not ok' must match"),
    ],
)
def test_scheduling_options_are_checked(options: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        WorkClass(kind="k", **options)  # type: ignore[arg-type]


def test_a_rate_limit_is_checked() -> None:
    from fencegate.lease import RateLimit

    assert RateLimit("stripe", 25).per_seconds == 1.0
    with pytest.raises(ValueError, match="at least 1"):
        RateLimit("stripe", 0)
    with pytest.raises(ValueError, match="positive"):
        RateLimit("stripe", 5, per_seconds=0)
