//! The rule service: the disposal-rule dataset (Korean separate-collection rules in Korean and
//! English) and `ecoscan.v1.RuleService`, which resolves a classification into the rules that
//! apply and the advice its situation tags call for.

mod dataset;
mod error;
mod service;

use std::{path::PathBuf, sync::Arc};

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::rule_service_server::RuleServiceServer;
use tokio::net::TcpListener;

pub use dataset::{Dataset, Locale, Resolved, Rules};
pub use error::Error;
pub use service::RuleApi;

/// Fully-qualified gRPC service name, as reported by health and reflection.
pub const SERVICE_NAME: &str = "ecoscan.v1.RuleService";

/// Configuration of the rule service.
///
/// Environment variables:
/// - `RULE_DATASET_PATH` (optional, unset by default): a JSON file in the schema of the embedded
///   `data/rules.json` to use instead of it; validated the same way, and a failure stops startup.
///
/// The binary also reads `RULE_ADDR` (default `127.0.0.1:50053`) for its listen address.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Alternative dataset file; `None` uses the dataset compiled into the binary.
    pub dataset_path: Option<PathBuf>,
}

impl Config {
    /// Reads the configuration from the environment (see the type's documentation).
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            dataset_path: ecoscan_common::config::env_opt("RULE_DATASET_PATH").map(PathBuf::from),
        })
    }

    /// Loads and validates the configured dataset.
    pub async fn load_dataset(&self) -> Result<Dataset, Error> {
        match &self.dataset_path {
            Some(path) => Dataset::load(path).await,
            None => Dataset::embedded(),
        }
    }
}

/// Loads the dataset, then serves `ecoscan.v1.RuleService` (with health and reflection) on
/// `listener` until `shutdown` is cancelled. An invalid dataset is an error before serving.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let dataset = config
        .load_dataset()
        .await
        .context("failed to load the rule dataset")?;
    tracing::info!(
        dataset = %dataset.id(),
        categories = dataset.categories().len(),
        situation_tags = dataset.situation_tags().len(),
        path = ?config.dataset_path,
        "rule dataset loaded"
    );
    let mut metrics = ecoscan_common::metrics::Metrics::new("rule");
    let api = RuleApi::new(Arc::new(dataset)).with_metrics(&mut metrics);
    let svc = RuleServiceServer::new(api)
        .max_decoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    ecoscan_common::server::serve_with_metrics(
        tonic::service::Routes::new(svc),
        &[SERVICE_NAME],
        metrics,
        listener,
        shutdown,
    )
    .await
}
