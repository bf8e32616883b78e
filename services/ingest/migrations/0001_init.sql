-- Scan jobs: the row is the truth about a job; Redis and in-memory structures are fast paths.
CREATE TABLE IF NOT EXISTS jobs (
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
    classification  BLOB,              -- stage checkpoints, protobuf-encoded
    rules           BLOB,
    answer          BLOB,
    reward          BLOB,
    error           BLOB,
    attempts        INTEGER NOT NULL DEFAULT 0,
    created_at_ms   INTEGER NOT NULL,
    updated_at_ms   INTEGER NOT NULL,
    finished_at_ms  INTEGER,
    lease_epoch     INTEGER NOT NULL DEFAULT 0,  -- fencing token of the latest claim
    dead_at_ms      INTEGER                      -- set aside for an operator (dead letter)
);

CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency
    ON jobs (user_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

CREATE INDEX IF NOT EXISTS jobs_unfinished ON jobs (status) WHERE status IN (1, 2);
