-- The lease queue's statements on PostgreSQL (fencegate/lease/drivers/postgres.py runs them
-- by name). Each operation is one statement, so one short transaction whose time comparisons
-- all use the database's now(). A row "held" by the presenter of a lease matches its id,
-- state 'running', owner and token, with lease_until still in the future.
-- Whether a failed attempt ends the job or is retried is decided once, by the queue
-- (fencegate/lease/policy.py): here a NULL retry_in means "failed for good".

-- name: lease_now
SELECT clock_timestamp();

-- name: lease_ping
SELECT 1;

-- name: lease_enqueue
-- The keys go first, into fencegate_job_keys (006_job_keys.sql): a job is inserted only for a
-- key this statement inserted, with the id set aside for it, so a key already taken (or taken
-- meanwhile by a transaction that committed: ON CONFLICT waits for it) adds no job. Ids follow
-- each key's first place in the batch. A key taken already gets its job's id from the join;
-- one committed by another transaction after this snapshot yields NULL (the driver runs the
-- statement again).
WITH input AS (
    SELECT *
      FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::float8[], $6::float8[],
                  $7::float8[], $8::float8[], $9::float8[], $10::float8[], $11::int[],
                  $12::text[], $13::text[]) WITH ORDINALITY
           AS t(kind, payload, idempotency_key, max_attempts, lease_seconds, heartbeat_seconds,
                jitter_seconds, stage_timeout_seconds, tool_timeout_seconds, run_after_seconds,
                priority, concurrency_key, model, ord)
),
firsts AS (
    SELECT DISTINCT ON (idempotency_key) * FROM input ORDER BY idempotency_key, ord
),
ids AS (
    SELECT array_agg(t.id ORDER BY t.id) AS sorted
      FROM (SELECT nextval('fencegate_jobs_id_seq') AS id FROM firsts) AS t
),
numbered AS (
    SELECT f.*, (SELECT sorted FROM ids)[row_number() OVER (ORDER BY f.ord)] AS id
      FROM firsts AS f
),
keyed AS (
    INSERT INTO fencegate_job_keys (idempotency_key, job_id)
    SELECT idempotency_key, id FROM numbered ORDER BY id
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key, job_id
),
inserted AS (
    INSERT INTO fencegate_jobs (id, kind, payload, idempotency_key, max_attempts, lease_seconds,
                                heartbeat_seconds, jitter_seconds, stage_timeout_seconds,
                                tool_timeout_seconds, run_after, priority, concurrency_key,
                                model)
    OVERRIDING SYSTEM VALUE
    SELECT n.id, n.kind, COALESCE(n.payload::jsonb, 'null'::jsonb), n.idempotency_key,
           n.max_attempts, n.lease_seconds, n.heartbeat_seconds,
           n.jitter_seconds, n.stage_timeout_seconds, n.tool_timeout_seconds,
           now() + make_interval(secs => n.run_after_seconds), n.priority, n.concurrency_key,
           n.model
      FROM numbered AS n JOIN keyed AS k ON k.job_id = n.id
     ORDER BY n.id
)
SELECT i.ord, COALESCE(k.job_id, e.job_id) AS id
  FROM input AS i
  LEFT JOIN keyed AS k ON k.idempotency_key = i.idempotency_key
  LEFT JOIN fencegate_job_keys AS e ON e.idempotency_key = i.idempotency_key
 ORDER BY i.ord;

