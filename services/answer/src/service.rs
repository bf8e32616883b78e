//! The `AnswerService` RPC: compose the prompt from the classification and the rules, stream the
//! model's text as deltas, end with the whole answer.

use std::sync::Arc;

use ecoscan_llm::{AnswerChunk, AnswerInput, Llm, Locale, OfferedModel};
use ecoscan_proto::v1::{
    Answer, GenerateRequest, GenerateResponse, Progress, answer_service_server::AnswerService,
    generate_response,
};
use tokio::sync::mpsc;
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::{compose, error::Error};

pub(crate) struct AnswerSvc {
    pub(crate) llm: Arc<Llm>,
}

type EventSender = mpsc::Sender<Result<GenerateResponse, Status>>;

fn parse_locale(locale: &str) -> Result<Locale, Error> {
    match locale.trim() {
        "" | "ko" => Ok(Locale::Ko),
        "en" => Ok(Locale::En),
        other => Err(Error::UnsupportedLocale(other.to_owned())),
    }
}

/// How long a finished stage waits for its model call's analytics report to be acknowledged
/// before it answers (see `ecoscan_llm::AnalyticsReporter::settled`).
const REPORT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

#[tonic::async_trait]
impl AnswerService for AnswerSvc {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    #[tracing::instrument(skip_all, fields(job.id = %req.get_ref().job_id, answer.locale = %req.get_ref().locale))]
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
        let model = self.llm.choose_model(&req.model).map_err(Error::from)?;
        let (tx, rx) = mpsc::channel(16);
        let llm = self.llm.clone();
        tokio::spawn(
            async move {
                let work = Work {
                    job_id: req.job_id,
                    locale,
                    classification,
                    rules,
                    model,
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
    model: Option<OfferedModel>,
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
        model,
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
        model,
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
                // The call's analytics report leaves this process before the answer does.
                if !llm.reports_settled(REPORT_WAIT).await {
                    tracing::warn!(
                        "analytics has not acknowledged the call's report yet; answering anyway, the report is retried in the background"
                    );
                }
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
