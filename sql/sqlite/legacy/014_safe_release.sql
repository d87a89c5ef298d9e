-- Releasing a key safely, and reconciliation: see the PostgreSQL migration of the same name.
CREATE TABLE fencegate_gateways (
    instance      TEXT PRIMARY KEY,
    host          TEXT NOT NULL,
    pid           INTEGER NOT NULL,
    started_at    REAL NOT NULL,
    heartbeat_at  REAL NOT NULL,
    alive_until   REAL NOT NULL
) WITHOUT ROWID;

ALTER TABLE fencegate_idempotency_keys ADD COLUMN method TEXT;
ALTER TABLE fencegate_idempotency_keys ADD COLUMN target TEXT;
ALTER TABLE fencegate_idempotency_keys ADD COLUMN request_body BLOB;
ALTER TABLE fencegate_idempotency_keys ADD COLUMN unknown_reason TEXT;
ALTER TABLE fencegate_idempotency_keys ADD COLUMN resolution TEXT;
ALTER TABLE fencegate_idempotency_keys ADD COLUMN reconcile_after REAL;
ALTER TABLE fencegate_idempotency_keys ADD COLUMN reconcile_tries INTEGER NOT NULL DEFAULT 0;
ALTER TABLE fencegate_idempotency_keys ADD COLUMN reconcile_note TEXT;

CREATE INDEX fencegate_idempotency_keys_reconcile ON fencegate_idempotency_keys (reconcile_after)
    WHERE reconcile_after IS NOT NULL;
