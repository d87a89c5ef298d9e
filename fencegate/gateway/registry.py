"""The gateway registry: each gateway process (`fencegate serve`, and the middleware once it
has a store) keeps a row in ``fencegate_gateways`` while it runs.

The release rule reads it: a key in flight whose gateway is alive is never released by
anyone else, since that gateway may still record the answer or release the key itself. So
the row must outlive every write the process owes: it is deleted on a clean stop only after
the engine drained them, and a process that dies leaves a row that runs out (``alive_until``
is three heartbeats ahead, on the database clock). A heartbeat that fails is logged and
tried again at the next one, never fatal: the row then runs out, and the lease deadline
keeps the gateway from sending anything a release could run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Final

from fencegate.store.base import GatewayStore
from fencegate.store.release_rule import DEFAULT_GATEWAY_HEARTBEAT

logger = logging.getLogger("fencegate.gateway")

# A gateway counts as alive this many heartbeats after its last one: one late beat (a slow
# store, a busy loop) does not make it look dead.
ALIVE_BEATS: Final = 3
# Rows of processes that stopped without deregistering (killed) are purged after a day.
PURGE_DEAD_AFTER: Final = 24 * 3600.0
PURGE_EVERY: Final = 3600.0


class GatewayRegistry:
    """One process's row: `start` registers it and heartbeats every ``heartbeat`` seconds,
    `stop` stops heartbeating and deletes it. The caller stops the registry only once the
    process owes the store no write."""

    def __init__(
        self,
        store: GatewayStore,
        instance: str,
        *,
        heartbeat: float = DEFAULT_GATEWAY_HEARTBEAT,
        timeout: float = 2.0,
    ) -> None:
        if not heartbeat > 0:
            raise ValueError("the gateway heartbeat must be longer than zero seconds")
        self.store = store
        self.instance = instance
        self.heartbeat = float(heartbeat)
        self.timeout = float(timeout)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._task: asyncio.Task[None] | None = None
        self._purged_at: float | None = None
        # Whether the latest heartbeat reached the store (for logs: one line per change).
        self.healthy: bool | None = None

    @property
    def alive_seconds(self) -> float:
        return ALIVE_BEATS * self.heartbeat

    async def start(self) -> None:
        """Register now (logged, not raised, when the store is away) and keep heartbeating."""
        await self.beat()
        if self._task is None:
            self._task = asyncio.create_task(self._beat_forever(), name="fencegate-registry")

    async def beat(self) -> bool:
        """One heartbeat (registering the row if it is gone); whether the store took it.
        Now and then, the rows of long-dead processes are purged too."""
        try:
            await self.store.heartbeat_gateway(
                self.instance,
                host=self.host,
                pid=self.pid,
                alive_seconds=self.alive_seconds,
                timeout=min(self.timeout, self.alive_seconds),
            )
        except Exception as exc:
            if self.healthy is not False:
                logger.warning(
                    "gateway %s could not heartbeat in the store (trying again every %gs): %s",
                    self.instance,
                    self.heartbeat,
                    exc,
                )
            self.healthy = False
            return False
        if self.healthy is False:
            logger.info("gateway %s heartbeats in the store again", self.instance)
        self.healthy = True
        await self._purge_now_and_then()
        return True

    async def _purge_now_and_then(self) -> None:
        now = time.monotonic()
        if self._purged_at is not None and now - self._purged_at < PURGE_EVERY:
            return
        self._purged_at = now
        try:
            await self.store.purge_gateways(dead_for_seconds=PURGE_DEAD_AFTER, timeout=self.timeout)
        except Exception as exc:
            logger.info("gateway registry: purging dead gateways skipped: %s", exc)

    async def _beat_forever(self) -> None:
        # Beats on a fixed schedule: a slow one does not push the next ones later (one that
        # took longer than the interval is followed by the next at once).
        next_at = time.monotonic()
        while True:
            next_at = max(next_at + self.heartbeat, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())
            await self.beat()

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop heartbeating and (``deregister``) delete the row: after the engine drained
        its owed writes. A row that cannot be deleted runs out by itself."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not deregister:
            return
        try:
            await self.store.deregister_gateway(self.instance, timeout=self.timeout)
        except Exception as exc:
            logger.warning(
                "gateway %s could not remove its registry row (it runs out in %gs): %s",
                self.instance,
                self.alive_seconds,
                exc,
            )
