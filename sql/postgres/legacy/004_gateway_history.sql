-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- Every gateway table carries the fencegate_ prefix, like the lease queue's; and the decision
-- history: one row per keyed or fenced decision (and per recorded answer, release, unknown
-- mark and operator resolution), written in the same transaction as the decision itself,
-- kept as long as the key. The operator's question "who sent these two requests, with which
-- token, and which one was fenced off" is a read of this table joined with the job attempts
-- by fencing token. Never payloads: ids, the method and path, outcomes, statuses.

ALTER TABLE idempotency_keys RENAME TO fencegate_idempotency_keys;
ALTER INDEX idempotency_keys_expires_at RENAME TO fencegate_idempotency_keys_expires_at;
ALTER TABLE fences RENAME TO fencegate_fences;
ALTER TABLE signature_nonces RENAME TO fencegate_signature_nonces;
ALTER INDEX signature_nonces_expires_at RENAME TO fencegate_signature_nonces_expires_at;

CREATE TABLE fencegate_decisions (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at               timestamptz NOT NULL DEFAULT now(),
    tenant           text        NOT NULL,
    entity           text,
    key              text,
    fence            bigint,
    -- stale | fence_only | reserved | taken_over | retry_unknown | replay | mismatch |
    -- in_flight | unknown | completed | released | marked_unknown | resolved_completed |
    -- resolved_released
    decision         text        NOT NULL,
    attempt          integer,
    owner            text,       -- the gateway reservation (or operator:who) behind it
    request_id       text,
    method           text,
    target           text,       -- the path as sent; never the query (it may hold secrets)
    upstream_status  integer,
    expires_at       timestamptz NOT NULL
);
-- An entity's fence history and a key's story, newest last. Rows are inserted in time order
-- and all live as long as a key, so the purge walks the primary key from the oldest: no
-- index on expires_at to maintain on every decision.
CREATE INDEX fencegate_decisions_entity ON fencegate_decisions (tenant, entity, id)
    WHERE entity IS NOT NULL;
CREATE INDEX fencegate_decisions_key ON fencegate_decisions (tenant, key, id)
    WHERE key IS NOT NULL;

DROP FUNCTION IF EXISTS fencegate_step(
    text[], text[], text[], text[], bigint[], text[], double precision[], double precision[],
    boolean[], text[], text[], text[], integer[], integer[], text[], bytea[], text[], boolean[]);

-- As in 003, on the renamed tables; it also answers each step's entity, fence and expiry,
-- which the gateway's step query writes into fencegate_decisions in the same statement.
