//! One streamed answer, read to its true end. The text is complete when the server names a
//! `finish_reason` or sends `[DONE]`; a stream that stops with neither was cut (a proxy or the
//! server went away) and fails as a retryable transport error that says so. A stream that
//! fails before its first delta is sent again within the call's retry budget; once a delta has
//! gone to the caller it never is (the caller has shown the text).

use std::{sync::Arc, time::Duration};

use futures::StreamExt as _;
use serde_json::Value;

use super::{Admitted, Budget, OpenAi, stream::SseEvent};
use crate::{AnswerChunk, AnswerUsage, CallLog, ChunkSender, Failure, Llm, LlmError};

/// An answer whose request the provider accepted, with what a resend needs.
pub(crate) struct Started {
    pub admitted: Admitted,
    pub budget: Budget,
    pub body: Value,
    pub estimate: u32,
}

/// How one attempt at reading the stream ended.
enum Read {
    Complete,
    /// The caller stopped reading.
    Cancelled,
    Failed(LlmError),
}

pub(crate) async fn answer_task(
    llm: Llm,
    provider: Arc<OpenAi>,
    started: Started,
    mut log: CallLog,
    tx: ChunkSender,
) {
    let Started {
        admitted,
        mut budget,
        body,
        estimate,
    } = started;
    let mut text = String::new();
    let mut admitted = Some(admitted);
    let outcome = loop {
        let Some(current) = admitted.take() else {
            break Read::Failed(LlmError::Transport("no response to read".into()));
        };
        match read(current, provider.timeout(), &mut text, &mut log, &tx).await {
            Read::Failed(e) if text.is_empty() && e.is_retryable() => {
                // Nothing reached the caller yet: this attempt can be replaced.
                let wait = match budget.next_wait(e, None) {
                    Ok(wait) => wait,
                    Err(exhausted) => break Read::Failed(exhausted),
                };
                tokio::time::sleep(wait).await;
                match provider.send(&body, estimate, &mut budget).await {
                    Ok(next) => admitted = Some(next),
                    Err(e) => break Read::Failed(e),
                }
            }
            other => break other,
        }
    };
    log.response_body = text;
    match outcome {
        Read::Complete => {
            let usage = AnswerUsage {
                provider: log.system.clone(),
                model: log.model.clone(),
                input_tokens: log.input_tokens,
                output_tokens: log.output_tokens,
                ttft: log.ttft,
            };
            llm.finish(log, None);
            let _ = tx.send(Ok(AnswerChunk::Done(usage))).await;
        }
        Read::Cancelled => llm.finish(log, Some(Failure::cancelled())),
        Read::Failed(e) => {
            llm.finish(log, Some(Failure::from(&e)));
            let _ = tx.send(Err(e)).await;
        }
    }
}

/// How long a stream may stay open after its `finish_reason` (for the usage chunk and
/// `[DONE]`) before the answer counts as complete without them.
const AFTER_FINISH: Duration = Duration::from_secs(2);

/// Reads one response's stream, passing deltas on as they come.
async fn read(
    admitted: Admitted,
    timeout: Duration,
    text: &mut String,
    log: &mut CallLog,
    tx: &ChunkSender,
) -> Read {
    // Held until the stream ends: a streaming call occupies a provider slot throughout.
    let Admitted { response, permit } = admitted;
    let _permit = permit;
    let mut events = super::stream::sse_events(response.bytes_stream(), timeout);
    let mut finished: Option<String> = None;
    loop {
        let next = match finished {
            None => events.next().await,
            // After `finish_reason` only the usage chunk and `[DONE]` are to come: a server
            // that keeps the stream open without them has still answered, within a moment.
            Some(_) => match tokio::time::timeout(AFTER_FINISH, events.next()).await {
                Ok(next) => next,
                Err(_) => {
                    tracing::warn!(
                        "answer stream stayed open after its finish_reason; the text is complete"
                    );
                    return Read::Complete;
                }
            },
        };
        let batch = match next {
            Some(Ok(batch)) => batch,
            // After `finish_reason` the text is whole; only the usage chunk and `[DONE]` were
            // still to come, and a server that breaks off there has still answered.
            Some(Err(e)) if finished.is_some() => {
                tracing::warn!(error = %e, "answer stream failed after its finish_reason; the text is complete");
                return Read::Complete;
            }
            Some(Err(e)) => return Read::Failed(e),
            None if finished.is_some() => return Read::Complete,
            None => return Read::Failed(cut(text)),
        };
        for event in batch {
            match event {
                SseEvent::Delta(delta) => {
                    if log.ttft.is_none() {
                        log.ttft = Some(log.started.elapsed());
                    }
                    text.push_str(&delta);
                    if tx.send(Ok(AnswerChunk::Delta(delta))).await.is_err() {
                        return Read::Cancelled;
                    }
                }
                SseEvent::Usage {
                    model,
                    usage_in,
                    usage_out,
                    usage_cached,
                } => {
                    if !model.is_empty() {
                        log.model = model;
                    }
                    log.input_tokens = usage_in;
                    log.output_tokens = usage_out;
                    log.cached_input_tokens = usage_cached;
                }
                SseEvent::Finish(reason) => {
                    if reason != "stop" {
                        tracing::warn!(finish_reason = %reason, "the model stopped before the end of its answer");
                    }
                    finished = Some(reason);
                }
                SseEvent::Done => return Read::Complete,
                SseEvent::Nothing => {}
            }
        }
    }
}

/// The failure of a stream that ended with neither `finish_reason` nor `[DONE]`.
fn cut(text: &str) -> LlmError {
    if text.is_empty() {
        LlmError::Interrupted("it ended before any text, without finish_reason or [DONE]".into())
    } else {
        LlmError::Interrupted(format!(
            "it ended after {} characters of text, without finish_reason or [DONE]",
            text.chars().count()
        ))
    }
}
