//! Job rows: the truth about every scan, with a checkpoint per finished stage.

use std::{
    collections::HashMap,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use async_trait::async_trait;
use ecoscan_proto::v1::{
    Answer, Classification, DisposalRules, ErrorInfo, JobStatus, RewardDecision, Stage,
};
use prost::Message;
use sqlx::{Row, SqlitePool, sqlite::SqliteRow};

use crate::error::StoreError;

/// A job as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub id: String,
    pub user_id: String,
    pub status: JobStatus,
    pub stage: Stage,
    pub image_key: String,
    pub content_type: String,
    pub hint: String,
    pub locale: String,
    pub idempotency_key: Option<String>,
    pub trace_carrier: HashMap<String, String>,
    pub classification: Option<Classification>,
    pub rules: Option<DisposalRules>,
    pub answer: Option<Answer>,
    pub reward: Option<RewardDecision>,
    pub error: Option<ErrorInfo>,
    /// Runs of the job so far (each claim counts one).
    pub attempts: u32,
    /// The epoch of the job's latest claim: every write a worker makes carries the epoch it
    /// claimed with, and a stale one is refused ([`StoreError::Fenced`]).
    pub lease_epoch: u64,
    pub created_at: SystemTime,
    pub finished_at: Option<SystemTime>,
    /// When the job was set aside for an operator (see [`JobStore::dead_letter`]).
    pub dead_at: Option<SystemTime>,
}

impl Job {
    pub fn is_terminal(&self) -> bool {
        matches!(self.status, JobStatus::Succeeded | JobStatus::Failed)
    }
}

/// What `insert` needs.
#[derive(Clone, Debug)]
pub struct NewJob {
    pub id: String,
    pub user_id: String,
    pub image_key: String,
    pub content_type: String,
    pub hint: String,
    pub locale: String,
    pub idempotency_key: Option<String>,
    pub trace_carrier: HashMap<String, String>,
}

/// A stage's output, checkpointed on the job row.
#[derive(Clone, Debug)]
pub enum Checkpoint {
    Classification(Classification),
    Rules(DisposalRules),
    Answer(Answer),
    Reward(RewardDecision),
}

impl Checkpoint {
    /// The column it fills, for spans and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Classification(_) => "classification",
            Self::Rules(_) => "rules",
            Self::Answer(_) => "answer",
            Self::Reward(_) => "reward",
        }
    }
}

