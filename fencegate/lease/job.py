"""`JobContext`: what a tool receives. Its payload, its identity and fence, the guard that
refuses new external actions once ownership is lost or unknown, persistable stages, and the
fenced HTTP clients."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from fencegate import tracing
from fencegate.errors import FencegateError
from fencegate.lease.events import EventLog, digest
from fencegate.lease.execution import Execution, OwnershipLost, OwnershipUnknown

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    import aiohttp

    from fencegate.lease.client import FencedClient
    from fencegate.lease.httpx_client import FencedAuth
    from fencegate.lease.mcp_client import FencedMcpSession
    from fencegate.lease.models import Lease
    from fencegate.types import RequestSigner


_current_stage: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fencegate_stage", default=None
)


class StageStore(Protocol):
    """The part of `LeaseQueue` that stages use."""

    async def stage_result(self, lease: Lease, name: str, *, timeout: float) -> Any: ...

    async def commit_stage(
        self, lease: Lease, name: str, result: Any, *, timeout: float
    ) -> bool: ...


class StageTimeout(FencegateError, TimeoutError):
    """A stage ran longer than its work class allows (the lease may be perfectly fine)."""


class JobContext:
    def __init__(
        self,
        execution: Execution,
        *,
        queue: StageStore,
        events: EventLog,
        worker_id: str,
        ownership_margin: float,
        signer: RequestSigner | None = None,
        session: Callable[[], aiohttp.ClientSession] | None = None,
        store_timeout: float = 10.0,
        http_timeout: float = 30.0,
        labels: tuple[str, str, str] | None = None,
    ) -> None:
        self.execution = execution
        # What names this execution never changes (a renewal moves only its end): read once,
        # not through the execution's lock on every event and every property.
        lease = execution.lease
        self._id = lease.job_id
        self._kind = str(lease.kind)
        self._token = int(lease.fencing_token)
        self._attempt = int(lease.attempt)
        self._key = str(lease.idempotency_key)
        # (kind, provider, model): the provider and model go on every event ("" left out).
        self.labels = labels or (self._kind, "", "")
        self.queue = queue
        self.events = events
        self.worker_id = worker_id
        # The fields every event of this job starts with, in their order, put together once;
        # without the empty ones for `EventLog.emit_about` (an EventLog subclass with an emit
        # of its own still gets every field as a keyword).
        self._fields: dict[str, Any] = {
            "job": str(self._id),
            "kind": self._kind,
            "provider": self.labels[1] or None,
            "model": self.labels[2] or None,
            "token": self._token,
            "worker": worker_id,
        }
        self._about: dict[str, Any] | None = None
        if type(events).emit is EventLog.emit:
            self._about = {k: v for k, v in self._fields.items() if v is not None}
        self.ownership_margin = ownership_margin
        self.signer = signer
        self._session = session
        self.store_timeout = store_timeout
        self.http_timeout = http_timeout

    # -- identity -------------------------------------------------------------------------
    @property
    def lease(self) -> Lease:
        return self.execution.lease

    @property
    def id(self) -> Any:
        return self._id

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def payload(self) -> Any:
        return self.lease.payload

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def fencing_token(self) -> int:
        return self._token

    @property
    def idempotency_key(self) -> str:
        return self._key

    @property
    def default_entity(self) -> str:
        return f"job:{self.id}"

    @property
    def current_stage(self) -> str | None:
        """The stage the calling task is in (stages run concurrently keep theirs apart)."""
        return _current_stage.get()

    def step_key(self, step: str) -> str:
        """The stable ``Idempotency-Key`` of one step of this job: the same on every attempt."""
        return f"{self.idempotency_key}:{step}"

    def emit(self, event: str, **fields: Any) -> None:
        if tracing.TRACER is not None:
            fields["trace_id"] = tracing.current_trace_id()
        about = self._about
        if about is not None:
            if not self._fields.keys().isdisjoint(fields):
                # As keywords would have it: a field is the job's, or the event's.
                repeated = min(self._fields.keys() & fields.keys())
                raise TypeError(f"emit() got multiple values for keyword argument {repeated!r}")
            self.events.emit_about(event, about, fields)
            return
        self.events.emit(event, **self._fields, **fields)

    # -- ownership ------------------------------------------------------------------------
    def guard(self) -> None:
        """Raise `OwnershipLost` / `OwnershipUnknown` unless a new external action may start."""
        self.execution.guard(margin=self.ownership_margin)

    def ensure_owner(self, margin: float | None = None) -> None:
        self.execution.guard(margin=self.ownership_margin if margin is None else margin)

    async def wait_for_ownership(self, *, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the heartbeat to confirm the lease again.

        For a tool that would rather wait out a short store outage than fail: returns as
        soon as a new external action may start; raises `OwnershipLost` at once if the
        lease is lost, and `OwnershipUnknown` if it is still unconfirmed at the timeout.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                self.guard()
                return
            except OwnershipUnknown:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))

    # -- stages ---------------------------------------------------------------------------
    async def stage(
        self,
        name: str,
        fn: Callable[[], Awaitable[Any] | Any],
        *,
        timeout: float | None = None,
    ) -> Any:
        """Run ``fn`` once per job: a later attempt gets the stored result instead.

        The result is stored only if this worker still holds the lease (same token);
        otherwise `OwnershipLost` is raised and nothing is recorded.
        """
        record = await self.queue.stage_result(self.lease, name, timeout=self.store_timeout)
        if record is not None:
            self.emit("stage_skipped", stage=name, result_sha256=digest(record.result))
            return record.result
        self.guard()
        limit = timeout if timeout is not None else self.lease.stage_timeout_seconds
        entered = _current_stage.set(name)
        try:
            result = await asyncio.wait_for(invoke(fn), limit)
        except TimeoutError as exc:
            self.emit("stage_timeout", stage=name, timeout_seconds=limit)
            raise StageTimeout(f"stage {name!r} ran longer than {limit}s") from exc
        finally:
            _current_stage.reset(entered)
        committed = await self.queue.commit_stage(
            self.lease, name, result, timeout=self.store_timeout
        )
        if not committed:
            self.execution.mark_lost("stage_rejected")
            self.emit("result_rejected", stage=name, result_sha256=digest(result))
            raise OwnershipLost(self.id, self.fencing_token, f"stage {name!r} not committed")
        self.emit("stage_committed", stage=name, result_sha256=digest(result))
        return result

    # -- HTTP -----------------------------------------------------------------------------
    def http(self, *, entity: str | None = None, timeout: float | None = None) -> FencedClient:
        """The fenced aiohttp client over the worker's pooled session."""
        from fencegate.lease.client import FencedClient

        if self._session is None:
            raise RuntimeError("this job has no HTTP session (run it through a Worker)")
        return FencedClient(
            self,
            self._session(),
            entity=entity,
            signer=self.signer,
            timeout=timeout or self.http_timeout,
        )

    def mcp(
        self, url: str, *, entity: str | None = None, timeout: float | None = None
    ) -> AbstractAsyncContextManager[FencedMcpSession]:
        """A fenced MCP connection (needs ``fencegate[mcp]``): ``async with job.mcp(url) as
        tools: await tools.call_tool(name, arguments)``."""
        from fencegate.lease.mcp_client import connect

        return connect(
            self, url, entity=entity, signer=self.signer, timeout=timeout or self.http_timeout
        )

    def httpx_auth(self, *, step: str | None = None, entity: str | None = None) -> FencedAuth:
        """An `httpx.Auth` that fences and signs every request of an httpx client."""
        from fencegate.lease.httpx_client import FencedAuth

        return FencedAuth(self, step=step, entity=entity, signer=self.signer)


async def invoke(fn: Callable[..., Awaitable[Any] | Any], *args: Any) -> Any:
    """``fn(*args)``, awaited if it gives an awaitable: tools and stages may be plain
    functions. One that blocks holds the loop; the heartbeat thread keeps the lease."""
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result
