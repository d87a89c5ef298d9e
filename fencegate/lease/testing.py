"""Tools for exercising workers against trouble, used by the demo and the tests.

`PartitionSwitch` + `PartitionedStore` put a worker on the far side of a network partition
from its store without touching the store itself: while the switch is on, every call
through the wrapper waits out its own ``timeout`` and then raises `StoreUnavailable`, which
is exactly what a driver does when its database stops answering. The database and everyone
else's connections carry on. (On PostgreSQL a real TCP relay can cut a real connection; a
SQLite file has no connection to cut, and this is the honest stand-in.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from fencegate.lease.errors import StoreUnavailable

_DEFAULT_TIMEOUT = 10.0

_CALLS = frozenset(
    {
        "claim",
        "extend",
        "extend_many",
        "complete",
        "complete_many",
        "fail",
        "release",
        "cancel",
        "retry",
        "get",
        "attempts",
        "now",
        "stage_result",
        "commit_stage",
        "enqueue",
        "list_jobs",
    }
)


class PartitionSwitch:
    """Thread-safe on/off, shared by every wrapper of one worker (its loop and its
    heartbeat thread)."""

    def __init__(self) -> None:
        self._on = threading.Event()
        self.blocked_calls = 0
        self._lock = threading.Lock()

    @property
    def partitioned(self) -> bool:
        return self._on.is_set()

    def partition(self) -> None:
        self._on.set()

    def heal(self) -> None:
        self._on.clear()

    def count(self) -> None:
        with self._lock:
            self.blocked_calls += 1


class PartitionedStore:
    """Wraps a `LeaseQueue`; calls fail like an unreachable database while partitioned."""

    def __init__(self, queue: Any, switch: PartitionSwitch) -> None:
        self._queue = queue
        self._switch = switch

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._queue, name)
        if name not in _CALLS:
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self._switch.partitioned:
                self._switch.count()
                # A partition does not answer "no": the call just hangs until its timeout.
                await asyncio.sleep(float(kwargs.get("timeout") or _DEFAULT_TIMEOUT))
                raise StoreUnavailable(f"{name}: no answer from the store (partitioned)")
            return await target(*args, **kwargs)

        return call

    async def wait_for_work(
        self, kinds: Sequence[str] | None = None, *, timeout: float = _DEFAULT_TIMEOUT
    ) -> bool:
        if self._switch.partitioned:
            await asyncio.sleep(timeout)
            return False
        return bool(await self._queue.wait_for_work(kinds, timeout=timeout))

    async def close(self) -> None:
        await self._queue.close()
