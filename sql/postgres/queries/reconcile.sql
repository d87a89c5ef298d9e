-- The reconciler's statements on PostgreSQL (fencegate/store/reconcile.py runs them by name):
-- keys whose outcome is unknown, settled by asking the upstream (DESIGN §8).

-- name: reconcile_claim
-- One poll, across tenants like the purges: up to $2 keys whose time to be looked at has
-- come, whose outcome is unknown (marked so, or in flight under an expired lease), whose TTL
-- has not run out, and whose release rule says no copy of the request can still reach the
-- upstream ($1: the release margin; the plain comparison lets the function run only for
-- keys past their margin). Rows another gateway's poll (or a step) holds are skipped. Each
-- claimed key's next look is pushed past its probe ($3 seconds) and a backoff that doubles
-- with each try (1 s, 2 s, 4 s ... at most $4), so that two gateways never probe it at once
-- and a gateway that dies while probing leaves it for another. $5: one tenant's keys only, or
-- NULL for every tenant's. On a Citus coordinator the poll names a tenant (the tenants come
-- from reconcile_due_tenants): a statement on one tenant's rows runs on its worker, where
-- the row locks are taken; Citus does not lock rows across shards.
WITH due AS (
    SELECT k.tenant, k.key FROM fencegate_idempotency_keys k
    WHERE k.reconcile_after <= now()
        AND k.state IN ('in_flight', 'outcome_unknown')
        AND k.expires_at > now()
        AND k.locked_until <= now() - make_interval(secs => $1)
        AND ($5::text IS NULL OR k.tenant = $5)
        AND fencegate_release_blocker(k.state, k.owner, k.locked_until, $1,
            (SELECT g.alive_until FROM fencegate_gateways g
             WHERE g.instance = split_part(k.owner, '/', 1)), now()) IS NULL
    ORDER BY k.reconcile_after
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
-- (The next look in epoch seconds: Citus refuses a timestamptz + interval, a STABLE operator,
-- over a column in an UPDATE; now() alone it evaluates before sending the statement.)
UPDATE fencegate_idempotency_keys k
SET reconcile_tries = k.reconcile_tries + 1,
    reconcile_after = to_timestamp(extract(epoch FROM now())::float8
        + $3 + least($4, 2 ^ least(k.reconcile_tries, 20)))
FROM due
WHERE k.tenant = due.tenant AND k.key = due.key AND ($5::text IS NULL OR k.tenant = $5)
RETURNING k.tenant, k.key, k.owner, k.attempt, k.state, k.method, k.target,
    k.request_body, k.entity, k.fence, k.reconcile_tries;

-- name: reconcile_due_tenants
-- On a Citus coordinator, before reconcile_claim: up to $2 tenants with keys the claim would
-- take now ($1: the release margin), those waiting longest first. Reads only, no row locks,
-- so that it may run on every worker at once; the claim then checks each key again.
SELECT k.tenant FROM fencegate_idempotency_keys k
WHERE k.reconcile_after <= now()
    AND k.state IN ('in_flight', 'outcome_unknown')
    AND k.expires_at > now()
    AND k.locked_until <= now() - make_interval(secs => $1)
    AND fencegate_release_blocker(k.state, k.owner, k.locked_until, $1,
        (SELECT g.alive_until FROM fencegate_gateways g
         WHERE g.instance = split_part(k.owner, '/', 1)), now()) IS NULL
GROUP BY k.tenant
ORDER BY min(k.reconcile_after)
LIMIT $2;

-- name: reconcile_complete
-- The upstream ran it: its answer becomes the key's, as if the gateway had recorded it.
-- Only if the key is still as claimed ($3 owner, $4 attempt, $5 state, $6 tries).
WITH done AS (
    UPDATE fencegate_idempotency_keys k
    SET state = 'completed', response_status = $7, response_headers = $8::jsonb,
        response_body = $9, response_sha256 = $10, body_too_large = $11, completed_at = now(),
        locked_until = NULL, resolution = 'reconciled', reconcile_after = NULL,
        reconcile_note = $12
    WHERE k.tenant = $1 AND k.key = $2 AND k.owner IS NOT DISTINCT FROM $3 AND k.attempt = $4
        AND k.state = $5::fencegate_key_state AND k.reconcile_tries = $6
    RETURNING k.tenant, k.entity, k.key, k.fence, k.attempt, k.method, k.target, k.expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, method, target, upstream_status,
        expires_at)
    SELECT tenant, entity, key, fence, 'reconciled_completed', attempt, $13, method, target,
        $7, expires_at
    FROM done
)
SELECT count(*) FROM done;

-- name: reconcile_release
-- The upstream never ran it: the key goes, so that the next request runs. Only if the key is
-- still as claimed, and if its release rule ($7: the margin) still says it is safe.
WITH gone AS (
    DELETE FROM fencegate_idempotency_keys k
    WHERE k.tenant = $1 AND k.key = $2 AND k.owner IS NOT DISTINCT FROM $3 AND k.attempt = $4
        AND k.state = $5::fencegate_key_state AND k.reconcile_tries = $6
        AND fencegate_release_blocker(k.state, k.owner, k.locked_until, $7,
            (SELECT g.alive_until FROM fencegate_gateways g
             WHERE g.instance = split_part(k.owner, '/', 1)), now()) IS NULL
    RETURNING k.tenant, k.entity, k.key, k.fence, k.attempt, k.method, k.target, k.expires_at
), history AS (
    INSERT INTO fencegate_decisions (
        tenant, entity, key, fence, decision, attempt, owner, method, target, expires_at)
    SELECT tenant, entity, key, fence, 'reconciled_released', attempt, $8, method, target,
        expires_at
    FROM gone
)
SELECT count(*) FROM gone;

-- name: reconcile_later
-- No answer either way: why ($8), and when to look again ($7 seconds from now). (The time
-- itself, not its epoch: Citus runs no STABLE function, extract among them, in RETURNING.)
UPDATE fencegate_idempotency_keys k
SET reconcile_after = now() + make_interval(secs => $7), reconcile_note = $8
WHERE k.tenant = $1 AND k.key = $2 AND k.owner IS NOT DISTINCT FROM $3 AND k.attempt = $4
    AND k.state = $5::fencegate_key_state AND k.reconcile_tries = $6
RETURNING k.reconcile_after;
