"""The reconciler (DESIGN §8): a background task in every gateway process that settles keys
whose outcome is unknown by asking the upstream, instead of waiting for an operator.

Every ``interval`` seconds (with jitter, so that gateways do not poll in step) it claims a
bounded batch of keys of reconciling routes whose release is safe (`fencegate.store.reconcile`
holds the statements and the claim's rules), runs each route's ``reconcile`` probe
(`fencegate.gateway.reconcile`) against the route's upstream, and settles the key by what
the probe said, conditional on the key being as claimed:

- executed: completed with the upstream's answer (replayed from then on), ``reconciled``;
- not executed: released, so that the next request runs;
- unknown: the note says why; tried again after a backoff (1 s, 2 s, 4 s … 5 min), and the
  key stays for an operator meanwhile.

Each key gets one line in the decision log (``event=reconciliation``), a count in
``fencegate_reconciliations_total{route,result}`` and, with traces on, a span.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote, urlsplit

from fencegate import tracing
from fencegate.errors import StoreUnavailable
from fencegate.gateway import spans
from fencegate.gateway.decisions import log_reconciliation
from fencegate.gateway.headers import NOT_REPLAYED
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.reconcile import (
    CallableProbe,
    Executed,
    HttpProbe,
    MissingValue,
    NotExecuted,
    ProbeResult,
    StoredRequest,
    Unknown,
)
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.gateway.target import parse_target
from fencegate.gateway.upstream import Upstream, UpstreamOutcomeUnknown, UpstreamRefused
from fencegate.internal_errors import InternalErrors
from fencegate.problems import Problem
from fencegate.store.base import GatewayStore, StoredResponse
from fencegate.store.reconcile import ClaimedKey, backoff, reconcile_store
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN
from fencegate.types import IncomingRequest, Message, Scope

logger = logging.getLogger("fencegate.reconciler")

DEFAULT_INTERVAL = 1.0
DEFAULT_BATCH = 32

# Results, as counted and logged.
COMPLETED = "completed"
RELEASED = "released"
UNKNOWN = "unknown"
CHANGED = "changed"  # the key changed between the claim and the probe's answer: left alone


def reconciling(routes: RouteTable) -> list[RoutePolicy]:
    return [r for r in (*routes.routes, routes.default) if r.reconcile is not None]


class Reconciler:
    def __init__(
        self,
        store: GatewayStore,
        *,
        routes: RouteTable,
        upstream: Upstream,
        instance: str,
        release_margin: float = DEFAULT_RELEASE_MARGIN,
        interval: float = DEFAULT_INTERVAL,
        batch: int = DEFAULT_BATCH,
        store_timeout: float = 2.0,
        metrics: GatewayMetrics | None = None,
        internal_errors: InternalErrors | None = None,
    ) -> None:
        """``internal_errors``: where a fault in fencegate's own code is reported (the
        engine's, so that they are counted together)."""
        if interval <= 0:
            raise ValueError("the reconcile interval must be longer than zero seconds")
        self.store = reconcile_store(store)
        self.routes = routes
        self.upstream = upstream
        self.instance = instance
        self.by = f"reconciler:{instance}"  # who settled a key, in the decision history
        self.release_margin = float(release_margin)
        self.interval = float(interval)
        self.batch = batch
        self.store_timeout = float(store_timeout)
        self.metrics = metrics
        self.internal_errors = internal_errors or InternalErrors(
            logger, count=metrics.internal_error if metrics is not None else None
        )
        # A claimed key is not looked at again before its probe and settling can have ended:
        # the slowest reconciling route's timeout, and two store round trips.
        slowest = max((r.timeout for r in reconciling(routes)), default=0.0)
        self.hold = slowest + 2 * self.store_timeout
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._forever())

    async def close(self) -> None:
        """Stop polling; a probe under way is abandoned (its key is claimed, so it is looked
        at again once the claim's hold has passed, here or in another gateway)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _forever(self) -> None:
        while True:
            try:
                claimed = await self.run_once()
            except StoreUnavailable as exc:
                if not self._failing:
                    logger.warning("reconciler: cannot claim keys, will keep trying: %s", exc)
                self._failing = True
                claimed = 0
            except Exception as exc:
                self.internal_errors.report(exc, where="reconcile", about="claiming keys")
                claimed = 0
            else:
                if self._failing:
                    logger.info("reconciler: claiming keys again")
                self._failing = False
            if claimed < self.batch:  # a full batch: more may be due, poll again at once
                await asyncio.sleep(self.interval * random.uniform(0.5, 1.5))

    async def run_once(self) -> int:
        """One poll: claim due keys, probe and settle each; how many were claimed."""
        claimed = await self.store.claim(
            margin=self.release_margin,
            hold=self.hold,
            limit=self.batch,
            timeout=self.store_timeout,
        )
        if claimed:
            await asyncio.gather(*(self._reconcile(c) for c in claimed))
        return len(claimed)

    async def _reconcile(self, claimed: ClaimedKey) -> None:
        policy = self._route(claimed)
        if tracing.TRACER is None:
            await self._settle(claimed, policy, None)
            return
        with spans.reconcile_span(route=policy.prefix, method=claimed.method or "",
                                  tenant=claimed.tenant, key=claimed.key,
                                  attempt=claimed.attempt) as span:  # fmt: skip
            await self._settle(claimed, policy, span)

    async def _settle(self, claimed: ClaimedKey, policy: RoutePolicy, span: Any) -> None:
        started = time.perf_counter()
        stored = StoredRequest(
            tenant=claimed.tenant,
            key=claimed.key,
            method=claimed.method or "",
            target=claimed.target or "",
            body=claimed.body or b"",
            entity=claimed.entity,
            fence=claimed.fence,
            attempt=claimed.attempt,
        )
        fields: dict[str, Any] = {}
        try:
            result, probe_status = await self._probe(policy, stored)
            probe_ms = round((time.perf_counter() - started) * 1000, 3)
            outcome, next_try = await self._write(claimed, policy, result)
        except StoreUnavailable as exc:
            # The store could not take the result: the claim's hold passes, and the key is
            # looked at again (here or in another gateway).
            logger.warning(
                "reconciler: could not settle key %r (tenant %r): %s",
                claimed.key,
                claimed.tenant,
                exc,
            )
            return
        except Exception as exc:
            about = f"key {claimed.key!r} of tenant {claimed.tenant!r}"
            self.internal_errors.report(exc, where="reconcile", about=about)
            return
        note = result.note
        fields = {
            "result": outcome,
            "probe_result": type(result).__name__,
            "route": policy.prefix,
            "tenant": claimed.tenant,
            "key": claimed.key,
            "method": claimed.method,
            "target": claimed.target,
            "entity": claimed.entity,
            "fence": claimed.fence,
            "attempt": claimed.attempt,
            "state": claimed.state,
            "tries": claimed.tries,
            "probe": policy.reconcile.describe() if policy.reconcile is not None else None,
            "probe_status": probe_status,
            "probe_ms": probe_ms,
            "note": note or None,
            "next_try": _iso(next_try),
            "owner": self.instance,
        }
        if span is not None:
            fields["trace_id"] = format(span.get_span_context().trace_id, "032x")
            spans.end_reconcile_span(span, result=outcome, probe_status=probe_status, note=note)
        if self.metrics is not None:
            self.metrics.reconciled(policy.prefix, outcome)
        log_reconciliation(fields)

    def _route(self, claimed: ClaimedKey) -> RoutePolicy:
        target = claimed.target or "/"
        try:
            path = parse_target(target.encode("latin-1"), b"").route_path
        except (Problem, UnicodeError):
            path = unquote(target)
        return self.routes.match(path)

    async def _probe(
        self, policy: RoutePolicy, stored: StoredRequest
    ) -> tuple[ProbeResult, int | None]:
        """What the route's probe says (never raises for the upstream's faults: they are
        unknown), with the probe's HTTP status when there was one."""
        rule = policy.reconcile
        if isinstance(rule, HttpProbe):
            return await self._http_probe(policy, rule, stored)
        if isinstance(rule, CallableProbe):
            return await self._call_probe(policy, rule, stored), None
        return Unknown(f"the route {policy.prefix} declares no reconcile"), None

    async def _http_probe(
        self, policy: RoutePolicy, probe: HttpProbe, stored: StoredRequest
    ) -> tuple[ProbeResult, int | None]:
        try:
            target = probe.render(stored)
        except MissingValue as exc:
            return Unknown(f"cannot probe: {exc}"), None
        asked = f"{probe.method} {target}"
        request = probe_request(policy, probe, target)
        try:
            answer = await self.upstream.send(
                request, policy, probe_scope(request), _no_more_body, timeout=policy.timeout
            )
        except UpstreamRefused as exc:
            return Unknown(f"{asked}: the upstream could not be reached ({exc})"), None
        except UpstreamOutcomeUnknown as exc:
            return Unknown(f"{asked}: no answer ({exc})"), None
        status = answer.status
        verdict = probe.judge(status)
        if verdict == "executed":
            note = f"{asked} answered {status}: executed"
            return Executed(status, answer.headers, answer.body, note=note), status
        if verdict == "not_executed":
            return NotExecuted(f"{asked} answered {status}: not executed"), status
        return Unknown(f"{asked} answered {status}, in neither executed nor not_executed"), status

    async def _call_probe(
        self, policy: RoutePolicy, probe: CallableProbe, stored: StoredRequest
    ) -> ProbeResult:
        try:
            result = await asyncio.wait_for(probe.function(stored), policy.timeout)
        except TimeoutError:
            return Unknown(f"{probe.spec} did not answer within {policy.timeout:g}s")
        except Exception as exc:
            logger.warning("reconciler: %s raised for key %r", probe.spec, stored.key,
                           exc_info=True)  # fmt: skip
            return Unknown(f"{probe.spec} raised {type(exc).__name__}: {exc}")
        return checked_result(result, probe.spec)

    async def _write(
        self, claimed: ClaimedKey, policy: RoutePolicy, result: ProbeResult
    ) -> tuple[str, float | None]:
        """Settle the key as the probe said; the result's word, and for an unknown when the
        key is looked at next (epoch seconds)."""
        timeout = self.store_timeout
        if isinstance(result, Executed):
            done = await self.store.complete(
                claimed,
                stored_answer(result, policy),
                note=result.note,
                by=self.by,
                timeout=timeout,
            )
            return (COMPLETED if done else CHANGED), None
        if isinstance(result, NotExecuted):
            gone = await self.store.release(
                claimed, margin=self.release_margin, by=self.by, timeout=timeout
            )
            return (RELEASED if gone else CHANGED), None
        next_try = await self.store.later(
            claimed, note=result.note, after=backoff(claimed.tries), timeout=timeout
        )
        return (UNKNOWN if next_try is not None else CHANGED), next_try


