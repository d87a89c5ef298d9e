"""The read pages: overview, jobs, one job, keys, one key, a trace, the audit log. Every
Inspector call passes the viewer's tenant, so a tenant's token reads only that tenant."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from fencegate.console.web import Viewer, console_of, render
from fencegate.operator_actions import key_fields, key_history
from fencegate.problems import Problem
from fencegate.store.inspect import JOB_STATES
from fencegate.store.key_states import KEY_STATES
from fencegate.types import DEFAULT_TENANT

PAGE_SIZE = 50
# A gateway decision, a lease grant and a stage carry different fields: one table shows all.
_TRACE_FIELDS = ("at", "source", "what", "token", "worker", "job_id", "attempt", "owner", "key",
                 "tenant", "request_id", "method", "target", "status", "stage", "kind")  # fmt: skip


def _param(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    return value or None


def _require_jobs(viewer: Viewer) -> None:
    if not viewer.token.sees_jobs:
        raise Problem(
            403, "jobs-not-shown", "Jobs are not shown to tenant tokens",
            "jobs carry no tenant, so a token limited to one tenant does not see them",
        )  # fmt: skip


def _tenant_for(request: Request, viewer: Viewer) -> str | None:
    """The viewer's own tenant, or (for an unrestricted token) the one asked for, if any."""
    return viewer.tenant if viewer.tenant is not None else _param(request, "tenant")


async def overview(request: Request, viewer: Viewer) -> Response:
    inspector = await console_of(request).inspector()
    data = await inspector.overview(tenant=viewer.tenant)
    unknown = await inspector.keys(tenant=viewer.tenant, state="outcome_unknown", limit=25)
    return render(request, "overview.html", {"data": data, "unknown": unknown}, viewer=viewer)


async def jobs(request: Request, viewer: Viewer) -> Response:
    _require_jobs(viewer)
    state, kind = _param(request, "state"), _param(request, "kind")
    inspector = await console_of(request).inspector()
    page = await inspector.jobs(
        state=state, kind=kind, cursor=_param(request, "cursor"), limit=PAGE_SIZE
    )
    limits = await inspector.limits()
    context = {"page": page, "state": state, "kind": kind, "states": JOB_STATES, "limits": limits}
    return render(request, "jobs.html", context, viewer=viewer)


async def job(request: Request, viewer: Viewer) -> Response:
    _require_jobs(viewer)
    job_id = int(request.path_params["job_id"])
    console = console_of(request)
    inspector = await console.inspector()
    row = await inspector.job(job_id)
    if row is None:
        raise Problem(404, "no-such-job", "No such job", f"there is no job {job_id}")
    payload = await inspector.job_payload(job_id) if console.show_payloads else None
    context = {"job": row, "payload": payload, "done": _param(request, "done")}
    return render(request, "job.html", context, viewer=viewer)


async def keys(request: Request, viewer: Viewer) -> Response:
    state = _param(request, "state")
    tenant = _tenant_for(request, viewer)
    inspector = await console_of(request).inspector()
    page = await inspector.keys(
        tenant=tenant, state=state, cursor=_param(request, "cursor"), limit=PAGE_SIZE
    )
    context = {"page": page, "state": state, "tenant": tenant, "states": KEY_STATES}
    return render(request, "keys.html", context, viewer=viewer)


async def key(request: Request, viewer: Viewer) -> Response:
    name = _param(request, "key")
    if name is None:
        raise Problem(400, "which-key", "Which key?", "give ?key=… (and &tenant=…)")
    tenant = _param(request, "tenant") or viewer.tenant or DEFAULT_TENANT
    if viewer.tenant is not None and tenant != viewer.tenant:
        # Not 403: another tenant's keys are not even said to exist.
        raise Problem(404, "no-such-key", "No such key", f"no key {name!r} for tenant {tenant!r}")
    console = console_of(request)
    store, inspector = await console.store(), await console.inspector()
    record = await store.get_key(
        tenant, name, margin=console.release_margin, timeout=console.timeout
    )
    if record is None:
        raise Problem(404, "no-such-key", "No such key", f"no key {name!r} for tenant {tenant!r}")
    history = await key_history(inspector, tenant=tenant, key=name, timeout=console.timeout)
    context = {"key": key_fields(record), "history": history, "done": _param(request, "done")}
    # The resolve form is on this page: a refresh must not wipe what the operator types.
    return render(request, "key.html", context, viewer=viewer, refresh=not viewer.token.can_act)


async def trace(request: Request, viewer: Viewer) -> Response:
    subject = _param(request, "subject")
    tenant = _tenant_for(request, viewer)
    result = None
    key_tenant = None
    if subject is not None:
        inspector = await console_of(request).inspector()
        result = await inspector.trace(subject, tenant=tenant)
        key_tenant = next((e["tenant"] for e in result.events if e.get("key") == subject), None)
    events = [{f: e.get(f) for f in _TRACE_FIELDS} for e in result.events] if result else []
    context = {"subject": subject, "tenant": tenant, "trace": result, "events": events,
               "key_tenant": key_tenant}  # fmt: skip
    return render(request, "trace.html", context, viewer=viewer)


async def audit(request: Request, viewer: Viewer) -> Response:
    inspector = await console_of(request).inspector()
    rows = await inspector.audit_log(tenant=viewer.tenant, limit=200)
    if viewer.tenant is not None:
        # The log also lists actions on jobs (no tenant): a tenant's token sees only its own.
        rows = [r for r in rows if r["tenant"] == viewer.tenant]
    return render(request, "audit.html", {"rows": rows}, viewer=viewer)
