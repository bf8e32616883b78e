//! A streamed completion's events. A stream is complete when a choice names its
//! `finish_reason` or the server sends `data: [DONE]` (servers differ: some end with one, some
//! with the other, LiteLLM and OpenAI with both); the usage chunk, asked for with
//! `stream_options`, comes between the two. An error object inside the stream (vLLM sends
//! `data: {"error": {…, "code": 500}}` when generation fails after the 200) is mapped by its
//! code like an HTTP status.

use std::time::Duration;

use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::Value;

use super::{MAX_ERROR_BODY, error_chain, structured::Usage, truncate};
use crate::LlmError;

/// What one SSE `data:` line said.
#[derive(Debug, PartialEq)]
pub(crate) enum SseEvent {
    Delta(String),
    Usage {
        model: String,
        usage_in: u32,
        usage_out: u32,
        /// Of `usage_in`, those read from the prompt cache.
        usage_cached: u32,
    },
    /// A choice ended, and why (`stop`, `length`, `content_filter`, …).
    Finish(String),
    Done,
    Nothing,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    model: String,
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    delta: Option<Delta>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
}

/// The parsed `data:` payloads of a streamed completion. `eventsource-stream` does the SSE
/// framing (events split across chunks, `\r\n`, comments and other fields, multi-line data);
/// `timeout` bounds the wait for each chunk of the body, comments included, so a provider's
/// keep-alive comments keep a slow stream alive.
pub(crate) fn sse_events<S>(
    body: S,
    timeout: Duration,
) -> impl futures::Stream<Item = Result<Vec<SseEvent>, LlmError>> + Unpin + Send
where
    S: futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin + Send + 'static,
{
    use eventsource_stream::{EventStreamError, Eventsource as _};
    let chunks = futures::stream::unfold(body, move |mut body| async move {
        match next_chunk(&mut body, timeout).await {
            Ok(Some(chunk)) => Some((Ok(chunk), body)),
            Ok(None) => None,
            Err(e) => Some((Err(e), body)),
        }
    });
    Box::pin(chunks).eventsource().map(|item| match item {
        Ok(event) => parse_data(event.data.trim()),
        Err(EventStreamError::Transport(e)) => Err(e),
        Err(EventStreamError::Utf8(_)) => Err(LlmError::Malformed("stream is not utf-8".into())),
        Err(EventStreamError::Parser(e)) => {
            Err(LlmError::Malformed(format!("stream is not valid SSE: {e}")))
        }
    })
}

fn parse_data(data: &str) -> Result<Vec<SseEvent>, LlmError> {
    if data == "[DONE]" {
        return Ok(vec![SseEvent::Done]);
    }
    let value: Value = serde_json::from_str(data)
        .map_err(|e| LlmError::Malformed(format!("stream chunk is not json: {e}")))?;
    if let Some(error) = value.get("error").filter(|e| !e.is_null()) {
        return Err(in_stream_error(error));
    }
    let chunk: Chunk = serde_json::from_value(value)
        .map_err(|e| LlmError::Malformed(format!("stream chunk is not a completion chunk: {e}")))?;
    let mut events = Vec::new();
    for choice in chunk.choices {
        if let Some(text) = choice
            .delta
            .and_then(|d| d.content)
            .filter(|t| !t.is_empty())
        {
            events.push(SseEvent::Delta(text));
        }
        if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
            events.push(SseEvent::Finish(reason));
        }
    }
    if let Some(usage) = chunk.usage {
        events.push(SseEvent::Usage {
            model: chunk.model,
            usage_in: usage.prompt_tokens,
            usage_out: usage.completion_tokens,
            usage_cached: usage.cached_tokens(),
        });
    }
    if events.is_empty() {
        events.push(SseEvent::Nothing);
    }
    Ok(events)
}

