-- Scan jobs in the embedded SQLite database: the row is the truth about a job; in-memory
-- structures are fast paths. The same table as on PostgreSQL (postgres/), so one store's
-- statements run on both. Times are microseconds since the Unix epoch. A database made by an
-- earlier version is brought to this layout first (src/store/sqlite.rs, `upgrade`).
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
    classification  BLOB,              -- stage checkpoints, protobuf-encoded
    rules           BLOB,
    answer          BLOB,
    reward          BLOB,
    error           BLOB,
    attempts        INTEGER NOT NULL DEFAULT 0,
    created_at_us   INTEGER NOT NULL,
    updated_at_us   INTEGER NOT NULL,
    finished_at_us  INTEGER,
    lease_epoch     INTEGER NOT NULL DEFAULT 0,  -- fencing token of the latest claim
    dead_at_us      INTEGER,                     -- set aside for an operator (dead letter)
    end_seq         INTEGER,                     -- seq of the final event, once the log took it
    dead_reason     TEXT,                        -- why it was dead-lettered: attempts, store
    auto_requeues   INTEGER NOT NULL DEFAULT 0,  -- requeued by the schedule since an operator's
    model           TEXT NOT NULL DEFAULT ''     -- the model the scan chose; '' for none
);

CREATE UNIQUE INDEX IF NOT EXISTS scan_jobs_idempotency
    ON scan_jobs (user_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- The sweeper's scan: unfinished jobs (queued = 1, running = 2) by age.
CREATE INDEX IF NOT EXISTS scan_jobs_unfinished
    ON scan_jobs (created_at_us) WHERE status IN (1, 2);

CREATE INDEX IF NOT EXISTS scan_jobs_dead ON scan_jobs (dead_at_us) WHERE dead_at_us IS NOT NULL;

-- Direct uploads (PostgreSQL migration 0006): a photo a client sends to the object store
-- itself, reserved by CreateUpload and named by a later Submit; `job_id` once it was submitted
-- (once). Rows past their expiry are swept, with the objects of those never submitted. A new
-- table, so an older database gets it from this statement without an upgrade step.
CREATE TABLE IF NOT EXISTS scan_uploads (
    id            TEXT PRIMARY KEY,
    user_id       TEXT NOT NULL,
    object_key    TEXT NOT NULL,
    content_type  TEXT NOT NULL,
    size_bytes    INTEGER NOT NULL,
    created_at_us INTEGER NOT NULL,
    expires_at_us INTEGER NOT NULL,
    job_id        TEXT
);

CREATE INDEX IF NOT EXISTS scan_uploads_expiry ON scan_uploads (expires_at_us);
