-- Gateway records: idempotency keys, fences, signature nonces.
-- Times are epoch seconds (REAL) from the database clock; the decision itself runs in the
-- store inside one BEGIN IMMEDIATE transaction.

CREATE TABLE idempotency_keys (
    tenant            TEXT    NOT NULL,
    key               TEXT    NOT NULL,
    fingerprint       TEXT    NOT NULL,
    state             TEXT    NOT NULL
                      CHECK (state IN ('in_flight', 'completed', 'outcome_unknown')),
    owner             TEXT,
    locked_until      REAL,
    attempt           INTEGER NOT NULL DEFAULT 1,
    entity            TEXT,
    fence             INTEGER,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BLOB,
    response_sha256   TEXT,
    body_too_large    INTEGER NOT NULL DEFAULT 0,
    created_at        REAL    NOT NULL,
    completed_at      REAL,
    expires_at        REAL    NOT NULL,
    PRIMARY KEY (tenant, key)
) WITHOUT ROWID;

CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

CREATE TABLE fences (
    tenant         TEXT    NOT NULL,
    entity         TEXT    NOT NULL,
    last_accepted  INTEGER NOT NULL CHECK (last_accepted >= 0),
    updated_at     REAL    NOT NULL,
    PRIMARY KEY (tenant, entity)
) WITHOUT ROWID;

CREATE INDEX fences_updated_at ON fences (updated_at);

CREATE TABLE signature_nonces (
    key_id      TEXT NOT NULL,
    nonce       TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (key_id, nonce)
) WITHOUT ROWID;

CREATE INDEX signature_nonces_expires_at ON signature_nonces (expires_at);
