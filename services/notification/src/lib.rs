//! `ecoscan.v1.NotificationService`: an inbox in SQL, notifications delivered now or at a due
//! time by a scheduler, and a live stream per user fed by an in-process hub (through Redis
//! Pub/Sub across replicas when `REDIS_URL` is set).

mod error;
pub mod hub;
pub mod metrics;
pub mod reconcile;
pub mod scheduler;
pub mod store;

use std::{sync::Arc, time::Duration};

use anyhow::{Context, bail};
use ecoscan_common::{
    CancellationToken,
    config::{env_duration, env_opt, env_or},
    identity::{IdentityError, caller, valid_user_id},
};
use ecoscan_proto::v1::{
    CancelRequest, CancelResponse, ListRequest, ListResponse, Notification, NotificationStatus,
    NotifyRequest, NotifyResponse, ScheduleRequest, ScheduleResponse, SubscribeRequest,
    SubscribeResponse,
    notification_service_server::{NotificationService, NotificationServiceServer},
};
use tokio::{net::TcpListener, sync::mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub use error::Error;
use hub::{Ended, Fanout, Hub};
use metrics::NotificationMetrics;
use reconcile::Kick;
use scheduler::{AnyScheduler, MemoryScheduler, Scheduler};
use store::{AnyNotificationStore, CancelOutcome, NotificationRow, NotificationStore};

/// Fully-qualified gRPC service name.
pub const SERVICE_NAME: &str = "ecoscan.v1.NotificationService";

/// Default database: a SQLite file under `./data`.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://./data/notification.db?mode=rwc";

/// `List` returns this many when the request gives no limit.
pub const DEFAULT_LIST_LIMIT: u32 = 50;
/// `List` never returns more than this many; larger limits are clamped.
pub const MAX_LIST_LIMIT: u32 = 500;
/// How far ahead a notification may be scheduled.
pub const MAX_SCHEDULE_AHEAD: Duration = Duration::from_secs(365 * 24 * 3600);

/// Due notifications claimed per scheduler round.
const CLAIM_BATCH: usize = 2000;
/// Claimed notifications marked, published and acknowledged together: large enough that a batch
/// costs the database and Redis one round trip each, small enough that the first of a claim is
/// not held back long by the rest.
const DELIVERY_BATCH: usize = 250;
/// Longest the delivery loop sleeps without looking at the scheduler.
const MAX_IDLE: Duration = Duration::from_secs(60);

/// Configuration of the notification service.
///
/// Environment variables:
/// - `NOTIFICATION_DATABASE_URL`, else `DATABASE_URL`: sqlx database URL (default
///   `sqlite://./data/notification.db?mode=rwc`, the parent directory of a file is created; a
///   `postgres://` URL selects PostgreSQL, whose migrations are applied at start).
/// - `REDIS_URL`: schedule on Redis and deliver to subscribers of every replica through Redis
///   Pub/Sub (unset: an in-memory scheduler and in-process delivery, one replica only). With
///   `REDIS_CLUSTER=true` it names one or more seed nodes of a Redis Cluster.
/// - `NOTIFICATION_REDIS_PREFIX`: prefix of every Redis key and channel (default empty), for
///   deployments or tests sharing one Redis.
/// - `NOTIFICATION_POLL_INTERVAL`: with Redis, the longest the delivery loop waits before looking
///   for entries other replicas scheduled, e.g. `100ms` (default 100 ms).
/// - `NOTIFICATION_SUBSCRIBER_BUFFER`: notifications a live subscriber may fall behind by before
///   its stream is ended with RESOURCE_EXHAUSTED (default 64).
/// - `NOTIFICATION_DELIVERY_LEASE`: how long a claimed due notification stays claimed before
///   another round may retry it, e.g. `30s` (default 30 s).
/// - `NOTIFICATION_RECONCILE_INTERVAL`: with Redis, how often a sweep puts scheduled rows that
///   Redis lost (a failed add, a Redis that came back empty) back into the due set, e.g. `30s`
///   (default 30 s). A sweep also runs soon after the Redis subscription comes back from a lost
///   connection and soon after an add fails; a failed sweep is retried after 1 s, 2 s, … up to
///   this interval.
/// - `NOTIFICATION_RECONCILE_LIMIT`: scheduled notifications one sweep looks at, earliest due
///   first, in pages of 1,000 (default 10000); later ones are looked at as earlier ones are
///   delivered.
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    pub subscriber_buffer: usize,
    pub delivery_lease: Duration,
    /// Redis (one server or a Cluster) for scheduling and cross-replica delivery; `None` keeps
    /// both in this process.
    pub redis: Option<ecoscan_redis::Settings>,
    pub redis_prefix: String,
    pub poll_interval: Duration,
    /// With Redis, the longest time between two reconcile sweeps.
    pub reconcile_interval: Duration,
    /// Scheduled rows one reconcile sweep looks at, earliest due first.
    pub reconcile_limit: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            subscriber_buffer: 64,
            delivery_lease: Duration::from_secs(30),
            redis: None,
            redis_prefix: String::new(),
            poll_interval: Duration::from_millis(100),
            reconcile_interval: Duration::from_secs(30),
            reconcile_limit: 10_000,
        }
    }
}

