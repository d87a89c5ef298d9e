-- fencegate_step: one round trip of a gateway (DESIGN §1 steps 3, 4 and 6): the decisions and
-- the answers to record that queued up, in one transaction, with their decision-history rows.
-- This file is the step's only home: `fencegate migrate` applies it again whenever its text
-- changes (a repeatable migration). SQLite's twin is fencegate/store/sqlite.py, held to it by
-- tests/integration/test_gateway_differential.py.
--
-- p_tenant: the one tenant every step of the batch is for, or NULL for a batch that mixes
-- tenants. On Citus (docs/operations/citus.md) the step is a distributed function on this
-- argument, colocated with the tenant's tables: Citus runs the whole call on the worker that
-- holds the tenant's shard, as one local transaction. Citus plans no volatile function in an
-- UPDATE of a distributed table, nor a non-immutable one in an upsert's DO UPDATE: the
-- database clock is read into v_now (the transaction's start, as now()) and v_clock (the
-- moment a lease starts, read after the row it is written on is locked or inserted).
CREATE OR REPLACE FUNCTION fencegate_step(p_tenant text, p_decides fencegate_decide_step[], p_records fencegate_record_step[], p_history boolean, p_budget_ms double precision DEFAULT NULL::double precision) RETURNS TABLE(d_index integer, d_outcome text, d_last_accepted bigint, d_attempt integer, d_reserved_age double precision, d_key_state text, d_since timestamp with time zone, d_response_status integer, d_response_headers text, d_response_body bytea, d_response_sha256 text, d_body_too_large boolean, d_reconcile_after timestamp with time zone)
    LANGUAGE plpgsql
    AS $$
DECLARE
    n integer := coalesce(cardinality(p_decides), 0);
    v_stale boolean[] := array_fill(false, ARRAY[n]);
    v_last bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    -- Fences accepted without a write: equal to the one accepted, on a replay.
    v_unwritten boolean[] := array_fill(false, ARRAY[n]);
    v_d fencegate_decide_step;
    v_c fencegate_record_step;
    v_row fencegate_idempotency_keys%ROWTYPE;
    v_step record;
    v_fence bigint;
    v_found boolean;
    v_raised boolean;
    v_inserted boolean;
    i integer;
    v_deadline timestamptz;
    -- What a step did, for its history row.
    d_entity text;
    d_fence bigint;
    d_expires_at timestamptz;
    v_row_history fencegate_decisions%ROWTYPE;
    v_history fencegate_decisions[] := '{}';
    v_changed boolean := false;
    v_now timestamptz := now();
    v_clock timestamptz;
