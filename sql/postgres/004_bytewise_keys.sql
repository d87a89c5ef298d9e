-- Names that are only ever compared for equality or walked in an index (tenants, keys,
-- entities, kinds, nonces, ...) are compared bytewise: COLLATE "C". Under a linguistic
-- collation (en_US.UTF-8, a common database default) every index search and insertion on
-- them called the C library's strcoll; on such a database this cut PostgreSQL's CPU per
-- new key by a fifth (docs/benchmarks.md). Equality and uniqueness do not change (a
-- deterministic collation compares bytes for equality already); only the order of listings
-- sorted by these names becomes bytewise.
--
-- The columns keep their type, so no table is rewritten; the indexes holding them are
-- rebuilt, each table under its ACCESS EXCLUSIVE lock for as long as that takes.
-- On Citus a table's distribution column (the tenant of the gateway's tables) cannot change
-- once the table is distributed: on a database distributed before this migration it keeps
-- its collation (a fresh database runs this before it is distributed).
DO $$
DECLARE
    v_table record;
    v_column text;
    v_alters text[];
    v_distribution_column text;
BEGIN
    FOR v_table IN
        SELECT * FROM (VALUES
            ('fencegate_idempotency_keys', ARRAY['tenant', 'key']),
            ('fencegate_fences', ARRAY['tenant', 'entity']),
            ('fencegate_decisions', ARRAY['tenant', 'key', 'entity']),
            ('fencegate_signature_nonces', ARRAY['tenant', 'key_id', 'nonce']),
            ('fencegate_gateways', ARRAY['instance']),
            ('fencegate_jobs', ARRAY['kind', 'idempotency_key']),
            ('fencegate_job_stages', ARRAY['name']),
            ('fencegate_work_classes', ARRAY['kind']),
            ('fencegate_rate_limits', ARRAY['provider'])
        ) AS t(name, columns)
    LOOP
        v_distribution_column := NULL;
        IF to_regclass('pg_dist_partition') IS NOT NULL THEN
            EXECUTE 'SELECT column_to_column_name(logicalrelid, partkey)
                       FROM pg_dist_partition
                      WHERE logicalrelid = $1::regclass AND partkey IS NOT NULL'
               INTO v_distribution_column USING v_table.name;
        END IF;
        v_alters := '{}';
        FOREACH v_column IN ARRAY v_table.columns LOOP
            IF v_column IS DISTINCT FROM v_distribution_column THEN
                v_alters := v_alters
                    || format('ALTER COLUMN %I TYPE text COLLATE "C"', v_column);
            END IF;
        END LOOP;
        IF cardinality(v_alters) > 0 THEN
            -- One statement per table: its indexes are rebuilt once.
            EXECUTE format('ALTER TABLE %I %s', v_table.name, array_to_string(v_alters, ', '));
        END IF;
    END LOOP;
END;
$$;