-- template: lease_claim
-- One statement: fail the expired jobs that have no attempt left, grant leases on ready or
-- expired jobs within the limits in force, close the expired attempts and open new ones.
-- Order: higher priority first; within a priority, expired leases first (they have waited
-- longest; ties in id order), then queued work in id order, each from its own partial index.
-- Tokens come from the one sequence and, within the batch, follow the job id: the n-th
-- smallest id gets the n-th smallest token, whatever order the UPDATE visits its rows in.
-- $1 the owner of each slot, $2 the kind filter's argument, $3 limit (at most the slots):
-- the n-th job granted (in id order) goes to the n-th slot's owner, so the claims of several
-- workers sharing a queue are one statement. The variants below differ only in the
-- kind filter: one kind walks the (kind, priority, id) index in order, several or any walk
-- (priority, id).
--
-- Limits (fencegate_work_classes, fencegate_rate_limits; written by `lease_declare_*`): a
-- kind's max_running and max_running_per_key count the jobs holding a live lease (an expired
-- lease does not count), and a provider's bucket gives one token per job granted. Keys and
-- kinds already full are skipped by the scans themselves (no head-of-line blocking); the
-- rest are ranked per kind, per key and per provider and cut to the room left. Counting is
-- only sound when claims of a limited kind take turns: the driver runs `lease_claim_lock`
-- first, in the same transaction, so this statement's snapshot sees the claim before it.
-- With limits in force each scan looks ahead four times the limit, since some candidates
-- may be cut; a candidate locked and not granted is locked for this transaction only.
--
-- Cost must not grow with the backlog: a plan made without the limit's value (a generic
-- plan) guesses a tenth of the table for a LIMIT, so every write finds the rows it touches
-- through `= ANY(ARRAY(...))` on a primary key, which is always an index lookup, never a
-- hash join over a scan of the table (tests/integration/lease/test_claim_plan.py reads the
-- plans).
WITH exhausted AS (
    UPDATE fencegate_jobs AS j
       SET state = 'failed', lease_until = NULL, updated_at = now(),
           error = to_jsonb(format('lease expired on attempt %s of %s', j.attempt,
                                   j.max_attempts))
     WHERE j.id = ANY(ARRAY(SELECT id FROM fencegate_jobs
                             WHERE state = 'running' AND lease_until < now()
                               AND attempt >= max_attempts AND /* TEMPLATE: kinds */
                               FOR UPDATE SKIP LOCKED))
    RETURNING j.fencing_token, j.error
),
limits AS (
    SELECT kind, max_running, max_running_per_key, provider
      FROM fencegate_work_classes
     WHERE (max_running IS NOT NULL OR max_running_per_key IS NOT NULL
            OR provider IN (SELECT provider FROM fencegate_rate_limits))
       AND /* TEMPLATE: kinds */
),
live AS (
    SELECT j.kind, j.concurrency_key
      FROM fencegate_jobs AS j
     WHERE j.state = 'running' AND j.lease_until >= now()
       AND j.kind IN (SELECT kind FROM limits)
),
full_kinds AS (
    SELECT l.kind FROM limits AS l
     WHERE l.max_running <= (SELECT count(*) FROM live WHERE live.kind = l.kind)
),
full_keys AS (
    SELECT live.kind, live.concurrency_key FROM live JOIN limits AS l ON l.kind = live.kind
     WHERE live.concurrency_key IS NOT NULL
     GROUP BY live.kind, live.concurrency_key, l.max_running_per_key
    HAVING count(*) >= l.max_running_per_key
),
lookahead AS (
    SELECT CASE WHEN EXISTS (SELECT 1 FROM limits) THEN $3 * 4 ELSE $3 END AS n
),
expired AS (
    SELECT id, kind, concurrency_key, priority, fencing_token AS previous_token,
           to_jsonb(format('lease expired on attempt %s of %s', attempt, max_attempts))
               AS expiry_error,
           0 AS pass, lease_until AS expired_at
      FROM fencegate_jobs AS j
     WHERE state = 'running' AND lease_until < now() AND attempt < max_attempts
       AND /* TEMPLATE: kinds */ AND /* TEMPLATE: room */
       AND kind <> ALL(ARRAY(SELECT kind FROM full_kinds))
       AND NOT EXISTS (SELECT 1 FROM full_keys AS f
                        WHERE f.kind = j.kind AND f.concurrency_key = j.concurrency_key)
     ORDER BY priority DESC, lease_until, id
     LIMIT (SELECT n FROM lookahead)
       FOR UPDATE SKIP LOCKED
),
queued AS (
    -- Each kind asked for (or all kinds at once) walks its index in order and stops at the
    -- lookahead: a scan of several kinds in one index range would read all their queued
    -- jobs to sort them.
    SELECT q.*
      FROM /* TEMPLATE: wanted */ AS wanted(kind)
     CROSS JOIN LATERAL (
        SELECT id, kind, concurrency_key, priority, fencing_token AS previous_token,
               NULL::jsonb AS expiry_error, 1 AS pass, NULL::timestamptz AS expired_at
          FROM fencegate_jobs AS j
         WHERE state = 'queued' AND run_after <= now() AND /* TEMPLATE: wanted_kind */
           AND /* TEMPLATE: room */ AND kind <> ALL(ARRAY(SELECT kind FROM full_kinds))
           AND NOT EXISTS (SELECT 1 FROM full_keys AS f
                            WHERE f.kind = j.kind AND f.concurrency_key = j.concurrency_key)
         ORDER BY priority DESC, id
         LIMIT (SELECT n FROM lookahead)
           FOR UPDATE SKIP LOCKED
     ) AS q
),
clock AS (
    SELECT clock_timestamp() AS at
),
buckets AS (
    -- Tokens now: what was left, plus capacity per per_seconds since, up to the capacity.
    SELECT r.provider,
           floor(least(r.capacity,
                       r.tokens + r.capacity / r.per_seconds
                                  * greatest(extract(epoch FROM c.at - r.refilled_at), 0)))
               AS available,
           least(r.capacity,
                 r.tokens + r.capacity / r.per_seconds
                            * greatest(extract(epoch FROM c.at - r.refilled_at), 0)) AS tokens,
           greatest(c.at, r.refilled_at) AS at
      FROM fencegate_rate_limits AS r, clock AS c
     WHERE r.provider IN (SELECT provider FROM limits)
),
ranked AS (
    SELECT c.*, l.max_running, l.max_running_per_key, b.provider, b.available,
           row_number() OVER (PARTITION BY c.kind
                              ORDER BY c.priority DESC, c.pass, c.expired_at, c.id) AS in_kind,
           row_number() OVER (PARTITION BY c.kind, c.concurrency_key
                              ORDER BY c.priority DESC, c.pass, c.expired_at, c.id) AS in_key,
           row_number() OVER (PARTITION BY b.provider
                              ORDER BY c.priority DESC, c.pass, c.expired_at, c.id) AS in_bucket
      FROM (SELECT * FROM expired UNION ALL SELECT * FROM queued) AS c
      LEFT JOIN limits AS l ON l.kind = c.kind
      LEFT JOIN buckets AS b ON b.provider = l.provider
),
chosen AS (
    SELECT r.* FROM ranked AS r
     WHERE (r.max_running IS NULL
            OR r.in_kind <= r.max_running - (SELECT count(*) FROM live WHERE live.kind = r.kind))
       AND (r.max_running_per_key IS NULL OR r.concurrency_key IS NULL
            OR r.in_key <= r.max_running_per_key
                           - (SELECT count(*) FROM live
                               WHERE live.kind = r.kind
                                 AND live.concurrency_key = r.concurrency_key))
       AND (r.provider IS NULL OR r.in_bucket <= r.available)
     ORDER BY r.priority DESC, r.pass, r.expired_at, r.id
     LIMIT $3
),
spent AS (
    UPDATE fencegate_rate_limits AS r
       SET tokens = b.tokens - (SELECT count(*) FROM chosen AS c WHERE c.provider = b.provider),
           refilled_at = b.at
      FROM buckets AS b
     WHERE r.provider = b.provider
),
picked AS (
    -- The jobs chosen, in id order: the n-th of them goes to the n-th slot's owner and gets
    -- the n-th smallest token (and, an expired lease, its error).
    SELECT array_agg(c.id ORDER BY c.id) AS ids,
           array_agg(c.expiry_error ORDER BY c.id) AS errors
      FROM chosen AS c
),
tokens AS (
    -- One array, read by position: a join of the numbered rows to their tokens was a nested
    -- loop over both (the planner guesses one row for each), n² comparisons per claim.
    SELECT array_agg(t.token ORDER BY t.token) AS sorted
      FROM (SELECT nextval('fencegate_fencing_tokens') AS token FROM chosen) AS t
),
granted AS (
    -- Each job found by primary key, its place in the batch by its position in `ids`: no
    -- join. Joined to the chosen rows, the update became (after ANALYZE of a queue of
    -- queued jobs) a nested loop that looked the whole batch up again for each chosen row:
    -- a claim of 50 read 1,400 rows and threw 1,225 away.
    UPDATE fencegate_jobs AS j
       SET state = 'running',
           owner_id = ($1::text[])[array_position((SELECT ids FROM picked), j.id)],
           fencing_token
               = (SELECT sorted FROM tokens)[array_position((SELECT ids FROM picked), j.id)],
           lease_until = now() + make_interval(secs => j.lease_seconds),
           heartbeat_at = now(), attempt = j.attempt + 1, updated_at = now(),
           error = COALESCE(
               (SELECT errors FROM picked)[array_position((SELECT ids FROM picked), j.id)],
               j.error)
     WHERE j.id = ANY((SELECT ids FROM picked)::bigint[])
    RETURNING j.*
),
ended AS (
    SELECT fencing_token, error FROM exhausted
    UNION ALL
    -- Every chosen row is granted (each is locked by this statement's scans).
    SELECT previous_token, expiry_error FROM chosen WHERE expiry_error IS NOT NULL
),
expired_attempts AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'lease_expired', error = e.error
      FROM ended AS e
     WHERE a.fencing_token = ANY(ARRAY(SELECT fencing_token FROM ended))
       AND a.fencing_token = e.fencing_token AND a.ended_at IS NULL
),
opened AS (
    INSERT INTO fencegate_job_attempts (fencing_token, job_id, attempt, owner_id, claimed_at)
    SELECT fencing_token, id, attempt, owner_id, now() FROM granted
)
SELECT id, kind, owner_id, fencing_token, lease_until, lease_seconds, heartbeat_seconds,
       attempt, max_attempts, payload, idempotency_key, stage_timeout_seconds,
       tool_timeout_seconds, priority, concurrency_key, model
  FROM granted ORDER BY id;

