-- When the current holder reserved the key: a 409 in-flight says how long the first request
-- may still take (its upstream deadline), not how long its lease runs.
ALTER TABLE idempotency_keys ADD COLUMN reserved_at REAL;
