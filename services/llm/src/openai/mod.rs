//! The OpenAI-compatible Chat Completions provider: JSON classification of an image and
//! streamed answers, with retries, limits and trace-context propagation, for every server that
//! speaks the wire format (OpenAI, vLLM, Ollama, llama.cpp's server, LiteLLM).
//!
//! One file per idea: [`request`] builds the bodies, [`headers`] decides what goes with them,
//! [`retry_hint`] reads a provider's wait, [`budget`] spends a call's retries, [`structured`]
//! reads a classification out of whatever the model wrote, [`stream`] parses a streamed answer,
//! and [`classify`] / [`answer`] run the two operations.

mod answer;
mod budget;
mod classify;
mod headers;
mod request;
mod retry_hint;
mod stream;
mod structured;

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub(crate) use answer::{Started, answer_task};
pub(crate) use budget::Budget;
pub(crate) use request::{answer_body, answer_estimate, image_urls};

use crate::{LlmConfig, LlmError, PropagateTrace, ResponseFormat, limit::TokenBucket};

/// How much of an error body is kept in errors and reports.
const MAX_ERROR_BODY: usize = 2_000;

pub(crate) struct OpenAi {
    http: reqwest::Client,
    url: reqwest::Url,
    api_key: Option<String>,
    timeout: Duration,
    max_retries: usize,
    retry_base_delay: Duration,
    retry_budget: Duration,
    response_format: ResponseFormat,
    stream_options: bool,
    /// Whether requests carry `traceparent`: decided once, from the setting and the host.
    propagate_trace: bool,
    permits: Arc<Semaphore>,
    bucket: Option<TokenBucket>,
    /// Models whose server answered 400 to `json_schema` and accepted `json_object`: they are
    /// asked with `json_object` from then on, instead of failing once per call.
    json_schema_rejected: Mutex<HashSet<String>>,
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
            .user_agent(headers::USER_AGENT)
            .build()?;
        let url = reqwest::Url::parse(&format!(
            "{}/chat/completions",
            config.base_url.trim_end_matches('/')
        ))?;
        let propagate_trace = match config.propagate_trace {
            PropagateTrace::Always => true,
            PropagateTrace::Never => false,
            PropagateTrace::Auto => headers::is_internal(&url),
        };
        tracing::info!(
            url = %url,
            propagate_trace,
            response_format = ?config.response_format,
            "openai-compatible model provider configured"
        );
        Ok(Self {
            http,
            url,
            api_key: config.api_key.clone(),
            timeout: config.timeout,
            max_retries: config.max_retries,
            retry_base_delay: config.retry_base_delay,
            retry_budget: config.retry_budget,
            response_format: config.response_format,
            stream_options: config.stream_options,
            propagate_trace,
            permits: Arc::new(Semaphore::new(config.max_concurrency)),
            bucket: (config.tokens_per_minute > 0)
                .then(|| TokenBucket::per_minute(config.tokens_per_minute)),
            json_schema_rejected: Mutex::new(HashSet::new()),
        })
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn stream_options(&self) -> bool {
        self.stream_options
    }

    /// A fresh retry budget for one call.
    pub(crate) fn budget(&self) -> Budget {
        Budget::new(self.max_retries, self.retry_base_delay, self.retry_budget)
    }

    /// Sends `body`, retrying 429, 5xx and connection failures with exponential backoff and
    /// jitter, or after the wait the provider names (see [`retry_hint`]), under the concurrency
    /// and token limits. Only the response head is awaited, so for a stream nothing has been
    /// yielded yet when a retry happens.
    ///
    /// Attempts and waits are spent from `budget`, which a call shares across everything it
    /// sends (a repair request, a stream restarted before its first delta): at most
    /// `1 + max_retries` requests, and no wait that would end past `retry_budget` after the
    /// first attempt began. A transient failure that outlasts the budget comes back as
    /// [`LlmError::RetriesExhausted`]. The concurrency permit is held for one attempt at a
    /// time: a call waiting to retry lets others use the provider meanwhile.
    pub(crate) async fn send(
        &self,
        body: &Value,
        estimated_tokens: u32,
        budget: &mut Budget,
    ) -> Result<Admitted, LlmError> {
        let mut charged = false;
        loop {
            // A permit per attempt: held through the request (and, on success, the response
            // body), never through a wait between attempts.
            let permit = self.permit().await?;
            budget.start();
            if !charged && let Some(bucket) = &self.bucket {
                bucket.acquire(estimated_tokens).await;
            }
            charged = true;
            budget.count_attempt();
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
            let wait = budget.next_wait(failed.error, failed.retry_after)?;
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
        let mut request = self
            .http
            .post(self.url.clone())
            .headers(headers::trace_headers(self.propagate_trace))
            .json(body);
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
        let retry_after = retry_hint::retry_after(response.headers(), std::time::SystemTime::now());
        let body = truncate(response.text().await.unwrap_or_default(), MAX_ERROR_BODY);
        let error = if status == http::StatusCode::TOO_MANY_REQUESTS {
            tracing::debug!(body = %body, "provider answered 429");
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

    /// The response format to ask `model` for: the configured one, unless the server already
    /// refused `json_schema` for it.
    fn format_for(&self, model: &str) -> ResponseFormat {
        let rejected = self
            .json_schema_rejected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(model);
        match self.response_format {
            ResponseFormat::JsonSchema if rejected => ResponseFormat::JsonObject,
            other => other,
        }
    }

    fn remember_json_schema_rejected(&self, model: &str) {
        let first = self
            .json_schema_rejected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(model.to_owned());
        if first {
            tracing::warn!(
                model,
                "the model provider refused response_format json_schema and accepted json_object; \
                 asking this model with json_object from now on (set LLM_RESPONSE_FORMAT=json_object \
                 to start so)"
            );
        }
    }
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

/// Reads a whole (non-streamed) response body within `timeout`.
async fn read_body(admitted: Admitted, timeout: Duration) -> Result<String, LlmError> {
    let Admitted { response, permit } = admitted;
    let text = tokio::time::timeout(timeout, response.text())
        .await
        .map_err(|_| LlmError::Timeout(timeout))?
        .map_err(|e| LlmError::Transport(error_chain(&e)))?;
    drop(permit);
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("가나다".into(), 4), "가…");
    }
}
