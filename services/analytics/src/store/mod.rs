//! Where LLM calls live: rows in SQL ([`CallStore`], as an `Arc<dyn CallStore>` that [`open`]
//! picks by the database URL) and bodies in an object store (`ecoscan_objects::ObjectStore`: a
//! local directory or S3). The one SQL implementation, [`SqlCallStore`] (`sql.rs`), is written
//! once for SQLite ([`sqlite`], embedded) and PostgreSQL ([`postgres`], production); each of
//! those only opens its database and carries a batch of rows in its own way ([`CallSql`]).

use std::{collections::HashSet, sync::Arc};

use async_trait::async_trait;

pub mod postgres;
mod sql;
pub mod sqlite;

pub use postgres::PgCallStore;
pub use sql::{CallSql, SqlCallStore};
pub use sqlite::SqliteCallStore;

/// Whether `url` names a PostgreSQL database (anything else is taken for SQLite).
pub use ecoscan_sql::is_postgres;

/// What a store operation fails with (shared by every SQL store of the workspace).
pub use ecoscan_sql::StoreError;

/// Opens the database at `url` — PostgreSQL for a `postgres://` URL, SQLite otherwise — and
/// brings its schema up to date.
pub async fn open(url: &str) -> Result<Arc<dyn CallStore>, StoreError> {
    Ok(if is_postgres(url) {
        Arc::new(PgCallStore::connect(url).await?)
    } else {
        Arc::new(SqliteCallStore::connect(url).await?)
    })
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
    /// Of `input_tokens`, those read from the provider's prompt cache.
    pub cached_input_tokens: i64,
    /// Images sent with the call.
    pub images: i64,
    /// What it cost in micro-units; `None` when no price was known (never read as zero).
    pub cost_micros: Option<i64>,
    /// The price version of `cost_micros`; empty when unknown.
    pub price_version: String,
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
    pub cost_micros: Option<i64>,
}

/// Rows of LLM calls.
#[async_trait]
pub trait CallStore: Send + Sync + 'static {
    /// Inserts `rows` in one transaction, skipping ids already stored (and repeats within
    /// `rows` after the first), and returns the ids it inserted. Returns after commit.
    async fn insert_batch(&self, rows: &[CallRow]) -> Result<HashSet<String>, StoreError>;

    /// The call with `call_id`, if stored.
    async fn get(&self, call_id: &str) -> Result<Option<CallRow>, StoreError>;

    /// Every call whose start lies in `[since_us, until_us)`.
    async fn usage_samples(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> Result<Vec<UsageSample>, StoreError>;

    /// Closes every connection.
    async fn close(&self);
    /// Whether the database answers, for one reached over the network (PostgreSQL).
    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        None
    }

    /// The connections of the database's pool, for one reached over the network (PostgreSQL).
    fn pool_stats(&self) -> Option<ecoscan_common::store_health::PoolStats> {
        None
    }
}
