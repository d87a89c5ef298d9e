"""Opportunistic batching: calls that arrive while earlier ones run go to the database
together, in one statement and one commit.

Nothing waits for a batch to fill: an idle gateway sends each call at once. Under load,
each round trip carries everything that queued up meanwhile, so the gateway makes fewer
round trips and commits than it answers requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from fencegate.store.base import StoreUnavailable

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")

# run(items, timeout) -> one result per item, in order; an exception in place of a result
# fails that item alone.
BatchRunner = Callable[[list[I], float], Awaitable[Sequence[R | BaseException]]]


class Batcher(Generic[I, R]):
    def __init__(
        self, run: BatchRunner[I, R], *, max_batch: int = 64, max_in_flight: int = 2
    ) -> None:
        self._run = run
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._pending: list[tuple[I, float, asyncio.Future[R]]] = []
        self._in_flight: set[asyncio.Task[None]] = set()

    async def submit(self, item: I, *, timeout: float) -> R:
        """The item's result, within ``timeout``. A call still queued when its ``timeout``
        has passed is never sent (the caller has given up on it) and fails at once with
        `StoreUnavailable`; a call already sent waits for its batch, whose run is bounded by
        the earliest deadline in it, so by this call's own."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        entry = (item, time.monotonic() + timeout, future)
        self._pending.append(entry)
        if len(self._in_flight) < self._max_in_flight:
            self._start()
        if future.done() or entry not in self._pending:
            return await future  # sent at once: no timer needed on the common path
        expiry = loop.call_later(timeout, self._expire, entry)
        try:
            return await future
        finally:
            expiry.cancel()

    def _expire(self, entry: tuple[I, float, asyncio.Future[R]]) -> None:
        """A queued call's deadline passed behind batches in flight: fail it, unsent."""
        try:
            self._pending.remove(entry)
        except ValueError:
            return  # already sent
        if not entry[2].done():
            entry[2].set_exception(StoreUnavailable("no answer in time (queued)"))

    def _take(self) -> list[tuple[I, float, asyncio.Future[R]]]:
        """The next batch to send; calls whose deadline has passed fail here, unsent."""
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            now = time.monotonic()
            live = []
            for entry in batch:
                if entry[1] <= now:
                    if not entry[2].done():
                        entry[2].set_exception(StoreUnavailable("no answer in time (queued)"))
                else:
                    live.append(entry)
            if live:
                return live
        return []

    def _start(self) -> None:
        live = self._take()
        if not live:
            return
        task = asyncio.get_running_loop().create_task(self._send(live))
        self._in_flight.add(task)
        task.add_done_callback(self._done)

    async def _send(self, batch: list[tuple[I, float, asyncio.Future[R]]]) -> None:
        # What queued up while a batch ran goes next from this same task: a new task, and
        # the done callback that would start it, each wait for another turn of the event
        # loop, which under load is busy with every other request's I/O.
        while batch:
            await self._send_one(batch)
            batch = self._take()

    async def _send_one(self, batch: list[tuple[I, float, asyncio.Future[R]]]) -> None:
        timeout = min(deadline for _, deadline, _ in batch) - time.monotonic()
        try:
            results = await self._run([item for item, _, _ in batch], max(timeout, 0.0))
        except BaseException as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if self._pending and len(self._in_flight) < self._max_in_flight:
            self._start()
