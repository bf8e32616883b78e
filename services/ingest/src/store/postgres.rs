//! Job rows in PostgreSQL (production). Same semantics as [`super::SqliteJobStore`]: the
//! idempotency key is unique per user, only a stage's first checkpoint is kept, and a terminal
//! status is final. The schema comes from versioned migrations in `migrations/postgres/`,
//! applied at start and by `ecoscan-ingest migrate`.

use std::{str::FromStr, time::SystemTime};

use async_trait::async_trait;
use ecoscan_proto::v1::{ErrorInfo, JobStatus, Stage};
use prost::Message;
use sqlx::{
    AssertSqlSafe, Connection, Row,
    migrate::Migrator,
    postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow},
};

use super::jobs::{Checkpoint, Job, JobStore, NewJob, from_ms, ms};
use crate::error::StoreError;

/// Connections per process: workers and RPCs share them; a statement holds one for
/// milliseconds.
const MAX_CONNECTIONS: u32 = 16;

/// Ingest's migrations, tracked in their own table so services sharing one database never
/// mistake each other's versions for theirs.
pub fn migrator() -> Migrator {
    ecoscan_sql::tracked_in(
        "_ingest_migrations",
        sqlx::migrate!("./migrations/postgres"),
    )
}

/// True for the URLs that select PostgreSQL.
pub use ecoscan_sql::is_postgres as is_postgres_url;

/// Jobs in PostgreSQL.
#[derive(Clone)]
pub struct PgJobStore {
    pool: PgPool,
}

impl PgJobStore {
    /// Connects to `url` and applies pending migrations (concurrent starts wait on the
    /// migrator's advisory lock).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_in_schema(url, None).await
    }

    /// Like [`connect`](Self::connect), with every table in `schema` (created when missing):
    /// the tests give each run its own schema.
    pub async fn connect_in_schema(url: &str, schema: Option<&str>) -> Result<Self, StoreError> {
        let mut opts = PgConnectOptions::from_str(url)?;
        if let Some(schema) = schema {
            if !schema
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
            {
                return Err(StoreError::Corrupt(format!(
                    "schema name {schema:?} must be letters, digits and '_'"
                )));
            }
            let mut conn = PgConnection::connect_with(&opts).await?;
            // The name was checked above: letters, digits and '_' only.
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE SCHEMA IF NOT EXISTS {schema}"
            )))
            .execute(&mut conn)
            .await?;
            conn.close().await?;
            opts = opts.options([("search_path", schema)]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .connect_with(opts)
            .await?;
        migrator()
            .run(&pool)
            .await
            .map_err(|e| StoreError::Unavailable(format!("applying the ingest migrations: {e}")))?;
        Ok(Self { pool })
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// After an update that changed nothing: refused because another claim came since
    /// (`Fenced`), or a no-op (the stage's checkpoint was there, the job had finished).
    async fn fenced(&self, id: &str, epoch: u64) -> Result<(), StoreError> {
        let current: Option<i64> =
            sqlx::query_scalar("SELECT lease_epoch FROM scan_jobs WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        match current {
            None => Err(StoreError::Corrupt(format!("job {id} vanished"))),
            Some(e) if e as u64 != epoch => Err(StoreError::Fenced {
                job: id.to_owned(),
                epoch,
            }),
            Some(_) => Ok(()),
        }
    }

    /// `finish` and `dead_letter`: the first terminal status stands.
    async fn end(
        &self,
        id: &str,
        epoch: u64,
        status: JobStatus,
        error: Option<ErrorInfo>,
        dead: bool,
    ) -> Result<(), StoreError> {
        let now = ms(SystemTime::now());
        let done = sqlx::query(
            "UPDATE scan_jobs SET status = $1, stage = COALESCE($2, stage), error = $3, \
             finished_at_ms = $4, updated_at_ms = $4, dead_at_ms = $5 \
             WHERE id = $6 AND lease_epoch = $7 AND status IN ($8, $9)",
        )
        .bind(status as i32)
        // A failed job keeps the stage it failed at.
        .bind((status == JobStatus::Succeeded).then_some(Stage::Done as i32))
        .bind(error.map(|e| e.encode_to_vec()))
        .bind(now)
        .bind(dead.then_some(now))
        .bind(id)
        .bind(epoch as i64)
        .bind(JobStatus::Queued as i32)
        .bind(JobStatus::Running as i32)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            self.fenced(id, epoch).await?;
        }
        Ok(())
    }
}

