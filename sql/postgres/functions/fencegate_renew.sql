-- fencegate_renew: a gateway renews its in-flight lease on a key while the upstream answers
-- (DESIGN §1 step 5). The lease runs from when the row is written, not from when the
-- statement began (it may have waited for the row): the clock is read once the row is
-- locked. A function rather than one UPDATE because Citus plans no volatile function
-- (clock_timestamp()) in an UPDATE of a distributed table; on Citus it is a distributed
-- function on p_tenant, run on the worker holding the tenant's shard. True: renewed.
CREATE OR REPLACE FUNCTION fencegate_renew(
    p_tenant text, p_key text, p_owner text, p_attempt integer, p_lease_seconds double precision)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_clock timestamptz;
BEGIN
    PERFORM 1 FROM fencegate_idempotency_keys k
    WHERE k.tenant = p_tenant AND k.key = p_key AND k.owner = p_owner
        AND k.attempt = p_attempt AND k.state = 'in_flight'
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    v_clock := clock_timestamp();
    UPDATE fencegate_idempotency_keys k
    SET locked_until = v_clock + make_interval(secs => p_lease_seconds)
    WHERE k.tenant = p_tenant AND k.key = p_key AND k.owner = p_owner
        AND k.attempt = p_attempt AND k.state = 'in_flight' AND k.locked_until > v_clock;
    RETURN FOUND;
END;
$$;
