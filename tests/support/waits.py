"""Waiting for a condition with a deadline, instead of sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


@overload
async def wait_until(
    predicate: Callable[[], Awaitable[T]],
    *,
    timeout: float = ...,
    what: str = ...,
    interval: float = ...,
) -> T: ...


@overload
async def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = ...,
    what: str = ...,
    interval: float = ...,
) -> T: ...


async def wait_until(
    predicate: Callable[[], Any],
    *,
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.02,
) -> Any:
    """The first true value of ``predicate()`` (plain or async); fail the test after
    ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached after {timeout}s")
        await asyncio.sleep(interval)


def wait_until_sync(
    predicate: Callable[[], T],
    *,
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.02,
) -> T:
    """`wait_until` for code outside an event loop."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {timeout}s")
        time.sleep(interval)
    return result
