"""What operators read and do, on either store: the command line (`fencegate keys|fences|jobs|
trace`) and the web console both go through `Inspector`.

Reads: keys by state, one entity's fence, jobs with paging, a job's attempts and stages, the
overview (queue depth, running leases, reclaimed leases, unknown outcomes, the 412 rate), and
the trace of an entity or a key: gateway decisions joined with the job attempts whose fencing
tokens they carried — who sent which request, with which token, and which one was fenced off.

Actions (purging jobs; the audit records of `fencegate.operator_actions`) are written to
``fencegate_audit`` with who did it, why, and the state before and after. Nothing here
returns payloads, results or stored answers: ids, tokens, owners, times, states and
outcomes. The one exception is ``job_payload``, which only a console started with
``--show-payloads`` calls.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from fencegate.store.audit import AuditEntry
from fencegate.store.backends import NamedQueries, open_database
from fencegate.store.dburl import DatabaseURL, parse_database_url
from fencegate.store.key_states import KEY_STATES
from fencegate.store.queries import Queries

Row = dict[str, Any]


JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class Page:
    rows: list[Row]
    cursor: str | None  # pass back for the next page; None on the last one


@dataclass(frozen=True, slots=True)
class Trace:
    subject: str
    fence: Row | None
    events: list[Row] = field(default_factory=list)


class Inspector:
    """The operator's reads over either store: named queries (``sql/<store>/queries/
    inspect.sql``) run through the backend's connection layer, never a branch on which."""

    def __init__(self, target: DatabaseURL, db: NamedQueries) -> None:
        self.target = target
        self._db = db
        self._q = Queries(target.kind)

    @classmethod
    async def open(cls, url: str | None, *, timeout: float = 10.0) -> Inspector:
        target = parse_database_url(url)
        db = await open_database(
            target, application_name="fencegate-operator", max_size=4, timeout=timeout
        )
        return cls(target, db)

    async def close(self) -> None:
        await self._db.close()

    # -- running statements -------------------------------------------------------------

    async def _rows(self, name: str, *args: Any, timeout: float) -> list[Row]:
        return await self._db.fetch(getattr(self._q, name), args, timeout=timeout)

    async def _value(self, name: str, *args: Any, timeout: float) -> Any:
        rows = await self._rows(name, *args, timeout=timeout)
        return next(iter(rows[0].values())) if rows else None

    # -- reads ----------------------------------------------------------------------------

    async def now(self, *, timeout: float = 10.0) -> float:
        return float(await self._value("clock", timeout=timeout))

    async def keys(
        self,
        *,
        tenant: str | None = None,
        state: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
        timeout: float = 10.0,
    ) -> Page:
        if state is not None and state not in KEY_STATES:
            raise ValueError(f"state must be one of {', '.join(KEY_STATES)}")
        after_tenant, _, after_key = (cursor or "").partition("\x1f")
        rows = await self._rows(
            "keys",
            tenant,
            state,
            after_key if cursor else None,
            after_tenant if cursor else None,
            limit + 1,
            timeout=timeout,
        )
        more = len(rows) > limit
        rows = rows[:limit]
        next_cursor = f"{rows[-1]['tenant']}\x1f{rows[-1]['key']}" if more else None
        return Page(rows, next_cursor)

    async def fence(self, entity: str, *, tenant: str | None, timeout: float = 10.0) -> Trace:
        """An entity's fence and its history of fenced decisions."""
        rows = await self._rows("fence", tenant, entity, timeout=timeout)
        history = await self._rows("decisions_for", tenant, entity, 1000, timeout=timeout)
        events = [self._decision_event(d) for d in history if d["entity"] == entity]
        return Trace(entity, rows[0] if rows else None, events)

    async def jobs(
        self,
        *,
        state: str | None = None,
        kind: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
        timeout: float = 10.0,
    ) -> Page:
        if state is not None and state not in JOB_STATES:
            raise ValueError(f"state must be one of {', '.join(JOB_STATES)}")
        before = _job_cursor(cursor)
        rows = await self._rows("jobs", state, kind, before, limit + 1, timeout=timeout)
        for row in rows:
            row["has_error"] = bool(row["has_error"])
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, str(rows[-1]["id"]) if more else None)

    async def job(self, job_id: int, *, timeout: float = 10.0) -> Row | None:
        """One job with its attempts and stages; errors as a code and a hash, never text."""
        rows = await self._rows("job", job_id, timeout=timeout)
        if not rows:
            return None
        job = rows[0]
        job["error"] = _error_summary(job.get("error"))
        attempts = await self._rows("attempts", job_id, timeout=timeout)
        for attempt in attempts:
            attempt["error"] = _error_summary(attempt.get("error"), outcome=attempt["outcome"])
        job["attempts"] = attempts
        job["stages"] = await self._rows("stages", job_id, timeout=timeout)
        return job

    async def job_payload(self, job_id: int, *, timeout: float = 10.0) -> Row | None:
        """A job's payload and result, decoded. Every other read leaves them out: only a
        caller that was told to show payloads asks for them."""
        rows = await self._rows("job_payload", job_id, timeout=timeout)
        if not rows:
            return None
        return {
            name: orjson.loads(value) if value is not None else None
            for name, value in rows[0].items()
        }

    async def overview(self, *, tenant: str | None = None, timeout: float = 10.0) -> Row:
        recent = await self._rows("recent_decisions", tenant, 3600.0, timeout=timeout)
        counts = {r["decision"]: int(r["decisions"]) for r in recent}
        total = sum(counts.values())
        jobs_visible = tenant is None  # jobs carry no tenant: a tenant's view shows none
        return {
            "now": await self.now(timeout=timeout),
            "queue_depth": await self._rows("queue_depth", timeout=timeout) if jobs_visible else [],
            "running_leases": await self._rows("running_leases", 50, timeout=timeout)
            if jobs_visible
            else [],
            "reclaimed_leases": int(await self._value("reclaimed", timeout=timeout) or 0)
            if jobs_visible
            else 0,
            "unknown_keys": int(await self._value("unknown_keys", tenant, timeout=timeout) or 0),
            "decisions_last_hour": counts,
            "stale_fence_rate": (counts.get("stale", 0) / total) if total else 0.0,
        }

    async def limits(self, *, timeout: float = 10.0) -> list[Row]:
        """Each scheduling limit in force: its rule (max_running, max_running_per_key, rate),
        the work class or provider, the limit, the jobs running under it and the ready jobs
        it holds back now (a rate limit's detail: the tokens in its bucket)."""
        return await self._rows("scheduling_limits", timeout=timeout)

    async def ownership(self, *, timeout: float = 10.0) -> list[Row]:
        """By work class: queued, running, expired (lease ran out, not yet reclaimed),
        reclaimed, the smallest remaining lease and the oldest heartbeat among running."""
        return await self._rows("ownership_by_kind", timeout=timeout)

    async def trace(
        self, subject: str, *, tenant: str | None, limit: int = 1000, timeout: float = 10.0
    ) -> Trace:
        """One timeline for an entity or a key: the gateway's decisions, the lease grants
        whose tokens they carried (and, for ``job:<id>``, that job's own attempts and
        stages), and how each grant ended."""
        decisions = await self._rows("decisions_for", tenant, subject, limit, timeout=timeout)
        events = [self._decision_event(d) for d in decisions]
        tokens = sorted({int(d["fence"]) for d in decisions if d["fence"] is not None})
        attempts: dict[int, Row] = {}
        if tokens:
            arg = orjson.dumps(tokens).decode()
            for row in await self._rows("attempts_by_token", arg, timeout=timeout):
                attempts[int(row["fencing_token"])] = row
        job_id = _job_of(subject)
        if job_id is not None and tenant is None:
            for row in await self._rows("attempts", job_id, timeout=timeout):
                attempts[int(row["fencing_token"])] = row
            for stage in await self._rows("stages", job_id, timeout=timeout):
                events.append(
                    {
                        "at": stage["committed_at"],
                        "source": "stage",
                        "what": "stage_committed",
                        "job_id": job_id,
                        "token": stage["fencing_token"],
                        "stage": stage["name"],
                    }
                )
        # A token number alone does not say a request came from this queue: any caller may
        # send any fence. The worker behind a request is the holder of the lease its token
        # came from only when the request also carried that job's identity, as the fenced
        # clients send it (the job's key + step, or the entity job:<id>).
        shown = {token: a for token, a in attempts.items() if job_id == a["job_id"]}
        for event in events:
            if event["source"] != "gateway":
                continue
            grant = attempts.get(event["token"]) if event["token"] is not None else None
            if grant is not None and _carries_job_identity(event, grant):
                event["worker"] = grant["owner_id"]
                shown[event["token"]] = grant
            else:
                event["worker"] = None
        for attempt in shown.values():
            events.extend(_attempt_events(attempt))
        events.sort(key=lambda e: (e["at"] or 0.0, e["source"] != "lease"))
        fence = await self._rows("fence", tenant, subject, timeout=timeout)
        return Trace(subject, fence[0] if fence else None, events)

    def _decision_event(self, d: Row) -> Row:
        # An operator's resolution is written to the same history, under operator:<who>.
        operator = str(d["owner"] or "").startswith("operator:")
        return {
            "at": d["at"],
            "source": "operator" if operator else "gateway",
            "what": d["decision"],
            "token": d["fence"],
            "tenant": d["tenant"],
            "entity": d["entity"],
            "key": d["key"],
            "attempt": d["attempt"],
            "owner": d["owner"],
            "request_id": d["request_id"],
            "method": d["method"],
            "target": d["target"],
            "status": d["upstream_status"],
        }

    async def audit_log(
        self, *, tenant: str | None = None, limit: int = 100, timeout: float = 10.0
    ) -> list[Row]:
        return await self._rows("audit_log", tenant, limit, timeout=timeout)

    # -- actions (each recorded in fencegate_audit) ------------------------------------------

    async def audit(
        self,
        *,
        actor: str,
        action: str,
        subject: str,
        tenant: str | None = None,
        reason: str | None = None,
        before: Any = None,
        after: Any = None,
        timeout: float = 10.0,
    ) -> None:
        """An audit row on its own (an action whose change is not one transaction: the
        purge's batches). Actions that are one change write theirs in it (`AuditEntry`)."""
        entry = AuditEntry(actor, action, subject, tenant, reason, before, after)
        await self._execute("audit", *entry.arguments(), timeout=timeout)

    async def purge_jobs(
        self,
        *,
        older_than_seconds: float,
        actor: str,
        batch_size: int = 1000,
        timeout: float = 60.0,
    ) -> int:
        """Delete finished jobs (with their attempts and stages) not updated for that long."""
        total = 0
        while True:
            deleted = await self._execute(
                "jobs_purge", float(older_than_seconds), batch_size, timeout=timeout
            )
            total += deleted
            if deleted < batch_size:
                break
        await self.audit(
            actor=actor,
            action="jobs.purge",
            subject=f"older_than={older_than_seconds:g}s",
            after={"deleted": total},
            timeout=timeout,
        )
        return total

    async def _execute(self, name: str, *args: Any, timeout: float) -> int:
        """One statement in its own transaction; the number of rows it touched."""
        return await self._db.execute(getattr(self._q, name), args, timeout=timeout)


