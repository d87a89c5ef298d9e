-- An attempt's row is written twice: inserted when its lease is granted, then updated when
-- the attempt ends (ended_at, outcome, perhaps an error), which makes it longer. With the
-- inserts filling 80% of each page, under half of those updates found room on the row's
-- own page at concurrency 50 (45% of them heap-only, pg_stat_user_tables over 20,000 jobs);
-- each of the others wrote a new entry into both of the table's indexes. Pages filled to
-- half leave room for nine in ten. Only pages filled from now on are affected: no rewrite,
-- and the lock taken (SHARE UPDATE EXCLUSIVE) lets reads and writes go on.
ALTER TABLE fencegate_job_attempts SET (fillfactor = 50);
