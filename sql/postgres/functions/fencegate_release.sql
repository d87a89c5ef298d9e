-- fencegate_release: a reservation given up, so that a retry runs again (DESIGN §1 step 6: 5xx
-- not stored, or nothing reached the upstream; and a decision the gateway gave up on, 503,
-- which may still have reserved the key under the owner it named). Deletes the key only while
-- this owner holds it in flight (p_attempt NULL: whatever the attempt, the owner being that
-- request's alone), with its history row when p_history says the history is kept. 1: released.
-- One function rather than one statement with a CTE, because Citus runs such a statement as
-- two (the delete, then the history insert) and commits them with two-phase commit; on Citus
-- this is a distributed function on p_tenant, one local transaction on the tenant's worker.
CREATE OR REPLACE FUNCTION fencegate_release(
    p_tenant text, p_key text, p_owner text, p_attempt integer, p_request_id text,
    p_upstream_status integer, p_history boolean)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_row fencegate_idempotency_keys%ROWTYPE;
BEGIN
    DELETE FROM fencegate_idempotency_keys k
    WHERE k.tenant = p_tenant AND k.key = p_key AND k.owner = p_owner
        AND (p_attempt IS NULL OR k.attempt = p_attempt) AND k.state = 'in_flight'
    RETURNING k.* INTO v_row;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF p_history THEN
        INSERT INTO fencegate_decisions (
            tenant, entity, key, fence, decision, attempt, owner, request_id, upstream_status,
            expires_at)
        VALUES (v_row.tenant, v_row.entity, v_row.key, v_row.fence, 'released', v_row.attempt,
            v_row.owner, p_request_id, p_upstream_status, v_row.expires_at);
    END IF;
    RETURN 1;
END;
$$;