def _job_cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    try:
        return int(cursor)
    except ValueError:
        raise ValueError(f"cursor {cursor!r} is not a job id") from None


def _job_of(subject: str) -> int | None:
    """``job:<id>`` is the entity the fenced clients send by default."""
    prefix, _, rest = subject.partition(":")
    return int(rest) if prefix == "job" and rest.isdigit() else None


def _carries_job_identity(decision: Row, attempt: Row) -> bool:
    """The request named the attempt's job: the entity ``job:<id>``, or a key the job's
    fenced client made (its idempotency key, ``:``, the step)."""
    if decision["entity"] == f"job:{attempt['job_id']}":
        return True
    job_key = attempt.get("idempotency_key")
    return bool(job_key) and (decision["key"] or "").startswith(f"{job_key}:")


def _error_summary(error: Any, *, outcome: str | None = None) -> Row | None:
    """A stored error as the operator sees it: its code, the worker's redacted summary, and a
    hash of the whole (its full message may quote the payload: `job_payload` only)."""
    if error is None:
        return None
    value = orjson.loads(error) if isinstance(error, str | bytes) else error
    digest = hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()
    if isinstance(value, str):
        # The queue's own words ("lease expired on attempt 1 of 3"): no payload in them.
        code = (
            "lease_expired"
            if outcome == "lease_expired" or value.startswith("lease expired")
            else "error"
        )
        return {"code": code, "summary": value, "sha256": digest[:16]}
    fields = value if isinstance(value, dict) else {}
    named = fields.get("code") or fields.get("type") or "error"
    return {"code": named, "summary": fields.get("summary"), "sha256": digest[:16]}


def _attempt_events(attempt: Row) -> list[Row]:
    common = {
        "source": "lease",
        "job_id": attempt["job_id"],
        "attempt": attempt["attempt"],
        "token": attempt["fencing_token"],
        "owner": attempt["owner_id"],
        "kind": attempt.get("kind"),
    }
    events = [{"at": attempt["claimed_at"], "what": "job_claimed", **common}]
    if attempt["ended_at"] is not None:
        outcome = attempt["outcome"]
        # A lease that ran out is the heartbeat lost: its holder was cut off or died.
        what = "heartbeat_lost" if outcome == "lease_expired" else f"attempt_{outcome}"
        events.append({"at": attempt["ended_at"], "what": what, **common})
    return events
