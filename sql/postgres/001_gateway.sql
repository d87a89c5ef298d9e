-- Gateway records: idempotency keys, fences, signature nonces.
-- Every time comparison uses the database clock (now()).

CREATE TABLE idempotency_keys (
    tenant            text        NOT NULL,
    key               text        NOT NULL,
    fingerprint       text        NOT NULL,  -- hex SHA-256 of method, path, sorted query, body
    state             text        NOT NULL
                      CHECK (state IN ('in_flight', 'completed', 'outcome_unknown')),
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
) WITH (fillfactor = 70);  -- room on the page makes recording the answer a HOT update

CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

CREATE TABLE fences (
    tenant         text        NOT NULL,
    entity         text        NOT NULL,
    last_accepted  bigint      NOT NULL CHECK (last_accepted >= 0),
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

-- Step 3: accept a fence or find it stale. The WHERE makes a stale fence a no-op: nothing
-- is stored for it. Returns whether it was accepted and the last accepted fence.
CREATE FUNCTION fencegate_accept_fence(
    p_tenant text, p_entity text, p_fence bigint,
    OUT accepted boolean, OUT last_accepted bigint
) LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fences AS f (tenant, entity, last_accepted, updated_at)
    VALUES (p_tenant, p_entity, p_fence, now())
    ON CONFLICT (tenant, entity) DO UPDATE
        SET last_accepted = EXCLUDED.last_accepted, updated_at = now()
        WHERE f.last_accepted <= EXCLUDED.last_accepted
    RETURNING f.last_accepted INTO last_accepted;
    accepted := FOUND;
    IF NOT accepted THEN
        SELECT f.last_accepted INTO last_accepted
        FROM fences f WHERE f.tenant = p_tenant AND f.entity = p_entity;
    END IF;
END;
$$;

-- Step 4 for one key (its fence, if any, already accepted in this transaction).
-- d_outcome: reserved | taken_over | retry_unknown | replay | mismatch | in_flight | unknown
CREATE FUNCTION fencegate_decide_key(
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
    d_outcome text,
    d_attempt integer,
    d_retry_after double precision,
    d_response_status integer,
    d_response_headers text,
    d_response_body bytea,
    d_response_sha256 text,
    d_body_too_large boolean
) LANGUAGE plpgsql AS $$
DECLARE
    v_row idempotency_keys%ROWTYPE;
    v_attempt integer;
    v_found boolean := false;
BEGIN
    -- Answers that change nothing (replay, key reused, in flight) are read without a row
    -- lock: many copies of one key must not queue behind each other for a replay.
    SELECT * INTO v_row FROM idempotency_keys k WHERE k.tenant = p_tenant AND k.key = p_key;
    IF FOUND AND v_row.expires_at > now() THEN
        IF v_row.fingerprint <> p_fingerprint THEN
            RETURN QUERY SELECT 'mismatch'::text, v_row.attempt, NULL::double precision,
                NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
            RETURN;
        END IF;
        IF v_row.state = 'completed' THEN
            RETURN QUERY SELECT 'replay'::text, v_row.attempt, NULL::double precision,
                v_row.response_status, v_row.response_headers::text, v_row.response_body,
                v_row.response_sha256, v_row.body_too_large;
            RETURN;
        END IF;
        IF v_row.state = 'in_flight' AND v_row.locked_until > now() THEN
            RETURN QUERY SELECT 'in_flight'::text, v_row.attempt,
                extract(epoch FROM v_row.locked_until - now())::double precision,
                NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
            RETURN;
        END IF;
    END IF;

    -- A concurrent release can delete the row between the insert and the lock: try again.
    FOR i IN 1..5 LOOP
        INSERT INTO idempotency_keys AS k (
            tenant, key, fingerprint, state, owner, locked_until, attempt, entity, fence,
            created_at, expires_at)
        VALUES (
            p_tenant, p_key, p_fingerprint, 'in_flight', p_owner,
            now() + make_interval(secs => p_lease_seconds), 1, p_entity, p_fence,
            now(), now() + make_interval(secs => p_ttl_seconds))
        ON CONFLICT (tenant, key) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT 'reserved'::text, 1, NULL::double precision,
                NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
            RETURN;
        END IF;
        SELECT * INTO v_row FROM idempotency_keys k
        WHERE k.tenant = p_tenant AND k.key = p_key
        FOR UPDATE;
        IF FOUND THEN
            v_found := true;
            EXIT;
        END IF;
    END LOOP;
    IF NOT v_found THEN
        RAISE EXCEPTION 'idempotency key % kept changing under concurrent updates', p_key
            USING ERRCODE = '40001';
    END IF;

    IF v_row.expires_at <= now() THEN
        -- Expired but not yet purged: the key is free again.
        UPDATE idempotency_keys k
        SET fingerprint = p_fingerprint, state = 'in_flight', owner = p_owner,
            locked_until = now() + make_interval(secs => p_lease_seconds), attempt = 1,
            entity = p_entity, fence = p_fence, response_status = NULL,
            response_headers = NULL, response_body = NULL, response_sha256 = NULL,
            body_too_large = false, created_at = now(), completed_at = NULL,
            expires_at = now() + make_interval(secs => p_ttl_seconds)
        WHERE k.tenant = p_tenant AND k.key = p_key;
        RETURN QUERY SELECT 'reserved'::text, 1, NULL::double precision,
            NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
        RETURN;
    END IF;

    IF v_row.fingerprint <> p_fingerprint THEN
        RETURN QUERY SELECT 'mismatch'::text, v_row.attempt, NULL::double precision,
            NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
        RETURN;
    END IF;

    IF v_row.state = 'completed' THEN
        RETURN QUERY SELECT 'replay'::text, v_row.attempt, NULL::double precision,
            v_row.response_status, v_row.response_headers::text, v_row.response_body,
            v_row.response_sha256, v_row.body_too_large;
        RETURN;
    END IF;

    IF v_row.state = 'in_flight' AND v_row.locked_until > now() THEN
        RETURN QUERY SELECT 'in_flight'::text, v_row.attempt,
            extract(epoch FROM v_row.locked_until - now())::double precision,
            NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
        RETURN;
    END IF;

    IF v_row.state = 'outcome_unknown' AND NOT p_retry_unknown THEN
        RETURN QUERY SELECT 'unknown'::text, v_row.attempt, NULL::double precision,
            NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
        RETURN;
    END IF;

    UPDATE idempotency_keys k
    SET state = 'in_flight', owner = p_owner,
        locked_until = now() + make_interval(secs => p_lease_seconds),
        attempt = k.attempt + 1, entity = p_entity, fence = p_fence
    WHERE k.tenant = p_tenant AND k.key = p_key
    RETURNING k.attempt INTO v_attempt;
    RETURN QUERY SELECT
        (CASE WHEN v_row.state = 'in_flight' THEN 'taken_over' ELSE 'retry_unknown' END)::text,
        v_attempt, NULL::double precision,
        NULL::integer, NULL::text, NULL::bytea, NULL::text, NULL::boolean;
END;
$$;

-- One round trip of a gateway: the decisions (steps 3 and 4) and the recorded answers
-- (step 6) that queued up while its previous round trip ran, in one transaction.
-- Decision i answers with d_index = i, recorded answer i with d_index = -i
-- (d_outcome 'completed', or 'not_held' when the reservation is no longer the caller's).
-- Decision outcomes: stale | fence_only, or one of fencegate_decide_key's.
-- Every fence row is locked before any key row, each kind in sorted order, as in a single
-- decision: concurrent round trips take their locks in one global order and cannot
-- deadlock.
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
    v_fence record;
    v_step record;
    i integer;
BEGIN
    FOR i IN
        SELECT o.i FROM generate_subscripts(p_tenants, 1) AS o(i)
        WHERE p_fences[o.i] IS NOT NULL
        ORDER BY p_tenants[o.i], p_entities[o.i], o.i
    LOOP
        SELECT * INTO v_fence FROM fencegate_accept_fence(p_tenants[i], p_entities[i], p_fences[i]);
        v_last[i] := v_fence.last_accepted;
        v_stale[i] := NOT v_fence.accepted;
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
        IF v_step.record THEN
            UPDATE idempotency_keys k
            SET state = 'completed', response_status = c_statuses[i],
                response_headers = c_headers[i]::jsonb, response_body = c_bodies[i],
                response_sha256 = c_sha256[i], body_too_large = c_too_large[i],
                completed_at = now(), locked_until = NULL
            WHERE k.tenant = c_tenants[i] AND k.key = c_keys[i] AND k.owner = c_owners[i]
                AND k.attempt = c_attempts[i] AND k.state = 'in_flight';
            RETURN QUERY SELECT -i, (CASE WHEN FOUND THEN 'completed' ELSE 'not_held' END)::text,
                NULL::bigint, NULL::integer, NULL::double precision, NULL::integer, NULL::text,
                NULL::bytea, NULL::text, NULL::boolean;
        ELSIF v_stale[i] THEN
            RETURN QUERY SELECT i, 'stale'::text, v_last[i], NULL::integer,
                NULL::double precision, NULL::integer, NULL::text, NULL::bytea, NULL::text,
                NULL::boolean;
        ELSIF p_keys[i] IS NULL THEN
            RETURN QUERY SELECT i, 'fence_only'::text, v_last[i], NULL::integer,
                NULL::double precision, NULL::integer, NULL::text, NULL::bytea, NULL::text,
                NULL::boolean;
        ELSE
            RETURN QUERY SELECT i, d.d_outcome, v_last[i], d.d_attempt, d.d_retry_after,
                d.d_response_status, d.d_response_headers, d.d_response_body,
                d.d_response_sha256, d.d_body_too_large
            FROM fencegate_decide_key(
                p_tenants[i], p_keys[i], p_fingerprints[i], p_entities[i], p_fences[i],
                p_owners[i], p_lease_seconds[i], p_ttl_seconds[i], p_retry_unknown[i]) AS d;
        END IF;
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
