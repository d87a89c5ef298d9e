"""Opportunistic batching: calls that arrive while earlier ones run go to the database
together, in one statement and one commit.

Nothing waits for a batch to fill: an idle gateway sends each call at once. Under load,
each round trip carries everything that queued up meanwhile, so the gateway makes fewer
round trips and commits than it answers requests.

With a ``group`` (the gateway on Citus: the tenant), a batch holds the calls of one group
only, the oldest queued call's, so that each round trip touches one shard; the batches of
several groups may be in flight at once (``max_in_flight``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from fencegate.errors import StoreTimedOut, unsent

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")

# run(items, timeout) -> one result per item, in order; an exception in place of a result
# fails that item alone.
BatchRunner = Callable[[list[I], float], Awaitable[Sequence[R | BaseException]]]


class _Call(Generic[I, R]):
    """One submitted call. Compared by identity: finding it among the queued calls must not
    compare the items themselves (dataclasses, compared field by field)."""

    __slots__ = ("deadline", "future", "item", "taken", "timeout")
    item: I
    timeout: float
    deadline: float
    future: asyncio.Future[R]
    taken: bool

    def __init__(self, item: I, timeout: float, future: asyncio.Future[R]) -> None:
        self.item = item
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.future = future
        self.taken = False  # off the queue: sent in a batch, or failed unsent

    def timed_out(self, where: str = "") -> StoreTimedOut:
        # The caller's own timeout, not the time its batch had left when it was sent.
        return StoreTimedOut(f"no answer within {self.timeout:g}s{where}")

    def give_up(self) -> None:
        """Off the queue, unsent: its caller's deadline has passed."""
        self.taken = True
        if not self.future.done():
            self.future.set_exception(unsent(self.timed_out(" (queued behind earlier calls)")))


