-- An unknown outcome is never forwarded again unless the route says so (docs/protocol.md §3):
-- an in-flight key whose lease expired is unknown like one marked so, a late answer from
-- the holder of an unknown key still completes it, and a 409 in-flight says how long the
-- first request may still take (from reserved_at), not how long its lease runs.

ALTER TABLE idempotency_keys ADD COLUMN reserved_at timestamptz;

-- Nothing calls the single-decision wrapper; the gateway batches through fencegate_step.
DROP FUNCTION fencegate_decide(
    text, text, text, text, bigint, text, double precision, double precision, boolean);
DROP FUNCTION fencegate_step(
    text[], text[], text[], text[], bigint[], text[], double precision[], double precision[],
    boolean[], text[], text[], text[], integer[], integer[], text[], bytea[], text[], boolean[]);

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
    d_reserved_age double precision,
    d_key_state text,
    d_since timestamptz,
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
        d_reserved_age := NULL;
        d_key_state := NULL;
        d_since := NULL;
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
                AND k.attempt = c_attempts[i] AND k.state IN ('in_flight', 'outcome_unknown');
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
            created_at, reserved_at, expires_at)
        VALUES (
            p_tenants[i], p_keys[i], p_fingerprints[i], 'in_flight', p_owners[i],
            now() + make_interval(secs => p_lease_seconds[i]), 1, p_entities[i], p_fences[i],
            now(), now(), now() + make_interval(secs => p_ttl_seconds[i]))
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
                     OR (v_row.state = 'in_flight' AND v_row.locked_until > now())
                     OR NOT p_retry_unknown[i])) THEN
            -- The row has to change (or is gone): lock it. A concurrent release can delete
            -- it between the insert and the lock: try again.
            v_found := false;
            v_inserted := false;
            FOR attempt IN 1..5 LOOP
                INSERT INTO idempotency_keys AS k (
                    tenant, key, fingerprint, state, owner, locked_until, attempt, entity,
                    fence, created_at, reserved_at, expires_at)
                VALUES (
                    p_tenants[i], p_keys[i], p_fingerprints[i], 'in_flight', p_owners[i],
                    now() + make_interval(secs => p_lease_seconds[i]), 1, p_entities[i],
                    p_fences[i], now(), now(), now() + make_interval(secs => p_ttl_seconds[i]))
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
                    reserved_at = now(), completed_at = NULL,
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
            d_reserved_age := extract(
                epoch FROM now() - coalesce(v_row.reserved_at, v_row.created_at))::double precision;
        ELSIF NOT p_retry_unknown[i] THEN
            -- Marked unknown, or in flight with an expired lease (its gateway died or could
            -- not record): the upstream may have acted. Not forwarded again.
            d_outcome := 'unknown';
            d_key_state := v_row.state::text;
            d_since := v_row.locked_until;
        ELSE
            UPDATE idempotency_keys k
            SET state = 'in_flight', owner = p_owners[i],
                locked_until = now() + make_interval(secs => p_lease_seconds[i]),
                reserved_at = now(),
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
