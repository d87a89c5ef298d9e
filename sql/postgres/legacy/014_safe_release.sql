-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- Releasing a key safely, and reconciliation (DESIGN §8).
--
-- Every gateway process registers here and heartbeats: a key whose owner is alive may still
-- be sent, so it is never released from under it. `alive_until` is the database clock's
-- word; a clean stop deletes the row.
CREATE TABLE fencegate_gateways (
    instance      text PRIMARY KEY,
    host          text NOT NULL,
    pid           integer NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    alive_until   timestamptz NOT NULL
);

-- What a key was (for the reconciler's probe and for the operator's page), and what became
-- of its unknown outcome:
--   method, target   the request as routed (the path, never the query: it may carry secrets)
--   request_body     kept only for routes that declare `reconcile` ({json.<field>} and the
--                    callable read it)
--   unknown_reason   the limit that fired ("no answer within 2.0s", "connection lost after
--                    sending", "its gateway stopped before recording")
--   resolution       how an unknown outcome ended: reconciled, operator, forced
--   reconcile_after  NULL unless the key's route reconciles; when the reconciler may look next
--   reconcile_tries  probes so far;  reconcile_note: what the last probe said
ALTER TABLE fencegate_idempotency_keys
    ADD COLUMN method text,
    ADD COLUMN target text,
    ADD COLUMN request_body bytea,
    ADD COLUMN unknown_reason text,
    ADD COLUMN resolution text,
    ADD COLUMN reconcile_after timestamptz,
    ADD COLUMN reconcile_tries integer NOT NULL DEFAULT 0,
    ADD COLUMN reconcile_note text;

-- Only keys of reconciling routes are in it; a key of any other route keeps NULL, so its
-- updates stay HOT.
CREATE INDEX fencegate_idempotency_keys_reconcile ON fencegate_idempotency_keys
    (reconcile_after) WHERE reconcile_after IS NOT NULL;
