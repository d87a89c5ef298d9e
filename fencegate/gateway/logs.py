"""Logging for `fencegate serve`: text for people, or one JSON object per line (on stderr) for
log pipelines. Records may carry structured ``fields`` (the decision log, the start-up line);
the JSON format puts them at the top level of the object, the text format already has them
in the message."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _SecondCache:
    """A timestamp's text up to the second, formatted once per second: the decision log
    writes a line per request, thousands within one second."""

    def __init__(self, render: Callable[[int], str]) -> None:
        self._render = render
        self._second = -1
        self._text = ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._text = self._render(second)
            self._second = second
        return self._text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._seconds = _SecondCache(
            lambda second: time.strftime(self.default_time_format, self.converter(second))
        )

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return f"{self._seconds(record.created)},{int(record.msecs):03d}"


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._seconds = _SecondCache(
            lambda second: datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        )

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": f"{self._seconds(record.created)}.{int(record.msecs):03d}+00:00",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            document.update(fields)
        else:
            document["message"] = record.getMessage()
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        # default=str: a field of an unexpected type is written, never a lost line.
        return orjson.dumps(document, default=str).decode()


class LoopBatchedHandler(logging.StreamHandler[Any]):
    """A stream handler that writes the records emitted during one turn of the running
    event loop in one write, at the start of the next turn, instead of one write and one
    flush per record: under load a gateway logs a decision line for every request, and on
    loopback a system call costs more than formatting the line. Outside an event loop
    (start-up, other threads, shutdown) a record is written at once, after any held ones;
    ``flush()`` (called by ``logging.shutdown`` at exit) writes what is held. A process
    killed outright loses at most the lines of its last loop turn."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._held: list[str] = []
        # The loop a write is scheduled on; another loop (the first one closed before its
        # turn came) schedules its own.
        self._scheduled_on: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            self._held.append(line)
            self._write_held()
            return
        self._held.append(line)
        if self._scheduled_on is not loop:
            self._scheduled_on = loop
            loop.call_soon(self.flush)

    def _write_held(self) -> None:
        # Called with the handler's lock held.
        self._scheduled_on = None
        if not self._held:
            return
        text = "".join(self._held)
        self._held.clear()
        try:
            self.stream.write(text)
            self.stream.flush()
        except Exception:  # a closed or broken stream must not break the caller
            self.handleError(logging.makeLogRecord({"msg": text}))

    def flush(self) -> None:
        self.acquire()
        try:
            self._write_held()
        finally:
            self.release()


def configure_logging(
    level: str, log_format: LogFormat = "text", *, decision_log: bool = True
) -> None:
    """Root handler on stderr; ``force`` so that a worker process that inherited a
    configuration gets exactly this one. Without ``decision_log`` the per-decision lines
    (INFO on ``fencegate.decisions``) are not even built."""
    # Neither format shows the process, thread or source line: not looking them up saves a
    # getpid() call and a walk up the stack on every record (one per decision).
    logging.logProcesses = False
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging._srcfile = None
    handler = LoopBatchedHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("fencegate.decisions").setLevel(
        logging.NOTSET if decision_log else logging.WARNING
    )
