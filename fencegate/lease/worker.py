"""`Worker`: claims jobs, runs their tools under a lease, commits only while it owns them.

One worker is one claim loop on one event loop, running up to ``concurrency`` tools at once,
plus a heartbeat controller on its own thread and connection (`fencegate.lease.heartbeat`).
For each lease it:

1. logs ``job_claimed`` and registers the execution with the controller;
2. runs the tool with the work class's tool timeout (``tool_timeout`` → retry);
3. commits through the conditional ``complete``/``fail``: a lost lease or a ``False`` answer
   is ``result_rejected`` (the result is logged as a hash, nothing else);
4. a `PermanentError` fails the job at once; other errors are retried with the queue's
   backoff until the attempts are exhausted (``job_failed``).

Group commit and claiming ahead: a tool slot is free as soon as its tool returns, so the next
claim runs while the finished jobs commit. Their ``complete``/``fail``/stage commits, made
concurrently, are coalesced by the queue into one conditional statement per batch (each row
still checked against owner, token and lease, each job still answered True/False on its own),
and the heartbeat controller renews all held leases in one statement per interval. Workers
sharing a queue claim together the same way (one statement for the claims of one set of kinds
made while one is in flight). The claim
loop claims ahead: up to ``concurrency`` leases wait, held and renewed, for a tool slot, so a
slot that frees does not wait for a round trip. Leases held at once are bounded: at most
``2 * concurrency`` running or waiting, ``4 * concurrency`` counting those still committing.

``stop()`` (SIGTERM through `run_worker`) stops claiming, lets running tools finish within
``grace_seconds`` and releases the leases of those that cannot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import aiohttp

from fencegate import tracing
from fencegate.errors import StoreClosed
from fencegate.lease import spans as lease_spans
from fencegate.lease import young_generation
from fencegate.lease.error_summary import ErrorSummary, default_error_summary, error_record
from fencegate.lease.errors import StoreUnavailable
from fencegate.lease.events import EventLog, digest
from fencegate.lease.execution import (
    Execution,
    Ownership,
    OwnershipLost,
    OwnershipUnknown,
    PermanentError,
)
from fencegate.lease.heartbeat import HeartbeatController, RenewingStore
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.policy import fails_for_good

if TYPE_CHECKING:
    from fencegate.lease.models import Lease
    from fencegate.lease.policy import RateLimit, WorkClass
    from fencegate.lease.queue import LeaseQueue
    from fencegate.lease.testing import PartitionedStore
    from fencegate.types import RequestSigner

Tool = Callable[[JobContext], Coroutine[Any, Any, Any]] | Callable[[JobContext], Any]

logger = logging.getLogger("fencegate.worker")

# How an attempt ends when this worker's own complete / fail / release lands.
_SUCCEEDED = frozenset({"succeeded"})
_FAILED = frozenset({"failed", "retry_scheduled"})
_RELEASED = frozenset({"released"})

_default_metrics: WorkerMetrics | None = None
_default_metrics_lock = threading.Lock()


def default_metrics() -> WorkerMetrics:
    """One set of worker metrics on the default Prometheus registry, shared by the process."""
    global _default_metrics
    with _default_metrics_lock:
        if _default_metrics is None:
            _default_metrics = WorkerMetrics()
        return _default_metrics


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(
        self,
        queue: str | LeaseQueue | PartitionedStore,
        *,
        tools: Mapping[str, Tool],
        worker_id: str | None = None,
        kinds: Sequence[str] | None = None,
        concurrency: int = 4,
        work_classes: Iterable[WorkClass] = (),
        rate_limits: Iterable[RateLimit] = (),
        signer: RequestSigner | None = None,
        events: EventLog | None = None,
        metrics: WorkerMetrics | None = None,
        grace_seconds: float = 30.0,
        ownership_margin_seconds: float | None = None,
        store_timeout: float = 10.0,
        outcome_wait_seconds: float | None = None,
        poll_seconds: float = 1.0,
        http_timeout: float = 30.0,
        heartbeat_store: Callable[[], Awaitable[RenewingStore]] | None = None,
        require_synchronous_replication: bool = False,
        error_summary: ErrorSummary = default_error_summary,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.worker_id = worker_id or default_worker_id()
        self.tools = dict(tools)
        self.kinds = list(kinds) if kinds is not None else list(self.tools)
        missing = [k for k in self.kinds if k not in self.tools]
        if missing:
            raise ValueError(f"no tool for kind(s) {', '.join(missing)}")
        self.concurrency = concurrency
        self.work_classes = list(work_classes)
        self.rate_limits = list(rate_limits)
        self.signer = signer
        # By default every event is a JSON line on stderr, where a process supervisor or a
        # log shipper picks it up; EventLog() keeps them in memory only.
        self.events = events if events is not None else EventLog(sys.stderr)
        self.metrics = metrics if metrics is not None else default_metrics()
        self.grace_seconds = grace_seconds
        self.ownership_margin_seconds = ownership_margin_seconds
        self.store_timeout = store_timeout
        # How long a commit whose answers were lost keeps asking the store how it ended
        # (by default one more store timeout; a failover's length to ride one out).
        self.outcome_wait_seconds = (
            store_timeout if outcome_wait_seconds is None else outcome_wait_seconds
        )
        self.poll_seconds = poll_seconds
        # The line every operator sees about a failure (the message itself is payload-like).
        self.error_summary = error_summary
        self.http_timeout = http_timeout
        self._queue_arg = queue
        self._heartbeat_store = heartbeat_store
        # For the connections this worker opens from a URL (a given queue keeps its own).
        self.require_synchronous_replication = require_synchronous_replication
        self.queue: LeaseQueue | None = None
        self._owns_queue = False
        self._controller: HeartbeatController | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False
        self._running: dict[asyncio.Task[None], Execution] = {}
        # Tools started and not yet finished: what the concurrency bounds. A job whose tool
        # returned and whose commit is on its way no longer takes a slot.
        self._tools_busy = 0
        # Leases claimed ahead, waiting for a tool slot (first come, first served).
        self._waiting = 0
        self._slot_queue: collections.deque[asyncio.Future[bool]] = collections.deque()
        self._slot_freed: asyncio.Future[None] | None = None
        self._tool_tasks: dict[Execution, asyncio.Future[Any]] = {}
        self._shutting_down: set[Execution] = set()
        # Set at shutdown: past it nobody waits any longer to learn how a lost commit ended.
        self._outcome_cutoff = float("inf")

    # -- public ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Work until `stop()`; then finish or release what is running."""
        try:
            await self._start()
            await self._claim_loop(until_idle=False)
        finally:
            await self._shutdown()

    async def run_until_idle(self) -> None:
        """Work until nothing is claimable now and nothing is running (retries scheduled
        for later are left for later)."""
        try:
            await self._start()
            await self._claim_loop(until_idle=True)
        finally:
            await self._shutdown()

    def stop(self) -> None:
        """Stop claiming and shut down gracefully. Safe from any thread or signal handler."""
        self._stop_requested = True
        loop, stopping = self._loop, self._stopping
        if loop is None or stopping is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            stopping.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(stopping.set)

    # -- start and stop -------------------------------------------------------------------
    async def _start(self) -> None:
        # Traces only when OTEL_TRACES_EXPORTER (or the application's own provider) asks.
        tracing.configure(service_name="fencegate-worker")
        from fencegate.lease.queue import LeaseQueue

        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        if self._stop_requested:
            self._stopping.set()
        if isinstance(self._queue_arg, str):
            self.queue = await LeaseQueue.connect(
                self._queue_arg,
                timeout=self.store_timeout,
                require_synchronous_replication=self.require_synchronous_replication,
            )
            self._owns_queue = True
        else:
            self.queue = cast("LeaseQueue", self._queue_arg)
        self.metrics.declare(self.work_classes)
        for work_class in self.work_classes:
            self.queue.declare(work_class)
        for rate_limit in self.rate_limits:
            self.queue.declare_rate_limit(rate_limit)
        connect = self._heartbeat_store or self._default_heartbeat_store()
        self._controller = HeartbeatController(
            connect, events=self.events, metrics=self.metrics, worker_id=self.worker_id
        )
        await asyncio.to_thread(self._controller.start, timeout=self.store_timeout)
        self._session = aiohttp.ClientSession()
        self.events.emit(
            "worker_started", worker=self.worker_id, kinds=self.kinds, concurrency=self.concurrency
        )
        # The leases held at once are bounded (`_free_slots`): the collector's youngest
        # generation is made to hold their objects (`fencegate.lease.young_generation`).
        young_generation.enter(self, leases=4 * self.concurrency)

    def _default_heartbeat_store(self) -> Callable[[], Awaitable[RenewingStore]]:
        from fencegate.lease.queue import LeaseQueue

        url = self._queue_arg if isinstance(self._queue_arg, str) else None
        url = url or getattr(self._queue_arg, "url", None)
        if not url:
            raise ValueError(
                "the heartbeat needs its own connection: pass the queue URL, or heartbeat_store="
            )
        timeout = self.store_timeout
        require = self.require_synchronous_replication

        async def connect() -> RenewingStore:
            return await LeaseQueue.connect(
                str(url), timeout=timeout, require_synchronous_replication=require
            )

        return connect

    async def _shutdown(self) -> None:
        # Also runs after a failed start: each part is closed only if it was opened.
        young_generation.leave(self)
        self._refuse_waiting()
        running = dict(self._running)
        self._outcome_cutoff = time.monotonic() + self.grace_seconds
        if running:
            _, pending = await asyncio.wait(running, timeout=self.grace_seconds)
            for task in pending:
                execution = running[task]
                self._shutting_down.add(execution)
                tool_task = self._tool_tasks.get(execution)
                if tool_task is not None:
                    tool_task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=self.store_timeout * 2)
        if self._controller is not None:
            await asyncio.to_thread(self._controller.stop, timeout=self.store_timeout)
        if self._session is not None:
            await self._session.close()
        if self._owns_queue and self.queue is not None:
            with contextlib.suppress(Exception):
                await self.queue.close()
        self.events.emit("worker_stopped", worker=self.worker_id)
        await asyncio.to_thread(tracing.flush)

    # -- claiming -------------------------------------------------------------------------
    def _free_slots(self) -> int:
        """How many leases to claim now. Claiming ahead: up to ``concurrency`` leases wait,
        held and heartbeated, for a tool slot, so a slot that frees finds its next job here
        instead of waiting for a round trip. Leases still committing count too (commits are
        batched, so some queue behind the batch in flight), so a store that stops answering
        commits stops the claiming as well."""
        return min(
            2 * self.concurrency - self._tools_busy - self._waiting,
            4 * self.concurrency - len(self._running),
        )

    def _worth_claiming(self, free: int | None = None) -> bool:
        """Whether to claim now (``free``: `_free_slots()`, if known): only once half a
        concurrency of leases is free (one, for a worker of concurrency 1). Below that, more
        than half a concurrency of leases still waits for a tool slot (or the commits are
        behind), so no slot can idle meanwhile; and a claim of one or two jobs costs a whole
        round trip (a worker of concurrency 10 running short jobs claimed 19, then 1, then
        19, in turn)."""
        return (self._free_slots() if free is None else free) >= (self.concurrency + 1) // 2

    async def _claim_loop(self, *, until_idle: bool) -> None:
        assert self.queue is not None and self._stopping is not None
        stop_wait = asyncio.ensure_future(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                free = self._free_slots()
                claimed: list[Lease] = []
                # An empty claim proves the queue idle only if nothing of this worker's ran
                # while it was sent: a job that held its kind's last place made the claim
                # find nothing, and may have ended before the answer came.
                ran_meanwhile = bool(self._running)
                if self._worth_claiming(free):
                    sent_at = time.monotonic()
                    try:
                        claimed = await self.queue.claim(
                            self.worker_id, kinds=self.kinds, limit=free, timeout=self.store_timeout
                        )
                    except StoreUnavailable:
                        await asyncio.wait({stop_wait}, timeout=self.poll_seconds)
                        continue
                    # A batch comes back in job id order; the higher priorities start first.
                    for lease in sorted(claimed, key=lambda lease: -lease.priority):
                        self._launch(lease, sent_at)
                if claimed and self._worth_claiming():
                    continue  # there may be more ready work right now
                if until_idle and not claimed and not self._running:
                    if not ran_meanwhile:
                        return
                    continue  # a job ended during the claim: claim once more
                await self._wait_for_news(stop_wait)
        finally:
            stop_wait.cancel()

    async def _wait_for_news(self, stop_wait: asyncio.Future[Any]) -> None:
        """Until a slot frees, a job ends, work may be ready, stop(), or a poll period."""
        assert self._loop is not None
        slot = self._loop.create_future()
        self._slot_freed = slot
        # A job that ends resolves `slot` too (`_finished`): waiting on every running task
        # instead would add and remove a callback on each of them at every turn of this loop.
        waiters: set[asyncio.Future[Any]] = {stop_wait, slot}
        listener: asyncio.Task[Any] | None = None
        # Not while too few leases are free to claim: news of work would wake this loop for
        # nothing, again and again (the notification stays unseen until the next claim).
        if self._worth_claiming():
            listener = asyncio.ensure_future(self._wait_for_work())
            waiters.add(listener)
        try:
            await asyncio.wait(
                waiters, timeout=self.poll_seconds, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._slot_freed = None
            if listener is not None and not listener.done():
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await listener

    def _slot_now(self) -> bool | None:
        """A tool slot without waiting: True if one is free, False when the worker stops
        (the lease is given back unstarted), None when the lease must wait its turn."""
        if self._stopping is not None and self._stopping.is_set():
            self._waiting -= 1
            return False
        if self._tools_busy < self.concurrency and not self._slot_queue:
            self._waiting -= 1
            self._tools_busy += 1
            return True
        return None

    async def _wait_for_slot(self) -> bool:
        """Wait for a tool slot when none is free (`_slot_now` said None); False when the
        worker stops first (the lease is given back unstarted)."""
        assert self._loop is not None
        turn: asyncio.Future[bool] = self._loop.create_future()
        self._slot_queue.append(turn)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                if turn.result():
                    self._tool_done()  # handed a slot it will never use
            else:
                self._waiting -= 1
            raise

    def _tool_done(self) -> None:
        self._tools_busy -= 1
        while self._slot_queue:
            turn = self._slot_queue.popleft()
            if not turn.done():
                # The slot passes straight to the next lease claimed ahead.
                self._waiting -= 1
                self._tools_busy += 1
                turn.set_result(True)
                break
        self._news()

    def _news(self) -> None:
        """Wake the claim loop (a slot freed, or a job ended) once enough leases are free to
        claim: waking it for less would only send it back to wait, at every job's end."""
        slot = self._slot_freed
        if slot is not None and not slot.done() and self._worth_claiming():
            slot.set_result(None)

    def _refuse_waiting(self) -> None:
        # Stopping: leases still waiting for a slot are given back without running.
        while self._slot_queue:
            turn = self._slot_queue.popleft()
            if not turn.done():
                self._waiting -= 1
                turn.set_result(False)

    async def _wait_for_work(self) -> None:
        assert self.queue is not None
        with contextlib.suppress(TimeoutError, StoreUnavailable):
            await self.queue.wait_for_work(self.kinds, timeout=self.poll_seconds)

    def _launch(self, lease: Lease, sent_at: float) -> None:
        assert self._loop is not None
        execution = Execution(lease, confirmed_at=sent_at)
        self._waiting += 1
        # The loop kept from start: asyncio.ensure_future looks the running loop up (a
        # getpid() system call) for every job. Without tracing, the attempt is the task's
        # coroutine itself: a wrapper would be one more frame on every resume of it.
        attempt = self._attempt(execution) if tracing.TRACER is None else self._execute(execution)
        task = self._loop.create_task(attempt)
        self._running[task] = execution
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        execution = self._running.pop(task, None)
        self._news()
        if not task.cancelled() and task.exception() is not None and execution is not None:
            # The tool's own errors are handled in _settle; this is the worker failing.
            logger.error(
                "worker %s: handling job %s failed; its lease will expire",
                self.worker_id,
                execution.job_id,
                exc_info=task.exception(),
            )

    # -- one execution --------------------------------------------------------------------
    def margin_for(self, lease: Lease) -> float:
        """How much confirmed lease must remain to start a new external action."""
        if self.ownership_margin_seconds is not None:
            return self.ownership_margin_seconds
        return min(float(lease.heartbeat_seconds), float(lease.lease_seconds) / 4)

    async def _execute(self, execution: Execution) -> None:
        with lease_spans.attempt_span(execution.lease, worker_id=self.worker_id):
            await self._attempt(execution)

    def _outcome(self, job: JobContext, outcome: str) -> None:
        # The labels worked out at the claim (kind and model never change with a renewal):
        # not looked up again from the lease, through its lock, at every job's end.
        self.metrics.count_outcome(job.labels, outcome)
        if tracing.TRACER is not None:
            lease_spans.record_outcome(outcome)

    async def _attempt(self, execution: Execution) -> None:
        assert self.queue is not None and self._controller is not None
        lease = execution.lease
        kind = lease.kind
        margin = self.margin_for(lease)
        labels = self.metrics.labels_of(lease)  # (kind, provider, model)
        job = JobContext(
            execution,
            queue=self.queue,
            events=self.events,
            worker_id=self.worker_id,
            ownership_margin=margin,
            signer=self.signer,
            session=self._http_session,
            store_timeout=self.store_timeout,
            http_timeout=self.http_timeout,
            labels=labels,
        )
        job.emit(
            "job_claimed",
            attempt=lease.attempt,
            max_attempts=lease.max_attempts,
            lease_until=lease.lease_until,
            idempotency_key=lease.idempotency_key,
            payload_sha256=digest(lease.payload),
        )
        if lease.attempt > 1:
            self.metrics.reclaimed_jobs.labels(*labels).inc()
        self.metrics.live.add(labels, execution)
        loop = self._loop
        assert loop is not None
        tool: list[asyncio.Future[Any]] = []

        def cancel_from_controller() -> None:
            # Before the tool started there is nothing to cancel: the lost state is seen
            # when the lease's turn comes, and the tool is never started.
            for task in tool:
                with contextlib.suppress(RuntimeError):  # the loop closed: nothing to stop
                    loop.call_soon_threadsafe(task.cancel)

        # Renewed from the claim on: a lease waiting for its slot is held like any other.
        self._controller.register(
            execution, kind=kind, cancel=cancel_from_controller, margin=margin
        )
        try:
            # A free slot is taken here and now, without a coroutine of its own to wait in.
            slotted = self._slot_now()
            if slotted is None:
                slotted = await self._wait_for_slot()
        except BaseException:
            self._controller.unregister(execution)
            self.metrics.live.remove(execution)
            raise
        try:
            if not slotted or execution.state is Ownership.LOST:
                self._controller.unregister(execution)
                await self._unstarted(job, released=not slotted)
                return
            await self._run_tool_and_settle(job, tool)
        finally:
            self.metrics.live.remove(execution)
            self._shutting_down.discard(execution)

    async def _unstarted(self, job: JobContext, *, released: bool) -> None:
        """A lease whose tool never ran: given back at shutdown, or lost while it waited."""
        execution = job.execution
        if not released:
            job.emit("result_rejected", reason=execution.lost_reason, duration_seconds=0.0)
            self._outcome(job, "rejected")
            return
        given_back = await self._conditional(
            execution,
            lambda t: self._q().release(execution.lease, timeout=t),
            landed_as=_RELEASED,
        )
        job.emit("job_released", released=bool(given_back), duration_seconds=0.0)
        self._outcome(job, "released")

    async def _run_tool_and_settle(self, job: JobContext, tool: list[asyncio.Future[Any]]) -> None:
        assert self._controller is not None
        execution = job.execution
        lease = execution.lease
        started = time.monotonic()
        execution.start_tool(timeout=lease.tool_timeout_seconds, now=started)
        assert self._loop is not None
        tool_task = _start_tool(self.tools[job.kind], job, self._loop)
        tool.append(tool_task)
        self._tool_tasks[execution] = tool_task
        try:
            if not tool_task.done():
                await asyncio.wait({tool_task}, timeout=lease.tool_timeout_seconds)
            timed_out = not tool_task.done()
            if timed_out:
                tool_task.cancel()
                await asyncio.wait({tool_task})
        finally:
            self._controller.unregister(execution)
            self._tool_tasks.pop(execution, None)
            # The slot is free now: the next lease runs, and the claim loop takes more work,
            # while this one commits.
            self._tool_done()
        await self._settle(job, tool_task, timed_out=timed_out, duration=time.monotonic() - started)

    async def _settle(
        self, job: JobContext, tool_task: asyncio.Future[Any], *, timed_out: bool, duration: float
    ) -> None:
        execution = job.execution
        duration = round(duration, 3)
        result: Any = None
        error: BaseException | None = None
        if tool_task.cancelled():
            error = asyncio.CancelledError()
        else:
            error = tool_task.exception()
            if error is None:
                result = tool_task.result()

        if execution.state is Ownership.LOST or isinstance(error, OwnershipLost):
            execution.mark_lost(execution.lost_reason or "tool_saw_loss")
            job.emit(
                "result_rejected",
                reason=execution.lost_reason,
                result_sha256=digest(result) if error is None else None,
                error=type(error).__name__ if error is not None else None,
                duration_seconds=duration,
            )
            self._outcome(job, "rejected")
            return
        if timed_out:
            job.emit(
                "tool_timeout",
                timeout_seconds=job.lease.tool_timeout_seconds,
                duration_seconds=duration,
            )
            await self._fail(job, TimeoutError("tool timeout"), code="tool_timeout")
            return
        if isinstance(error, asyncio.CancelledError) and execution in self._shutting_down:
            released = await self._conditional(
                execution,
                lambda t: self._q().release(execution.lease, timeout=t),
                landed_as=_RELEASED,
            )
            job.emit("job_released", released=bool(released), duration_seconds=duration)
            self._outcome(job, "released")
            return
        if error is None:
            try:
                await self._complete(job, result, duration)
            except (TypeError, ValueError) as exc:
                # The store cannot hold this result (not JSON): retrying would not change it.
                await self._fail(job, exc, code="result_not_storable", permanent=True)
            return
        if isinstance(error, PermanentError):
            await self._fail(job, error, code="permanent", permanent=True)
            return
        job.emit(
            "tool_failed",
            error=type(error).__name__,
            # A tool's message may quote its payload; the log gets a hash to match it with
            # the job's stored error, never the text.
            detail_sha256=digest(str(error)) if str(error) else None,
            duration_seconds=duration,
            ownership_unknown=isinstance(error, OwnershipUnknown) or None,
        )
        await self._fail(job, error, code=type(error).__name__)

    def _q(self) -> LeaseQueue:
        assert self.queue is not None
        return self.queue

    async def _complete(self, job: JobContext, result: Any, duration: float) -> None:
        execution = job.execution
        committed = await self._conditional(
            execution,
            lambda t: self._q().complete(execution.lease, result, timeout=t),
            landed_as=_SUCCEEDED,
        )
        if committed:
            job.emit("result_committed", result_sha256=digest(result), duration_seconds=duration)
            self._outcome(job, "succeeded")
            return
        job.emit(
            "result_rejected",
            reason="ownership_unknown" if committed is None else "zero_rows",
            result_sha256=digest(result),
            duration_seconds=duration,
        )
        self._outcome(job, "rejected")

    async def _fail(
        self, job: JobContext, error: BaseException, *, code: str, permanent: bool = False
    ) -> None:
        execution = job.execution
        record = error_record(error, self.error_summary)
        accepted = await self._conditional(
            execution,
            lambda t: self._q().fail(execution.lease, record, permanent=permanent, timeout=t),
            landed_as=_FAILED,
        )
        if not accepted:
            job.emit(
                "result_rejected",
                reason="ownership_unknown" if accepted is None else "zero_rows",
                error=code,
            )
            self._outcome(job, "rejected")
            return
        # Known here without asking the store (a later read could already see what the next
        # owner did with the retry): the same rule the queue applied to this call.
        if fails_for_good(job.lease.attempt, job.lease.max_attempts, permanent=permanent):
            job.emit(
                "job_failed",
                error=code,
                permanent=permanent or None,
                attempt=job.attempt,
                max_attempts=job.lease.max_attempts,
            )
            self._outcome(job, "failed")
            return
        run_after = None
        with contextlib.suppress(Exception):
            run_after = (await self._q().get(job.id, timeout=self.store_timeout)).run_after
        job.emit("retry_scheduled", error=code, attempt=job.attempt, run_after=run_after)
        self._outcome(job, "retry")

    async def _conditional(
        self,
        execution: Execution,
        call: Callable[[float], Awaitable[bool]],
        *,
        landed_as: frozenset[str],
    ) -> bool | None:
        """Run a conditional write (complete/fail/release). True/False as the store answers.
        When an answer was lost, the attempt's own record says whether the write landed;
        None when the store could not say so in time."""
        tries = 0
        while True:
            tries += 1
            timeout = max(0.25, min(self.store_timeout, execution.remaining()))
            try:
                accepted = await call(timeout)
            except (StoreUnavailable, TimeoutError):
                if execution.remaining() <= 0:
                    execution.mark_lost("ownership_unknown_past_lease")
                    # A try may have landed (a failover can lose a commit's answer, not the
                    # commit): once the store answers, the attempt's record says so. Only a
                    # record that shows it turns "unknown" into "landed".
                    return await self._landed(execution, landed_as) or None
                await asyncio.sleep(min(0.5, max(0.05, execution.remaining() / 4)))
                continue
            if accepted or tries == 1:
                return bool(accepted)
            # An earlier try may have landed although its answer was lost.
            return await self._landed(execution, landed_as)

    async def _landed(self, execution: Execution, outcomes: frozenset[str]) -> bool | None:
        """Whether this attempt ended as one of ``outcomes``, from its own record (a job
        cancelled, or failed by an expired lease, in the meantime still carries this token but
        was not ended by us). Asked until the store answers, for up to ``outcome_wait_seconds``;
        None if it never did."""
        deadline = min(time.monotonic() + self.outcome_wait_seconds, self._outcome_cutoff)
        while True:
            timeout = max(0.25, min(self.store_timeout, deadline - time.monotonic()))
            try:
                history = await self._q().attempts(execution.job_id, timeout=timeout)
            except StoreClosed:
                return None  # this process closed its queue: nobody left to ask
            except (StoreUnavailable, TimeoutError):
                if time.monotonic() >= min(deadline, self._outcome_cutoff):
                    return None
                await asyncio.sleep(0.2)
                continue
            except Exception:
                # Not an outage (the queue closed under a shutdown, a bug): unknown, said once.
                logger.exception("could not read job %s's attempts", execution.job_id)
                return None
            return any(
                attempt.fencing_token == execution.fencing_token and attempt.outcome in outcomes
                for attempt in history
            )

    def _http_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the worker is not running")
        return self._session


def run_worker(*workers: Worker) -> None:
    """Run workers until SIGTERM or SIGINT, then shut them down gracefully: stop claiming,
    let running tools finish within each worker's grace, release the rest."""
    if not workers:
        raise ValueError("run_worker needs at least one worker")

    def stop_all() -> None:
        for worker in workers:
            worker.stop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_all)
        try:
            await asyncio.gather(*(worker.run() for worker in workers))
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    asyncio.run(main())


def _start_tool(
    tool: Tool, job: JobContext, loop: asyncio.AbstractEventLoop
) -> asyncio.Future[Any]:
    """The tool's outcome as a future. A plain function runs here and now: it holds the loop
    until it returns, so a task of its own could neither time it out nor cancel it, and would
    cost a task, its scheduling and a wait per job. A coroutine (an ``async def`` tool, or an
    awaitable a plain function returns) runs in a task of its own, which the timeout, the
    heartbeat's loss of the lease and the shutdown cancel. ``loop``: the running loop, as
    the caller kept it (looking it up costs a getpid() system call)."""
    outcome: asyncio.Future[Any] = loop.create_future()
    try:
        result = tool(job)
    except asyncio.CancelledError:
        outcome.cancel()
        return outcome
    except StopIteration as exc:
        # As a coroutine would have it: a future cannot carry StopIteration.
        outcome.set_exception(RuntimeError(f"tool raised StopIteration: {exc!r}"))
        return outcome
    except Exception as exc:
        outcome.set_exception(exc)
        return outcome
    if inspect.isawaitable(result):
        # A coroutine becomes a task directly (no wrapping coroutine per job); a future the
        # tool returned is waited on, and cancelled, as it is.
        return (
            loop.create_task(result)
            if inspect.iscoroutine(result)
            else asyncio.ensure_future(result)
        )
    outcome.set_result(result)
    return outcome
