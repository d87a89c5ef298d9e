"""`fencegate demo`: the whole story of a stale worker, on the embedded store, with no set-up.

One process tree, all on loopback:

- a fake payment API (uvicorn, a real socket) that executes every capture it receives;
- the real gateway in front of it (a `fencegate serve` subprocess);
- worker W1 and worker W2, each on its own thread with its own event loop, sharing one
  SQLite lease queue in a temporary directory.

W1 claims the capture job and sends the capture. While the capture is in flight, W1 is
partitioned from the store: SQLite is a local file with no connection to cut, so every store
call W1 makes (heartbeats, commit) hangs until its own timeout and fails, exactly as a
driver behind a network partition would (`fencegate.lease.testing.PartitionedStore`).
W1's lease runs out; W2 claims with a larger token and retries the capture with the same
idempotency key; the gateway replays the stored answer. The partition heals and W1 tries
everything an old owner could try: renew, commit, and send again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import aiohttp
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fencegate.lease import LeaseQueue, PermanentError
from fencegate.lease.events import Event, EventLog
from fencegate.lease.execution import OwnershipError
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.testing import PartitionedStore, PartitionSwitch
from fencegate.lease.worker import Worker

KIND = "capture_payment"
INVOICE = "inv-1042"
AMOUNT_CENTS = 4200
JOB_KEY = f"payment:{INVOICE}"
STEP = "capture"
LEASE_SECONDS, HEARTBEAT_SECONDS, JITTER_SECONDS = 2.0, 0.5, 0.5
CAPTURE_SECONDS = 0.6  # how long the payment API takes: the capture is "in flight" meanwhile


# -- the fake payment API ----------------------------------------------------------------------
class PaymentAPI:
    """A legacy API that does not deduplicate: every capture it receives is executed."""

    def __init__(self) -> None:
        self.captures: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.app = Starlette(
            routes=[Route("/payments/{invoice}/capture", self.capture, methods=["POST"])]
        )

    async def capture(self, request: Request) -> JSONResponse:
        body = await request.json()
        with self._lock:
            capture = {
                "capture_id": f"cap_{len(self.captures) + 1:04d}",
                "invoice": request.path_params["invoice"],
                "amount_cents": body.get("amount_cents"),
                "fence": request.headers.get("x-execution-fence"),
            }
            self.captures.append(capture)
        await asyncio.sleep(CAPTURE_SECONDS)
        return JSONResponse(capture, status_code=201)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, *, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the gateway exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout:g}s")


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int) -> Iterator[str]:
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="payment-api", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the payment API did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def gateway_process(upstream: str, workdir: Path) -> Iterator[str]:
    port = free_port()
    log = (workdir / "gateway.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fencegate.cli",
            "serve",
            "--upstream",
            upstream,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database-url",
            f"sqlite:///{workdir / 'gateway.db'}",
            "--log-level",
            "warning",
        ],
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=20, process=process)
        yield f"http://127.0.0.1:{port}"
    except BaseException:
        log.flush()
        sys.stderr.write((workdir / "gateway.log").read_text(errors="replace"))
        raise
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


# -- workers on their own threads --------------------------------------------------------------
class WorkerThread:
    """A Worker on its own thread and event loop."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=worker.worker_id, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            await self.worker.run()

        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by the demo, never swallowed
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def call(self, coro_fn: Callable[[], Any], *, timeout: float) -> Any:
        """Run a coroutine on this worker's loop (its own connections live there)."""
        deadline = time.monotonic() + timeout
        while self._loop is None:
            if time.monotonic() > deadline:
                raise TimeoutError("worker loop not running")
            time.sleep(0.01)
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout)

    def stop(self, *, timeout: float) -> None:
        self.worker.stop()
        self._thread.join(timeout)


@dataclass
class Story:
    started: float = field(default_factory=time.monotonic)
    lines: list[tuple[float, str, str]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    jobs: dict[str, JobContext] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, who: str, text: str) -> None:
        with self.lock:
            self.lines.append((time.monotonic() - self.started, who, text))

    def on_event(self, event: Event) -> None:
        self.note(str(event.get("worker", "")).upper(), describe(event))


def describe(e: Event) -> str:
    name = str(e["event"])
    parts = [f"{name:<20}"]
    if "job" in e:
        parts.append(f"job={e['job']}")
    if "token" in e:
        parts.append(f"token={e['token']}")
    details = {
        "job_claimed": ("attempt", "lease_until"),
        "heartbeat_ok": ("lease_until",),
        "heartbeat_failed": ("error", "consecutive"),
        "ownership_unknown": ("last_confirmed_lease_until", "remaining_seconds"),
        "heartbeat_lost": ("reason", "job_state", "current_owner", "current_token"),
        "tool_request_started": ("method", "url", "idempotency_key"),
        "result_committed": ("result_sha256",),
        "result_rejected": ("reason", "result_sha256"),
        "tool_failed": ("error",),
    }.get(name, ())
    for key in details:
        if key in e:
            value = e[key]
            if key == "url":
                value = urlsplit(str(value)).path
            elif key.endswith("lease_until"):
                value = _clock(str(value))
            elif key.endswith("sha256"):
                value = str(value)[:19] + "…"
            parts.append(f"{key}={value}")
    hint = HINTS.get(name)
    if name == "job_claimed" and int(e.get("attempt", 1)) > 1:
        hint = "a new owner with a larger token: the old owner's fence is now stale"
    return " ".join(parts) + (f"\n{'':16}↳ {hint}" if hint else "")


