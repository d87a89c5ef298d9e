"""What one worker knows locally about one lease it holds: owned, unknown or lost.

The heartbeat controller (its own thread) writes this state; the tool's guard and the fenced
client (the worker's event loop) read it. Every field is read and written under one lock.

Local deadlines use the monotonic clock, counted from the moment a claim or renewal was
*sent*: the database set ``lease_until = now() + lease_seconds`` no earlier than that moment,
so the local deadline is never later than the real one.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import TYPE_CHECKING, Any

from fencegate.errors import FencegateError

if TYPE_CHECKING:
    from fencegate.lease.models import Lease


class OwnershipError(FencegateError):
    """The job may no longer act on the outside world."""

    def __init__(self, job_id: Any, fencing_token: int, detail: str) -> None:
        super().__init__(f"job {job_id} (token {fencing_token}): {detail}")
        self.job_id = job_id
        self.fencing_token = fencing_token
        self.detail = detail


class OwnershipLost(OwnershipError):
    """The store said this worker no longer holds the lease (or it gave up locally)."""


class OwnershipUnknown(OwnershipError):
    """The lease could not be confirmed recently enough: start no new external action."""


class PermanentError(FencegateError):
    """Raised by a tool for a failure that retrying cannot fix: the job fails at once."""


class Ownership(enum.Enum):
    OWNED = "owned"
    UNKNOWN = "unknown"
    LOST = "lost"


class Execution:
    """One claimed lease being worked on by this process."""

    def __init__(self, lease: Lease, *, confirmed_at: float) -> None:
        self._lock = threading.Lock()
        self._lease = lease
        self._state = Ownership.OWNED
        self._confirmed_at = confirmed_at
        self._running = True
        self.lost_reason: str | None = None
        # The executor: the thread whose loop runs the tool, and when the tool must be done.
        self.executor_thread = threading.current_thread()
        self.tool_deadline: float | None = None

    @property
    def lease(self) -> Lease:
        with self._lock:
            return self._lease

    @property
    def job_id(self) -> Any:
        return self._lease.job_id

    @property
    def fencing_token(self) -> int:
        return int(self._lease.fencing_token)

    @property
    def state(self) -> Ownership:
        with self._lock:
            return self._state

    @property
    def running(self) -> bool:
        """True while the tool is alive and unfinished: the only time a renewal is wanted."""
        with self._lock:
            return self._running

    def start_tool(self, *, timeout: float | None, now: float) -> None:
        self.tool_deadline = None if timeout is None else now + float(timeout)

    def abandoned(self, *, now: float, grace: float) -> str | None:
        """Why the executor can no longer be trusted to be alive and useful, if it cannot.

        Its thread died; or the tool ran past its timeout by more than ``grace`` although
        the worker's loop should have cancelled it (a tool that blocks the loop for good).
        """
        if not self.executor_thread.is_alive():
            return "executor_thread_gone"
        if self.tool_deadline is not None and now > self.tool_deadline + grace:
            return "tool_timeout_overrun"
        return None

    def finish(self) -> None:
        with self._lock:
            self._running = False

    def remaining(self, *, now: float | None = None) -> float:
        """Seconds until the lease ends, by the conservative local deadline."""
        with self._lock:
            return self._deadline() - (time.monotonic() if now is None else now)

    def confirmed_age(self, *, now: float | None = None) -> float:
        with self._lock:
            return (time.monotonic() if now is None else now) - self._confirmed_at

    def _deadline(self) -> float:
        # The lease ends, locally, one lease duration after the last confirmation was sent.
        # Called with the lock held.
        return self._confirmed_at + float(self._lease.lease_seconds)

    def renewed(self, lease: Lease, *, sent_at: float) -> bool:
        """Record a successful renewal; False if the execution was already given up."""
        with self._lock:
            if self._state is Ownership.LOST:
                return False
            self._lease = lease
            self._confirmed_at = sent_at
            self._state = Ownership.OWNED
            return True

    def mark_unknown(self) -> bool:
        """True the first time ownership becomes unknown (since the last confirmation)."""
        with self._lock:
            if self._state is not Ownership.OWNED:
                return False
            self._state = Ownership.UNKNOWN
            return True

    def mark_lost(self, reason: str) -> bool:
        """True if this call is the one that gave the lease up."""
        with self._lock:
            if self._state is Ownership.LOST:
                return False
            self._state = Ownership.LOST
            self.lost_reason = reason
            return True

    def guard(self, *, margin: float) -> None:
        """Raise unless this worker may start a new external action now.

        It may when the last confirmation is still good for more than ``margin`` seconds.
        """
        with self._lock:
            state, deadline, reason = self._state, self._deadline(), self.lost_reason
        if state is Ownership.LOST:
            raise OwnershipLost(self.job_id, self.fencing_token, f"lease lost ({reason})")
        if state is Ownership.UNKNOWN:
            raise OwnershipUnknown(
                self.job_id, self.fencing_token, "the store cannot confirm the lease"
            )
        left = deadline - time.monotonic()
        if left <= margin:
            raise OwnershipUnknown(
                self.job_id,
                self.fencing_token,
                f"lease confirmed for only {max(left, 0.0):.2f}s more (margin {margin:.2f}s)",
            )
