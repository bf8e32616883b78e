//! `AnswerService`: writes the disposal instructions for the person. It composes the prompt
//! from the classification and the rules, streams the model's text as deltas, and ends with
//! the whole answer: ordered steps, a short message, the text, and who wrote it.

mod compose;
mod error;

mod config;
mod service;

pub use config::Config;
use service::AnswerSvc;

use std::sync::Arc;

use ecoscan_common::CancellationToken;
use ecoscan_llm::Llm;
use ecoscan_proto::v1::answer_service_server::AnswerServiceServer;

pub use error::Error;

/// Fully-qualified gRPC service name (health and reflection).
pub const SERVICE_NAME: &str = "ecoscan.v1.AnswerService";

/// Serves `AnswerService` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut metrics = ecoscan_common::metrics::Metrics::new("answer");
    let llm = Llm::for_service(
        config.llm,
        "answer",
        config.analytics_url.as_deref(),
        &mut metrics,
    )?;
    tracing::info!(provider = %llm.provider(), "answer service ready");
    let svc = AnswerServiceServer::new(AnswerSvc { llm: Arc::new(llm) })
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
