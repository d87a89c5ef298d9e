-- fencegate_remember_nonce: a signature's nonce, remembered until it expires (DESIGN §1
-- step 1). A nonce row that has expired may be reused; an unexpired one is a replayed
-- signature (false). The row is kept with the tenant's other rows (its shard, on Citus,
-- where this is a distributed function on p_tenant): a node that is down refuses only its
-- own tenants' signed requests. The clock is read once into a variable: Citus plans no
-- non-immutable function in an upsert's DO UPDATE.
CREATE OR REPLACE FUNCTION fencegate_remember_nonce(
    p_tenant text, p_key_id text, p_nonce text, p_ttl_seconds double precision)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_now timestamptz := now();
BEGIN
    INSERT INTO fencegate_signature_nonces AS n (tenant, key_id, nonce, expires_at)
    VALUES (p_tenant, p_key_id, p_nonce, v_now + make_interval(secs => p_ttl_seconds))
    ON CONFLICT (tenant, key_id, nonce) DO UPDATE SET expires_at = EXCLUDED.expires_at
        WHERE n.expires_at <= v_now;
    RETURN FOUND;
END;
$$;
