-- A user's inbox: every notification, delivered now, scheduled for later, or cancelled.
CREATE TABLE IF NOT EXISTS notifications (
    -- UUID v7, so ids sort by creation time.
    id               TEXT    PRIMARY KEY,
    user_id          TEXT    NOT NULL,
    kind             TEXT    NOT NULL,
    title            TEXT    NOT NULL,
    body             TEXT    NOT NULL,
    job_id           TEXT    NOT NULL,
    -- NULL when the caller sent no key: NULLs never collide in the unique index below.
    dedupe_key       TEXT,
    -- 'scheduled', 'delivered' or 'cancelled'.
    status           TEXT    NOT NULL,
    -- Microseconds since the Unix epoch.
    due_at_us        INTEGER,
    created_at_us    INTEGER NOT NULL,
    delivered_at_us  INTEGER,
    -- The W3C traceparent of the request that scheduled it (its delivery links to it).
    trace_parent     TEXT
);

CREATE UNIQUE INDEX IF NOT EXISTS notifications_dedupe
    ON notifications (user_id, dedupe_key);

CREATE INDEX IF NOT EXISTS notifications_inbox
    ON notifications (user_id, created_at_us);

-- What the reconcile sweep and the reload at start page through, earliest due first (it
-- replaced `notifications_pending (due_at_us)`, dropped from databases that still have it).
CREATE INDEX IF NOT EXISTS notifications_scheduled
    ON notifications (due_at_us, id) WHERE status = 'scheduled';

DROP INDEX IF EXISTS notifications_pending;
