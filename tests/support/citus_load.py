"""Keyed, fenced load through a gateway, for the Citus tier's shard move and node kill: per
tenant a few clients, each sending new keys one after another with a rising fence on an
entity of its own, and retrying each key (the same request, signed afresh) on a 503 or a
lost connection until it has its answer, as a careful client does. Every answer is kept, so
that a test can check that no key ran twice, none was lost, and which statuses were seen
when."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx

from fencegate.signing import HttpSigner

PATH = "/v1/charges"
# The clients' own pace between retries of one key (not a wait for a condition).
RETRY_PAUSE = 0.05
CLIENT_TIMEOUT = 30.0


@dataclass
class Seen:
    tenant: str
    status: int
    at: float
    error: str = ""  # with status 0: what the client saw instead of an answer


@dataclass
class LoadResult:
    answers: dict[str, dict[str, object]] = field(default_factory=dict)  # key -> final body
    tenant_of: dict[str, str] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)

    def statuses(
        self, tenant: str, since: float = 0.0, until: float = float("inf")
    ) -> Counter[int]:
        return Counter(s.status for s in self.seen if s.tenant == tenant and since <= s.at < until)

    def errors(self, tenant: str) -> list[str]:
        """What the tenant's clients saw where no answer came (status 0)."""
        return [s.error for s in self.seen if s.tenant == tenant and s.status == 0]


class Load:
    def __init__(
        self, base_url: str, signers: dict[str, HttpSigner], *, clients_per_tenant: int = 2
    ) -> None:
        self.base_url = base_url
        self.signers = signers
        self.clients_per_tenant = clients_per_tenant
        self.result = LoadResult()
        # Keys and entities of this run alone (a gateway may serve several runs).
        self.run = uuid.uuid4().hex[:6]
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for tenant in self.signers:
            for n in range(self.clients_per_tenant):
                self._tasks.append(asyncio.create_task(self._client(tenant, n)))

    async def stop(self, *, timeout: float = 120.0) -> LoadResult:
        """Stop sending new keys; every key begun is retried to its answer (or timeout)."""
        self._stop.set()
        done, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()
        return self.result

    def answered(self, tenant: str) -> int:
        return sum(1 for t in self.result.tenant_of.values() if t == tenant)

    async def _client(self, tenant: str, n: int) -> None:
        signer = self.signers[tenant]
        entity = f"account:{tenant}:{self.run}:{n}"
        fence = 0
        # A client's patience, not a bound of the gateway's (its store deadline is 2 s).
        async with httpx.AsyncClient(base_url=self.base_url, timeout=CLIENT_TIMEOUT) as client:
            while not self._stop.is_set():
                fence += 1
                key = f"{tenant}:{self.run}:{n}:{fence}"
                body = b'{"amount":100}'
                while True:
                    headers = {
                        "Idempotency-Key": key,
                        "X-Execution-Fence": str(fence),
                        "X-Execution-Entity": entity,
                        "Content-Type": "application/json",
                    }
                    signer.sign("POST", self.base_url + PATH, headers, body)
                    error = ""
                    try:
                        response = await client.post(PATH, headers=headers, content=body)
                        status = response.status_code
                    except httpx.TransportError as exc:
                        status = 0  # no answer: the same key again
                        error = f"{type(exc).__name__}: {exc}"
                    self.result.seen.append(Seen(tenant, status, time.monotonic(), error))
                    if status == 200:
                        self.result.answers[key] = response.json()
                        self.result.tenant_of[key] = tenant
                        break
                    if status not in (0, 503):
                        # Anything else is final for this key, and a finding.
                        self.result.answers[key] = {"status": status, "body": response.text}
                        self.result.tenant_of[key] = tenant
                        break
                    await asyncio.sleep(RETRY_PAUSE)
