-- What operators read and do (fencegate/store/inspect.py), on SQLite: the same queries and
-- the same positional parameters (?1, ?2, …) as on PostgreSQL.

-- name: clock
SELECT (julianday('now') - 2440587.5) * 86400.0 AS now;

-- name: keys
-- Keys by the operator's state (fencegate/store/key_states.py): an in-flight key whose lease
-- ran out is outcome_unknown (reason lease_expired), like a key marked so (upstream_timeout).
SELECT tenant, key,
    CASE WHEN state = 'in_flight'
              AND locked_until <= (julianday('now') - 2440587.5) * 86400.0
         THEN 'outcome_unknown' ELSE state END AS state,
    CASE WHEN state = 'outcome_unknown' THEN 'upstream_timeout'
         WHEN state = 'in_flight'
              AND locked_until <= (julianday('now') - 2440587.5) * 86400.0
         THEN 'lease_expired' END AS reason,
    owner, attempt, entity, fence, locked_until, created_at,
    completed_at, expires_at, response_status
FROM fencegate_idempotency_keys
WHERE (?1 IS NULL OR tenant = ?1)
    AND (?2 IS NULL
         OR (?2 = 'outcome_unknown' AND (state = 'outcome_unknown'
             OR (state = 'in_flight'
                 AND locked_until <= (julianday('now') - 2440587.5) * 86400.0)))
         OR (?2 = 'in_flight' AND state = 'in_flight'
             AND locked_until > (julianday('now') - 2440587.5) * 86400.0)
         OR (?2 = 'completed' AND state = 'completed'))
    AND (?3 IS NULL OR (tenant, key) > (?4, ?3))
ORDER BY tenant, key
LIMIT ?5;

-- name: decisions_for
SELECT id, at, tenant, entity, key, fence, decision, attempt, owner, request_id, method,
    target, upstream_status
FROM fencegate_decisions
WHERE (?1 IS NULL OR tenant = ?1) AND (entity = ?2 OR key = ?2)
ORDER BY id
LIMIT ?3;

-- name: fence
SELECT tenant, entity, last_accepted, updated_at
FROM fencegate_fences WHERE (?1 IS NULL OR tenant = ?1) AND entity = ?2;

-- name: jobs
SELECT id, kind, state, owner_id, fencing_token, attempt, max_attempts, idempotency_key,
    priority, concurrency_key,
    lease_until, heartbeat_at, run_after, created_at, updated_at, error IS NOT NULL AS has_error
FROM fencegate_jobs
WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR kind = ?2) AND (?3 IS NULL OR id < ?3)
ORDER BY id DESC
LIMIT ?4;

-- name: job
SELECT id, kind, state, owner_id, fencing_token, attempt, max_attempts, idempotency_key,
    lease_until, heartbeat_at, run_after, created_at, updated_at, error, lease_seconds,
    heartbeat_seconds
FROM fencegate_jobs WHERE id = ?1;

-- name: attempts
SELECT job_id, attempt, fencing_token, owner_id, claimed_at, ended_at, outcome, error
FROM fencegate_job_attempts WHERE job_id = ?1 ORDER BY fencing_token;

-- name: attempts_by_token
-- ?1 is a JSON array of fencing tokens.
SELECT a.job_id, a.attempt, a.fencing_token, a.owner_id, j.kind, j.idempotency_key, a.claimed_at, a.ended_at,
    a.outcome
FROM fencegate_job_attempts a JOIN fencegate_jobs j ON j.id = a.job_id
WHERE a.fencing_token IN (SELECT value FROM json_each(?1))
ORDER BY a.fencing_token;

-- name: stages
SELECT job_id, name, idempotency_key, fencing_token, committed_at
FROM fencegate_job_stages WHERE job_id = ?1 ORDER BY committed_at;

-- name: queue_depth
SELECT kind, state, count(*) AS jobs FROM fencegate_jobs GROUP BY kind, state
ORDER BY kind, state;

-- name: running_leases
SELECT id, kind, owner_id, fencing_token, attempt,
    lease_until - (julianday('now') - 2440587.5) * 86400.0 AS lease_left,
    (julianday('now') - 2440587.5) * 86400.0 - heartbeat_at AS heartbeat_age
FROM fencegate_jobs WHERE state = 'running' ORDER BY lease_until LIMIT ?1;

-- name: reclaimed
SELECT count(*) FROM fencegate_job_attempts WHERE outcome = 'lease_expired';

-- name: unknown_keys
SELECT count(*) FROM fencegate_idempotency_keys
WHERE (?1 IS NULL OR tenant = ?1)
    AND (state = 'outcome_unknown'
         OR (state = 'in_flight' AND locked_until <= (julianday('now') - 2440587.5) * 86400.0));

-- name: recent_decisions
SELECT decision, count(*) AS decisions FROM fencegate_decisions
WHERE (?1 IS NULL OR tenant = ?1) AND at > (julianday('now') - 2440587.5) * 86400.0 - ?2
GROUP BY decision ORDER BY decision;

-- name: jobs_purge
DELETE FROM fencegate_jobs WHERE id IN (
    SELECT id FROM fencegate_jobs
    WHERE state IN ('succeeded', 'failed', 'cancelled')
        AND updated_at <= (julianday('now') - 2440587.5) * 86400.0 - ?1
    ORDER BY id LIMIT ?2);

