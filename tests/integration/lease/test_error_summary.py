"""What a failed job tells the operator by default: the exception's type and a short, masked
summary of its message; the message itself stays in the job's error for a console started
with ``--show-payloads``. A worker may bring its own summary."""

from __future__ import annotations

import orjson
import pytest

from fencegate.lease import LeaseQueue
from fencegate.lease.error_summary import SUMMARY_LIMIT, default_error_summary
from fencegate.lease.execution import PermanentError
from fencegate.lease.job import JobContext
from fencegate.store.inspect import Inspector
from tests.support.workers import SHORT, make_worker, running, wait_for_state

SECRET = "charge for jane.doe@example.com on card 4242 4242 4242 4242 declined\nline two"


@pytest.mark.parametrize(
    ("message", "summary"),
    [
        (SECRET, "charge for <email> on card <number> declined"),
        ("token sk_live_51HxAbCdEfGhIjKlMnOpQrSt rejected", "token <token> rejected"),
        ("order c-1048 for 12 items: HTTP 503", "order c-1048 for 12 items: HTTP 503"),
        ("", "RuntimeError"),
    ],
)
def test_the_default_summary_is_the_first_line_masked(message: str, summary: str) -> None:
    assert default_error_summary(RuntimeError(message)) == summary


def test_the_default_summary_is_bounded() -> None:
    summary = default_error_summary(ValueError("word " * 200))
    assert len(summary) == SUMMARY_LIMIT and summary.endswith("…")


async def test_a_failed_job_records_why_without_its_payload(
    store_url: str, queue: LeaseQueue
) -> None:
    async def charge(job: JobContext) -> None:
        raise PermanentError(SECRET)

    async def refund(job: JobContext) -> None:
        raise PermanentError("refund of r-7 refused")

    failing = await queue.enqueue("charge", {}, idempotency_key="charge:1", **SHORT)
    custom = await queue.enqueue("refund", {}, idempotency_key="refund:1", **SHORT)
    worker = make_worker(store_url, {"charge": charge})
    async with running(worker):
        await wait_for_state(queue, failing, "failed")
    own = make_worker(
        store_url, {"refund": refund}, error_summary=lambda exc: "refund refused upstream"
    )
    async with running(own):
        await wait_for_state(queue, custom, "failed")

    stored = (await queue.get(failing)).error
    assert stored["type"] == "PermanentError"
    assert stored["summary"] == "charge for <email> on card <number> declined"
    assert stored["message"] == SECRET  # for --show-payloads only
    assert (await queue.get(custom)).error["summary"] == "refund refused upstream"

    # What `fencegate jobs show` and the console read.
    inspector = await Inspector.open(store_url)
    try:
        shown = await inspector.job(failing)
    finally:
        await inspector.close()
    assert shown is not None
    error = shown["error"]
    assert (error["code"], error["summary"]) == (
        "PermanentError",
        "charge for <email> on card <number> declined",
    )
    text = orjson.dumps(shown).decode()
    assert "4242" not in text and "jane" not in text
