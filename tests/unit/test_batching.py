"""The batcher that groups store calls: nothing queued past its caller's timeout is sent."""

from __future__ import annotations

import asyncio
import gc

import pytest

from fencegate.errors import StoreTimedOut
from fencegate.store.base import StoreUnavailable
from fencegate.store.batching import Batcher
from tests.support.waits import wait_until


async def test_calls_queued_while_others_run_go_together() -> None:
    sent: list[list[int]] = []
    release = asyncio.Event()

    async def run(items: list[int], timeout: float) -> list[int]:
        sent.append(items)
        await release.wait()
        return [i * 10 for i in items]

    batcher: Batcher[int, int] = Batcher(run, max_in_flight=1)
    first = asyncio.create_task(batcher.submit(1, timeout=30))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(batcher.submit(i, timeout=30)) for i in (2, 3, 4)]
    await asyncio.sleep(0)
    release.set()
    assert await first == 10
    assert [await t for t in rest] == [20, 30, 40]
    assert sent == [[1], [2, 3, 4]]


async def test_a_call_queued_past_its_timeout_is_never_sent() -> None:
    sent: list[list[str]] = []

    async def run(items: list[str], timeout: float) -> list[str]:
        sent.append(items)
        await asyncio.sleep(0.3)
        return items

    batcher: Batcher[str, str] = Batcher(run, max_in_flight=1)
    slow = asyncio.create_task(batcher.submit("running", timeout=30))
    await asyncio.sleep(0)
    with pytest.raises(StoreUnavailable):
        await batcher.submit("late", timeout=0.05)
    assert await slow == "running"
    await asyncio.sleep(0.05)
    assert sent == [["running"]]


async def test_a_failed_batch_fails_each_of_its_calls() -> None:
    async def run(items: list[int], timeout: float) -> list[int]:
        raise StoreUnavailable("down")

    batcher: Batcher[int, int] = Batcher(run)
    results = await asyncio.gather(
        *(batcher.submit(i, timeout=30) for i in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, StoreUnavailable) for r in results)


async def test_a_queued_call_gives_up_at_its_own_deadline_not_when_the_batch_ahead_ends() -> None:
    sent: list[list[str]] = []
    on_the_wire = asyncio.Event()
    release = asyncio.Event()

    async def run(items: list[str], timeout: float) -> list[str]:
        sent.append(items)
        on_the_wire.set()
        await release.wait()
        return items

    batcher: Batcher[str, str] = Batcher(run, max_in_flight=1)
    ahead = asyncio.create_task(batcher.submit("ahead", timeout=30))
    await asyncio.wait_for(on_the_wire.wait(), 5)
    # The batch ahead is still on the wire (release not set): the queued call must not wait
    # for it past its own 0.05 s.
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(batcher.submit("queued", timeout=0.05), 5)
    assert not ahead.done()
    release.set()
    assert await ahead == "ahead"
    assert sent == [["ahead"]]


async def test_a_timed_out_call_names_its_own_timeout_not_the_time_its_batch_had_left() -> None:
    async def run(items: list[str], timeout: float) -> list[str]:
        # What a store says when the batch's last moments ran out (the time it was given).
        raise StoreTimedOut(f"no answer within {timeout:g}s")

    batcher: Batcher[str, str] = Batcher(run)
    with pytest.raises(StoreTimedOut, match=r"no answer within 2\.5s$"):
        await batcher.submit("a", timeout=2.5)


async def test_an_inline_batcher_sends_a_lone_call_from_its_callers_task() -> None:
    """``inline=True``: with nothing in flight, a call runs in its caller's own task (no task
    of its own to wait for); calls made meanwhile queue and go together after it; a call
    cancelled while queued is never sent."""
    sent: list[tuple[list[int], asyncio.Task[object] | None]] = []
    release = asyncio.Event()

    async def run(items: list[int], timeout: float) -> list[int]:
        sent.append((items, asyncio.current_task()))
        await release.wait()
        return [i * 10 for i in items]

    batcher: Batcher[int, int] = Batcher(run, max_in_flight=1, inline=True)
    first = asyncio.create_task(batcher.submit(1, timeout=30))
    await wait_until(lambda: len(sent) == 1, what="the first call sent", timeout=5)
    cancelled = asyncio.create_task(batcher.submit(2, timeout=30))
    rest = [asyncio.create_task(batcher.submit(i, timeout=30)) for i in (3, 4)]
    await wait_until(lambda: batcher.queued == 3, what="three calls queued", timeout=5)
    cancelled.cancel()
    release.set()
    assert await first == 10
    assert [await t for t in rest] == [30, 40]
    assert [items for items, _ in sent] == [[1], [3, 4]]
    assert sent[0][1] is first  # the lone call ran in its caller's task
    assert sent[1][1] not in (first, *rest)
    # Idle again: the next lone call also runs inline.
    assert await batcher.submit(5, timeout=30) == 50
    assert sent[-1] == ([5], asyncio.current_task())


async def test_an_inline_call_cancelled_in_flight_leaves_nothing_unretrieved() -> None:
    """The caller of an inline call cancelled while it runs sees the cancellation; nothing is
    reported to the loop as a future whose exception nobody retrieved."""
    reported: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    started, answer = asyncio.Event(), asyncio.Event()

    async def run(items: list[int], timeout: float) -> list[int]:
        started.set()
        await answer.wait()  # not before the first call is cancelled
        return items

    batcher: Batcher[int, int] = Batcher(run, max_in_flight=1, inline=True)
    call = asyncio.create_task(batcher.submit(1, timeout=30))
    await started.wait()
    call.cancel()
    cancelled = False
    try:
        await call
    except asyncio.CancelledError:  # not pytest.raises: its record would keep the frames
        cancelled = True
    assert cancelled
    del call
    for _ in range(3):
        # The cancelled task lets go of its frames, and the loop hears of an unretrieved
        # exception, each in a callback of the loop's own: one has run after each collection.
        await _callbacks_run(loop)
        gc.collect()
    await _callbacks_run(loop)
    assert reported == []
    # And the batcher is idle again: the next call runs, in its caller's task.
    answer.set()
    assert await batcher.submit(2, timeout=30) == 2


async def _callbacks_run(loop: asyncio.AbstractEventLoop) -> None:
    """Until the callbacks the loop had scheduled before this one have run."""
    turned = asyncio.Event()
    loop.call_soon(turned.set)
    await asyncio.wait_for(turned.wait(), 5)
