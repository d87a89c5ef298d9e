"""The queue's ownership gauges by work class, read from the queue itself (console /metrics):
what a Prometheus scrape sees is what the console's overview shows, whoever holds the leases,
including a holder that died (its lease expired, not yet reclaimed)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fencegate.console import ConsoleToken, create_console_app
from fencegate.lease import LeaseQueue
from fencegate.store.inspect import Inspector
from tests.support.waits import wait_until

TOKENS = [
    ConsoleToken.from_secret("prom", "scraper-secret-0123", role="viewer"),
    ConsoleToken.from_secret("acme-op", "acme-secret-012345", role="operator", tenant="acme"),
]


async def queue_with_a_dead_holder(url: str) -> None:
    queue = await LeaseQueue.connect(url)
    try:
        for n in range(3):
            await queue.enqueue(
                "capture",
                {"n": n},
                idempotency_key=f"capture:{n}",
                lease_seconds=0.3,
                heartbeat_seconds=0.1,
                jitter_seconds=0.1,
            )
        await queue.enqueue("report", {}, idempotency_key="report:1")
        await queue.claim("dead-worker", kinds=["capture"], limit=1)  # then it dies
        await queue.claim(
            "live-worker",
            kinds=["capture"],
            limit=1,
        )
    finally:
        await queue.close()


async def gauges(url: str) -> dict[tuple[str, str], float]:
    app = create_console_app(url, tokens=TOKENS)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as client:
        answer = await client.get(
            "/metrics", headers={"Authorization": "Bearer scraper-secret-0123"}
        )
        assert answer.status_code == 200, answer.text
        refused = await client.get(
            "/metrics", headers={"Authorization": "Bearer acme-secret-012345"}
        )
        assert refused.status_code == 403
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            # By work class, provider and model (none declared here: "").
            assert (sample.labels["provider"], sample.labels["model"]) == ("", "")
            values[(sample.name, sample.labels["kind"])] = sample.value
    return values


@pytest.mark.timeout(60)
async def test_the_queue_gauges_show_who_owns_what_and_the_dead_holder(store_url: str) -> None:
    await queue_with_a_dead_holder(store_url)
    inspector = await Inspector.open(store_url)
    try:

        async def both_leases_ran_out() -> bool:  # by the database clock
            rows = {r["kind"]: r for r in await inspector.ownership()}
            return bool(rows["capture"]["expired"] == 2)

        await wait_until(both_leases_ran_out, timeout=30, what="two expired leases")
    finally:
        await inspector.close()
    values = await gauges(store_url)
    assert values[("fencegate_queue_jobs_queued", "capture")] == 1
    assert values[("fencegate_queue_jobs_queued", "report")] == 1
    assert values[("fencegate_queue_leases_running", "capture")] == 2
    assert values[("fencegate_queue_leases_expired", "capture")] == 2
    assert values[("fencegate_queue_heartbeat_age_seconds", "capture")] >= 0.3
    assert ("fencegate_queue_lease_remaining_seconds", "capture") not in values  # none live
    assert values[("fencegate_queue_reclaimed_total", "capture")] == 0

    # The dead holder's job is reclaimed: the gauge counts it, as the console does.
    queue = await LeaseQueue.connect(store_url)
    try:
        reclaimed = await queue.claim("new-worker", kinds=["capture"], limit=2)
        assert len(reclaimed) == 2
    finally:
        await queue.close()
    after = await gauges(store_url)
    assert after[("fencegate_queue_reclaimed_total", "capture")] == 2
    assert after[("fencegate_queue_leases_expired", "capture")] == 0
    assert after[("fencegate_queue_lease_remaining_seconds", "capture")] > 0
