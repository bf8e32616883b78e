-- Who owns which character, and the scan that first earned it. One row per (user, character):
-- the primary key is what makes a grant idempotent under concurrency.
CREATE TABLE owned_characters (
    user_id         TEXT    NOT NULL,
    character_code  TEXT    NOT NULL,
    job_id          TEXT    NOT NULL,
    -- Microseconds since the Unix epoch.
    acquired_at_us  BIGINT  NOT NULL,
    PRIMARY KEY (user_id, character_code)
);

CREATE INDEX owned_characters_by_user ON owned_characters (user_id, acquired_at_us);

-- The first eligible decision per scan, so a replayed job gets exactly the same answer.
CREATE TABLE reward_decisions (
    job_id          TEXT    PRIMARY KEY,
    user_id         TEXT    NOT NULL,
    eligible        BOOLEAN NOT NULL,
    newly_granted   BOOLEAN NOT NULL,
    character_code  TEXT,
    reason          TEXT    NOT NULL,
    decided_at_us   BIGINT  NOT NULL
);
