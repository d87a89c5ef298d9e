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

from fencegate.errors import StoreClosed, StoreUnavailable
from fencegate.internal_errors import InternalErrors
from fencegate.store.base import KeyRecord, Reservation

logger = logging.getLogger("fencegate.gateway")

# One conditional write: True when it landed, False when the reservation is no longer ours.
Write = Callable[[], Awaitable[bool]]
# The key as the store has it now (tenant, key), to tell what a write that found nothing to
# change means.
LookUp = Callable[[str, str], Awaitable[KeyRecord | None]]

# A decision the gateway gave up on (503): its reservation, if it committed after all, goes.
ABANDON = "abandon"


@dataclass(frozen=True, slots=True)
class OwedWrite:
    operation: str  # complete | release | mark_unknown | abandon
    reservation: Reservation
    write: Write
    give_up_at: float  # monotonic: when the key would have expired anyway
    # For an abandoned decision: finding nothing is no proof (its transaction may still be
    # committing, e.g. waiting on a synchronous standby), so look again until then.
    watch_until: float = 0.0


def landed_before(operation: str, r: Reservation, record: KeyRecord | None) -> bool:
    """Whether the key is as ``operation`` by this reservation leaves it: an earlier try
    committed and only its reply was lost (or, for a release, nothing of ours is left)."""
    if operation in ("release", ABANDON):
        return record is None or record.owner != r.owner
    if record is None or (record.owner, record.attempt) != (r.owner, r.attempt):
        return False
    wanted = {"complete": "completed", "mark_unknown": "outcome_unknown"}.get(operation)
    return record.state == wanted


def holder_of(record: KeyRecord | None) -> str:
    if record is None:
        return "it is gone (released or purged)"
    return f"it is {record.state} under {record.owner} (attempt {record.attempt})"


class PendingWrites:
    def __init__(
        self,
        *,
        look_up: LookUp | None = None,
        first_delay: float = 0.05,
        max_delay: float = 2.0,
        internal: InternalErrors | None = None,
    ) -> None:
        self.look_up = look_up
        self.internal = internal  # where a bug met while trying is reported
        self.first_delay = first_delay
        self.max_delay = max_delay
        self._tasks: dict[asyncio.Task[None], OwedWrite] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def owes(self, tenant: str, key: str) -> bool:
        """Whether this process still owes the store a write for the key (an answer, a
        release): its outcome is not settled yet, though the store may say unknown."""
        return any(
            owed.reservation.tenant == tenant and owed.reservation.key == key
            for owed in self._tasks.values()
        )

    def keep_trying(self, owed: OwedWrite) -> None:
        task = asyncio.get_running_loop().create_task(self._keep_trying(owed))
        self._tasks[task] = owed
        task.add_done_callback(self._tasks.pop)

    async def _keep_trying(self, owed: OwedWrite) -> None:
        delay = self.first_delay
        tries = 0
        bug_reported = False
        r = owed.reservation
        while time.monotonic() + delay < owed.give_up_at:
            await asyncio.sleep(delay)  # backoff between tries, not a wait for a condition
            delay = min(delay * 2, self.max_delay)
            tries += 1
            try:
                landed = await owed.write()
            except StoreClosed:
                # Nobody will try again once this process let go of the store: say so.
                self._left_behind(owed)
                return
            except StoreUnavailable as exc:
                logger.debug("still cannot %s key %r: %s", owed.operation, r.key, exc)
                continue
            except Exception as exc:
                # A bug, not the store: reported once per owed write, and tried again, as a
                # fault that depends on the moment may not come back.
                if self.internal is not None and not bug_reported:
                    self.internal.report(exc, where="owed_write", about=f"key {r.key!r}")
                    bug_reported = True
                logger.debug("still cannot %s key %r: %r", owed.operation, r.key, exc)
                continue
            if owed.operation == ABANDON:
                if landed:
                    logger.warning(
                        "released key %r (tenant %r): its reservation committed after the "
                        "gateway had refused the request (store-unavailable)",
                        r.key,
                        r.tenant,
                    )
                elif time.monotonic() + delay < owed.watch_until:
                    continue
            elif landed:
                logger.info(
                    "recorded %s of key %r (tenant %r, attempt %d) after %d more tries",
                    owed.operation,
                    r.key,
                    r.tenant,
                    r.attempt,
                    tries,
                )
            else:
                await self._not_held(owed)
            return
        logger.error(
            "gave up trying to %s key %r (tenant %r, attempt %d): the key expires first",
            owed.operation,
            r.key,
            r.tenant,
            r.attempt,
        )

    async def _not_held(self, owed: OwedWrite) -> None:
        """The write found nothing to change: say why, after a look at the key. An earlier
        try that committed with only its reply lost is not a lost key."""
        r = owed.reservation
        try:
            record = None if self.look_up is None else await self.look_up(r.tenant, r.key)
        except Exception as exc:
            logger.warning(
                "could not %s key %r (tenant %r): it is not held as this gateway left it, "
                "and its state could not be read: %s",
                owed.operation,
                r.key,
                r.tenant,
                exc,
            )
            return
        if self.look_up is not None and landed_before(owed.operation, r, record):
            logger.info(
                "%s of key %r (tenant %r, attempt %d) had already landed; only the store's "
                "reply was lost",
                owed.operation,
                r.key,
                r.tenant,
                r.attempt,
            )
            return
        logger.warning(
            "could not %s key %r (tenant %r, attempt %d): it is no longer held by this gateway: %s",
            owed.operation,
            r.key,
            r.tenant,
            r.attempt,
            holder_of(record) if self.look_up is not None else "its state is not known",
        )

    async def drain(self, *, grace: float) -> int:
        """Wait up to ``grace`` seconds for the owed writes; returns how many were left.
        Each one left is logged with its key, for an operator to resolve. Watches over
        abandoned decisions are not waited for (they mostly find nothing); each still open
        is logged."""
        answers = [task for task, owed in self._tasks.items() if owed.operation != ABANDON]
        if answers:
            logger.info("waiting up to %.1fs to record %d answers", grace, len(answers))
            await asyncio.wait(answers, timeout=grace)
        left = dict(self._tasks)
        for task, owed in left.items():
            task.cancel()
            self._left_behind(owed)
        for task in left:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return sum(owed.operation != ABANDON for owed in left.values())

    def _left_behind(self, owed: OwedWrite) -> None:
        """Log a write this gateway stops trying, for an operator to resolve."""
        if owed.operation == ABANDON:
            logger.warning(
                "stopping while key %r (tenant %r) may still be reserved by a decision "
                "refused with store-unavailable: if it is, it reads as an unknown "
                "outcome until resolved",
                owed.reservation.key,
                owed.reservation.tenant,
            )
            return
        logger.error(
            "stopping before the store took %s of key %r (tenant %r, attempt %d): "
            "it will read as an unknown outcome until resolved",
            owed.operation,
            owed.reservation.key,
            owed.reservation.tenant,
            owed.reservation.attempt,
        )
