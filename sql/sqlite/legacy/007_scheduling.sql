-- Scheduling decided by the database for the whole fleet: priorities, concurrency limits per
-- work class and per key, and token buckets per provider (see sql/postgres/007_scheduling.sql).
-- A claim is one BEGIN IMMEDIATE transaction, so claims take turns without row locks.

ALTER TABLE fencegate_jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE fencegate_jobs ADD COLUMN concurrency_key TEXT;
ALTER TABLE fencegate_jobs ADD COLUMN model TEXT;

DROP INDEX fencegate_jobs_queued;
DROP INDEX fencegate_jobs_queued_any;
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
