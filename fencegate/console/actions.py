"""The operator's actions from the console: resolve a key, retry or cancel a job.

Each is two POSTs: ``step=review`` shows what will happen on a confirmation page (no
script needed), ``step=confirm`` does it through the same code as the command line, which
writes the audit record with the token's name as who did it, in the action's transaction.
Resolving a key follows the release rule as the command line does (``force=yes`` overrides
it, audited); a refusal is 409 ``release-unsafe``, saying why and from when it is safe."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from fencegate.console.web import Viewer, console_of, read_form, redirect, render
from fencegate.operator_actions import (
    cancel_job,
    key_fields,
    refusal,
    resolve_key,
    retry_job,
    stored_answer,
)
from fencegate.problems import Problem
from fencegate.store import Resolution, ResolveResult, StoredResponse
from fencegate.store.release import ReleaseBlocker, utc
from fencegate.types import DEFAULT_TENANT


def _require_operator(viewer: Viewer) -> None:
    if not viewer.token.can_act:
        raise Problem(
            403, "read-only-token", "Read-only token", f"{viewer.name} is a viewer: it cannot act"
        )


def _reason(form: dict[str, str]) -> str | None:
    return form.get("reason", "").strip()[:500] or None


async def resolve(request: Request, viewer: Viewer) -> Response:
    _require_operator(viewer)
    form = await read_form(request, viewer)
    key = form.get("key", "")
    tenant = form.get("tenant") or viewer.tenant or DEFAULT_TENANT
    if not key:
        raise Problem(400, "which-key", "Which key?", "the form names no key")
    if viewer.tenant is not None and tenant != viewer.tenant:
        raise Problem(404, "no-such-key", "No such key", f"no key {key!r} for tenant {tenant!r}")
    answer = _answer(form)
    force = form.get("force") == "yes"
    console = console_of(request)
    if form.get("step") != "confirm":
        record = await (await console.store()).get_key(
            tenant, key, margin=console.release_margin, timeout=console.timeout
        )
        if record is None:
            raise Problem(
                404, "no-such-key", "No such key", f"no key {key!r} for tenant {tenant!r}"
            )
        context = {"form": form, "key": key_fields(record), "answer": answer, "force": force,
                   "tenant": tenant, "body_text": form.get("body", "")}  # fmt: skip
        return render(request, "confirm_resolve.html", context, viewer=viewer, refresh=False)
    done = await resolve_key(
        await console.store(), tenant=tenant, key=key, answer=answer, actor=viewer.actor,
        reason=_reason(form), margin=console.release_margin, force=force,
        timeout=console.timeout,
    )  # fmt: skip
    result = done.result
    if result is ResolveResult.NOT_FOUND:
        raise Problem(404, "no-such-key", "No such key", f"no key {key!r} for tenant {tenant!r}")
    if result is ResolveResult.NOT_UNKNOWN:
        raise Problem(
            409, "key-not-unknown", "Key not unknown",
            f"key {key!r} is completed: there is nothing to release or record; left as it is",
        )  # fmt: skip
    if result is ResolveResult.BLOCKED:
        raise release_unsafe(key, done)
    if result is ResolveResult.RELEASED:
        return redirect(request, "/keys", done=f"released {key}")
    return redirect(request, "/key", tenant=tenant, key=key, done=result.value)


def release_unsafe(key: str, done: Resolution) -> Problem:
    """409: the release rule refused, with why and from when it is safe."""
    blocker = ReleaseBlocker.of(done.before) if done.before is not None else None
    safe = blocker.safe_from if blocker is not None else None
    return Problem(
        409,
        "release-unsafe",
        "Not safe to release yet",
        f"key {key!r} was left as it is: "
        f"{refusal(done, force_hint='resolve it again with force (audited)')}",
        blocker=blocker.reason if blocker is not None else None,
        safe_from=utc(safe) if safe is not None else None,
        release_margin=done.before.release_margin if done.before is not None else None,
    )


def _answer(form: dict[str, str]) -> StoredResponse | None:
    mode = form.get("mode")
    if mode == "release":
        return None
    if mode != "completed":
        raise Problem(
            400, "resolve-how", "Resolve how?", "choose: record an answer, or release the key"
        )
    try:
        status = int(form.get("status", ""))
    except ValueError:
        raise Problem(
            400, "status-needed", "Status needed", "an answer needs an HTTP status, 100 to 599"
        ) from None
    content_type = form.get("content_type", "").strip() or "application/json"
    try:
        return stored_answer(status, form.get("body", "").encode(), content_type)
    except ValueError as exc:
        raise Problem(400, "status-needed", "Status needed", str(exc)) from None


async def job_action(request: Request, viewer: Viewer) -> Response:
    _require_operator(viewer)
    if not viewer.token.sees_jobs:
        raise Problem(
            403, "jobs-not-shown", "Jobs are not shown to tenant tokens", "jobs carry no tenant"
        )
    job_id = int(request.path_params["job_id"])
    action = request.path_params["action"]
    if action not in ("retry", "cancel"):
        raise Problem(
            404,
            "no-such-action",
            "No such action",
            f"jobs can be retried or cancelled, not {action!r}",
        )
    form = await read_form(request, viewer)
    console = console_of(request)
    inspector = await console.inspector()
    if form.get("step") != "confirm":
        job = await inspector.job(job_id)
        if job is None:
            raise Problem(404, "no-such-job", "No such job", f"there is no job {job_id}")
        context = {"job": job, "action": action}
        return render(request, "confirm_job.html", context, viewer=viewer, refresh=False)
    act = retry_job if action == "retry" else cancel_job
    after = await act(
        await console.queue(), inspector, job_id, actor=viewer.actor, reason=_reason(form),
        timeout=console.timeout,
    )  # fmt: skip
    if after is None:
        which = "failed or cancelled" if action == "retry" else "queued or running"
        raise Problem(
            409,
            "nothing-to-do",
            f"Nothing to {action}",
            f"job {job_id} is not {which}: left as it is",
        )
    return redirect(request, f"/jobs/{job_id}", done=action)
