//! Pipeline workers: claim a job with a lease, run each stage that has no checkpoint yet,
//! append every streamed message to the job's event log, checkpoint each stage's output on the
//! row, then tell the owner and acknowledge. A job whose worker died is claimed again when its
//! lease runs out and resumes at its first unfinished stage; stages are idempotent per job.

use std::{collections::HashMap, future::Future, sync::Arc, time::Duration};

use backon::{ExponentialBuilder, Retryable};
use ecoscan_common::{
    CancellationToken,
    client::{TracedChannel, channel, request_as},
    codes,
};
use ecoscan_proto::v1::{
    Answer, Classification, ClassifyRequest, DisposalRules, ErrorInfo, EvaluateRequest,
    EventStatus, GenerateRequest, JobStatus, LookupRequest, NotifyRequest, Progress,
    RewardDecision, ScanEvent, Stage, answer_service_client::AnswerServiceClient,
    classify_response, generate_response, lookup_response,
    notification_service_client::NotificationServiceClient,
    reward_service_client::RewardServiceClient, rule_service_client::RuleServiceClient,
    scan_event::Payload, vision_service_client::VisionServiceClient,
};
use tokio::task::JoinSet;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    Config, Stores,
    error::StoreError,
    event::{event, progress_range, stage_name, terminal_event_from_row},
    metrics::IngestMetrics,
    store::{Job, Lease, Queue, jobs::Checkpoint},
};

/// One shared channel per stage service.
#[derive(Clone)]
pub struct StageClients {
    vision: VisionServiceClient<TracedChannel>,
    rule: RuleServiceClient<TracedChannel>,
    answer: AnswerServiceClient<TracedChannel>,
    reward: RewardServiceClient<TracedChannel>,
    notification: NotificationServiceClient<TracedChannel>,
}

impl StageClients {
    pub fn connect(config: &Config) -> anyhow::Result<Self> {
        let max = ecoscan_common::server::MAX_MESSAGE_BYTES;
        Ok(Self {
            vision: VisionServiceClient::new(channel(&config.vision_url)?)
                .max_encoding_message_size(max)
                .max_decoding_message_size(max),
            rule: RuleServiceClient::new(channel(&config.rule_url)?),
            answer: AnswerServiceClient::new(channel(&config.answer_url)?),
            reward: RewardServiceClient::new(channel(&config.reward_url)?),
            notification: NotificationServiceClient::new(channel(&config.notification_url)?),
        })
    }
}

/// The running pipeline: a dispatcher claiming jobs and one task per job in flight.
pub struct Workers {
    dispatcher: Option<tokio::task::JoinHandle<()>>,
    jobs: Arc<tokio::sync::Mutex<JoinSet<()>>>,
    /// Stops the lease keeper.
    keeper_stop: CancellationToken,
    leases: Arc<Leases>,
    queue: Arc<dyn Queue>,
}

impl Workers {
    /// Waits until the dispatcher has stopped and every job in flight has finished (after
    /// shutdown, once their current stage is done).
    pub async fn wait(mut self) {
        if let Some(dispatcher) = self.dispatcher.take() {
            let _ = dispatcher.await;
        }
        let mut jobs = self.jobs.lock().await;
        while jobs.join_next().await.is_some() {}
    }
}

