-- Dead letters retried on a schedule: why a job was set aside (`attempts`: started too often
-- without finishing; `store`: a record of it cannot be read), which decides whether the
-- schedule retries it, and how often the schedule has requeued it since an operator last did
-- (its backoff and its limit). Additive: an earlier replica reads the rows as before.
ALTER TABLE scan_jobs ADD COLUMN IF NOT EXISTS dead_reason TEXT;
ALTER TABLE scan_jobs ADD COLUMN IF NOT EXISTS auto_requeues INTEGER NOT NULL DEFAULT 0;