fn decode<M: Message + Default>(row: &PgRow, col: &str) -> Result<Option<M>, StoreError> {
    let bytes: Option<Vec<u8>> = row.try_get(col)?;
    bytes
        .map(|b| M::decode(b.as_slice()).map_err(|e| StoreError::Corrupt(format!("{col}: {e}"))))
        .transpose()
}

fn job_from_row(row: &PgRow) -> Result<Job, StoreError> {
    let carrier: String = row.try_get("trace_carrier")?;
    let status: i32 = row.try_get("status")?;
    let stage: i32 = row.try_get("stage")?;
    let attempts: i32 = row.try_get("attempts")?;
    let epoch: i64 = row.try_get("lease_epoch")?;
    let finished: Option<i64> = row.try_get("finished_at_ms")?;
    let dead: Option<i64> = row.try_get("dead_at_ms")?;
    Ok(Job {
        id: row.try_get("id")?,
        user_id: row.try_get("user_id")?,
        status: JobStatus::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("unknown job status {status}")))?,
        stage: Stage::try_from(stage)
            .map_err(|_| StoreError::Corrupt(format!("unknown stage {stage}")))?,
        image_key: row.try_get("image_key")?,
        content_type: row.try_get("content_type")?,
        hint: row.try_get("hint")?,
        locale: row.try_get("locale")?,
        idempotency_key: row.try_get("idempotency_key")?,
        trace_carrier: serde_json::from_str(&carrier).unwrap_or_default(),
        classification: decode(row, "classification")?,
        rules: decode(row, "rules")?,
        answer: decode(row, "answer")?,
        reward: decode(row, "reward")?,
        error: decode(row, "error")?,
        attempts: attempts.max(0) as u32,
        lease_epoch: epoch.max(0) as u64,
        created_at: from_ms(row.try_get("created_at_ms")?),
        finished_at: finished.map(from_ms),
        dead_at: dead.map(from_ms),
    })
}

