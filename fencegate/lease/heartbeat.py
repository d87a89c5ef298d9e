"""The heartbeat controller: renews leases from its own thread, event loop and connection.

A tool that blocks the worker's event loop (``time.sleep``, a native call) cannot starve
it, and it renews a lease only while the execution it belongs to is alive and unfinished
(`Execution.running`, its thread alive, its tool within its timeout), never on a bare timer.

Three kinds of trouble, three reactions:

- zero rows (``extend`` → None): the lease is lost. Log ``heartbeat_lost``, cancel the tool;
  its result will not be committed.
- no answer (`StoreUnavailable`): ownership is unknown. Log ``heartbeat_failed`` and
  ``ownership_unknown``; the job's guard refuses new external actions; retry sooner than a
  full period; at ``lease_until - margin`` give up locally (cancel, no commit).
- any other error is a bug in fencegate, not an outage: its traceback is logged (once per
  kind), and the lease is given up at once (``heartbeat_lost``, reason ``internal_error``:
  cancel, no commit), since nothing renews it any more.
- success: ``heartbeat_ok``; the guard allows actions again.

Renewals are grouped: each lease's renewal time is rounded down onto a grid of a quarter of
its period, so leases with one period fall due together, and the renewals due within a few
milliseconds of each other go to the store as one ``extend_many`` (one statement for all the
leases held). The answer is still per lease: a lease missing from it is lost, that one alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

from fencegate.errors import StoreUnavailable
from fencegate.internal_errors import InternalErrors
from fencegate.lease.events import EventLog
from fencegate.lease.execution import Execution, Ownership
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.models import Lease

logger = logging.getLogger("fencegate.worker")

# An extend that cannot even be sent quickly is no better than none: keep a floor so a
# nearly-expired lease still gets one honest try.
_MIN_CALL_TIMEOUT = 0.25
_MIN_RETRY_DELAY = 0.05
# How long the first renewal due waits for others to join its statement.
_GATHER_SECONDS = 0.002
# How long registrations wait to be delivered to the controller's thread, together.
_DELIVERY_SECONDS = 0.02
# Renewals are moved earlier (never later) onto a grid of this fraction of the period.
_GRID_FRACTION = 0.25


class RenewingStore(Protocol):
    async def extend(self, lease: Lease, *, timeout: float) -> Lease | None: ...

    async def get(self, job_id: Any, *, timeout: float) -> Any: ...

    async def close(self) -> None: ...


class RenewingManyStore(RenewingStore, Protocol):
    async def extend_many(self, leases: list[Lease], *, timeout: float) -> list[Lease | None]: ...


_Renewal = tuple[Lease, float, "asyncio.Future[Lease | None]"]
# (execution, (kind, cancel, margin)) registers it; (execution, None) says it finished.
_Message = tuple[Execution, tuple[str, Callable[[], None], float] | None]


def aligned(due: float, period: float, *, now: float) -> float:
    """``due`` moved back onto the renewal grid, unless that is already past."""
    step = period * _GRID_FRACTION
    if step <= 0:
        return due
    earlier = math.floor(due / step) * step
    return earlier if earlier > now else due


class HeartbeatController:
    def __init__(
        self,
        connect: Callable[[], Awaitable[RenewingStore]],
        *,
        events: EventLog,
        metrics: WorkerMetrics,
        worker_id: str,
    ) -> None:
        self._connect = connect
        self.events = events
        self.metrics = metrics
        self.worker_id = worker_id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._store: RenewingStore | None = None
        self._wakeups: dict[int, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._due: list[_Renewal] = []
        # By execution (its id; the message holds the execution, so the id stays its own).
        self._inbox: dict[int, _Message] = {}
        self._inbox_lock = threading.Lock()
        self._delivery_pending = False
        self._flush: asyncio.TimerHandle | None = None
        self.internal_errors = InternalErrors(logger)

    # -- life cycle (called from the worker's thread) --------------------------------------
    def start(self, *, timeout: float) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._thread_main, args=(ready,), name=f"heartbeat-{self.worker_id}", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("heartbeat thread did not start")
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._open(), self._loop)
        try:
            future.result(timeout)
        except BaseException:
            self.stop(timeout=timeout)
            raise

    def _thread_main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _open(self) -> None:
        self._store = await self._connect()

    def stop(self, *, timeout: float) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._close(timeout=timeout), loop)
        with contextlib.suppress(Exception):
            future.result(timeout + 1.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    async def _close(self, *, timeout: float) -> None:
        if self._flush is not None:
            self._flush.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
        if self._store is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._store.close(), timeout)

    # -- executions (thread-safe) -----------------------------------------------------------
    def register(
        self,
        execution: Execution,
        *,
        kind: str,
        cancel: Callable[[], None],
        margin: float,
    ) -> None:
        """Keep ``execution``'s lease while it runs; call ``cancel`` if it must stop."""
        self._require_loop()
        self._post((execution, (kind, cancel, margin)))

    def unregister(self, execution: Execution) -> None:
        """The tool finished (or was abandoned): stop renewing at once."""
        execution.finish()
        with self._inbox_lock:
            pending = self._inbox.get(id(execution))
            if pending is not None and pending[1] is not None:
                # Its registration was never delivered: take it back, and there is nothing
                # to stop (a short job's usual case: no message either way, per job).
                del self._inbox[id(execution)]
                return
        with contextlib.suppress(RuntimeError):  # the controller's loop is already closed
            self._post((execution, None))

    def _post(self, message: _Message) -> None:
        # Waking another thread costs a system call and a hand-over of the GIL, so one
        # wake-up carries every message of the next `_DELIVERY_SECONDS`: a worker running
        # many short jobs does not pay one per job. Nothing here is urgent: the first renewal
        # of a lease is due most of a period after its claim, and a finished execution is
        # never renewed (its `running` flag is already down).
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._inbox_lock:
            self._inbox[id(message[0])] = message
            wake = not self._delivery_pending
            self._delivery_pending = True
        if wake:
            loop.call_soon_threadsafe(loop.call_later, _DELIVERY_SECONDS, self._drain)

    def _drain(self) -> None:
        with self._inbox_lock:
            messages, self._inbox = self._inbox, {}
            self._delivery_pending = False
        for execution, registration in messages.values():
            if registration is None:
                self._wake(id(execution))
            else:
                self._spawn(execution, *registration)

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._store is None:
            raise RuntimeError("heartbeat controller not started")
        return self._loop

    def _spawn(
        self, execution: Execution, kind: str, cancel: Callable[[], None], margin: float
    ) -> None:
        if not execution.running:
            return  # finished before its registration arrived: nothing to renew
        wake = asyncio.Event()
        self._wakeups[id(execution)] = wake
        task = asyncio.get_running_loop().create_task(
            self._keep(execution, kind, cancel, margin, wake)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake(self, key: int) -> None:
        wake = self._wakeups.get(key)
        if wake is not None:
            wake.set()

    # -- the renewal loop of one execution (controller thread) ------------------------------
    async def _keep(
        self,
        execution: Execution,
        kind: str,
        cancel: Callable[[], None],
        margin: float,
        wake: asyncio.Event,
    ) -> None:
        store = self._store
        assert store is not None
        period = float(execution.lease.heartbeat_seconds)
        now = time.monotonic()
        next_at = aligned(now + period - execution.confirmed_age(now=now), period, now=now)
        failures = 0
        try:
            while execution.running:
                delay = next_at - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), delay)
                if not execution.running or execution.state is Ownership.LOST:
                    return
                abandoned = execution.abandoned(now=time.monotonic(), grace=period)
                if abandoned:
                    # Renewing for an executor that is gone or stuck would hold the job
                    # forever; let the lease run out so another worker can take over.
                    self._lose(execution, kind, cancel, abandoned)
                    return
                sent_at = time.monotonic()
                budget = execution.remaining(now=sent_at) - margin
                call_timeout = max(_MIN_CALL_TIMEOUT, min(period, budget))
                try:
                    renewed = await self._renew(store, execution.lease, call_timeout)
                except StoreUnavailable as exc:
                    # No answer from the store: ownership unknown, never confirmed.
                    failures += 1
                    self._failed(execution, kind, exc, failures)
                    left = execution.remaining() - margin
                    if left <= 0:
                        self._lose(execution, kind, cancel, "ownership_unknown_past_margin")
                        return
                    # Retry sooner than a full period while there is margin left.
                    next_at = time.monotonic() + max(_MIN_RETRY_DELAY, min(period, left / 3))
                    continue
                except Exception as exc:
                    # A bug, not an outage: nothing renews this lease any more, so it is
                    # given up now rather than reported as unknown until it runs out.
                    self.internal_errors.report(
                        exc, where="heartbeat", about=f"job {execution.job_id}"
                    )
                    self._lose(execution, kind, cancel, "internal_error", error=type(exc).__name__)
                    return
                if renewed is None:
                    await self._lost_zero_rows(store, execution, kind, cancel)
                    return
                if not execution.renewed(renewed, sent_at=sent_at):
                    return
                failures = 0
                self.events.emit(
                    "heartbeat_ok",
                    **self._about(execution, kind),
                    lease_until=renewed.lease_until,
                )
                next_at = aligned(sent_at + period, period, now=time.monotonic())
        finally:
            self._wakeups.pop(id(execution), None)

    # -- grouped renewals (controller thread) ------------------------------------------------
    async def _renew(self, store: RenewingStore, lease: Lease, timeout: float) -> Lease | None:
        """Renew one lease, in one statement with every other renewal due now."""
        if not hasattr(store, "extend_many"):
            return await store.extend(lease, timeout=timeout)
        many = cast(RenewingManyStore, store)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Lease | None] = loop.create_future()
        self._due.append((lease, timeout, future))
        if self._flush is None:
            self._flush = loop.call_later(_GATHER_SECONDS, self._send_due, many)
        return await future

    def _send_due(self, store: RenewingManyStore) -> None:
        due, self._due, self._flush = self._due, [], None
        live = [entry for entry in due if not entry[2].done()]
        if live:
            task = asyncio.get_running_loop().create_task(self._send(store, live))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, store: RenewingManyStore, due: list[_Renewal]) -> None:
        # The tightest budget of the group bounds the call: no renewal waits past its own.
        timeout = min(entry[1] for entry in due)
        try:
            renewed = await store.extend_many([entry[0] for entry in due], timeout=timeout)
        except Exception as exc:
            for _, _, future in due:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, _, future), lease in zip(due, renewed, strict=True):
            if not future.done():
                future.set_result(lease)

    def _about(self, execution: Execution, kind: str) -> dict[str, Any]:
        """The fields every event of one execution carries."""
        _, provider, model = self.metrics.labels_of(execution.lease)
        about = {
            "job": str(execution.job_id),
            "kind": kind,
            "token": execution.fencing_token,
            "worker": self.worker_id,
        }
        return about | {k: v for k, v in (("provider", provider), ("model", model)) if v}

    def _failed(self, execution: Execution, kind: str, exc: BaseException, failures: int) -> None:
        self.metrics.failed_renewals.labels(*self.metrics.labels_of(execution.lease)).inc()
        common = self._about(execution, kind)
        self.events.emit(
            "heartbeat_failed",
            **common,
            error=type(exc).__name__,
            detail=str(exc)[:200] or None,
            consecutive=failures,
        )
        if execution.mark_unknown():
            self.events.emit(
                "ownership_unknown",
                **common,
                last_confirmed_lease_until=execution.lease.lease_until,
                confirmed_seconds_ago=round(execution.confirmed_age(), 3),
                remaining_seconds=round(execution.remaining(), 3),
            )

    async def _lost_zero_rows(
        self,
        store: RenewingStore,
        execution: Execution,
        kind: str,
        cancel: Callable[[], None],
    ) -> None:
        # Say why at 2 a.m.: cancelled by an operator, or taken over by whom with which token.
        details: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            job = await store.get(execution.job_id, timeout=2.0)
            details = {
                "job_state": job.state,
                "current_owner": job.owner_id if job.owner_id != self.worker_id else None,
                "current_token": job.fencing_token,
            }
        self._lose(execution, kind, cancel, "zero_rows", **details)

    def _lose(
        self,
        execution: Execution,
        kind: str,
        cancel: Callable[[], None],
        reason: str,
        **details: Any,
    ) -> None:
        if not execution.mark_lost(reason):
            return
        self.metrics.expired_leases.labels(*self.metrics.labels_of(execution.lease)).inc()
        self.events.emit("heartbeat_lost", **self._about(execution, kind), reason=reason, **details)
        cancel()
