"""The operator's actions, shared by the command line and the web console (both import this
module; it imports neither).

Each action goes through the rule's own home (the gateway store resolves a key under the
release rule, the lease queue cancels or retries a job) and leaves one audit record, written
in the action's own transaction: who, what, why, and the state before and after. The callers
open the stores; this module only acts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from fencegate.lease import JobNotFound, LeaseQueue
from fencegate.store import GatewayStore, KeyRecord, Resolution, StoredResponse
from fencegate.store.audit import AuditEntry
from fencegate.store.inspect import Inspector, Row
from fencegate.store.key_states import operator_state
from fencegate.store.release import ReleaseBlocker, utc
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN, gateway_instance


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
    *,
    tenant: str,
    key: str,
    answer: StoredResponse | None,
    actor: str,
    reason: str | None,
    margin: float = DEFAULT_RELEASE_MARGIN,
    force: bool = False,
    timeout: float,
) -> Resolution:
    """Record ``answer`` for a key whose outcome is unknown (None: release it), when the
    release rule allows it (``margin``: the release margin in seconds) or ``force`` says to,
    with its audit record in the same transaction. A refusal (`ResolveResult.BLOCKED`) is
    explained by `refusal`."""

    def audit(done: Resolution) -> AuditEntry:
        action = "keys.resolve_forced" if done.forced else f"keys.resolve_{done.result.value}"
        return AuditEntry(
            actor=actor,
            action=action,
            tenant=tenant,
            subject=key,
            reason=reason,
            before=key_fields(done.before) if done.before is not None else None,
            after=key_fields(done.after) if done.after is not None else None,
        )

    return await store.resolve_key(
        tenant,
        key,
        answer,
        resolved_by=actor,
        margin=margin,
        force=force,
        audit=audit,
        timeout=timeout,
    )


def refusal(resolution: Resolution, *, force_hint: str = "use --force") -> str:
    """Why a resolve was refused, and when it becomes safe, in one sentence."""
    blocker = ReleaseBlocker.of(resolution.before) if resolution.before is not None else None
    if blocker is None:
        return "its gateway's state changed while it was checked: try again"
    return blocker.explain(force_hint=force_hint)


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
        queue.cancel,
        "jobs.cancel",
        inspector,
        job_id,
        actor=actor,
        reason=reason,
        timeout=timeout,
    )


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
        queue.retry,
        "jobs.retry",
        inspector,
        job_id,
        actor=actor,
        reason=reason,
        timeout=timeout,
    )


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
    """``act`` (a `LeaseQueue` method) on one job, audited with the job before and after in
    the action's own transaction; None when there is no such job or ``act`` left it as it
    was."""

    def audit(before: Row, after: Row) -> AuditEntry:
        return AuditEntry(
            actor=actor,
            action=action,
            subject=str(job_id),
            reason=reason,
            before=before,
            after=after,
        )

    try:
        if not await act(job_id, audit=audit, timeout=timeout):
            return None
    except JobNotFound:
        return None
    return await inspector.job(job_id, timeout=timeout)


async def key_history(inspector: Inspector, *, tenant: str, key: str, timeout: float) -> list[Row]:
    """What the gateway decided on one key and what operators did to it, oldest first."""
    trace = await inspector.trace(key, tenant=tenant, timeout=timeout)
    return [e for e in trace.events if e["source"] in ("gateway", "operator") and e["key"] == key]


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
        # The request as routed, the limit that fired, and how its unknown outcome ended.
        "method": record.method,
        "target": record.target,
        "unknown_reason": record.unknown_reason,
        "resolution": record.resolution,
        **release_fields(record),
        **reconcile_fields(record),
    }


def release_fields(record: KeyRecord) -> dict[str, object]:
    """Who may settle the key and when: its gateway process and whether it heartbeats, and
    the release rule's answer in words with the time releasing becomes safe."""
    gateway = gateway_instance(record.owner) if record.state != "completed" else ""
    alive = record.gateway_alive_until is not None and record.gateway_alive_until > record.now
    fields: dict[str, object] = {
        "gateway": gateway or None,
        "gateway_alive": alive if gateway else None,
        "gateway_heartbeat_at": when(record.gateway_heartbeat_at) if gateway else None,
    }
    if record.state == "completed":
        return fields | {"release": None, "release_safe_from": None}
    blocker = ReleaseBlocker.of(record)
    if blocker is None:
        words = f"safe now (release margin {record.release_margin:g} s)"
        return fields | {"release": words, "release_safe_from": None}
    safe = blocker.safe_from
    return fields | {
        "release": f"not yet: {blocker.explain(force_hint='force it (audited)')}",
        "release_safe_from": utc(safe) if safe is not None else None,
    }


def reconcile_fields(record: KeyRecord) -> dict[str, object]:
    """The reconciler's schedule for the key, when it has one."""
    if record.reconcile_after is None and not record.reconcile_tries and not record.reconcile_note:
        return {}
    return {
        "reconcile_after": when(record.reconcile_after),
        "reconcile_tries": record.reconcile_tries,
        "reconcile_note": record.reconcile_note,
    }
