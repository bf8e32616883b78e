//! The embedded [`NotificationStore`]: a SQLite file (or in-memory database) through sqlx.

use anyhow::Context;
use sqlx::{
    Row,
    sqlite::{SqlitePool, SqliteRow},
};

use super::{CancelOutcome, NotificationRow, NotificationStore, Status};

/// [`NotificationStore`] on SQLite.
#[derive(Debug, Clone)]
pub struct SqliteNotificationStore {
    pool: SqlitePool,
}

impl SqliteNotificationStore {
    /// Opens (creating if needed) the database at `url` and applies the schema. File databases
    /// get their parent directory created, WAL journaling and a busy timeout.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let pool = ecoscan_sql::open_sqlite(url, include_str!("../../migrations/0001_init.sql"))
            .await
            .with_context(|| format!("failed to open the notification database {url:?}"))?;
        Ok(Self { pool })
    }

    /// Closes every connection (so the file can be reopened at once, e.g. by a restarted server).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    async fn fetch_by_id(
        &self,
        id: &str,
        user_id: &str,
    ) -> anyhow::Result<Option<NotificationRow>> {
        let row = sqlx::query("SELECT * FROM notifications WHERE id = ? AND user_id = ?")
            .bind(id)
            .bind(user_id)
            .fetch_optional(&self.pool)
            .await
            .context("failed to read notification")?;
        row.as_ref().map(from_row).transpose()
    }
}

fn from_row(r: &SqliteRow) -> anyhow::Result<NotificationRow> {
    Ok(NotificationRow {
        id: r.try_get("id")?,
        user_id: r.try_get("user_id")?,
        kind: r.try_get("kind")?,
        title: r.try_get("title")?,
        body: r.try_get("body")?,
        job_id: r.try_get("job_id")?,
        dedupe_key: r.try_get("dedupe_key")?,
        status: Status::parse(r.try_get("status")?)?,
        due_at_us: r.try_get("due_at_us")?,
        created_at_us: r.try_get("created_at_us")?,
        delivered_at_us: r.try_get("delivered_at_us")?,
    })
}

