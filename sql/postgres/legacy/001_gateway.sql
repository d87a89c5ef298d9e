-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- Gateway records: idempotency keys, fences, signature nonces.
-- Every time comparison uses the database clock (now()).

-- Enum and domain rather than CHECK constraints: a table's CHECK expressions are read from
-- the catalog and planned again for every statement that writes the table, which is a large
-- part of a decision's cost; a type validates its values for free.
CREATE TYPE fencegate_key_state AS ENUM ('in_flight', 'completed', 'outcome_unknown');
CREATE DOMAIN fencegate_fence AS bigint CHECK (VALUE >= 0);

CREATE TABLE idempotency_keys (
    tenant            text        NOT NULL,
    key               text        NOT NULL,
    fingerprint       text        NOT NULL,  -- hex SHA-256 of method, path, sorted query, body
    state             fencegate_key_state NOT NULL,
    owner             text,                  -- gateway instance holding the in-flight lease
    locked_until      timestamptz,           -- end of that lease
    attempt           integer     NOT NULL DEFAULT 1,
    entity            text,
    fence             bigint,
    response_status   integer,
    response_headers  jsonb,                 -- [[name, value], ...] as replayed
    response_body     bytea,
    response_sha256   text,
    body_too_large    boolean     NOT NULL DEFAULT false,
    created_at        timestamptz NOT NULL DEFAULT now(),
    completed_at      timestamptz,
    expires_at        timestamptz NOT NULL,  -- set once at reservation: keys live a fixed TTL
    PRIMARY KEY (tenant, key)
) WITH (fillfactor = 20);
-- Recording the answer updates the reservation's row and makes it several times larger (a
-- reservation is about 250 bytes, a row with a JSON answer of half a kilobyte about 900).
-- New rows fill a fifth of a page, so that the answers of the rows on a page fit beside
-- them: the update stays on its page (HOT) and writes no index entries. Once answered, the
-- pages are about as full as they would be anyway.

CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

CREATE TABLE fences (
    tenant         text        NOT NULL,
    entity         text        NOT NULL,
    last_accepted  fencegate_fence NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, entity)
) WITH (fillfactor = 70);
-- No index on updated_at: every accepted fence updates it, and an index would turn each of
-- those updates into index writes. The periodic purge scans instead.

CREATE TABLE signature_nonces (
    key_id      text        NOT NULL,
    nonce       text        NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (key_id, nonce)
);

CREATE INDEX signature_nonces_expires_at ON signature_nonces (expires_at);

-- One round trip of a gateway: the decisions (steps 3 and 4) and the recorded answers
-- (step 6) that queued up while its previous round trip ran, in one transaction.
-- Decision i answers with d_index = i, recorded answer i with d_index = -i
-- (d_outcome 'completed', or 'not_held' when the reservation is no longer the caller's).
-- Decision outcomes: stale | fence_only | reserved | taken_over | retry_unknown | replay |
-- mismatch | in_flight | unknown.
-- Every fence row is locked before any key row, each kind in sorted order, as in a single
-- decision: concurrent round trips take their locks in one global order and cannot
-- deadlock.
-- Written as one function that answers with RETURN NEXT: every statement run per request
-- costs an executor start-up, so the common paths run as few as possible (a new key: one
-- fence UPDATE, one key INSERT, and one UPDATE to record its answer).

-- One decision (for operators and scripts; the gateway calls fencegate_step).
