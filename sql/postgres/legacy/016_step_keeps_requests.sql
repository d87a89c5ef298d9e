-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- The step keeps what a key was (method, target; the body only where its route reconciles),
-- schedules reconciling routes' keys for the reconciler, and answers `pending` instead of
-- `unknown` for an in-flight key whose lease ended while its gateway is alive: that gateway
-- still owes the key a write, so the client is told to retry, not that an operator must act.
ALTER TYPE fencegate_decide_step ADD ATTRIBUTE request_body bytea, ADD ATTRIBUTE reconcile boolean;

DROP FUNCTION IF EXISTS fencegate_step(
    fencegate_decide_step[], fencegate_record_step[], boolean, double precision);

