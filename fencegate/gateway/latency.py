"""How long a route's keyed requests really take upstream, so that a 409 ``in-flight`` can
tell the client when the first request will probably have finished.

The deadline alone (the route's timeout minus the request's age) makes clients that honour
``Retry-After`` wait up to the whole timeout past the answer. Per route, this keeps a
smoothed latency and its mean deviation as TCP keeps round-trip times (RFC 6298: gains 1/8
and 1/4), in memory, per gateway process; one observation costs a dict lookup and a few
float operations. The hint is the smoothed latency plus twice the deviation, minus the
request's age, bounded by what is left of its deadline and never under one second.

A request that has outlived that estimate is slower than the route's usual (one slow outlier
on a fast route): "ask again in a second" would then be repeated on every poll, and a client
that honours Retry-After with a bounded number of retries gives up before the answer. Past
the estimate the hint is how long the request has overrun it, so the polls double their
spacing from the estimate on (1, 2, 4, 8 s ...), still bounded by the deadline.
"""

from __future__ import annotations

import math

_GAIN = 0.125  # RFC 6298 alpha
_DEVIATION_GAIN = 0.25  # RFC 6298 beta


class RouteLatency:
    __slots__ = ("_estimates",)

    def __init__(self) -> None:
        # route -> [smoothed latency, mean deviation], in seconds
        self._estimates: dict[str, list[float]] = {}

    def observe(self, route: str, seconds: float) -> None:
        estimate = self._estimates.get(route)
        if estimate is None:
            self._estimates[route] = [seconds, seconds / 2]
            return
        smoothed, deviation = estimate
        estimate[1] = (1 - _DEVIATION_GAIN) * deviation + _DEVIATION_GAIN * abs(smoothed - seconds)
        estimate[0] = (1 - _GAIN) * smoothed + _GAIN * seconds

    def typical(self, route: str) -> float | None:
        """How long a request on this route usually takes (None before the first answer)."""
        estimate = self._estimates.get(route)
        return None if estimate is None else estimate[0] + 2 * estimate[1]


def retry_after_seconds(*, age: float, timeout: float, typical: float | None) -> int:
    """When to ask again about a request in flight for ``age`` seconds: when such requests
    are usually done or, once it has outlived that, after as long again as it has overrun
    it; never later than its deadline, and at least one second."""
    left = timeout - age
    if typical is None:
        expected = left
    elif age < typical:
        expected = min(typical - age, left)
    else:
        expected = min(age - typical, left)
    return max(1, math.ceil(expected))
