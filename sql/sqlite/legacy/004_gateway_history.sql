-- Every gateway table carries the fencegate_ prefix, like the lease queue's; and the decision
-- history (see the PostgreSQL migration of the same name for what it is for).

ALTER TABLE idempotency_keys RENAME TO fencegate_idempotency_keys;
DROP INDEX idempotency_keys_expires_at;
CREATE INDEX fencegate_idempotency_keys_expires_at ON fencegate_idempotency_keys (expires_at);

ALTER TABLE fences RENAME TO fencegate_fences;
DROP INDEX fences_updated_at;
CREATE INDEX fencegate_fences_updated_at ON fencegate_fences (updated_at);

ALTER TABLE signature_nonces RENAME TO fencegate_signature_nonces;
DROP INDEX signature_nonces_expires_at;
CREATE INDEX fencegate_signature_nonces_expires_at ON fencegate_signature_nonces (expires_at);

CREATE TABLE fencegate_decisions (
    id               INTEGER PRIMARY KEY,
    at               REAL    NOT NULL,
    tenant           TEXT    NOT NULL,
    entity           TEXT,
    key              TEXT,
    fence            INTEGER,
    decision         TEXT    NOT NULL,
    attempt          INTEGER,
    owner            TEXT,
    request_id       TEXT,
    method           TEXT,
    target           TEXT,
    upstream_status  INTEGER,
    expires_at       REAL    NOT NULL
);
CREATE INDEX fencegate_decisions_entity ON fencegate_decisions (tenant, entity, id)
    WHERE entity IS NOT NULL;
CREATE INDEX fencegate_decisions_key ON fencegate_decisions (tenant, key, id)
    WHERE key IS NOT NULL;
