//! `ecoscan.v1.AnalyticsService`: records every LLM call (rows in SQL, bodies in an object store)
//! through one group-commit writer, and answers usage aggregates. A batch the stores fail to take
//! goes to a bounded on-disk [`spool`] and is written to them when they recover, so an
//! acknowledged call is never lost to a store outage.

mod batch;
mod error;
mod metrics;
pub mod prices;
pub mod spool;
pub mod store;
pub mod writer;

mod config;
mod service;

pub use config::{
    BODY_KEY_PREFIX, Config, DEFAULT_BODY_DIR, DEFAULT_DATABASE_URL, DEFAULT_SPOOL_DIR,
};
pub use service::Analytics;

use std::sync::Arc;

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::analytics_service_server::AnalyticsServiceServer;
use tokio::net::TcpListener;

use ecoscan_objects::ObjectStore;
pub use ecoscan_objects::ObjectStoreConfig;
pub use error::Error;
use spool::{ReplayOptions, Spool, SpoolMetrics};
use store::CallStore;
use writer::{BatchOptions, Writer};

/// Fully-qualified gRPC service name.
pub const SERVICE_NAME: &str = "ecoscan.v1.AnalyticsService";

/// Brings the database's schema up to date and returns (`ecoscan-analytics migrate`); `serve`
/// does the same at start.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    let store = store::open(&config.database_url)
        .await
        .context("failed to migrate the analytics database")?;
    store.close().await;
    Ok(())
}

/// Serves `ecoscan.v1.AnalyticsService` (with health and reflection) on `listener` until
/// `shutdown` is cancelled; calls accepted before shutdown are committed (or spooled) before it
/// returns.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    config.validate()?;
    let mut embedded = Vec::new();
    if !store::is_postgres(&config.database_url) {
        embedded.push((
            "call rows in SQLite",
            "ANALYTICS_DATABASE_URL or DATABASE_URL to a postgres:// URL",
        ));
    }
    if matches!(config.bodies, ObjectStoreConfig::Local(_)) {
        embedded.push((
            "call bodies in a local directory",
            "S3_ENDPOINT and S3_BUCKET",
        ));
    }
    ecoscan_common::config::require_production_stores("analytics", &embedded)?;
    let store = store::open(&config.database_url)
        .await
        .context("failed to open the analytics database")?;
    let bodies = config
        .bodies
        .open()
        .await
        .context("failed to open the analytics body store")?;
    let result = serve_with_stores(config, store.clone(), bodies, listener, shutdown).await;
    store.close().await;
    result
}

/// Like [`serve`], on stores opened by the caller (`config.database_url` and `config.bodies` are
/// not used): tests wrap the stores to inject failures. Opens the spool (replaying what it holds)
/// and leaves the stores open.
pub async fn serve_with_stores(
    config: Config,
    store: Arc<dyn CallStore>,
    bodies: Arc<dyn ObjectStore>,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    config.validate()?;
    let mut metrics = ecoscan_common::metrics::Metrics::new("analytics");
    let observed = store.clone();
    ecoscan_common::store_health::register_sql(
        &mut metrics,
        store.health(),
        "call reports go to the spool and are written when it answers",
        move || observed.pool_stats(),
    );
    let writer_metrics = writer::WriterMetrics::register(&mut metrics);
    let spool_metrics = SpoolMetrics::register(&mut metrics);
    let spool_dir = config.spool_dir();
    let spool = Arc::new(
        Spool::open(&spool_dir, config.spool_max_bytes, spool_metrics.clone())
            .await
            .with_context(|| {
                format!("failed to open the analytics spool {}", spool_dir.display())
            })?,
    );
    let stop_writer = CancellationToken::new();
    let (writer, writer_task) = Writer::spawn(
        store.clone(),
        bodies.clone(),
        spool.clone(),
        BatchOptions {
            max_rows: config.batch_max_rows,
            linger: config.batch_linger,
            queue_capacity: config.queue_capacity,
            store_timeout: config.store_timeout,
            full_retry_after: config.full_retry_after(),
            max_in_flight: config.batch_in_flight,
        },
        writer_metrics.clone(),
        spool_metrics,
        stop_writer.clone(),
    );
    let stop_replayer = CancellationToken::new();
    let replayer = spool::spawn_replayer(
        spool,
        store.clone(),
        bodies.clone(),
        ReplayOptions {
            store_timeout: config.store_timeout,
            retry_max: config.spool_retry_max,
            max_rows: config.batch_max_rows.max(1000),
        },
        writer_metrics,
        stop_replayer.clone(),
    );
    tracing::info!(
        versions = ?config.prices.versions().collect::<Vec<_>>(),
        models = config.prices.models(),
        "price table loaded (calls of unpriced models are recorded with their cost unknown)"
    );
    let svc = AnalyticsServiceServer::new(
        Analytics::new(store, bodies, writer).with_prices(config.prices.clone()),
    )
    .max_decoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    tracing::info!(spool = %spool_dir.display(), "analytics service ready");
    let result = ecoscan_common::server::serve_with_metrics(
        tonic::service::Routes::new(svc),
        &[SERVICE_NAME],
        metrics,
        listener,
        shutdown,
    )
    .await;
    // In-flight RPCs are done: write (or spool) what the writer still holds, then stop the
    // replayer; what the spool still holds is replayed at the next start.
    stop_writer.cancel();
    if let Err(e) = writer_task.await {
        tracing::error!(error = %e, "analytics writer task failed");
    }
    stop_replayer.cancel();
    if let Err(e) = replayer.await {
        tracing::error!(error = %e, "analytics spool replayer failed");
    }
    result
}
