-- One row per LLM call. Bodies live in the object store: `body_key` names the batch object
-- (empty when the call had no bodies), and the request body is the `request_len` bytes at
-- `body_offset`, followed by the `response_len` bytes of the response body.
CREATE TABLE llm_calls (
    call_id         TEXT             PRIMARY KEY,
    service         TEXT             NOT NULL,
    provider        TEXT             NOT NULL,
    model           TEXT             NOT NULL,
    operation       TEXT             NOT NULL,
    input_tokens    BIGINT           NOT NULL,
    output_tokens   BIGINT           NOT NULL,
    latency_ms      DOUBLE PRECISION NOT NULL,
    ttft_ms         DOUBLE PRECISION NOT NULL,
    -- ecoscan.v1.CallStatus number.
    status          INTEGER          NOT NULL,
    error           TEXT             NOT NULL,
    body_key        TEXT             NOT NULL,
    body_offset     BIGINT           NOT NULL,
    request_len     BIGINT           NOT NULL,
    response_len    BIGINT           NOT NULL,
    job_id          TEXT             NOT NULL,
    trace_id        TEXT             NOT NULL,
    -- Microseconds since the Unix epoch.
    started_at_us   BIGINT           NOT NULL,
    recorded_at_us  BIGINT           NOT NULL
);

CREATE INDEX llm_calls_by_start ON llm_calls (started_at_us);
