"""History rows of decisions answered without the store, written in the background.

A replay answered from the gateway's copy of a completed answer (`fencegate.gateway.answers`)
has no transaction of its own to write its decision-history row in. Its row waits here and
is written with the others that came within ``interval`` seconds, in one statement. The
row is durable once that batch commits: a gateway process killed in between loses the
history rows of its last interval's cached replays (never a key, a fence or an answer;
a clean stop writes them). A batch the store does not take is tried again with the next
one; past ``max_rows`` waiting, the oldest are dropped and counted in the log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from fencegate.errors import StoreUnavailable
from fencegate.internal_errors import InternalErrors
from fencegate.store.base import DeferredDecision, GatewayStore

logger = logging.getLogger("fencegate.gateway")

DEFAULT_INTERVAL = 0.2
DEFAULT_MAX_ROWS = 100_000


class DeferredHistory:
    def __init__(
        self,
        store: GatewayStore,
        *,
        timeout: float,
        internal: InternalErrors,
        interval: float = DEFAULT_INTERVAL,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        self._store = store
        self._timeout = timeout
        self._internal = internal
        self.interval = interval
        self._max_rows = max_rows
        # (row, time.monotonic() when decided)
        self._rows: list[tuple[DeferredDecision, float]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task[None] | None = None

    def add(self, row: DeferredDecision) -> None:
        self._rows.append((row, time.monotonic()))
        if len(self._rows) > self._max_rows:
            extra = len(self._rows) - self._max_rows
            del self._rows[:extra]
            logger.warning("decision history: %d rows dropped (the store takes none)", extra)
        if self._timer is None and self._writing is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._start)

    def _start(self) -> None:
        self._timer = None
        if self._rows and self._writing is None:
            self._writing = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        try:
            await self.flush()
        finally:
            self._writing = None
            if self._rows and self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.interval, self._start)

    async def flush(self) -> None:
        """Write every row waiting now; on failure they wait for the next batch."""
        batch, self._rows = self._rows, []
        if not batch:
            return
        now = time.monotonic()
        rows = [_aged(row, now - at) for row, at in batch]
        try:
            await self._store.record_decisions(rows, timeout=self._timeout)
        except StoreUnavailable as exc:
            logger.warning("decision history: %d rows not written yet: %s", len(rows), exc)
            self._rows[:0] = batch
        except Exception as exc:
            self._internal.report(exc, where="history", about=f"{len(rows)} history rows")
            self._rows[:0] = batch

    async def close(self) -> None:
        """Write what is waiting (a clean stop loses no row the store takes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        await self.flush()


def _aged(row: DeferredDecision, age: float) -> DeferredDecision:
    return dataclasses.replace(row, age=max(age, 0.0))
