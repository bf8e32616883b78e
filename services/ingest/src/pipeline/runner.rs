//! One job, from its claim to its final event: the claim and its fence, the stage table walked
//! in order (each stage's messages appended as events, its output checkpointed), the final
//! event from the row, and the dead letter for a job that cannot finish.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use ecoscan_common::{CancellationToken, codes};
use ecoscan_proto::v1::{
    ErrorInfo, EventStatus, JobStatus, Progress, ScanEvent, Stage, scan_event::Payload,
};
use tonic::Status;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{
    Ctx,
    notify::notify,
    stages::{Calls, STAGES, StageDef, StageError, StageMsg, next, payload, record},
};
use crate::{
    error::StoreError,
    event::{close_log, delta, event, failed, progress_range, restarted, stage_error, stage_name},
    store::{Job, Lease, jobs::Checkpoint},
};

/// A stage failed for good; the job fails with this.
struct StageFailure {
    stage: Stage,
    status: Status,
}

impl Ctx {
    pub(super) async fn process(&self, lease: &Lease, lost: CancellationToken) {
        let job_id = lease.entry.job_id.clone();
        if lease.entry.deliveries == 0 {
            // A redelivery's enqueue time is the first one: it would count the lease timeout.
            let lag = std::time::SystemTime::now()
                .duration_since(lease.entry.enqueued_at)
                .unwrap_or_default();
            self.metrics.dispatch_lag(lag);
        }
        // The consumer's side of the dispatch queue, by the messaging conventions: the job is
        // the message, processed here, and the span is named `{operation} {destination}`.
        let span = tracing::info_span!(
            "pipeline",
            otel.name = super::PROCESS_SPAN,
            otel.kind = "consumer",
            job.id = %job_id,
            job.deliveries = i64::from(lease.entry.deliveries),
            messaging.system = if self.config.redis.is_some() { "redis" } else { "in_memory" },
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.destination.name = super::QUEUE_NAME,
            messaging.message.id = %job_id,
        );
        // The pipeline joins the trace of the request that submitted the job.
        let _ = span.set_parent(ecoscan_common::telemetry::context_from_carrier(
            &lease.entry.carrier,
        ));

        // A lease found lost means another worker may own the job now (this one stalled past
        // its lease, or Redis lost the queue and the sweeper put the job back): stop, so that
        // two workers never keep running one job. Should the two overlap anyway, the stale
        // one's next write is refused (fencing) and it stops then.
        let outcome = tokio::select! {
            outcome = self.run(&job_id, lease.entry.deliveries == 0).instrument(span) => Some(outcome),
            () = lost.cancelled() => None,
        };
        match outcome {
            Some(Ok(())) => {
                if let Err(e) = self.stores.queue.ack(lease).await {
                    tracing::warn!(job.id = %job_id, error = %e, "failed to acknowledge job; it will run again and find its checkpoints");
                }
            }
            Some(Err(StoreError::Fenced { epoch, .. })) => {
                self.metrics.fenced();
                tracing::warn!(job.id = %job_id, epoch, "the job was claimed again; this worker stops and leaves it to its new owner");
                // The newer claim holds an entry of its own; this one, left behind, would come
                // back when its lease ran out and fence that claim in turn (see `ack_held`).
                match self.stores.queue.ack_held(lease).await {
                    Ok(dropped) => {
                        tracing::debug!(job.id = %job_id, dropped, "fenced worker's queue entry")
                    }
                    Err(e) => {
                        tracing::warn!(job.id = %job_id, error = %e, "failed to drop the fenced worker's queue entry; it comes back when its lease runs out")
                    }
                }
            }
            // The job is left claimed: when the lease runs out it is tried again (and after
            // `max_attempts` runs it is dead-lettered).
            // Every running job fails so during a store outage: one line per interval, the others
            // counted (the store's health says once that it stopped answering).
            Some(Err(e)) => {
                if let Some(suppressed) =
                    ecoscan_common::log_limit::admit("ingest job store failure")
                {
                    tracing::error!(
                        job.id = %job_id,
                        error = %e,
                        suppressed,
                        "storage failed while running job; it will be retried (at most one such \
                         line per {} s; `suppressed` counts the others)",
                        ecoscan_common::log_limit::INTERVAL.as_secs()
                    );
                }
            }
            // Whoever holds the job now resumes it from its last checkpoint.
            None => {
                tracing::warn!(job.id = %job_id, "lease lost; leaving the job to its new owner")
            }
        }
    }

    /// The gRPC deadline of a stage call: a little past the stage deadline, so that the
    /// stage's own timer fires first (DEADLINE_EXCEEDED with a message saying which stage),
    /// rather than the client's (CANCELLED "Timeout expired"), while the stage server still
    /// learns when to give up.
    fn call_deadline(&self) -> Duration {
        self.config.stage_timeout + Duration::from_secs(1)
    }

