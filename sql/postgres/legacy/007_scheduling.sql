-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- Scheduling decided by the database for the whole fleet: priorities, concurrency limits per
-- work class and per key, and token buckets per provider.

-- Higher priority first; ties in enqueue (id) order. A concurrency key names who a job
-- runs for ("customer:c-1048"), for the work class's limit per key. The model a job runs
-- with is a metric label, one of the names its work class declares.
ALTER TABLE fencegate_jobs
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    ADD COLUMN concurrency_key text,
    ADD COLUMN model text;

-- The claim walks queued work in (priority, id) order, from an index in that order.
DROP INDEX fencegate_jobs_queued;
DROP INDEX fencegate_jobs_queued_any;
CREATE INDEX fencegate_jobs_queued ON fencegate_jobs (kind, priority DESC, id)
    WHERE state = 'queued';
CREATE INDEX fencegate_jobs_queued_any ON fencegate_jobs (priority DESC, id)
    WHERE state = 'queued';

-- The limits of each work class, written by the workers that declare it (the last
-- declaration wins). A claim of a limited kind first locks its row here, so that claims of
-- that kind take turns: each counts the running jobs after the one before it committed.
CREATE TABLE fencegate_work_classes (
    kind                text PRIMARY KEY,
    max_running         integer CHECK (max_running >= 1),
    max_running_per_key integer CHECK (max_running_per_key >= 1),
    provider            text,
    updated_at          timestamptz NOT NULL DEFAULT now()
);

-- One token bucket per provider: up to `capacity` tokens, `capacity` more every
-- `per_seconds`. A claim takes one token per job of the provider's work classes it grants.
CREATE TABLE fencegate_rate_limits (
    provider    text PRIMARY KEY,
    capacity    double precision NOT NULL CHECK (capacity >= 1),
    per_seconds double precision NOT NULL CHECK (per_seconds > 0),
    tokens      double precision NOT NULL,
    refilled_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
