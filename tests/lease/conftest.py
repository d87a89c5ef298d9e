"""Fixtures shared by the lease queue and worker tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from fencegate.lease import LeaseQueue


@pytest.fixture
async def queue(store_url: str) -> AsyncIterator[LeaseQueue]:
    """A queue on a fresh migrated store: the test's own view, beside any worker's."""
    q = await LeaseQueue.connect(store_url, timeout=10)
    try:
        yield q
    finally:
        await q.close()
