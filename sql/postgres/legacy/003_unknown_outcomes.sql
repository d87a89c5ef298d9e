-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- An unknown outcome is never forwarded again unless the route says so (docs/protocol.md §3):
-- an in-flight key whose lease expired is unknown like one marked so, a late answer from
-- the holder of an unknown key still completes it, and a 409 in-flight says how long the
-- first request may still take (from reserved_at), not how long its lease runs.

ALTER TABLE idempotency_keys ADD COLUMN reserved_at timestamptz;

-- Nothing calls the single-decision wrapper; the gateway batches through fencegate_step.
DROP FUNCTION IF EXISTS fencegate_decide(
    text, text, text, text, bigint, text, double precision, double precision, boolean);
DROP FUNCTION IF EXISTS fencegate_step(
    text[], text[], text[], text[], bigint[], text[], double precision[], double precision[],
    boolean[], text[], text[], text[], integer[], integer[], text[], bytea[], text[], boolean[]);