BEGIN
    IF p_tenant IS NOT NULL AND (
        EXISTS (SELECT 1 FROM unnest(p_decides) AS d WHERE d.tenant IS DISTINCT FROM p_tenant)
        OR EXISTS (SELECT 1 FROM unnest(p_records) AS c WHERE c.tenant IS DISTINCT FROM p_tenant))
    THEN
        RAISE EXCEPTION 'fencegate_step: a step of this batch is not for tenant %', p_tenant
            USING ERRCODE = '22023';
    END IF;
    IF p_budget_ms IS NOT NULL THEN
        v_deadline := statement_timestamp() + make_interval(secs => p_budget_ms / 1000.0);
        -- For this transaction only: a lock held elsewhere fails the step in time.
        PERFORM set_config('lock_timeout', greatest(ceil(p_budget_ms), 1)::bigint || 'ms', true);
    END IF;
    -- Step 3: accept each fence or find it stale. A stale fence changes nothing.
    FOR i IN
        SELECT d.ordinality::integer FROM unnest(p_decides) WITH ORDINALITY AS d
        WHERE d.fence IS NOT NULL
        ORDER BY d.tenant, d.entity, d.ordinality
    LOOP
        v_d := p_decides[i];
        -- The entity usually has a row already: a plain UPDATE is the cheapest way to raise
        -- it (it waits for a concurrent writer of the row, then checks the newest version).
        -- Not a retry of a completed key with the fence already accepted (the usual fenced
        -- replay): that one raises nothing, forwards nothing, and is only read (below), so
        -- that a batch of such replays writes no fence and need not wait for the disk.
        UPDATE fencegate_fences f SET last_accepted = v_d.fence, updated_at = v_now
        WHERE f.tenant = v_d.tenant AND f.entity = v_d.entity
            AND f.last_accepted <= v_d.fence
            AND NOT (f.last_accepted = v_d.fence AND v_d.key IS NOT NULL AND EXISTS (
                SELECT 1 FROM fencegate_idempotency_keys k
                WHERE k.tenant = v_d.tenant AND k.key = v_d.key AND k.state = 'completed'
                    AND k.expires_at > v_now AND k.fingerprint = v_d.fingerprint));
        v_raised := FOUND;
        IF NOT v_raised AND v_d.key IS NOT NULL THEN
            SELECT f.last_accepted INTO v_fence
            FROM fencegate_fences f WHERE f.tenant = v_d.tenant AND f.entity = v_d.entity;
            IF FOUND AND v_fence = v_d.fence AND EXISTS (
                SELECT 1 FROM fencegate_idempotency_keys k
                WHERE k.tenant = v_d.tenant AND k.key = v_d.key AND k.state = 'completed'
                    AND k.expires_at > v_now AND k.fingerprint = v_d.fingerprint) THEN
                -- Accepted as it stands; the key is read as a replay below (a completed key
                -- changes only when it expires: v_now is this whole step's clock).
                v_unwritten[i] := true;
                v_last[i] := v_d.fence;
                CONTINUE;
            END IF;
        END IF;
        IF NOT v_raised THEN
            -- A new entity, or a stale fence: the upsert decides atomically, and leaves the
            -- row locked either way.
            INSERT INTO fencegate_fences AS f (tenant, entity, last_accepted, updated_at)
            VALUES (v_d.tenant, v_d.entity, v_d.fence, v_now)
            ON CONFLICT (tenant, entity) DO UPDATE
                SET last_accepted = EXCLUDED.last_accepted, updated_at = EXCLUDED.updated_at
                WHERE f.last_accepted <= EXCLUDED.last_accepted;
            IF NOT FOUND THEN
                v_stale[i] := true;
                SELECT f.last_accepted INTO v_fence
                FROM fencegate_fences f WHERE f.tenant = v_d.tenant AND f.entity = v_d.entity;
                v_last[i] := v_fence;
                CONTINUE;
            END IF;
        END IF;
        v_last[i] := v_d.fence;
    END LOOP;

    FOR v_step IN
        SELECT * FROM (
            SELECT false AS record, d.ordinality::integer AS i, d.tenant, d.key
            FROM unnest(p_decides) WITH ORDINALITY AS d
            UNION ALL
            SELECT true, c.ordinality::integer, c.tenant, c.key
            FROM unnest(p_records) WITH ORDINALITY AS c
        ) AS steps
        -- An answer is recorded before a decision on the same key sees it.
        ORDER BY steps.key IS NULL, steps.tenant, steps.key, steps.record DESC, steps.i
    LOOP
        i := v_step.i;
        IF v_step.record THEN
            v_c := p_records[i];
        ELSE
            v_d := p_decides[i];
        END IF;
        <<one_step>>
        BEGIN
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
            d_reconcile_after := NULL;
            d_entity := NULL;
            d_fence := NULL;
            d_expires_at := NULL;

            IF v_step.record THEN
                -- Step 6: conditional on still holding the reservation.
                UPDATE fencegate_idempotency_keys k
                SET state = 'completed', response_status = v_c.status,
                    response_headers = v_c.headers::jsonb, response_body = v_c.body,
                    response_sha256 = v_c.sha256, body_too_large = v_c.too_large,
                    completed_at = v_now, locked_until = NULL, reconcile_after = NULL
                WHERE k.tenant = v_c.tenant AND k.key = v_c.key AND k.owner = v_c.owner
                    AND k.attempt = v_c.attempt AND k.state IN ('in_flight', 'outcome_unknown')
                RETURNING k.entity, k.fence, k.expires_at INTO d_entity, d_fence, d_expires_at;
                d_index := -i;
                d_outcome := CASE WHEN FOUND THEN 'completed' ELSE 'not_held' END;
                EXIT one_step;
            END IF;

            d_index := i;
            d_last_accepted := v_last[i];
            d_expires_at := v_now + make_interval(secs => v_d.ttl_seconds);
            IF v_stale[i] THEN
                d_outcome := 'stale';
                EXIT one_step;
            END IF;
            IF v_d.key IS NULL THEN
                d_outcome := 'fence_only';
                EXIT one_step;
            END IF;

            -- Step 4 (its fence, if any, accepted above). Most keys are new: try to reserve
            -- first (not a replay found above: its key is read).
            IF v_unwritten[i] THEN
                SELECT * INTO v_row FROM fencegate_idempotency_keys k
                WHERE k.tenant = v_d.tenant AND k.key = v_d.key;
                IF NOT (FOUND AND v_row.state = 'completed'
                        AND v_row.fingerprint = v_d.fingerprint) THEN
                    -- Gone since (an expired key purged): its fence was never locked, so
                    -- nothing may be decided on it; the whole step is retried.
                    RAISE EXCEPTION 'idempotency key % changed during the step', v_d.key
                        USING ERRCODE = '40001';
                END IF;
            ELSE
                v_clock := clock_timestamp();
                INSERT INTO fencegate_idempotency_keys AS k (
                    tenant, key, fingerprint, state, owner, locked_until, attempt, entity, fence,
                    created_at, reserved_at, expires_at, method, target, request_body,
                    reconcile_after)
                VALUES (
                    v_d.tenant, v_d.key, v_d.fingerprint, 'in_flight', v_d.owner,
                    v_clock + make_interval(secs => v_d.lease_seconds), 1, v_d.entity,
                    v_d.fence, v_now, v_clock,
                    v_now + make_interval(secs => v_d.ttl_seconds), v_d.method, v_d.target,
                    CASE WHEN v_d.reconcile THEN v_d.request_body END,
                    CASE WHEN v_d.reconcile THEN v_now END)
                ON CONFLICT (tenant, key) DO NOTHING;
                IF FOUND THEN
                    d_outcome := 'reserved';
                    d_attempt := 1;
                    EXIT one_step;
                END IF;

                -- Answers that change nothing (replay, key reused, in flight) are read without a row
                -- lock: many copies of one key must not queue behind each other for a replay.
                SELECT * INTO v_row FROM fencegate_idempotency_keys k
                WHERE k.tenant = v_d.tenant AND k.key = v_d.key;
                v_found := FOUND;
                IF NOT (v_found AND v_row.expires_at > v_now
                        AND (v_row.fingerprint <> v_d.fingerprint OR v_row.state = 'completed'
                             OR (v_row.state = 'in_flight' AND v_row.locked_until > v_now)
                             OR NOT v_d.retry_unknown)) THEN
                    -- The row has to change (or is gone): lock it. A concurrent release can delete
                    -- it between the insert and the lock: try again.
                    v_found := false;
                    v_inserted := false;
                    FOR attempt IN 1..5 LOOP
                        v_clock := clock_timestamp();
                        INSERT INTO fencegate_idempotency_keys AS k (
                            tenant, key, fingerprint, state, owner, locked_until, attempt, entity,
                            fence, created_at, reserved_at, expires_at, method, target,
                            request_body, reconcile_after)
                        VALUES (
                            v_d.tenant, v_d.key, v_d.fingerprint, 'in_flight', v_d.owner,
                            v_clock + make_interval(secs => v_d.lease_seconds), 1,
                            v_d.entity, v_d.fence, v_now, v_clock,
                            v_now + make_interval(secs => v_d.ttl_seconds), v_d.method,
                            v_d.target, CASE WHEN v_d.reconcile THEN v_d.request_body END,
                            CASE WHEN v_d.reconcile THEN v_now END)
                        ON CONFLICT (tenant, key) DO NOTHING;
                        IF FOUND THEN
                            v_inserted := true;
                            EXIT;
                        END IF;
                        SELECT * INTO v_row FROM fencegate_idempotency_keys k
                        WHERE k.tenant = v_d.tenant AND k.key = v_d.key
                        FOR UPDATE;
                        IF FOUND THEN
                            v_found := true;
                            EXIT;
                        END IF;
                    END LOOP;
                    IF v_inserted THEN
                        d_outcome := 'reserved';
                        d_attempt := 1;
                        EXIT one_step;
                    END IF;
                    IF NOT v_found THEN
                        RAISE EXCEPTION 'idempotency key % kept changing under concurrent updates',
                            v_d.key USING ERRCODE = '40001';
                    END IF;
                    IF v_row.expires_at <= v_now THEN
                        -- Expired but not yet purged: the key is free again (its row locked
                        -- above: the lease starts now).
                        v_clock := clock_timestamp();
                        UPDATE fencegate_idempotency_keys k
                        SET fingerprint = v_d.fingerprint, state = 'in_flight', owner = v_d.owner,
                            locked_until = v_clock + make_interval(secs => v_d.lease_seconds),
                            attempt = 1, entity = v_d.entity, fence = v_d.fence,
                            response_status = NULL, response_headers = NULL, response_body = NULL,
                            response_sha256 = NULL, body_too_large = false, created_at = v_now,
                            reserved_at = v_clock, completed_at = NULL,
                            expires_at = v_now + make_interval(secs => v_d.ttl_seconds),
                            method = v_d.method, target = v_d.target,
                            request_body = CASE WHEN v_d.reconcile THEN v_d.request_body END,
                            reconcile_after = CASE WHEN v_d.reconcile THEN v_now END,
                            unknown_reason = NULL, resolution = NULL, reconcile_tries = 0,
                            reconcile_note = NULL
                        WHERE k.tenant = v_d.tenant AND k.key = v_d.key;
                        d_outcome := 'reserved';
                        d_attempt := 1;
                        EXIT one_step;
                    END IF;
                END IF;

            END IF;

            -- v_row is current: read without a lock above, or locked.
            d_attempt := v_row.attempt;
            IF v_row.fingerprint <> v_d.fingerprint THEN
                d_outcome := 'mismatch';
            ELSIF v_row.state = 'completed' THEN
                d_outcome := 'replay';
                d_response_status := v_row.response_status;
                d_response_headers := v_row.response_headers::text;
                d_response_body := v_row.response_body;
                d_response_sha256 := v_row.response_sha256;
                d_body_too_large := v_row.body_too_large;
            ELSIF v_row.state = 'in_flight' AND v_row.locked_until > v_now THEN
                d_outcome := 'in_flight';
                d_reserved_age := greatest(extract(
                    epoch FROM clock_timestamp() - coalesce(v_row.reserved_at, v_row.created_at)
                )::double precision, 0);
            ELSIF NOT v_d.retry_unknown THEN
                -- Marked unknown, or in flight with an expired lease (its gateway died or could
                -- not record): the upstream may have acted. Not forwarded again. While the
                -- key's gateway is alive it still owes the key a write (an answer, a
                -- release): pending, "retry", never an unknown that an operator must settle.
                IF v_row.state = 'in_flight' AND EXISTS (
                    SELECT 1 FROM fencegate_gateways g
                    WHERE g.instance = split_part(v_row.owner, '/', 1)
                        AND g.alive_until > v_now) THEN
                    d_outcome := 'pending';
                ELSE
                    d_outcome := 'unknown';
                END IF;
                d_key_state := v_row.state::text;
                d_since := v_row.locked_until;
                d_reconcile_after := v_row.reconcile_after;
            ELSE
                -- Its row is locked (above): the new lease starts now.
                v_clock := clock_timestamp();
                UPDATE fencegate_idempotency_keys k
                SET state = 'in_flight', owner = v_d.owner,
                    locked_until = v_clock + make_interval(secs => v_d.lease_seconds),
                    reserved_at = v_clock,
                    attempt = k.attempt + 1, entity = v_d.entity, fence = v_d.fence,
                    reconcile_after = CASE WHEN v_d.reconcile THEN v_now END,
                    unknown_reason = NULL
                WHERE k.tenant = v_d.tenant AND k.key = v_d.key
                RETURNING k.attempt INTO d_attempt;
                d_outcome := CASE WHEN v_row.state = 'in_flight' THEN 'taken_over'
                                  ELSE 'retry_unknown' END;
            END IF;
        END;
        RETURN NEXT;
        -- A batch that changed no key and no fence (replays and refusals, no fence given, no
        -- answer recorded) writes only its history rows (below).
        v_changed := v_changed OR v_step.record
            OR d_outcome NOT IN ('replay', 'mismatch', 'in_flight', 'unknown', 'pending')
            OR (v_d.fence IS NOT NULL AND NOT v_unwritten[i]);
        IF p_history AND (NOT v_step.record OR d_outcome = 'completed') THEN
            v_row_history := NULL;
            v_row_history.decision := d_outcome;
            v_row_history.expires_at := d_expires_at;
            IF v_step.record THEN
                v_row_history.tenant := v_c.tenant;
                v_row_history.key := v_c.key;
                v_row_history.entity := d_entity;
                v_row_history.fence := d_fence;
                v_row_history.attempt := v_c.attempt;
                v_row_history.owner := v_c.owner;
                v_row_history.request_id := v_c.request_id;
                v_row_history.upstream_status := v_c.status;
            ELSE
                v_row_history.tenant := v_d.tenant;
                v_row_history.key := v_d.key;
                v_row_history.entity := v_d.entity;
                v_row_history.fence := v_d.fence;
                v_row_history.attempt := d_attempt;
                v_row_history.owner := v_d.owner;
                v_row_history.request_id := v_d.request_id;
                v_row_history.method := v_d.method;
                v_row_history.target := v_d.target;
            END IF;
            v_history := v_history || v_row_history;
        END IF;
    END LOOP;
    IF cardinality(v_history) > 0 THEN
        INSERT INTO fencegate_decisions (
            tenant, entity, key, fence, decision, attempt, owner, request_id, method, target,
            upstream_status, expires_at)
        SELECT h.tenant, h.entity, h.key, h.fence, h.decision, h.attempt, h.owner,
            h.request_id, h.method, h.target, h.upstream_status, h.expires_at
        FROM unnest(v_history) AS h;
    END IF;
    IF NOT v_changed THEN
        -- Its commit need not wait for the WAL to reach the disk: a database crash can lose
        -- the last such history rows, never a key, a fence or an answer.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- The caller has given up by now (its 503 said nothing was forwarded): nothing of this
    -- step may commit.
    IF v_deadline IS NOT NULL AND clock_timestamp() > v_deadline THEN
        RAISE EXCEPTION 'the caller''s deadline passed before the step could commit'
            USING ERRCODE = '57014';
    END IF;
END;
$$;
