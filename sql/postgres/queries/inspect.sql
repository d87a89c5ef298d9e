-- What operators read and do (fencegate/store/inspect.py): the command line and the console
-- run these. Times are epoch seconds; the same positional parameters as on SQLite.

-- name: clock
SELECT extract(epoch FROM now())::float8 AS now;

-- name: keys
-- Keys of one tenant (or all: $1 NULL) by the operator's state (fencegate/store/key_states.py):
-- an in-flight key whose lease ran out is outcome_unknown (reason lease_expired), like a key
-- marked so (upstream_timeout). In key order after the cursor.
SELECT tenant, key,
    CASE WHEN state = 'in_flight' AND locked_until <= now() THEN 'outcome_unknown'
         ELSE state::text END AS state,
    CASE WHEN state = 'outcome_unknown' THEN 'upstream_timeout'
         WHEN state = 'in_flight' AND locked_until <= now() THEN 'lease_expired' END AS reason,
    owner, attempt, entity, fence,
    extract(epoch FROM locked_until)::float8 AS locked_until,
    extract(epoch FROM created_at)::float8 AS created_at,
    extract(epoch FROM completed_at)::float8 AS completed_at,
    extract(epoch FROM expires_at)::float8 AS expires_at,
    response_status
FROM fencegate_idempotency_keys
WHERE ($1::text IS NULL OR tenant = $1)
    AND ($2::text IS NULL
         OR ($2 = 'outcome_unknown' AND (state = 'outcome_unknown'
                                         OR (state = 'in_flight' AND locked_until <= now())))
         OR ($2 = 'in_flight' AND state = 'in_flight' AND locked_until > now())
         OR ($2 = 'completed' AND state = 'completed'))
    AND ($3::text IS NULL OR (tenant, key) > ($4::text, $3::text))
ORDER BY tenant, key
LIMIT $5;

-- name: decisions_for
-- One tenant's decisions about an entity or a key (the subject), oldest first.
SELECT id, extract(epoch FROM at)::float8 AS at, tenant, entity, key, fence, decision, attempt,
    owner, request_id, method, target, upstream_status
FROM fencegate_decisions
WHERE ($1::text IS NULL OR tenant = $1) AND (entity = $2 OR key = $2)
ORDER BY id
LIMIT $3;

-- name: fence
SELECT tenant, entity, last_accepted, extract(epoch FROM updated_at)::float8 AS updated_at
FROM fencegate_fences WHERE ($1::text IS NULL OR tenant = $1) AND entity = $2;

-- name: jobs
-- Jobs newest first, before the cursor (an id), by state and kind.
SELECT id, kind, state, owner_id, fencing_token, attempt, max_attempts, idempotency_key,
    priority, concurrency_key,
    extract(epoch FROM lease_until)::float8 AS lease_until,
    extract(epoch FROM heartbeat_at)::float8 AS heartbeat_at,
    extract(epoch FROM run_after)::float8 AS run_after,
    extract(epoch FROM created_at)::float8 AS created_at,
    extract(epoch FROM updated_at)::float8 AS updated_at,
    error IS NOT NULL AS has_error
FROM fencegate_jobs
WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR kind = $2)
    AND ($3::bigint IS NULL OR id < $3)
ORDER BY id DESC
LIMIT $4;

-- name: job
SELECT id, kind, state, owner_id, fencing_token, attempt, max_attempts, idempotency_key,
    extract(epoch FROM lease_until)::float8 AS lease_until,
    extract(epoch FROM heartbeat_at)::float8 AS heartbeat_at,
    extract(epoch FROM run_after)::float8 AS run_after,
    extract(epoch FROM created_at)::float8 AS created_at,
    extract(epoch FROM updated_at)::float8 AS updated_at,
    error::text AS error, lease_seconds, heartbeat_seconds
FROM fencegate_jobs WHERE id = $1;

