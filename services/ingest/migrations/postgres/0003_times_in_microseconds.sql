-- One time representation across ecoscan's SQL stores: microseconds since the Unix epoch (as
-- analytics, notification and reward keep them). The columns are renamed with their unit, so
-- a replica of an earlier version fails loudly on them instead of reading a time 1000 times
-- too far away; indexes on them follow the rename.
ALTER TABLE scan_jobs RENAME COLUMN created_at_ms TO created_at_us;
ALTER TABLE scan_jobs RENAME COLUMN updated_at_ms TO updated_at_us;
ALTER TABLE scan_jobs RENAME COLUMN finished_at_ms TO finished_at_us;
ALTER TABLE scan_jobs RENAME COLUMN dead_at_ms TO dead_at_us;
UPDATE scan_jobs SET
    created_at_us = created_at_us * 1000,
    updated_at_us = updated_at_us * 1000,
    finished_at_us = finished_at_us * 1000,
    dead_at_us = dead_at_us * 1000;
