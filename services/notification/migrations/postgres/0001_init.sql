-- A user's inbox: every notification, delivered now, scheduled for later, or cancelled.
CREATE TABLE notifications (
    -- UUID v7, so ids sort by creation time.
    id               TEXT    PRIMARY KEY,
    user_id          TEXT    NOT NULL,
    kind             TEXT    NOT NULL,
    title            TEXT    NOT NULL,
    body             TEXT    NOT NULL,
    job_id           TEXT    NOT NULL,
    -- NULL when the caller sent no key: such rows never collide in the index below.
    dedupe_key       TEXT,
    status           TEXT    NOT NULL CHECK (status IN ('scheduled', 'delivered', 'cancelled')),
    -- Microseconds since the Unix epoch.
    due_at_us        BIGINT,
    created_at_us    BIGINT  NOT NULL,
    delivered_at_us  BIGINT
);

-- One notification per (user, dedupe key); rows without a key are not indexed at all.
CREATE UNIQUE INDEX notifications_dedupe
    ON notifications (user_id, dedupe_key) WHERE dedupe_key IS NOT NULL;

CREATE INDEX notifications_inbox ON notifications (user_id, created_at_us);

-- What the scheduler reloads at start.
CREATE INDEX notifications_pending ON notifications (due_at_us) WHERE status = 'scheduled';
