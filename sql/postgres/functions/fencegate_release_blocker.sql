-- The release rule (DESIGN §8): whether a key whose outcome is unknown may be made runnable
-- again, because no copy of its request can still reach the upstream. NULL: safe now.
-- Otherwise why not, first match wins:
--   not_unknown     nothing to release: the key is completed
--   lease_live      in flight under a live lease: its gateway may be sending it now
--   owner_alive     in flight, lease over, but its gateway heartbeats: it may still record or
--                   release the key itself
--   release_margin  a request sent before the lease ended (or before the outcome became
--                   unknown) may still be on its way: safe from locked_until + margin
-- The operator's commands, the console and the reconciler all ask this one function; SQLite's
-- twin is fencegate/store/release_rule.py, held to it by a differential test.
-- p_owner_alive_until: the owner gateway's registration (fencegate_gateways.alive_until of
-- the owner's text before its first '/'), NULL when it has none; p_now: the database clock
-- (now()). Both read by the caller, so that this function reads neither a table nor the clock:
-- immutable (the state as the enum: its cast to text is not), it runs wherever the key's row is (on Citus, its worker; Citus calls no
-- non-immutable function on a distributed row in an UPDATE). PL/pgSQL, so that the planner
-- never inlines it.
CREATE OR REPLACE FUNCTION fencegate_release_blocker(
    p_state fencegate_key_state, p_owner text, p_locked_until timestamptz,
    p_margin_seconds double precision, p_owner_alive_until timestamptz, p_now timestamptz)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_now timestamptz := p_now;
BEGIN
    IF p_state IS DISTINCT FROM 'in_flight' AND p_state IS DISTINCT FROM 'outcome_unknown' THEN
        RETURN 'not_unknown';
    END IF;
    IF p_state = 'in_flight' AND p_locked_until > v_now THEN
        RETURN 'lease_live';
    END IF;
    IF p_state = 'in_flight' AND p_owner IS NOT NULL AND p_owner_alive_until > v_now THEN
        RETURN 'owner_alive';
    END IF;
    IF coalesce(p_locked_until, v_now) + make_interval(secs => p_margin_seconds) > v_now THEN
        RETURN 'release_margin';
    END IF;
    RETURN NULL;
END;
$$;
