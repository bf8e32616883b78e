//! Where LLM calls live: rows in SQL ([`CallStore`]) and bodies in an object store
//! ([`BodyStore`]). The service names only these traits; [`sqlite`] and [`local`] are the embedded
//! implementations, and PostgreSQL and S3 ones can sit beside them.

use std::{collections::HashSet, future::Future};

pub mod local;
pub mod sqlite;

pub use local::LocalDirBodyStore;
pub use sqlite::SqliteCallStore;

/// One stored call, as a row (bodies are referenced, not included).
#[derive(Debug, Clone, PartialEq)]
pub struct CallRow {
    pub call_id: String,
    pub service: String,
    pub provider: String,
    pub model: String,
    pub operation: String,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub latency_ms: f64,
    pub ttft_ms: f64,
    pub status: i32,
    pub error: String,
    /// Object holding the bodies; empty when the call had none.
    pub body_key: String,
    pub body_offset: i64,
    pub request_len: i64,
    pub response_len: i64,
    pub job_id: String,
    pub trace_id: String,
    pub started_at_us: i64,
    pub recorded_at_us: i64,
}

/// The columns a usage aggregate needs, one per call in the window.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageSample {
    pub service: String,
    pub model: String,
    pub status: i32,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub latency_ms: f64,
}

/// Rows of LLM calls.
pub trait CallStore: Send + Sync + 'static {
    /// Inserts `rows` in one transaction, skipping ids already stored (and repeats within
    /// `rows` after the first), and returns the ids it inserted. Returns after commit.
    fn insert_batch(
        &self,
        rows: &[CallRow],
    ) -> impl Future<Output = anyhow::Result<HashSet<String>>> + Send;

    /// The call with `call_id`, if stored.
    fn get(&self, call_id: &str) -> impl Future<Output = anyhow::Result<Option<CallRow>>> + Send;

    /// Every call whose start lies in `[since_us, until_us)`.
    fn usage_samples(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> impl Future<Output = anyhow::Result<Vec<UsageSample>>> + Send;
}

/// Objects by key (request and response bodies, one object per written batch).
pub trait BodyStore: Send + Sync + 'static {
    /// Stores `bytes` under `key` durably before returning, replacing any object with that key.
    fn put(&self, key: &str, bytes: Vec<u8>) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// The object under `key`, or `None` when there is none.
    fn get(&self, key: &str) -> impl Future<Output = anyhow::Result<Option<Vec<u8>>>> + Send;
}
