//! Where the inbox lives. The service talks to [`NotificationStore`] only; [`sqlite`] is the
//! embedded implementation, [`postgres`] the production one, and [`AnyNotificationStore`] picks
//! one by the database URL.

use std::future::Future;

pub mod postgres;
pub mod sqlite;

pub use postgres::PgNotificationStore;
pub use sqlite::SqliteNotificationStore;

/// Whether `url` names a PostgreSQL database (anything else is taken for SQLite).
pub use ecoscan_sql::is_postgres;

/// The store the configuration names: PostgreSQL for a `postgres://` URL, SQLite otherwise.
#[derive(Debug, Clone)]
pub enum AnyNotificationStore {
    Sqlite(SqliteNotificationStore),
    Postgres(PgNotificationStore),
}

impl AnyNotificationStore {
    /// Opens the database at `url` and brings its schema up to date.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        Ok(if is_postgres(url) {
            Self::Postgres(PgNotificationStore::connect(url).await?)
        } else {
            Self::Sqlite(SqliteNotificationStore::connect(url).await?)
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

/// Forwards every call to the selected implementation.
macro_rules! either {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            AnyNotificationStore::Sqlite($s) => $call,
            AnyNotificationStore::Postgres($s) => $call,
        }
    };
}

impl NotificationStore for AnyNotificationStore {
    async fn insert(&self, row: NotificationRow) -> anyhow::Result<(NotificationRow, bool)> {
        either!(self, s => s.insert(row).await)
    }

    async fn mark_delivered(
        &self,
        id: &str,
        now_us: i64,
    ) -> anyhow::Result<Option<NotificationRow>> {
        either!(self, s => s.mark_delivered(id, now_us).await)
    }

    async fn mark_delivered_many(
        &self,
        ids: &[String],
        now_us: i64,
    ) -> anyhow::Result<Vec<NotificationRow>> {
        either!(self, s => s.mark_delivered_many(ids, now_us).await)
    }

    async fn cancel(&self, id: &str, user_id: &str) -> anyhow::Result<CancelOutcome> {
        either!(self, s => s.cancel(id, user_id).await)
    }

    async fn list(&self, user_id: &str, limit: u32) -> anyhow::Result<Vec<NotificationRow>> {
        either!(self, s => s.list(user_id, limit).await)
    }

    async fn pending(&self) -> anyhow::Result<Vec<(String, i64)>> {
        either!(self, s => s.pending().await)
    }

    async fn scheduled_page(
        &self,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> anyhow::Result<Vec<(String, i64)>> {
        either!(self, s => s.scheduled_page(after, limit).await)
    }
}

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
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "scheduled" => Ok(Status::Scheduled),
            "delivered" => Ok(Status::Delivered),
            "cancelled" => Ok(Status::Cancelled),
            other => anyhow::bail!("unknown notification status {other:?}"),
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
pub trait NotificationStore: Send + Sync + 'static {
    /// Inserts `row` unless the user already has one with its dedupe key; returns the stored row
    /// (the new one, or the first one with that key) and whether it was inserted.
    fn insert(
        &self,
        row: NotificationRow,
    ) -> impl Future<Output = anyhow::Result<(NotificationRow, bool)>> + Send;

    /// Marks a scheduled notification delivered at `now_us` and returns it; `None` when it is
    /// not scheduled (cancelled, delivered already, or unknown), so it is delivered at most once.
    fn mark_delivered(
        &self,
        id: &str,
        now_us: i64,
    ) -> impl Future<Output = anyhow::Result<Option<NotificationRow>>> + Send;

    /// [`Self::mark_delivered`] for many ids in one statement: the rows among `ids` that were
    /// scheduled, now delivered, in no particular order. What the due-time deliverer uses, so
    /// that the database sees one statement per batch instead of one per notification.
    fn mark_delivered_many(
        &self,
        ids: &[String],
        now_us: i64,
    ) -> impl Future<Output = anyhow::Result<Vec<NotificationRow>>> + Send;

    /// Cancels `user_id`'s scheduled notification `id`.
    fn cancel(
        &self,
        id: &str,
        user_id: &str,
    ) -> impl Future<Output = anyhow::Result<CancelOutcome>> + Send;

    /// `user_id`'s notifications, newest first, at most `limit`.
    fn list(
        &self,
        user_id: &str,
        limit: u32,
    ) -> impl Future<Output = anyhow::Result<Vec<NotificationRow>>> + Send;

    /// `(id, due_at_us)` of every notification still scheduled, all at once (the service pages
    /// through them with [`Self::scheduled_page`] instead).
    fn pending(&self) -> impl Future<Output = anyhow::Result<Vec<(String, i64)>>> + Send;

    /// One page of the scheduled notifications as `(id, due_at_us)`, at most `limit`, in
    /// `(due_at_us, id)` order, after the position `after` (the `(due_at_us, id)` of the
    /// previous page's last row; `None` for the first page). Reads an index, whatever the number
    /// of delivered rows. What the reconcile sweep and the reload at start walk.
    fn scheduled_page(
        &self,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> impl Future<Output = anyhow::Result<Vec<(String, i64)>>> + Send;
}

/// `limit` as a SQL `LIMIT` parameter.
fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}
