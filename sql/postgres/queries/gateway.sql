-- The gateway store's statements on PostgreSQL (fencegate/store/postgres.py runs them by name).

-- name: step
-- One round trip of a gateway: the decisions ($2) and recorded answers ($3) that queued up,
-- in one transaction, which also writes their rows in the decision history when $4 says it
-- is kept; $5: the caller's remaining milliseconds (the step rolls back rather than commit
-- after the caller gave up). $1: the batch's one tenant (NULL: it mixes tenants), by which
-- Citus sends the call to the worker holding that tenant's shard.
SELECT * FROM fencegate_step($1::text,
    $2::fencegate_decide_step[], $3::fencegate_record_step[], $4::boolean, $5::double precision);

-- name: release
-- 5xx not stored, or nothing reached the upstream: the key goes, so that a retry runs again
-- (sql/postgres/functions/fencegate_release.sql).
SELECT fencegate_release($1::text, $2::text, $3::text, $4::integer, $5::text, $6::integer,
    $7::boolean);

-- name: release_abandoned
-- A decision the gateway gave up on (503) may still have reserved the key under the owner it
-- named: that reservation goes, whatever its attempt (the owner is this request's alone).
SELECT fencegate_release($1::text, $2::text, $3::text, NULL::integer, $4::text, NULL::integer,
    $5::boolean);

-- name: mark_unknown
-- $7: the limit that fired (sql/postgres/functions/fencegate_mark_unknown.sql).
SELECT fencegate_mark_unknown($1::text, $2::text, $3::text, $4::integer, $5::text, $6::boolean,
    $7::text);

-- name: renew
-- The lease runs from when the row is written (sql/postgres/functions/fencegate_renew.sql).
SELECT fencegate_renew($1::text, $2::text, $3::text, $4::integer, $5::double precision);

-- name: record_decisions
-- History rows of decisions the gateway answered from its copy of a completed answer (no
-- statement on the request's path), written in batches: $10 is each one's age in seconds
-- (its time is the database clock less that), $11 how long it is kept from then.
INSERT INTO fencegate_decisions (
    at, tenant, entity, key, decision, attempt, owner, request_id, method, target, expires_at)
SELECT now() - make_interval(secs => d.age), d.tenant, d.entity, d.key, d.decision,
    d.attempt, d.owner, d.request_id, d.method, d.target,
    now() - make_interval(secs => d.age) + make_interval(secs => d.ttl)
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::integer[], $6::text[],
    $7::text[], $8::text[], $9::text[], $10::float8[], $11::float8[])
    AS d(tenant, entity, key, decision, attempt, owner, request_id, method, target, age, ttl);

-- name: remember_nonce
-- A nonce row that has expired may be reused; an unexpired one is a replayed signature
-- (sql/postgres/functions/fencegate_remember_nonce.sql).
SELECT fencegate_remember_nonce($1::text, $2::text, $3::text, $4::double precision);

-- template: key_read
-- One key as an operator sees it; unknown = marked so, or in flight with an expired lease.
-- With its owner gateway's last heartbeat, and what the release rule says of it now ($3: the
-- release margin in seconds). Never the request's body.
SELECT k.tenant, k.key, k.state::text AS state, k.owner, k.attempt, k.entity, k.fence,
    k.fingerprint,
    extract(epoch FROM k.locked_until)::float8 AS locked_until,
    extract(epoch FROM k.reserved_at)::float8 AS reserved_at,
    extract(epoch FROM k.created_at)::float8 AS created_at,
    extract(epoch FROM k.completed_at)::float8 AS completed_at,
    extract(epoch FROM k.expires_at)::float8 AS expires_at,
    k.response_status, extract(epoch FROM now())::float8 AS now,
    (k.state = 'outcome_unknown' OR (k.state = 'in_flight' AND k.locked_until <= now()))
        AS unknown,
    k.method, k.target, k.unknown_reason, k.resolution,
    extract(epoch FROM k.reconcile_after)::float8 AS reconcile_after,
    k.reconcile_tries, k.reconcile_note,
    extract(epoch FROM g.heartbeat_at)::float8 AS gateway_heartbeat_at,
    extract(epoch FROM g.alive_until)::float8 AS gateway_alive_until,
    fencegate_release_blocker(k.state, k.owner, k.locked_until, $3::float8,
        g.alive_until, now()) AS release_blocker,
    $3::float8 AS release_margin
FROM fencegate_idempotency_keys k
LEFT JOIN fencegate_gateways g ON g.instance = split_part(k.owner, '/', 1)
WHERE k.tenant = $1 AND k.key = $2 /* TEMPLATE: lock */;

-- name: get_key from key_read
-- lock: /* a read: no lock */

-- name: get_key_for_update from key_read
-- An operator's action reads the key it changes under its row lock, in its transaction.
-- lock: FOR UPDATE OF k