impl Config {
    /// Reads the configuration from the environment (see the type's docs).
    pub fn from_env() -> anyhow::Result<Self> {
        let d = Self::default();
        let config = Self {
            database_url: match env_opt("NOTIFICATION_DATABASE_URL") {
                Some(url) => url,
                None => env_or("DATABASE_URL", d.database_url)?,
            },
            subscriber_buffer: env_or("NOTIFICATION_SUBSCRIBER_BUFFER", d.subscriber_buffer)?,
            delivery_lease: env_duration("NOTIFICATION_DELIVERY_LEASE", d.delivery_lease)?,
            redis: ecoscan_redis::Settings::from_env()?,
            redis_prefix: env_opt("NOTIFICATION_REDIS_PREFIX").unwrap_or_default(),
            poll_interval: env_duration("NOTIFICATION_POLL_INTERVAL", d.poll_interval)?,
            reconcile_interval: env_duration(
                "NOTIFICATION_RECONCILE_INTERVAL",
                d.reconcile_interval,
            )?,
            reconcile_limit: env_or("NOTIFICATION_RECONCILE_LIMIT", d.reconcile_limit)?,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.subscriber_buffer == 0 {
            bail!("subscriber_buffer must be at least 1");
        }
        if self.delivery_lease.is_zero() {
            bail!("delivery_lease must be positive");
        }
        if self.poll_interval.is_zero() {
            bail!("poll_interval must be positive");
        }
        if self.reconcile_interval.is_zero() {
            bail!("reconcile_interval must be positive (NOTIFICATION_RECONCILE_INTERVAL)");
        }
        if self.reconcile_limit == 0 {
            bail!("reconcile_limit must be at least 1 (NOTIFICATION_RECONCILE_LIMIT)");
        }
        Ok(())
    }
}

impl Config {
    /// Switches this configuration onto the production stores the environment names, store by
    /// store, and leaves the rest as it is: `NOTIFICATION_DATABASE_URL`/`DATABASE_URL` when it is
    /// a `postgres://` URL (the inbox), `REDIS_URL` and `NOTIFICATION_REDIS_PREFIX` (schedule and
    /// cross-replica delivery), and `NOTIFICATION_RECONCILE_INTERVAL` and
    /// `NOTIFICATION_RECONCILE_LIMIT` (how Redis is kept in line with the rows) when set.
    /// `ecoscan up` builds its own embedded configuration and passes it through here.
    pub fn with_stores_from_env(mut self) -> anyhow::Result<Self> {
        if let Some(url) = env_opt("NOTIFICATION_DATABASE_URL")
            .or_else(|| env_opt("DATABASE_URL"))
            .filter(|u| store::is_postgres(u))
        {
            self.database_url = url;
        }
        if let Some(redis) = ecoscan_redis::Settings::from_env()? {
            self.redis = Some(redis);
        }
        if let Some(prefix) = env_opt("NOTIFICATION_REDIS_PREFIX") {
            self.redis_prefix = prefix;
        }
        self.reconcile_interval =
            env_duration("NOTIFICATION_RECONCILE_INTERVAL", self.reconcile_interval)?;
        self.reconcile_limit = env_or("NOTIFICATION_RECONCILE_LIMIT", self.reconcile_limit)?;
        Ok(self)
    }
}

/// Brings the database's schema up to date and returns (`ecoscan-notification migrate`);
/// `serve` does the same at start.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    let store = AnyNotificationStore::connect(&config.database_url)
        .await
        .context("failed to migrate the notification database")?;
    store.close().await;
    Ok(())
}