HINTS = {
    "heartbeat_failed": "the store did not answer the renewal in time",
    "ownership_unknown": "W1 cannot confirm its lease: its guard refuses new external actions",
    "heartbeat_lost": "the lease is gone: the tool is cancelled and nothing is committed",
    "result_rejected": "not committed: the result survives only as a hash in this log",
    "result_committed": "committed under the current token",
}


def _clock(value: str) -> str:
    with contextlib.suppress(ValueError):
        return dt.datetime.fromisoformat(value).strftime("%H:%M:%S.%f")[:-3]
    return value


def make_tool(gateway: str, story: Story) -> Callable[[JobContext], Any]:
    async def capture_payment(job: JobContext) -> dict[str, Any]:
        story.jobs[job.worker_id] = job
        url = f"{gateway}/payments/{job.payload['invoice']}/capture"
        response = await job.http().post(
            url, json={"amount_cents": job.payload["amount_cents"]}, step=STEP
        )
        body = await response.json(content_type=None)
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        story.answers.append(
            {"worker": job.worker_id, "status": response.status, "replayed": replayed, **body}
        )
        story.note(
            job.worker_id.upper(),
            f"{'gateway answered':<20} {response.status} capture_id={body.get('capture_id')}"
            + (" (Idempotent-Replayed: true, the payment API was not called)" if replayed else ""),
        )
        if response.status >= 400:
            raise PermanentError(f"payment API answered {response.status}")
        return {"capture_id": body["capture_id"], "replayed": replayed}

    return capture_payment


# -- the story ---------------------------------------------------------------------------------
async def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo stuck waiting for {what}")
        await asyncio.sleep(0.02)


async def run_demo(out: TextIO, *, workdir: Path) -> bool:
    story = Story()
    events = EventLog(story.on_event)
    store_url = f"sqlite:///{workdir / 'queue.db'}"
    queue = await LeaseQueue.connect(store_url)
    await queue.migrate()
    api = PaymentAPI()
    with (
        serve_in_thread(api.app, free_port()) as api_url,
        gateway_process(api_url, workdir) as gateway_url,
    ):
        job_id = await queue.enqueue(
            KIND,
            {"invoice": INVOICE, "amount_cents": AMOUNT_CENTS},
            idempotency_key=JOB_KEY,
            lease_seconds=LEASE_SECONDS,
            heartbeat_seconds=HEARTBEAT_SECONDS,
            jitter_seconds=JITTER_SECONDS,
        )
        _header(out, workdir, api_url, gateway_url, job_id)
        tool = make_tool(gateway_url, story)
        switch = PartitionSwitch()

        async def w1_heartbeat_store() -> PartitionedStore:
            return PartitionedStore(await LeaseQueue.connect(store_url), switch)

        def worker(name: str, store: Any, heartbeat_store: Any = None) -> Worker:
            return Worker(
                store,
                tools={KIND: tool},
                worker_id=name,
                events=events,
                metrics=WorkerMetrics(registry=CollectorRegistry()),
                heartbeat_store=heartbeat_store,
                store_timeout=1.0,
                poll_seconds=0.2,
                grace_seconds=2.0,
            )

        w1_queue = await LeaseQueue.connect(store_url)
        w1 = WorkerThread(worker("w1", PartitionedStore(w1_queue, switch), w1_heartbeat_store))
        w2: WorkerThread | None = None
        try:
            w1.start()
            await wait_for(
                lambda: bool(events.named("tool_request_started")), timeout=15, what="W1"
            )
            switch.partition()
            story.note("--", "W1 is cut off from the store; its capture is still in flight")
            await wait_for(
                lambda: bool(events.named("result_rejected")), timeout=15, what="W1 giving up"
            )
            w2 = WorkerThread(worker("w2", store_url))
            w2.start()
            await wait_for(lambda: bool(events.named("result_committed")), timeout=15, what="W2")
            switch.heal()
            story.note("--", "the partition heals: W1 can reach the store again")
            late = await _w1_wakes_up(w1, story, gateway_url, job_id)
        finally:
            w1.stop(timeout=10)
            if w2 is not None:
                w2.stop(timeout=10)
            await w1_queue.close()
        job = await queue.get(job_id)
        history = await queue.attempts(job_id)
    await queue.close()
    return _report(out, story, api, job, history, late)


