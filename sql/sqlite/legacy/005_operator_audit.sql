-- What operators did (see the PostgreSQL migration of the same name).
CREATE TABLE fencegate_audit (
    id       INTEGER PRIMARY KEY,
    at       REAL NOT NULL,
    actor    TEXT NOT NULL,
    action   TEXT NOT NULL,
    tenant   TEXT,
    subject  TEXT NOT NULL,
    reason   TEXT,
    before   TEXT,
    after    TEXT
);
