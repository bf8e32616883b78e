//! Where LLM calls live: rows in SQL ([`CallStore`]; [`sqlite`] embedded, [`postgres`] in
//! production, [`AnyCallStore`] picks one by the database URL) and bodies in an object store
//! (`ecoscan_objects::ObjectStore`: a local directory or S3).

use std::{collections::HashSet, future::Future};

pub mod postgres;
pub mod sqlite;

pub use postgres::PgCallStore;
pub use sqlite::SqliteCallStore;

/// Whether `url` names a PostgreSQL database (anything else is taken for SQLite).
pub use ecoscan_sql::is_postgres;

/// The store the configuration names: PostgreSQL for a `postgres://` URL, SQLite otherwise.
#[derive(Debug, Clone)]
pub enum AnyCallStore {
    Sqlite(SqliteCallStore),
    Postgres(PgCallStore),
}

impl AnyCallStore {
    /// Opens the database at `url` and brings its schema up to date.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        Ok(if is_postgres(url) {
            Self::Postgres(PgCallStore::connect(url).await?)
        } else {
            Self::Sqlite(SqliteCallStore::connect(url).await?)
        })
    }

    /// Closes every connection.
    pub async fn close(&self) {
        match self {
            Self::Sqlite(s) => s.close().await,
            Self::Postgres(s) => s.close().await,
        }
    }
}

impl CallStore for AnyCallStore {
    async fn insert_batch(&self, rows: &[CallRow]) -> anyhow::Result<HashSet<String>> {
        match self {
            Self::Sqlite(s) => s.insert_batch(rows).await,
            Self::Postgres(s) => s.insert_batch(rows).await,
        }
    }

    async fn get(&self, call_id: &str) -> anyhow::Result<Option<CallRow>> {
        match self {
            Self::Sqlite(s) => s.get(call_id).await,
            Self::Postgres(s) => s.get(call_id).await,
        }
    }

    async fn usage_samples(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> anyhow::Result<Vec<UsageSample>> {
        match self {
            Self::Sqlite(s) => s.usage_samples(since_us, until_us).await,
            Self::Postgres(s) => s.usage_samples(since_us, until_us).await,
        }
    }
}

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
