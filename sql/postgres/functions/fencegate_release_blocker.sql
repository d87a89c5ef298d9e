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
CREATE OR REPLACE FUNCTION fencegate_release_blocker(
    p_state text, p_owner text, p_locked_until timestamptz, p_margin_seconds double precision)
RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT CASE
        WHEN p_state IS DISTINCT FROM 'in_flight' AND p_state IS DISTINCT FROM 'outcome_unknown'
            THEN 'not_unknown'
        WHEN p_state = 'in_flight' AND p_locked_until > now() THEN 'lease_live'
        WHEN p_state = 'in_flight' AND EXISTS (
            SELECT 1 FROM fencegate_gateways g
            WHERE g.instance = split_part(p_owner, '/', 1) AND g.alive_until > now())
            THEN 'owner_alive'
        WHEN coalesce(p_locked_until, now()) + make_interval(secs => p_margin_seconds) > now()
            THEN 'release_margin'
    END
$$;
