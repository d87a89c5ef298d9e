"""Faults in fencegate's own code: a bug, never dressed as an outage.

Each kind of fault (its exception type and the place it was raised) is logged with its
traceback the first time, then in one line with how often it has been seen: a bug hit by
every request must not bury the log in identical tracebacks, and the first one says all.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
# Kinds remembered; past this many, every fault is logged in one line (memory stays bounded).
_MAX_KINDS = 256


def place_of(exc: BaseException) -> str:
    """Where ``exc`` was raised: ``file:line in function`` of its innermost frame, the file
    relative to the installed package's parent when it lies under it."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "unknown place"
    frame = frames[-1]
    path = Path(frame.filename)
    try:
        shown = str(path.resolve().relative_to(_PACKAGE_ROOT))
    except ValueError:
        shown = str(path)
    return f"{shown}:{frame.lineno} in {frame.name}"


class InternalErrors:
    """Logs (and, through ``count``, counts) the internal errors of one component."""

    def __init__(
        self, logger: logging.Logger, *, count: Callable[[str], None] | None = None
    ) -> None:
        self.logger = logger
        self.count = count
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()  # a worker reports from two threads

    def report(self, exc: BaseException, *, where: str, about: str = "") -> None:
        """Log ``exc``, caught at ``where`` (a short word, also the metric's label), with
        ``about`` (e.g. the request id) in the line."""
        if self.count is not None:
            self.count(where)
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        place = place_of(exc)
        key = (kind, place)
        with self._lock:
            seen = self._seen.get(key, 0) + 1
            first = seen == 1 and len(self._seen) < _MAX_KINDS
            if first or seen > 1:
                self._seen[key] = seen
        line = f"internal error in {where}: {kind}: {str(exc)[:200]} at {place}"
        if about:
            line += f" ({about})"
        if first:
            self.logger.error("%s", line, exc_info=exc)
        elif seen > 1:
            self.logger.error("%s; seen %d times, its traceback logged the first time", line, seen)
        else:
            self.logger.error("%s; traceback not logged: too many kinds of internal error", line)
