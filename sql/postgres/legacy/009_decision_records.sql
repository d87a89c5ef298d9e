-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- The gateway's step takes its work as two arrays of typed records, one per kind (a decision
-- to make, an answer to record), instead of one array per field: a field is added to a
-- record type and to the one place that builds it (fencegate/store/postgres.py), nothing
-- else. The step also writes its own rows in the decision history and chooses its commit
-- mode, which the statement around it did before (a data-modifying CTE that read the
-- function's result back and indexed the argument arrays again). The body is otherwise
-- 006's.

CREATE TYPE fencegate_decide_step AS (
    tenant text,
    key text,
    fingerprint text,
    entity text,
    fence bigint,
    owner text,
    lease_seconds double precision,
    ttl_seconds double precision,
    retry_unknown boolean,
    request_id text,
    method text,
    target text           -- the path as sent; never the query
);

CREATE TYPE fencegate_record_step AS (
    tenant text,
    key text,
    owner text,
    attempt integer,
    status integer,
    headers text,         -- JSON: [[name, value], ...]
    body bytea,
    sha256 text,
    too_large boolean,
    request_id text
);

DROP FUNCTION IF EXISTS fencegate_step(
    text[], text[], text[], text[], bigint[], text[], double precision[], double precision[],
    boolean[], text[], text[], text[], integer[], integer[], text[], bytea[], text[], boolean[],
    double precision);