-- name: audit
INSERT INTO fencegate_audit (at, actor, action, tenant, subject, reason, before, after)
VALUES ((julianday('now') - 2440587.5) * 86400.0, ?1, ?2, ?3, ?4, ?5, ?6, ?7);

-- name: audit_log
SELECT id, at, actor, action, tenant, subject, reason, before, after
FROM fencegate_audit WHERE (?1 IS NULL OR tenant = ?1 OR tenant IS NULL)
ORDER BY id DESC LIMIT ?2;

-- name: job_payload
-- Only for a console started with --show-payloads: what the job was given, what it returned,
-- and its error in full (a message may quote the payload).
SELECT payload, result, error FROM fencegate_jobs WHERE id = ?1;

-- name: ownership_by_kind
SELECT kind, COALESCE((SELECT w.provider FROM fencegate_work_classes AS w
                        WHERE w.kind = j.kind), '') AS provider,
    COALESCE(model, '') AS model,
    count(*) FILTER (WHERE state = 'queued') AS queued,
    count(*) FILTER (WHERE state = 'running') AS running,
    count(*) FILTER (WHERE state = 'running'
        AND lease_until <= (julianday('now') - 2440587.5) * 86400.0) AS expired,
    min(lease_until - (julianday('now') - 2440587.5) * 86400.0) FILTER (
        WHERE state = 'running'
            AND lease_until > (julianday('now') - 2440587.5) * 86400.0) AS lease_remaining_min,
    max((julianday('now') - 2440587.5) * 86400.0 - heartbeat_at) FILTER (
        WHERE state = 'running') AS heartbeat_age_max,
    (SELECT count(*) FROM fencegate_job_attempts a
     WHERE a.outcome = 'lease_expired'
        AND a.job_id IN (SELECT id FROM fencegate_jobs k WHERE k.kind = j.kind
                                                      AND k.model IS j.model)) AS reclaimed
FROM fencegate_jobs j GROUP BY kind, model ORDER BY kind, model;

-- name: scheduling_limits
-- See sql/postgres/queries/inspect.sql.
WITH clock AS (SELECT (julianday('now') - 2440587.5) * 86400.0 AS now),
live AS (
    SELECT kind, concurrency_key FROM fencegate_jobs, clock
     WHERE state = 'running' AND lease_until > clock.now
),
ready AS (
    SELECT kind, concurrency_key FROM fencegate_jobs, clock
     WHERE state = 'queued' AND run_after <= clock.now
),
kinds AS (
    SELECT w.*, (SELECT count(*) FROM live WHERE live.kind = w.kind) AS running,
           (SELECT count(*) FROM ready WHERE ready.kind = w.kind) AS ready
      FROM fencegate_work_classes AS w
),
buckets AS (
    SELECT r.provider, r.capacity, r.per_seconds,
           min(r.capacity, r.tokens + r.capacity / r.per_seconds
               * max(clock.now - r.refilled_at, 0)) AS tokens
      FROM fencegate_rate_limits AS r, clock
)
SELECT 'max_running' AS rule, kind AS subject, CAST(max_running AS TEXT) AS "limit",
       running, CASE WHEN running >= max_running THEN ready ELSE 0 END AS waiting,
       NULL AS detail
  FROM kinds WHERE max_running IS NOT NULL
UNION ALL
SELECT 'max_running_per_key', k.kind, k.max_running_per_key || ' per key',
       (SELECT count(*) FROM live WHERE live.kind = k.kind AND live.concurrency_key IS NOT NULL),
       (SELECT count(*) FROM ready
         WHERE ready.kind = k.kind AND ready.concurrency_key IN (
               SELECT concurrency_key FROM live WHERE live.kind = k.kind
                GROUP BY concurrency_key HAVING count(*) >= k.max_running_per_key)),
       NULL
  FROM kinds AS k WHERE k.max_running_per_key IS NOT NULL
UNION ALL
SELECT 'rate', b.provider,
       -- Numbers as PostgreSQL prints a double precision: 25, 0.5, 31536000.
       CASE WHEN b.capacity = CAST(b.capacity AS INTEGER)
            THEN CAST(CAST(b.capacity AS INTEGER) AS TEXT) ELSE printf('%g', b.capacity) END
       || ' per ' ||
       CASE WHEN b.per_seconds = CAST(b.per_seconds AS INTEGER)
            THEN CAST(CAST(b.per_seconds AS INTEGER) AS TEXT) ELSE printf('%g', b.per_seconds) END
       || 's',
       (SELECT count(*) FROM live JOIN fencegate_work_classes AS w ON w.kind = live.kind
         WHERE w.provider = b.provider),
       CASE WHEN b.tokens >= 1 THEN 0
            ELSE (SELECT count(*) FROM ready JOIN fencegate_work_classes AS w
                    ON w.kind = ready.kind WHERE w.provider = b.provider) END,
       CAST(CAST(b.tokens AS INTEGER) AS TEXT) || ' tokens'
  FROM buckets AS b
 ORDER BY subject, rule;
