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
CREATE FUNCTION fencegate_step(
    p_tenants text[],
    p_keys text[],
    p_fingerprints text[],
    p_entities text[],
    p_fences bigint[],
    p_owners text[],
    p_lease_seconds double precision[],
    p_ttl_seconds double precision[],
    p_retry_unknown boolean[],
    c_tenants text[],
    c_keys text[],
    c_owners text[],
    c_attempts integer[],
    c_statuses integer[],
    c_headers text[],
    c_bodies bytea[],
    c_sha256 text[],
    c_too_large boolean[]
) RETURNS TABLE (
    d_index integer,
    d_outcome text,
    d_last_accepted bigint,
    d_attempt integer,
    d_retry_after double precision,
    d_response_status integer,
    d_response_headers text,
    d_response_body bytea,
    d_response_sha256 text,
    d_body_too_large boolean
) LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(array_length(p_tenants, 1), 0);
    v_stale boolean[] := array_fill(false, ARRAY[n]);
    v_last bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    v_row idempotency_keys%ROWTYPE;
    v_step record;
    v_fence bigint;
    v_found boolean;
    v_inserted boolean;
    i integer;
BEGIN
    -- Step 3: accept each fence or find it stale. A stale fence changes nothing.
    FOR i IN
        SELECT o.i FROM generate_subscripts(p_tenants, 1) AS o(i)
        WHERE p_fences[o.i] IS NOT NULL
        ORDER BY p_tenants[o.i], p_entities[o.i], o.i
    LOOP
        -- The entity usually has a row already: a plain UPDATE is the cheapest way to raise
        -- it (it waits for a concurrent writer of the row, then checks the newest version).
        UPDATE fences f SET last_accepted = p_fences[i], updated_at = now()
        WHERE f.tenant = p_tenants[i] AND f.entity = p_entities[i]
            AND f.last_accepted <= p_fences[i];
        IF NOT FOUND THEN
            -- A new entity, or a stale fence: the upsert decides atomically, and leaves the
            -- row locked either way.
            INSERT INTO fences AS f (tenant, entity, last_accepted, updated_at)
            VALUES (p_tenants[i], p_entities[i], p_fences[i], now())
            ON CONFLICT (tenant, entity) DO UPDATE
                SET last_accepted = EXCLUDED.last_accepted, updated_at = now()
                WHERE f.last_accepted <= EXCLUDED.last_accepted;
            IF NOT FOUND THEN
                v_stale[i] := true;
                SELECT f.last_accepted INTO v_fence
                FROM fences f WHERE f.tenant = p_tenants[i] AND f.entity = p_entities[i];
                v_last[i] := v_fence;
                CONTINUE;
            END IF;
        END IF;
        v_last[i] := p_fences[i];
    END LOOP;

    FOR v_step IN
        SELECT * FROM (
            SELECT false AS record, o.i, p_tenants[o.i] AS tenant, p_keys[o.i] AS key
            FROM generate_subscripts(p_tenants, 1) AS o(i)
            UNION ALL
            SELECT true, o.i, c_tenants[o.i], c_keys[o.i]
            FROM generate_subscripts(c_tenants, 1) AS o(i)
        ) AS steps
        -- An answer is recorded before a decision on the same key sees it.
        ORDER BY steps.key IS NULL, steps.tenant, steps.key, steps.record DESC, steps.i
    LOOP
        i := v_step.i;
        d_last_accepted := NULL;
        d_attempt := NULL;
        d_retry_after := NULL;
        d_response_status := NULL;
        d_response_headers := NULL;
        d_response_body := NULL;
        d_response_sha256 := NULL;
        d_body_too_large := NULL;

        IF v_step.record THEN
            -- Step 6: conditional on still holding the reservation.
            UPDATE idempotency_keys k
            SET state = 'completed', response_status = c_statuses[i],
                response_headers = c_headers[i]::jsonb, response_body = c_bodies[i],
                response_sha256 = c_sha256[i], body_too_large = c_too_large[i],
                completed_at = now(), locked_until = NULL
            WHERE k.tenant = c_tenants[i] AND k.key = c_keys[i] AND k.owner = c_owners[i]
                AND k.attempt = c_attempts[i] AND k.state = 'in_flight';
            d_index := -i;
            d_outcome := CASE WHEN FOUND THEN 'completed' ELSE 'not_held' END;
            RETURN NEXT;
            CONTINUE;
        END IF;

        d_index := i;
        d_last_accepted := v_last[i];
        IF v_stale[i] THEN
            d_outcome := 'stale';
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF p_keys[i] IS NULL THEN
            d_outcome := 'fence_only';
            RETURN NEXT;
            CONTINUE;
        END IF;

        -- Step 4 (its fence, if any, accepted above). Most keys are new: try to reserve
        -- first.
        INSERT INTO idempotency_keys AS k (
            tenant, key, fingerprint, state, owner, locked_until, attempt, entity, fence,
            created_at, expires_at)
        VALUES (
            p_tenants[i], p_keys[i], p_fingerprints[i], 'in_flight', p_owners[i],
            now() + make_interval(secs => p_lease_seconds[i]), 1, p_entities[i], p_fences[i],
            now(), now() + make_interval(secs => p_ttl_seconds[i]))
        ON CONFLICT (tenant, key) DO NOTHING;
        IF FOUND THEN
            d_outcome := 'reserved';
            d_attempt := 1;
            RETURN NEXT;
            CONTINUE;
        END IF;

        -- Answers that change nothing (replay, key reused, in flight) are read without a row
        -- lock: many copies of one key must not queue behind each other for a replay.
        SELECT * INTO v_row FROM idempotency_keys k
        WHERE k.tenant = p_tenants[i] AND k.key = p_keys[i];
        v_found := FOUND;
        IF NOT (v_found AND v_row.expires_at > now()
                AND (v_row.fingerprint <> p_fingerprints[i] OR v_row.state = 'completed'
                     OR (v_row.state = 'in_flight' AND v_row.locked_until > now()))) THEN
            -- The row has to change (or is gone): lock it. A concurrent release can delete
            -- it between the insert and the lock: try again.
            v_found := false;
            v_inserted := false;
            FOR attempt IN 1..5 LOOP
                INSERT INTO idempotency_keys AS k (
                    tenant, key, fingerprint, state, owner, locked_until, attempt, entity,
                    fence, created_at, expires_at)
                VALUES (
                    p_tenants[i], p_keys[i], p_fingerprints[i], 'in_flight', p_owners[i],
                    now() + make_interval(secs => p_lease_seconds[i]), 1, p_entities[i],
                    p_fences[i], now(), now() + make_interval(secs => p_ttl_seconds[i]))
                ON CONFLICT (tenant, key) DO NOTHING;
                IF FOUND THEN
                    v_inserted := true;
                    EXIT;
                END IF;
                SELECT * INTO v_row FROM idempotency_keys k
                WHERE k.tenant = p_tenants[i] AND k.key = p_keys[i]
                FOR UPDATE;
                IF FOUND THEN
                    v_found := true;
                    EXIT;
                END IF;
            END LOOP;
            IF v_inserted THEN
                d_outcome := 'reserved';
                d_attempt := 1;
                RETURN NEXT;
                CONTINUE;
            END IF;
            IF NOT v_found THEN
                RAISE EXCEPTION 'idempotency key % kept changing under concurrent updates',
                    p_keys[i] USING ERRCODE = '40001';
            END IF;
            IF v_row.expires_at <= now() THEN
                -- Expired but not yet purged: the key is free again.
                UPDATE idempotency_keys k
                SET fingerprint = p_fingerprints[i], state = 'in_flight', owner = p_owners[i],
                    locked_until = now() + make_interval(secs => p_lease_seconds[i]),
                    attempt = 1, entity = p_entities[i], fence = p_fences[i],
                    response_status = NULL, response_headers = NULL, response_body = NULL,
                    response_sha256 = NULL, body_too_large = false, created_at = now(),
                    completed_at = NULL,
                    expires_at = now() + make_interval(secs => p_ttl_seconds[i])
                WHERE k.tenant = p_tenants[i] AND k.key = p_keys[i];
                d_outcome := 'reserved';
                d_attempt := 1;
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;

        -- v_row is current: read without a lock above, or locked.
        d_attempt := v_row.attempt;
        IF v_row.fingerprint <> p_fingerprints[i] THEN
            d_outcome := 'mismatch';
        ELSIF v_row.state = 'completed' THEN
            d_outcome := 'replay';
            d_response_status := v_row.response_status;
            d_response_headers := v_row.response_headers::text;
            d_response_body := v_row.response_body;
            d_response_sha256 := v_row.response_sha256;
            d_body_too_large := v_row.body_too_large;
        ELSIF v_row.state = 'in_flight' AND v_row.locked_until > now() THEN
            d_outcome := 'in_flight';
            d_retry_after := extract(epoch FROM v_row.locked_until - now())::double precision;
        ELSIF v_row.state = 'outcome_unknown' AND NOT p_retry_unknown[i] THEN
            d_outcome := 'unknown';
        ELSE
            UPDATE idempotency_keys k
            SET state = 'in_flight', owner = p_owners[i],
                locked_until = now() + make_interval(secs => p_lease_seconds[i]),
                attempt = k.attempt + 1, entity = p_entities[i], fence = p_fences[i]
            WHERE k.tenant = p_tenants[i] AND k.key = p_keys[i]
            RETURNING k.attempt INTO d_attempt;
            d_outcome := CASE WHEN v_row.state = 'in_flight' THEN 'taken_over'
                              ELSE 'retry_unknown' END;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- One decision (for operators and scripts; the gateway calls fencegate_step).
CREATE FUNCTION fencegate_decide(
    p_tenant text,
    p_key text,
    p_fingerprint text,
    p_entity text,
    p_fence bigint,
    p_owner text,
    p_lease_seconds double precision,
    p_ttl_seconds double precision,
    p_retry_unknown boolean
) RETURNS TABLE (
    d_index integer,
    d_outcome text,
    d_last_accepted bigint,
    d_attempt integer,
    d_retry_after double precision,
    d_response_status integer,
    d_response_headers text,
    d_response_body bytea,
    d_response_sha256 text,
    d_body_too_large boolean
) LANGUAGE sql AS $$
    SELECT * FROM fencegate_step(
        ARRAY[p_tenant], ARRAY[p_key], ARRAY[p_fingerprint], ARRAY[p_entity], ARRAY[p_fence],
        ARRAY[p_owner], ARRAY[p_lease_seconds], ARRAY[p_ttl_seconds], ARRAY[p_retry_unknown],
        '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}');
$$;
