-- The reconciler's statements on SQLite (fencegate/store/reconcile.py runs them by name, in
-- one write transaction per step; the release rule is fencegate/store/release_rule.py).

-- name: reconcile_due
-- Keys whose time to be looked at has come, whose outcome is unknown, whose TTL has not run
-- out and whose lease ended at least a release margin ago; the rest of the release rule is
-- asked in Python.
SELECT tenant, key, owner, state, locked_until FROM fencegate_idempotency_keys
WHERE reconcile_after IS NOT NULL AND reconcile_after <= :now
    AND state IN ('in_flight', 'outcome_unknown') AND expires_at > :now
    AND locked_until <= :now - :margin
ORDER BY reconcile_after;

-- name: gateways_alive
SELECT instance FROM fencegate_gateways WHERE alive_until > :now;

-- name: reconcile_claim
-- The next look goes past the probe (:hold seconds) and a backoff doubling with each try.
UPDATE fencegate_idempotency_keys
SET reconcile_tries = reconcile_tries + 1,
    reconcile_after = :now + :hold + min(:most, 1 << min(reconcile_tries, 20))
WHERE tenant = :tenant AND key = :key
RETURNING tenant, key, owner, attempt, state, method, target, request_body, entity, fence,
    reconcile_tries;

-- name: reconcile_get
-- A claimed key as it is now, inside the transaction that settles it.
SELECT owner, attempt, state, locked_until, reconcile_tries FROM fencegate_idempotency_keys
WHERE tenant = :tenant AND key = :key;

-- name: reconcile_complete
UPDATE fencegate_idempotency_keys
SET state = 'completed', response_status = :status, response_headers = :headers,
    response_body = :body, response_sha256 = :sha256, body_too_large = :too_large,
    completed_at = :now, locked_until = NULL, resolution = 'reconciled',
    reconcile_after = NULL, reconcile_note = :note
WHERE tenant = :tenant AND key = :key AND owner IS :owner AND attempt = :attempt
    AND state = :state AND reconcile_tries = :tries
RETURNING entity, fence, attempt, method, target, expires_at;

-- name: reconcile_release
DELETE FROM fencegate_idempotency_keys
WHERE tenant = :tenant AND key = :key AND owner IS :owner AND attempt = :attempt
    AND state = :state AND reconcile_tries = :tries
RETURNING entity, fence, attempt, method, target, expires_at;

-- name: reconcile_later
UPDATE fencegate_idempotency_keys
SET reconcile_after = :now + :after, reconcile_note = :note
WHERE tenant = :tenant AND key = :key AND owner IS :owner AND attempt = :attempt
    AND state = :state AND reconcile_tries = :tries
RETURNING reconcile_after;
