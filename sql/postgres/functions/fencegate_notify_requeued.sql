-- A job put back in the queue (retried, or its lease taken back) wakes the workers too, with
-- the trigger that calls it.
CREATE OR REPLACE FUNCTION fencegate_notify_requeued() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('fencegate_jobs', NEW.kind);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS fencegate_jobs_notify_requeue ON fencegate_jobs;
CREATE TRIGGER fencegate_jobs_notify_requeue AFTER UPDATE OF state ON fencegate_jobs FOR EACH ROW WHEN (((new.state = 'queued'::text) AND (old.state <> 'queued'::text) AND (new.run_after <= now()))) EXECUTE FUNCTION fencegate_notify_requeued();
