//! Pipeline workers: claim a job with a lease, run each stage that has no checkpoint yet,
//! append every streamed message to the job's event log, checkpoint each stage's output on the
//! row, then tell the owner and acknowledge. A job whose worker died is claimed again when its
//! lease runs out and resumes at its first unfinished stage; stages are idempotent per job.
//!
//! Read top to bottom:
//! - this module: the dispatcher (claims jobs while there is room, one task per job) and the
//!   lease keeper (renews every held lease in one round trip);
//! - [`runner`]: one job from its claim to its final event, a loop over the stage table;
//! - [`stages`]: the stage table, and one file per stage that turns a job into the stage's
//!   request and its response into [`stages::StageMsg`]s (progress, answer text, the output),
//!   which the runner appends and checkpoints; a stage knows nothing of the event log;
//! - [`notify`]: the owner's notification once a scan is done.

mod notify;
mod runner;
mod stages;

use std::{collections::HashMap, sync::Arc, time::Duration};

use ecoscan_common::{
    CancellationToken,
    client::{TracedChannel, channel},
};
use ecoscan_proto::v1::{
    answer_service_client::AnswerServiceClient,
    notification_service_client::NotificationServiceClient,
    reward_service_client::RewardServiceClient, rule_service_client::RuleServiceClient,
    vision_service_client::VisionServiceClient,
};
use tokio::task::JoinSet;

use crate::{
    Config,
    metrics::IngestMetrics,
    store::{Lease, Queue, Stores},
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

/// The dispatch queue's name in traces (`messaging.destination.name`).
pub(crate) const QUEUE_NAME: &str = "scan-jobs";
/// The name of a worker's span for one job taken from the queue: the messaging conventions'
/// `{operation} {destination}` for the consumer's processing.
pub(crate) const PROCESS_SPAN: &str = "process scan-jobs";

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
            let sent = tokio::time::Instant::now();
            match queue.extend_many(&leases, hold).await {
                Ok(kept) => {
                    let mut held = self.held.lock().expect("leases lock poisoned");
                    for ((lease, lost), kept) in chunk.iter().zip(kept) {
                        if kept {
                            // Renewed by a request sent at `sent`: the next renewal's bound.
                            if let Some((l, _)) = held.get_mut(&lease.id) {
                                l.renewed = sent;
                            }
                        } else if held.contains_key(&lease.id) {
                            // (A job that finished, and acknowledged, meanwhile no longer
                            // holds it.)
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

/// What every job's task shares.
struct Ctx {
    config: Config,
    stores: Stores,
    stages: StageClients,
    metrics: IngestMetrics,
}
