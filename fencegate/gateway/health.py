"""``GET /healthz``: is the store reachable, and does it hold the schema this code needs?

Load balancers ask often; the answer is cached for about a second and concurrent asks share
one check, so health checks never compete with requests for store connections.
"""

from __future__ import annotations

import asyncio
import time

from fencegate.store.base import GatewayStore
from fencegate.store.schema import SchemaMismatch, check_applied


class StoreHealth:
    def __init__(
        self,
        store: GatewayStore,
        *,
        database_url: str | None,
        timeout: float,
        cache_seconds: float = 1.0,
    ) -> None:
        self.store = store
        self.database_url = database_url
        self.timeout = timeout
        self.cache_seconds = cache_seconds
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
        return None