-- name: resolve_completed
-- An operator records the upstream's real answer for a key whose outcome is unknown, when
-- the release rule allows it ($4: the release margin) or when forced ($5): an answer recorded
-- while a copy of the request may still be on its way is as unsafe as a release. The rule is
-- checked on the row this statement changes, not before it.
WITH resolved AS (
    UPDATE fencegate_idempotency_keys SET state = 'completed', owner = $3,
        response_status = $6, response_headers = $7::jsonb, response_body = $8,
        response_sha256 = $9, body_too_large = false, completed_at = now(), locked_until = NULL,
        resolution = CASE WHEN $5::boolean THEN 'forced' ELSE 'operator' END
    WHERE tenant = $1 AND key = $2 AND state IN ('in_flight', 'outcome_unknown')
        AND ($5::boolean OR fencegate_release_blocker(state, owner, locked_until, $4,
            (SELECT g.alive_until FROM fencegate_gateways g
             WHERE g.instance = split_part(owner, '/', 1)), now()) IS NULL)
    RETURNING tenant, entity, key, fence, attempt, owner, expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, upstream_status, expires_at)
    SELECT tenant, entity, key, fence,
        CASE WHEN $5::boolean THEN 'resolved_forced' ELSE 'resolved_completed' END,
        attempt, owner, $6, expires_at
    FROM resolved
)
SELECT count(*) FROM resolved;

-- name: resolve_released
-- An operator releases a key whose outcome is unknown, when the release rule allows it ($4:
-- the release margin) or when forced ($5): the next request runs again. The rule is checked
-- on the row this statement deletes, not before it.
WITH released AS (
    DELETE FROM fencegate_idempotency_keys
    WHERE tenant = $1 AND key = $2 AND state IN ('in_flight', 'outcome_unknown')
        AND ($5::boolean OR fencegate_release_blocker(state, owner, locked_until, $4,
            (SELECT g.alive_until FROM fencegate_gateways g
             WHERE g.instance = split_part(owner, '/', 1)), now()) IS NULL)
    RETURNING tenant, entity, key, fence, attempt, expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, expires_at)
    SELECT tenant, entity, key, fence,
        CASE WHEN $5::boolean THEN 'resolved_forced' ELSE 'resolved_released' END,
        attempt, $3, expires_at
    FROM released
)
SELECT count(*) FROM released;

-- name: applied_migrations
SELECT name FROM fencegate_migrations ORDER BY name;

-- name: migrations_table
SELECT to_regclass('fencegate_migrations') IS NOT NULL;

-- name: purge_keys
-- Each purge deletes by primary key (not by ctid, which Citus cannot plan on a distributed
-- table: there each purge runs on every shard).
DELETE FROM fencegate_idempotency_keys WHERE (tenant, key) IN (
    SELECT tenant, key FROM fencegate_idempotency_keys WHERE expires_at <= now() LIMIT $1);

-- name: purge_fences
DELETE FROM fencegate_fences WHERE (tenant, entity) IN (
    SELECT tenant, entity FROM fencegate_fences
    WHERE updated_at <= now() - make_interval(secs => $2) LIMIT $1);

-- name: purge_nonces
DELETE FROM fencegate_signature_nonces WHERE (tenant, key_id, nonce) IN (
    SELECT tenant, key_id, nonce FROM fencegate_signature_nonces
    WHERE expires_at <= now() LIMIT $1);

-- name: purge_decisions
-- Those that expired first, first.
DELETE FROM fencegate_decisions WHERE (tenant, id) IN (
    SELECT tenant, id FROM fencegate_decisions WHERE expires_at <= now()
    ORDER BY expires_at LIMIT $1);

-- name: ping
SELECT 1;

-- The gateway registry: each gateway process heartbeats its row (fencegate/gateway/registry.py).

-- name: gateway_heartbeat
-- Registers the process, or keeps it alive: alive until $4 seconds from now (database clock).
-- (The upsert sets only what it inserted: Citus plans no non-immutable function in DO UPDATE.)
INSERT INTO fencegate_gateways AS g (instance, host, pid, heartbeat_at, alive_until)
VALUES ($1, $2, $3, now(), now() + make_interval(secs => $4))
ON CONFLICT (instance) DO UPDATE
SET heartbeat_at = EXCLUDED.heartbeat_at, alive_until = EXCLUDED.alive_until;

-- name: gateway_deregister
-- A clean stop, once the process owes no write.
DELETE FROM fencegate_gateways WHERE instance = $1;

-- name: gateway_purge
-- Rows of processes that stopped without deregistering ($1: seconds since they expired).
DELETE FROM fencegate_gateways WHERE alive_until < now() - make_interval(secs => $1);

-- name: gateways
SELECT instance, host, pid,
    extract(epoch FROM started_at)::float8 AS started_at,
    extract(epoch FROM heartbeat_at)::float8 AS heartbeat_at,
    extract(epoch FROM alive_until)::float8 AS alive_until,
    extract(epoch FROM now())::float8 AS now
FROM fencegate_gateways ORDER BY instance;
