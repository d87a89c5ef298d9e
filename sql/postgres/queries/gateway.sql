-- The gateway store's statements on PostgreSQL (fencegate/store/postgres.py runs them by name).

-- name: step
-- One round trip of a gateway: the decisions and recorded answers that queued up, in one
-- transaction (fencegate_step), and their rows in the decision history in the same
-- statement. $1-$9 and $19-$21: decisions; $10-$18 and $22: recorded answers; $23: whether
-- the history is kept; $24: the caller's remaining milliseconds (the step rolls back rather
-- than commit after the caller gave up).
WITH step AS (
    SELECT * FROM fencegate_step(
        $1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[],
        $7::double precision[], $8::double precision[], $9::boolean[],
        $10::text[], $11::text[], $12::text[], $13::integer[], $14::integer[], $15::text[],
        $16::bytea[], $17::text[], $18::boolean[], $24::double precision)
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, request_id, method, target,
        upstream_status, expires_at)
    SELECT
        CASE WHEN s.d_index > 0 THEN ($1::text[])[s.d_index] ELSE ($10::text[])[-s.d_index] END,
        CASE WHEN s.d_index > 0 THEN ($4::text[])[s.d_index] ELSE s.d_entity END,
        CASE WHEN s.d_index > 0 THEN ($2::text[])[s.d_index] ELSE ($11::text[])[-s.d_index] END,
        CASE WHEN s.d_index > 0 THEN ($5::bigint[])[s.d_index] ELSE s.d_fence END,
        s.d_outcome,
        CASE WHEN s.d_index > 0 THEN s.d_attempt ELSE ($13::integer[])[-s.d_index] END,
        CASE WHEN s.d_index > 0 THEN ($6::text[])[s.d_index] ELSE ($12::text[])[-s.d_index] END,
        CASE WHEN s.d_index > 0 THEN ($19::text[])[s.d_index]
             ELSE ($22::text[])[-s.d_index] END,
        CASE WHEN s.d_index > 0 THEN ($20::text[])[s.d_index] END,
        CASE WHEN s.d_index > 0 THEN ($21::text[])[s.d_index] END,
        CASE WHEN s.d_index < 0 THEN ($14::integer[])[-s.d_index] END,
        s.d_expires_at
    FROM step s
    WHERE $23::boolean AND (s.d_index > 0 OR s.d_outcome = 'completed')
), commit_mode AS MATERIALIZED (
    -- A batch that changed no key and no fence (replays and refusals, no fence given, no
    -- answer recorded) wrote only its history rows: its commit need not wait for the WAL to
    -- reach the disk. A database crash can lose the last such rows, never a key or a fence.
    SELECT set_config('synchronous_commit', 'off', true) AS setting
    WHERE NOT EXISTS (
        SELECT 1 FROM step s
        WHERE s.d_index < 0
            OR s.d_outcome NOT IN ('replay', 'mismatch', 'in_flight', 'unknown')
            OR ($5::bigint[])[s.d_index] IS NOT NULL)
)
-- The mode is read here so that it is set before the statement's transaction commits.
SELECT step.* FROM step, (SELECT count(setting) FROM commit_mode) AS mode;

-- name: release
-- 5xx not stored, or nothing reached the upstream: the key goes, so that a retry runs again.
WITH gone AS (
    DELETE FROM fencegate_idempotency_keys
    WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
    RETURNING tenant, entity, key, fence, attempt, owner, expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, request_id, upstream_status,
        expires_at)
    SELECT tenant, entity, key, fence, 'released', attempt, owner, $5, $6, expires_at
    FROM gone WHERE $7::boolean
)
SELECT count(*) FROM gone;

-- name: release_abandoned
-- A decision the gateway gave up on (503) may still have reserved the key under the owner it
-- named: that reservation goes, whatever its attempt (the owner is this request's alone).
WITH gone AS (
    DELETE FROM fencegate_idempotency_keys
    WHERE tenant = $1 AND key = $2 AND owner = $3 AND state = 'in_flight'
    RETURNING tenant, entity, key, fence, attempt, owner, expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, request_id, expires_at)
    SELECT tenant, entity, key, fence, 'released', attempt, owner, $4, expires_at
    FROM gone WHERE $5::boolean
)
SELECT count(*) FROM gone;

