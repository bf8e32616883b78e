//! ingest: owns scan jobs. `Submit` stores the image and the job row, appends the `queued` event
//! and enqueues the job; pipeline workers claim jobs with a lease and run vision → rule → answer →
//! reward, checkpointing each stage on the row so a resumed job starts at its first unfinished
//! stage; `Watch` serves every job's events from one in-process hub.

pub mod admin;
pub mod config;
pub mod error;
pub mod event;
pub mod fetch;
pub mod hub;
pub mod image;
pub mod metrics;
pub mod pipeline;
pub mod service;
pub mod store;
pub mod sweeper;

use std::{sync::Arc, time::Duration};

use anyhow::Context;

use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::{
    scan_admin_service_server::ScanAdminServiceServer, scan_service_server::ScanServiceServer,
};
use tokio::net::TcpListener;

pub use config::Config;
pub use error::Error;

use crate::store::{
    EventLog, JobStore, LocalObjectStore, MemoryEventLog, MemoryQueue, ObjectStore, PgJobStore,
    Queue, RedisEventLog, RedisQueue, S3ObjectStore, SqliteJobStore, postgres::is_postgres_url,
    redis::consumer_name,
};

/// Bytes of recently stored images kept in memory for the vision stage (with S3).
const RECENT_IMAGES_BYTES: usize = 64 * 1024 * 1024;

/// Every store ingest uses.
#[derive(Clone)]
pub struct Stores {
    pub jobs: Arc<dyn JobStore>,
    pub events: Arc<dyn EventLog>,
    pub queue: Arc<dyn Queue>,
    pub objects: Arc<dyn ObjectStore>,
}

impl Stores {
    /// The embedded stores: SQLite rows, a local object directory, in-memory log and queue.
    pub async fn embedded(config: &Config) -> anyhow::Result<Self> {
        Ok(Self {
            jobs: Arc::new(SqliteJobStore::open(&config.database_url).await?),
            events: Arc::new(MemoryEventLog::new(config.event_max_len)),
            queue: Arc::new(MemoryQueue::new()),
            objects: Arc::new(LocalObjectStore::open(&config.object_dir).await?),
        })
    }

    /// The stores `config` selects, each on its own: PostgreSQL job rows for a `postgres://`
    /// database URL (else SQLite), Redis event log and queue with `redis_url` (else in memory),
    /// S3 images with `s3` (else the object directory).
    pub async fn from_config(config: &Config) -> anyhow::Result<Self> {
        let jobs: Arc<dyn JobStore> = if is_postgres_url(&config.database_url) {
            tracing::info!("job rows in postgresql");
            Arc::new(
                PgJobStore::connect(&config.database_url)
                    .await
                    .context("failed to open the postgresql job store")?,
            )
        } else {
            Arc::new(
                SqliteJobStore::open(&config.database_url)
                    .await
                    .with_context(|| format!("failed to open {}", config.database_url))?,
            )
        };
        let (events, queue): (Arc<dyn EventLog>, Arc<dyn Queue>) = match &config.redis {
            Some(settings) => {
                tracing::info!(
                    cluster = settings.cluster,
                    "event log and dispatch queue in redis"
                );
                let consumer = consumer_name();
                let redis =
                    ecoscan_redis::Redis::connect(settings, &format!("ecoscan-ingest:{consumer}"))
                        .await
                        .context("failed to connect to redis (REDIS_URL)")?;
                let prefix = &config.redis_prefix;
                (
                    Arc::new(RedisEventLog::with_settings(
                        &redis,
                        prefix,
                        config.event_max_len,
                        config.feed_shards,
                        config.append_linger,
                    )),
                    Arc::new(RedisQueue::open(&redis, prefix, &consumer).await?),
                )
            }
            None => (
                Arc::new(MemoryEventLog::new(config.event_max_len)),
                Arc::new(MemoryQueue::new()),
            ),
        };
        let objects: Arc<dyn ObjectStore> = match &config.s3 {
            Some(s3) => {
                tracing::info!(bucket = %s3.bucket, "images in s3");
                let s3 = S3ObjectStore::connect(s3.clone())
                    .await
                    .context("failed to open the s3 object store (S3_ENDPOINT)")?;
                // The vision stage reads back, seconds later and usually in this process, the
                // photo intake just wrote: keep recent ones rather than fetch each twice.
                Arc::new(ecoscan_objects::RecentWrites::new(
                    Arc::new(s3),
                    RECENT_IMAGES_BYTES,
                ))
            }
            None => Arc::new(LocalObjectStore::open(&config.object_dir).await?),
        };
        Ok(Self {
            jobs,
            events,
            queue,
            objects,
        })
    }
}

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
    let hub = hub::Hub::start(stores.clone(), config.hub.clone(), shutdown.clone())
        .await
        .context("failed to start the event hub")?;
    let stages = pipeline::StageClients::connect(&config)?;
    let mut metrics = ecoscan_common::metrics::Metrics::new("ingest");
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
    served
}
