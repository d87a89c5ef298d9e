"""The operator's actions, shared by the command line and the web console (both import this
module; it imports neither).

Each action goes through the rule's own home (the gateway store resolves a key, the lease
queue cancels or retries a job) and leaves one audit record: who, what, why, and the state
before and after. The callers open the stores; this module only acts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from fencegate.lease import LeaseQueue
from fencegate.store import GatewayStore, KeyRecord, ResolveResult, StoredResponse
from fencegate.store.inspect import Inspector, Row
from fencegate.store.key_states import operator_state


def stored_answer(status: int, body: bytes, content_type: str) -> StoredResponse:
    """The answer an operator records for a key: replayed to every retry from then on."""
    if not 100 <= status <= 599:
        raise ValueError(f"status {status} is not an HTTP status from 100 to 599")
    return StoredResponse(
        status=status,
        headers=[("content-type", content_type)],
        body=body,
        sha256=hashlib.sha256(body).hexdigest(),
    )


async def resolve_key(
    store: GatewayStore,
    inspector: Inspector,
    *,
    tenant: str,
    key: str,
    answer: StoredResponse | None,
    actor: str,
    reason: str | None,
    timeout: float,
) -> ResolveResult:
    """Record ``answer`` for an unknown key (None: release it), and audit it."""
    before = await store.get_key(tenant, key, timeout=timeout)
    result = await store.resolve_key(tenant, key, answer, resolved_by=actor, timeout=timeout)
    if result in (ResolveResult.COMPLETED, ResolveResult.RELEASED):
        after = await store.get_key(tenant, key, timeout=timeout)
        await inspector.audit(
            actor=actor,
            action=f"keys.resolve_{result.value}",
            tenant=tenant,
            subject=key,
            reason=reason,
            before=key_fields(before) if before is not None else None,
            after=key_fields(after) if after is not None else None,
            timeout=timeout,
        )
    return result


def when(value: Any) -> Any:
    """Epoch seconds as an ISO 8601 time in UTC; anything else as it is."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds")
    return value


async def cancel_job(
    queue: LeaseQueue,
    inspector: Inspector,
    job_id: int,
    *,
    actor: str,
    reason: str | None,
    timeout: float,
) -> Row | None:
    """Through the queue's own cancel: the rule for ending a job lives there. None when
    there is no such job, or it had already finished."""
    return await _job_action(
        queue.cancel, "jobs.cancel", inspector, job_id, actor=actor, reason=reason,
        timeout=timeout,
    )  # fmt: skip


async def retry_job(
    queue: LeaseQueue,
    inspector: Inspector,
    job_id: int,
    *,
    actor: str,
    reason: str | None,
    timeout: float,
) -> Row | None:
    """Through the queue's own retry: a failed or cancelled job is queued again with one more
    attempt. None when there is no such job, or it is not failed or cancelled."""
    return await _job_action(
        queue.retry, "jobs.retry", inspector, job_id, actor=actor, reason=reason,
        timeout=timeout,
    )  # fmt: skip


async def _job_action(
    act: Callable[..., Awaitable[bool]],
    action: str,
    inspector: Inspector,
    job_id: int,
    *,
    actor: str,
    reason: str | None,
    timeout: float,
) -> Row | None:
    """``act`` (a `LeaseQueue` method) on one job, audited with the job before and after;
    None when there is no such job or ``act`` left it as it was."""
    before = await inspector.job(job_id, timeout=timeout)
    if before is None:
        return None
    if not await act(job_id, timeout=timeout):
        return None
    after = await inspector.job(job_id, timeout=timeout)
    await inspector.audit(
        actor=actor,
        action=action,
        subject=str(job_id),
        reason=reason,
        before=_job_summary(before),
        after=_job_summary(after) if after else None,
        timeout=timeout,
    )
    return after


def _job_summary(job: Row) -> Row:
    fields = ("id", "kind", "state", "attempt", "max_attempts", "fencing_token", "owner_id")
    return {k: job[k] for k in fields}


async def key_history(inspector: Inspector, *, tenant: str, key: str, timeout: float) -> list[Row]:
    """The gateway's decisions on one key, oldest first."""
    trace = await inspector.trace(key, tenant=tenant, timeout=timeout)
    return [e for e in trace.events if e["source"] == "gateway" and e["key"] == key]


def key_fields(record: KeyRecord) -> dict[str, object]:
    """A key as the operator reads it, and as its audit records keep it."""
    lease_left = (
        round(record.locked_until - record.now, 3)
        if record.state == "in_flight" and record.locked_until is not None
        else None
    )
    lease_expired = record.unknown and record.state == "in_flight"
    state, reason = operator_state(record.state, lease_expired=lease_expired)
    return {
        "tenant": record.tenant,
        "key": record.key,
        "state": state,
        "reason": reason,
        "owner": record.owner,
        "attempt": record.attempt,
        "entity": record.entity,
        "fence": record.fence,
        "fingerprint": record.fingerprint,
        "lease_seconds_left": lease_left,
        "reserved_at": when(record.reserved_at),
        "created_at": when(record.created_at),
        "completed_at": when(record.completed_at),
        "expires_at": when(record.expires_at),
        "response_status": record.response_status,
    }