impl Workers {
    /// Hands every job still in flight back to the queue (shutdown, once the workers had their
    /// time): another process resumes them from their last checkpoint at once instead of
    /// waiting out their leases; a worker of this process that still writes is fenced off by
    /// that claim. Returns how many.
    pub fn releaser(&self) -> impl std::future::Future<Output = usize> + Send + 'static {
        let (leases, queue) = (self.leases.clone(), self.queue.clone());
        async move {
            let held: Vec<Lease> = leases
                .held
                .lock()
                .expect("leases lock poisoned")
                .values()
                .map(|(l, _)| l.clone())
                .collect();
            if held.is_empty() {
                return 0;
            }
            match queue.release(&held).await {
                Ok(()) => held.len(),
                Err(e) => {
                    tracing::warn!(error = %e, leases = held.len(), "failed to release leases; they run out instead");
                    0
                }
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.keeper_stop.cancel();
    }
}

/// Jobs claimed per round trip at most.
const CLAIM_BATCH: usize = 64;
/// How often the dispatcher forgets claimers of processes that are gone (at most; every five
/// leases when that is sooner).
const FORGET_EVERY: Duration = Duration::from_secs(60);

/// Leases held by this process's jobs, renewed together.
#[derive(Default)]
struct Leases {
    held: std::sync::Mutex<HashMap<String, (Lease, CancellationToken)>>,
}

impl Leases {
    fn hold(&self, lease: &Lease) -> CancellationToken {
        let lost = CancellationToken::new();
        self.held
            .lock()
            .expect("leases lock poisoned")
            .insert(lease.id.clone(), (lease.clone(), lost.clone()));
        lost
    }

    fn release(&self, lease: &Lease) {
        self.held
            .lock()
            .expect("leases lock poisoned")
            .remove(&lease.id);
    }

