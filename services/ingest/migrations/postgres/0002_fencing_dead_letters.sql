-- Fencing: every claim of a job bumps its epoch, and a worker's writes carry the epoch it
-- claimed with, so a worker that lost its lease can no longer change the row.
ALTER TABLE scan_jobs ADD COLUMN IF NOT EXISTS lease_epoch BIGINT NOT NULL DEFAULT 0;
-- Dead letters: poison jobs set aside for an operator to list and requeue.
ALTER TABLE scan_jobs ADD COLUMN IF NOT EXISTS dead_at_ms BIGINT;
CREATE INDEX IF NOT EXISTS scan_jobs_dead ON scan_jobs (dead_at_ms) WHERE dead_at_ms IS NOT NULL;