/// Serves `ecoscan.v1.NotificationService` (with health and reflection) on `listener` until
/// `shutdown` is cancelled. Notifications still scheduled in the database are loaded into the
/// scheduler first, so none is lost across restarts; with Redis, a reconcile loop then keeps
/// putting back what Redis loses while the process runs (see [`reconcile`]).
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    config.validate()?;
    let mut embedded = Vec::new();
    if !store::is_postgres(&config.database_url) {
        embedded.push((
            "notifications in SQLite",
            "NOTIFICATION_DATABASE_URL or DATABASE_URL to a postgres:// URL",
        ));
    }
    if config.redis.is_none() {
        embedded.push(("the schedule in this process", "REDIS_URL"));
    }
    ecoscan_common::config::require_production_stores("notification", &embedded)?;
    let store = Arc::new(
        AnyNotificationStore::connect(&config.database_url)
            .await
            .context("failed to open the notification database")?,
    );
    let hub = Hub::new(config.subscriber_buffer);
    let stop_relay = CancellationToken::new();
    let kick = Kick::default();
    let (scheduler, fanout, relay) = match &config.redis {
        Some(settings) => {
            let (scheduler, fanout, relay) = open_redis(
                settings,
                &config.redis_prefix,
                config.poll_interval,
                hub.clone(),
                stop_relay.clone(),
                kick.clone(),
            )
            .await
            .context("failed to set up the redis scheduler")?;
            (
                AnyScheduler::Redis(scheduler),
                Fanout::Redis(fanout),
                Some(relay),
            )
        }
        None => (
            AnyScheduler::Memory(MemoryScheduler::new()),
            Fanout::Local(hub.clone()),
            None,
        ),
    };
    let on_redis = matches!(scheduler, AnyScheduler::Redis(_));
    let scheduler = Arc::new(scheduler);
    let fanout = Arc::new(fanout);

    let mut metrics = ecoscan_common::metrics::Metrics::new("notification");
    let notification_metrics =
        NotificationMetrics::register(&mut metrics, scheduler.clone(), hub.clone());
    // The reload at start: every scheduled row, in pages; on Redis only what it is missing is
    // added (entries waiting or claimed stay as they are). Not counted as reconciled: in memory
    // the whole schedule is reloaded at every start.
    let reloaded = reconcile::sweep(&*store, &*scheduler, None, &NotificationMetrics::default())
        .await
        .context("failed to reload the scheduled notifications")?;
    tracing::info!(
        scheduled = reloaded.checked,
        added = reloaded.restored,
        "reloaded scheduled notifications"
    );

    let stop_delivery = CancellationToken::new();
    let delivery = tokio::spawn(
        deliver_due(
            store.clone(),
            scheduler.clone(),
            fanout.clone(),
            notification_metrics.clone(),
            config.delivery_lease,
            stop_delivery.clone(),
        )
        .instrument(tracing::info_span!("notification.delivery")),
    );
    // In memory nothing can lose an entry while the process runs: no sweeps there.
    let reconciler = on_redis.then(|| {
        tokio::spawn(
            reconcile::run(
                store.clone(),
                scheduler.clone(),
                notification_metrics.clone(),
                reconcile::Settings {
                    interval: config.reconcile_interval,
                    limit: config.reconcile_limit,
                },
                kick.clone(),
                stop_delivery.clone(),
            )
            .instrument(tracing::info_span!("notification.reconcile")),
        )
    });

    let svc = NotificationServiceServer::new(
        Notifications::new(store.clone(), scheduler, hub, fanout, shutdown.clone())
            .with_metrics(notification_metrics)
            .with_reconcile(kick),
    )
    .max_decoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    let result = ecoscan_common::server::serve_with_metrics(
        tonic::service::Routes::new(svc),
        &[SERVICE_NAME],
        metrics,
        listener,
        shutdown,
    )
    .await;
    stop_delivery.cancel();
    if let Err(e) = delivery.await {
        tracing::error!(error = %e, "delivery task failed");
    }
    if let Some(reconciler) = reconciler
        && let Err(e) = reconciler.await
    {
        tracing::error!(error = %e, "reconcile task failed");
    }
    stop_relay.cancel();
    if let Some(relay) = relay
        && let Err(e) = relay.await
    {
        tracing::error!(error = %e, "redis relay task failed");
    }
    store.close().await;
    result
}

