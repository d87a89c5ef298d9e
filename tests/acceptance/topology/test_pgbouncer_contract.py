"""The gateway store's conformance suite and the lease queue's, run again through PgBouncer in
transaction pooling (``?pool_mode=transaction``): every call a transaction of its own,
unnamed statements, settings per transaction, no LISTEN. The tests are the integration
suites' own; only the database they get differs (migrated through the pooler too)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from fencegate.store.migrations import migrate
from tests.integration.lease.test_queue import (  # noqa: F401  (collected here again)
    test_claim_grants_a_lease_once_with_growing_tokens,
    test_complete_many_answers_per_lease,
    test_complete_stores_the_result_once,
    test_concurrent_enqueues_of_one_key_make_one_job,
    test_enqueue_is_idempotent_by_key,
    test_expired_lease_is_reclaimed_and_the_old_owner_is_fenced,
    test_extend_many_answers_per_lease,
    test_extend_renews_only_for_the_current_owner,
    test_fail_retries_after_backoff_until_attempts_run_out,
    test_list_jobs_filters_newest_first,
    test_stages_are_committed_only_by_the_owner_and_survive_a_retry,
)
from tests.integration.test_gateway_store import (  # noqa: F401
    test_completed_key_replays_what_was_stored,
    test_concurrent_decisions_reserve_once,
    test_concurrent_fences_on_one_entity_end_at_the_highest,
    test_expired_lease_is_taken_over_and_the_old_holder_cannot_record,
    test_fence_is_max_and_stale_stores_nothing,
    test_keys_are_per_tenant,
    test_new_key_is_reserved_then_in_flight,
    test_other_fingerprint_is_a_mismatch,
    test_release_frees_the_key,
    test_two_gateways_racing_on_shared_keys_and_entities_never_fail,
    test_writes_are_conditional_on_the_holder,
)
from tests.support import postgres
from tests.support.topology import PgBouncer


@pytest.fixture(params=["postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def pg_url(pg_server_url: str, pgbouncer: PgBouncer) -> AsyncIterator[str]:
    """A new database, migrated through the pooler; the URL the stores get is the pooler's."""
    direct = await postgres.create_database(pg_server_url)
    database = urlsplit(direct).path.lstrip("/")
    url = pgbouncer.url(database, query="pool_mode=transaction")
    await migrate(url)
    try:
        yield url
    finally:
        await postgres.drop_database(pg_server_url, direct)
