"""The gateway's common case through its store, for the benchmarks that drive the store
without the gateway (`benchmarks/citus_capacity.py`, `benchmarks/step.py`): a new key
reserved with a fence, then its answer recorded. Concurrent calls share the store's steps
as the gateway's requests do."""

from __future__ import annotations

import uuid

from fencegate.store import DecideRequest, Reservation, StoredResponse
from fencegate.store.base import GatewayStore, Outcome

TIMEOUT = 30.0
ANSWER = StoredResponse(
    status=201, headers=[("content-type", "application/json")], body=b"{}", sha256=""
)


async def one_key(
    store: GatewayStore, tenant: str, n: int, *, entity: str | None = None, fence: int = 1
) -> None:
    """A new key for caller ``n`` (entity ``invoice-n`` unless given), reserved with
    ``fence``, and its answer recorded; fails loudly if either is refused."""
    request = DecideRequest(
        tenant=tenant,
        key=f"k-{uuid.uuid4().hex}",
        fingerprint="f" * 64,
        entity=entity or f"invoice-{n}",
        fence=fence,
        owner=f"bench/{n}",
        lease_seconds=30,
        ttl_seconds=3600,
        retry_unknown=False,
        request_id=str(n),
        method="POST",
        target="/v1/charges",
    )
    decision = await store.decide(request, timeout=TIMEOUT)
    if decision.outcome is not Outcome.RESERVED or decision.attempt is None:
        raise RuntimeError(f"a new key was not reserved: {decision}")
    assert request.key is not None
    holder = Reservation(tenant, request.key, request.owner, decision.attempt, str(n))
    if not await store.complete(holder, ANSWER, timeout=TIMEOUT):
        raise RuntimeError("a new key's answer was not recorded")