    /// Appends `ev` as the writer of claim `epoch` (refused once the job is claimed again).
    async fn append(&self, epoch: u64, ev: ScanEvent) -> Result<ScanEvent, StoreError> {
        self.stores.events.append_as(ev, epoch).await
    }

    async fn run(&self, job_id: &str, first_delivery: bool) -> Result<(), StoreError> {
        // The claim: a new epoch on the row, then the log's fence raised to it. From here on
        // every write of an earlier claim is refused, and what earlier claims wrote (their
        // checkpoints, their events) is what this one reads.
        // A queued job is marked running at the first stage in the same write.
        let Some(job) = self.stores.jobs.claim(job_id, STAGES[0].stage).await? else {
            tracing::warn!(job.id = %job_id, "queued job has no row; dropping the queue entry");
            return Ok(());
        };
        let epoch = job.lease_epoch;
        self.stores.events.fence(job_id, epoch).await?;
        if job.is_terminal() {
            // Finished before, but the final event may not have made it to the log (the
            // process died between the row and the log).
            return close_log(&self.stores, &job, epoch, self.config.event_ttl)
                .await
                .map(drop);
        }
        if job.attempts > self.config.max_attempts {
            let message = format!(
                "the scan was started {} times without finishing (the service failed while \
                 running it each time); it has been set aside for an operator",
                job.attempts - 1
            );
            return self.give_up(&job, message, "attempts").await;
        }
        if !first_delivery || job.attempts > 1 {
            tracing::info!(job.id = %job_id, attempt = job.attempts, "resuming job from its last checkpoint");
            self.complete_checkpointed(&job).await?;
        }
        let outcome = match self.stages(&job).await {
            Ok(outcome) => outcome,
            Err(e @ StoreError::Fenced { .. }) => return Err(e),
            // A record that cannot be read fails the same way however often the job is tried
            // (an image that is gone, a checkpoint that does not decode): give up now.
            Err(e) if !e.is_transient() => {
                tracing::error!(job.id = %job_id, error = %e, "a record of the job cannot be read; failing it");
                let message = "the scan could not be completed because one of its stored \
                               records cannot be read; it has been set aside for an operator"
                    .to_owned();
                return self.give_up(&job, message, "store").await;
            }
            Err(e) => return Err(e),
        };
        let ended = match outcome {
            Ok(()) => {
                let ended = self
                    .stores
                    .jobs
                    .finish(job_id, epoch, JobStatus::Succeeded, None)
                    .await?;
                self.metrics.finished("succeeded");
                tracing::info!(job.id = %job_id, "scan complete");
                ended
            }
            Err(StageFailure { stage, status }) => {
                let error = stage_error(stage, &status);
                tracing::warn!(job.id = %job_id, stage = stage_name(stage), code = %error.code, error = %status.message(), "scan failed");
                self.append(epoch, failed(job_id, stage, &error)).await?;
                let ended = self
                    .stores
                    .jobs
                    .finish(job_id, epoch, JobStatus::Failed, Some(error))
                    .await?;
                self.metrics.finished("failed");
                ended
            }
        };
        self.final_event(job_id, epoch, ended).await
    }

    /// The final event says what the row says: the first terminal status stands (`finish`
    /// keeps it), and the log takes one final event whoever appends it.
    ///
    /// Runs as a task of its own, so that it completes even when this worker's lease is found
    /// lost meanwhile (which drops the rest of the job's work): the row is terminal already, and
    /// nobody else would append the event — the sweeper puts back only unfinished jobs, and a
    /// job whose queue entry Redis lost is never delivered again. Should a newer claim own the
    /// job, its fence refuses this append and that claim appends the event itself.
    ///
    /// `ended` is the row as this worker's `finish` left it; `None` (it was finished before)
    /// reads the row.
    async fn final_event(
        &self,
        job_id: &str,
        epoch: u64,
        ended: Option<Job>,
    ) -> Result<(), StoreError> {
        let (stores, ttl, job_id) = (
            self.stores.clone(),
            self.config.event_ttl,
            job_id.to_owned(),
        );
        let task = tokio::spawn(
            async move {
                let row = match ended {
                    Some(row) => row,
                    None => stores.jobs.get(&job_id).await?.ok_or_else(|| {
                        StoreError::Corrupt(format!("job {job_id} vanished while running"))
                    })?,
                };
                close_log(&stores, &row, epoch, ttl).await.map(drop)
            }
            .in_current_span(),
        );
        task.await
            .map_err(|e| StoreError::Unavailable(format!("the final event's task failed: {e}")))?
    }