-- name: lease_claim_one_kind from lease_claim
-- A kind already full is not scanned at all (rather than each of its rows filtered out).
-- kinds: kind = $2::text
-- wanted: (VALUES ($2::text))
-- wanted_kind: kind = wanted.kind
-- room: NOT EXISTS (SELECT 1 FROM full_kinds)

-- name: lease_claim_kinds from lease_claim
-- Each kind once: a kind named twice would be walked twice, its rows offered twice.
-- kinds: kind = ANY($2::text[])
-- wanted: (SELECT DISTINCT k FROM unnest($2::text[]) AS k)
-- wanted_kind: kind = wanted.kind
-- room: (SELECT count(*) FROM full_kinds) < cardinality($2::text[])

-- name: lease_claim_any from lease_claim
-- $2 is NULL, so that all three take the same arguments.
-- kinds: $2::text[] IS NULL
-- wanted: (VALUES (NULL::text))
-- wanted_kind: TRUE
-- room: TRUE

-- name: lease_claim_lock
-- Claims of limited kinds, and of kinds whose provider has a bucket, take turns: each takes
-- these transaction locks (one per kind and per provider, in name order so that two claims
-- never wait on each other crosswise) before its claim statement, which then counts what
-- every earlier claim committed. $1: the names, e.g. {kind:browser, provider:stripe}.
SELECT count(pg_advisory_xact_lock(1179010627, hashtext(name)))
  FROM (SELECT DISTINCT name FROM unnest($1::text[]) AS name ORDER BY name) AS ordered;

