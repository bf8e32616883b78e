-- One row per LLM call. Bodies live in the object store: `body_key` names the batch object
-- (empty when the call had no bodies), and the request body is the `request_len` bytes at
-- `body_offset`, followed by the `response_len` bytes of the response body.
CREATE TABLE IF NOT EXISTS llm_calls (
    call_id         TEXT    PRIMARY KEY,
    service         TEXT    NOT NULL,
    provider        TEXT    NOT NULL,
    model           TEXT    NOT NULL,
    operation       TEXT    NOT NULL,
    input_tokens    INTEGER NOT NULL,
    output_tokens   INTEGER NOT NULL,
    latency_ms      REAL    NOT NULL,
    ttft_ms         REAL    NOT NULL,
    -- ecoscan.v1.CallStatus number.
    status          INTEGER NOT NULL,
    error           TEXT    NOT NULL,
    body_key        TEXT    NOT NULL,
    body_offset     INTEGER NOT NULL,
    request_len     INTEGER NOT NULL,
    response_len    INTEGER NOT NULL,
    job_id          TEXT    NOT NULL,
    trace_id        TEXT    NOT NULL,
    -- Microseconds since the Unix epoch.
    started_at_us   INTEGER NOT NULL,
    recorded_at_us  INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL DEFAULT 0,
    images          INTEGER NOT NULL DEFAULT 0,
    -- Micro-units of the price table's currency; NULL: no price was known (never zero).
    cost_micros     INTEGER,
    price_version   TEXT    NOT NULL DEFAULT ''
);

CREATE INDEX IF NOT EXISTS llm_calls_by_start ON llm_calls (started_at_us);
