-- The lease queue's statements on SQLite (fencegate/lease/drivers/sqlite.py runs them by name,
-- each write inside one BEGIN IMMEDIATE transaction). Times are epoch seconds from the
-- database clock, read once per transaction (lease_now) and passed as :now, so that every
-- comparison in it agrees. A row "held" by the presenter of a lease matches its id, state
-- 'running', owner and token, with lease_until still in the future.
-- :kinds is a JSON array of kinds, or NULL for any kind.
-- Whether a failed attempt ends the job or is retried is decided once, by the queue
-- (fencegate/lease/policy.py): here a NULL :retry_in means "failed for good".

-- name: lease_now
SELECT (julianday('now') - 2440587.5) * 86400.0;

-- name: lease_ping
SELECT 1;

-- name: lease_enqueue
-- Nothing comes back for a key that exists already: the driver then reads its id.
INSERT INTO fencegate_jobs (kind, payload, idempotency_key, max_attempts, lease_seconds,
    heartbeat_seconds, jitter_seconds, stage_timeout_seconds, tool_timeout_seconds, run_after,
    created_at, updated_at, priority, concurrency_key, model)
VALUES (:kind, :payload, :idempotency_key, :max_attempts, :lease_seconds, :heartbeat_seconds,
    :jitter_seconds, :stage_timeout_seconds, :tool_timeout_seconds, :now + :run_after_seconds,
    :now, :now, :priority, :concurrency_key, :model)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- name: lease_job_by_key
SELECT id FROM fencegate_jobs WHERE idempotency_key = :idempotency_key;

-- template: lease_fail_exhausted
-- Expired leases with no attempt left fail instead of going back to work. This and the
-- other claim statements below come in three variants that differ only in the kind filter
-- (:kinds is a JSON array of kinds, or NULL for any): one kind searches the (kind, id)
-- index, several or any walk the (id) index of queued work in order and stop at the limit,
-- so that the cost does not grow with the backlog or with the finished jobs before it
-- (tests/integration/lease/test_claim_plan.py reads the plans).
UPDATE fencegate_jobs
   SET state = 'failed', lease_until = NULL, updated_at = :now,
       error = json_quote('lease expired on attempt ' || attempt || ' of ' || max_attempts)
 WHERE state = 'running' AND lease_until < :now AND attempt >= max_attempts
   AND /* TEMPLATE: kinds */
RETURNING fencing_token, error;

-- name: lease_fail_exhausted_one_kind from lease_fail_exhausted
-- kinds: kind = json_extract(:kinds, '$[0]')

-- name: lease_fail_exhausted_kinds from lease_fail_exhausted
-- kinds: kind IN (SELECT value FROM json_each(:kinds))

-- name: lease_fail_exhausted_any from lease_fail_exhausted
-- kinds: :kinds IS NULL

-- template: lease_claimable_expired
-- Within a priority expired leases are taken first: they have waited longest (ties in id
-- order). Kinds and keys already full (:full_kinds, :full_keys: JSON arrays, the keys as
-- [kind, key] pairs) are skipped by the scan itself.
SELECT id, kind, concurrency_key, priority, state, fencing_token, attempt, max_attempts,
       json_quote('lease expired on attempt ' || attempt || ' of ' || max_attempts)
           AS expiry_error, 0 AS pass, lease_until AS expired_at
  FROM fencegate_jobs
 WHERE state = 'running' AND lease_until < :now AND attempt < max_attempts
   AND /* TEMPLATE: kinds */
   AND kind NOT IN (SELECT value FROM json_each(:full_kinds))
   AND NOT EXISTS (SELECT 1 FROM json_each(:full_keys) AS f
                    WHERE json_extract(f.value, '$[0]') = kind
                      AND json_extract(f.value, '$[1]') = concurrency_key)
 ORDER BY priority DESC, lease_until, id
 LIMIT :limit;

-- name: lease_claimable_expired_one_kind from lease_claimable_expired
-- kinds: kind = json_extract(:kinds, '$[0]')

-- name: lease_claimable_expired_kinds from lease_claimable_expired
-- kinds: kind IN (SELECT value FROM json_each(:kinds))

-- name: lease_claimable_expired_any from lease_claimable_expired
-- kinds: :kinds IS NULL

-- template: lease_claimable_queued
SELECT id, kind, concurrency_key, priority, state, fencing_token, attempt, max_attempts,
       NULL AS expiry_error, 1 AS pass, NULL AS expired_at
  FROM fencegate_jobs /* TEMPLATE: index */
 WHERE state = 'queued' AND run_after <= :now AND /* TEMPLATE: kinds */
   AND kind NOT IN (SELECT value FROM json_each(:full_kinds))
   AND NOT EXISTS (SELECT 1 FROM json_each(:full_keys) AS f
                    WHERE json_extract(f.value, '$[0]') = kind
                      AND json_extract(f.value, '$[1]') = concurrency_key)
 ORDER BY priority DESC, id
 LIMIT :limit;

