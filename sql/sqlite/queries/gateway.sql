-- The gateway store's statements on SQLite (fencegate/store/sqlite.py runs them by name).
-- Times are epoch seconds from the database clock: ((julianday('now') - 2440587.5) * 86400.0).
-- A decision reads the clock once (now) and passes it to the statements of its transaction.

-- name: now
SELECT (julianday('now') - 2440587.5) * 86400.0;

-- name: fence_get
SELECT last_accepted FROM fencegate_fences WHERE tenant = ? AND entity = ?;

-- name: fence_accept
INSERT INTO fencegate_fences (tenant, entity, last_accepted, updated_at)
VALUES (:tenant, :entity, :fence, :now)
ON CONFLICT (tenant, entity) DO UPDATE
SET last_accepted = excluded.last_accepted, updated_at = excluded.updated_at;

-- name: key_get
SELECT * FROM fencegate_idempotency_keys WHERE tenant = ? AND key = ?;

-- name: key_reserve
-- A new key, or one whose TTL ran out (not yet purged): reserved for this request.
INSERT OR REPLACE INTO fencegate_idempotency_keys (
    tenant, key, fingerprint, state, owner, locked_until, attempt, entity, fence, created_at,
    reserved_at, expires_at, method, target, request_body, reconcile_after)
VALUES (
    :tenant, :key, :fingerprint, 'in_flight', :owner, :now + :lease_seconds, 1, :entity,
    :fence, :now, :now, :now + :ttl_seconds, :method, :target, :request_body,
    :reconcile_after);

-- name: key_take_over
-- An unknown outcome on a route that retries: the same key, a new holder and attempt.
UPDATE fencegate_idempotency_keys
SET state = 'in_flight', owner = :owner, locked_until = :now + :lease_seconds,
    reserved_at = :now, attempt = :attempt, entity = :entity, fence = :fence,
    reconcile_after = :reconcile_after, unknown_reason = NULL
WHERE tenant = :tenant AND key = :key;

-- name: gateway_alive
-- Whether a key's gateway process still heartbeats (it owes the key a write).
SELECT 1 FROM fencegate_gateways WHERE instance = ? AND alive_until > ?;

-- name: record_decision
INSERT INTO fencegate_decisions (
    at, tenant, entity, key, fence, decision, attempt, owner, request_id, method, target,
    upstream_status, expires_at)
VALUES (
    :now, :tenant, :entity, :key, :fence, :decision, :attempt, :owner, :request_id, :method,
    :target, :upstream_status, :expires_at);

-- name: complete
-- Conditional on still holding the reservation; a late answer from the holder of a key
-- marked unknown still completes it.
UPDATE fencegate_idempotency_keys
SET state = 'completed', response_status = :status, response_headers = :headers,
    response_body = :body, response_sha256 = :sha256, body_too_large = :too_large,
    completed_at = :now, locked_until = NULL, reconcile_after = NULL
WHERE tenant = :tenant AND key = :key AND owner = :owner AND attempt = :attempt
    AND state IN ('in_flight', 'outcome_unknown')
RETURNING entity, fence, expires_at;

-- name: release
DELETE FROM fencegate_idempotency_keys
WHERE tenant = :tenant AND key = :key AND owner = :owner AND attempt = :attempt
    AND state = 'in_flight'
RETURNING entity, fence, expires_at;

-- name: release_abandoned
-- A decision the gateway gave up on may have reserved the key under the owner it named.
DELETE FROM fencegate_idempotency_keys
WHERE tenant = :tenant AND key = :key AND owner = :owner AND state = 'in_flight'
RETURNING entity, fence, expires_at, attempt;

-- name: mark_unknown
-- locked_until keeps the moment the outcome became unknown (shown to the caller).
UPDATE fencegate_idempotency_keys
SET state = 'outcome_unknown', locked_until = :now, unknown_reason = :reason
WHERE tenant = :tenant AND key = :key AND owner = :owner AND attempt = :attempt
    AND state = 'in_flight'
RETURNING entity, fence, expires_at;

-- name: renew
UPDATE fencegate_idempotency_keys
SET locked_until = (julianday('now') - 2440587.5) * 86400.0 + :lease_seconds
WHERE tenant = :tenant AND key = :key AND owner = :owner AND attempt = :attempt
    AND state = 'in_flight' AND locked_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: remember_nonce
-- A nonce row that has expired may be reused; an unexpired one is a replayed signature.
INSERT INTO fencegate_signature_nonces (key_id, nonce, expires_at)
VALUES (?, ?, (julianday('now') - 2440587.5) * 86400.0 + ?)
ON CONFLICT (key_id, nonce) DO UPDATE SET expires_at = excluded.expires_at
WHERE fencegate_signature_nonces.expires_at <= (julianday('now') - 2440587.5) * 86400.0;

