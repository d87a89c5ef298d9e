"""The log handler of `fencegate serve`: the records of one event-loop turn leave in one write."""

from __future__ import annotations

import io
import logging

from fencegate.gateway.logs import LoopBatchedHandler
from tests.support.waits import wait_until


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def logger_on(stream: CountingStream, name: str) -> tuple[logging.Logger, LoopBatchedHandler]:
    handler = LoopBatchedHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(name)
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, handler


async def test_records_of_one_loop_turn_leave_in_one_write() -> None:
    stream = CountingStream()
    logger, _ = logger_on(stream, "test.logs.batched")
    for n in range(3):
        logger.info("decision %d", n)
    assert stream.getvalue() == ""  # held until the loop's next turn
    await wait_until(lambda: stream.getvalue().count("\n") == 3, timeout=5, what="three lines")
    assert stream.getvalue() == "decision 0\ndecision 1\ndecision 2\n"
    assert stream.writes == 1


async def test_flush_writes_what_is_held() -> None:
    stream = CountingStream()
    logger, handler = logger_on(stream, "test.logs.flushed")
    logger.info("last words")
    handler.flush()  # what logging.shutdown does at exit
    assert stream.getvalue() == "last words\n"


def test_outside_an_event_loop_a_record_is_written_at_once() -> None:
    stream = CountingStream()
    logger, _ = logger_on(stream, "test.logs.plain")
    logger.info("starting")
    assert stream.getvalue() == "starting\n"
