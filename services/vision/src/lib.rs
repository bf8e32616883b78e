//! `VisionService`: classifies a photo into the disposal taxonomy. It checks the upload, loads
//! the taxonomy from the rule service (once), asks the LLM, and accepts only answers inside the
//! taxonomy, streaming its progress on the way.

mod error;
mod image;
mod taxonomy;

use std::sync::Arc;

use bytes::Bytes;
use ecoscan_common::CancellationToken;
use ecoscan_llm::{AnalyticsReporter, ClassifyInput, Llm, LlmConfig, TaxonomyPath};
use ecoscan_proto::v1::{
    Classification, ClassifyRequest, ClassifyResponse, Progress, classify_response,
    vision_service_server::{VisionService, VisionServiceServer},
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub use error::Error;

/// Fully-qualified gRPC service name (health and reflection).
pub const SERVICE_NAME: &str = "ecoscan.v1.VisionService";

/// Vision service settings.
///
/// Environment variables (defaults in brackets):
/// - `VISION_ADDR` — listen address of the `ecoscan-vision` binary [127.0.0.1:50052]
/// - `RULE_URL` — rule service, source of the taxonomy [http://127.0.0.1:50053]
/// - `ANALYTICS_URL` — where model calls are reported [http://127.0.0.1:50056]; set it empty to
///   disable reporting
/// - the `LLM_*` variables of [`ecoscan_llm::LlmConfig`]
#[derive(Clone, Debug)]
pub struct Config {
    pub rule_url: String,
    pub analytics_url: Option<String>,
    pub llm: LlmConfig,
}

impl Config {
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            rule_url: ecoscan_common::config::env_opt("RULE_URL")
                .unwrap_or_else(|| "http://127.0.0.1:50053".to_owned()),
            analytics_url: ecoscan_llm::analytics_url_from_env(),
            llm: LlmConfig::from_env()?,
        })
    }
}

/// Serves `VisionService` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let reporter = config
        .analytics_url
        .as_deref()
        .map(AnalyticsReporter::new)
        .transpose()?;
    let mut metrics = ecoscan_common::metrics::Metrics::new("vision");
    let llm_metrics = ecoscan_llm::LlmMetrics::register(&mut metrics, reporter.as_ref());
    let llm = Llm::new(config.llm, "vision", reporter)?.with_metrics(llm_metrics);
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

#[derive(Clone)]
struct Vision {
    inner: Arc<Inner>,
}

struct Inner {
    llm: Llm,
    taxonomy: taxonomy::TaxonomyCache,
}

type EventSender = mpsc::Sender<Result<ClassifyResponse, Status>>;

#[tonic::async_trait]
impl VisionService for Vision {
    type ClassifyStream = ReceiverStream<Result<ClassifyResponse, Status>>;

    #[tracing::instrument(skip_all, fields(job.id = %req.get_ref().job_id, image.bytes = req.get_ref().image.len()))]
    async fn classify(
        &self,
        req: Request<ClassifyRequest>,
    ) -> Result<Response<Self::ClassifyStream>, Status> {
        let req = req.into_inner();
        // Bad input is refused before a stream opens: nothing is called, nothing is reported.
        let image_type = image::check(&req.image, &req.content_type)?;
        let (tx, rx) = mpsc::channel(16);
        let inner = self.inner.clone();
        tokio::spawn(
            async move {
                if let Err(e) = run(&inner, req, image_type, &tx).await {
                    let _ = tx.send(Err(e.into())).await;
                }
            }
            .in_current_span(),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

async fn progress(tx: &EventSender, step: &str, fraction: f32, message: &str) {
    tracing::info!(step, fraction, "progress");
    let _ = tx
        .send(Ok(ClassifyResponse {
            event: Some(classify_response::Event::Progress(Progress {
                step: step.to_owned(),
                fraction,
                message: message.to_owned(),
            })),
        }))
        .await;
}

async fn run(
    inner: &Inner,
    req: ClassifyRequest,
    image_type: &'static str,
    tx: &EventSender,
) -> Result<(), Error> {
    let size = req.image.len();
    progress(
        tx,
        "validate_image",
        0.1,
        &format!("{image_type} image, {size} bytes"),
    )
    .await;

    progress(tx, "load_taxonomy", 0.2, "loading the taxonomy").await;
    let taxonomy = inner.taxonomy.get().await?;

    progress(tx, "model_call", 0.3, "asking the model").await;
    let output = inner
        .llm
        .classify(ClassifyInput {
            job_id: req.job_id,
            image: Bytes::from(req.image),
            content_type: image_type.to_owned(),
            hint: req.hint,
            taxonomy: taxonomy.paths.clone(),
            situation_tags: taxonomy.situation_tags.clone(),
        })
        .await?;

    progress(
        tx,
        "validate_output",
        0.9,
        "checking the answer against the taxonomy",
    )
    .await;
    if !taxonomy.contains(&output.major, &output.middle, &output.minor) {
        return Err(Error::OutsideTaxonomy(TaxonomyPath::display(
            &output.major,
            &output.middle,
            &output.minor,
        )));
    }
    let (situation_tags, unknown): (Vec<String>, Vec<String>) = output
        .situation_tags
        .into_iter()
        .partition(|t| taxonomy.has_tag(t));
    if !unknown.is_empty() {
        tracing::warn!(
            ?unknown,
            "model answered situation tags outside the vocabulary, dropped"
        );
    }
    let classification = Classification {
        major_category: output.major,
        middle_category: output.middle,
        minor_category: output.minor,
        item_name: output.item_name,
        confidence: output.confidence,
        situation_tags,
        provider: output.provider,
        model: output.model,
    };
    tracing::info!(
        major = %classification.major_category,
        middle = %classification.middle_category,
        minor = %classification.minor_category,
        provider = %classification.provider,
        "classified"
    );
    let _ = tx
        .send(Ok(ClassifyResponse {
            event: Some(classify_response::Event::Classification(classification)),
        }))
        .await;
    Ok(())
}
