-- On a Citus coordinator (docs/operations/citus.md), after the migrations: the gateway's
-- tables distributed by tenant and colocated, so that every row of one tenant (its keys,
-- fences, decision history and signature nonces) is on one worker; the gateway registry, which
-- every decision may read, a reference table (a copy on every node); the gateway's functions
-- distributed on their tenant argument, so that Citus runs each call on the worker holding
-- the tenant's shard. The lease queue's tables, the audit and the migrations stay plain
-- tables on the coordinator. `fencegate migrate` runs this on every run: each step is taken
-- only where it is missing, and a function replaced since is distributed again.
DO $$
DECLARE
    v_table text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                   WHERE logicalrelid = 'fencegate_idempotency_keys'::regclass) THEN
        PERFORM create_distributed_table('fencegate_idempotency_keys', 'tenant');
    END IF;
    FOREACH v_table IN ARRAY ARRAY[
        'fencegate_fences', 'fencegate_decisions', 'fencegate_signature_nonces']
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                       WHERE logicalrelid = v_table::regclass) THEN
            PERFORM create_distributed_table(
                v_table, 'tenant', colocate_with => 'fencegate_idempotency_keys');
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                   WHERE logicalrelid = 'fencegate_gateways'::regclass) THEN
        PERFORM create_reference_table('fencegate_gateways');
    END IF;
    PERFORM create_distributed_function(
        'fencegate_step(text, fencegate_decide_step[], fencegate_record_step[], boolean, '
            'double precision)'::regprocedure,
        distribution_arg_name => 'p_tenant', colocate_with => 'fencegate_idempotency_keys');
    PERFORM create_distributed_function(
        'fencegate_renew(text, text, text, integer, double precision)'::regprocedure,
        distribution_arg_name => 'p_tenant', colocate_with => 'fencegate_idempotency_keys');
    PERFORM create_distributed_function(
        'fencegate_remember_nonce(text, text, text, double precision)'::regprocedure,
        distribution_arg_name => 'p_tenant', colocate_with => 'fencegate_idempotency_keys');
    PERFORM create_distributed_function(
        'fencegate_release(text, text, text, integer, text, integer, boolean)'::regprocedure,
        distribution_arg_name => 'p_tenant', colocate_with => 'fencegate_idempotency_keys');
    PERFORM create_distributed_function(
        'fencegate_mark_unknown(text, text, text, integer, text, boolean, text)'::regprocedure,
        distribution_arg_name => 'p_tenant', colocate_with => 'fencegate_idempotency_keys');
    -- Asked inside statements on the tenant's rows, which run on its worker.
    PERFORM create_distributed_function(
        'fencegate_release_blocker(fencegate_key_state, text, timestamptz, double precision, '
            'timestamptz, timestamptz)'
            ::regprocedure);
END;
$$;
