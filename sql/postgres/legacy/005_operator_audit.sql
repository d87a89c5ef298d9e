-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- What operators did: every action from the command line or the console (resolve a key,
-- retry, cancel or purge jobs), who did it, why, and the state before and after.
CREATE TABLE fencegate_audit (
    id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text        NOT NULL,  -- operator:user@host, or console:<token name>
    action   text        NOT NULL,  -- keys.resolve_completed | keys.resolve_released |
                                    -- jobs.retry | jobs.cancel | jobs.purge
    tenant   text,
    subject  text        NOT NULL,  -- the key, the job id, or the purge's cut-off
    reason   text,
    before   jsonb,
    after    jsonb
);
