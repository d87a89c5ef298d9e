"""``GET /healthz``: is the store reachable, does it hold the schema this code needs, and
can it take the gateway's decisions?

Load balancers ask often; the answer is cached for about a second and concurrent asks share
one check, so health checks never compete with requests for store connections. The check
reads; a store that answers reads but refuses writes (a full disk) shows in the decisions
themselves, so their recent failures count too (`DecisionOutcomes`).
"""

from __future__ import annotations

import asyncio
import time

from fencegate.store.base import GatewayStore
from fencegate.store.schema import SchemaMismatch, check_applied


class DecisionOutcomes:
    """Whether the store took the gateway's latest decision. Failing: the latest decision
    failed at the store less than ``window`` seconds ago, and none succeeded since. The
    window lets a gateway that a load balancer took out of rotation (so sees no more
    requests) report healthy again, and be tried again."""

    def __init__(self, *, window: float = 5.0) -> None:
        self.window = window
        self._failed_at = -float("inf")
        self._reason = ""

    def succeeded(self) -> None:
        self._failed_at = -float("inf")

    def failed(self, reason: str) -> None:
        self._failed_at = time.monotonic()
        self._reason = reason

    def problem(self) -> str | None:
        if time.monotonic() - self._failed_at < self.window:
            return f"the store refused the latest decision: {self._reason}"
        return None


class StoreHealth:
    def __init__(
        self,
        store: GatewayStore,
        *,
        database_url: str | None,
        timeout: float,
        cache_seconds: float = 1.0,
        decisions: DecisionOutcomes | None = None,
    ) -> None:
        self.store = store
        self.database_url = database_url
        self.timeout = timeout
        self.cache_seconds = cache_seconds
        self.decisions = decisions
        self._checked_at = -float("inf")
        self._problem: str | None = None
        self._lock = asyncio.Lock()

    async def problem(self) -> str | None:
        """None when healthy, else why not (one line, no secrets)."""
        async with self._lock:
            if time.monotonic() - self._checked_at >= self.cache_seconds:
                self._problem = await self._check()
                self._checked_at = time.monotonic()
            return self._problem

    async def _check(self) -> str | None:
        try:
            applied = await self.store.applied_migrations(timeout=self.timeout)
            check_applied(applied, self.store.kind, self.database_url)
        except SchemaMismatch as exc:
            return str(exc)
        except Exception as exc:
            return f"the store did not answer: {exc}"
        return None if self.decisions is None else self.decisions.problem()