class Batcher(Generic[I, R]):
    def __init__(
        self,
        run: BatchRunner[I, R],
        *,
        max_batch: int = 64,
        max_deep_batch: int | None = None,
        max_in_flight: int = 2,
        group: Callable[[I], Hashable] | None = None,
        abandoned: Callable[[I, R], None] | None = None,
        inline: bool = False,
    ) -> None:
        self._run = run
        # With nothing in flight or queued, a call runs in its caller's task: a task of its
        # own would start, and its answer reach the caller, each a turn of the event loop
        # later (a busy loop's turn: a Worker's claims are on its critical path).
        self._inline = inline
        # Told of a result whose caller stopped waiting for it (cancelled): what it holds
        # (leases a claim granted) is nobody's unless given back.
        self._abandoned = abandoned
        self._group = group
        self._max_batch = max_batch
        # A backlog of more than two batches (more callers than one statement carries, e.g.
        # several Workers' jobs ending together) goes in batches of up to this many: at
        # max_batch it would only grow, each queued call holding its caller meanwhile. A
        # shallower one keeps max_batch, whose first calls are answered sooner.
        self._max_deep_batch = max(max_deep_batch or max_batch, max_batch)
        self._max_in_flight = max_in_flight
        self._pending: list[_Call[I, R]] = []
        self._in_flight: set[asyncio.Task[None]] = set()
        # One timer for every queued call, set for the earliest deadline among them: a timer
        # per call would cost more than the call under load, when most calls queue.
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = 0.0
        # The loop of the calls queued or in flight (they all share one). Looked up again
        # only when there are none: each lookup costs a getpid() system call.
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def queued(self) -> int:
        """Calls waiting for a batch, not yet sent."""
        return len(self._pending)

    async def submit(self, item: I, *, timeout: float) -> R:
        """The item's result, within ``timeout``. A call still queued when its ``timeout``
        has passed is never sent (the caller has given up on it) and fails at once with
        `StoreUnavailable`; a call already sent waits for its batch, whose run is bounded by
        the earliest deadline in it, so by this call's own."""
        loop = self._loop
        if loop is None or not (self._in_flight or self._pending):
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        call = _Call(item, timeout, future)
        if self._inline and not self._in_flight and not self._pending:
            return await self._send_inline(call)
        self._pending.append(call)
        if len(self._in_flight) < self._max_in_flight:
            self._start()
        if not call.taken:
            self._sweep_by(call.deadline)
        return await call.future

    async def _send_inline(self, call: _Call[I, R]) -> R:
        """``call`` alone, sent from its caller's task; calls made meanwhile queue behind it
        and go together once it is answered."""
        running = asyncio.current_task()
        assert running is not None
        call.taken = True
        self._in_flight.add(running)  # counted, never awaited here
        try:
            await self._send_one([call])
        except BaseException:
            # Cancelled while in flight: the exception is this caller's to see, raised here,
            # not its future's to report as never retrieved.
            if call.future.done() and not call.future.cancelled():
                call.future.exception()
            raise
        finally:
            self._in_flight.discard(running)
            if self._pending and len(self._in_flight) < self._max_in_flight:
                self._start()
        return call.future.result()

    def _sweep_by(self, deadline: float) -> None:
        if self._sweep is not None:
            if self._sweep_at <= deadline:
                return
            self._sweep.cancel()
        delay = max(deadline - time.monotonic(), 0.0)
        assert self._loop is not None
        self._sweep = self._loop.call_later(delay, self._expire_due)
        self._sweep_at = deadline

    def _expire_due(self) -> None:
        """Queued calls whose deadline passed behind batches in flight fail, unsent."""
        self._sweep = None
        now = time.monotonic()
        waiting = []
        for call in self._pending:
            if call.deadline > now:
                waiting.append(call)
            else:
                call.give_up()
        self._pending[:] = waiting
        if waiting:
            self._sweep_by(min(call.deadline for call in waiting))

    def _take(self) -> list[_Call[I, R]]:
        """The next batch to send; calls whose deadline has passed fail here, unsent."""
        while self._pending:
            if self._group is None:
                size = self._max_batch
                if len(self._pending) > 2 * size:
                    size = self._max_deep_batch
                batch = self._pending[:size]
                del self._pending[:size]
            else:
                batch = self._take_group(self._group(self._pending[0].item))
            now = time.monotonic()
            live = []
            for call in batch:
                if call.future.done():  # its caller was cancelled: nobody waits for it
                    call.taken = True
                elif call.deadline <= now:
                    call.give_up()
                else:
                    call.taken = True
                    live.append(call)
            if live:
                return live
        return []

    def _take_group(self, group: Hashable) -> list[_Call[I, R]]:
        """Up to ``max_batch`` queued calls of ``group``, in order; the others stay queued."""
        assert self._group is not None
        batch: list[_Call[I, R]] = []
        rest: list[_Call[I, R]] = []
        for call in self._pending:
            if len(batch) < self._max_batch and self._group(call.item) == group:
                batch.append(call)
            else:
                rest.append(call)
        self._pending[:] = rest
        return batch

    def _start(self) -> None:
        live = self._take()
        if not live:
            return
        assert self._loop is not None
        task = self._loop.create_task(self._send(live))
        self._in_flight.add(task)
        task.add_done_callback(self._done)

    async def _send(self, batch: list[_Call[I, R]]) -> None:
        # What queued up while a batch ran goes next from this same task: a new task, and
        # the done callback that would start it, each wait for another turn of the event
        # loop, which under load is busy with every other request's I/O.
        while batch:
            await self._send_one(batch)
            batch = self._take()

    async def _send_one(self, batch: list[_Call[I, R]]) -> None:
        timeout = min(call.deadline for call in batch) - time.monotonic()
        try:
            results = await self._run([call.item for call in batch], max(timeout, 0.0))
        except BaseException as exc:
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(
                        call.timed_out() if isinstance(exc, StoreTimedOut) else exc
                    )
            if not isinstance(exc, Exception):
                raise
            return
        for call, result in zip(batch, results, strict=True):
            if call.future.done():
                if self._abandoned is not None and not isinstance(result, BaseException):
                    self._abandoned(call.item, result)
                continue
            if isinstance(result, BaseException):
                call.future.set_exception(result)
            else:
                call.future.set_result(result)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if self._pending and len(self._in_flight) < self._max_in_flight:
            self._start()
