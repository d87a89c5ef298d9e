-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- The lease queue: jobs, the history of every lease grant, and committed stages.

-- One sequence issues every fencing token, so a later grant always carries a larger token
-- than any earlier one, for any job.
CREATE SEQUENCE fencegate_fencing_tokens AS bigint START 1;

CREATE TABLE fencegate_jobs (
    id                    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind                  text NOT NULL,
    state                 text NOT NULL DEFAULT 'queued'
        CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    owner_id              text,
    lease_until           timestamptz,
    fencing_token         bigint,
    heartbeat_at          timestamptz,
    attempt               integer NOT NULL DEFAULT 0,
    max_attempts          integer NOT NULL CHECK (max_attempts >= 1),
    run_after             timestamptz NOT NULL DEFAULT now(),
    idempotency_key       text NOT NULL UNIQUE,
    payload               jsonb NOT NULL DEFAULT 'null',
    result                jsonb,
    error                 jsonb,
    lease_seconds         double precision NOT NULL CHECK (lease_seconds > 0),
    heartbeat_seconds     double precision NOT NULL CHECK (heartbeat_seconds > 0),
    jitter_seconds        double precision NOT NULL CHECK (jitter_seconds >= 0),
    stage_timeout_seconds double precision,
    tool_timeout_seconds  double precision,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    CHECK (state <> 'running' OR (owner_id IS NOT NULL AND lease_until IS NOT NULL
                                  AND fencing_token IS NOT NULL))
) WITH (fillfactor = 70);  -- room on the page for HOT heartbeats (see below)

-- Claim looks for queued work by kind in id order, and for running work whose lease ran out.
CREATE INDEX fencegate_jobs_queued ON fencegate_jobs (kind, id) WHERE state = 'queued';
-- Running rows are few (bounded by the workers' concurrency), so the expired-lease scan reads
-- them all and filters on lease_until. Keeping lease_until out of every index lets a heartbeat,
-- which changes only lease_until and heartbeat_at, be a HOT update: no index is written.
CREATE INDEX fencegate_jobs_running ON fencegate_jobs (kind, id) WHERE state = 'running';
CREATE INDEX fencegate_jobs_queued_any ON fencegate_jobs (id) WHERE state = 'queued';

CREATE TABLE fencegate_job_attempts (
    fencing_token bigint PRIMARY KEY,
    job_id        bigint NOT NULL REFERENCES fencegate_jobs (id) ON DELETE CASCADE,
    attempt       integer NOT NULL,
    owner_id      text NOT NULL,
    claimed_at    timestamptz NOT NULL DEFAULT now(),
    ended_at      timestamptz,
    outcome       text CHECK (outcome IN ('succeeded', 'failed', 'retry_scheduled', 'released',
                                          'cancelled', 'lease_expired')),
    error         jsonb,
    CHECK ((ended_at IS NULL) = (outcome IS NULL))
) WITH (fillfactor = 80);  -- room on the page lets closing an attempt be a HOT update
CREATE INDEX fencegate_job_attempts_job ON fencegate_job_attempts (job_id, fencing_token);

CREATE TABLE fencegate_job_stages (
    job_id          bigint NOT NULL REFERENCES fencegate_jobs (id) ON DELETE CASCADE,
    name            text NOT NULL,
    idempotency_key text NOT NULL,
    result          jsonb,
    fencing_token   bigint NOT NULL,
    committed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, name)
);

-- Workers LISTEN on fencegate_jobs and wake as soon as work of their kind is queued; the
-- notification is sent on commit of the transaction that queued it, never before.

-- Released work (and a retry due now) is ready again at once.
