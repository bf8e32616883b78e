//! Dead letters put back on the queue: by an operator (`RequeueDeadLetter`), or by the
//! schedule (`INGEST_DEAD_LETTER_RETRY`), which retries the kinds of dead letter that a later
//! try can mend — a job started too often without finishing (its workers died under it) — a
//! number of times with a doubling wait, and never a poison input (a record that cannot be
//! read) unless the operator asks for it.
//!
//! Both go through [`requeue`]: the row back to `queued` (one requeue wins when two race, so
//! replicas of ingest each running the schedule requeue a job once), the job's log restarted,
//! the job enqueued, and the requeue linked in the trace to the scan it restarts.

use std::time::{Duration, SystemTime};

use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::{EventStatus, Stage};
use tokio::task::JoinHandle;

pub use crate::retry_policy::RetryPolicy;
use crate::{
    error::StoreError,
    event::event,
    metrics::IngestMetrics,
    store::{Job, QueueEntry, Stores},
};

/// Who put a dead letter back: the `by` label of `ingest_jobs_requeued_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequeuedBy {
    Operator,
    Schedule,
}

impl RequeuedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Operator => "operator",
            Self::Schedule => "schedule",
        }
    }
}

/// Puts the dead letter `id` back on the queue; `None` when it is not (or no longer) a dead
/// letter. Its log starts again, so that its watchers see the new run only; a worker then picks
/// it up and resumes it at its first stage without a checkpoint.
pub async fn requeue(
    stores: &Stores,
    metrics: &IngestMetrics,
    id: &str,
    by: RequeuedBy,
) -> Result<Option<Job>, StoreError> {
    let Some(job) = stores.jobs.requeue(id, by == RequeuedBy::Schedule).await? else {
        return Ok(None);
    };
    // The request (or pass) that requeues is a trace of its own; a link joins it to the scan it
    // restarts (whose trace the rerun goes on in, from the job's carrier), so a search by
    // `job.id` finds the requeue beside the scan.
    ecoscan_common::telemetry::link_to_carrier(&tracing::Span::current(), &job.trace_carrier);
    let note = match by {
        RequeuedBy::Operator => "requeued by an operator",
        RequeuedBy::Schedule => "requeued by the dead-letter schedule",
    };
    stores
        .events
        .restart(event(
            &job.id,
            Stage::Queued,
            EventStatus::Completed,
            0.0,
            note,
            None,
        ))
        .await?;
    stores.queue.enqueue(QueueEntry::for_job(&job)).await?;
    metrics.requeued(by.as_str());
    Ok(Some(job))
}

/// Dead letters one pass looks at, newest first: far more than a healthy suite ever holds.
const PASS_LIMIT: u32 = 1000;

/// Runs the schedule every `interval` until `shutdown`: each pass requeues the dead letters
/// whose next try is due. Nothing runs when the policy retries nothing.
pub fn spawn(
    stores: Stores,
    metrics: IngestMetrics,
    policy: RetryPolicy,
    interval: Duration,
    shutdown: CancellationToken,
) -> Option<JoinHandle<()>> {
    if policy.is_off() {
        tracing::info!("dead-letter schedule off: dead letters wait for an operator");
        return None;
    }
    // The schedule in effect, as the setting spells it: what an operator checks first when
    // dead letters come back (or never do).
    tracing::info!(schedule = %policy, every = ?interval, "dead-letter schedule running");
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => {}
            }
            if let Err(e) = pass(&stores, &metrics, &policy, SystemTime::now()).await {
                tracing::warn!(error = %e, "dead-letter schedule pass failed; trying again next interval");
            }
        }
    }))
}

/// One pass of the schedule at `now`: returns how many dead letters it requeued.
// A trace of its own per pass (the loop outlives any request), with a link from each requeue
// to its scan.
#[tracing::instrument(name = "retry dead letters", parent = None, skip_all)]
pub async fn pass(
    stores: &Stores,
    metrics: &IngestMetrics,
    policy: &RetryPolicy,
    now: SystemTime,
) -> Result<usize, StoreError> {
    let mut requeued = 0;
    for job in stores.jobs.dead_letters(None, PASS_LIMIT).await? {
        let Some(due) = policy.next_try(job.dead_reason.as_deref(), job.auto_requeues, job.dead_at)
        else {
            continue;
        };
        if due > now {
            continue;
        }
        let kind = job.dead_reason.clone().unwrap_or_default();
        if let Some(job) = requeue(stores, metrics, &job.id, RequeuedBy::Schedule).await? {
            requeued += 1;
            // Recorded like an operator's requeue: who, which job, and which try of how many.
            tracing::info!(
                job.id = %job.id,
                by = "schedule",
                kind,
                attempt = job.auto_requeues,
                of = policy.times(&kind),
                "dead-lettered job requeued"
            );
        }
    }
    Ok(requeued)
}
