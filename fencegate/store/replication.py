"""What a PostgreSQL server does with a commit before it returns: whether a standby that could
be promoted has it too.

With asynchronous streaming replication (PostgreSQL's default) a commit returns as soon as
the primary has flushed it; a failover to a standby that had not received the last commits
loses them. For fencegate those are acknowledged decisions: an idempotency key whose answer
a client already got (its retry then runs again upstream), an accepted fence (a stale owner
gets through) and the last fencing tokens handed out (handed out again). Only synchronous
replication (Patroni's ``synchronous_mode: true``) closes that, so every store checks on
every new connection and warns, or refuses when told to require it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import asyncpg

from fencegate.errors import StoreUnavailable

logger = logging.getLogger("fencegate.store")

REQUIRE_OPTION = "--require-synchronous-replication"
REQUIRE_ENV = "FENCEGATE_REQUIRE_SYNCHRONOUS_REPLICATION"

# One round trip; pg_stat_replication's rows are visible to every role, their sync_state
# only to superusers and pg_read_all_stats (NULL otherwise).
STATE_SQL = """
SELECT current_setting('synchronous_commit') AS synchronous_commit,
       current_setting('synchronous_standby_names') AS synchronous_standby_names,
       count(r.pid) AS standbys,
       count(r.pid) FILTER (WHERE r.sync_state IN ('sync', 'quorum')) AS synchronous,
       count(r.pid) FILTER (WHERE r.sync_state IS NULL) AS hidden
FROM (SELECT 1) AS one LEFT JOIN pg_stat_replication AS r ON true
"""

# synchronous_commit levels at which a commit waits for the synchronous standbys.
_WAITS_FOR_STANDBY = ("on", "remote_write", "remote_apply")

FIX = (
    "turn on synchronous replication: Patroni synchronous_mode: true, or "
    "synchronous_standby_names and synchronous_commit = on"
)


class ReplicationNotSynchronous(StoreUnavailable):
    """Synchronous replication was required and the server does not replicate that way."""


@dataclass(frozen=True)
class ReplicationState:
    synchronous_commit: str
    synchronous_standby_names: str
    standbys: int  # streaming standbys connected
    synchronous_standbys: int  # of those, confirming commits before they return
    hidden: int  # standbys whose sync_state this role may not read

    @property
    def synchronous(self) -> bool:
        """A commit returns only once a standby has it (or no standby could be promoted)."""
        if self.standbys == 0:
            return True
        if self.synchronous_commit not in _WAITS_FOR_STANDBY:
            return False
        if not self.synchronous_standby_names.strip():
            return False
        # A role that cannot read sync_state trusts the configuration it can read.
        return self.synchronous_standbys > 0 or self.hidden > 0

    def risk(self, where: str) -> str:
        return (
            f"PostgreSQL at {where} replicates asynchronously ({self.standbys} standby(s), "
            f"none synchronous; synchronous_commit={self.synchronous_commit}, "
            f"synchronous_standby_names={self.synchronous_standby_names!r}): a failover can "
            "lose acknowledged decisions, so a retried key runs upstream twice, an accepted "
            f"fence is forgotten and fencing tokens are handed out again; {FIX}"
        )


async def read_state(conn: asyncpg.Connection) -> ReplicationState:
    row = await conn.fetchrow(STATE_SQL)
    assert row is not None
    return ReplicationState(
        synchronous_commit=row["synchronous_commit"],
        synchronous_standby_names=row["synchronous_standby_names"],
        standbys=row["standbys"],
        synchronous_standbys=row["synchronous"],
        hidden=row["hidden"],
    )


# Servers already warned about in this process: `fencegate serve` checks the store before it
# serves and the application opens its own pool, and the risk is said once, not per pool.
_warned: set[str] = set()


class ReplicationGuard:
    """Checks each new connection of a pool: the first time a server is found replicating
    asynchronously the process says so once (again only after it was seen synchronous);
    with ``require`` the connection is refused instead, which the caller sees as the store
    being unavailable (the gateway answers 503, a worker keeps its hands off)."""

    def __init__(self, where: str, *, require: bool = False) -> None:
        self.where = where
        self.require = require
        self.last: ReplicationState | None = None

    async def check(self, conn: asyncpg.Connection) -> None:
        state = await read_state(conn)
        self.last = state
        if state.synchronous:
            _warned.discard(self.where)
            return
        if self.require:
            raise ReplicationNotSynchronous(
                f"{state.risk(self.where)} ({REQUIRE_OPTION} refuses to run on it)"
            )
        if self.where not in _warned:
            _warned.add(self.where)
            logger.warning("%s", state.risk(self.where))
