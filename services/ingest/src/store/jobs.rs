//! Job rows: the truth about every scan, with a checkpoint per finished stage. The trait and
//! its types; [`super::sql`] stores them in SQLite or PostgreSQL.

use std::{collections::HashMap, time::SystemTime};

use async_trait::async_trait;
use ecoscan_common::store_health::{PoolStats, StoreHealth};
use ecoscan_proto::v1::{
    Answer, Classification, DisposalRules, ErrorInfo, JobStatus, RewardDecision, Stage,
};

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
    /// The model the scan chose; empty for the one configured per stage.
    pub model: String,
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
    /// The seq of the job's final event, once its log took it ([`JobStore::set_end_seq`]): a
    /// finished job's end is known from the row alone, whatever the log's store is doing.
    pub end_seq: Option<u64>,
    /// Why the job was dead-lettered (`attempts`, `store`), while it is.
    pub dead_reason: Option<String>,
    /// Times the dead-letter schedule requeued the job since an operator last did (or since it
    /// was submitted).
    pub auto_requeues: u32,
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
    /// The model the scan chose (checked against the offered ones); empty for none.
    pub model: String,
    pub idempotency_key: Option<String>,
    pub trace_carrier: HashMap<String, String>,
}

/// A direct upload as stored: a photo the client sends to the object store itself, reserved by
/// `CreateUpload` and named by a later submit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upload {
    /// A UUID.
    pub id: String,
    /// Whose it is: only they may submit it.
    pub user_id: String,
    /// Where its photo goes in the object store.
    pub object_key: String,
    /// The declared type, which the bytes must be.
    pub content_type: String,
    /// The declared size, which the object must have exactly.
    pub size_bytes: u64,
    pub created_at: SystemTime,
    /// After it, the upload cannot be submitted and the sweep deletes it.
    pub expires_at: SystemTime,
    /// The job it was submitted as (once).
    pub job_id: Option<String>,
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
    /// worker makes) and one more attempt; a queued job is marked running at `first` in the
    /// same write (a running or finished one keeps its status and stage). `None` when there
    /// is no such job.
    async fn claim(&self, id: &str, first: Stage) -> Result<Option<Job>, StoreError>;
    /// Marks the job running at `stage`.
    async fn mark_running(&self, id: &str, epoch: u64, stage: Stage) -> Result<(), StoreError>;
    /// Stores a stage's output and, with `next`, marks the job running at the stage that
    /// follows, in one write. Only the first checkpoint of a stage is kept (a second changes
    /// nothing, `next` included), so a resumed worker can never overwrite an output that
    /// watchers have already seen.
    async fn checkpoint(
        &self,
        id: &str,
        epoch: u64,
        checkpoint: Checkpoint,
        next: Option<Stage>,
    ) -> Result<(), StoreError>;
    /// Moves the job to a terminal status (once; later calls change nothing). Returns the
    /// row as it moved it, or `None` when it was terminal already.
    async fn finish(
        &self,
        id: &str,
        epoch: u64,
        status: JobStatus,
        error: Option<ErrorInfo>,
    ) -> Result<Option<Job>, StoreError>;
    /// Records where a finished job's final event stands in its log, once the log took it
    /// (the last record wins: the log holds one final event).
    async fn set_end_seq(&self, id: &str, seq: u64) -> Result<(), StoreError>;
    /// Fails the job with `error` and sets it aside for an operator (a poison job: it failed
    /// too often, or on a record that cannot be read), `reason` saying which (`attempts`,
    /// `store`). Once, like [`JobStore::finish`].
    async fn dead_letter(
        &self,
        id: &str,
        epoch: u64,
        error: ErrorInfo,
        reason: &str,
    ) -> Result<(), StoreError>;
    /// Dead-lettered jobs, newest first: up to `limit` set aside before `before` (all when
    /// `None`), so callers page back in time.
    async fn dead_letters(
        &self,
        before: Option<SystemTime>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError>;
    /// Puts a dead-lettered job back to `queued` (its checkpoints kept, its attempts reset);
    /// `None` when the job is not dead-lettered (or no longer: of two concurrent requeues one
    /// wins). `scheduled`: the dead-letter schedule requeues it (its `auto_requeues` counts
    /// one more); else an operator does (the count starts over).
    async fn requeue(&self, id: &str, scheduled: bool) -> Result<Option<Job>, StoreError>;
    /// Up to `limit` jobs not yet terminal that were created before `created_before`, newest
    /// first, so callers page back in time (the sweeper re-enqueues those whose queue entry is
    /// gone).
    async fn unfinished(
        &self,
        created_before: SystemTime,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError>;
    /// Records a new direct upload (its id is new).
    async fn create_upload(&self, upload: &Upload) -> Result<(), StoreError>;
    /// The upload, or `None` when there is none with this id (or it was swept).
    async fn get_upload(&self, id: &str) -> Result<Option<Upload>, StoreError>;
    /// Marks the upload submitted as `job_id`, once: `false` when it was already (by this or
    /// a concurrent submit) or is gone.
    async fn claim_upload(&self, id: &str, job_id: &str) -> Result<bool, StoreError>;
    /// Undoes [`JobStore::claim_upload`] by `job_id` (its submit failed after the claim), so
    /// the upload can be submitted again; changes nothing when another job holds it.
    async fn release_upload(&self, id: &str, job_id: &str) -> Result<(), StoreError>;
    /// Up to `limit` uploads that expired before `before`, the oldest first, submitted or not
    /// (the sweep deletes them).
    async fn expired_uploads(
        &self,
        before: SystemTime,
        limit: u32,
    ) -> Result<Vec<Upload>, StoreError>;
    /// Removes the upload's row: `false` when there was none (another sweep removed it).
    async fn delete_upload(&self, id: &str) -> Result<bool, StoreError>;
    /// Whether the store answers, for a store reached over the network (PostgreSQL): what
    /// intake checks before it waits on the store ([`crate::store::Stores::check`]).
    fn health(&self) -> Option<StoreHealth> {
        None
    }
    /// The connections of the store's pool, for a store that has one (PostgreSQL).
    fn pool_stats(&self) -> Option<PoolStats> {
        None
    }
}
