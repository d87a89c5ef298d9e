"""A worker process killed with SIGKILL (no clean-up of any kind): its job is claimed
again once the lease runs out on the database clock, by a new owner with a larger token."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fencegate.lease import LeaseQueue
from fencegate.lease.events import read_events
from tests.support.processes import REPO_ROOT, child_env
from tests.support.workers import claim_when_free


def start_worker_process(url: str, events: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.worker_process",
            "--url",
            url,
            "--events",
            str(events),
            *args,
        ],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def read(events: Path) -> list[dict[str, object]]:
    if not events.exists():
        return []
    lines = events.read_bytes().splitlines()
    return read_events(lines[:-1] if lines and not lines[-1].endswith(b"}") else lines)


async def wait_for_log(
    proc: subprocess.Popen[bytes],
    events: Path,
    seen: Callable[[list[dict[str, object]]], bool],
    *,
    what: str,
    timeout: float = 60.0,
) -> None:
    """Wait until the worker's event log shows ``seen``, while the worker is alive."""
    deadline = time.monotonic() + timeout
    while not seen(read(events)):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else b""
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def has_event(name: str, count: int = 1) -> Callable[[list[dict[str, object]]], bool]:
    return lambda events: sum(e["event"] == name for e in events) >= count


async def test_killed_worker_job_is_claimed_again_after_its_lease(
    store_url: str, tmp_path: Path
) -> None:
    lease_seconds = 2.0
    queue = await LeaseQueue.connect(store_url)
    events = tmp_path / "events.jsonl"
    job_id = await queue.enqueue(
        "work",
        {"seconds": 120},
        idempotency_key="work:kill-me",
        lease_seconds=lease_seconds,
        heartbeat_seconds=0.5,
        jitter_seconds=0.5,
    )
    proc = start_worker_process(store_url, events, "--tool", "sleep", "--name", "victim")
    try:
        await wait_for_log(
            proc, events, has_event("heartbeat_ok"), what="the worker never renewed its lease"
        )
        killed_at = await queue.now()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        lease = await claim_when_free(queue, "rescuer", "work")
        history = await queue.attempts(job_id)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        await queue.close()

    [claimed] = [e for e in read(events) if e["event"] == "job_claimed"]
    assert lease.job_id == job_id and lease.attempt == 2
    assert lease.fencing_token > int(claimed["token"])  # type: ignore[call-overload]
    first, second = history
    assert (first.owner_id, first.outcome) == (claimed["worker"], "lease_expired")
    assert second.owner_id == "rescuer"
    # By the database clock: not before the lease ran out, and no later than lease + 1 s.
    assert second.claimed_at >= first.claimed_at
    waited = (second.claimed_at - killed_at).total_seconds()
    assert waited <= lease_seconds + 1.0, f"reclaimed {waited:.2f}s after the kill"


async def test_sigterm_finishes_what_it_can_and_releases_the_rest(
    store_url: str, tmp_path: Path
) -> None:
    queue = await LeaseQueue.connect(store_url)
    events = tmp_path / "events.jsonl"
    intervals: dict[str, Any] = {
        "lease_seconds": 2.0,
        "heartbeat_seconds": 0.5,
        "jitter_seconds": 0.5,
    }
    short_id = await queue.enqueue(
        "work", {"seconds": 1.0}, idempotency_key="work:short", **intervals
    )
    long_id = await queue.enqueue(
        "work", {"seconds": 120}, idempotency_key="work:long", **intervals
    )
    proc = start_worker_process(
        store_url, events, "--tool", "sleep", "--concurrency", "2", "--grace-seconds", "3"
    )
    try:
        await wait_for_log(
            proc, events, has_event("job_claimed", 2), what="the worker did not claim both jobs"
        )
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out
        short, long = await queue.get(short_id), await queue.get(long_id)
        [released_attempt] = await queue.attempts(long_id)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        await queue.close()

    assert short.state == "succeeded"  # finished within the grace period
    assert (long.state, long.owner_id) == ("queued", None)  # given back, not left to expire
    assert released_attempt.outcome == "released"
    logged = [e["event"] for e in read(events)]
    assert logged.count("job_released") == 1 and logged.count("result_committed") == 1
    assert logged[-1] == "worker_stopped"


async def test_a_paused_worker_wakes_up_to_zero_rows_and_stops(
    store_url: str, tmp_path: Path
) -> None:
    """A runtime pause (SIGSTOP, as a stop-the-world pause or a frozen VM would do): when
    the process resumes, the lease belongs to someone else. Its next renewal finds zero
    rows; the tool is cancelled and nothing is committed."""
    queue = await LeaseQueue.connect(store_url)
    events = tmp_path / "events.jsonl"
    job_id = await queue.enqueue(
        "work",
        {"seconds": 120},
        idempotency_key="work:paused",
        lease_seconds=2.0,
        heartbeat_seconds=0.5,
        jitter_seconds=0.5,
    )
    proc = start_worker_process(store_url, events, "--tool", "sleep", "--name", "sleeper")
    try:
        await wait_for_log(
            proc, events, has_event("heartbeat_ok"), what="the worker never renewed its lease"
        )
        proc.send_signal(signal.SIGSTOP)
        lease = await claim_when_free(queue, "rescuer", "work")
        proc.send_signal(signal.SIGCONT)
        await wait_for_log(
            proc,
            events,
            has_event("result_rejected"),
            what="the woken worker did not give the job up",
        )
        assert await queue.complete(lease, {"by": "rescuer"})
        job = await queue.get(job_id)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=30)
        await queue.close()

    logged = read(events)
    [lost] = [e for e in logged if e["event"] == "heartbeat_lost"]
    assert lost["reason"] == "zero_rows"
    assert (lost["current_owner"], lost["current_token"]) == ("rescuer", lease.fencing_token)
    assert not any(e["event"] == "result_committed" for e in logged)
    assert (job.state, job.result) == ("succeeded", {"by": "rescuer"})