/// Delivers scheduled notifications as they fall due until `stop` is cancelled.
async fn deliver_due<St: NotificationStore, Sc: Scheduler>(
    store: Arc<St>,
    scheduler: Arc<Sc>,
    fanout: Arc<Fanout>,
    metrics: NotificationMetrics,
    lease: Duration,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let claimed = match scheduler.claim_due(now_us(), CLAIM_BATCH, lease).await {
            Ok(claimed) => claimed,
            Err(e) => {
                tracing::error!(error = ?e, "failed to claim due notifications");
                Vec::new()
            }
        };
        for batch in claimed.chunks(DELIVERY_BATCH) {
            deliver_batch(&*store, &*scheduler, &fanout, &metrics, batch).await;
        }
        if claimed.len() == CLAIM_BATCH {
            continue;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = scheduler.wait(MAX_IDLE) => {}
        }
    }
}

/// Delivers one batch of claimed ids: one statement marks them delivered (only those still
/// scheduled: a cancelled or already delivered one drops out), one round trip publishes them, one
/// acknowledges them. A batch that fails to be marked is not acknowledged: its leases run out
/// and a later round retries it.
// A root span per batch: the delivery loop lives as long as the process, and a trace of it all
// would never end.
#[tracing::instrument(name = "deliver due notifications", parent = None, skip_all, fields(count = ids.len()))]
async fn deliver_batch<St: NotificationStore, Sc: Scheduler>(
    store: &St,
    scheduler: &Sc,
    fanout: &Fanout,
    metrics: &NotificationMetrics,
    ids: &[String],
) {
    let now = now_us();
    let rows = match store.mark_delivered_many(ids, now).await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::error!(count = ids.len(), error = ?e, "failed to deliver due notifications");
            return;
        }
    };
    if rows.len() < ids.len() {
        // Cancelled, or delivered by an earlier claim: nothing to do for those.
        tracing::debug!(
            skipped = ids.len() - rows.len(),
            "due notifications no longer scheduled"
        );
    }
    let notifications: Vec<Notification> = rows
        .into_iter()
        .map(|row| {
            if let Some(due) = row.due_at_us {
                let late_us = u64::try_from(now.saturating_sub(due)).unwrap_or(0);
                metrics.delivery_lag(Duration::from_micros(late_us));
            }
            to_proto(row)
        })
        .collect();
    for n in &notifications {
        metrics.delivered(&n.kind);
    }
    // A failure is logged, not retried: the notifications are in the inbox already, and a live
    // stream is best-effort by design.
    match fanout.publish_many(&notifications).await {
        Ok(receivers) => {
            for (n, subscribers) in notifications.iter().zip(receivers) {
                tracing::debug!(id = %n.id, user_id = %n.user_id, subscribers, "scheduled notification delivered");
            }
        }
        Err(e) => {
            tracing::error!(count = notifications.len(), error = ?e, "failed to publish notifications to live subscribers");
        }
    }
    tracing::info!(
        delivered = notifications.len(),
        "scheduled notifications delivered"
    );
    if let Err(e) = scheduler.ack_many(ids).await {
        tracing::warn!(count = ids.len(), error = ?e, "failed to acknowledge delivered notifications");
    }
}

/// Publishes a stored notification to live subscribers. A failure is logged, not returned: the
/// notification is in the inbox already, and a live stream is best-effort by design.
async fn publish(fanout: &Fanout, metrics: &NotificationMetrics, n: &Notification) -> usize {
    metrics.delivered(&n.kind);
    match fanout.publish(n).await {
        Ok(receivers) => receivers,
        Err(e) => {
            tracing::error!(id = %n.id, error = ?e, "failed to publish a notification to live subscribers");
            0
        }
    }
}

/// The NotificationService implementation over any [`NotificationStore`] and [`Scheduler`].
pub struct Notifications<St, Sc> {
    store: Arc<St>,
    scheduler: Arc<Sc>,
    /// Where `Subscribe` streams attach.
    hub: Arc<Hub>,
    /// Where delivered notifications are published (this hub, or every replica's).
    fanout: Arc<Fanout>,
    /// Ends live streams when the server shuts down, so draining does not wait on them.
    shutdown: CancellationToken,
    metrics: NotificationMetrics,
    /// Asks for a reconcile sweep when adding to the scheduler failed.
    reconcile: Kick,
}

