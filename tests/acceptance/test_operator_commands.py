"""The operator's commands on both stores, run as a user runs them (`python -m fencegate.cli`):
keys list/show/resolve, fences show, jobs list/show/retry/cancel/purge, and the trace that
answers "who sent these two requests, with which token, and which one was fenced off"."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from fencegate.lease import LeaseQueue
from fencegate.store.inspect import Inspector
from tests.support.processes import fencegate
from tests.support.stories import two_workers_one_fenced_off

pytestmark = pytest.mark.timeout(120)


def ok_json(*args: str) -> Any:
    done = fencegate(*args, "--json")
    assert done.returncode == 0, done.stderr
    return orjson.loads(done.stdout)


@pytest.fixture
def story(store_url: str) -> tuple[str, int, int, int]:
    job, first, second = asyncio.run(two_workers_one_fenced_off(store_url))
    return store_url, job, first, second


def test_trace_names_who_sent_each_request_and_which_was_fenced_off(
    story: tuple[str, int, int, int],
) -> None:
    url, job, first, second = story
    trace = ok_json("trace", f"job:{job}", "--database-url", url)
    assert trace["fence"]["last_accepted"] == second
    gateway = [e for e in trace["events"] if e["source"] == "gateway"]
    by_decision = {e["what"]: e for e in gateway}
    assert (by_decision["reserved"]["token"], by_decision["reserved"]["worker"]) == (
        second,
        "worker-2",
    )
    assert (by_decision["stale"]["token"], by_decision["stale"]["worker"]) == (first, "worker-1")
    lease = [(e["what"], e["token"], e["owner"]) for e in trace["events"] if e["source"] == "lease"]
    assert ("job_claimed", first, "worker-1") in lease
    assert ("heartbeat_lost", first, "worker-1") in lease
    assert ("job_claimed", second, "worker-2") in lease
    text = fencegate("trace", f"job:{job}", "--database-url", url)
    assert text.returncode == 0 and "stale" in text.stdout and "worker-1" in text.stdout


def test_keys_list_show_and_resolve_with_an_audit_record(story: tuple[str, int, int, int]) -> None:
    url = story[0]
    key = "capture:inv-1:POST /v1/charges"
    unknown = ok_json("keys", "list", "--state", "outcome_unknown", "--database-url", url)
    assert [k["key"] for k in unknown["keys"]] == [key]
    shown = ok_json("keys", "show", key, "--tenant", "acme", "--database-url", url)
    assert shown["state"] == "outcome_unknown"
    assert [h["what"] for h in shown["history"]] == ["reserved", "marked_unknown", "stale"]

    resolved = fencegate(
        "keys",
        "resolve",
        key,
        "--tenant",
        "acme",
        "--database-url",
        url,
        "--completed",
        "--status",
        "201",
        "--body",
        '{"id": "ch_1"}',
        "--by",
        "night-op",
        "--reason",
        "ticket 7",
        "--release-margin",
        "0",  # the story's request is not on its way
    )
    assert resolved.returncode == 0, resolved.stderr
    still = ok_json("keys", "list", "--state", "outcome_unknown", "--database-url", url)
    assert still["keys"] == []
    [audit] = asyncio.run(audit_rows(url))
    assert (audit["actor"], audit["action"], audit["subject"], audit["reason"]) == (
        "operator:night-op",
        "keys.resolve_completed",
        key,
        "ticket 7",
    )
    assert orjson.loads(audit["before"])["state"] == "outcome_unknown"
    assert orjson.loads(audit["after"])["state"] == "completed"
    again = fencegate(
        "keys", "resolve", key, "--tenant", "acme", "--database-url", url, "--release"
    )
    assert again.returncode == 2 and "is completed: there is nothing to release" in again.stderr


async def audit_rows(url: str) -> list[dict[str, Any]]:
    inspector = await Inspector.open(url)
    try:
        return await inspector.audit_log()
    finally:
        await inspector.close()


def test_fences_show_the_history_of_an_entity(story: tuple[str, int, int, int]) -> None:
    url, job, first, second = story
    fence = ok_json("fences", "show", f"job:{job}", "--database-url", url)
    assert fence["fence"]["last_accepted"] == second
    assert [(h["what"], h["token"]) for h in fence["history"]] == [
        ("reserved", second),
        ("marked_unknown", second),
        ("stale", first),
    ]
    missing = fencegate("fences", "show", "job:nope", "--database-url", url)
    assert missing.returncode == 2 and "no fence" in missing.stderr


def test_jobs_list_show_retry_cancel_and_purge(story: tuple[str, int, int, int]) -> None:
    url, job, first, second = story
    asyncio.run(more_jobs(url, 3))
    page = ok_json("jobs", "list", "--limit", "2", "--database-url", url)
    assert len(page["jobs"]) == 2 and page["cursor"]
    rest = ok_json(
        "jobs", "list", "--limit", "2", "--cursor", page["cursor"], "--database-url", url
    )
    ids = [j["id"] for j in page["jobs"] + rest["jobs"]]
    assert ids == sorted(ids, reverse=True) and job in ids and len(set(ids)) == 4

    shown = ok_json("jobs", "show", str(job), "--database-url", url)
    assert [(a["fencing_token"], a["owner_id"]) for a in shown["attempts"]] == [
        (first, "worker-1"),
        (second, "worker-2"),
    ]
    # Errors are shown as a code and a hash: their text may quote the payload.
    [*_, last] = shown["attempts"]
    assert last["error"]["code"] == "charge_timeout" and len(last["error"]["sha256"]) == 16
    assert "4242" not in orjson.dumps(shown).decode()
    assert shown["state"] in ("queued", "failed")

    queued = [j["id"] for j in rest["jobs"] + page["jobs"] if j["state"] == "queued"]
    cancelled = fencegate("jobs", "cancel", str(queued[0]), "--database-url", url, "--by", "op")
    assert cancelled.returncode == 0, cancelled.stderr
    retried = ok_json("jobs", "retry", str(queued[0]), "--database-url", url, "--by", "op")
    assert retried["state"] == "queued"
    refused = fencegate("jobs", "retry", str(queued[0]), "--database-url", url)
    assert refused.returncode == 2 and "no failed or cancelled job" in refused.stderr

    assert fencegate("jobs", "cancel", str(queued[1]), "--database-url", url).returncode == 0
    purged = ok_json("jobs", "purge", "--older-than", "0s", "--database-url", url)
    assert purged["deleted"] >= 1
    gone = fencegate("jobs", "show", str(queued[1]), "--database-url", url)
    assert gone.returncode == 2
    actions = [a["action"] for a in asyncio.run(audit_rows(url))]
    assert actions[:4] == ["jobs.purge", "jobs.cancel", "jobs.retry", "jobs.cancel"]
    bad = fencegate("jobs", "purge", "--older-than", "soon", "--database-url", url)
    assert bad.returncode == 2 and "--older-than" in bad.stderr


async def more_jobs(url: str, count: int) -> None:
    queue = await LeaseQueue.connect(url)
    try:
        for n in range(count):
            await queue.enqueue("report", {"n": n}, idempotency_key=f"report:{n}")
    finally:
        await queue.close()