-- name: attempts
SELECT job_id, attempt, fencing_token, owner_id,
    extract(epoch FROM claimed_at)::float8 AS claimed_at,
    extract(epoch FROM ended_at)::float8 AS ended_at, outcome, error::text AS error
FROM fencegate_job_attempts WHERE job_id = $1 ORDER BY fencing_token;

-- name: attempts_by_token
-- The lease grants behind the fences a gateway saw: tokens come from one sequence, so a
-- token names one attempt of one job (if the fence came from this queue at all: the trace
-- checks the request also carried the job's key or entity). $1 is a JSON array of fencing
-- tokens, as on SQLite.
SELECT a.job_id, a.attempt, a.fencing_token, a.owner_id, j.kind, j.idempotency_key,
    extract(epoch FROM a.claimed_at)::float8 AS claimed_at,
    extract(epoch FROM a.ended_at)::float8 AS ended_at, a.outcome
FROM fencegate_job_attempts a JOIN fencegate_jobs j ON j.id = a.job_id
WHERE a.fencing_token IN (SELECT jsonb_array_elements_text($1::jsonb)::bigint)
ORDER BY a.fencing_token;

-- name: stages
SELECT job_id, name, idempotency_key, fencing_token,
    extract(epoch FROM committed_at)::float8 AS committed_at
FROM fencegate_job_stages WHERE job_id = $1 ORDER BY committed_at;

-- name: queue_depth
SELECT kind, state, count(*)::bigint AS jobs FROM fencegate_jobs GROUP BY kind, state
ORDER BY kind, state;

-- name: running_leases
SELECT id, kind, owner_id, fencing_token, attempt,
    extract(epoch FROM lease_until - now())::float8 AS lease_left,
    extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age
FROM fencegate_jobs WHERE state = 'running' ORDER BY lease_until LIMIT $1;

-- name: reclaimed
-- Leases that ran out (their holder crashed or was cut off) and were granted again.
SELECT count(*)::bigint FROM fencegate_job_attempts WHERE outcome = 'lease_expired';

-- name: unknown_keys
SELECT count(*)::bigint FROM fencegate_idempotency_keys
WHERE ($1::text IS NULL OR tenant = $1)
    AND (state = 'outcome_unknown' OR (state = 'in_flight' AND locked_until <= now()));

-- name: recent_decisions
-- Decisions of the last $2 seconds, by decision: the 412 rate is stale over all.
SELECT decision, count(*)::bigint AS decisions FROM fencegate_decisions
WHERE ($1::text IS NULL OR tenant = $1) AND at > now() - make_interval(secs => $2)
GROUP BY decision ORDER BY decision;

-- name: jobs_purge
-- Finished jobs older than the cut-off, with their attempts and stages (ON DELETE CASCADE).
DELETE FROM fencegate_jobs WHERE id = ANY(ARRAY(
    SELECT id FROM fencegate_jobs
    WHERE state IN ('succeeded', 'failed', 'cancelled')
        AND updated_at <= now() - make_interval(secs => $1)
    ORDER BY id LIMIT $2));

-- name: audit
INSERT INTO fencegate_audit (actor, action, tenant, subject, reason, before, after)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7::jsonb);

-- name: audit_log
SELECT id, extract(epoch FROM at)::float8 AS at, actor, action, tenant, subject, reason,
    before::text AS before, after::text AS after
FROM fencegate_audit WHERE ($1::text IS NULL OR tenant = $1 OR tenant IS NULL)
ORDER BY id DESC LIMIT $2;

-- name: job_payload
-- Only for a console started with --show-payloads: what the job was given, what it returned,
-- and its error in full (a message may quote the payload).
SELECT payload::text AS payload, result::text AS result, error::text AS error
FROM fencegate_jobs WHERE id = $1;

