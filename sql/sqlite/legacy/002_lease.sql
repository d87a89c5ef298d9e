-- The lease queue: jobs, the history of every lease grant, and committed stages.
-- Times are epoch seconds (REAL) from the database clock; JSON values are TEXT.

-- One counter issues every fencing token (the SQLite stand-in for a sequence), so a later
-- grant always carries a larger token than any earlier one, for any job.
CREATE TABLE fencegate_sequences (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
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
    updated_at            REAL NOT NULL,
    CHECK (state <> 'running' OR (owner_id IS NOT NULL AND lease_until IS NOT NULL
                                  AND fencing_token IS NOT NULL))
);

CREATE INDEX fencegate_jobs_queued ON fencegate_jobs (kind, id) WHERE state = 'queued';
CREATE INDEX fencegate_jobs_running ON fencegate_jobs (lease_until) WHERE state = 'running';
CREATE INDEX fencegate_jobs_queued_any ON fencegate_jobs (id) WHERE state = 'queued';

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