impl NotificationStore for SqliteNotificationStore {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "INSERT notifications", otel.kind = "client", db.system = "sqlite", db.operation.name = "INSERT", db.collection.name = "notifications"),
        err
    )]
    async fn insert(&self, n: NotificationRow) -> anyhow::Result<(NotificationRow, bool)> {
        let inserted = sqlx::query(
            "INSERT INTO notifications (id, user_id, kind, title, body, job_id, dedupe_key, \
             status, due_at_us, created_at_us, delivered_at_us) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT (user_id, dedupe_key) DO NOTHING",
        )
        .bind(&n.id)
        .bind(&n.user_id)
        .bind(&n.kind)
        .bind(&n.title)
        .bind(&n.body)
        .bind(&n.job_id)
        .bind(&n.dedupe_key)
        .bind(n.status.as_str())
        .bind(n.due_at_us)
        .bind(n.created_at_us)
        .bind(n.delivered_at_us)
        .execute(&self.pool)
        .await
        .context("failed to insert notification")?
        .rows_affected()
            == 1;
        if inserted {
            return Ok((n, true));
        }
        // Only the dedupe key can conflict (ids are fresh v7 uuids): return the first one.
        let row = sqlx::query("SELECT * FROM notifications WHERE user_id = ? AND dedupe_key = ?")
            .bind(&n.user_id)
            .bind(&n.dedupe_key)
            .fetch_one(&self.pool)
            .await
            .context("failed to read the deduplicated notification")?;
        Ok((from_row(&row)?, false))
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE notifications", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "notifications"),
        err
    )]
    async fn mark_delivered(
        &self,
        id: &str,
        now_us: i64,
    ) -> anyhow::Result<Option<NotificationRow>> {
        // The status guard makes delivery happen once, and never for a cancelled notification,
        // however many times the scheduler hands the id out.
        let row = sqlx::query(
            "UPDATE notifications SET status = 'delivered', delivered_at_us = ? \
             WHERE id = ? AND status = 'scheduled' RETURNING *",
        )
        .bind(now_us)
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .context("failed to mark notification delivered")?;
        row.as_ref().map(from_row).transpose()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE notifications", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "notifications", db.operation.batch.size = ids.len()),
        err
    )]
    async fn mark_delivered_many(
        &self,
        ids: &[String],
        now_us: i64,
    ) -> anyhow::Result<Vec<NotificationRow>> {
        let mut rows = Vec::with_capacity(ids.len());
        // SQLite caps a statement's parameters (32,766 in current versions); chunks stay far
        // below it. SQLite has one writer, so no ordering is needed against deadlocks.
        for chunk in ids.chunks(1000) {
            let mut query = sqlx::QueryBuilder::new(
                "UPDATE notifications SET status = 'delivered', delivered_at_us = ",
            );
            query
                .push_bind(now_us)
                .push(" WHERE status = 'scheduled' AND id IN (");
            let mut list = query.separated(", ");
            for id in chunk {
                list.push_bind(id);
            }
            query.push(") RETURNING *");
            let found = query
                .build()
                .fetch_all(&self.pool)
                .await
                .context("failed to mark notifications delivered")?;
            for row in &found {
                rows.push(from_row(row)?);
            }
        }
        Ok(rows)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE notifications", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "notifications"),
        err
    )]
    async fn cancel(&self, id: &str, user_id: &str) -> anyhow::Result<CancelOutcome> {
        let row = sqlx::query(
            "UPDATE notifications SET status = 'cancelled' \
             WHERE id = ? AND user_id = ? AND status = 'scheduled' RETURNING *",
        )
        .bind(id)
        .bind(user_id)
        .fetch_optional(&self.pool)
        .await
        .context("failed to cancel notification")?;
        if let Some(row) = row {
            return Ok(CancelOutcome::Cancelled(from_row(&row)?));
        }
        Ok(match self.fetch_by_id(id, user_id).await? {
            None => CancelOutcome::NotFound,
            Some(n) if n.status == Status::Delivered => CancelOutcome::AlreadyDelivered(n),
            Some(n) => CancelOutcome::AlreadyCancelled(n),
        })
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT notifications", otel.kind = "client", db.system = "sqlite", db.operation.name = "SELECT", db.collection.name = "notifications"),
        err
    )]
    async fn list(&self, user_id: &str, limit: u32) -> anyhow::Result<Vec<NotificationRow>> {
        let rows = sqlx::query(
            "SELECT * FROM notifications WHERE user_id = ? \
             ORDER BY created_at_us DESC, id DESC LIMIT ?",
        )
        .bind(user_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .context("failed to list notifications")?;
        rows.iter().map(from_row).collect()
    }

    async fn pending(&self) -> anyhow::Result<Vec<(String, i64)>> {
        let rows =
            sqlx::query("SELECT id, due_at_us FROM notifications WHERE status = 'scheduled'")
                .fetch_all(&self.pool)
                .await
                .context("failed to read scheduled notifications")?;
        rows.iter()
            .map(|r| {
                let due: Option<i64> = r.try_get("due_at_us")?;
                // A scheduled row always has a due time; treat a missing one as due now.
                Ok((r.try_get("id")?, due.unwrap_or(0)))
            })
            .collect()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT notifications", otel.kind = "client", db.system = "sqlite", db.operation.name = "SELECT", db.collection.name = "notifications"),
        err
    )]
    async fn scheduled_page(
        &self,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> anyhow::Result<Vec<(String, i64)>> {
        // Keyset pagination on the partial index `notifications_scheduled (due_at_us, id)`.
        let (due, id) = after.unwrap_or((i64::MIN, ""));
        let rows = sqlx::query(
            "SELECT id, due_at_us FROM notifications \
             WHERE status = 'scheduled' AND due_at_us IS NOT NULL \
             AND (due_at_us, id) > (?, ?) \
             ORDER BY due_at_us, id LIMIT ?",
        )
        .bind(due)
        .bind(id)
        .bind(super::sql_limit(limit))
        .fetch_all(&self.pool)
        .await
        .context("failed to read a page of scheduled notifications")?;
        rows.iter()
            .map(|r| Ok((r.try_get("id")?, r.try_get("due_at_us")?)))
            .collect()
    }
}
