-- Scan jobs on PostgreSQL: the row is the truth about a job; Redis is a fast path.
-- Same columns and semantics as the SQLite schema (../0001_init.sql).
CREATE TABLE IF NOT EXISTS scan_jobs (
    id              TEXT PRIMARY KEY,
    user_id         TEXT NOT NULL,
    status          INTEGER NOT NULL,  -- ecoscan.v1.JobStatus
    stage           INTEGER NOT NULL,  -- ecoscan.v1.Stage reached
    image_key       TEXT NOT NULL,
    content_type    TEXT NOT NULL,
    hint            TEXT NOT NULL,
    locale          TEXT NOT NULL,
    idempotency_key TEXT,
    trace_carrier   TEXT NOT NULL,     -- W3C trace context of the submitting request, as JSON
    classification  BYTEA,             -- stage checkpoints, protobuf-encoded
    rules           BYTEA,
    answer          BYTEA,
    reward          BYTEA,
    error           BYTEA,
    attempts        INTEGER NOT NULL DEFAULT 0,
    created_at_ms   BIGINT NOT NULL,
    updated_at_ms   BIGINT NOT NULL,
    finished_at_ms  BIGINT
);

CREATE UNIQUE INDEX IF NOT EXISTS scan_jobs_idempotency
    ON scan_jobs (user_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- The sweeper's scan: unfinished jobs (queued = 1, running = 2) by age.
CREATE INDEX IF NOT EXISTS scan_jobs_unfinished
    ON scan_jobs (created_at_ms) WHERE status IN (1, 2);
