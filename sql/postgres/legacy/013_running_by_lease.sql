-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- The running jobs' index is keyed by kind and lease end (SQLite's was already by lease end):
-- a claim finds the expired leases of its kinds by a range scan, where it read every running
-- job of those kinds from the table to check its lease (twice: the exhausted ones, and the
-- ones to grant again), so a Worker claiming ahead at high concurrency paid for every lease
-- it held at each claim. Counting a limited kind's live leases reads the live ones only.
-- Jobs are found by id through the primary key, as every statement's `id = ANY(...)` asks.
DROP INDEX fencegate_jobs_running;
CREATE INDEX fencegate_jobs_running ON fencegate_jobs (kind, lease_until)
    WHERE state = 'running';
