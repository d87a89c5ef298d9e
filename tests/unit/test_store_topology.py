"""What a database URL says about a pooler, and when replication is called asynchronous."""

from __future__ import annotations

import pytest

from fencegate.store.dburl import parse_database_url
from fencegate.store.pg import _split_settings
from fencegate.store.replication import ReplicationState


def test_pool_mode_is_taken_out_of_the_url_for_the_driver() -> None:
    target = parse_database_url("postgresql://u:pw@h1:1,h2:2/db?pool_mode=transaction&schema=fg")
    assert target.transaction_pooling and target.schema == "fg"
    assert target.dsn == "postgresql://u:pw@h1:1,h2:2/db"
    assert target.where == "h1:1,h2:2/db"  # no password in messages
    assert not parse_database_url("postgresql://h/db?pool_mode=session").transaction_pooling
    assert not parse_database_url("postgresql://h/db").transaction_pooling


def test_an_unknown_pool_mode_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="pool_mode=transaction"):
        parse_database_url("postgresql://h/db?pool_mode=statement")


def test_behind_a_transaction_pooler_settings_move_to_set_local() -> None:
    settings = {
        "jit": "off",
        "application_name": "a",
        "search_path": "fg",
        "plan_cache_mode": "force_generic_plan",
    }
    startup, local = _split_settings(settings, transaction_pooling=False)
    assert (startup, local.sql) == (settings, "")
    startup, local = _split_settings(settings, transaction_pooling=True)
    assert startup == {"application_name": "a"}
    assert local.sql == "SET LOCAL search_path = 'fg'"


def state(commit: str, names: str, standbys: int, sync: int, hidden: int = 0) -> ReplicationState:
    return ReplicationState(commit, names, standbys, sync, hidden)


@pytest.mark.parametrize(
    ("replication", "synchronous"),
    [
        (state("on", "", 0, 0), True),  # no standby: nothing to promote past it
        (state("on", "", 1, 0), False),  # the default: asynchronous
        (state("on", "standby1", 1, 1), True),  # Patroni synchronous_mode
        (state("local", "standby1", 1, 1), False),  # this session does not wait
        (state("off", "standby1", 1, 1), False),
        (state("remote_apply", '"*"', 2, 1), True),
        (state("on", "standby9", 1, 0), False),  # named, but not the one streaming
        (state("on", "standby1", 1, 0, hidden=1), True),  # sync_state not readable: trusted
    ],
)
def test_when_replication_counts_as_synchronous(
    replication: ReplicationState, synchronous: bool
) -> None:
    assert replication.synchronous is synchronous