    /// Fails a poison job for good and sets it aside (dead letter) for an operator to look at
    /// and requeue; its watchers get its `failed` and final events.
    async fn give_up(
        &self,
        job: &Job,
        message: String,
        reason: &'static str,
    ) -> Result<(), StoreError> {
        let status = Status::internal(message);
        let error = ErrorInfo {
            code: codes::code_name(status.code()).to_owned(),
            http_status: u32::from(codes::http_status(status.code())),
            message: status.message().to_owned(),
            // Trying the same scan again will not help until an operator has looked.
            retryable: false,
        };
        let stage = if job.stage == Stage::Queued {
            Stage::Vision
        } else {
            job.stage
        };
        tracing::error!(job.id = %job.id, attempts = job.attempts, reason, "dead-lettering job");
        self.append(job.lease_epoch, failed(&job.id, stage, &error))
            .await?;
        self.stores
            .jobs
            .dead_letter(&job.id, job.lease_epoch, error, reason)
            .await?;
        self.metrics.finished("failed");
        self.metrics.dead_lettered(reason);
        if job.auto_requeues > 0 {
            // The schedule requeued it and it came back: `EcoscanDeadLettersReturn`.
            self.metrics.dead_letter_returned();
        }
        self.final_event(&job.id, job.lease_epoch, None).await
    }

    /// A resumed job: every stage whose output is on the row but whose `completed` event is
    /// not in the log (the previous worker stopped between the two) gets it now, from the
    /// stored output, so watchers see each stage's output exactly once and it is the stored
    /// one.
    async fn complete_checkpointed(&self, job: &Job) -> Result<(), StoreError> {
        let logged = self.stores.events.read_after(&job.id, None).await?;
        let done = |stage: Stage| {
            logged
                .iter()
                .any(|e| e.stage == stage as i32 && e.status == EventStatus::Completed as i32)
        };
        for def in &STAGES {
            if let Some(output) = (def.stored)(job)
                && !done(def.stage)
            {
                self.completed(job, def.stage, def.completed, payload(output))
                    .await?;
            }
        }
        Ok(())
    }

    /// Runs every stage without a checkpoint, in order. The outer error is a storage failure
    /// (retry the job later); the inner one a stage that failed for good (fail the job).
    async fn stages(&self, job: &Job) -> Result<Result<(), StageFailure>, StoreError> {
        let mut job = job.clone();
        for (i, def) in STAGES.iter().enumerate() {
            if (def.stored)(&job).is_some() {
                continue;
            }
            let output = match self.stage(&job, def).await? {
                Ok(output) => output,
                Err(f) => return Ok(Err(f)),
            };
            // The checkpoint marks the job running at the next stage to run, in the same write
            // (one statement where two were); that stage then skips `mark_running`.
            let next = STAGES[i + 1..]
                .iter()
                .find(|d| (d.stored)(&job).is_none())
                .map(|d| d.stage);
            self.stores
                .jobs
                .checkpoint(&job.id, job.lease_epoch, output.clone(), next)
                .await?;
            if let Some(next) = next {
                job.status = JobStatus::Running;
                job.stage = next;
            }
            self.completed(&job, def.stage, def.completed, payload(output.clone()))
                .await?;
            record(&mut job, output);
        }
        if let (Some(classification), Some(reward)) = (&job.classification, &job.reward) {
            notify(&self.stages.notification, &job, classification, reward).await;
        }
        Ok(Ok(()))
    }

    async fn completed(
        &self,
        job: &Job,
        stage: Stage,
        message: &str,
        payload: Payload,
    ) -> Result<(), StoreError> {
        let (_, hi) = progress_range(stage);
        self.append(
            job.lease_epoch,
            event(
                &job.id,
                stage,
                EventStatus::Completed,
                hi,
                message,
                Some(payload),
            ),
        )
        .await?;
        Ok(())
    }

