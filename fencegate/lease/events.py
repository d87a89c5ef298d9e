"""The worker's event log: one JSON object per line, the record a person reads at 2 a.m.

Events carry ids, fencing tokens, hashes, durations and error codes, never payloads or
results (a log must not become a second copy of customer data): use `digest` for those.

Names (docs/protocol.md §4): job_claimed, heartbeat_ok, heartbeat_failed, ownership_unknown,
heartbeat_lost, tool_request_started, tool_timeout, result_committed, result_rejected,
retry_scheduled, job_failed; and job_released, job_cancelled, stage_skipped, stage_committed,
stage_timeout, tool_failed, worker_started, worker_stopped.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import orjson

Event = dict[str, Any]
Sink = Callable[[Event], None]

EVENT_NAMES = frozenset(
    {
        "job_claimed",
        "heartbeat_ok",
        "heartbeat_failed",
        "ownership_unknown",
        "heartbeat_lost",
        "tool_request_started",
        "tool_timeout",
        "result_committed",
        "result_rejected",
        "retry_scheduled",
        "job_failed",
        "job_released",
        "job_cancelled",
        "stage_skipped",
        "stage_committed",
        "stage_timeout",
        "tool_failed",
        "worker_started",
        "worker_stopped",
    }
)


def digest(value: Any) -> str:
    """``sha256:<hex>`` of a value's canonical JSON (bytes and str are hashed as they are)."""
    if value is None:
        return _NULL_DIGEST  # the result of every tool that returns nothing
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    else:
        data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str)
    return "sha256:" + hashlib.sha256(data).hexdigest()


_NULL_DIGEST = "sha256:" + hashlib.sha256(orjson.dumps(None)).hexdigest()
_NOTHING_ABOUT: Mapping[str, Any] = {}

_second_text: tuple[int, str] = (-1, "")
# The last whole text, by (second, millisecond): events come many to a millisecond.
_milli_text: tuple[int, int, str] = (-1, -1, "")


def _timestamp() -> str:
    """Now, as ISO 8601 UTC to the millisecond (``isoformat(timespec="milliseconds")``'s
    text); the part up to the second is formatted once per second: a busy worker writes
    several events per job, thousands within one second."""
    global _second_text, _milli_text
    now = time.time()
    second = int(now)
    milli = int((now - second) * 1000)
    cached_second, cached_milli, whole = _milli_text  # one tuple: safe to read from any thread
    if cached_milli == milli and cached_second == second:
        return whole
    cached_second, text = _second_text
    if cached_second != second:
        text = dt.datetime.fromtimestamp(second, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second_text = (second, text)
    whole = f"{text}.{milli:03d}+00:00"
    _milli_text = (second, milli, whole)
    return whole


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)


class EventLog:
    """Thread-safe: the heartbeat thread and the worker's loop write to the same log.

    ``sink`` is a path (appended to), a text or binary stream, a callable taking the event
    dict, or None (kept in memory only). ``keep`` keeps at least the last ``keep`` events in
    ``records``, and at most an eighth more: the oldest go in one cut once that many more
    have come, not one at every event (a cut moves every record kept, some 1.3 µs per event
    at the default ``keep`` of 10,000).
    """

    def __init__(
        self,
        sink: str | Path | IO[str] | IO[bytes] | Sink | None = None,
        *,
        keep: int = 10_000,
    ) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self._trim_at = keep + max(keep // 8, 1)
        self.records: list[Event] = []
        self._file: IO[bytes] | None = None
        self._stream: Any = None
        self._call: Sink | None = None
        if isinstance(sink, str | Path):
            self._file = open(sink, "ab")
        elif callable(sink):
            self._call = sink
        else:
            self._stream = sink

    def _write(self, line: bytes) -> None:
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        elif self._stream is not None:
            # Text streams (sys.stdout) take str; binary ones take the bytes as they are.
            self._stream.write(line.decode() if hasattr(self._stream, "encoding") else line)
            self._stream.flush()

    def emit(self, event: str, **fields: Any) -> Event:
        return self.emit_about(event, _NOTHING_ABOUT, fields)

    def emit_about(self, event: str, about: Mapping[str, Any], fields: Mapping[str, Any]) -> Event:
        """`emit` with ``about``'s fields (none of them None) first, then ``fields``: the
        fields every event of one job carries, put together once for all of its events
        rather than passed again, as keywords, at each."""
        if event not in EVENT_NAMES:
            raise ValueError(f"unknown event name {event!r}")
        record: Event = {"ts": _timestamp(), "event": event, **about}
        for key, value in fields.items():
            if value is not None:
                record[key] = value
        return self._add(record)

    def _add(self, record: Event) -> Event:
        # Serialised only when written out: a log kept in memory (or handed to a callable)
        # needs no line.
        written = self._file is not None or self._stream is not None
        line = orjson.dumps(record, default=_json_default) + b"\n" if written else b""
        with self._lock:
            if self._keep:
                self.records.append(record)
                if len(self.records) > self._trim_at:
                    del self.records[: len(self.records) - self._keep]
            if written:
                self._write(line)
            if self._call is not None:
                self._call(record)
        return record

    def named(self, *names: str) -> list[Event]:
        with self._lock:
            return [r for r in self.records if r["event"] in names]

    def for_job(self, job_id: Any) -> list[Event]:
        with self._lock:
            return [r for r in self.records if r.get("job") == str(job_id)]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(lines: Iterable[str | bytes]) -> list[Event]:
    """Parse a JSON-lines event log (e.g. a file another process wrote)."""
    return [orjson.loads(line) for line in lines if line.strip()]
