#![allow(dead_code, unused_imports)] // Each test binary uses its own part of these helpers.

//! Test helpers: a private PostgreSQL schema per test (shared with every SQL store), and
//! what this crate's tests need besides.

pub use ecoscan_sql::testing::PgSchema;

use ecoscan_proto::v1::{CallStatus, LlmCall};

/// A successful model call of `answer` numbered `i` (its job `job-<i>`) with these bodies,
/// started now.
pub fn llm_call(i: usize, request_body: String, response_body: String) -> LlmCall {
    LlmCall {
        call_id: uuid::Uuid::now_v7().to_string(),
        service: "answer".into(),
        provider: "mock".into(),
        model: "mock-1".into(),
        operation: "generate".into(),
        input_tokens: 100,
        output_tokens: 10,
        latency_ms: 5.0,
        ttft_ms: 1.0,
        status: CallStatus::Ok as i32,
        error: String::new(),
        request_body,
        response_body,
        job_id: format!("job-{i}"),
        trace_id: String::new(),
        started_at: Some(now_in_whole_micros()),
        ..LlmCall::default()
    }
}

/// `call` as analytics stores it: the mock's calls are priced at zero.
pub fn as_recorded(call: &LlmCall) -> LlmCall {
    LlmCall {
        cost_micros: Some(0),
        price_version: "mock".into(),
        ..call.clone()
    }
}

/// Now, to the microsecond (calls are stored so).
pub fn now_in_whole_micros() -> ecoscan_proto::Timestamp {
    let mut ts = ecoscan_proto::now();
    ts.nanos -= ts.nanos % 1_000;
    ts
}
