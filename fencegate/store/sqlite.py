"""The gateway store on SQLite: the embedded default.

Each batch of decisions runs in one BEGIN IMMEDIATE transaction on the store's single
connection, so the read and the write it decides on cannot interleave with another process's
write (WAL lets several gateway processes share the file). Times come from the database
clock. The SQL is in ``sql/sqlite/queries/gateway.sql``.

`decide_in` is the reference of the decision order's steps 3 and 4: the PostgreSQL function
``fencegate_step`` is held to it by a differential test that runs random sequences of
operations against both stores.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from fencegate.store.base import (
    DecideRequest,
    Decision,
    DeferredDecision,
    GatewayStore,
    KeyRecord,
    Outcome,
    Reservation,
    Resolution,
    ResolveAudit,
    ResolveResult,
    StoredResponse,
)
from fencegate.store.batching import Batcher
from fencegate.store.queries import Queries
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN, gateway_instance, release_blocker
from fencegate.store.sqlite_db import SQLiteDatabase

T = TypeVar("T")

Q = Queries("sqlite")


def clock(conn: sqlite3.Connection) -> float:
    return float(conn.execute(Q.now).fetchone()[0])


class History:
    """Decision-history rows of one transaction, written together before it commits."""

    def __init__(self, conn: sqlite3.Connection, now: float, *, keep: bool) -> None:
        self.conn = conn
        self.now = now
        self.keep = keep
        self.rows: list[dict[str, Any]] = []

    def add(self, decision: str, **fields: Any) -> None:
        if self.keep:
            row = {"entity": None, "key": None, "fence": None, "attempt": None, "owner": None}
            row |= {"request_id": None, "method": None, "target": None, "upstream_status": None}
            self.rows.append(row | fields | {"decision": decision, "now": self.now})

    def add_for_key(
        self,
        decision: str,
        key_row: sqlite3.Row,
        reservation: Reservation,
        *,
        upstream_status: int | None = None,
    ) -> None:
        """A row about a key as a statement returned it (its entity, fence and expiry) and
        the reservation acting on it."""
        self.add(
            decision,
            tenant=reservation.tenant,
            entity=key_row["entity"],
            key=reservation.key,
            fence=key_row["fence"],
            # A reservation released by its owner alone names no attempt: the row does.
            attempt=key_row["attempt"] if "attempt" in key_row.keys() else reservation.attempt,
            owner=reservation.owner,
            request_id=reservation.request_id,
            upstream_status=upstream_status,
            expires_at=key_row["expires_at"],
        )

    def write(self) -> None:
        if self.rows:
            self.conn.executemany(Q.record_decision, self.rows)


def decide_in(
    conn: sqlite3.Connection, requests: list[DecideRequest], *, history: bool
) -> list[Decision | BaseException]:
    """Decisions in arrival order, in one write transaction (its caller's): one lock and one
    commit for everything that queued up while the previous batch ran."""
    log = History(conn, clock(conn), keep=history)
    decisions: list[Decision | BaseException] = []
    for r in requests:
        decision = _decide(conn, r, log.now)
        decisions.append(decision)
        log.add(
            decision.outcome.value,
            tenant=r.tenant,
            entity=r.entity,
            key=r.key,
            fence=r.fence,
            attempt=decision.attempt,
            owner=r.owner,
            request_id=r.request_id,
            method=r.method,
            target=r.target,
            expires_at=log.now + r.ttl_seconds,
        )
    log.write()
    return decisions


def _decide(conn: sqlite3.Connection, r: DecideRequest, now: float) -> Decision:
    # The key's row, read once (the fence's write below does not touch it).
    key_row = None if r.key is None else conn.execute(Q.key_get, (r.tenant, r.key)).fetchone()
    # Step 3: the fence, if any. A stale fence changes nothing.
    last: int | None = None
    if r.fence is not None:
        row = conn.execute(Q.fence_get, (r.tenant, r.entity)).fetchone()
        if row is not None and r.fence < row[0]:
            return Decision(Outcome.STALE, last_accepted=int(row[0]))
        # As fencegate_step: the fence of a replay (its key completed, unexpired, for the
        # same request) that is already the entity's last accepted is read, not written.
        replay = (
            key_row is not None
            and key_row["state"] == "completed"
            and key_row["expires_at"] > now
            and key_row["fingerprint"] == r.fingerprint
        )
        if row is None or r.fence > row[0] or not replay:
            conn.execute(
                Q.fence_accept,
                {"tenant": r.tenant, "entity": r.entity, "fence": r.fence, "now": now},
            )
        last = r.fence
    if r.key is None:
        return Decision(Outcome.FENCE_ONLY, last_accepted=last)

    # Step 4: the key.
    holder = {
        "tenant": r.tenant,
        "key": r.key,
        "owner": r.owner,
        "entity": r.entity,
        "fence": r.fence,
        "now": now,
        "lease_seconds": r.lease_seconds,
        "reconcile_after": now if r.reconcile else None,
    }
    row = key_row
    if row is None or row["expires_at"] <= now:
        conn.execute(
            Q.key_reserve,
            holder
            | {
                "fingerprint": r.fingerprint,
                "ttl_seconds": r.ttl_seconds,
                "method": r.method,
                "target": r.target,
                "request_body": r.request_body if r.reconcile else None,
            },
        )
        return Decision(Outcome.RESERVED, last_accepted=last, attempt=1)
    if row["fingerprint"] != r.fingerprint:
        return Decision(Outcome.MISMATCH, last_accepted=last, attempt=row["attempt"])
    state = row["state"]
    if state == "completed":
        response = StoredResponse(
            status=int(row["response_status"]),
            headers=[(str(k), str(v)) for k, v in orjson.loads(row["response_headers"])],
            body=None if row["body_too_large"] else bytes(row["response_body"] or b""),
            sha256=str(row["response_sha256"]),
        )
        return Decision(
            Outcome.REPLAY, last_accepted=last, attempt=row["attempt"], response=response
        )
    if state == "in_flight" and row["locked_until"] > now:
        reserved_at = row["reserved_at"] if row["reserved_at"] is not None else row["created_at"]
        return Decision(
            Outcome.IN_FLIGHT,
            last_accepted=last,
            attempt=row["attempt"],
            reserved_age=now - float(reserved_at),
        )
    if not r.retry_unknown:
        # Marked unknown, or in flight with an expired lease (its gateway died or could not
        # record): the upstream may have acted. Not forwarded again. While the key's gateway
        # is alive it still owes the key a write: pending (retry), not for an operator.
        owner_alive = (
            state == "in_flight"
            and conn.execute(Q.gateway_alive, (gateway_instance(row["owner"]), now)).fetchone()
            is not None
        )
        return Decision(
            Outcome.PENDING if owner_alive else Outcome.UNKNOWN,
            last_accepted=last,
            attempt=row["attempt"],
            key_state=state,
            unknown_since=float(row["locked_until"]) if row["locked_until"] is not None else None,
            reconcile_after=row["reconcile_after"],
        )
    attempt = int(row["attempt"]) + 1
    conn.execute(Q.key_take_over, holder | {"attempt": attempt})
    outcome = Outcome.TAKEN_OVER if state == "in_flight" else Outcome.RETRY_UNKNOWN
    return Decision(outcome, last_accepted=last, attempt=attempt)


def _held(r: Reservation, now: float) -> dict[str, Any]:
    return {"tenant": r.tenant, "key": r.key, "owner": r.owner, "attempt": r.attempt, "now": now}


def _conditional(
    sql: str,
    decision: str,
    r: Reservation,
    *,
    history: bool,
    upstream_status: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Callable[[sqlite3.Connection], bool]:
    """A write on one reservation, and its history row, in one transaction."""

    def run(conn: sqlite3.Connection) -> bool:
        log = History(conn, clock(conn), keep=history)
        row = conn.execute(sql, _held(r, log.now) | (extra or {})).fetchone()
        if row is None:
            return False
        log.add_for_key(decision, row, r, upstream_status=upstream_status)
        log.write()
        return True

    return run


def read_key(
    conn: sqlite3.Connection, tenant: str, key: str, *, margin: float, now: float
) -> KeyRecord | None:
    """One key with its gateway's registry row and what the release rule says of it at
    ``now``: in the caller's transaction, so that a change made on what it says is made on
    the key as read (the write transaction holds SQLite's one write lock)."""
    row = conn.execute(Q.get_key, {"tenant": tenant, "key": key, "now": now}).fetchone()
    if row is None:
        return None
    values = dict(zip(row.keys(), tuple(row), strict=True))
    values["unknown"] = bool(values["unknown"])
    alive_until = values["gateway_alive_until"]
    values["release_blocker"] = release_blocker(
        state=values["state"],
        locked_until=values["locked_until"],
        owner_alive=alive_until is not None and alive_until > now,
        margin=margin,
        now=now,
    )
    values["release_margin"] = float(margin)
    return KeyRecord(**values)


def _resolve(
    tenant: str,
    key: str,
    response: StoredResponse | None,
    *,
    resolved_by: str,
    margin: float,
    force: bool,
    audit: ResolveAudit | None,
) -> Callable[[sqlite3.Connection], Resolution]:
    """Run in one write transaction: the key read, the release rule asked, the change, the
    history row and the audit row, under SQLite's one write lock (no check-then-act)."""

    def run(conn: sqlite3.Connection) -> Resolution:
        log = History(conn, clock(conn), keep=True)
        before = read_key(conn, tenant, key, margin=margin, now=log.now)
        if before is None:
            return Resolution(ResolveResult.NOT_FOUND)
        if before.state not in ("in_flight", "outcome_unknown"):
            return Resolution(ResolveResult.NOT_UNKNOWN, before)
        if before.release_blocker is not None and not force:
            return Resolution(ResolveResult.BLOCKED, before)
        which = {"tenant": tenant, "key": key, "now": log.now}
        if response is None:
            row = conn.execute(Q.resolve_released, which).fetchone()
            done = ResolveResult.RELEASED
        else:
            answer = {
                "owner": resolved_by,
                "status": response.status,
                "headers": orjson.dumps(response.headers).decode(),
                "body": response.body,
                "sha256": response.sha256,
                "resolution": "forced" if force else "operator",
            }
            row = conn.execute(Q.resolve_completed, which | answer).fetchone()
            done = ResolveResult.COMPLETED
        assert row is not None, "the key changed under the write lock"
        log.add(
            "resolved_forced" if force else f"resolved_{done.value}",
            tenant=tenant,
            entity=row["entity"],
            key=key,
            fence=row["fence"],
            attempt=row["attempt"],
            owner=resolved_by,
            upstream_status=response.status if response is not None else None,
            expires_at=row["expires_at"],
        )
        log.write()
        after = read_key(conn, tenant, key, margin=margin, now=log.now)
        resolution = Resolution(done, before, after, forced=force)
        if audit is not None:
            conn.execute(Q.audit, audit(resolution).arguments())
        return resolution

    return run


class SQLiteGatewayStore(GatewayStore):
    kind = "sqlite"
    queries = Q
    _db: SQLiteDatabase

    def __init__(self, db: SQLiteDatabase, *, history: bool = True) -> None:
        super().__init__(db, history=history)
        # One connection on one thread: a single batch at a time, and each batch is one
        # thread hand-off and one transaction however many calls it carries.
        self._decider: Batcher[DecideRequest, Decision] = Batcher(
            self._decide_many, max_in_flight=1
        )
        self._completer: Batcher[tuple[Reservation, StoredResponse], bool] = Batcher(
            self._complete_many, max_in_flight=1
        )

    async def decide(self, request: DecideRequest, *, timeout: float) -> Decision:
        return await self._decider.submit(request, timeout=timeout)

    async def _decide_many(
        self, requests: list[DecideRequest], timeout: float
    ) -> list[Decision | BaseException]:
        history = self.history
        return await self._db.run(
            lambda conn: decide_in(conn, requests, history=history), timeout=timeout, write=True
        )

    async def complete(
        self,
        reservation: Reservation,
        response: StoredResponse,
        *,
        timeout: float,
    ) -> bool:
        return await self._completer.submit((reservation, response), timeout=timeout)

    async def _complete_many(
        self, items: list[tuple[Reservation, StoredResponse]], timeout: float
    ) -> list[bool | BaseException]:
        history = self.history

        def run(conn: sqlite3.Connection) -> list[bool | BaseException]:
            log = History(conn, clock(conn), keep=history)
            results: list[bool | BaseException] = []
            for r, answer in items:
                row = conn.execute(
                    Q.complete,
                    _held(r, log.now)
                    | {
                        "status": answer.status,
                        "headers": orjson.dumps(answer.headers).decode(),
                        "body": answer.body,
                        "sha256": answer.sha256,
                        "too_large": int(answer.body is None),
                    },
                ).fetchone()
                results.append(row is not None)
                if row is not None:
                    log.add_for_key("completed", row, r, upstream_status=answer.status)
            log.write()
            return results

        return await self._db.run(run, timeout=timeout, write=True)

    async def release(
        self, reservation: Reservation, *, upstream_status: int | None = None, timeout: float
    ) -> bool:
        write = _conditional(
            Q.release,
            "released",
            reservation,
            history=self.history,
            upstream_status=upstream_status,
        )
        return await self._db.run(write, timeout=timeout, write=True)

    async def release_abandoned(self, reservation: Reservation, *, timeout: float) -> bool:
        write = _conditional(Q.release_abandoned, "released", reservation, history=self.history)
        return await self._db.run(write, timeout=timeout, write=True)

    async def mark_unknown(
        self, reservation: Reservation, *, reason: str = "", timeout: float
    ) -> bool:
        write = _conditional(
            Q.mark_unknown,
            "marked_unknown",
            reservation,
            history=self.history,
            extra={"reason": reason or None},
        )
        return await self._db.run(write, timeout=timeout, write=True)

    async def renew(
        self, reservation: Reservation, lease_seconds: float, *, timeout: float
    ) -> bool:
        params = _held(reservation, 0.0) | {"lease_seconds": float(lease_seconds)}

        def run(conn: sqlite3.Connection) -> bool:
            return conn.execute(Q.renew, params).rowcount > 0

        return await self._db.run(run, timeout=timeout, write=True)

    async def record_decisions(self, rows: list[DeferredDecision], *, timeout: float) -> None:
        def run(conn: sqlite3.Connection) -> None:
            now = clock(conn)
            conn.executemany(
                Q.record_decision,
                [
                    {
                        "now": now - r.age,
                        "tenant": r.tenant,
                        "entity": r.entity,
                        "key": r.key,
                        "fence": None,
                        "decision": r.decision,
                        "attempt": r.attempt,
                        "owner": r.owner,
                        "request_id": r.request_id,
                        "method": r.method,
                        "target": r.target,
                        "upstream_status": None,
                        "expires_at": now - r.age + r.ttl_seconds,
                    }
                    for r in rows
                ],
            )

        await self._db.run(run, timeout=timeout, write=True)

    async def remember_nonce(
        self, key_id: str, nonce: str, ttl_seconds: float, *, tenant: str, timeout: float
    ) -> bool:
        # One file holds every tenant: the tenant places a nonce only on a distributed
        # PostgreSQL (a key id belongs to one tenant, so it changes nothing else).
        del tenant

        def run(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(Q.remember_nonce, (key_id, nonce, float(ttl_seconds)))
            return cur.rowcount > 0

        return await self._db.run(run, timeout=timeout, write=True)

    async def get_key(
        self, tenant: str, key: str, *, margin: float = DEFAULT_RELEASE_MARGIN, timeout: float
    ) -> KeyRecord | None:
        def read(conn: sqlite3.Connection) -> KeyRecord | None:
            return read_key(conn, tenant, key, margin=margin, now=clock(conn))

        return await self._db.run(read, timeout=timeout)

    async def resolve_key(
        self,
        tenant: str,
        key: str,
        response: StoredResponse | None,
        *,
        resolved_by: str,
        margin: float = DEFAULT_RELEASE_MARGIN,
        force: bool = False,
        audit: ResolveAudit | None = None,
        timeout: float,
    ) -> Resolution:
        write = _resolve(
            tenant,
            key,
            response,
            resolved_by=resolved_by,
            margin=margin,
            force=force,
            audit=audit,
        )
        return await self._db.run(write, timeout=timeout, write=True)