    /// Runs one stage in its own span: a `started` event, then the call, retried with backoff
    /// while it fails transiently.
    async fn stage(
        &self,
        job: &Job,
        def: &StageDef,
    ) -> Result<Result<Checkpoint, StageFailure>, StoreError> {
        let stage = def.stage;
        let span = tracing::info_span!(
            "stage",
            otel.name = %format!("stage {}", stage_name(stage)),
            job.id = %job.id,
            job.stage = stage_name(stage),
            // The lease counted this run already: the first run is attempt 1.
            job.attempt = i64::from(job.attempts),
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let started = std::time::Instant::now();
        let result = async {
            // Marked running at this stage already by the claim or the previous checkpoint?
            if !(job.status == JobStatus::Running && job.stage == stage) {
                self.stores.jobs.mark_running(&job.id, job.lease_epoch, stage).await?;
            }
            let (lo, _) = progress_range(stage);
            self.append(job.lease_epoch, event(&job.id, stage, EventStatus::Started, lo, &format!("{} started", stage_name(stage)), None))
                .await?;
            // Each attempt within the stage deadline, its whole response stream included. An
            // attempt after the first says so first (`restarted`): what the failed one streamed
            // (answer text above all) is void, and its deltas start again at offset 0.
            let timeout = self.config.stage_timeout;
            let attempts = std::sync::atomic::AtomicUsize::new(0);
            let attempt = || async {
                let n = attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if n > 1 {
                    self.append(job.lease_epoch, restarted(&job.id, stage, n)).await?;
                }
                tokio::time::timeout(timeout, self.attempt(job, def)).await.unwrap_or_else(|_| {
                    Err(StageError::Call(Status::deadline_exceeded(format!(
                        "{} did not finish within {} s",
                        stage_name(stage),
                        timeout.as_secs_f64()
                    ))))
                })
            };
            let result = attempt
                .retry(
                    ExponentialBuilder::default()
                        .with_min_delay(Duration::from_millis(200))
                        .with_max_delay(Duration::from_secs(5))
                        .with_max_times(self.config.stage_retries)
                        .with_jitter(),
                )
                .when(|e: &StageError| matches!(e, StageError::Call(s) if codes::worth_retrying(s)))
                .notify(|e, after| tracing::warn!(stage = stage_name(stage), error = %e, retry_in = ?after, "stage call failed; retrying"))
                .await;
            match result {
                Ok(v) => Ok(Ok(v)),
                Err(StageError::Store(e)) => Err(e),
                Err(StageError::Call(status)) => {
                    ecoscan_common::telemetry::record_error(
                        &tracing::Span::current(),
                        codes::code_name(status.code()),
                        status.message(),
                    );
                    Ok(Err(StageFailure { stage, status }))
                }
            }
        }
        .instrument(span)
        .await;
        let outcome = match &result {
            Ok(Ok(_)) => "ok",
            Ok(Err(_)) => "failed",
            Err(_) => "store_error",
        };
        self.metrics
            .stage(stage_name(stage), outcome, started.elapsed());
        result
    }

    /// One attempt of a stage: its call, then its messages until the stream ends, each
    /// appended as it comes, except answer text, which is buffered and appended at most every
    /// `delta_interval`. Returns the stage's output.
    async fn attempt(&self, job: &Job, def: &StageDef) -> Result<Checkpoint, StageError> {
        let stage = def.stage;
        let calls = Calls {
            clients: &self.stages,
            objects: self.stores.objects.as_ref(),
            deadline: self.call_deadline(),
        };
        let mut messages = (def.call)(&calls, job).await?;
        let idle = self.config.stage_idle_timeout;
        let (lo, hi) = progress_range(stage);
        let mut out = None;
        let mut pending = String::new();
        let mut streamed_chars = 0usize;
        let mut flush_at = tokio::time::Instant::now() + self.config.delta_interval;
        loop {
            let msg = if pending.is_empty() {
                next(&mut messages, idle, stage).await?
            } else {
                tokio::select! {
                    m = next(&mut messages, idle, stage) => m?,
                    () = tokio::time::sleep_until(flush_at) => {
                        let offset = streamed_chars;
                        streamed_chars += pending.chars().count();
                        let text = std::mem::take(&mut pending);
                        let p = (lo + (hi - lo) * (streamed_chars as f32 / 600.0).min(0.95)).min(hi);
                        self.append(job.lease_epoch, delta(&job.id, stage, p, text, offset)).await?;
                        flush_at = tokio::time::Instant::now() + self.config.delta_interval;
                        continue;
                    }
                }
            };
            let Some(msg) = msg else { break };
            match msg {
                StageMsg::Progress(p) => self.progress(job, stage, &p).await?,
                StageMsg::Delta(d) => {
                    if pending.is_empty() {
                        flush_at = tokio::time::Instant::now() + self.config.delta_interval;
                    }
                    pending.push_str(&d);
                }
                StageMsg::Output(o) => out = Some(*o),
            }
        }
        if !pending.is_empty() {
            self.append(
                job.lease_epoch,
                delta(&job.id, stage, hi, pending, streamed_chars),
            )
            .await?;
        }
        out.ok_or_else(|| StageError::Call(Status::internal(def.missing)))
    }

    async fn progress(&self, job: &Job, stage: Stage, p: &Progress) -> Result<(), StoreError> {
        let (lo, hi) = progress_range(stage);
        let fraction = lo + (hi - lo) * p.fraction.clamp(0.0, 1.0);
        tracing::debug!(stage = stage_name(stage), step = %p.step, "stage progress");
        self.append(
            job.lease_epoch,
            event(
                &job.id,
                stage,
                EventStatus::Progress,
                fraction,
                &p.message,
                None,
            ),
        )
        .await?;
        Ok(())
    }
}
