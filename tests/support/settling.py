"""The people in the no-double-send stories (issue 25): a client that sends a keyed request
again until it has its answer, and an operator who follows a 424's instructions with the real
`fencegate keys resolve`; plus reading a story's keys from either store and pausing a gateway.

The operator does what the 424 says: waits until the time it names as safe for settling the
key by hand (``release_safe_from``: no copy of the request can still be on its way), reads the
upstream's execution log (`UpstreamProcess.answers`), then records the answer the upstream
gave (``--completed``) where it ran the key, or releases the key (``--release``) where it did
not. When the command refuses anyway, the log is read again before acting: a decision made on
a read from before releasing was safe may be wrong.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from fencegate.problems import PROBLEM_TYPE_BASE
from fencegate.store.dburl import parse_database_url
from tests.support.processes import child_env
from tests.support.upstream import UpstreamProcess

TENANT = "default"  # the tenant of a gateway without signatures
BODY = b'{"amount": 1250, "currency": "EUR"}'
# Clients wait what Retry-After says, but no more than this: the stories' leases are short.
MAX_RETRY_WAIT = 0.5
# Operator commands running at once (each is a Python process start on a small machine).
OPERATOR_PARALLEL = 4


def problem_type(response: httpx.Response) -> str | None:
    """The RFC 9457 problem type of an error answer (``outcome-unknown``), else None."""
    if not response.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    kind = str(response.json().get("type", ""))
    return kind.removeprefix(PROBLEM_TYPE_BASE) if kind.startswith(PROBLEM_TYPE_BASE) else None


def answer_name(response: httpx.Response) -> str:
    """``200``, ``503 outcome-pending``: what a client was told, for the tallies."""
    kind = problem_type(response)
    return f"{response.status_code} {kind}" if kind else str(response.status_code)


async def send_keyed(
    client: httpx.AsyncClient, base: str, key: str, *, timeout: float = 30.0
) -> httpx.Response:
    return await client.post(
        base + "/v1/charges",
        content=BODY,
        headers={"content-type": "application/json", "Idempotency-Key": key},
        timeout=timeout,
    )


@dataclass
class Tally:
    """What happened in a story, for its assertions and its report."""

    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    resolutions: collections.Counter[str] = field(default_factory=collections.Counter)
    refusals: collections.Counter[str] = field(default_factory=collections.Counter)
    # Keys answered 424 while the upstream had never run them (a false 424).
    false_unknown: list[str] = field(default_factory=list)
    # Seconds operators waited for the time the 424 says settling by hand is safe from.
    waits: list[float] = field(default_factory=list)

    def summary(self) -> str:
        waited = f", waited up to {max(self.waits):.1f} s for safe" if self.waits else ""
        return (
            f"answers {dict(self.answers)}, resolutions {dict(self.resolutions)}, "
            f"refusals {dict(self.refusals)}{waited}"
        )


class Operator:
    """Resolves the keys clients were told are unknown, with `fencegate keys resolve`."""

    def __init__(
        self,
        database_url: str,
        upstream: UpstreamProcess,
        tally: Tally,
        *,
        workdir: Path,
        release_margin: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.database_url = database_url
        self.upstream = upstream
        self.tally = tally
        self.workdir = workdir
        self.release_margin = release_margin
        self.env = dict(env or {})
        self._running = asyncio.Semaphore(OPERATOR_PARALLEL)
        self._settling: dict[str, asyncio.Task[str]] = {}

    async def settle(
        self, key: str, problem: dict[str, Any] | None = None, *, timeout: float
    ) -> str:
        """Resolve ``key`` as its 424 (``problem``) says, once: concurrent callers share the
        one resolution. Returns ``completed``, ``released``, or ``gone`` (released meanwhile
        by its gateway)."""
        task = self._settling.get(key)
        if task is None or (task.done() and task.exception() is not None):
            task = self._settling[key] = asyncio.ensure_future(
                self._settle(key, problem or {}, timeout)
            )
        return await asyncio.shield(task)

    async def _settle(self, key: str, problem: dict[str, Any], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        # The 424 says from when settling by hand is safe: from then on no copy of the
        # request can still be on its way, so the upstream's log is read only then (a read
        # before it could miss a copy that arrives later).
        safe_from = problem.get("release_safe_from")
        if safe_from:
            wait = datetime.fromisoformat(safe_from).timestamp() - time.time()
            self.tally.waits.append(max(wait, 0.0))
            await asyncio.sleep(max(wait, 0.0))
        last = ""
        while time.monotonic() < deadline:
            # The log is read right before the command runs, not before waiting for a turn.
            async with self._running:
                args, outcome = await self._what_the_log_says(key)
                done = await self._run(key, *args) if args else None
            if done is None:
                last = f"the upstream is running {key!r} now"
                await asyncio.sleep(0.1)
                continue
            if done.returncode == 0:
                self.tally.resolutions[outcome] += 1
                return outcome
            if f"no key {key!r}" in done.stderr:
                self.tally.resolutions["found nothing"] += 1
                return "gone"
            # Refused (not safe yet): the log is read again before acting.
            last = done.stderr.strip()
            self.tally.refusals[refusal_reason(last)] += 1
            await asyncio.sleep(0.3)
        raise AssertionError(f"the operator could not resolve {key!r} in {timeout}s: {last}")

    async def _what_the_log_says(self, key: str) -> tuple[list[str], str]:
        """The resolve arguments the upstream's log calls for (none while it runs the key)."""
        log = await self.upstream.aanswers(key)
        if await self.upstream.acount(key) > len(log):
            return [], ""  # counted on arrival, logged once answered: it is running now
        if not log:
            return ["--release"], "released"
        body = self.workdir / f"answer-{hashlib.sha256(key.encode()).hexdigest()}.json"
        body.write_text(log[0]["body"], encoding="utf-8")
        return ["--completed", "--status", str(log[0]["status"]), "--body", f"@{body}"], (
            "completed"
        )

    async def _run(self, key: str, *args: str) -> CommandResult:
        command = [
            sys.executable, "-m", "fencegate.cli", "keys", "resolve", key, "--tenant", TENANT,
            "--database-url", self.database_url, *args, "--by", "story-operator",
            "--reason", "followed the 424",
        ]  # fmt: skip
        if self.release_margin is not None:
            command += ["--release-margin", f"{self.release_margin:g}"]
        proc = await asyncio.create_subprocess_exec(
            *command,
            cwd=self.workdir,
            env=child_env(self.env),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        assert proc.returncode is not None
        return CommandResult(proc.returncode, out.decode(), err.decode())


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


# What `keys resolve` says when the release rule refuses, and the rule's name for it.
REFUSALS = {
    "live lease": "lease_live",
    "is alive": "owner_alive",
    "release margin": "release_margin",
    "nothing to release": "not_unknown",
}


def refusal_reason(stderr: str) -> str:
    """A short name for why `keys resolve` refused, for the tallies."""
    for words, reason in REFUSALS.items():
        if words in stderr:
            return reason
    return stderr.strip().splitlines()[-1][:80] if stderr.strip() else "no message"


async def until_answered(
    client: httpx.AsyncClient,
    base: str,
    key: str,
    tally: Tally,
    *,
    on_unknown: Callable[[str, dict[str, Any]], Awaitable[object]],
    ran: Callable[[str], Awaitable[int]],
    timeout: float,
    max_wait: float = MAX_RETRY_WAIT,
) -> httpx.Response:
    """Send the keyed request until it is answered 200: waiting on 409 and 503 (what they
    ask, up to ``max_wait`` seconds), and on 424 calling ``on_unknown`` with the key and the
    424's body (the operator). A 424 for a key the upstream never ran is noted in
    ``tally.false_unknown``."""
    deadline = time.monotonic() + timeout
    while True:
        response = await send_keyed(client, base, key)
        tally.answers[answer_name(response)] += 1
        if response.status_code == 200:
            return response
        if time.monotonic() > deadline:
            raise AssertionError(f"{key!r} still unanswered after {timeout}s: {response.text}")
        if response.status_code == 424:
            if await ran(key) == 0:
                tally.false_unknown.append(key)
            await on_unknown(key, response.json())
            continue
        assert response.status_code in (409, 503), (response.status_code, response.text)
        wait = float(response.headers.get("retry-after", "1"))
        await asyncio.sleep(min(wait, max_wait))


# ------------------------------------------------------------------------ the store's view


@dataclass(frozen=True)
class Row:
    key: str
    state: str
    owner: str | None
    expired: bool  # locked_until has passed, by the database clock


class KeyRows:
    """The story's keys as the store has them, read straight from either store."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.target = parse_database_url(database_url)
        self._pg: asyncpg.Connection | None = None

    async def __aenter__(self) -> KeyRows:
        if self.target.kind == "postgresql":
            self._pg = await asyncpg.connect(self.database_url, timeout=10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pg is not None:
            await self._pg.close()

    async def rows(self, keys: Sequence[str]) -> dict[str, Row]:
        if self._pg is not None:
            found = await self._pg.fetch(
                "SELECT key, state, owner, coalesce(locked_until <= now(), true) AS expired"
                " FROM fencegate_idempotency_keys WHERE tenant = $1 AND key = ANY($2::text[])",
                TENANT,
                list(keys),
                timeout=10,
            )
            return {r["key"]: Row(r["key"], r["state"], r["owner"], r["expired"]) for r in found}
        return await asyncio.to_thread(self._sqlite_rows, list(keys))

    def _sqlite_rows(self, keys: list[str]) -> dict[str, Row]:
        path = self.target.sqlite_path
        assert path is not None
        with sqlite3.connect(path, timeout=10) as db:
            found = db.execute(
                "SELECT key, state, owner, coalesce(locked_until <= ?, 1)"
                " FROM fencegate_idempotency_keys WHERE tenant = ?"
                " AND key IN (SELECT value FROM json_each(?))",
                (time.time(), TENANT, json.dumps(keys)),
            ).fetchall()
        return {k: Row(k, state, owner, bool(expired)) for k, state, owner, expired in found}


# ------------------------------------------------------------------------ pausing a process


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


async def wait_stopped(pid: int, *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped after {timeout}s")
        await asyncio.sleep(0.001)


def sqlite_write_lock_free(path: Path) -> bool:
    """Whether a writer could start now (nobody holds SQLite's write lock)."""
    db = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()


async def pause(pid: int, database_url: str, *, tries: int = 100) -> int:
    """SIGSTOP the process. On SQLite, a process stopped inside a write transaction holds
    the file's write lock until it resumes and every other writer (the other gateway, the
    operator) waits: the story stops it outside one, letting it run a moment and stopping
    it again. Returns how many extra stops that took."""
    path = parse_database_url(database_url).sqlite_path
    for attempt in range(tries):
        os.kill(pid, signal.SIGSTOP)
        await wait_stopped(pid)
        if path is None or await asyncio.to_thread(sqlite_write_lock_free, path):
            return attempt
        os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(0.002)  # let it finish its transaction
    raise AssertionError(f"process {pid} held SQLite's write lock at each of {tries} stops")


def gateway_of(owner: str | None) -> str:
    """The gateway process that holds a reservation (its owner is ``instance/n``)."""
    return (owner or "").split("/", 1)[0]


def pid_of_instance(instance: str) -> int:
    """A gateway instance is ``host:pid:uuid8``."""
    return int(instance.split(":")[-2])


def describe_rows(rows: dict[str, Row]) -> dict[str, Any]:
    return {k: (r.state, gateway_of(r.owner), r.expired) for k, r in rows.items()}
