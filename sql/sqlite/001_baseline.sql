-- The fencegate 1.0 schema of SQLite: every table and index, as every migration up to 1.0 left
-- them. A database made before 1.0 is brought here by legacy/ instead.

CREATE TABLE "fencegate_idempotency_keys" (
    tenant            TEXT    NOT NULL,
    key               TEXT    NOT NULL,
    fingerprint       TEXT    NOT NULL,
    state             TEXT    NOT NULL
                      CHECK (state IN ('in_flight', 'completed', 'outcome_unknown')),
    owner             TEXT,
    locked_until      REAL,
    attempt           INTEGER NOT NULL DEFAULT 1,
    entity            TEXT,
    fence             INTEGER,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BLOB,
    response_sha256   TEXT,
    body_too_large    INTEGER NOT NULL DEFAULT 0,
    created_at        REAL    NOT NULL,
    completed_at      REAL,
    expires_at        REAL    NOT NULL, reserved_at REAL, method TEXT, target TEXT, request_body BLOB, unknown_reason TEXT, resolution TEXT, reconcile_after REAL, reconcile_tries INTEGER NOT NULL DEFAULT 0, reconcile_note TEXT,
    PRIMARY KEY (tenant, key)
) WITHOUT ROWID;

CREATE TABLE "fencegate_fences" (
    tenant         TEXT    NOT NULL,
    entity         TEXT    NOT NULL,
    last_accepted  INTEGER NOT NULL CHECK (last_accepted >= 0),
    updated_at     REAL    NOT NULL,
    PRIMARY KEY (tenant, entity)
) WITHOUT ROWID;

CREATE TABLE "fencegate_signature_nonces" (
    key_id      TEXT NOT NULL,
    nonce       TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (key_id, nonce)
) WITHOUT ROWID;

CREATE TABLE fencegate_sequences (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
-- The fencing tokens' one counter (PostgreSQL: the sequence fencegate_fencing_tokens).
INSERT INTO fencegate_sequences (name, value) VALUES ('fencing_token', 0);

CREATE TABLE fencegate_jobs (
    id                    INTEGER PRIMARY KEY AUTOINCREMENT,
    kind                  TEXT NOT NULL,
    state                 TEXT NOT NULL DEFAULT 'queued'
        CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    owner_id              TEXT,
    lease_until           REAL,
    fencing_token         INTEGER,
    heartbeat_at          REAL,
    attempt               INTEGER NOT NULL DEFAULT 0,
    max_attempts          INTEGER NOT NULL CHECK (max_attempts >= 1),
    run_after             REAL NOT NULL,
    idempotency_key       TEXT NOT NULL UNIQUE,
    payload               TEXT NOT NULL DEFAULT 'null',
    result                TEXT,
    error                 TEXT,
    lease_seconds         REAL NOT NULL CHECK (lease_seconds > 0),
    heartbeat_seconds     REAL NOT NULL CHECK (heartbeat_seconds > 0),
    jitter_seconds        REAL NOT NULL CHECK (jitter_seconds >= 0),
    stage_timeout_seconds REAL,
    tool_timeout_seconds  REAL,
    created_at            REAL NOT NULL,
    updated_at            REAL NOT NULL, priority INTEGER NOT NULL DEFAULT 0, concurrency_key TEXT, model TEXT,
    CHECK (state <> 'running' OR (owner_id IS NOT NULL AND lease_until IS NOT NULL
                                  AND fencing_token IS NOT NULL))
);

CREATE INDEX fencegate_jobs_running ON fencegate_jobs (lease_until) WHERE state = 'running';

CREATE TABLE fencegate_job_attempts (
    fencing_token INTEGER PRIMARY KEY,
    job_id        INTEGER NOT NULL REFERENCES fencegate_jobs (id) ON DELETE CASCADE,
    attempt       INTEGER NOT NULL,
    owner_id      TEXT NOT NULL,
    claimed_at    REAL NOT NULL,
    ended_at      REAL,
    outcome       TEXT CHECK (outcome IN ('succeeded', 'failed', 'retry_scheduled', 'released',
                                          'cancelled', 'lease_expired')),
    error         TEXT,
    CHECK ((ended_at IS NULL) = (outcome IS NULL))
);

CREATE INDEX fencegate_job_attempts_job ON fencegate_job_attempts (job_id, fencing_token);

CREATE TABLE fencegate_job_stages (
    job_id          INTEGER NOT NULL REFERENCES fencegate_jobs (id) ON DELETE CASCADE,
    name            TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    result          TEXT,
    fencing_token   INTEGER NOT NULL,
    committed_at    REAL NOT NULL,
    PRIMARY KEY (job_id, name)
);

CREATE INDEX fencegate_idempotency_keys_expires_at ON fencegate_idempotency_keys (expires_at);

CREATE INDEX fencegate_fences_updated_at ON fencegate_fences (updated_at);

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

CREATE TABLE fencegate_audit (
    id       INTEGER PRIMARY KEY,
    at       REAL NOT NULL,
    actor    TEXT NOT NULL,
    action   TEXT NOT NULL,
    tenant   TEXT,
    subject  TEXT NOT NULL,
    reason   TEXT,
    before   TEXT,
    after    TEXT
);

CREATE INDEX fencegate_jobs_queued ON fencegate_jobs (kind, priority DESC, id)
    WHERE state = 'queued';

CREATE INDEX fencegate_jobs_queued_any ON fencegate_jobs (priority DESC, id)
    WHERE state = 'queued';

CREATE TABLE fencegate_work_classes (
    kind                TEXT PRIMARY KEY,
    max_running         INTEGER CHECK (max_running >= 1),
    max_running_per_key INTEGER CHECK (max_running_per_key >= 1),
    provider            TEXT,
    updated_at          REAL NOT NULL
);

CREATE TABLE fencegate_rate_limits (
    provider    TEXT PRIMARY KEY,
    capacity    REAL NOT NULL CHECK (capacity >= 1),
    per_seconds REAL NOT NULL CHECK (per_seconds > 0),
    tokens      REAL NOT NULL,
    refilled_at REAL NOT NULL
);

CREATE TABLE fencegate_gateways (
    instance      TEXT PRIMARY KEY,
    host          TEXT NOT NULL,
    pid           INTEGER NOT NULL,
    started_at    REAL NOT NULL,
    heartbeat_at  REAL NOT NULL,
    alive_until   REAL NOT NULL
) WITHOUT ROWID;

CREATE INDEX fencegate_idempotency_keys_reconcile ON fencegate_idempotency_keys (reconcile_after)
    WHERE reconcile_after IS NOT NULL;