async def _w1_wakes_up(
    w1: WorkerThread, story: Story, gateway_url: str, job_id: int
) -> dict[str, Any]:
    job = story.jobs["w1"]
    lease = job.lease
    w1_queue = w1.worker.queue
    assert w1_queue is not None
    renewed = w1.call(lambda: w1_queue.extend(lease, timeout=5), timeout=10)
    outcome = "lost (no longer the owner)" if renewed is None else "renewed"
    story.note("W1", f"{'extend':<20} token={lease.fencing_token} -> {outcome}")
    committed = w1.call(
        lambda: w1_queue.complete(lease, {"capture_id": "cap_0001"}, timeout=5), timeout=10
    )
    story.note("W1", f"{'complete':<20} token={lease.fencing_token} -> {committed}")
    try:
        job.guard()
        refused = "no"
    except OwnershipError as exc:
        refused = f"{type(exc).__name__} ({exc.detail})"
    story.note("W1", f"{'fenced client':<20} refuses to send: {refused}")
    # The guard stops W1 from sending anything new. What it cannot stop is a request that
    # was already on the wire: send exactly what W1 would have sent, as it would arrive.
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{gateway_url}/payments/{INVOICE}/capture",
            json={"amount_cents": AMOUNT_CENTS},
            headers={
                "Idempotency-Key": job.step_key(STEP),
                "X-Execution-Fence": str(lease.fencing_token),
                "X-Execution-Entity": job.default_entity,
            },
        ) as response:
            problem = await response.json(content_type=None)
            status = response.status
    story.note(
        "W1",
        f"{'late request':<20} fence={lease.fencing_token} -> {status} "
        f"{str(problem.get('type', '')).rsplit('/', 1)[-1]}"
        + (
            f" (last accepted fence {problem['last_accepted_fence']})"
            if "last_accepted_fence" in problem
            else ""
        ),
    )
    return {
        "renewed": renewed,
        "committed": committed,
        "refused": refused != "no",
        "status": status,
        "token": lease.fencing_token,
    }


def _header(out: TextIO, workdir: Path, api_url: str, gateway_url: str, job_id: int) -> None:
    out.write(
        "fencegate demo: a stale worker meets the gateway\n\n"
        f"  store        SQLite lease queue in {workdir}\n"
        f"  payment API  {api_url}  (fake; executes every capture it receives, "
        f"takes {CAPTURE_SECONDS:g}s)\n"
        f"  gateway      {gateway_url}  (fencegate serve, in front of the payment API)\n"
        f"  job {job_id}        {KIND} {INVOICE} {AMOUNT_CENTS} cents, key {JOB_KEY}, "
        f"lease {LEASE_SECONDS:g}s, heartbeat {HEARTBEAT_SECONDS:g}s\n\n"
        "How W1 is cut off: SQLite is a local file with no connection to cut, so every store\n"
        "call W1 makes (heartbeats, commit) hangs until its own timeout and then fails, as a\n"
        "database behind a network partition would. W2 and the gateway reach their stores.\n\n"
    )
    out.flush()


def _report(
    out: TextIO,
    story: Story,
    api: PaymentAPI,
    job: Any,
    history: list[Any],
    late: dict[str, Any],
) -> bool:
    out.write("What happened (seconds since start):\n")
    for at, who, text in sorted(story.lines, key=lambda line: line[0]):
        out.write(f"  {at:6.2f}s  {who:<3} {text}\n")
    out.write("\nAttempts on the job (database clock):\n")
    for a in history:
        out.write(
            f"  attempt {a.attempt}  token {a.fencing_token}  owner {a.owner_id}  "
            f"claimed {a.claimed_at:%H:%M:%S.%f}"[:-3]
            + f"  outcome {a.outcome}\n"
        )
    captures = len(api.captures)
    w2_answers = [a for a in story.answers if a["worker"] == "w2"]
    ok = (
        captures == 1
        and job.state == "succeeded"
        and job.owner_id == "w2"
        and late["renewed"] is None
        and late["committed"] is False
        and late["refused"]
        and late["status"] == 412
        and bool(w2_answers)
        and all(a["replayed"] for a in w2_answers)
    )
    w2_token = job.fencing_token
    verdict = (
        f"{captures} capture executed; W1 (token {late['token']}) fenced off with "
        f"{late['status']}; W2 (token {w2_token}) committed the replayed result "
        f"{job.result.get('capture_id') if isinstance(job.result, dict) else job.result}"
    )
    out.write(f"\nVerdict: {verdict}\n" if ok else f"\nVerdict: FAILED: {verdict}\n")
    out.flush()
    return ok


def main(out: TextIO | None = None) -> int:
    stream = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="fencegate-demo-") as tmp:
        ok = asyncio.run(run_demo(stream, workdir=Path(tmp)))
    return 0 if ok else 1
