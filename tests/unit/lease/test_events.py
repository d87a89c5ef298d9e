"""The event log: JSON lines, thread-safe, hashes instead of payloads."""

from __future__ import annotations

import hashlib
import io
import threading
from pathlib import Path

import orjson
import pytest

from fencegate.lease.events import EventLog, digest, read_events


def test_file_sink_writes_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.emit("job_claimed", job="7", token=42, lease_until=None)
    log.emit("heartbeat_lost", job="7", token=42, reason="zero_rows")
    log.close()
    events = read_events(path.read_bytes().splitlines())
    assert [e["event"] for e in events] == ["job_claimed", "heartbeat_lost"]
    assert events[1]["reason"] == "zero_rows"
    assert events[0]["token"] == 42
    assert "lease_until" not in events[0]  # None fields are left out, not written as null
    assert events[0]["ts"].endswith("+00:00")


def test_text_stream_and_callable_sinks() -> None:
    stream = io.StringIO()
    seen: list[dict[str, object]] = []
    EventLog(stream).emit("result_committed", job="1", token=3)
    EventLog(seen.append).emit("result_rejected", job="1", token=2)
    assert orjson.loads(stream.getvalue())["event"] == "result_committed"
    assert seen[0]["event"] == "result_rejected"


def test_unknown_event_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown event name"):
        EventLog().emit("heartbeat_maybe", job="1")


def test_digest_hashes_canonical_json_never_the_value_itself() -> None:
    payload = {"card": "4242424242424242", "amount": 4200}
    same_payload_other_order = {"amount": 4200, "card": "4242424242424242"}
    assert digest(payload) == digest(same_payload_other_order)
    assert digest(b"abc") == "sha256:" + hashlib.sha256(b"abc").hexdigest()
    assert "4242" not in digest(payload)


def test_concurrent_writers_never_interleave_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, keep=0)

    def write(n: int) -> None:
        for i in range(200):
            log.emit("heartbeat_ok", job=str(n), token=i, padding="x" * 300)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    log.close()
    events = read_events(path.read_bytes().splitlines())
    assert len(events) == 800
    assert {e["job"] for e in events} == {"0", "1", "2", "3"}
