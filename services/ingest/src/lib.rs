//! ingest: owns scan jobs. `Submit` stores the image and the job row, appends the `queued` event
//! and enqueues the job; pipeline workers claim jobs with a lease and run vision → rule → answer →
//! reward, checkpointing each stage on the row so a resumed job starts at its first unfinished
//! stage; `Watch` serves every job's events from one in-process hub.

pub mod admin;
mod allowlist;
pub mod config;
pub mod dead_letters;
pub mod error;
pub mod event;
pub mod fetch;
pub mod hub;
pub mod image;
pub mod metrics;
pub mod pending;
pub mod pipeline;
pub mod retry_policy;
pub mod service;
pub mod store;
pub mod sweeper;
pub mod uploads;

use std::time::Duration;

use anyhow::Context;

use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::{
    scan_admin_service_server::ScanAdminServiceServer, scan_service_server::ScanServiceServer,
};
use tokio::net::TcpListener;

pub use config::Config;
pub use error::Error;
pub use store::Stores;

use crate::store::{PgJobStore, SqliteJobStore, postgres::is_postgres_url};

/// Applies the job store's migrations (PostgreSQL; SQLite's schema is created the same way)
/// and returns: `ecoscan-ingest migrate`.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    if is_postgres_url(&config.database_url) {
        PgJobStore::connect(&config.database_url)
            .await
            .context("failed to migrate the postgresql job store")?
            .close()
            .await;
    } else {
        SqliteJobStore::open(&config.database_url)
            .await
            .with_context(|| format!("failed to migrate {}", config.database_url))?;
    }
    Ok(())
}

/// Serves `ScanService` and runs the pipeline workers on the stores `config` selects (see
/// [`Stores::from_config`]) until `shutdown`.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut embedded = Vec::new();
    if !is_postgres_url(&config.database_url) {
        embedded.push((
            "job rows in SQLite",
            "INGEST_DATABASE_URL or DATABASE_URL to a postgres:// URL",
        ));
    }
    if config.redis.is_none() {
        embedded.push(("the event log and queue in memory", "REDIS_URL"));
    }
    if config.s3.is_none() {
        embedded.push(("images in a local directory", "S3_ENDPOINT and S3_BUCKET"));
    }
    ecoscan_common::config::require_production_stores("ingest", &embedded)?;
    let stores = Stores::from_config(&config).await?;
    serve_with(config, stores, listener, shutdown).await
}

/// Serves with the given stores (the suite and tests choose them).
pub async fn serve_with(
    config: Config,
    stores: Stores,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let hub_config = hub::HubConfig {
        event_ttl: config.event_ttl,
        ..config.hub.clone()
    };
    let hub = hub::Hub::start(stores.clone(), hub_config, shutdown.clone())
        .await
        .context("failed to start the event hub")?;
    let stages = pipeline::StageClients::connect(&config)?;
    let mut metrics = ecoscan_common::metrics::Metrics::new("ingest");
    let healths = stores.healths();
    for health in &healths {
        health.set_waiting(
            "new scans and watches are refused with UNAVAILABLE until it answers; running \
             scans and open watches wait for it",
        );
    }
    let jobs = stores.jobs.clone();
    let pools: Vec<(&'static str, ecoscan_common::store_health::PoolReader)> =
        match jobs.pool_stats() {
            Some(_) => vec![(
                "postgres",
                Box::new(move || jobs.pool_stats().unwrap_or_default()),
            )],
            None => Vec::new(),
        };
    ecoscan_common::store_health::register(&mut metrics, &healths, pools);
    let ingest_metrics =
        metrics::IngestMetrics::register(&mut metrics, stores.queue.clone(), hub.clone());
    let workers = pipeline::spawn_workers(
        &config,
        stores.clone(),
        stages,
        ingest_metrics.clone(),
        shutdown.clone(),
    );
    let sweeper = sweeper::spawn(
        stores.clone(),
        config.sweep_interval,
        config.sweep_grace,
        shutdown.clone(),
    );
    let retries = dead_letters::spawn(
        stores.clone(),
        ingest_metrics.clone(),
        config.dead_letter_retry.clone(),
        config.dead_letter_interval,
        shutdown.clone(),
    );
    let upload_sweep = uploads::spawn_sweep(
        stores.clone(),
        ingest_metrics.clone(),
        config.sweep_interval,
        shutdown.clone(),
    );
    let admin = admin::AdminApi::new(stores.clone(), ingest_metrics.clone());
    let api = service::ScanApi::new(config, stores, hub, ingest_metrics, shutdown.clone());
    let server = ScanServiceServer::new(api)
        .max_decoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    let served = ecoscan_common::server::serve_with_metrics(
        tonic::service::Routes::new(server).add_service(ScanAdminServiceServer::new(admin)),
        &["ecoscan.v1.ScanService", "ecoscan.v1.ScanAdminService"],
        metrics,
        listener,
        shutdown,
    )
    .await;
    // Let in-flight jobs finish their current stage; anything left is handed back to the
    // queue, and another process resumes it from its last checkpoint.
    let release = workers.releaser();
    if tokio::time::timeout(Duration::from_secs(10), workers.wait())
        .await
        .is_err()
    {
        let released = release.await;
        tracing::warn!(
            released,
            "pipeline workers still busy after 10 s; their jobs were handed back to the queue"
        );
    }
    sweeper.abort();
    upload_sweep.abort();
    if let Some(retries) = retries {
        retries.abort();
    }
    served
}
