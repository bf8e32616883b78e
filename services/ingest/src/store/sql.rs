//! [`JobStore`] in SQL, written once for every [`Dialect`]: the same statements run on SQLite
//! (the embedded default, [`super::sqlite`]) and on PostgreSQL ([`super::postgres`]). Times are
//! microseconds since the Unix epoch, as in every ecoscan SQL store.

use ecoscan_sql::db_span;
use std::time::SystemTime;

use async_trait::async_trait;
use ecoscan_proto::{
    now_us, system_time_from_us, system_time_us,
    v1::{ErrorInfo, JobStatus, Stage},
};
use ecoscan_sql::Dialect;
use prost::Message;
use sqlx::{Decode, Encode, Executor, IntoArguments, Row, Type};

use super::jobs::{Checkpoint, Job, JobStore, NewJob, Upload};
use crate::error::StoreError;

/// [`JobStore`] on the SQL database `DB`.
#[derive(Debug)]
pub struct SqlJobStore<DB: Dialect> {
    pub(super) pool: ecoscan_sql::Db<DB>,
}

impl<DB: Dialect> Clone for SqlJobStore<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

impl<DB: Dialect> SqlJobStore<DB> {
    pub(super) fn new(pool: impl Into<ecoscan_sql::Db<DB>>) -> Self {
        Self { pool: pool.into() }
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// The statement of [`JobStore::checkpoint`] for each stage output: only the first checkpoint
/// of a stage is kept (`IS NULL`), and only from the worker holding the latest claim. `$5` is
/// the stage the job runs next (NULL keeps the stage): one write where a stage's end and the
/// next one's start were two.
fn checkpoint_sql(checkpoint: &Checkpoint) -> &'static str {
    match checkpoint {
        Checkpoint::Classification(_) => {
            "UPDATE scan_jobs SET classification = $1, stage = COALESCE($5, stage), updated_at_us = $2 \
             WHERE id = $3 AND lease_epoch = $4 AND classification IS NULL"
        }
        Checkpoint::Rules(_) => {
            "UPDATE scan_jobs SET rules = $1, stage = COALESCE($5, stage), updated_at_us = $2 \
             WHERE id = $3 AND lease_epoch = $4 AND rules IS NULL"
        }
        Checkpoint::Answer(_) => {
            "UPDATE scan_jobs SET answer = $1, stage = COALESCE($5, stage), updated_at_us = $2 \
             WHERE id = $3 AND lease_epoch = $4 AND answer IS NULL"
        }
        Checkpoint::Reward(_) => {
            "UPDATE scan_jobs SET reward = $1, stage = COALESCE($5, stage), updated_at_us = $2 \
             WHERE id = $3 AND lease_epoch = $4 AND reward IS NULL"
        }
    }
}

fn encode_checkpoint(checkpoint: &Checkpoint) -> Vec<u8> {
    match checkpoint {
        Checkpoint::Classification(m) => m.encode_to_vec(),
        Checkpoint::Rules(m) => m.encode_to_vec(),
        Checkpoint::Answer(m) => m.encode_to_vec(),
        Checkpoint::Reward(m) => m.encode_to_vec(),
    }
}

fn decode<M: Message + Default>(
    col: &str,
    bytes: Option<Vec<u8>>,
) -> Result<Option<M>, StoreError> {
    bytes
        .map(|b| M::decode(b.as_slice()).map_err(|e| StoreError::Corrupt(format!("{col}: {e}"))))
        .transpose()
}

fn job_from_row<R: Row>(row: &R) -> Result<Job, StoreError>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<Vec<u8>>: Decode<'r, R::Database> + Type<R::Database>,
{
    let carrier: String = row.try_get("trace_carrier")?;
    let status: i32 = row.try_get("status")?;
    let stage: i32 = row.try_get("stage")?;
    // INTEGER on both databases (64 bits on SQLite, 32 on PostgreSQL): read as the narrower.
    let attempts: i32 = row.try_get("attempts")?;
    let epoch: i64 = row.try_get("lease_epoch")?;
    let finished: Option<i64> = row.try_get("finished_at_us")?;
    let dead: Option<i64> = row.try_get("dead_at_us")?;
    let end_seq: Option<i64> = row.try_get("end_seq")?;
    let auto_requeues: i32 = row.try_get("auto_requeues")?;
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
        model: row.try_get("model")?,
        idempotency_key: row.try_get("idempotency_key")?,
        trace_carrier: serde_json::from_str(&carrier).unwrap_or_default(),
        classification: decode("classification", row.try_get("classification")?)?,
        rules: decode("rules", row.try_get("rules")?)?,
        answer: decode("answer", row.try_get("answer")?)?,
        reward: decode("reward", row.try_get("reward")?)?,
        error: decode("error", row.try_get("error")?)?,
        attempts: attempts.max(0).unsigned_abs(),
        lease_epoch: epoch.max(0).unsigned_abs(),
        created_at: system_time_from_us(row.try_get("created_at_us")?),
        finished_at: finished.map(system_time_from_us),
        dead_at: dead.map(system_time_from_us),
        end_seq: end_seq.map(|s| s.max(0).unsigned_abs()),
        dead_reason: row.try_get("dead_reason")?,
        auto_requeues: auto_requeues.max(0).unsigned_abs(),
    })
}

