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


def test_a_jobs_events_carry_the_same_fields_in_the_same_order_as_a_plain_emit() -> None:
    import datetime as dt

    from fencegate.lease.execution import Execution
    from fencegate.lease.job import JobContext
    from fencegate.lease.models import Lease

    lease = Lease(
        job_id=7,
        kind="ocr",
        owner_id="w",
        fencing_token=3,
        lease_until=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        lease_seconds=30.0,
        heartbeat_seconds=10.0,
        attempt=1,
        max_attempts=3,
        payload=None,
        idempotency_key="k",
        stage_timeout_seconds=None,
        tool_timeout_seconds=None,
    )

    class Plain(EventLog):
        # An emit of its own: the job's events come through it, as keywords.
        def emit(self, event: str, **fields: object) -> dict[str, object]:
            return super().emit(event, **fields)

    for labels in (("ocr", "", ""), ("ocr", "acme", "m1"), ("ocr", "", "m1")):
        fast, plain = EventLog(), Plain()
        for log in (fast, plain):
            job = JobContext(
                Execution(lease, confirmed_at=0.0),
                queue=None,  # type: ignore[arg-type]  # no stage is run
                events=log,
                worker_id="w",
                ownership_margin=1.0,
                labels=labels,
            )
            job.emit("result_committed", result_sha256=None, duration_seconds=0.5)
            with pytest.raises(TypeError, match="multiple values for keyword argument 'token'"):
                job.emit("result_committed", token=4)
        [ours], [theirs] = fast.records, plain.records
        assert [k for k in ours if k != "ts"] == [k for k in theirs if k != "ts"]
        assert {k: v for k, v in ours.items() if k != "ts"} == {
            k: v for k, v in theirs.items() if k != "ts"
        }


def test_digest_of_none_and_the_timestamp_text() -> None:
    import datetime as dt

    from fencegate.lease.events import _timestamp

    assert digest(None) == "sha256:" + hashlib.sha256(b"null").hexdigest()
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    stamps = [_timestamp() for _ in range(1000)]
    for stamp in stamps:
        parsed = dt.datetime.fromisoformat(stamp)
        assert parsed >= before and stamp == parsed.isoformat(timespec="milliseconds")
    assert stamps == sorted(stamps)


def test_records_keep_the_newest_events_within_their_bound() -> None:
    """``keep`` bounds the records kept in memory: never fewer than the last ``keep``
    events, never more than an eighth more, the newest always last, the oldest gone first."""
    log = EventLog(keep=80)
    for n in range(1, 1001):
        log.emit("job_claimed", job=str(n))
        jobs = [int(record["job"]) for record in log.records]
        assert min(n, 80) <= len(jobs) <= 90
        assert jobs == list(range(n - len(jobs) + 1, n + 1))
