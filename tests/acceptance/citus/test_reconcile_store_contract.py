"""The reconciler's store tests (tests/integration/test_reconcile_store.py) on a Citus
coordinator whose gateway tables are distributed by tenant: this package's conftest gives
them the coordinator's database as ``pg_url``, and PostgreSQL as their only store kind. There
the poll reads which tenants have due keys, then claims each tenant's keys on its worker.

One is replaced here, because Citus changes what it looks at: the history's ids are not in
the order of its rows across nodes (a row written by a function on the tenant's worker takes
its id from that worker's range, one written through the coordinator from the
coordinator's), so the release is looked for in the key's history, not as its last row.
"""

from __future__ import annotations

from dataclasses import replace

from fencegate.store import GatewayStore, Outcome
from fencegate.store.reconcile import ReconcileStore
from tests.integration.test_reconcile_store import *  # noqa: F403
from tests.integration.test_reconcile_store import MARGIN, Rows, T, claim, reserve


async def test_not_executed_releases_the_key(  # type: ignore[no-redef]
    store: GatewayStore, reconciler: ReconcileStore, rows: Rows
) -> None:
    request = await reserve(store, "never-ran")
    await rows.shape("never-ran")
    [claimed] = await claim(reconciler)
    assert await reconciler.release(claimed, margin=MARGIN, by="reconciler:me", timeout=T)
    assert await rows.row("never-ran") is None
    decisions = [h["decision"] for h in await rows.history("never-ran")]
    assert decisions.count("reconciled_released") == 1, decisions
    again = await store.decide(replace(request, owner="gw-b/1"), timeout=T)
    assert again.outcome is Outcome.RESERVED