#[async_trait]
pub trait JobStore: Send + Sync + 'static {
    /// Inserts a queued job. With an idempotency key already used by the same user, inserts nothing
    /// and returns the existing job with `false`.
    async fn insert(&self, job: NewJob) -> Result<(Job, bool), StoreError>;
    async fn get(&self, id: &str) -> Result<Option<Job>, StoreError>;
    async fn find_by_idempotency_key(
        &self,
        user_id: &str,
        key: &str,
    ) -> Result<Option<Job>, StoreError>;
    /// Claims the job for a worker: a new lease epoch (the fencing token of every write this
    /// worker makes) and one more attempt. `None` when there is no such job.
    async fn claim(&self, id: &str) -> Result<Option<Job>, StoreError>;
    /// Marks the job running at `stage`.
    async fn mark_running(&self, id: &str, epoch: u64, stage: Stage) -> Result<(), StoreError>;
    /// Stores a stage's output. Only the first checkpoint of a stage is kept, so a resumed
    /// worker can never overwrite an output that watchers have already seen.
    async fn checkpoint(
        &self,
        id: &str,
        epoch: u64,
        checkpoint: Checkpoint,
    ) -> Result<(), StoreError>;
    /// Moves the job to a terminal status (once; later calls change nothing).
    async fn finish(
        &self,
        id: &str,
        epoch: u64,
        status: JobStatus,
        error: Option<ErrorInfo>,
    ) -> Result<(), StoreError>;
    /// Fails the job with `error` and sets it aside for an operator (a poison job: it failed
    /// too often, or on a record that cannot be read). Once, like [`JobStore::finish`].
    async fn dead_letter(&self, id: &str, epoch: u64, error: ErrorInfo) -> Result<(), StoreError>;
    /// Dead-lettered jobs, newest first: up to `limit` set aside before `before` (all when
    /// `None`), so callers page back in time.
    async fn dead_letters(
        &self,
        before: Option<SystemTime>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError>;
    /// Puts a dead-lettered job back to `queued` (its checkpoints kept, its attempts reset);
    /// `None` when the job is not dead-lettered.
    async fn requeue(&self, id: &str) -> Result<Option<Job>, StoreError>;
    /// Up to `limit` jobs not yet terminal that were created before `created_before`, newest
    /// first, so callers page back in time (the sweeper re-enqueues those whose queue entry is
    /// gone).
    async fn unfinished(
        &self,
        created_before: SystemTime,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError>;
}

/// Jobs in SQLite (the embedded default).
pub struct SqliteJobStore {
    pool: SqlitePool,
}

pub(crate) fn ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

pub(crate) fn from_ms(v: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(v.max(0) as u64)
}

impl SqliteJobStore {
    /// Opens (creating when needed) the database at `url` and applies the schema.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let pool =
            ecoscan_sql::open_sqlite(url, include_str!("../../migrations/0001_init.sql")).await?;
        // Columns added after the first release: a database made before them gets them here
        // (SQLite has no `ADD COLUMN IF NOT EXISTS`).
        let columns: Vec<String> = sqlx::query("SELECT name FROM pragma_table_info('jobs')")
            .fetch_all(&pool)
            .await?
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<_, _>>()?;
        for (name, ddl) in [
            (
                "lease_epoch",
                "ALTER TABLE jobs ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0",
            ),
            (
                "dead_at_ms",
                "ALTER TABLE jobs ADD COLUMN dead_at_ms INTEGER",
            ),
        ] {
            if !columns.iter().any(|c| c == name) {
                sqlx::query(ddl).execute(&pool).await?;
            }
        }
        sqlx::query(
            "CREATE INDEX IF NOT EXISTS jobs_dead ON jobs (dead_at_ms) WHERE dead_at_ms IS NOT NULL",
        )
        .execute(&pool)
        .await?;
        Ok(Self { pool })
    }

    /// After an update that changed nothing: refused because another claim came since
    /// (`Fenced`), or a no-op (the stage's checkpoint was there, the job had finished).
    async fn fenced(&self, id: &str, epoch: u64) -> Result<(), StoreError> {
        let current: Option<i64> = sqlx::query_scalar("SELECT lease_epoch FROM jobs WHERE id = ?")
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
            "UPDATE jobs SET status = ?, stage = COALESCE(?, stage), error = ?, finished_at_ms = ?, \
             dead_at_ms = ?, updated_at_ms = ? WHERE id = ? AND lease_epoch = ? AND status IN (?, ?)",
        )
        .bind(status as i32)
        // A failed job keeps the stage it failed at.
        .bind((status == JobStatus::Succeeded).then_some(Stage::Done as i32))
        .bind(error.map(|e| e.encode_to_vec()))
        .bind(now)
        .bind(dead.then_some(now))
        .bind(now)
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

    /// Opens a file database inside `dir` (for tests and the suite).
    pub async fn open_in(dir: &Path) -> Result<Self, StoreError> {
        Self::open(&format!(
            "sqlite://{}?mode=rwc",
            dir.join("ingest.db").display()
        ))
        .await
    }
}

fn decode<M: Message + Default>(row: &SqliteRow, col: &str) -> Result<Option<M>, StoreError> {
    let bytes: Option<Vec<u8>> = row.try_get(col)?;
    bytes
        .map(|b| M::decode(b.as_slice()).map_err(|e| StoreError::Corrupt(format!("{col}: {e}"))))
        .transpose()
}

