-- fencegate_mark_unknown: the upstream may have acted, and its answer is not known (DESIGN §1
-- step 6: a timeout or a connection lost after the request was sent). Only while this owner
-- holds the key in flight at this attempt; locked_until keeps the moment the outcome became
-- unknown (shown to the caller); p_reason: the limit that fired. With its history row when
-- p_history says the history is kept. 1: marked. A function for the reason
-- fencegate_release.sql gives (one local transaction on the tenant's worker on Citus).
CREATE OR REPLACE FUNCTION fencegate_mark_unknown(
    p_tenant text, p_key text, p_owner text, p_attempt integer, p_request_id text,
    p_history boolean, p_reason text)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_row fencegate_idempotency_keys%ROWTYPE;
    v_now timestamptz := now();
BEGIN
    UPDATE fencegate_idempotency_keys k
    SET state = 'outcome_unknown', locked_until = v_now, unknown_reason = p_reason
    WHERE k.tenant = p_tenant AND k.key = p_key AND k.owner = p_owner
        AND k.attempt = p_attempt AND k.state = 'in_flight'
    RETURNING k.* INTO v_row;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF p_history THEN
        INSERT INTO fencegate_decisions (
            tenant, entity, key, fence, decision, attempt, owner, request_id, expires_at)
        VALUES (v_row.tenant, v_row.entity, v_row.key, v_row.fence, 'marked_unknown',
            v_row.attempt, v_row.owner, p_request_id, v_row.expires_at);
    END IF;
    RETURN 1;
END;
$$;
