"""Logging for `fencegate serve`: text for people, or one JSON object per line (on stderr) for
log pipelines. Records may carry structured ``fields`` (the decision log, the start-up line);
the JSON format puts them at the top level of the object, the text format already has them
in the message."""

from __future__ import annotations

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
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("fencegate.decisions").setLevel(
        logging.NOTSET if decision_log else logging.WARNING
    )
