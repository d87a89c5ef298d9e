"""Shared story for the operator command, console and console-browser tests: two workers,
one fenced off by the gateway's store."""

from __future__ import annotations

from typing import Any

from fencegate.gateway.fingerprint import request_fingerprint
from fencegate.lease import LeaseQueue
from fencegate.lease.error_summary import error_record
from fencegate.store import DecideRequest, Reservation, open_gateway_store
from tests.support.waits import wait_until


def request(token: int, owner: str, key: str, entity: str, **extra: Any) -> DecideRequest:
    fields: dict[str, Any] = {
        "tenant": "acme",
        "key": key,
        "fingerprint": "f",
        "entity": entity,
        "fence": token,
        "owner": owner,
        "lease_seconds": 30.0,
        "ttl_seconds": 3600.0,
        "retry_unknown": False,
        "request_id": f"req-{owner}",
        "method": "POST",
        "target": "/v1/charges",
    }
    return DecideRequest(**(fields | extra))


async def two_workers_one_fenced_off(url: str) -> tuple[int, int, int]:
    """W1 claims the job and is cut off; its lease runs out; W2 claims it (a larger token)
    and charges; W1's late request arrives with the old token. Returns (job, t1, t2)."""
    queue = await LeaseQueue.connect(url)
    store = await open_gateway_store(url, run_migrations=False)
    try:
        job = await queue.enqueue(
            "capture",
            {"invoice": "inv-1"},
            idempotency_key="capture:inv-1",
            max_attempts=3,
            lease_seconds=0.5,
            heartbeat_seconds=0.1,
            jitter_seconds=0.1,
        )
        [first] = await queue.claim("worker-1", kinds=["capture"], limit=1)
        # worker-2 gets the job once worker-1's lease has run out, by the database clock.
        [second] = await wait_until(
            lambda: queue.claim("worker-2", kinds=["capture"], limit=1),
            timeout=30,
            what="worker-1's lease running out",
            interval=0.05,
        )
        key = "capture:inv-1:POST /v1/charges"
        entity = f"job:{job}"
        accepted = await store.decide(
            request(second.fencing_token, "gw/1", key, entity), timeout=30
        )
        assert accepted.outcome == "reserved"
        holder = Reservation("acme", key, "gw/1", 1, "req-gw/1")
        assert await store.mark_unknown(holder, timeout=30)  # the charge timed out
        stale = await store.decide(request(first.fencing_token, "gw/2", key, entity), timeout=30)
        assert stale.outcome == "stale"
        # As a worker records it: the message may quote the payload, the summary is masked.
        failure = TimeoutError("card 4242 4242 4242 4242 declined for c-1048")
        error = {"code": "charge_timeout", **error_record(failure)}
        assert await queue.fail(second, error, retry_in=None)
        return job, first.fencing_token, second.fencing_token
    finally:
        await store.close()
        await queue.close()


LEASE_EXPIRED_KEY = "refund:r-7:POST /v1/refunds"
LEASE_EXPIRED_BODY = b'{"amount": 500}'


async def gateway_stopped_in_flight(url: str) -> str:
    """A gateway reserved a key, forwarded it, and stopped before recording the answer: the
    key stays in flight until its lease runs out (by the database clock). Returns the key,
    which belongs to the single-tenant gateway's tenant ``default``."""
    store = await open_gateway_store(url, run_migrations=False)
    try:
        fingerprint = request_fingerprint("POST", "/v1/refunds", "", LEASE_EXPIRED_BODY)
        reserved = await store.decide(
            request(
                0,
                "gw-gone/1",
                LEASE_EXPIRED_KEY,
                "refund:r-7",
                tenant="default",
                fence=None,
                fingerprint=fingerprint,
                lease_seconds=0.3,
                target="/v1/refunds",
            ),
            timeout=30,
        )
        assert reserved.outcome == "reserved"

        async def expired() -> bool:
            record = await store.get_key("default", LEASE_EXPIRED_KEY, timeout=30)
            return record is not None and record.unknown

        await wait_until(expired, timeout=30, what="the in-flight lease running out")
        return LEASE_EXPIRED_KEY
    finally:
        await store.close()
