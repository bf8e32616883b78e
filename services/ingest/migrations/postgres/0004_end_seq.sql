-- The seq of a job's final event in its log, once the log took it: a watcher that resumes at
-- or past the end of a finished job gets the end from the row alone, at the position the log
-- gave it, whether or not Redis answers, still holds the log, or lost it. NULL until the final
-- event is in the log (and again when an operator requeues the job). Additive: an earlier
-- replica reads the rows as before.
ALTER TABLE scan_jobs ADD COLUMN IF NOT EXISTS end_seq BIGINT;
