//! The production [`NotificationStore`]: PostgreSQL through sqlx, schema managed by versioned
//! migrations (`migrations/postgres/`).

use anyhow::Context;
use sqlx::{
    Row,
    migrate::Migrator,
    postgres::{PgPool, PgRow},
};

use super::{CancelOutcome, NotificationRow, NotificationStore, Status};

/// Connections per process.
const MAX_CONNECTIONS: u32 = 10;

/// The notification schema's migrations, tracked in their own table so services sharing one
/// database (through `DATABASE_URL`) never mistake each other's versions for theirs.
pub fn migrator() -> Migrator {
    ecoscan_sql::tracked_in(
        "_notification_migrations",
        sqlx::migrate!("./migrations/postgres"),
    )
}

/// [`NotificationStore`] on PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgNotificationStore {
    pool: PgPool,
}

impl PgNotificationStore {
    /// Connects to `url` and applies any pending migration (concurrent starts wait on the
    /// migrator's advisory lock).
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let pool = ecoscan_sql::connect_postgres(url, MAX_CONNECTIONS, &migrator())
            .await
            .context("failed to open the notification database on postgresql")?;
        Ok(Self { pool })
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

fn from_row(r: &PgRow) -> anyhow::Result<NotificationRow> {
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

impl NotificationStore for PgNotificationStore {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "INSERT notifications", otel.kind = "client", db.system = "postgresql", db.operation.name = "INSERT", db.collection.name = "notifications"),
        err
    )]
    async fn insert(&self, n: NotificationRow) -> anyhow::Result<(NotificationRow, bool)> {
        // The conflict target names the partial index (its predicate included), so only a
        // repeated dedupe key conflicts; a concurrent insert of the same key waits for the first
        // to commit and then does nothing.
        let inserted = sqlx::query(
            "INSERT INTO notifications (id, user_id, kind, title, body, job_id, dedupe_key, \
             status, due_at_us, created_at_us, delivered_at_us) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
             ON CONFLICT (user_id, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING",
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
        let row = sqlx::query("SELECT * FROM notifications WHERE user_id = $1 AND dedupe_key = $2")
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
        fields(otel.name = "UPDATE notifications", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "notifications"),
        err
    )]
    async fn mark_delivered(
        &self,
        id: &str,
        now_us: i64,
    ) -> anyhow::Result<Option<NotificationRow>> {
        // The status guard makes delivery happen once, and never for a cancelled notification,
        // however many replicas claim the id: a concurrent update waits on the row lock, then
        // re-checks the guard and matches nothing.
        let row = sqlx::query(
            "UPDATE notifications SET status = 'delivered', delivered_at_us = $1 \
             WHERE id = $2 AND status = 'scheduled' RETURNING *",
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
        fields(otel.name = "UPDATE notifications", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "notifications", db.operation.batch.size = ids.len()),
        err
    )]
    async fn mark_delivered_many(
        &self,
        ids: &[String],
        now_us: i64,
    ) -> anyhow::Result<Vec<NotificationRow>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // The same status guard as `mark_delivered`. The rows are locked in id order first, so
        // that two replicas marking overlapping batches (a lease that ran out) wait on each
        // other instead of deadlocking; a row another replica delivered meanwhile drops out of
        // the locking read when it re-checks the guard.
        let rows = sqlx::query(
            "WITH due AS (SELECT id FROM notifications \
                          WHERE id = ANY($2) AND status = 'scheduled' ORDER BY id FOR UPDATE) \
             UPDATE notifications n SET status = 'delivered', delivered_at_us = $1 \
             FROM due WHERE n.id = due.id RETURNING n.*",
        )
        .bind(now_us)
        .bind(ids)
        .fetch_all(&self.pool)
        .await
        .context("failed to mark notifications delivered")?;
        rows.iter().map(from_row).collect()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE notifications", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "notifications"),
        err
    )]
    async fn cancel(&self, id: &str, user_id: &str) -> anyhow::Result<CancelOutcome> {
        let row = sqlx::query(
            "UPDATE notifications SET status = 'cancelled' \
             WHERE id = $1 AND user_id = $2 AND status = 'scheduled' RETURNING *",
        )
        .bind(id)
        .bind(user_id)
        .fetch_optional(&self.pool)
        .await
        .context("failed to cancel notification")?;
        if let Some(row) = row {
            return Ok(CancelOutcome::Cancelled(from_row(&row)?));
        }
        let row = sqlx::query("SELECT * FROM notifications WHERE id = $1 AND user_id = $2")
            .bind(id)
            .bind(user_id)
            .fetch_optional(&self.pool)
            .await
            .context("failed to read notification")?;
        Ok(match row.as_ref().map(from_row).transpose()? {
            None => CancelOutcome::NotFound,
            Some(n) if n.status == Status::Delivered => CancelOutcome::AlreadyDelivered(n),
            Some(n) => CancelOutcome::AlreadyCancelled(n),
        })
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT notifications", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "notifications"),
        err
    )]
    async fn list(&self, user_id: &str, limit: u32) -> anyhow::Result<Vec<NotificationRow>> {
        let rows = sqlx::query(
            "SELECT * FROM notifications WHERE user_id = $1 \
             ORDER BY created_at_us DESC, id DESC LIMIT $2",
        )
        .bind(user_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .context("failed to list notifications")?;
        rows.iter().map(from_row).collect()
    }

    async fn pending(&self) -> anyhow::Result<Vec<(String, i64)>> {
        let rows = sqlx::query(
            "SELECT id, due_at_us FROM notifications WHERE status = 'scheduled' ORDER BY due_at_us",
        )
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
        fields(otel.name = "SELECT notifications", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "notifications"),
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
             AND (due_at_us, id) > ($1, $2) \
             ORDER BY due_at_us, id LIMIT $3",
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
