//! [`NotificationStore`] in SQL, written once for every [`Dialect`]: the same statements run on
//! SQLite and on PostgreSQL.

use async_trait::async_trait;
use ecoscan_sql::Dialect;
use ecoscan_sql::db_span;
use sqlx::{Decode, Encode, Executor, IntoArguments, QueryBuilder, Row, Type};

use super::{CancelOutcome, NotificationRow, NotificationStore, Status, StoreError, sql_limit};

/// Ids per statement of [`NotificationStore::mark_delivered_many`]: far below SQLite's cap on a
/// statement's parameters (32,766) and PostgreSQL's (65,535).
const IDS_PER_STATEMENT: usize = 1000;

/// [`NotificationStore`] on the SQL database `DB`; opened by [`super::sqlite`] or
/// [`super::postgres`].
#[derive(Debug)]
pub struct SqlNotificationStore<DB: Dialect> {
    pool: ecoscan_sql::Db<DB>,
}

impl<DB: Dialect> Clone for SqlNotificationStore<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

impl<DB: Dialect> SqlNotificationStore<DB> {
    pub(super) fn new(pool: impl Into<ecoscan_sql::Db<DB>>) -> Self {
        Self { pool: pool.into() }
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

fn from_row<R: Row>(r: &R) -> Result<NotificationRow, StoreError>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(NotificationRow {
        id: r.try_get("id")?,
        user_id: r.try_get("user_id")?,
        kind: r.try_get("kind")?,
        title: r.try_get("title")?,
        body: r.try_get("body")?,
        job_id: r.try_get("job_id")?,
        dedupe_key: r.try_get("dedupe_key")?,
        status: Status::parse(&r.try_get::<String, _>("status")?)?,
        due_at_us: r.try_get("due_at_us")?,
        created_at_us: r.try_get("created_at_us")?,
        delivered_at_us: r.try_get("delivered_at_us")?,
        trace_parent: r.try_get("trace_parent")?,
    })
}

#[async_trait]
impl<DB> NotificationStore for SqlNotificationStore<DB>
where
    DB: Dialect,
    DB::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
{
    #[db_span(system = DB::SYSTEM, op = "INSERT", collection = "notifications")]
    async fn insert(&self, n: NotificationRow) -> Result<(NotificationRow, bool), StoreError> {
        // The conflict target names the dedupe index (on PostgreSQL a partial one, its predicate
        // included), so only a repeated dedupe key conflicts (ids are fresh v7 uuids); a
        // concurrent insert of the same key waits for the first to commit and then does
        // nothing.
        let result = sqlx::query(DB::sql(
            "INSERT INTO notifications (id, user_id, kind, title, body, job_id, dedupe_key, \
             status, due_at_us, created_at_us, delivered_at_us, trace_parent) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
             ON CONFLICT (user_id, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING",
        ))
        .bind(n.id.as_str())
        .bind(n.user_id.as_str())
        .bind(n.kind.as_str())
        .bind(n.title.as_str())
        .bind(n.body.as_str())
        .bind(n.job_id.as_str())
        .bind(n.dedupe_key.as_deref())
        .bind(n.status.as_str())
        .bind(n.due_at_us)
        .bind(n.created_at_us)
        .bind(n.delivered_at_us)
        .bind(n.trace_parent.as_deref())
        .execute(&self.pool)
        .await?;
        if DB::rows_affected(&result) == 1 {
            return Ok((n, true));
        }
        let row = sqlx::query(DB::sql(
            "SELECT * FROM notifications WHERE user_id = $1 AND dedupe_key = $2",
        ))
        .bind(n.user_id.as_str())
        .bind(n.dedupe_key.as_deref())
        .fetch_one(&self.pool)
        .await?;
        Ok((from_row(&row)?, false))
    }

    #[db_span(system = DB::SYSTEM, op = "UPDATE", collection = "notifications")]
    async fn mark_delivered(
        &self,
        id: &str,
        now_us: i64,
    ) -> Result<Option<NotificationRow>, StoreError> {
        // The status guard makes delivery happen once, and never for a cancelled notification,
        // however many replicas claim the id: a concurrent update waits on the row lock (on
        // SQLite, the database's), then re-checks the guard and matches nothing.
        let row = sqlx::query(DB::sql(
            "UPDATE notifications SET status = 'delivered', delivered_at_us = $1 \
             WHERE id = $2 AND status = 'scheduled' RETURNING *",
        ))
        .bind(now_us)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(from_row).transpose()
    }

    #[db_span(
        system = DB::SYSTEM,
        op = "UPDATE",
        collection = "notifications",
        fields(db.operation.batch.size = ids.len())
    )]
    async fn mark_delivered_many(
        &self,
        ids: &[String],
        now_us: i64,
    ) -> Result<Vec<NotificationRow>, StoreError> {
        let mut delivered = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            // The same status guard as `mark_delivered`. On PostgreSQL the rows are locked in
            // id order first, so that two replicas marking overlapping batches (a lease that
            // ran out) wait on each other instead of deadlocking; a row another replica
            // delivered meanwhile drops out of the locking read when it re-checks the guard.
            let mut query = QueryBuilder::<DB>::new(
                "WITH due AS (SELECT id FROM notifications WHERE status = 'scheduled' AND id IN (",
            );
            let mut list = query.separated(", ");
            for id in chunk {
                list.push_bind(id.as_str());
            }
            query
                .push(") ORDER BY id")
                .push(DB::LOCK_ROWS)
                .push(") UPDATE notifications SET status = 'delivered', delivered_at_us = ")
                .push_bind(now_us)
                .push(" WHERE id IN (SELECT id FROM due) RETURNING *");
            for row in query.build().fetch_all(&self.pool).await? {
                delivered.push(from_row(&row)?);
            }
        }
        Ok(delivered)
    }

    #[db_span(system = DB::SYSTEM, op = "UPDATE", collection = "notifications")]
    async fn cancel(&self, id: &str, user_id: &str) -> Result<CancelOutcome, StoreError> {
        let row = sqlx::query(DB::sql(
            "UPDATE notifications SET status = 'cancelled' \
             WHERE id = $1 AND user_id = $2 AND status = 'scheduled' RETURNING *",
        ))
        .bind(id)
        .bind(user_id)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = row {
            return Ok(CancelOutcome::Cancelled(from_row(&row)?));
        }
        let row = sqlx::query(DB::sql(
            "SELECT * FROM notifications WHERE id = $1 AND user_id = $2",
        ))
        .bind(id)
        .bind(user_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row.as_ref().map(from_row).transpose()? {
            None => CancelOutcome::NotFound,
            Some(n) if n.status == Status::Delivered => CancelOutcome::AlreadyDelivered(n),
            Some(n) => CancelOutcome::AlreadyCancelled(n),
        })
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "notifications")]
    async fn list(&self, user_id: &str, limit: u32) -> Result<Vec<NotificationRow>, StoreError> {
        let rows = sqlx::query(DB::sql(
            "SELECT * FROM notifications WHERE user_id = $1 \
             ORDER BY created_at_us DESC, id DESC LIMIT $2",
        ))
        .bind(user_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(from_row).collect()
    }

    async fn pending(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query(DB::sql(
            "SELECT id, due_at_us FROM notifications WHERE status = 'scheduled' ORDER BY due_at_us",
        ))
        .fetch_all(&self.pool)
        .await?;
        let pending = rows
            .iter()
            .map(|r| {
                let due: Option<i64> = r.try_get("due_at_us")?;
                // A scheduled row always has a due time; treat a missing one as due now.
                Ok((r.try_get("id")?, due.unwrap_or(0)))
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(pending)
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "notifications")]
    async fn scheduled_page(
        &self,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        // Keyset pagination on the partial index `notifications_scheduled (due_at_us, id)`.
        let (due, id) = after.unwrap_or((i64::MIN, ""));
        let rows = sqlx::query(DB::sql(
            "SELECT id, due_at_us FROM notifications \
             WHERE status = 'scheduled' AND due_at_us IS NOT NULL \
             AND (due_at_us, id) > ($1, $2) \
             ORDER BY due_at_us, id LIMIT $3",
        ))
        .bind(due)
        .bind(id)
        .bind(sql_limit(limit))
        .fetch_all(&self.pool)
        .await?;
        let page = rows
            .iter()
            .map(|r| Ok((r.try_get("id")?, r.try_get("due_at_us")?)))
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(page)
    }

    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        self.pool.health().cloned()
    }

    fn pool_stats(&self) -> Option<ecoscan_common::store_health::PoolStats> {
        // Only a pool the network stands between (PostgreSQL's; it has a health).
        self.pool.health().map(|_| self.pool.pool_stats())
    }

    async fn close(&self) {
        SqlNotificationStore::close(self).await;
    }
}
