-- The W3C traceparent of the request that scheduled a notification: its delivery, later and
-- in a trace of its own, links to that request's span. NULL for rows from before, and for
-- requests that were not traced.
ALTER TABLE notifications ADD COLUMN IF NOT EXISTS trace_parent TEXT;