-- name: lease_declare_work_classes
-- The limits of the work classes a queue declared; the last declaration wins.
INSERT INTO fencegate_work_classes (kind, max_running, max_running_per_key, provider)
SELECT * FROM unnest($1::text[], $2::int[], $3::int[], $4::text[])
ON CONFLICT (kind) DO UPDATE
   SET max_running = excluded.max_running, max_running_per_key = excluded.max_running_per_key,
       provider = excluded.provider, updated_at = now()
 WHERE (fencegate_work_classes.max_running, fencegate_work_classes.max_running_per_key,
        fencegate_work_classes.provider)
       IS DISTINCT FROM (excluded.max_running, excluded.max_running_per_key, excluded.provider);

-- name: lease_declare_rate_limits
-- A bucket starts full; declaring it again with another rate keeps the tokens it has (up to
-- the new capacity).
INSERT INTO fencegate_rate_limits (provider, capacity, per_seconds, tokens)
SELECT provider, capacity, per_seconds, capacity
  FROM unnest($1::text[], $2::float8[], $3::float8[]) AS t(provider, capacity, per_seconds)
ON CONFLICT (provider) DO UPDATE
   SET capacity = excluded.capacity, per_seconds = excluded.per_seconds,
       tokens = least(fencegate_rate_limits.tokens, excluded.capacity)
 WHERE (fencegate_rate_limits.capacity, fencegate_rate_limits.per_seconds)
       IS DISTINCT FROM (excluded.capacity, excluded.per_seconds);

-- name: lease_extend_many
-- Each lease presented finds its job by primary key (the only condition an index can take:
-- the live lease is tested as `(...) IS TRUE`, so that no plan walks the running jobs' index
-- and compares every lease held with every lease presented).
UPDATE fencegate_jobs AS j
   SET lease_until = now() + make_interval(secs => j.lease_seconds), heartbeat_at = now(),
       updated_at = now()
  FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS i(id, owner_id, fencing_token)
 WHERE j.id = i.id AND j.state = 'running'
   AND j.owner_id = i.owner_id AND j.fencing_token = i.fencing_token
   AND (j.lease_until > now()) IS TRUE
