//! Where grants and decisions live. The service talks to [`RewardStore`] only; [`sqlite`] is the
//! embedded implementation, [`postgres`] the production one, and [`AnyRewardStore`] picks one by
//! the database URL.

use std::future::Future;

pub mod postgres;
pub mod sqlite;

pub use postgres::PgRewardStore;
pub use sqlite::SqliteRewardStore;

/// Whether `url` names a PostgreSQL database (anything else is taken for SQLite).
pub use ecoscan_sql::is_postgres;

/// The store the configuration names: PostgreSQL for a `postgres://` URL, SQLite otherwise.
#[derive(Debug, Clone)]
pub enum AnyRewardStore {
    Sqlite(SqliteRewardStore),
    Postgres(PgRewardStore),
}

impl AnyRewardStore {
    /// Opens the database at `url` and brings its schema up to date.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        Ok(if is_postgres(url) {
            Self::Postgres(PgRewardStore::connect(url).await?)
        } else {
            Self::Sqlite(SqliteRewardStore::connect(url).await?)
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

impl RewardStore for AnyRewardStore {
    async fn decision(&self, job_id: &str) -> anyhow::Result<Option<StoredDecision>> {
        match self {
            Self::Sqlite(s) => s.decision(job_id).await,
            Self::Postgres(s) => s.decision(job_id).await,
        }
    }

    async fn grant(&self, grant: Grant) -> anyhow::Result<StoredDecision> {
        match self {
            Self::Sqlite(s) => s.grant(grant).await,
            Self::Postgres(s) => s.grant(grant).await,
        }
    }

    async fn list_owned(&self, user_id: &str) -> anyhow::Result<Vec<OwnedRow>> {
        match self {
            Self::Sqlite(s) => s.list_owned(user_id).await,
            Self::Postgres(s) => s.list_owned(user_id).await,
        }
    }
}

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
pub trait RewardStore: Send + Sync + 'static {
    /// The decision stored for `job_id`, if the job was already evaluated.
    fn decision(
        &self,
        job_id: &str,
    ) -> impl Future<Output = anyhow::Result<Option<StoredDecision>>> + Send;

    /// Grants the character and records the job's decision atomically, and returns the decision
    /// stored for the job: the new one, or the one an earlier (or concurrent) call stored first.
    /// A user receives a character at most once (`reason` "granted" the first time,
    /// "already_owned" after); a job that already has a decision grants nothing.
    fn grant(&self, grant: Grant) -> impl Future<Output = anyhow::Result<StoredDecision>> + Send;

    /// Characters `user_id` owns, oldest first.
    fn list_owned(
        &self,
        user_id: &str,
    ) -> impl Future<Output = anyhow::Result<Vec<OwnedRow>>> + Send;
}
