//! `VisionService`: classifies a photo into the disposal taxonomy. It checks the upload, loads
//! the taxonomy from the rule service (once), asks the LLM, and accepts only answers inside the
//! taxonomy, streaming its progress on the way.

mod error;
mod image;
mod taxonomy;

mod config;
mod service;

pub use config::Config;
use service::{Inner, Vision};

use std::sync::Arc;

use ecoscan_common::CancellationToken;
use ecoscan_llm::Llm;
use ecoscan_proto::v1::vision_service_server::VisionServiceServer;

pub use error::Error;

/// Fully-qualified gRPC service name (health and reflection).
pub const SERVICE_NAME: &str = "ecoscan.v1.VisionService";

/// Serves `VisionService` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut metrics = ecoscan_common::metrics::Metrics::new("vision");
    let llm = Llm::for_service(
        config.llm,
        "vision",
        config.analytics_url.as_deref(),
        &mut metrics,
    )?;
    let vision = Vision {
        inner: Arc::new(Inner {
            llm,
            taxonomy: taxonomy::TaxonomyCache::new(&config.rule_url)?,
        }),
    };
    tracing::info!(
        provider = %vision.inner.llm.provider(),
        rule_url = %config.rule_url,
        "vision service ready"
    );
    let svc = VisionServiceServer::new(vision)
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
