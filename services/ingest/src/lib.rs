//! ingest: owns scan jobs. `Submit` stores the image and the job row, appends the `queued` event
//! and enqueues the job; pipeline workers claim jobs with a lease and run vision → rule → answer →
//! reward, checkpointing each stage on the row so a resumed job starts at its first unfinished
//! stage; `Watch` serves every job's events from one in-process hub.

pub mod config;
pub mod error;
pub mod hub;
pub mod image;
pub mod pipeline;
pub mod service;
pub mod store;

use std::{sync::Arc, time::Duration};

use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::scan_service_server::ScanServiceServer;
use tokio::net::TcpListener;

pub use config::Config;
pub use error::Error;

use crate::store::{
    EventLog, JobStore, LocalObjectStore, MemoryEventLog, MemoryQueue, ObjectStore, Queue,
    SqliteJobStore,
};

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
            events: Arc::new(MemoryEventLog::new(2048)),
            queue: Arc::new(MemoryQueue::new()),
            objects: Arc::new(LocalObjectStore::open(&config.object_dir).await?),
        })
    }
}

/// Serves `ScanService` and runs the pipeline workers on the embedded stores until `shutdown`.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let stores = Stores::embedded(&config).await?;
    serve_with(config, stores, listener, shutdown).await
}

/// Serves with the given stores (the suite and tests choose them).
pub async fn serve_with(
    config: Config,
    stores: Stores,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let hub = hub::Hub::start(stores.events.clone(), shutdown.clone());
    let stages = pipeline::StageClients::connect(&config)?;
    let workers = pipeline::spawn_workers(&config, stores.clone(), stages, shutdown.clone());
    let api = service::ScanApi::new(config, stores, hub, shutdown.clone());
    let server = ScanServiceServer::new(api)
        .max_decoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    let served = ecoscan_common::server::serve(
        tonic::service::Routes::new(server),
        &["ecoscan.v1.ScanService"],
        listener,
        shutdown,
    )
    .await;
    // Let in-flight jobs finish their current stage; anything left is re-run from its last
    // checkpoint by the next process (its lease runs out).
    if tokio::time::timeout(Duration::from_secs(10), workers.wait())
        .await
        .is_err()
    {
        tracing::warn!("pipeline workers still busy after 10 s; leaving their jobs to the lease");
    }
    served
}