-- name: lease_claimable_queued_one_kind from lease_claimable_queued
-- index: INDEXED BY fencegate_jobs_queued
-- kinds: kind = json_extract(:kinds, '$[0]')

-- name: lease_claimable_queued_kinds from lease_claimable_queued
-- Left to itself the planner may read the whole table in rowid order, finished jobs too.
-- index: INDEXED BY fencegate_jobs_queued_any
-- kinds: kind IN (SELECT value FROM json_each(:kinds))

-- name: lease_claimable_queued_any from lease_claimable_queued
-- index: INDEXED BY fencegate_jobs_queued_any
-- kinds: :kinds IS NULL

-- name: lease_take_tokens
-- A block of :count tokens from the one counter; the driver hands them out in job id order.
UPDATE fencegate_sequences SET value = value + :count
 WHERE name = 'fencing_token'
RETURNING value;

-- name: lease_grant
UPDATE fencegate_jobs
   SET state = 'running', owner_id = :owner_id, fencing_token = :token,
       lease_until = :now + lease_seconds, heartbeat_at = :now, attempt = attempt + 1,
       updated_at = :now, error = COALESCE(:expiry_error, error)
 WHERE id = :id
RETURNING id, kind, owner_id, fencing_token, lease_until, lease_seconds, heartbeat_seconds,
          attempt, max_attempts, payload, idempotency_key, stage_timeout_seconds,
          tool_timeout_seconds, priority, concurrency_key, model;

-- name: lease_open_attempt
INSERT INTO fencegate_job_attempts (fencing_token, job_id, attempt, owner_id, claimed_at)
VALUES (:token, :id, :attempt, :owner_id, :now);

-- name: lease_end_attempt
UPDATE fencegate_job_attempts SET ended_at = :now, outcome = :outcome, error = :error
 WHERE fencing_token = :token AND ended_at IS NULL;

-- name: lease_extend
UPDATE fencegate_jobs
   SET lease_until = :now + lease_seconds, heartbeat_at = :now, updated_at = :now
 WHERE id = :id AND state = 'running' AND owner_id = :owner_id AND fencing_token = :token
   AND lease_until > :now
RETURNING lease_until;

-- name: lease_complete
UPDATE fencegate_jobs
   SET state = 'succeeded', result = :result, error = NULL, lease_until = NULL,
       updated_at = :now
 WHERE id = :id AND state = 'running' AND owner_id = :owner_id AND fencing_token = :token
   AND lease_until > :now
RETURNING fencing_token;

-- name: lease_fail
-- :retry_in NULL: the job fails for good (owner kept, for the record); otherwise it is
-- queued again after :retry_in seconds.
UPDATE fencegate_jobs
   SET state = CASE WHEN :retry_in IS NULL THEN 'failed' ELSE 'queued' END,
       run_after = CASE WHEN :retry_in IS NULL THEN run_after ELSE :now + :retry_in END,
       owner_id = CASE WHEN :retry_in IS NULL THEN owner_id END,
       error = :error, lease_until = NULL, updated_at = :now
 WHERE id = :id AND state = 'running' AND owner_id = :owner_id AND fencing_token = :token
   AND lease_until > :now
RETURNING fencing_token, state;

-- name: lease_release
-- Released work is not a failure: the attempt is given back so it does not count.
UPDATE fencegate_jobs
   SET state = 'queued', owner_id = NULL, lease_until = NULL, attempt = attempt - 1,
       run_after = :now, updated_at = :now
 WHERE id = :id AND state = 'running' AND owner_id = :owner_id AND fencing_token = :token
   AND lease_until > :now
RETURNING fencing_token;

-- name: lease_cancel_target
SELECT state, fencing_token FROM fencegate_jobs WHERE id = :id;

-- name: lease_cancel
UPDATE fencegate_jobs
   SET state = 'cancelled', lease_until = NULL, error = :error, updated_at = :now
 WHERE id = :id;

-- name: lease_retry
-- An operator's retry of a failed or cancelled job (the driver reads its state first, in the
-- same transaction): queued now with one more attempt, its history kept.
UPDATE fencegate_jobs
   SET state = 'queued', run_after = :now, owner_id = NULL, lease_until = NULL,
       max_attempts = max(max_attempts, attempt + 1), error = NULL, updated_at = :now
 WHERE id = :id AND state IN ('failed', 'cancelled');

-- name: lease_get_job
SELECT id, kind, state, owner_id, lease_until, fencing_token, heartbeat_at, attempt,
       max_attempts, run_after, idempotency_key, payload, result, error, lease_seconds,
       heartbeat_seconds, jitter_seconds, stage_timeout_seconds, created_at, updated_at,
       tool_timeout_seconds, priority, concurrency_key, model
  FROM fencegate_jobs WHERE id = ?1;

-- name: lease_list_jobs
SELECT id, kind, state, owner_id, lease_until, fencing_token, heartbeat_at, attempt,
       max_attempts, run_after, idempotency_key, payload, result, error, lease_seconds,
       heartbeat_seconds, jitter_seconds, stage_timeout_seconds, created_at, updated_at,
       tool_timeout_seconds, priority, concurrency_key, model
  FROM fencegate_jobs
 WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR kind = ?2)
   AND (?4 IS NULL OR id < ?4)  -- the page after the one that ended at job ?4
 ORDER BY id DESC
 LIMIT ?3;