    /// Renews every held lease in one round trip; a job whose lease was lost is told to stop.
    async fn renew(&self, queue: &dyn Queue, hold: Duration) {
        let held: Vec<(Lease, CancellationToken)> = self
            .held
            .lock()
            .expect("leases lock poisoned")
            .values()
            .cloned()
            .collect();
        for chunk in held.chunks(500) {
            let leases: Vec<Lease> = chunk.iter().map(|(l, _)| l.clone()).collect();
            match queue.extend_many(&leases, hold).await {
                Ok(kept) => {
                    let held = self.held.lock().expect("leases lock poisoned");
                    for ((lease, lost), kept) in chunk.iter().zip(kept) {
                        // A job that finished (and acknowledged) meanwhile no longer holds it.
                        if !kept && held.contains_key(&lease.id) {
                            tracing::warn!(job.id = %lease.entry.job_id, "lease lost");
                            lost.cancel();
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, leases = leases.len(), "failed to extend leases")
                }
            }
        }
    }
}

/// Starts the dispatcher: it claims jobs while fewer than `config.max_in_flight` run in this
/// process and runs each as a task of its own (a job waiting on a model is a cheap task, so
/// the bound is the backlog and the model provider's concurrency, not a pool of workers). It
/// stops claiming when `shutdown` is cancelled.
pub fn spawn_workers(
    config: &Config,
    stores: Stores,
    stages: StageClients,
    metrics: IngestMetrics,
    shutdown: CancellationToken,
) -> Workers {
    let ctx = Arc::new(Ctx {
        config: config.clone(),
        stores,
        stages,
        metrics,
    });
    let leases = Arc::new(Leases::default());
    // What shutdown hands back (see [`Workers::releaser`]).
    let (held, queue) = (leases.clone(), ctx.stores.queue.clone());
    let jobs = Arc::new(tokio::sync::Mutex::new(JoinSet::new()));
    // Keep every held lease alive; if this process dies, the leases run out and other
    // processes resume the jobs.
    // Runs past shutdown, as long as jobs in flight need their leases: until `Workers` has
    // waited for them (or is dropped).
    let keeper_stop = CancellationToken::new();
    {
        let (ctx, leases, stop) = (ctx.clone(), leases.clone(), keeper_stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(ctx.config.lease / 3);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = tick.tick() => leases.renew(ctx.stores.queue.as_ref(), ctx.config.lease).await,
                }
            }
        });
    }
    let in_flight = Arc::new(tokio::sync::Semaphore::new(config.max_in_flight.max(1)));
    let dispatcher = {
        let jobs = jobs.clone();
        tokio::spawn(async move {
            let mut last_forget = tokio::time::Instant::now();
            while !shutdown.is_cancelled() {
                // Room for at least one job, then as many as are free, up to a batch.
                let first = tokio::select! {
                    () = shutdown.cancelled() => break,
                    p = in_flight.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                };
                let mut permits = vec![first];
                while permits.len() < CLAIM_BATCH {
                    match in_flight.clone().try_acquire_owned() {
                        Ok(p) => permits.push(p),
                        Err(_) => break,
                    }
                }
                let claimed = tokio::select! {
                    () = shutdown.cancelled() => break,
                    c = ctx.stores.queue.claim_many(ctx.config.lease, Duration::from_secs(1), permits.len()) => c,
                };
                match claimed {
                    Ok(claimed) => {
                        let mut set = jobs.lock().await;
                        // Reap finished tasks so the set holds only what runs.
                        while set.try_join_next().is_some() {}
                        for lease in claimed {
                            let permit = permits.pop().expect("claimed at most one per permit");
                            let lost = leases.hold(&lease);
                            let (ctx, leases) = (ctx.clone(), leases.clone());
                            set.spawn(async move {
                                ctx.process(&lease, lost).await;
                                leases.release(&lease);
                                drop(permit);
                            });
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "failed to claim jobs; backing off");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                if last_forget.elapsed() >= FORGET_EVERY.min(ctx.config.lease * 5) {
                    last_forget = tokio::time::Instant::now();
                    // A claimer idle for many leases holds nothing and is gone.
                    if let Err(e) = ctx
                        .stores
                        .queue
                        .forget_idle_claimers(ctx.config.lease * 10)
                        .await
                    {
                        tracing::warn!(error = %e, "failed to forget idle claimers");
                    }
                }
            }
        })
    };
    Workers {
        dispatcher: Some(dispatcher),
        jobs,
        keeper_stop,
        leases: held,
        queue,
    }
}

struct Ctx {
    config: Config,
    stores: Stores,
    stages: StageClients,
    metrics: IngestMetrics,
}

/// A stage failed for good; the job fails with this.
struct StageFailure {
    stage: Stage,
    status: Status,
}

impl Ctx {
    async fn process(&self, lease: &Lease, lost: CancellationToken) {
        let job_id = lease.entry.job_id.clone();
        if lease.entry.deliveries == 0 {
            // A redelivery's enqueue time is the first one: it would count the lease timeout.
            let lag = std::time::SystemTime::now()
                .duration_since(lease.entry.enqueued_at)
                .unwrap_or_default();
            self.metrics.dispatch_lag(lag);
        }
        let span = tracing::info_span!(
            "pipeline",
            otel.name = "pipeline",
            job.id = %job_id,
            job.deliveries = i64::from(lease.entry.deliveries),
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
            }
            // The job is left claimed: when the lease runs out it is tried again (and after
            // `max_attempts` runs it is dead-lettered).
            Some(Err(e)) => {
                tracing::error!(job.id = %job_id, error = %e, "storage failed while running job; it will be retried")
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
        let Some(job) = self.stores.jobs.claim(job_id).await? else {
            tracing::warn!(job.id = %job_id, "queued job has no row; dropping the queue entry");
            return Ok(());
        };
        let epoch = job.lease_epoch;
        self.stores.events.fence(job_id, epoch).await?;
        if job.is_terminal() {
            // Finished before, but the final event may not have made it to the log (the
            // process died between the row and the log).
            self.stores
                .events
                .append_final_as(terminal_event_from_row(&job), epoch)
                .await?;
            self.stores
                .events
                .expire(job_id, self.config.event_ttl)
                .await?;
            return Ok(());
        }
        if job.attempts > self.config.max_attempts {
            let message = format!(
                "the scan was started {} times without finishing (the service failed while \
                 running it each time); it has been set aside for an operator",
                job.attempts - 1
            );
            return self.give_up(&job, message, "attempts").await;
        }
        self.stores
            .jobs
            .mark_running(job_id, epoch, Stage::Vision)
            .await?;
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
        match outcome {
            Ok(()) => {
                self.stores
                    .jobs
                    .finish(job_id, epoch, JobStatus::Succeeded, None)
                    .await?;
                self.metrics.finished("succeeded");
                tracing::info!(job.id = %job_id, "scan complete");
            }
            Err(StageFailure { stage, status }) => {
                let error = ErrorInfo {
                    code: codes::code_name(status.code()).to_owned(),
                    http_status: u32::from(codes::http_status(status.code())),
                    message: format!("{} stage failed: {}", stage_name(stage), status.message()),
                    retryable: codes::retryable(status.code()),
                };
                tracing::warn!(job.id = %job_id, stage = stage_name(stage), code = %error.code, error = %status.message(), "scan failed");
                let (_, hi) = progress_range(stage);
                self.append(
                    epoch,
                    event(
                        job_id,
                        stage,
                        EventStatus::Failed,
                        hi,
                        &error.message,
                        Some(Payload::Error(error.clone())),
                    ),
                )
                .await?;
                self.stores
                    .jobs
                    .finish(job_id, epoch, JobStatus::Failed, Some(error))
                    .await?;
                self.metrics.finished("failed");
            }
        }
        self.final_event(job_id, epoch).await
    }

    /// The final event says what the row says: the first terminal status stands (`finish`
    /// keeps it), and the log takes one final event whoever appends it.
    async fn final_event(&self, job_id: &str, epoch: u64) -> Result<(), StoreError> {
        let row =
            self.stores.jobs.get(job_id).await?.ok_or_else(|| {
                StoreError::Corrupt(format!("job {job_id} vanished while running"))
            })?;
        self.stores
            .events
            .append_final_as(terminal_event_from_row(&row), epoch)
            .await?;
        self.stores
            .events
            .expire(job_id, self.config.event_ttl)
            .await?;
        Ok(())
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
        let (_, hi) = progress_range(stage);
        self.append(
            job.lease_epoch,
            event(
                &job.id,
                stage,
                EventStatus::Failed,
                hi,
                &error.message,
                Some(Payload::Error(error.clone())),
            ),
        )
        .await?;
        self.stores
            .jobs
            .dead_letter(&job.id, job.lease_epoch, error)
            .await?;
        self.metrics.finished("failed");
        self.metrics.dead_lettered(reason);
        self.final_event(&job.id, job.lease_epoch).await
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
        let stored = [
            (
                Stage::Vision,
                "classified",
                job.classification.clone().map(Payload::Classification),
            ),
            (
                Stage::Rule,
                "rules found",
                job.rules.clone().map(Payload::Rules),
            ),
            (
                Stage::Answer,
                "answer written",
                job.answer.clone().map(Payload::Answer),
            ),
            (
                Stage::Reward,
                "reward evaluated",
                job.reward.clone().map(Payload::Reward),
            ),
        ];
        for (stage, message, payload) in stored {
            if let Some(payload) = payload
                && !done(stage)
            {
                self.completed(job, stage, message, payload).await?;
            }
        }
        Ok(())
    }

    /// Runs every stage without a checkpoint. The outer error is a storage failure (retry the
    /// job later); the inner one a stage that failed for good (fail the job).
    async fn stages(&self, job: &Job) -> Result<Result<(), StageFailure>, StoreError> {
        let id = job.id.as_str();

        let classification = match &job.classification {
            Some(c) => c.clone(),
            None => match self.stage(job, Stage::Vision, || self.vision(job)).await? {
                Ok(c) => {
                    self.stores
                        .jobs
                        .checkpoint(id, job.lease_epoch, Checkpoint::Classification(c.clone()))
                        .await?;
                    self.completed(
                        job,
                        Stage::Vision,
                        "classified",
                        Payload::Classification(c.clone()),
                    )
                    .await?;
                    c
                }
                Err(f) => return Ok(Err(f)),
            },
        };

        let rules = match &job.rules {
            Some(r) => r.clone(),
            None => match self
                .stage(job, Stage::Rule, || self.rule(job, &classification))
                .await?
            {
                Ok(r) => {
                    self.stores
                        .jobs
                        .checkpoint(id, job.lease_epoch, Checkpoint::Rules(r.clone()))
                        .await?;
                    self.completed(job, Stage::Rule, "rules found", Payload::Rules(r.clone()))
                        .await?;
                    r
                }
                Err(f) => return Ok(Err(f)),
            },
        };

        if job.answer.is_none() {
            match self
                .stage(job, Stage::Answer, || {
                    self.answer(job, &classification, &rules)
                })
                .await?
            {
                Ok(a) => {
                    self.stores
                        .jobs
                        .checkpoint(id, job.lease_epoch, Checkpoint::Answer(a.clone()))
                        .await?;
                    self.completed(job, Stage::Answer, "answer written", Payload::Answer(a))
                        .await?;
                }
                Err(f) => return Ok(Err(f)),
            }
        }

        let reward = match &job.reward {
            Some(r) => r.clone(),
            None => match self
                .stage(job, Stage::Reward, || {
                    self.reward(job, &classification, &rules)
                })
                .await?
            {
                Ok(r) => {
                    self.stores
                        .jobs
                        .checkpoint(id, job.lease_epoch, Checkpoint::Reward(r.clone()))
                        .await?;
                    self.completed(
                        job,
                        Stage::Reward,
                        "reward evaluated",
                        Payload::Reward(r.clone()),
                    )
                    .await?;
                    r
                }
                Err(f) => return Ok(Err(f)),
            },
        };

        self.notify(job, &classification, &reward).await;
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
    async fn stage<T, F, Fut>(
        &self,
        job: &Job,
        stage: Stage,
        call: F,
    ) -> Result<Result<T, StageFailure>, StoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, StageError>>,
    {
        let span = tracing::info_span!(
            "stage",
            otel.name = %format!("stage {}", stage_name(stage)),
            job.id = %job.id,
            stage = stage_name(stage),
            // The lease counted this run already: the first run is attempt 1.
            attempt = i64::from(job.attempts),
            otel.status_code = tracing::field::Empty,
        );
        let started = std::time::Instant::now();
        let result = async {
            self.stores.jobs.mark_running(&job.id, job.lease_epoch, stage).await?;
            let (lo, _) = progress_range(stage);
            self.append(job.lease_epoch, event(&job.id, stage, EventStatus::Started, lo, &format!("{} started", stage_name(stage)), None))
                .await?;
            // Each attempt within the stage deadline, its whole response stream included.
            let timeout = self.config.stage_timeout;
            let attempt = || async {
                tokio::time::timeout(timeout, call()).await.unwrap_or_else(|_| {
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
                    tracing::Span::current().record("otel.status_code", "ERROR");
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

    async fn vision(&self, job: &Job) -> Result<Classification, StageError> {
        let image = self
            .stores
            .objects
            .get(&job.image_key)
            .await
            .map_err(StoreError::from)?
            .ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "image {} of job {} is missing",
                    job.image_key, job.id
                ))
            })?;
        let req = ClassifyRequest {
            job_id: job.id.clone(),
            image: image.to_vec(),
            content_type: job.content_type.clone(),
            hint: job.hint.clone(),
        };
        let mut stream = self
            .stages
            .vision
            .clone()
            .classify(request_as(req, self.call_deadline(), &job.user_id))
            .await?
            .into_inner();
        let mut out = None;
        while let Some(msg) =
            next(&mut stream, self.config.stage_idle_timeout, Stage::Vision).await?
        {
            match msg.event {
                Some(classify_response::Event::Progress(p)) => {
                    self.progress(job, Stage::Vision, &p).await?
                }
                Some(classify_response::Event::Classification(c)) => out = Some(c),
                None => {}
            }
        }
        out.ok_or_else(|| {
            StageError::Call(Status::internal(
                "vision ended its stream without a classification",
            ))
        })
    }

    async fn rule(
        &self,
        job: &Job,
        classification: &Classification,
    ) -> Result<DisposalRules, StageError> {
        let req = LookupRequest {
            classification: Some(classification.clone()),
            locale: job.locale.clone(),
        };
        let mut stream = self
            .stages
            .rule
            .clone()
            .lookup(request_as(req, self.call_deadline(), &job.user_id))
            .await?
            .into_inner();
        let mut out = None;
        while let Some(msg) = next(&mut stream, self.config.stage_idle_timeout, Stage::Rule).await?
        {
            match msg.event {
                Some(lookup_response::Event::Progress(p)) => {
                    self.progress(job, Stage::Rule, &p).await?
                }
                Some(lookup_response::Event::Rules(r)) => out = Some(r),
                None => {}
            }
        }
        out.ok_or_else(|| StageError::Call(Status::internal("rule ended its stream without rules")))
    }

    async fn answer(
        &self,
        job: &Job,
        classification: &Classification,
        rules: &DisposalRules,
    ) -> Result<Answer, StageError> {
        let req = GenerateRequest {
            job_id: job.id.clone(),
            classification: Some(classification.clone()),
            rules: Some(rules.clone()),
            locale: job.locale.clone(),
        };
        let mut stream = self
            .stages
            .answer
            .clone()
            .generate(request_as(req, self.call_deadline(), &job.user_id))
            .await?
            .into_inner();
        let (lo, hi) = progress_range(Stage::Answer);
        let mut out = None;
        let mut pending = String::new();
        let mut streamed_chars = 0usize;
        let mut flush_at = tokio::time::Instant::now() + self.config.delta_interval;
        loop {
            // Deltas are buffered and flushed at most every `delta_interval`.
            let msg = if pending.is_empty() {
                next(&mut stream, self.config.stage_idle_timeout, Stage::Answer).await?
            } else {
                tokio::select! {
                    m = next(&mut stream, self.config.stage_idle_timeout, Stage::Answer) => m?,
                    () = tokio::time::sleep_until(flush_at) => {
                        streamed_chars += pending.chars().count();
                        let text = std::mem::take(&mut pending);
                        let p = (lo + (hi - lo) * (streamed_chars as f32 / 600.0).min(0.95)).min(hi);
                        self.append(job.lease_epoch, event(&job.id, Stage::Answer, EventStatus::Delta, p, "", Some(Payload::Delta(text)))).await?;
                        flush_at = tokio::time::Instant::now() + self.config.delta_interval;
                        continue;
                    }
                }
            };
            let Some(msg) = msg else { break };
            match msg.event {
                Some(generate_response::Event::Progress(p)) => {
                    self.progress(job, Stage::Answer, &p).await?
                }
                Some(generate_response::Event::Delta(d)) => {
                    if pending.is_empty() {
                        flush_at = tokio::time::Instant::now() + self.config.delta_interval;
                    }
                    pending.push_str(&d);
                }
                Some(generate_response::Event::Answer(a)) => out = Some(a),
                None => {}
            }
        }
        if !pending.is_empty() {
            self.append(
                job.lease_epoch,
                event(
                    &job.id,
                    Stage::Answer,
                    EventStatus::Delta,
                    hi,
                    "",
                    Some(Payload::Delta(pending)),
                ),
            )
            .await?;
        }
        out.ok_or_else(|| {
            StageError::Call(Status::internal(
                "answer ended its stream without an answer",
            ))
        })
    }

    async fn reward(
        &self,
        job: &Job,
        classification: &Classification,
        rules: &DisposalRules,
    ) -> Result<RewardDecision, StageError> {
        let req = EvaluateRequest {
            job_id: job.id.clone(),
            classification: Some(classification.clone()),
            rules: Some(rules.clone()),
        };
        Ok(self
            .stages
            .reward
            .clone()
            .evaluate(request_as(req, self.call_deadline(), &job.user_id))
            .await?
            .into_inner()
            .decision
            .ok_or_else(|| Status::internal("reward answered without a decision"))?)
    }

    /// Tells the owner the scan finished. Best effort: the scan's result does not depend on it,
    /// and the dedupe key makes a repeat after a resume harmless.
    async fn notify(&self, job: &Job, classification: &Classification, reward: &RewardDecision) {
        let item = if classification.item_name.is_empty() {
            classification.minor_category.clone()
        } else {
            classification.item_name.clone()
        };
        let character = reward.character.as_ref().filter(|_| reward.newly_granted);
        let (title, body) = match (job.locale.as_str(), character) {
            ("en", Some(c)) => (
                "Your scan is ready".to_owned(),
                format!(
                    "How to dispose of {item} is ready. New character: {}!",
                    c.name_en
                ),
            ),
            ("en", None) => (
                "Your scan is ready".to_owned(),
                format!("How to dispose of {item} is ready."),
            ),
            (_, Some(c)) => (
                "분리배출 안내가 준비됐어요".to_owned(),
                format!(
                    "{item} 배출 방법을 확인하세요. 새 캐릭터 {}을(를) 얻었어요!",
                    c.name_ko
                ),
            ),
            (_, None) => (
                "분리배출 안내가 준비됐어요".to_owned(),
                format!("{item} 배출 방법을 확인하세요."),
            ),
        };
        let req = NotifyRequest {
            kind: "scan_completed".into(),
            title,
            body,
            job_id: job.id.clone(),
            dedupe_key: format!("scan:{}", job.id),
        };
        let call = || {
            let mut client = self.stages.notification.clone();
            let req = req.clone();
            let user = job.user_id.as_str();
            async move {
                client
                    .notify(request_as(req, Duration::from_secs(5), user))
                    .await
            }
        };
        let sent = call
            .retry(ExponentialBuilder::default().with_max_times(3))
            .when(|s: &Status| codes::retryable(s.code()))
            .await;
        if let Err(status) = sent {
            tracing::warn!(job.id = %job.id, code = ?status.code(), error = %status.message(), "failed to notify the owner");
        }
    }
}

/// A stage call's failure: the remote call, or our own storage.
#[derive(Debug, thiserror::Error)]
enum StageError {
    #[error("{}: {}", codes::code_name(.0.code()), .0.message())]
    Call(Status),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<Status> for StageError {
    fn from(s: Status) -> Self {
        Self::Call(codes::connection_lost_is_unavailable(s))
    }
}

/// The stream's next message, or `DEADLINE_EXCEEDED` when the stage stays silent for `idle`
/// (a stalled stage must not hold its job forever while the lease keeper keeps it alive).
async fn next<T>(
    stream: &mut Streaming<T>,
    idle: Duration,
    stage: Stage,
) -> Result<Option<T>, StageError> {
    match tokio::time::timeout(idle, stream.next()).await {
        Ok(item) => Ok(item.transpose()?),
        Err(_) => Err(StageError::Call(Status::deadline_exceeded(format!(
            "{} sent nothing for {} s",
            stage_name(stage),
            idle.as_secs_f64()
        )))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_connection_lost_mid_call_is_retried_and_a_stage_verdict_is_not() {
        let lost = Status::unknown("h2 protocol error: error reading a body from connection");
        let StageError::Call(lost) = StageError::from(lost) else {
            unreachable!()
        };
        assert_eq!(lost.code(), tonic::Code::Unavailable);
        assert!(codes::worth_retrying(&lost));
        let StageError::Call(cut) = StageError::from(Status::unknown("transport error")) else {
            unreachable!()
        };
        assert_eq!(cut.code(), tonic::Code::Unavailable);
        let StageError::Call(verdict) = StageError::from(Status::unknown("model said no")) else {
            unreachable!()
        };
        assert_eq!(verdict.code(), tonic::Code::Unknown);
    }
}
