"""The gateway's own lease deadline, checked right before a request leaves.

A reservation's lease ends on the database clock; the gateway cannot see that clock, so it
keeps its own deadline on its monotonic clock, measured from *before* the round trip that
reserved (or renewed) the key and shortened by a margin for clock rate. Past it, the
reservation could have ended and the key been released (by an operator or the reconciler),
so nothing may leave any more: a gateway paused after reserving (SIGSTOP, a long GC, a
stalled VM) must not send its copy when it wakes. The release rule (store/release_rule.py)
relies on this: no copy starts leaving after the lease ends.

The deadline travels to the upstream client in a context variable, so that the last check
runs where the bytes are about to be written (aiohttp's headers-sent hook, before anything is
written), not an await earlier.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Final

from fencegate.errors import FencegateError

# Clocks run at slightly different rates; the gateway gives up this share of its lease.
CLOCK_RATE_MARGIN: Final = 0.01


class LeaseDeadlinePassed(FencegateError):
    """Nothing was sent: the reservation's lease could have ended first."""


class LeaseClock:
    """One reservation's deadline on this process's monotonic clock."""

    __slots__ = ("deadline", "lease_seconds")

    def __init__(self, lease_seconds: float, *, started: float) -> None:
        self.lease_seconds = lease_seconds
        self.deadline = started + lease_seconds * (1.0 - CLOCK_RATE_MARGIN)

    def renewed(self, *, started: float) -> None:
        """A renewal that began at ``started`` (before its round trip) succeeded."""
        self.deadline = max(self.deadline, started + self.lease_seconds * (1.0 - CLOCK_RATE_MARGIN))

    def check(self) -> None:
        overdue = time.monotonic() - self.deadline
        if overdue >= 0:
            raise LeaseDeadlinePassed(
                f"the in-flight lease could have ended {overdue:.3f}s before the request "
                "could be sent"
            )


# The reservation being sent by the current task (the renewer moves its deadline forward).
SEND_BY: ContextVar[LeaseClock | None] = ContextVar("fencegate_send_by", default=None)


def check_send_deadline() -> None:
    """Raise `LeaseDeadlinePassed` when the current request's deadline has passed."""
    clock = SEND_BY.get()
    if clock is not None:
        clock.check()