-- name: mark_unknown
-- locked_until keeps the moment the outcome became unknown (shown to the caller).
WITH marked AS (
    UPDATE fencegate_idempotency_keys SET state = 'outcome_unknown', locked_until = now()
    WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
    RETURNING tenant, entity, key, fence, attempt, owner, expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, request_id, expires_at)
    SELECT tenant, entity, key, fence, 'marked_unknown', attempt, owner, $5, expires_at
    FROM marked WHERE $6::boolean
)
SELECT count(*) FROM marked;

-- name: renew
-- The lease runs from when the row is written, not from when the statement began (it may
-- have waited for the row).
UPDATE fencegate_idempotency_keys SET locked_until = clock_timestamp() + make_interval(secs => $5)
WHERE tenant = $1 AND key = $2 AND owner = $3 AND attempt = $4 AND state = 'in_flight'
  AND locked_until > clock_timestamp();

-- name: remember_nonce
-- A nonce row that has expired may be reused; an unexpired one is a replayed signature.
INSERT INTO fencegate_signature_nonces AS n (key_id, nonce, expires_at)
VALUES ($1, $2, now() + make_interval(secs => $3))
ON CONFLICT (key_id, nonce) DO UPDATE SET expires_at = EXCLUDED.expires_at
    WHERE n.expires_at <= now()
RETURNING 1;

-- name: get_key
-- One key as an operator sees it; unknown = marked so, or in flight with an expired lease.
SELECT tenant, key, state::text AS state, owner, attempt, entity, fence, fingerprint,
    extract(epoch FROM locked_until)::float8 AS locked_until,
    extract(epoch FROM reserved_at)::float8 AS reserved_at,
    extract(epoch FROM created_at)::float8 AS created_at,
    extract(epoch FROM completed_at)::float8 AS completed_at,
    extract(epoch FROM expires_at)::float8 AS expires_at,
    response_status, extract(epoch FROM now())::float8 AS now,
    (state = 'outcome_unknown' OR (state = 'in_flight' AND locked_until <= now())) AS unknown
FROM fencegate_idempotency_keys WHERE tenant = $1 AND key = $2;

-- name: resolve_completed
-- An operator records the upstream's real answer for a key whose outcome is unknown.
WITH resolved AS (
    UPDATE fencegate_idempotency_keys SET state = 'completed', owner = $3,
        response_status = $4, response_headers = $5::jsonb, response_body = $6,
        response_sha256 = $7, body_too_large = false, completed_at = now(), locked_until = NULL
    WHERE tenant = $1 AND key = $2
        AND (state = 'outcome_unknown' OR (state = 'in_flight' AND locked_until <= now()))
    RETURNING tenant, entity, key, fence, attempt, owner, expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, upstream_status, expires_at)
    SELECT tenant, entity, key, fence, 'resolved_completed', attempt, owner, $4, expires_at
    FROM resolved
)
SELECT count(*) FROM resolved;

-- name: resolve_released
-- An operator releases a key whose outcome is unknown: the next request runs again.
WITH released AS (
    DELETE FROM fencegate_idempotency_keys
    WHERE tenant = $1 AND key = $2
        AND (state = 'outcome_unknown' OR (state = 'in_flight' AND locked_until <= now()))
    RETURNING tenant, entity, key, fence, attempt, expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, expires_at)
    SELECT tenant, entity, key, fence, 'resolved_released', attempt, $3, expires_at
    FROM released
)
SELECT count(*) FROM released;

-- name: applied_migrations
SELECT name FROM fencegate_migrations ORDER BY name;

-- name: migrations_table
SELECT to_regclass('fencegate_migrations') IS NOT NULL;

-- name: purge_keys
DELETE FROM fencegate_idempotency_keys WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM fencegate_idempotency_keys WHERE expires_at <= now() LIMIT $1));

-- name: purge_fences
DELETE FROM fencegate_fences WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM fencegate_fences
    WHERE updated_at <= now() - make_interval(secs => $2) LIMIT $1));

-- name: purge_nonces
DELETE FROM fencegate_signature_nonces WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM fencegate_signature_nonces WHERE expires_at <= now() LIMIT $1));

-- name: purge_decisions
-- Oldest first along the primary key (rows are inserted in time order).
DELETE FROM fencegate_decisions WHERE id = ANY(ARRAY(
    SELECT id FROM fencegate_decisions WHERE expires_at <= now() ORDER BY id LIMIT $1));

-- name: ping
SELECT 1;