RETURNING j.id, j.fencing_token, j.lease_until;

-- name: lease_complete_many
-- Results arrive as JSON text, not jsonb[]: asyncpg would read a list result as a nested
-- array. Each job found by primary key, as in lease_extend_many; its attempt by token, from
-- one array (a join of the two batches was a nested loop: n² comparisons per commit).
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[])
           AS t(id, owner_id, fencing_token, result)
),
done AS (
    UPDATE fencegate_jobs AS j
       SET state = 'succeeded', result = i.result::jsonb, error = NULL, lease_until = NULL,
           updated_at = now()
      FROM input AS i
     WHERE j.id = i.id AND j.state = 'running'
       AND j.owner_id = i.owner_id AND j.fencing_token = i.fencing_token
       AND (j.lease_until > now()) IS TRUE
    RETURNING j.id, j.fencing_token
),
ended AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'succeeded'
     WHERE a.fencing_token = ANY(ARRAY(SELECT fencing_token FROM done))
)
SELECT id FROM done;

-- name: lease_fail_many
-- Each row is matched on its own id, owner, token and live lease (by primary key, as in
-- lease_extend_many). retry_in NULL: the job
-- fails for good (owner kept, for the record); otherwise it is queued again after retry_in
-- seconds.
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::float8[])
           AS t(id, owner_id, fencing_token, error, retry_in)
),
ended AS (
    UPDATE fencegate_jobs AS j
       SET state = CASE WHEN i.retry_in IS NULL THEN 'failed' ELSE 'queued' END,
           run_after = CASE WHEN i.retry_in IS NULL
                            THEN j.run_after ELSE now() + make_interval(secs => i.retry_in) END,
           owner_id = CASE WHEN i.retry_in IS NULL THEN j.owner_id END,
           error = i.error::jsonb, lease_until = NULL, updated_at = now()
      FROM input AS i
     WHERE j.id = i.id AND j.state = 'running'
       AND j.owner_id = i.owner_id AND j.fencing_token = i.fencing_token
       AND (j.lease_until > now()) IS TRUE
    RETURNING j.id, j.fencing_token, j.state, i.error
),
closed AS (
    -- Each attempt by its token (an index probe per ended job).
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), error = e.error::jsonb,
           outcome = CASE WHEN e.state = 'failed' THEN 'failed' ELSE 'retry_scheduled' END
      FROM ended AS e
     WHERE a.fencing_token = e.fencing_token
)
SELECT id, fencing_token, state FROM ended;

-- name: lease_release
-- Released work is not a failure: the attempt is given back so it does not count.
WITH released AS (
    UPDATE fencegate_jobs
       SET state = 'queued', owner_id = NULL, lease_until = NULL, attempt = attempt - 1,
           run_after = now(), updated_at = now()
     WHERE id = $1 AND state = 'running' AND owner_id = $2 AND fencing_token = $3
       AND lease_until > now()
    RETURNING fencing_token
),
closed AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'released'
      FROM released AS r
     WHERE a.fencing_token = $3 AND a.fencing_token = r.fencing_token
)
SELECT count(*) FROM released;

-- name: lease_cancel
-- found = 0: no such job; cancelled = 0: it had already finished.
WITH target AS (
    SELECT id, state, fencing_token FROM fencegate_jobs WHERE id = $1 FOR UPDATE
),
cancelled AS (
    UPDATE fencegate_jobs AS j
       SET state = 'cancelled', lease_until = NULL, error = $2::text::jsonb,
           updated_at = now()
      FROM target AS t
     WHERE j.id = t.id AND t.state IN ('queued', 'running')
    RETURNING t.state AS previous_state, t.fencing_token
),
closed AS (
    UPDATE fencegate_job_attempts AS a
       SET ended_at = now(), outcome = 'cancelled', error = $2::text::jsonb
      FROM cancelled AS c
     WHERE c.previous_state = 'running'
       AND a.fencing_token = (SELECT fencing_token FROM target)
       AND a.fencing_token = c.fencing_token AND a.ended_at IS NULL
)
SELECT (SELECT count(*) FROM target) AS found, (SELECT count(*) FROM cancelled) AS cancelled;

