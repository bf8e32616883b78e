//! `AnswerService`: writes the disposal instructions for the person. It composes the prompt
//! from the classification and the rules, streams the model's text as deltas, and ends with
//! the whole answer: ordered steps, a short message, the text, and who wrote it.

mod compose;
mod error;

use std::sync::Arc;

use ecoscan_common::CancellationToken;
use ecoscan_llm::{AnalyticsReporter, AnswerChunk, AnswerInput, Llm, LlmConfig, Locale};
use ecoscan_proto::v1::{
    Answer, GenerateRequest, GenerateResponse, Progress,
    answer_service_server::{AnswerService, AnswerServiceServer},
    generate_response,
};
use tokio::sync::mpsc;
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub use error::Error;

/// Fully-qualified gRPC service name (health and reflection).
pub const SERVICE_NAME: &str = "ecoscan.v1.AnswerService";

/// Answer service settings.
///
/// Environment variables (defaults in brackets):
/// - `ANSWER_ADDR` — listen address of the `ecoscan-answer` binary [127.0.0.1:50054]
/// - `ANALYTICS_URL` — where model calls are reported [http://127.0.0.1:50056]; set it empty to
///   disable reporting
/// - the `LLM_*` variables of [`ecoscan_llm::LlmConfig`]
#[derive(Clone, Debug)]
pub struct Config {
    pub analytics_url: Option<String>,
    pub llm: LlmConfig,
}

impl Config {
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            analytics_url: ecoscan_llm::analytics_url_from_env(),
            llm: LlmConfig::from_env()?,
        })
    }
}

/// Serves `AnswerService` on `listener` until `shutdown` is cancelled.
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
    let mut metrics = ecoscan_common::metrics::Metrics::new("answer");
    let llm_metrics = ecoscan_llm::LlmMetrics::register(&mut metrics, reporter.as_ref());
    let llm = Llm::new(config.llm, "answer", reporter)?.with_metrics(llm_metrics);
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

struct AnswerSvc {
    llm: Arc<Llm>,
}

type EventSender = mpsc::Sender<Result<GenerateResponse, Status>>;

fn parse_locale(locale: &str) -> Result<Locale, Error> {
    match locale.trim() {
        "" | "ko" => Ok(Locale::Ko),
        "en" => Ok(Locale::En),
        other => Err(Error::UnsupportedLocale(other.to_owned())),
    }
}

#[tonic::async_trait]
impl AnswerService for AnswerSvc {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    #[tracing::instrument(skip_all, fields(job.id = %req.get_ref().job_id, locale = %req.get_ref().locale))]
    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let req = req.into_inner();
        // Bad input is refused before a stream opens: no model call, nothing reported.
        let classification = req.classification.ok_or(Error::MissingClassification)?;
        let rules = req.rules.ok_or(Error::MissingRules)?;
        let locale = parse_locale(&req.locale)?;
        if classification.major_category.trim().is_empty() {
            return Err(Error::NoCategory.into());
        }
        let (tx, rx) = mpsc::channel(16);
        let llm = self.llm.clone();
        tokio::spawn(
            async move {
                let work = Work {
                    job_id: req.job_id,
                    locale,
                    classification,
                    rules,
                };
                if let Err(e) = run(&llm, work, &tx).await {
                    let _ = tx.send(Err(e.into())).await;
                }
            }
            .in_current_span(),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Work {
    job_id: String,
    locale: Locale,
    classification: ecoscan_proto::v1::Classification,
    rules: ecoscan_proto::v1::DisposalRules,
}

async fn send(tx: &EventSender, event: generate_response::Event) -> bool {
    tx.send(Ok(GenerateResponse { event: Some(event) }))
        .await
        .is_ok()
}

async fn run(llm: &Llm, work: Work, tx: &EventSender) -> Result<(), Error> {
    let Work {
        job_id,
        locale,
        classification,
        rules,
    } = work;
    tracing::info!(step = "compose_prompt", "progress");
    send(
        tx,
        generate_response::Event::Progress(Progress {
            step: "compose_prompt".into(),
            fraction: 0.1,
            message: "writing the prompt from the rules".into(),
        }),
    )
    .await;
    let subject = compose::subject(&classification).to_owned();
    let rule_steps = compose::steps(&rules);
    let input = AnswerInput {
        job_id,
        locale,
        system_prompt: compose::system_prompt(locale).to_owned(),
        user_prompt: compose::user_prompt(&classification, &rules, &subject),
        subject: subject.clone(),
        steps: rule_steps.clone(),
    };

    let mut stream = llm.answer(input).await?;
    let mut text = String::new();
    let mut deltas = 0u32;
    while let Some(chunk) = stream.next().await {
        match chunk? {
            AnswerChunk::Delta(delta) => {
                deltas += 1;
                text.push_str(&delta);
                tracing::debug!(delta_bytes = delta.len(), "delta");
                if !send(tx, generate_response::Event::Delta(delta)).await {
                    // The caller went away; dropping the model stream cancels the call.
                    tracing::info!("caller closed the stream, stopping the answer");
                    return Ok(());
                }
            }
            AnswerChunk::Done(usage) => {
                let steps = if rule_steps.is_empty() {
                    compose::steps_from_text(&text)
                } else {
                    rule_steps
                };
                let mut message = compose::message(locale, &subject, &rules);
                if usage.provider == ecoscan_llm::Provider::Mock.as_str() {
                    // Nothing the mock produced may pass for a real model's words.
                    message.insert_str(0, ecoscan_llm::mock_marker(locale));
                }
                tracing::info!(
                    deltas,
                    text_bytes = text.len(),
                    provider = %usage.provider,
                    "answer written"
                );
                send(
                    tx,
                    generate_response::Event::Answer(Answer {
                        locale: locale.as_str().to_owned(),
                        steps,
                        message,
                        text,
                        provider: usage.provider,
                        model: usage.model,
                    }),
                )
                .await;
                return Ok(());
            }
        }
    }
    Err(Error::Truncated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_locale_means_korean_and_others_are_refused() {
        assert_eq!(parse_locale("").unwrap(), Locale::Ko);
        assert_eq!(parse_locale("en").unwrap(), Locale::En);
        assert!(matches!(
            parse_locale("fr"),
            Err(Error::UnsupportedLocale(_))
        ));
    }
}