/// An error object sent inside a stream, as the HTTP error it stands for: its `code` when that
/// is a status (vLLM: `500`, also as a string), OpenAI's names for the common ones, and
/// otherwise a server error — the request was accepted and then failed on the server's side.
fn in_stream_error(error: &Value) -> LlmError {
    let code = error.get("code").or_else(|| error.get("type"));
    let status = match code {
        Some(Value::Number(n)) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
        Some(Value::String(s)) => s.parse::<u16>().ok().or(match s.as_str() {
            "rate_limit_exceeded" | "rate_limit_error" | "tokens" | "requests" => Some(429),
            "invalid_request_error" | "context_length_exceeded" => Some(400),
            _ => None,
        }),
        _ => None,
    }
    .filter(|s| (400..=599).contains(s))
    .unwrap_or(500);
    let body = truncate(error.to_string(), MAX_ERROR_BODY);
    if status == 429 {
        tracing::debug!(body = %body, "provider sent a rate-limit error inside the stream");
        LlmError::RateLimited { retry_after: None }
    } else {
        LlmError::Upstream { status, body }
    }
}

/// Reads the next body chunk, waiting at most `timeout` for it.
async fn next_chunk(
    body: &mut (impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    timeout: Duration,
) -> Result<Option<bytes::Bytes>, LlmError> {
    match tokio::time::timeout(timeout, body.next()).await {
        Err(_) => Err(LlmError::Timeout(timeout)),
        Ok(None) => Ok(None),
        // The provider was reached; its stream broke off.
        Ok(Some(Err(e))) => Err(LlmError::Interrupted(error_chain(&e))),
        Ok(Some(Ok(b))) => Ok(Some(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parsed(chunks: &[&'static [u8]]) -> Vec<Result<Vec<SseEvent>, LlmError>> {
        let body = futures::stream::iter(
            chunks
                .iter()
                .map(|c| Ok::<_, reqwest::Error>(bytes::Bytes::from_static(c)))
                .collect::<Vec<_>>(),
        );
        sse_events(body, Duration::from_secs(5)).collect().await
    }

    #[tokio::test]
    async fn sse_parser_yields_deltas_finish_usage_and_done_across_split_chunks() {
        const FIRST: &[u8] = b"data: {\"model\":\"m\",\"choices\":[{\"delta\":{\"content\":\"Hel";
        const REST: &[u8] = b"lo\"},\"finish_reason\":null}]}\r\n\r\n: keepalive\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: {\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\ndata: [DONE]\n\n";
        // Half an event is no event yet.
        assert!(parsed(&[FIRST]).await.is_empty());
        let events: Vec<SseEvent> = parsed(&[FIRST, REST])
            .await
            .into_iter()
            .flat_map(Result::unwrap)
            .collect();
        assert_eq!(
            events,
            vec![
                SseEvent::Delta("Hello".into()),
                SseEvent::Finish("stop".into()),
                SseEvent::Usage {
                    model: "m".into(),
                    usage_in: 3,
                    usage_out: 1,
                    usage_cached: 2
                },
                SseEvent::Done
            ]
        );
    }

    #[test]
    fn in_stream_errors_are_mapped_by_their_code() {
        let cases = [
            (r#"{"error":{"message":"boom","code":500}}"#, Some(500)),
            (r#"{"error":{"message":"boom","code":"503"}}"#, Some(503)),
            (r#"{"error":{"message":"full","code":429}}"#, None),
            (
                r#"{"error":{"message":"x","type":"rate_limit_error"}}"#,
                None,
            ),
            (r#"{"error":{"message":"bad","code":400}}"#, Some(400)),
            (r#"{"error":{"message":"?"}}"#, Some(500)),
            (r#"{"error":"something broke"}"#, Some(500)),
        ];
        for (data, status) in cases {
            let err = parse_data(data).unwrap_err();
            match status {
                Some(s) => assert!(
                    matches!(&err, LlmError::Upstream { status, .. } if *status == s),
                    "{data}: {err:?}"
                ),
                None => assert!(
                    matches!(err, LlmError::RateLimited { .. }),
                    "{data}: {err:?}"
                ),
            }
            assert_eq!(err.is_retryable(), status != Some(400), "{data}");
        }
        // `"error": null` is no error.
        assert!(parse_data(r#"{"choices":[],"error":null}"#).is_ok());
    }
}
