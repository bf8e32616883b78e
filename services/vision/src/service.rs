//! The `VisionService` RPC: check the photo, load the taxonomy, ask the model, keep only answers
//! inside the taxonomy, streaming progress on the way.

use std::sync::Arc;

use bytes::Bytes;
use ecoscan_llm::{ClassifyInput, Llm, OfferedModel, TaxonomyPath};
use ecoscan_proto::v1::{
    Classification, ClassifyRequest, ClassifyResponse, Progress, classify_response,
    vision_service_server::VisionService,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::{error::Error, image, taxonomy::TaxonomyCache};

/// How long a classification waits for its model call's analytics report to be acknowledged
/// before it answers (see `ecoscan_llm::AnalyticsReporter::settled`).
const REPORT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

#[derive(Clone)]
pub(crate) struct Vision {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) llm: Llm,
    pub(crate) taxonomy: TaxonomyCache,
}

type EventSender = mpsc::Sender<Result<ClassifyResponse, Status>>;

#[tonic::async_trait]
impl VisionService for Vision {
    type ClassifyStream = ReceiverStream<Result<ClassifyResponse, Status>>;

    #[tracing::instrument(skip_all, fields(job.id = %req.get_ref().job_id, vision.image.bytes = req.get_ref().image.len()))]
    async fn classify(
        &self,
        req: Request<ClassifyRequest>,
    ) -> Result<Response<Self::ClassifyStream>, Status> {
        let req = req.into_inner();
        // Bad input is refused before a stream opens: nothing is called, nothing is reported.
        let image_type = image::check(&req.image, &req.content_type)?;
        let model = self
            .inner
            .llm
            .choose_model(&req.model)
            .map_err(Error::from)?;
        let (tx, rx) = mpsc::channel(16);
        let inner = self.inner.clone();
        tokio::spawn(
            async move {
                if let Err(e) = run(&inner, req, image_type, model, &tx).await {
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
    model: Option<OfferedModel>,
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
            model,
        })
        .await?;

    // The call's analytics report leaves this process before the classification does.
    if !inner.llm.reports_settled(REPORT_WAIT).await {
        tracing::warn!(
            "analytics has not acknowledged the call's report yet; answering anyway, the report is retried in the background"
        );
    }
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