-- name: ownership_by_kind
-- The seed's ownership gauges, by work class, provider (the work class's) and model (the
-- job's), read from the queue itself: the console and a Prometheus scrape see the same numbers.
SELECT kind, COALESCE((SELECT w.provider FROM fencegate_work_classes AS w
                        WHERE w.kind = j.kind), '') AS provider,
    COALESCE(model, '') AS model,
    count(*) FILTER (WHERE state = 'queued')::bigint AS queued,
    count(*) FILTER (WHERE state = 'running')::bigint AS running,
    count(*) FILTER (WHERE state = 'running' AND lease_until <= now())::bigint AS expired,
    min(extract(epoch FROM lease_until - now())) FILTER (
        WHERE state = 'running' AND lease_until > now())::float8 AS lease_remaining_min,
    max(extract(epoch FROM now() - heartbeat_at)) FILTER (
        WHERE state = 'running')::float8 AS heartbeat_age_max,
    (SELECT count(*) FROM fencegate_job_attempts a
     WHERE a.outcome = 'lease_expired'
        AND a.job_id IN (SELECT id FROM fencegate_jobs k WHERE k.kind = j.kind
                                                      AND k.model IS NOT DISTINCT FROM j.model))::bigint
        AS reclaimed
FROM fencegate_jobs j GROUP BY kind, model ORDER BY kind, model;

-- name: scheduling_limits
-- Each limit in force (sql/postgres/007_scheduling.sql): how many jobs run under it (a live
-- lease), and how many ready jobs it holds back now. A rate limit's `detail` is the tokens
-- in its bucket now.
WITH live AS (
    SELECT kind, concurrency_key FROM fencegate_jobs
     WHERE state = 'running' AND lease_until > now()
),
ready AS (
    SELECT kind, concurrency_key FROM fencegate_jobs
     WHERE state = 'queued' AND run_after <= now()
),
kinds AS (
    SELECT w.*, (SELECT count(*) FROM live WHERE live.kind = w.kind) AS running,
           (SELECT count(*) FROM ready WHERE ready.kind = w.kind) AS ready
      FROM fencegate_work_classes AS w
),
buckets AS (
    SELECT r.provider, r.capacity, r.per_seconds,
           least(r.capacity, r.tokens + r.capacity / r.per_seconds
                 * greatest(extract(epoch FROM clock_timestamp() - r.refilled_at), 0)) AS tokens
      FROM fencegate_rate_limits AS r
)
SELECT 'max_running' AS rule, kind AS subject, max_running::text AS "limit",
       running::bigint, (CASE WHEN running >= max_running THEN ready ELSE 0 END)::bigint AS waiting,
       NULL::text AS detail
  FROM kinds WHERE max_running IS NOT NULL
UNION ALL
SELECT 'max_running_per_key', k.kind, k.max_running_per_key::text || ' per key',
       (SELECT count(*) FROM live WHERE live.kind = k.kind
                                    AND live.concurrency_key IS NOT NULL)::bigint,
       (SELECT count(*) FROM ready
         WHERE ready.kind = k.kind AND ready.concurrency_key IN (
               SELECT concurrency_key FROM live WHERE live.kind = k.kind
                GROUP BY concurrency_key HAVING count(*) >= k.max_running_per_key))::bigint,
       NULL::text
  FROM kinds AS k WHERE k.max_running_per_key IS NOT NULL
UNION ALL
SELECT 'rate', b.provider, b.capacity::text || ' per ' || b.per_seconds::text || 's',
       (SELECT count(*) FROM live JOIN fencegate_work_classes AS w ON w.kind = live.kind
         WHERE w.provider = b.provider)::bigint,
       (CASE WHEN b.tokens >= 1 THEN 0
             ELSE (SELECT count(*) FROM ready JOIN fencegate_work_classes AS w
                     ON w.kind = ready.kind WHERE w.provider = b.provider) END)::bigint,
       floor(b.tokens)::text || ' tokens'
  FROM buckets AS b
 ORDER BY subject, rule;
