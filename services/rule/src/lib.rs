//! The rule service: the disposal-rule dataset (Korean separate-collection rules in Korean and
//! English) and `ecoscan.v1.RuleService`, which resolves a classification into the rules that
//! apply and the advice its situation tags call for.

mod config;
mod dataset;
mod error;
mod service;

use std::sync::Arc;

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::rule_service_server::RuleServiceServer;
use tokio::net::TcpListener;

pub use config::Config;
pub use dataset::{Dataset, Locale, Resolved, Rules};
pub use error::Error;
pub use service::RuleApi;

/// Fully-qualified gRPC service name, as reported by health and reflection.
pub const SERVICE_NAME: &str = "ecoscan.v1.RuleService";

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