impl<St: NotificationStore, Sc: Scheduler> Notifications<St, Sc> {
    /// Counts deliveries in `metrics` (registered with [`NotificationMetrics::register`]).
    #[must_use]
    pub fn with_metrics(mut self, metrics: NotificationMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Asks the reconcile loop listening on `kick` for a sweep whenever adding a scheduled
    /// notification to the scheduler fails (see [`reconcile::run`]).
    #[must_use]
    pub fn with_reconcile(mut self, kick: Kick) -> Self {
        self.reconcile = kick;
        self
    }

    /// A service over `store` and `scheduler`, streaming from `hub` and publishing through
    /// `fanout`.
    pub fn new(
        store: Arc<St>,
        scheduler: Arc<Sc>,
        hub: Arc<Hub>,
        fanout: Arc<Fanout>,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            store,
            scheduler,
            hub,
            fanout,
            shutdown,
            metrics: NotificationMetrics::default(),
            reconcile: Kick::default(),
        }
    }

    /// Stores and delivers a notification now; a repeat of a dedupe key returns the first one
    /// and publishes nothing.
    pub async fn notify(&self, user_id: &str, req: NotifyRequest) -> Result<Notification, Error> {
        check_user_and_title(user_id, &req.title)?;
        let now = now_us();
        let row = NotificationRow {
            id: uuid::Uuid::now_v7().to_string(),
            user_id: user_id.to_owned(),
            kind: req.kind,
            title: req.title,
            body: req.body,
            job_id: req.job_id,
            dedupe_key: dedupe_key(req.dedupe_key),
            status: store::Status::Delivered,
            due_at_us: None,
            created_at_us: now,
            delivered_at_us: Some(now),
        };
        let (row, inserted) = self.store.insert(row).await.map_err(Error::Internal)?;
        let n = to_proto(row);
        if inserted {
            let subscribers = publish(&self.fanout, &self.metrics, &n).await;
            tracing::info!(id = %n.id, subscribers, "notification delivered");
        } else {
            tracing::info!(id = %n.id, "deduplicated notification");
        }
        Ok(n)
    }

    /// Stores a notification for delivery at its due time (at once when that has passed).
    ///
    /// The stored row is the commitment: once it is written the call succeeds, even when adding
    /// it to the scheduler fails (Redis down): a reconcile sweep adds it once Redis answers
    /// again, and it is delivered then, late. A repeat of a dedupe key returns the first
    /// notification and, while that one is still scheduled, adds it to the scheduler again if
    /// the scheduler lost it (a caller retrying after an error gets its notification back on
    /// the schedule at once).
    pub async fn schedule(
        &self,
        user_id: &str,
        req: ScheduleRequest,
    ) -> Result<Notification, Error> {
        check_user_and_title(user_id, &req.title)?;
        let due = ts_to_us(&req.due_at.ok_or(Error::MissingDueAt)?);
        let now = now_us();
        let max_ahead = i64::try_from(MAX_SCHEDULE_AHEAD.as_micros()).expect("a year fits in i64");
        if due > now.saturating_add(max_ahead) {
            return Err(Error::DueTooFar);
        }
        let row = NotificationRow {
            id: uuid::Uuid::now_v7().to_string(),
            user_id: user_id.to_owned(),
            kind: req.kind,
            title: req.title,
            body: req.body,
            job_id: String::new(),
            dedupe_key: dedupe_key(req.dedupe_key),
            status: store::Status::Scheduled,
            due_at_us: Some(due),
            created_at_us: now,
            delivered_at_us: None,
        };
        let (row, inserted) = self.store.insert(row).await.map_err(Error::Internal)?;
        if !inserted {
            tracing::info!(id = %row.id, "deduplicated schedule");
            if row.status == store::Status::Scheduled
                && let Some(due) = row.due_at_us
            {
                let restored = self.add_to_scheduler(&row.id, due).await;
                if restored {
                    self.metrics.reconciled(1);
                    tracing::warn!(id = %row.id, "a retried schedule put its notification back on the schedule");
                }
            }
            return Ok(to_proto(row));
        }
        if due <= now {
            // Already due: deliver it in this call, through the same guarded update the
            // scheduler uses.
            let delivered = self
                .store
                .mark_delivered(&row.id, now)
                .await
                .map_err(Error::Internal)?;
            if let Some(row) = delivered {
                let n = to_proto(row);
                let subscribers = publish(&self.fanout, &self.metrics, &n).await;
                tracing::info!(id = %n.id, subscribers, "past-due notification delivered at once");
                return Ok(n);
            }
        }
        self.add_to_scheduler(&row.id, due).await;
        tracing::info!(id = %row.id, due_at_us = due, "notification scheduled");
        Ok(to_proto(row))
    }