-- name: lease_retry
-- An operator's retry of a failed or cancelled job: queued now with one more attempt, its
-- history kept. found = 0: no such job; retried = 0: it is not failed or cancelled.
WITH target AS (
    SELECT id, state FROM fencegate_jobs WHERE id = $1 FOR UPDATE
),
retried AS (
    UPDATE fencegate_jobs AS j
       SET state = 'queued', run_after = now(), owner_id = NULL, lease_until = NULL,
           max_attempts = greatest(j.max_attempts, j.attempt + 1), error = NULL,
           updated_at = now()
      FROM target AS t
     WHERE j.id = t.id AND t.state IN ('failed', 'cancelled')
    RETURNING j.id
)
SELECT (SELECT count(*) FROM target) AS found, (SELECT count(*) FROM retried) AS retried;

-- name: lease_get_job
SELECT id, kind, state, owner_id, lease_until, fencing_token, heartbeat_at, attempt,
       max_attempts, run_after, idempotency_key, payload, result, error, lease_seconds,
       heartbeat_seconds, jitter_seconds, stage_timeout_seconds, created_at, updated_at,
       tool_timeout_seconds, priority, concurrency_key, model
  FROM fencegate_jobs WHERE id = $1;

-- name: lease_list_jobs
SELECT id, kind, state, owner_id, lease_until, fencing_token, heartbeat_at, attempt,
       max_attempts, run_after, idempotency_key, payload, result, error, lease_seconds,
       heartbeat_seconds, jitter_seconds, stage_timeout_seconds, created_at, updated_at,
       tool_timeout_seconds, priority, concurrency_key, model
  FROM fencegate_jobs
 WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR kind = $2)
   AND ($4::bigint IS NULL OR id < $4)  -- the page after the one that ended at id $4
 ORDER BY id DESC
 LIMIT $3;

-- name: lease_attempts
SELECT job_id, attempt, fencing_token, owner_id, claimed_at, ended_at, outcome, error
  FROM fencegate_job_attempts WHERE job_id = $1 ORDER BY fencing_token;

-- name: lease_stage_result
SELECT job_id, name, idempotency_key, result, fencing_token, committed_at
  FROM fencegate_job_stages WHERE job_id = $1 AND name = $2;

-- name: lease_commit_stage_many
-- Stages of one or several jobs. Each job row is held FOR SHARE (once, whatever number of
-- its stages the batch carries) while the stages are written, so a concurrent reclaim cannot
-- slip in between the ownership check and the insert. A stage already committed under the
-- same token counts as committed (a retried call); under another token it does not.
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::text[],
                         $6::text[]) WITH ORDINALITY
           AS t(id, owner_id, fencing_token, name, idempotency_key, result, ord)
),
holder AS (
    SELECT j.id, j.fencing_token FROM fencegate_jobs AS j
     WHERE j.id = ANY($1::bigint[]) AND j.state = 'running' AND j.lease_until > now()
       AND EXISTS (SELECT 1 FROM input AS i WHERE i.id = j.id AND i.owner_id = j.owner_id
                                              AND i.fencing_token = j.fencing_token)
       FOR SHARE
),
inserted AS (
    INSERT INTO fencegate_job_stages (job_id, name, idempotency_key, result, fencing_token)
    SELECT i.id, i.name, i.idempotency_key, i.result::jsonb, h.fencing_token
      FROM input AS i JOIN holder AS h ON h.id = i.id AND h.fencing_token = i.fencing_token
    ON CONFLICT (job_id, name) DO NOTHING
    RETURNING job_id, name
)
SELECT i.ord,
       EXISTS (SELECT 1 FROM inserted AS n WHERE n.job_id = i.id AND n.name = i.name)
    OR EXISTS (SELECT 1 FROM holder AS h JOIN fencegate_job_stages AS s
                 ON s.job_id = h.id AND s.name = i.name AND s.fencing_token = h.fencing_token
                WHERE h.id = i.id AND h.fencing_token = i.fencing_token) AS committed
  FROM input AS i
 ORDER BY i.ord;

-- name: lease_job_summary
-- A job as an operator's audit record keeps it, before and after the action, read in the
-- action's transaction.
SELECT id, kind, state, attempt, max_attempts, fencing_token, owner_id
  FROM fencegate_jobs WHERE id = $1;

-- name: lease_job_summary_for_update
SELECT id, kind, state, attempt, max_attempts, fencing_token, owner_id
  FROM fencegate_jobs WHERE id = $1 FOR UPDATE;

-- name: lease_audit
-- The audit row of an operator's action on a job, in its transaction: before and after are
-- JSON text (this pool encodes jsonb parameters itself; text is taken as it is).
INSERT INTO fencegate_audit (actor, action, tenant, subject, reason, before, after)
VALUES ($1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb);