#[async_trait]
impl JobStore for PgJobStore {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "INSERT scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "INSERT", db.collection.name = "scan_jobs", job.id = %job.id),
        err
    )]
    async fn insert(&self, job: NewJob) -> Result<(Job, bool), StoreError> {
        let now = ms(SystemTime::now());
        let carrier = serde_json::to_string(&job.trace_carrier).unwrap_or_else(|_| "{}".into());
        let inserted = sqlx::query(
            "INSERT INTO scan_jobs (id, user_id, status, stage, image_key, content_type, hint, \
             locale, idempotency_key, trace_carrier, created_at_ms, updated_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11) \
             ON CONFLICT DO NOTHING RETURNING *",
        )
        .bind(&job.id)
        .bind(&job.user_id)
        .bind(JobStatus::Queued as i32)
        .bind(Stage::Queued as i32)
        .bind(&job.image_key)
        .bind(&job.content_type)
        .bind(&job.hint)
        .bind(&job.locale)
        .bind(&job.idempotency_key)
        .bind(carrier)
        .bind(now)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = inserted {
            return Ok((job_from_row(&row)?, true));
        }
        // The only other unique key is (user, idempotency key): someone got there first.
        let key = job
            .idempotency_key
            .as_deref()
            .ok_or_else(|| StoreError::Corrupt(format!("job id {} already exists", job.id)))?;
        let existing = self
            .find_by_idempotency_key(&job.user_id, key)
            .await?
            .ok_or_else(|| StoreError::Corrupt("idempotency conflict without a job".into()))?;
        Ok((existing, false))
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "scan_jobs", job.id = %id),
        err
    )]
    async fn get(&self, id: &str) -> Result<Option<Job>, StoreError> {
        sqlx::query("SELECT * FROM scan_jobs WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(job_from_row)
            .transpose()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "scan_jobs"),
        err
    )]
    async fn find_by_idempotency_key(
        &self,
        user_id: &str,
        key: &str,
    ) -> Result<Option<Job>, StoreError> {
        sqlx::query("SELECT * FROM scan_jobs WHERE user_id = $1 AND idempotency_key = $2")
            .bind(user_id)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(job_from_row)
            .transpose()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "scan_jobs", job.id = %id),
        err
    )]
    async fn claim(&self, id: &str) -> Result<Option<Job>, StoreError> {
        sqlx::query(
            "UPDATE scan_jobs SET lease_epoch = lease_epoch + 1, attempts = attempts + 1, \
             updated_at_ms = $1 WHERE id = $2 RETURNING *",
        )
        .bind(ms(SystemTime::now()))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(job_from_row)
        .transpose()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "scan_jobs", job.id = %id),
        err
    )]
    async fn mark_running(&self, id: &str, epoch: u64, stage: Stage) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE scan_jobs SET status = $1, stage = $2, updated_at_ms = $3 \
             WHERE id = $4 AND lease_epoch = $5 AND status IN ($6, $7)",
        )
        .bind(JobStatus::Running as i32)
        .bind(stage as i32)
        .bind(ms(SystemTime::now()))
        .bind(id)
        .bind(epoch as i64)
        .bind(JobStatus::Queued as i32)
        .bind(JobStatus::Running as i32)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            self.fenced(id, epoch).await?;
        }
        Ok(())
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "scan_jobs", job.id = %id, job.checkpoint = checkpoint.name()),
        err
    )]
    async fn checkpoint(
        &self,
        id: &str,
        epoch: u64,
        checkpoint: Checkpoint,
    ) -> Result<(), StoreError> {
        // Only the first checkpoint of a stage is kept (`IS NULL`), and only from the worker
        // holding the latest claim.
        let (sql, bytes) = match &checkpoint {
            Checkpoint::Classification(m) => (
                "UPDATE scan_jobs SET classification = $1, updated_at_ms = $2 WHERE id = $3 AND lease_epoch = $4 AND classification IS NULL",
                m.encode_to_vec(),
            ),
            Checkpoint::Rules(m) => (
                "UPDATE scan_jobs SET rules = $1, updated_at_ms = $2 WHERE id = $3 AND lease_epoch = $4 AND rules IS NULL",
                m.encode_to_vec(),
            ),
            Checkpoint::Answer(m) => (
                "UPDATE scan_jobs SET answer = $1, updated_at_ms = $2 WHERE id = $3 AND lease_epoch = $4 AND answer IS NULL",
                m.encode_to_vec(),
            ),
            Checkpoint::Reward(m) => (
                "UPDATE scan_jobs SET reward = $1, updated_at_ms = $2 WHERE id = $3 AND lease_epoch = $4 AND reward IS NULL",
                m.encode_to_vec(),
            ),
        };
        let done = sqlx::query(sql)
            .bind(bytes)
            .bind(ms(SystemTime::now()))
            .bind(id)
            .bind(epoch as i64)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 0 {
            self.fenced(id, epoch).await?;
        }
        Ok(())
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "scan_jobs", job.id = %id),
        err
    )]
    async fn finish(
        &self,
        id: &str,
        epoch: u64,
        status: JobStatus,
        error: Option<ErrorInfo>,
    ) -> Result<(), StoreError> {
        self.end(id, epoch, status, error, false).await
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "scan_jobs", job.id = %id),
        err
    )]
    async fn dead_letter(&self, id: &str, epoch: u64, error: ErrorInfo) -> Result<(), StoreError> {
        self.end(id, epoch, JobStatus::Failed, Some(error), true)
            .await
    }

    async fn dead_letters(
        &self,
        before: Option<SystemTime>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        sqlx::query(
            "SELECT * FROM scan_jobs WHERE dead_at_ms IS NOT NULL AND dead_at_ms < $1 \
             ORDER BY dead_at_ms DESC LIMIT $2",
        )
        .bind(before.map_or(i64::MAX, ms))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(job_from_row)
        .collect()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "UPDATE scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "UPDATE", db.collection.name = "scan_jobs", job.id = %id),
        err
    )]
    async fn requeue(&self, id: &str) -> Result<Option<Job>, StoreError> {
        sqlx::query(
            "UPDATE scan_jobs SET status = $1, stage = $2, error = NULL, finished_at_ms = NULL, \
             dead_at_ms = NULL, attempts = 0, updated_at_ms = $3 \
             WHERE id = $4 AND dead_at_ms IS NOT NULL RETURNING *",
        )
        .bind(JobStatus::Queued as i32)
        .bind(Stage::Queued as i32)
        .bind(ms(SystemTime::now()))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(job_from_row)
        .transpose()
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT scan_jobs", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "scan_jobs"),
        err
    )]
    async fn unfinished(
        &self,
        created_before: SystemTime,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        sqlx::query(
            "SELECT * FROM scan_jobs WHERE status IN (1, 2) AND created_at_ms < $1 \
             ORDER BY created_at_ms DESC LIMIT $2",
        )
        .bind(ms(created_before))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(job_from_row)
        .collect()
    }
}