    /// Adds the scheduled row `id` to the scheduler unless it is there already (waiting or
    /// claimed); returns whether it added it. A failure is logged and leaves it to the reconcile
    /// sweep, asked for at once.
    async fn add_to_scheduler(&self, id: &str, due: i64) -> bool {
        match self.scheduler.add_missing(&[(id.to_owned(), due)]).await {
            Ok(added) => added > 0,
            Err(e) => {
                tracing::warn!(id, error = ?e, "failed to add a scheduled notification to the scheduler; a reconcile sweep will");
                self.reconcile.sweep_soon();
                false
            }
        }
    }

    /// Cancels a scheduled notification of `user_id`; cancelling one twice is not an error.
    pub async fn cancel(&self, user_id: &str, req: CancelRequest) -> Result<Notification, Error> {
        check_user(user_id)?;
        if req.id.trim().is_empty() {
            return Err(Error::EmptyId);
        }
        match self
            .store
            .cancel(&req.id, user_id)
            .await
            .map_err(Error::Internal)?
        {
            CancelOutcome::Cancelled(row) | CancelOutcome::AlreadyCancelled(row) => {
                Ok(to_proto(row))
            }
            CancelOutcome::AlreadyDelivered(row) => Err(Error::AlreadyDelivered(row.id)),
            // Another user's notification is indistinguishable from an unknown one.
            CancelOutcome::NotFound => Err(Error::NotFound(req.id)),
        }
    }

    /// `user_id`'s inbox, newest first.
    pub async fn list(&self, user_id: &str, req: ListRequest) -> Result<Vec<Notification>, Error> {
        check_user(user_id)?;
        let limit = match req.limit {
            0 => DEFAULT_LIST_LIMIT,
            n => n.min(MAX_LIST_LIMIT),
        };
        let rows = self
            .store
            .list(user_id, limit)
            .await
            .map_err(Error::Internal)?;
        Ok(rows.into_iter().map(to_proto).collect())
    }
}

fn check_user(user_id: &str) -> Result<(), Error> {
    if valid_user_id(user_id) {
        Ok(())
    } else {
        Err(Error::Identity(IdentityError::Invalid))
    }
}

fn check_user_and_title(user_id: &str, title: &str) -> Result<(), Error> {
    check_user(user_id)?;
    if title.trim().is_empty() {
        return Err(Error::EmptyTitle);
    }
    Ok(())
}

fn dedupe_key(key: String) -> Option<String> {
    (!key.trim().is_empty()).then_some(key)
}

fn to_proto(row: NotificationRow) -> Notification {
    let status = match row.status {
        store::Status::Scheduled => NotificationStatus::Scheduled,
        store::Status::Delivered => NotificationStatus::Delivered,
        store::Status::Cancelled => NotificationStatus::Cancelled,
    };
    Notification {
        id: row.id,
        user_id: row.user_id,
        kind: row.kind,
        title: row.title,
        body: row.body,
        due_at: row.due_at_us.map(us_to_ts),
        created_at: Some(us_to_ts(row.created_at_us)),
        delivered_at: row.delivered_at_us.map(us_to_ts),
        status: status as i32,
        job_id: row.job_id,
    }
}

pub(crate) use ecoscan_proto::{now_us, timestamp_from_us as us_to_ts, timestamp_us as ts_to_us};

/// The user the call acts for (see `ecoscan_common::identity`), recorded on the RPC's span.
fn acting_user<T>(request: &Request<T>) -> Result<String, Error> {
    let user = caller(request.metadata())?;
    tracing::Span::current().record("user_id", user.as_str());
    Ok(user)
}

