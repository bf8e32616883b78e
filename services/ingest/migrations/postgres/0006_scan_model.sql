-- A model chosen per scan (LLM_MODELS): the name the scan was submitted with, '' when it
-- named none. Additive: an earlier replica reads the rows as before.
ALTER TABLE scan_jobs ADD COLUMN IF NOT EXISTS model TEXT NOT NULL DEFAULT '';
