"""Waiting for a condition with a deadline, instead of sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    predicate: Callable[[], object | Awaitable[object]],
    *,
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.02,
) -> None:
    """Return as soon as ``predicate()`` (plain or async) is true; fail the test after
    ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached after {timeout}s")
        await asyncio.sleep(interval)


def wait_until_sync(
    predicate: Callable[[], object],
    *,
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.02,
) -> None:
    """`wait_until` for code outside an event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {timeout}s")
        time.sleep(interval)
