-- New queued jobs wake the workers that LISTEN on fencegate_jobs (one notification per kind
-- and statement), with the trigger that calls it.
CREATE OR REPLACE FUNCTION fencegate_notify_inserted() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('fencegate_jobs', k.kind)
    FROM (SELECT DISTINCT kind FROM fencegate_new_jobs WHERE state = 'queued') AS k;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS fencegate_jobs_notify_insert ON fencegate_jobs;
CREATE TRIGGER fencegate_jobs_notify_insert AFTER INSERT ON fencegate_jobs REFERENCING NEW TABLE AS fencegate_new_jobs FOR EACH STATEMENT EXECUTE FUNCTION fencegate_notify_inserted();
