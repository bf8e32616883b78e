-- What each call cost (analytics prices it from ANALYTICS_PRICES when it records it): micro-units
-- of the price table's currency, NULL when no price was known (never read as zero), and the
-- price version used; with the cached input tokens and images the price depends on. Additive:
-- an earlier replica inserts rows without them, which read as unpriced.
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS cached_input_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS images BIGINT NOT NULL DEFAULT 0;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS cost_micros BIGINT;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS price_version TEXT NOT NULL DEFAULT '';
