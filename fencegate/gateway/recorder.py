"""Writes the gateway owes the store after the upstream has acted.

When the store cannot take an answer the upstream gave (or a release, or an unknown mark),
the client still gets its answer and the write is kept here and tried again with backoff,
until it lands, until the key itself would have expired, or until the process stops (on
SIGTERM, within the grace period). Each write stays conditional on the reservation still
being this gateway's, so nobody else's state is ever overwritten. Without this, the key would
stay ``in_flight`` until its lease ran out and then look like an unknown outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fencegate.store.base import Reservation

logger = logging.getLogger("fencegate.gateway")

# One conditional write: True when it landed, False when the reservation is no longer ours.
Write = Callable[[], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class OwedWrite:
    operation: str  # complete | release | mark_unknown
    reservation: Reservation
    write: Write
    give_up_at: float  # monotonic: when the key would have expired anyway


class PendingWrites:
    def __init__(self, *, first_delay: float = 0.05, max_delay: float = 2.0) -> None:
        self.first_delay = first_delay
        self.max_delay = max_delay
        self._tasks: dict[asyncio.Task[None], OwedWrite] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def keep_trying(self, owed: OwedWrite) -> None:
        task = asyncio.get_running_loop().create_task(self._keep_trying(owed))
        self._tasks[task] = owed
        task.add_done_callback(self._tasks.pop)

    async def _keep_trying(self, owed: OwedWrite) -> None:
        delay = self.first_delay
        tries = 0
        r = owed.reservation
        while time.monotonic() + delay < owed.give_up_at:
            await asyncio.sleep(delay)  # backoff between tries, not a wait for a condition
            delay = min(delay * 2, self.max_delay)
            tries += 1
            try:
                landed = await owed.write()
            except Exception as exc:
                logger.debug("still cannot %s key %r: %s", owed.operation, r.key, exc)
                continue
            if landed:
                logger.info(
                    "recorded %s of key %r (tenant %r, attempt %d) after %d more tries",
                    owed.operation,
                    r.key,
                    r.tenant,
                    r.attempt,
                    tries,
                )
            else:
                logger.warning(
                    "could not %s key %r (tenant %r): it is no longer held by this gateway",
                    owed.operation,
                    r.key,
                    r.tenant,
                )
            return
        logger.error(
            "gave up trying to %s key %r (tenant %r, attempt %d): the key expires first",
            owed.operation,
            r.key,
            r.tenant,
            r.attempt,
        )

    async def drain(self, *, grace: float) -> int:
        """Wait up to ``grace`` seconds for the owed writes; returns how many were left.
        Each one left is logged with its key, for an operator to resolve."""
        if self._tasks:
            logger.info("waiting up to %.1fs to record %d answers", grace, len(self._tasks))
            await asyncio.wait(list(self._tasks), timeout=grace)
        left = dict(self._tasks)
        for task, owed in left.items():
            task.cancel()
            logger.error(
                "stopping before the store took %s of key %r (tenant %r, attempt %d): "
                "it will read as an unknown outcome until resolved",
                owed.operation,
                owed.reservation.key,
                owed.reservation.tenant,
                owed.reservation.attempt,
            )
        for task in left:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return len(left)