-- name: get_key
-- One key as an operator sees it; unknown = marked so, or in flight with an expired lease.
-- With its owner gateway's last heartbeat (the gateway: the owner's text before its first
-- '/'); the release rule is asked in Python (fencegate/store/release_rule.py). Never the
-- request's body.
SELECT k.tenant, k.key, k.state, k.owner, k.attempt, k.entity, k.fence, k.fingerprint,
    k.locked_until, k.reserved_at, k.created_at, k.completed_at, k.expires_at,
    k.response_status, :now AS now,
    (k.state = 'outcome_unknown' OR (k.state = 'in_flight' AND k.locked_until <= :now))
        AS unknown,
    k.method, k.target, k.unknown_reason, k.resolution, k.reconcile_after, k.reconcile_tries,
    k.reconcile_note, g.heartbeat_at AS gateway_heartbeat_at,
    g.alive_until AS gateway_alive_until
FROM fencegate_idempotency_keys k
LEFT JOIN fencegate_gateways g ON g.instance = CASE WHEN instr(k.owner, '/') > 0
    THEN substr(k.owner, 1, instr(k.owner, '/') - 1) ELSE k.owner END
WHERE k.tenant = :tenant AND k.key = :key;

-- name: resolve_completed
-- Run in the write transaction that asked the release rule (or was forced): the key is
-- still as it was read.
UPDATE fencegate_idempotency_keys
SET state = 'completed', owner = :owner, response_status = :status,
    response_headers = :headers, response_body = :body, response_sha256 = :sha256,
    body_too_large = 0, completed_at = :now, locked_until = NULL, resolution = :resolution
WHERE tenant = :tenant AND key = :key AND state IN ('in_flight', 'outcome_unknown')
RETURNING entity, fence, attempt, expires_at;

-- name: resolve_released
DELETE FROM fencegate_idempotency_keys
WHERE tenant = :tenant AND key = :key AND state IN ('in_flight', 'outcome_unknown')
RETURNING entity, fence, attempt, expires_at;

-- name: migrations_table
SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'fencegate_migrations';

-- name: applied_migrations
SELECT name FROM fencegate_migrations ORDER BY name;

-- name: purge_keys
DELETE FROM fencegate_idempotency_keys WHERE (tenant, key) IN (
    SELECT tenant, key FROM fencegate_idempotency_keys
    WHERE expires_at <= (julianday('now') - 2440587.5) * 86400.0 LIMIT ?1);

-- name: purge_fences
DELETE FROM fencegate_fences WHERE (tenant, entity) IN (
    SELECT tenant, entity FROM fencegate_fences
    WHERE updated_at <= (julianday('now') - 2440587.5) * 86400.0 - ?2 LIMIT ?1);

-- name: purge_nonces
DELETE FROM fencegate_signature_nonces WHERE (key_id, nonce) IN (
    SELECT key_id, nonce FROM fencegate_signature_nonces
    WHERE expires_at <= (julianday('now') - 2440587.5) * 86400.0 LIMIT ?1);

-- name: purge_decisions
-- Oldest first along the primary key (rows are inserted in time order).
DELETE FROM fencegate_decisions WHERE id IN (
    SELECT id FROM fencegate_decisions
    WHERE expires_at <= (julianday('now') - 2440587.5) * 86400.0 ORDER BY id LIMIT ?1);

-- name: ping
SELECT 1;

-- The gateway registry: each gateway process heartbeats its row (fencegate/gateway/registry.py).

-- name: gateway_heartbeat
-- Registers the process, or keeps it alive: alive until ?4 seconds from now (database clock).
INSERT INTO fencegate_gateways (instance, host, pid, started_at, heartbeat_at, alive_until)
VALUES (?1, ?2, ?3, (julianday('now') - 2440587.5) * 86400.0,
    (julianday('now') - 2440587.5) * 86400.0, (julianday('now') - 2440587.5) * 86400.0 + ?4)
ON CONFLICT (instance) DO UPDATE
SET heartbeat_at = excluded.heartbeat_at, alive_until = excluded.alive_until;

-- name: gateway_deregister
DELETE FROM fencegate_gateways WHERE instance = ?1;

-- name: gateway_purge
DELETE FROM fencegate_gateways
WHERE alive_until < (julianday('now') - 2440587.5) * 86400.0 - ?1;

-- name: gateways
SELECT instance, host, pid, started_at, heartbeat_at, alive_until,
    (julianday('now') - 2440587.5) * 86400.0 AS now
FROM fencegate_gateways ORDER BY instance;
