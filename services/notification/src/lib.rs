//! `ecoscan.v1.NotificationService`: an inbox in SQL, notifications delivered now or at a due
//! time by a scheduler, and a live stream per user fed by an in-process hub (through Redis
//! Pub/Sub across replicas when `REDIS_URL` is set).

mod error;
pub mod hub;
mod kick;
pub mod metrics;
pub mod reconcile;
pub mod scheduler;
pub mod store;

mod config;
mod delivery;
mod service;

pub use config::{Config, DEFAULT_DATABASE_URL};
pub(crate) use ecoscan_proto::{now_us, timestamp_from_us as us_to_ts, timestamp_us as ts_to_us};
pub use service::{DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, MAX_SCHEDULE_AHEAD, Notifications};

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::notification_service_server::NotificationServiceServer;
use tokio::net::TcpListener;

pub use error::Error;
use hub::{Fanout, Hub};
use metrics::NotificationMetrics;
use reconcile::Kick;
use scheduler::{MemoryScheduler, Scheduler};

/// Fully-qualified gRPC service name.
pub const SERVICE_NAME: &str = "ecoscan.v1.NotificationService";

/// Brings the database's schema up to date and returns (`ecoscan-notification migrate`);
/// `serve` does the same at start.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    let store = store::open(&config.database_url)
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
    let store = store::open(&config.database_url)
        .await
        .context("failed to open the notification database")?;
    let hub = Hub::new(config.subscriber_buffer);
    let stop_relay = CancellationToken::new();
    let kick = Kick::default();
    let (scheduler, fanout, relay, redis_health) = match &config.redis {
        Some(settings) => {
            let (scheduler, fanout, relay, health) = open_redis(
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
                Arc::new(scheduler) as Arc<dyn Scheduler>,
                Fanout::Redis(fanout),
                Some(relay),
                Some(health),
            )
        }
        None => (
            Arc::new(MemoryScheduler::new()) as Arc<dyn Scheduler>,
            Fanout::Local(hub.clone()),
            None,
            None,
        ),
    };
    let on_redis = config.redis.is_some();
    let fanout = Arc::new(fanout);

    let mut metrics = ecoscan_common::metrics::Metrics::new("notification");
    let observed = store.clone();
    ecoscan_common::store_health::register_sql(
        &mut metrics,
        store.health(),
        "schedules and inbox reads fail with UNAVAILABLE; due notifications wait",
        move || observed.pool_stats(),
    );
    if let Some(health) = &redis_health {
        health.set_waiting(
            "scheduled notifications wait; the reconcile sweep puts back what was missed",
        );
        ecoscan_common::store_health::register(
            &mut metrics,
            std::slice::from_ref(health),
            Vec::new(),
        );
    }
    let notification_metrics =
        NotificationMetrics::register(&mut metrics, scheduler.clone(), hub.clone());
    // The reload at start: every scheduled row, in pages; on Redis only what it is missing is
    // added (entries waiting or claimed stay as they are). Not counted as reconciled: in memory
    // the whole schedule is reloaded at every start.
    let Some(reloaded) = reconcile::reload(&*store, &*scheduler, &shutdown).await? else {
        // Asked to stop while the stores were still unavailable: nothing was served yet.
        if let Some(relay) = relay {
            stop_relay.cancel();
            let _ = relay.await;
        }
        return Ok(());
    };
    tracing::info!(
        scheduled = reloaded.checked,
        added = reloaded.restored,
        "reloaded scheduled notifications"
    );

    let stop_delivery = CancellationToken::new();
    let delivery = tokio::spawn(delivery::deliver_due(
        store.clone(),
        scheduler.clone(),
        fanout.clone(),
        notification_metrics.clone(),
        config.delivery_lease,
        stop_delivery.clone(),
    ));
    // In memory nothing can lose an entry while the process runs: no sweeps there.
    let reconciler = on_redis.then(|| {
        tokio::spawn(reconcile::run(
            store.clone(),
            scheduler.clone(),
            notification_metrics.clone(),
            reconcile::Settings {
                interval: config.reconcile_interval,
                limit: config.reconcile_limit,
            },
            kick.clone(),
            stop_delivery.clone(),
        ))
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
    ecoscan_common::store_health::StoreHealth,
)> {
    let redis = ecoscan_redis::Redis::connect(settings, "ecoscan-notification")
        .await
        .context("failed to connect to redis (REDIS_URL)")?;
    let scheduler = scheduler::RedisScheduler::new(&redis, prefix, poll);
    let (fanout, relay) = hub::RedisFanout::start_with(&redis, prefix, hub, stop, resynced).await?;
    Ok((scheduler, fanout, relay, redis.health().clone()))
}