-- name: lease_attempts
SELECT job_id, attempt, fencing_token, owner_id, claimed_at, ended_at, outcome, error
  FROM fencegate_job_attempts WHERE job_id = ?1 ORDER BY fencing_token;

-- name: lease_stage_result
SELECT job_id, name, idempotency_key, result, fencing_token, committed_at
  FROM fencegate_job_stages WHERE job_id = ?1 AND name = ?2;

-- name: lease_held
SELECT 1 FROM fencegate_jobs
 WHERE id = :id AND state = 'running' AND owner_id = :owner_id AND fencing_token = :token
   AND lease_until > :now;

-- name: lease_insert_stage
INSERT INTO fencegate_job_stages
    (job_id, name, idempotency_key, result, fencing_token, committed_at)
VALUES (:id, :name, :idempotency_key, :result, :token, :now)
ON CONFLICT (job_id, name) DO NOTHING
RETURNING 1;

-- name: lease_stage_is_mine
-- A stage already committed under the same token counts as committed (a retried call);
-- under another token it does not.
SELECT 1 FROM fencegate_job_stages WHERE job_id = :id AND name = :name AND fencing_token = :token;

-- template: lease_ready
-- Claimable work exists (SQLite has no notifications: wait_for_work polls this). Two
-- searches, each on its own partial index, rather than one scan of the whole table.
SELECT 1
 WHERE EXISTS (SELECT 1 FROM fencegate_jobs /* TEMPLATE: index */
                WHERE state = 'queued' AND run_after <= :now AND /* TEMPLATE: kinds */)
    OR EXISTS (SELECT 1 FROM fencegate_jobs
                WHERE state = 'running' AND lease_until < :now AND /* TEMPLATE: kinds */);

-- name: lease_ready_one_kind from lease_ready
-- index: INDEXED BY fencegate_jobs_queued
-- kinds: kind = json_extract(:kinds, '$[0]')

-- name: lease_ready_kinds from lease_ready
-- index: INDEXED BY fencegate_jobs_queued_any
-- kinds: kind IN (SELECT value FROM json_each(:kinds))

-- name: lease_ready_any from lease_ready
-- index: INDEXED BY fencegate_jobs_queued_any
-- kinds: :kinds IS NULL

-- name: lease_limits
-- The limits in force for the kinds claimed (see PostgreSQL's lease_claim for the rules).
SELECT kind, max_running, max_running_per_key, provider
  FROM fencegate_work_classes
 WHERE (max_running IS NOT NULL OR max_running_per_key IS NOT NULL
        OR provider IN (SELECT provider FROM fencegate_rate_limits))
   AND (:kinds IS NULL OR kind IN (SELECT value FROM json_each(:kinds)));

-- name: lease_live
-- Jobs holding a live lease, per kind and key, of the limited kinds (:limited, a JSON array).
SELECT kind, concurrency_key, count(*) AS n
  FROM fencegate_jobs
 WHERE state = 'running' AND lease_until >= :now
   AND kind IN (SELECT value FROM json_each(:limited))
 GROUP BY kind, concurrency_key;

-- name: lease_buckets
SELECT provider, capacity, per_seconds, tokens, refilled_at
  FROM fencegate_rate_limits
 WHERE provider IN (SELECT value FROM json_each(:providers));

-- name: lease_spend_tokens
UPDATE fencegate_rate_limits SET tokens = :tokens, refilled_at = :at WHERE provider = :provider;

-- name: lease_declare_work_class
INSERT INTO fencegate_work_classes (kind, max_running, max_running_per_key, provider, updated_at)
VALUES (:kind, :max_running, :max_running_per_key, :provider, :now)
ON CONFLICT (kind) DO UPDATE
   SET max_running = excluded.max_running, max_running_per_key = excluded.max_running_per_key,
       provider = excluded.provider, updated_at = excluded.updated_at
 WHERE (max_running, max_running_per_key, provider)
       IS NOT (excluded.max_running, excluded.max_running_per_key, excluded.provider);

-- name: lease_declare_rate_limit
INSERT INTO fencegate_rate_limits (provider, capacity, per_seconds, tokens, refilled_at)
VALUES (:provider, :capacity, :per_seconds, :capacity, :now)
ON CONFLICT (provider) DO UPDATE
   SET capacity = excluded.capacity, per_seconds = excluded.per_seconds,
       tokens = min(tokens, excluded.capacity)
 WHERE (capacity, per_seconds) IS NOT (excluded.capacity, excluded.per_seconds);

-- name: lease_job_summary
-- A job as an operator's audit record keeps it, before and after the action, read in the
-- action's write transaction.
SELECT id, kind, state, attempt, max_attempts, fencing_token, owner_id
  FROM fencegate_jobs WHERE id = ?1;
