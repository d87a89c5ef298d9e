"""Logging for `fencegate serve`: text for people, or one JSON object per line (on stderr) for
log pipelines. Records may carry structured ``fields`` (the decision log, the start-up line);
the JSON format puts them at the top level of the object, the text format already has them
in the message."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
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


def configure_logging(level: str, log_format: LogFormat = "text") -> None:
    """Root handler on stderr; ``force`` so that a worker process that inherited a
    configuration gets exactly this one."""
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
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
