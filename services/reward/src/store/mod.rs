//! Where grants and decisions live. The service talks to [`RewardStore`] only, as an
//! `Arc<dyn RewardStore>` that [`open`] picks by the database URL; the one implementation,
//! [`SqlRewardStore`] (`sql.rs`), is written once and runs on SQLite ([`sqlite`], embedded) and
//! PostgreSQL ([`postgres`], production), which differ only in how they are opened.

use std::sync::Arc;

use async_trait::async_trait;

pub mod postgres;
mod sql;
pub mod sqlite;

pub use postgres::PgRewardStore;
pub use sql::SqlRewardStore;
pub use sqlite::SqliteRewardStore;

/// Whether `url` names a PostgreSQL database (anything else is taken for SQLite).
pub use ecoscan_sql::is_postgres;

/// Opens the database at `url` — PostgreSQL for a `postgres://` URL, SQLite otherwise — and
/// brings its schema up to date.
pub async fn open(url: &str) -> Result<Arc<dyn RewardStore>, StoreError> {
    Ok(if is_postgres(url) {
        Arc::new(PgRewardStore::connect(url).await?)
    } else {
        Arc::new(SqliteRewardStore::connect(url).await?)
    })
}

/// What a store operation fails with (shared by every SQL store of the workspace).
pub use ecoscan_sql::StoreError;

/// What the service asks the store to grant: `character_code` to `user_id`, earned by `job_id`.
#[derive(Debug, Clone)]
pub struct Grant {
    pub job_id: String,
    pub user_id: String,
    pub character_code: String,
    /// Microseconds since the Unix epoch, used as `acquired_at` and `decided_at`.
    pub now_us: i64,
}

/// A decision as stored for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredDecision {
    pub job_id: String,
    pub user_id: String,
    pub eligible: bool,
    pub newly_granted: bool,
    pub character_code: Option<String>,
    pub reason: String,
}

/// One character a user owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedRow {
    pub character_code: String,
    pub job_id: String,
    pub acquired_at_us: i64,
}

/// Storage of ownership and per-job decisions.
#[async_trait]
pub trait RewardStore: Send + Sync + 'static {
    /// The decision stored for `job_id`, if the job was already evaluated.
    async fn decision(&self, job_id: &str) -> Result<Option<StoredDecision>, StoreError>;

    /// Grants the character and records the job's decision atomically, and returns the decision
    /// stored for the job: the new one, or the one an earlier (or concurrent) call stored first.
    /// A user receives a character at most once (`reason` "granted" the first time,
    /// "already_owned" after); a job that already has a decision grants nothing.
    async fn grant(&self, grant: Grant) -> Result<StoredDecision, StoreError>;

    /// Characters `user_id` owns, oldest first.
    async fn list_owned(&self, user_id: &str) -> Result<Vec<OwnedRow>, StoreError>;

    /// Closes every connection (so a SQLite file can be reopened at once, e.g. by a restarted
    /// server).
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
