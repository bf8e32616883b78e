//! `ecoscan.v1.RewardService`: the character catalogue and who owns what. A scan of a recyclable
//! item earns the character of its middle category, once per user; every decision is idempotent
//! per job.

pub mod catalogue;
mod error;
pub mod store;

mod config;
mod service;

pub use config::{Config, DEFAULT_DATABASE_URL};
pub use service::Reward;

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::reward_service_server::RewardServiceServer;
use tokio::net::TcpListener;

pub use catalogue::Catalogue;
pub use error::Error;

/// Fully-qualified gRPC service name.
pub const SERVICE_NAME: &str = "ecoscan.v1.RewardService";

/// Brings the database's schema up to date and returns (`ecoscan-reward migrate`); `serve` does
/// the same at start.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    let store = store::open(&config.database_url)
        .await
        .context("failed to migrate the reward database")?;
    store.close().await;
    Ok(())
}

/// Serves `ecoscan.v1.RewardService` (with health and reflection) on `listener` until `shutdown`
/// is cancelled.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    if !store::is_postgres(&config.database_url) {
        ecoscan_common::config::require_production_stores(
            "reward",
            &[(
                "grants in SQLite",
                "REWARD_DATABASE_URL or DATABASE_URL to a postgres:// URL",
            )],
        )?;
    }
    let catalogue = Catalogue::embedded()?;
    let store = store::open(&config.database_url)
        .await
        .context("failed to open the reward database")?;
    tracing::info!(characters = catalogue.len(), "reward service ready");
    let mut metrics = ecoscan_common::metrics::Metrics::new("reward");
    let observed = store.clone();
    ecoscan_common::store_health::register_sql(
        &mut metrics,
        store.health(),
        "evaluations fail with UNAVAILABLE; running scans retry their reward stage",
        move || observed.pool_stats(),
    );
    let reward = Reward::new(catalogue, store.clone()).with_metrics(&mut metrics);
    let svc = RewardServiceServer::new(reward)
        .max_decoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    let result = ecoscan_common::server::serve_with_metrics(
        tonic::service::Routes::new(svc),
        &[SERVICE_NAME],
        metrics,
        listener,
        shutdown,
    )
    .await;
    store.close().await;
    result
}
