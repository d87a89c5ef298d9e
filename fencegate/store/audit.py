"""One row of ``fencegate_audit``: who did what to which subject, why, and the state before
and after. An operator's action writes it in the transaction of the change it records (the
gateway store's `resolve_key`, the lease queue's cancel and retry), so that neither lands
without the other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class AuditEntry:
    actor: str  # operator:user@host, console:<token name>
    action: str  # keys.resolve_completed, keys.resolve_released, keys.resolve_forced, jobs.…
    subject: str  # the key, the job id, the purge's cut-off
    tenant: str | None = None
    reason: str | None = None
    before: Any = None
    after: Any = None

    def arguments(self) -> tuple[Any, ...]:
        """The parameters of the ``audit`` query, in its order (both stores)."""
        return (
            self.actor,
            self.action,
            self.tenant,
            self.subject,
            self.reason,
            _json(self.before),
            _json(self.after),
        )


def _json(value: Any) -> str | None:
    return orjson.dumps(value, default=str).decode() if value is not None else None


# What a job action's caller audits, given the job's summary before and after the change
# (id, kind, state, attempt, max_attempts, fencing_token, owner_id), both read in its
# transaction.
JobAudit = Callable[[dict[str, Any], dict[str, Any]], AuditEntry]