fn upload_from_row<R: Row>(row: &R) -> Result<Upload, StoreError>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let size: i64 = row.try_get("size_bytes")?;
    Ok(Upload {
        id: row.try_get("id")?,
        user_id: row.try_get("user_id")?,
        object_key: row.try_get("object_key")?,
        content_type: row.try_get("content_type")?,
        size_bytes: size.max(0).unsigned_abs(),
        created_at: system_time_from_us(row.try_get("created_at_us")?),
        expires_at: system_time_from_us(row.try_get("expires_at_us")?),
        job_id: row.try_get("job_id")?,
    })
}

#[async_trait]
impl<DB> JobStore for SqlJobStore<DB>
where
    DB: Dialect,
    DB::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Decode<'q, DB> + Type<DB>,
    for<'q> i32: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<i32>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<Vec<u8>>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
{
    #[db_span(
        system = DB::SYSTEM,
        op = "INSERT",
        collection = "scan_jobs",
        fields(job.id = %job.id)
    )]
    async fn insert(&self, job: NewJob) -> Result<(Job, bool), StoreError> {
        let carrier = serde_json::to_string(&job.trace_carrier).unwrap_or_else(|_| "{}".into());
        let inserted = sqlx::query(DB::sql(
            "INSERT INTO scan_jobs (id, user_id, status, stage, image_key, content_type, hint, \
             locale, idempotency_key, trace_carrier, created_at_us, updated_at_us, model) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11, $12) \
             ON CONFLICT DO NOTHING RETURNING *",
        ))
        .bind(job.id.as_str())
        .bind(job.user_id.as_str())
        .bind(JobStatus::Queued as i32)
        .bind(Stage::Queued as i32)
        .bind(job.image_key.as_str())
        .bind(job.content_type.as_str())
        .bind(job.hint.as_str())
        .bind(job.locale.as_str())
        .bind(job.idempotency_key.as_deref())
        .bind(carrier)
        .bind(now_us())
        .bind(job.model.as_str())
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

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "scan_jobs", fields(job.id = %id))]
    async fn get(&self, id: &str) -> Result<Option<Job>, StoreError> {
        sqlx::query(DB::sql("SELECT * FROM scan_jobs WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(job_from_row)
            .transpose()
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "scan_jobs")]
    async fn find_by_idempotency_key(
        &self,
        user_id: &str,
        key: &str,
    ) -> Result<Option<Job>, StoreError> {
        sqlx::query(DB::sql(
            "SELECT * FROM scan_jobs WHERE user_id = $1 AND idempotency_key = $2",
        ))
        .bind(user_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(job_from_row)
        .transpose()
    }

    #[db_span(system = DB::SYSTEM, op = "UPDATE", collection = "scan_jobs", fields(job.id = %id))]
    async fn claim(&self, id: &str, first: Stage) -> Result<Option<Job>, StoreError> {
        // Every SET expression reads the row as it was: `status = $3` picks out a queued job.
        sqlx::query(DB::sql(
            "UPDATE scan_jobs SET lease_epoch = lease_epoch + 1, attempts = attempts + 1, \
             stage = CASE WHEN status = $3 THEN $4 ELSE stage END, \
             status = CASE WHEN status = $3 THEN $5 ELSE status END, \
             updated_at_us = $1 WHERE id = $2 RETURNING *",
        ))
        .bind(now_us())
        .bind(id)
        .bind(JobStatus::Queued as i32)
        .bind(first as i32)
        .bind(JobStatus::Running as i32)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(job_from_row)
        .transpose()
    }

    #[db_span(
        system = DB::SYSTEM,
        op = "UPDATE",
        collection = "scan_jobs",
        fields(job.id = %id, job.stage = ?stage)
    )]
    async fn mark_running(&self, id: &str, epoch: u64, stage: Stage) -> Result<(), StoreError> {
        let done = sqlx::query(DB::sql(
            "UPDATE scan_jobs SET status = $1, stage = $2, updated_at_us = $3 \
             WHERE id = $4 AND lease_epoch = $5 AND status IN ($6, $7)",
        ))
        .bind(JobStatus::Running as i32)
        .bind(stage as i32)
        .bind(now_us())
        .bind(id)
        .bind(epoch_param(epoch))
        .bind(JobStatus::Queued as i32)
        .bind(JobStatus::Running as i32)
        .execute(&self.pool)
        .await?;
        if DB::rows_affected(&done) == 0 {
            self.fenced(id, epoch).await?;
        }
        Ok(())
    }

    #[db_span(
        system = DB::SYSTEM,
        op = "UPDATE",
        collection = "scan_jobs",
        fields(job.id = %id, job.checkpoint = checkpoint.name(), job.next_stage = ?next)
    )]
    async fn checkpoint(
        &self,
        id: &str,
        epoch: u64,
        checkpoint: Checkpoint,
        next: Option<Stage>,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(DB::sql(checkpoint_sql(&checkpoint)))
            .bind(encode_checkpoint(&checkpoint))
            .bind(now_us())
            .bind(id)
            .bind(epoch_param(epoch))
            .bind(next.map(|s| s as i32))
            .execute(&self.pool)
            .await?;
        if DB::rows_affected(&done) == 0 {
            self.fenced(id, epoch).await?;
        }
        Ok(())
    }

    #[db_span(
        system = DB::SYSTEM,
        op = "UPDATE",
        collection = "scan_jobs",
        fields(job.id = %id, job.status = ?status)
    )]
    async fn finish(
        &self,
        id: &str,
        epoch: u64,
        status: JobStatus,
        error: Option<ErrorInfo>,
    ) -> Result<Option<Job>, StoreError> {
        self.end(id, epoch, status, error, None).await
    }

    #[db_span(
        system = DB::SYSTEM,
        op = "UPDATE",
        collection = "scan_jobs",
        fields(job.id = %id, job.end_seq = seq)
    )]
    async fn set_end_seq(&self, id: &str, seq: u64) -> Result<(), StoreError> {
        sqlx::query(DB::sql(
            "UPDATE scan_jobs SET end_seq = $1 WHERE id = $2 AND status IN ($3, $4)",
        ))
        .bind(i64::try_from(seq).unwrap_or(i64::MAX))
        .bind(id)
        .bind(JobStatus::Succeeded as i32)
        .bind(JobStatus::Failed as i32)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    #[db_span(system = DB::SYSTEM, op = "UPDATE", collection = "scan_jobs", fields(job.id = %id))]
    async fn dead_letter(
        &self,
        id: &str,
        epoch: u64,
        error: ErrorInfo,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.end(id, epoch, JobStatus::Failed, Some(error), Some(reason))
            .await
            .map(drop)
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "scan_jobs")]
    async fn dead_letters(
        &self,
        before: Option<SystemTime>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        sqlx::query(DB::sql(
            "SELECT * FROM scan_jobs WHERE dead_at_us IS NOT NULL AND dead_at_us < $1 \
             ORDER BY dead_at_us DESC LIMIT $2",
        ))
        .bind(before.map_or(i64::MAX, system_time_us))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(job_from_row)
        .collect()
    }

    #[db_span(system = DB::SYSTEM, op = "UPDATE", collection = "scan_jobs", fields(job.id = %id))]
    async fn requeue(&self, id: &str, scheduled: bool) -> Result<Option<Job>, StoreError> {
        sqlx::query(DB::sql(
            "UPDATE scan_jobs SET status = $1, stage = $2, error = NULL, finished_at_us = NULL, \
             dead_at_us = NULL, dead_reason = NULL, end_seq = NULL, attempts = 0, \
             auto_requeues = CASE WHEN $3 = 1 THEN auto_requeues + 1 ELSE 0 END, \
             updated_at_us = $4 WHERE id = $5 AND dead_at_us IS NOT NULL RETURNING *",
        ))
        .bind(JobStatus::Queued as i32)
        .bind(Stage::Queued as i32)
        .bind(i32::from(scheduled))
        .bind(now_us())
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(job_from_row)
        .transpose()
    }

    #[db_span(system = DB::SYSTEM, op = "INSERT", collection = "scan_uploads", fields(upload.id = %upload.id))]
    async fn create_upload(&self, upload: &Upload) -> Result<(), StoreError> {
        sqlx::query(DB::sql(
            "INSERT INTO scan_uploads (id, user_id, object_key, content_type, size_bytes, \
             created_at_us, expires_at_us) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        ))
        .bind(upload.id.as_str())
        .bind(upload.user_id.as_str())
        .bind(upload.object_key.as_str())
        .bind(upload.content_type.as_str())
        .bind(i64::try_from(upload.size_bytes).unwrap_or(i64::MAX))
        .bind(system_time_us(upload.created_at))
        .bind(system_time_us(upload.expires_at))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "scan_uploads", fields(upload.id = %id))]
    async fn get_upload(&self, id: &str) -> Result<Option<Upload>, StoreError> {
        sqlx::query(DB::sql("SELECT * FROM scan_uploads WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(upload_from_row)
            .transpose()
    }

    #[db_span(system = DB::SYSTEM, op = "UPDATE", collection = "scan_uploads", fields(upload.id = %id, job.id = %job_id))]
    async fn claim_upload(&self, id: &str, job_id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(DB::sql(
            "UPDATE scan_uploads SET job_id = $1 WHERE id = $2 AND job_id IS NULL",
        ))
        .bind(job_id)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(DB::rows_affected(&done) == 1)
    }

    #[db_span(system = DB::SYSTEM, op = "UPDATE", collection = "scan_uploads", fields(upload.id = %id, job.id = %job_id))]
    async fn release_upload(&self, id: &str, job_id: &str) -> Result<(), StoreError> {
        sqlx::query(DB::sql(
            "UPDATE scan_uploads SET job_id = NULL WHERE id = $1 AND job_id = $2",
        ))
        .bind(id)
        .bind(job_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "scan_uploads")]
    async fn expired_uploads(
        &self,
        before: SystemTime,
        limit: u32,
    ) -> Result<Vec<Upload>, StoreError> {
        sqlx::query(DB::sql(
            "SELECT * FROM scan_uploads WHERE expires_at_us < $1 \
             ORDER BY expires_at_us LIMIT $2",
        ))
        .bind(system_time_us(before))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(upload_from_row)
        .collect()
    }

    #[db_span(system = DB::SYSTEM, op = "DELETE", collection = "scan_uploads", fields(upload.id = %id))]
    async fn delete_upload(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(DB::sql("DELETE FROM scan_uploads WHERE id = $1"))
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(DB::rows_affected(&done) == 1)
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "scan_jobs")]
    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        self.pool.health().cloned()
    }

    fn pool_stats(&self) -> Option<ecoscan_common::store_health::PoolStats> {
        // Only a pool the network stands between (PostgreSQL's; it has a health).
        self.pool.health().map(|_| self.pool.pool_stats())
    }

    async fn unfinished(
        &self,
        created_before: SystemTime,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        // The statuses are literals (queued = 1, running = 2), as in the partial index's own
        // condition, so both databases' planners can use that index.
        sqlx::query(DB::sql(
            "SELECT * FROM scan_jobs WHERE status IN (1, 2) AND created_at_us < $1 \
             ORDER BY created_at_us DESC LIMIT $2",
        ))
        .bind(system_time_us(created_before))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(job_from_row)
        .collect()
    }
}

