//! The OpenAI-compatible Chat Completions provider: JSON-schema classification of an image and
//! streamed answers, with retries, limits and trace-context propagation.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use backon::{BackoffBuilder, ExponentialBuilder};
use base64::Engine;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{
    LlmConfig, LlmError,
    limit::TokenBucket,
    types::{AnswerInput, ClassifyInput, ClassifyOutput},
};

/// The longest backoff between two attempts when the provider names no wait.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How much of an error body is kept in errors and reports.
const MAX_ERROR_BODY: usize = 2_000;
/// Tokens budgeted per image before the call (a high-detail 512×512 tile costs ~255 + 85 for
/// gpt-4o models; a photo is a few tiles).
const IMAGE_TOKEN_ESTIMATE: u32 = 1_000;
const CLASSIFY_OUTPUT_ESTIMATE: u32 = 200;
const ANSWER_OUTPUT_ESTIMATE: u32 = 800;

const CLASSIFY_SYSTEM_PROMPT: &str = "You classify a photo of one item for household waste \
sorting in Korea. Answer with exactly one path of the taxonomy given by the user (major, middle, \
minor exactly as written there; middle is empty when the path has none), a short item_name \
describing the object, a confidence between 0 and 1, and only those situation tags from the \
given vocabulary that the photo clearly shows.";

pub(crate) struct OpenAi {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
    timeout: Duration,
    max_retries: usize,
    retry_base_delay: Duration,
    retry_budget: Duration,
    permits: Arc<Semaphore>,
    bucket: Option<TokenBucket>,
}

/// A response that arrived with a success status, and what it took to get it.
pub(crate) struct Admitted {
    pub response: reqwest::Response,
    pub permit: OwnedSemaphorePermit,
}

/// One failed attempt, with what the retry policy needs to know.
struct Attempt {
    error: LlmError,
    retryable: bool,
    retry_after: Option<Duration>,
}

impl OpenAi {
    pub(crate) fn new(config: &LlmConfig) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .build()?;
        Ok(Self {
            http,
            url: format!("{}/chat/completions", config.base_url.trim_end_matches('/')),
            api_key: config.api_key.clone(),
            timeout: config.timeout,
            max_retries: config.max_retries,
            retry_base_delay: config.retry_base_delay,
            retry_budget: config.retry_budget,
            permits: Arc::new(Semaphore::new(config.max_concurrency)),
            bucket: (config.tokens_per_minute > 0)
                .then(|| TokenBucket::per_minute(config.tokens_per_minute)),
        })
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends `body`, retrying 429, 5xx and connection failures with exponential backoff and
    /// jitter, or after the provider's `retry-after-ms` / `Retry-After` when it names a wait,
    /// under the concurrency and token limits. Only the response head is awaited, so for a
    /// stream nothing has been yielded yet when a retry happens.
    ///
    /// One budget per call: at most `1 + max_retries` requests, and no wait that would end
    /// past `retry_budget` after the first attempt began. A transient failure that outlasts the
    /// budget comes back as [`LlmError::RetriesExhausted`]. The concurrency permit is held for
    /// one attempt at a time: a call waiting to retry lets others use the provider meanwhile.
    pub(crate) async fn send(
        &self,
        body: &Value,
        estimated_tokens: u32,
    ) -> Result<Admitted, LlmError> {
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(self.retry_base_delay)
            .with_max_delay(MAX_BACKOFF)
            .with_max_times(self.max_retries)
            .with_jitter()
            .build();
        // When the first attempt began: set once its permit (and token budget) is granted.
        let mut started: Option<Instant> = None;
        let mut attempts = 0;
        loop {
            // A permit per attempt: held through the request (and, on success, the response
            // body), never through a wait between attempts.
            let permit = self.permit().await?;
            let started = *started.get_or_insert_with(Instant::now);
            if attempts == 0
                && let Some(bucket) = &self.bucket
            {
                bucket.acquire(estimated_tokens).await;
            }
            attempts += 1;
            let failed = match self.attempt(body).await {
                Ok(response) => return Ok(Admitted { response, permit }),
                Err(failed) => failed,
            };
            // Free the provider slot before deciding anything: whatever happens next (a wait,
            // or the end of the call) needs no request in flight.
            drop(permit);
            if !failed.retryable {
                return Err(failed.error);
            }
            let exhausted = |error: LlmError| LlmError::RetriesExhausted {
                attempts,
                last: Box::new(error),
            };
            // `None` once `max_retries` retries were made.
            let Some(delay) = backoff.next() else {
                return Err(exhausted(failed.error));
            };
            let wait = failed.retry_after.unwrap_or(delay);
            if started.elapsed() + wait > self.retry_budget {
                tracing::warn!(
                    error = %failed.error,
                    wait_ms = wait.as_millis() as u64,
                    budget_ms = self.retry_budget.as_millis() as u64,
                    "llm call failed, and waiting to retry would outlast the retry budget"
                );
                return Err(exhausted(failed.error));
            }
            tracing::warn!(
                error = %failed.error,
                attempt = attempts,
                wait_ms = wait.as_millis() as u64,
                "llm call failed, retrying"
            );
            tokio::time::sleep(wait).await;
        }
    }