fn job_from_row(row: &SqliteRow) -> Result<Job, StoreError> {
    let carrier: String = row.try_get("trace_carrier")?;
    let status: i32 = row.try_get("status")?;
    let stage: i32 = row.try_get("stage")?;
    let attempts: i64 = row.try_get("attempts")?;
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
impl JobStore for SqliteJobStore {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "INSERT jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "INSERT", db.collection.name = "jobs", job.id = %job.id),
        err
    )]
    async fn insert(&self, job: NewJob) -> Result<(Job, bool), StoreError> {
        let now = ms(SystemTime::now());
        let carrier = serde_json::to_string(&job.trace_carrier).unwrap_or_else(|_| "{}".into());
        let done = sqlx::query(
            "INSERT INTO jobs (id, user_id, status, stage, image_key, content_type, hint, locale, \
             idempotency_key, trace_carrier, created_at_ms, updated_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
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
        .bind(now)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 1 {
            let stored = self
                .get(&job.id)
                .await?
                .ok_or_else(|| StoreError::Corrupt("inserted job vanished".into()))?;
            return Ok((stored, true));
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
        fields(otel.name = "SELECT jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "SELECT", db.collection.name = "jobs", job.id = %id),
        err
    )]
    async fn get(&self, id: &str) -> Result<Option<Job>, StoreError> {
        sqlx::query("SELECT * FROM jobs WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(job_from_row)
            .transpose()
    }

    async fn find_by_idempotency_key(
        &self,
        user_id: &str,
        key: &str,
    ) -> Result<Option<Job>, StoreError> {
        sqlx::query("SELECT * FROM jobs WHERE user_id = ? AND idempotency_key = ?")
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
        fields(otel.name = "UPDATE jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "jobs", job.id = %id),
        err
    )]
    async fn claim(&self, id: &str) -> Result<Option<Job>, StoreError> {
        sqlx::query(
            "UPDATE jobs SET lease_epoch = lease_epoch + 1, attempts = attempts + 1, \
             updated_at_ms = ? WHERE id = ? RETURNING *",
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
        fields(otel.name = "UPDATE jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "jobs", job.id = %id, job.stage = ?stage),
        err
    )]
    async fn mark_running(&self, id: &str, epoch: u64, stage: Stage) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE jobs SET status = ?, stage = ?, updated_at_ms = ? \
             WHERE id = ? AND lease_epoch = ? AND status IN (?, ?)",
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
        fields(otel.name = "UPDATE jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "jobs", job.id = %id, job.checkpoint = checkpoint.name()),
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
                "UPDATE jobs SET classification = ?, updated_at_ms = ? WHERE id = ? AND lease_epoch = ? AND classification IS NULL",
                m.encode_to_vec(),
            ),
            Checkpoint::Rules(m) => (
                "UPDATE jobs SET rules = ?, updated_at_ms = ? WHERE id = ? AND lease_epoch = ? AND rules IS NULL",
                m.encode_to_vec(),
            ),
            Checkpoint::Answer(m) => (
                "UPDATE jobs SET answer = ?, updated_at_ms = ? WHERE id = ? AND lease_epoch = ? AND answer IS NULL",
                m.encode_to_vec(),
            ),
            Checkpoint::Reward(m) => (
                "UPDATE jobs SET reward = ?, updated_at_ms = ? WHERE id = ? AND lease_epoch = ? AND reward IS NULL",
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
        fields(otel.name = "UPDATE jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "jobs", job.id = %id, job.status = ?status),
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
        fields(otel.name = "UPDATE jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "jobs", job.id = %id),
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
            "SELECT * FROM jobs WHERE dead_at_ms IS NOT NULL AND dead_at_ms < ? \
             ORDER BY dead_at_ms DESC LIMIT ?",
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
        fields(otel.name = "UPDATE jobs", otel.kind = "client", db.system = "sqlite", db.operation.name = "UPDATE", db.collection.name = "jobs", job.id = %id),
        err
    )]
    async fn requeue(&self, id: &str) -> Result<Option<Job>, StoreError> {
        sqlx::query(
            "UPDATE jobs SET status = ?, stage = ?, error = NULL, finished_at_ms = NULL, \
             dead_at_ms = NULL, attempts = 0, updated_at_ms = ? \
             WHERE id = ? AND dead_at_ms IS NOT NULL RETURNING *",
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

    async fn unfinished(
        &self,
        created_before: SystemTime,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        sqlx::query(
            "SELECT * FROM jobs WHERE status IN (?, ?) AND created_at_ms < ? \
             ORDER BY created_at_ms DESC LIMIT ?",
        )
        .bind(JobStatus::Queued as i32)
        .bind(JobStatus::Running as i32)
        .bind(ms(created_before))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(job_from_row)
        .collect()
    }
}
