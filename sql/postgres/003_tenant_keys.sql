-- Every gateway table keyed by its tenant, so that Citus can distribute them by tenant
-- (docs/operations/citus.md): a distributed table's primary key must hold the distribution
-- column. On one PostgreSQL this changes no rule.
-- The decision history: (tenant, id); purged by expiry, oldest first.
ALTER TABLE fencegate_decisions DROP CONSTRAINT fencegate_decisions_pkey;
ALTER TABLE fencegate_decisions ADD CONSTRAINT fencegate_decisions_pkey PRIMARY KEY (tenant, id);
CREATE INDEX fencegate_decisions_expires_at ON fencegate_decisions (expires_at);

-- Signature nonces are kept with the tenant of the key that signed (a key id belongs to one
-- tenant), so that a tenant's signed requests need only the node that holds its rows. Nonces
-- remembered before this migration (a few minutes' worth) are dropped: they were kept under
-- no tenant, where no lookup finds them any more.
DELETE FROM fencegate_signature_nonces;
ALTER TABLE fencegate_signature_nonces ADD COLUMN tenant text NOT NULL;
ALTER TABLE fencegate_signature_nonces DROP CONSTRAINT signature_nonces_pkey;
ALTER TABLE fencegate_signature_nonces
    ADD CONSTRAINT signature_nonces_pkey PRIMARY KEY (tenant, key_id, nonce);

-- fencegate_step now takes the batch's tenant first (functions/fencegate_step.sql): the
-- old signature goes, or it would stay beside the new one.
DROP FUNCTION IF EXISTS fencegate_step(
    fencegate_decide_step[], fencegate_record_step[], boolean, double precision);
-- fencegate_release_blocker is now given the owner gateway's registration rather than read
-- it (functions/fencegate_release_blocker.sql): the old signature goes too.
DROP FUNCTION IF EXISTS fencegate_release_blocker(text, text, timestamptz, double precision);