def checked_result(result: object, spec: str) -> ProbeResult:
    """A function's result, held to the contract: anything else is unknown, with why."""
    if isinstance(result, NotExecuted | Unknown):
        return result
    if isinstance(result, Executed):
        if isinstance(result.status, bool) or not isinstance(result.status, int):
            return Unknown(f"{spec} returned Executed with status {result.status!r}")
        if not 100 <= result.status <= 599:
            return Unknown(f"{spec} returned Executed with status {result.status}")
        body: object = result.body
        if isinstance(body, str):
            body = body.encode()
        if not isinstance(body, bytes | bytearray):
            return Unknown(f"{spec} returned Executed with a body of {type(body).__name__}")
        headers = [(str(k), str(v)) for k, v in result.headers]
        return Executed(result.status, headers, bytes(body), note=result.note or spec)
    return Unknown(f"{spec} returned {type(result).__name__}, not Executed, NotExecuted or Unknown")


def stored_answer(result: Executed, policy: RoutePolicy) -> StoredResponse:
    """The answer as the engine would store it: replayable headers only, a body larger than
    the route keeps reduced to its SHA-256."""
    body = result.body
    return StoredResponse(
        status=result.status,
        headers=[(k, v) for k, v in result.headers if k.lower() not in NOT_REPLAYED],
        body=body if len(body) <= policy.max_stored_body_bytes else None,
        sha256=hashlib.sha256(body).hexdigest(),
    )


def probe_request(policy: RoutePolicy, probe: HttpProbe, target: str) -> IncomingRequest:
    """The probe as a request to the route's upstream, sent like a forwarded one."""
    upstream = urlsplit(policy.upstream or "http://localhost")
    path, _, query = target.partition("?")
    headers = probe.headers
    if tracing.TRACER is not None:
        headers = tracing.inject_headers(headers)
    return IncomingRequest(
        method=probe.method,
        scheme=upstream.scheme or "http",
        authority=upstream.netloc or "localhost",
        path=path,
        query_string=query,
        headers=headers,
        body=b"",
        decoded_path=unquote(path),
    )


def probe_scope(request: IncomingRequest) -> Scope:
    """An ASGI scope for the probe, for an in-process upstream (the middleware's app)."""
    host, _, port = request.authority.partition(":")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.route_path,
        "raw_path": request.path.encode("latin-1"),
        "query_string": request.query_string.encode("latin-1"),
        "root_path": "",
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": None,
        "server": (host, int(port) if port.isdigit() else 80),
    }


async def _no_more_body() -> Message:
    return {"type": "http.disconnect"}


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")