#[tonic::async_trait]
impl<St: NotificationStore, Sc: Scheduler> NotificationService for Notifications<St, Sc> {
    #[tracing::instrument(skip_all, fields(user_id, kind = %request.get_ref().kind))]
    async fn notify(
        &self,
        request: Request<NotifyRequest>,
    ) -> Result<Response<NotifyResponse>, Status> {
        let user = acting_user(&request)?;
        let n = Notifications::notify(self, &user, request.into_inner()).await?;
        Ok(Response::new(NotifyResponse {
            notification: Some(n),
        }))
    }

    #[tracing::instrument(skip_all, fields(user_id, kind = %request.get_ref().kind))]
    async fn schedule(
        &self,
        request: Request<ScheduleRequest>,
    ) -> Result<Response<ScheduleResponse>, Status> {
        let user = acting_user(&request)?;
        let n = Notifications::schedule(self, &user, request.into_inner()).await?;
        Ok(Response::new(ScheduleResponse {
            notification: Some(n),
        }))
    }

    #[tracing::instrument(skip_all, fields(id = %request.get_ref().id, user_id))]
    async fn cancel(
        &self,
        request: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        let user = acting_user(&request)?;
        let n = Notifications::cancel(self, &user, request.into_inner()).await?;
        tracing::info!("notification cancelled");
        Ok(Response::new(CancelResponse {
            notification: Some(n),
        }))
    }

    type SubscribeStream = ReceiverStream<Result<SubscribeResponse, Status>>;

    /// Streams the user's notifications delivered from now on. A subscriber that falls more than
    /// the subscriber buffer behind gets RESOURCE_EXHAUSTED; server shutdown ends it with
    /// UNAVAILABLE.
    #[tracing::instrument(skip_all, fields(user_id))]
    async fn subscribe(
        &self,
        request: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let user_id = acting_user(&request)?;
        // Subscribed before the response goes out: whatever is delivered after the caller sees
        // the stream open reaches it.
        let mut sub = self.hub.subscribe(&user_id);
        let (tx, rx) = mpsc::channel(16);
        let shutdown = self.shutdown.clone();
        tokio::spawn(
            async move {
                tracing::info!("subscriber joined");
                loop {
                    let item = tokio::select! {
                        () = tx.closed() => break,
                        () = shutdown.cancelled() => Err(Error::ShuttingDown),
                        r = sub.recv() => r.map_err(|Ended::Lagged(n)| Error::SubscriberLagged(n)),
                    };
                    let last = item.is_err();
                    if let Ok(n) = &item {
                        tracing::info!(id = %n.id, "notification streamed");
                    } else {
                        tracing::warn!(error = ?item.as_ref().err(), "ending subscription");
                    }
                    let sent = tokio::select! {
                        // A final status still goes out when there is room for it.
                        biased;
                        r = tx.send(item.map(|n| SubscribeResponse { notification: Some(n) }).map_err(Status::from)) => r.is_ok(),
                        () = shutdown.cancelled() => false,
                    };
                    if last || !sent {
                        break;
                    }
                }
                tracing::info!("subscriber left");
            }
            .in_current_span(),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    #[tracing::instrument(skip_all, fields(user_id, limit = request.get_ref().limit))]
    async fn list(&self, request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let user = acting_user(&request)?;
        let notifications = Notifications::list(self, &user, request.into_inner()).await?;
        Ok(Response::new(ListResponse { notifications }))
    }
}

/// The scheduler and the fan-out of one process on `settings`' Redis (one server or a
/// Cluster), sharing one multiplexed connection; with the subscription that makes two Redis
/// connections per process, however many subscribers it has. Each time the subscription comes
/// back after a lost connection, `resynced` asks for a reconcile sweep.
async fn open_redis(
    settings: &ecoscan_redis::Settings,
    prefix: &str,
    poll: Duration,
    hub: Arc<Hub>,
    stop: CancellationToken,
    resynced: Kick,
) -> anyhow::Result<(
    scheduler::RedisScheduler,
    hub::RedisFanout,
    tokio::task::JoinHandle<()>,
)> {
    let redis = ecoscan_redis::Redis::connect(settings, "ecoscan-notification")
        .await
        .context("failed to connect to redis (REDIS_URL)")?;
    let scheduler = scheduler::RedisScheduler::new(&redis, prefix, poll);
    let (fanout, relay) = hub::RedisFanout::start_with(&redis, prefix, hub, stop, resynced).await?;
    Ok((scheduler, fanout, relay))
}
