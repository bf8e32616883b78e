//! Where the inbox lives. The service talks to [`NotificationStore`] only, as an
//! `Arc<dyn NotificationStore>` that [`open`] picks by the database URL; the one
//! implementation, [`SqlNotificationStore`] (`sql.rs`), is written once and runs on SQLite
//! ([`sqlite`], embedded) and PostgreSQL ([`postgres`], production), which differ only in how
//! they are opened.

use std::sync::Arc;

use async_trait::async_trait;

pub mod postgres;
mod sql;
pub mod sqlite;

pub use postgres::PgNotificationStore;
pub use sql::SqlNotificationStore;
pub use sqlite::SqliteNotificationStore;

/// Whether `url` names a PostgreSQL database (anything else is taken for SQLite).
pub use ecoscan_sql::is_postgres;

/// Opens the database at `url` — PostgreSQL for a `postgres://` URL, SQLite otherwise — and
/// brings its schema up to date.
pub async fn open(url: &str) -> Result<Arc<dyn NotificationStore>, StoreError> {
    Ok(if is_postgres(url) {
        Arc::new(PgNotificationStore::connect(url).await?)
    } else {
        Arc::new(SqliteNotificationStore::connect(url).await?)
    })
}

/// What a store operation fails with (shared by every SQL store of the workspace).
pub use ecoscan_sql::StoreError;

/// Lifecycle of a notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Scheduled,
    Delivered,
    Cancelled,
}

impl Status {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Scheduled => "scheduled",
            Status::Delivered => "delivered",
            Status::Cancelled => "cancelled",
        }
    }

    /// Parses a stored `status` value.
    pub fn parse(s: &str) -> Result<Self, StoreError> {
        match s {
            "scheduled" => Ok(Status::Scheduled),
            "delivered" => Ok(Status::Delivered),
            "cancelled" => Ok(Status::Cancelled),
            other => Err(StoreError::Corrupt(format!(
                "unknown notification status {other:?}"
            ))),
        }
    }
}

/// One notification as stored. Times are microseconds since the Unix epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotificationRow {
    pub id: String,
    pub user_id: String,
    pub kind: String,
    pub title: String,
    pub body: String,
    pub job_id: String,
    pub dedupe_key: Option<String>,
    pub status: Status,
    pub due_at_us: Option<i64>,
    pub created_at_us: i64,
    pub delivered_at_us: Option<i64>,
    /// The W3C `traceparent` of the request that scheduled it: its delivery, later and in a
    /// trace of its own, links to that request's span. `None` when it was not traced.
    pub trace_parent: Option<String>,
}

/// What a cancel found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// It was scheduled and is now cancelled.
    Cancelled(NotificationRow),
    /// It had been cancelled before.
    AlreadyCancelled(NotificationRow),
    /// It was delivered already; nothing changed.
    AlreadyDelivered(NotificationRow),
    /// No notification with that id belongs to that user.
    NotFound,
}

/// Storage of the inbox.
#[async_trait]
pub trait NotificationStore: Send + Sync + 'static {
    /// Inserts `row` unless the user already has one with its dedupe key; returns the stored row
    /// (the new one, or the first one with that key) and whether it was inserted.
    async fn insert(&self, row: NotificationRow) -> Result<(NotificationRow, bool), StoreError>;

    /// Marks a scheduled notification delivered at `now_us` and returns it; `None` when it is
    /// not scheduled (cancelled, delivered already, or unknown), so it is delivered at most once.
    async fn mark_delivered(
        &self,
        id: &str,
        now_us: i64,
    ) -> Result<Option<NotificationRow>, StoreError>;

    /// [`Self::mark_delivered`] for many ids at once: the rows among `ids` that were
    /// scheduled, now delivered, in no particular order. What the due-time deliverer uses, so
    /// that the database sees one statement per batch (of up to 1,000) instead of one per
    /// notification.
    async fn mark_delivered_many(
        &self,
        ids: &[String],
        now_us: i64,
    ) -> Result<Vec<NotificationRow>, StoreError>;

    /// Cancels `user_id`'s scheduled notification `id`.
    async fn cancel(&self, id: &str, user_id: &str) -> Result<CancelOutcome, StoreError>;

    /// `user_id`'s notifications, newest first, at most `limit`.
    async fn list(&self, user_id: &str, limit: u32) -> Result<Vec<NotificationRow>, StoreError>;

    /// `(id, due_at_us)` of every notification still scheduled, all at once (the service pages
    /// through them with [`Self::scheduled_page`] instead).
    async fn pending(&self) -> Result<Vec<(String, i64)>, StoreError>;

    /// One page of the scheduled notifications as `(id, due_at_us)`, at most `limit`, in
    /// `(due_at_us, id)` order, after the position `after` (the `(due_at_us, id)` of the
    /// previous page's last row; `None` for the first page). Reads an index, whatever the number
    /// of delivered rows. What the reconcile sweep and the reload at start walk.
    async fn scheduled_page(
        &self,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError>;

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

/// `limit` as a SQL `LIMIT` parameter.
fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}