/// A lease epoch as stored (a signed 64-bit column; epochs count claims, far below `i64::MAX`).
fn epoch_param(epoch: u64) -> i64 {
    i64::try_from(epoch).unwrap_or(i64::MAX)
}

impl<DB> SqlJobStore<DB>
where
    DB: Dialect,
    DB::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Decode<'q, DB> + Type<DB>,
    for<'q> i32: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<i32>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<Vec<u8>>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
{
    /// After an update that changed nothing: refused because another claim came since
    /// (`Fenced`), or a no-op (the stage's checkpoint was there, the job had finished).
    async fn fenced(&self, id: &str, epoch: u64) -> Result<(), StoreError> {
        let current = sqlx::query(DB::sql("SELECT lease_epoch FROM scan_jobs WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .map(|row| row.try_get::<i64, _>("lease_epoch"))
            .transpose()?;
        match current {
            None => Err(StoreError::Corrupt(format!("job {id} vanished"))),
            Some(e) if e != epoch_param(epoch) => Err(StoreError::Fenced {
                job: id.to_owned(),
                epoch,
            }),
            Some(_) => Ok(()),
        }
    }

    /// `finish` and `dead_letter`: the first terminal status stands. Returns the row as it
    /// ended it (the final event is made from it), `None` when it was terminal already.
    async fn end(
        &self,
        id: &str,
        epoch: u64,
        status: JobStatus,
        error: Option<ErrorInfo>,
        dead: Option<&str>,
    ) -> Result<Option<Job>, StoreError> {
        let now = now_us();
        let ended = sqlx::query(DB::sql(
            "UPDATE scan_jobs SET status = $1, stage = COALESCE($2, stage), error = $3, \
             finished_at_us = $4, updated_at_us = $4, dead_at_us = $5, dead_reason = $10 \
             WHERE id = $6 AND lease_epoch = $7 AND status IN ($8, $9) RETURNING *",
        ))
        .bind(status as i32)
        // A failed job keeps the stage it failed at.
        .bind((status == JobStatus::Succeeded).then_some(Stage::Done as i32))
        .bind(error.map(|e| e.encode_to_vec()))
        .bind(now)
        .bind(dead.is_some().then_some(now))
        .bind(id)
        .bind(epoch_param(epoch))
        .bind(JobStatus::Queued as i32)
        .bind(JobStatus::Running as i32)
        .bind(dead)
        .fetch_optional(&self.pool)
        .await?;
        match ended {
            Some(row) => job_from_row(&row).map(Some),
            None => self.fenced(id, epoch).await.map(|()| None),
        }
    }
}