    async fn permit(&self) -> Result<OwnedSemaphorePermit, LlmError> {
        self.permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| LlmError::Transport("llm client is shutting down".into()))
    }

    async fn attempt(&self, body: &Value) -> Result<reqwest::Response, Attempt> {
        let mut headers = http::HeaderMap::new();
        ecoscan_common::telemetry::inject_headers(&mut headers);
        let mut request = self.http.post(&self.url).headers(headers).json(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = match tokio::time::timeout(self.timeout, request.send()).await {
            Err(_) => {
                return Err(Attempt {
                    error: LlmError::Timeout(self.timeout),
                    retryable: false,
                    retry_after: None,
                });
            }
            Ok(Err(e)) => return Err(transport_attempt(&e, self.timeout)),
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let retry_after = retry_after(response.headers());
        let body = truncate(response.text().await.unwrap_or_default(), MAX_ERROR_BODY);
        let error = if status == http::StatusCode::TOO_MANY_REQUESTS {
            LlmError::RateLimited { retry_after }
        } else {
            LlmError::Upstream {
                status: status.as_u16(),
                body,
            }
        };
        Err(Attempt {
            retryable: status == http::StatusCode::TOO_MANY_REQUESTS || status.is_server_error(),
            error,
            retry_after,
        })
    }
}

/// The wait a provider asks for: `retry-after-ms` (milliseconds, as OpenAI and Azure OpenAI
/// send it) or else `Retry-After` in seconds (fractions accepted). An HTTP-date, or anything
/// else, is ignored: the backoff decides.
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let number = |name: &str| {
        headers
            .get(name)?
            .to_str()
            .ok()?
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    let micros = number("retry-after-ms")
        .map(|ms| ms * 1e3)
        .or_else(|| number(http::header::RETRY_AFTER.as_str()).map(|s| s * 1e6))?;
    // Days of waiting are as good as forever: the retry budget refuses either.
    Some(Duration::from_micros(micros.min(86_400e6).round() as u64))
}

fn transport_attempt(e: &reqwest::Error, timeout: Duration) -> Attempt {
    if e.is_timeout() {
        return Attempt {
            error: LlmError::Timeout(timeout),
            retryable: false,
            retry_after: None,
        };
    }
    Attempt {
        error: LlmError::Transport(error_chain(e)),
        // A refused or reset connection is worth another try; a request we could not even
        // build (bad URL) is not.
        retryable: e.is_connect() || e.is_request(),
        retry_after: None,
    }
}

/// `e` and its sources, joined: reqwest's own message hides the cause.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

pub(crate) fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// `data:<mime>;base64,...` for the request, and the placeholder that replaces it in reports.
pub(crate) fn image_urls(input: &ClassifyInput) -> (String, String) {
    let mime = if input.content_type.is_empty() {
        "application/octet-stream"
    } else {
        input.content_type.as_str()
    };
    let data = base64::engine::general_purpose::STANDARD.encode(&input.image);
    (
        format!("data:{mime};base64,{data}"),
        format!("data:{mime};base64,<{} bytes>", input.image.len()),
    )
}

/// The classification request; `image_url` is the data URL (or its redacted stand-in).
pub(crate) fn classify_body(input: &ClassifyInput, model: &str, image_url: &str) -> Value {
    let mut majors = Vec::new();
    let mut middles = Vec::new();
    let mut minors = Vec::new();
    let mut lines = String::new();
    for p in &input.taxonomy {
        push_unique(&mut majors, &p.major);
        push_unique(&mut middles, &p.middle);
        push_unique(&mut minors, &p.minor);
        lines.push_str(&format!(
            "- major: {} | middle: {} | minor: {} | ({})\n",
            p.major, p.middle, p.minor, p.name_en
        ));
    }
    let hint = if input.hint.trim().is_empty() {
        "(none)"
    } else {
        input.hint.trim()
    };
    let text = format!(
        "Hint from the person: {hint}\n\nTaxonomy paths:\n{lines}\nSituation tag vocabulary: {}",
        input.situation_tags.join(", ")
    );
    let schema = json!({
        "type": "object",
        "properties": {
            "major": {"type": "string", "enum": majors},
            "middle": {"type": "string", "enum": middles},
            "minor": {"type": "string", "enum": minors},
            "item_name": {"type": "string"},
            "confidence": {"type": "number"},
            "situation_tags": {
                "type": "array",
                "items": {"type": "string", "enum": input.situation_tags},
            },
        },
        "required": ["major", "middle", "minor", "item_name", "confidence", "situation_tags"],
        "additionalProperties": false,
    });
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": CLASSIFY_SYSTEM_PROMPT},
            {"role": "user", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": image_url}},
            ]},
        ],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "waste_classification", "strict": true, "schema": schema},
        },
    })
}

fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_owned());
    }
}

pub(crate) fn classify_estimate(input: &ClassifyInput) -> u32 {
    let text: usize = input
        .taxonomy
        .iter()
        .map(|p| p.major.len() + p.middle.len() + p.minor.len() + p.name_en.len() + 32)
        .sum::<usize>()
        + input.hint.len()
        + CLASSIFY_SYSTEM_PROMPT.len();
    u32::try_from(text / 4).unwrap_or(u32::MAX) + IMAGE_TOKEN_ESTIMATE + CLASSIFY_OUTPUT_ESTIMATE
}

pub(crate) fn answer_body(input: &AnswerInput, model: &str) -> Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": input.system_prompt},
            {"role": "user", "content": input.user_prompt},
        ],
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

pub(crate) fn answer_estimate(input: &AnswerInput) -> u32 {
    u32::try_from((input.system_prompt.len() + input.user_prompt.len()) / 4).unwrap_or(u32::MAX)
        + ANSWER_OUTPUT_ESTIMATE
}

#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    model: String,
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    message: Option<Message>,
    delta: Option<Message>,
}

#[derive(Deserialize)]
struct Message {
    content: Option<String>,
    refusal: Option<String>,
}

#[derive(Deserialize, Default, Clone, Copy)]
pub(crate) struct Usage {
    #[serde(default)]
    pub prompt_tokens: u32,
    #[serde(default)]
    pub completion_tokens: u32,
}

#[derive(Deserialize)]
struct ClassifyJson {
    major: String,
    middle: String,
    minor: String,
    item_name: String,
    confidence: f32,
    situation_tags: Vec<String>,
}

/// Parses a non-streamed completion whose message content is the classification JSON.
pub(crate) fn parse_classification(
    body: &str,
    requested_model: &str,
) -> Result<(ClassifyOutput, Usage), LlmError> {
    let completion: Completion = serde_json::from_str(body)
        .map_err(|e| LlmError::Malformed(format!("response is not a chat completion: {e}")))?;
    let message = completion
        .choices
        .into_iter()
        .next()
        .and_then(|c| c.message)
        .ok_or_else(|| LlmError::Malformed("completion has no message".into()))?;
    if let Some(refusal) = message.refusal.filter(|r| !r.is_empty()) {
        return Err(LlmError::Malformed(format!("model refused: {refusal}")));
    }
    let content = message
        .content
        .ok_or_else(|| LlmError::Malformed("completion message has no content".into()))?;
    let c: ClassifyJson = serde_json::from_str(&content).map_err(|e| {
        LlmError::Malformed(format!(
            "content does not match the classification schema: {e}"
        ))
    })?;
    if !(0.0..=1.0).contains(&c.confidence) {
        return Err(LlmError::Malformed(format!(
            "confidence {} is outside 0..1",
            c.confidence
        )));
    }
    let model = if completion.model.is_empty() {
        requested_model.to_owned()
    } else {
        completion.model
    };
    Ok((
        ClassifyOutput {
            major: c.major,
            middle: c.middle,
            minor: c.minor,
            item_name: c.item_name,
            confidence: c.confidence,
            situation_tags: c.situation_tags,
            provider: crate::Provider::OpenAi.as_str().to_owned(),
            model,
        },
        completion.usage.unwrap_or_default(),
    ))
}

/// What one SSE `data:` line said.
#[derive(Debug, PartialEq)]
pub(crate) enum SseEvent {
    Delta(String),
    Usage {
        model: String,
        usage_in: u32,
        usage_out: u32,
    },
    Done,
    Nothing,
}

