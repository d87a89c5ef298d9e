-- Pre-1.0 migration, kept only to bring a database made before 1.0 to the 1.0 baseline
-- (fencegate/store/migrations.py). Its functions and triggers were taken out: each now
-- lives in ../functions/, applied after this.
-- A reservation must never outlive the gateway that asked for it (a 503 store-unavailable
-- promises "nothing forwarded, nothing left behind"). fencegate_step now takes the caller's
-- remaining time: it waits for locks no longer than that (lock_timeout, for this
-- transaction only) and refuses to return, so the transaction rolls back, once that time has
-- passed. A lease and a reservation time start when the row is written (clock_timestamp()),
-- not when the transaction began (now()): a step that waited for a lock is not born with its
-- lease already run down. The body is otherwise 004's.

DROP FUNCTION IF EXISTS fencegate_step(
    text[], text[], text[], text[], bigint[], text[], double precision[], double precision[],
    boolean[], text[], text[], text[], integer[], integer[], text[], bytea[], text[], boolean[]);