/// The parsed `data:` payloads of a streamed completion. `eventsource-stream` does the SSE
/// framing (events split across chunks, `\r\n`, comments and other fields, multi-line data);
/// `timeout` bounds the wait for each chunk of the body, comments included, so a provider's
/// keep-alive comments keep a slow stream alive.
pub(crate) fn sse_events<S>(
    body: S,
    timeout: Duration,
) -> impl futures::Stream<Item = Result<Vec<SseEvent>, LlmError>> + Unpin
where
    S: futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
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
    if let Some(error) = value.get("error") {
        return Err(LlmError::Upstream {
            status: 200,
            body: truncate(error.to_string(), MAX_ERROR_BODY),
        });
    }
    let chunk: Completion = serde_json::from_value(value)
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
    }
    if let Some(usage) = chunk.usage {
        events.push(SseEvent::Usage {
            model: chunk.model,
            usage_in: usage.prompt_tokens,
            usage_out: usage.completion_tokens,
        });
    }
    if events.is_empty() {
        events.push(SseEvent::Nothing);
    }
    Ok(events)
}

/// Reads the next body chunk, waiting at most `timeout` for it.
pub(crate) async fn next_chunk(
    body: &mut (impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    timeout: Duration,
) -> Result<Option<bytes::Bytes>, LlmError> {
    match tokio::time::timeout(timeout, body.next()).await {
        Err(_) => Err(LlmError::Timeout(timeout)),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(LlmError::Transport(error_chain(&e))),
        Ok(Some(Ok(b))) => Ok(Some(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sse_parser_yields_deltas_usage_and_done_across_split_chunks() {
        const FIRST: &[u8] = b"data: {\"model\":\"m\",\"choices\":[{\"delta\":{\"content\":\"Hel";
        const REST: &[u8] = b"lo\"}}]}\r\n\r\n: keepalive\ndata: {\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
        async fn parsed(chunks: &[&'static [u8]]) -> Vec<SseEvent> {
            let body = futures::stream::iter(
                chunks
                    .iter()
                    .map(|c| Ok::<_, reqwest::Error>(bytes::Bytes::from_static(c)))
                    .collect::<Vec<_>>(),
            );
            let mut out = Vec::new();
            let mut events = sse_events(body, Duration::from_secs(5));
            while let Some(batch) = events.next().await {
                out.extend(batch.unwrap());
            }
            out
        }
        // Half an event is no event yet.
        let events = parsed(&[FIRST]).await;
        assert!(events.is_empty());
        let events = parsed(&[FIRST, REST]).await;
        assert_eq!(
            events,
            vec![
                SseEvent::Delta("Hello".into()),
                SseEvent::Usage {
                    model: "m".into(),
                    usage_in: 3,
                    usage_out: 1
                },
                SseEvent::Done
            ]
        );
    }

    #[test]
    fn classification_with_confidence_out_of_range_is_malformed() {
        let content = r#"{"major":"a","middle":"","minor":"c","item_name":"x","confidence":7,"situation_tags":[]}"#;
        let body = json!({"choices":[{"message":{"content": content}}]}).to_string();
        assert!(matches!(
            parse_classification(&body, "m"),
            Err(LlmError::Malformed(_))
        ));
    }

    #[test]
    fn redacted_image_url_keeps_the_type_and_size_only() {
        let input = ClassifyInput {
            image: bytes::Bytes::from_static(&[1, 2, 3]),
            content_type: "image/png".into(),
            ..ClassifyInput::default()
        };
        let (real, redacted) = image_urls(&input);
        assert_eq!(real, "data:image/png;base64,AQID");
        assert_eq!(redacted, "data:image/png;base64,<3 bytes>");
    }

    #[test]
    fn retry_after_reads_milliseconds_first_then_seconds_and_ignores_dates() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = http::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, http::HeaderValue::from_static(v));
            }
            h
        };
        assert_eq!(
            retry_after(&headers(&[("retry-after", "2")])),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            retry_after(&headers(&[("retry-after", "0.25")])),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            retry_after(&headers(&[("retry-after", "2"), ("retry-after-ms", "150")])),
            Some(Duration::from_millis(150))
        );
        assert_eq!(
            retry_after(&headers(&[(
                "retry-after",
                "Wed, 21 Oct 2015 07:28:00 GMT"
            )])),
            None
        );
        assert_eq!(retry_after(&headers(&[("retry-after", "-1")])), None);
        assert_eq!(retry_after(&headers(&[])), None);
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("가나다".into(), 4), "가…");
    }
}
