//! The LLM client every model-calling service uses: one [`Llm`] over two providers — `openai`
//! (any OpenAI-compatible Chat Completions endpoint) and `mock` (no model, deterministic,
//! marked as mock) — with provider limits, retries, one GenAI span per call, and a report of
//! every call, success or failure, to the analytics service.
//!
//! The client knows providers and reporting, not stages: callers pass the taxonomy to classify
//! into, and the prompts and facts an answer is written from.

mod config;
mod error;
mod limit;
mod metrics;
mod mock;
mod openai;
mod report;
mod types;

use std::{
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use ecoscan_proto::v1::{CallStatus, LlmCall};
use futures::Stream;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{Instrument, Span, field::Empty};

pub use config::{LlmConfig, Operation, PropagateTrace, Provider, ResponseFormat};
pub use error::LlmError;
pub use metrics::LlmMetrics;
pub use mock::{MODEL as MOCK_MODEL, marker as mock_marker};
pub use report::{AnalyticsReporter, DEFAULT_BUFFER};
pub use types::{
    AnswerChunk, AnswerInput, AnswerUsage, ClassifyInput, ClassifyOutput, Locale, OfferedModel,
    TaxonomyPath,
};

/// Text deltas in order, then one [`AnswerChunk::Done`]; or an error, after which nothing more
/// comes.
pub type AnswerStream = Pin<Box<dyn Stream<Item = Result<AnswerChunk, LlmError>> + Send>>;

/// Default analytics address, used when `ANALYTICS_URL` is unset.
pub const DEFAULT_ANALYTICS_URL: &str = "http://127.0.0.1:50056";

/// `ANALYTICS_URL` for services that report calls: unset means the default
/// (`http://127.0.0.1:50056`), set but empty disables reporting (`None`).
pub fn analytics_url_from_env() -> Option<String> {
    match std::env::var("ANALYTICS_URL") {
        Err(_) => Some(DEFAULT_ANALYTICS_URL.to_owned()),
        Ok(v) if v.trim().is_empty() => None,
        Ok(v) => Some(v.trim().to_owned()),
    }
}

/// Bodies kept in analytics reports are cut at this size.
const MAX_REPORTED_BODY: usize = 64 * 1024;

/// The LLM client. Cheap to clone; clones share limits and the analytics reporter.
#[derive(Clone)]
pub struct Llm {
    inner: Arc<Inner>,
}

struct Inner {
    config: LlmConfig,
    service: &'static str,
    reporter: Option<AnalyticsReporter>,
    backend: Backend,
    /// Set once by [`Llm::with_metrics`]; calls before that are not counted.
    metrics: std::sync::OnceLock<LlmMetrics>,
    /// The model server's host and port, for `server.address` / `server.port` on every call's
    /// span (the conventions' client attributes); `None` for the mock, which has no server.
    server: Option<(String, i64)>,
}

enum Backend {
    Mock(mock::Mock),
    OpenAi(Arc<openai::OpenAi>),
}

impl Llm {
    /// A client for `service` (reported to analytics, e.g. "vision"), reporting every call to
    /// `reporter` when given.
    pub fn new(
        config: LlmConfig,
        service: &'static str,
        reporter: Option<AnalyticsReporter>,
    ) -> anyhow::Result<Self> {
        config.validate()?;
        let backend = match config.provider {
            Provider::Mock => {
                Backend::Mock(mock::Mock::new(config.mock_latency, config.mock_jitter))
            }
            Provider::OpenAi => Backend::OpenAi(Arc::new(openai::OpenAi::new(&config)?)),
        };
        let server = match config.provider {
            Provider::Mock => None,
            Provider::OpenAi => reqwest::Url::parse(&config.base_url).ok().and_then(|url| {
                let port = url.port_or_known_default()?;
                Some((url.host_str()?.to_owned(), i64::from(port)))
            }),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                service,
                reporter,
                backend,
                server,
                metrics: std::sync::OnceLock::new(),
            }),
        })
    }

    /// The client a service runs with: reporting every call to analytics at `analytics_url`
    /// when given, its series registered in `metrics`.
    pub fn for_service(
        config: LlmConfig,
        service: &'static str,
        analytics_url: Option<&str>,
        metrics: &mut ecoscan_common::metrics::Metrics,
    ) -> anyhow::Result<Self> {
        let reporter = analytics_url.map(AnalyticsReporter::new).transpose()?;
        let llm_metrics = LlmMetrics::register(metrics, reporter.as_ref());
        Ok(Self::new(config, service, reporter)?.with_metrics(llm_metrics))
    }

    /// Records every call in `metrics` (see [`LlmMetrics::register`]). Only the first call of
    /// this on a client (or any of its clones) takes effect.
    #[must_use]
    pub fn with_metrics(self, metrics: LlmMetrics) -> Self {
        let _ = self.inner.metrics.set(metrics);
        self
    }

    pub fn provider(&self) -> Provider {
        self.inner.config.provider
    }

    pub fn config(&self) -> &LlmConfig {
        &self.inner.config
    }

    /// A caller's choice of model (`model` of a request): `None` for none (the configured
    /// model), the offered model it names, or why it may not be chosen.
    pub fn choose_model(
        &self,
        requested: &str,
    ) -> Result<Option<OfferedModel>, ecoscan_common::models::ModelRefused> {
        Ok(self.inner.config.offered.choose(requested)?.cloned())
    }

    pub fn reporter(&self) -> Option<&AnalyticsReporter> {
        self.inner.reporter.as_ref()
    }

    /// Classifies an image into one path of `input.taxonomy`.
    /// Waits (at most `within`) until this client's calls so far have reached analytics; see
    /// [`AnalyticsReporter::settled`]. At once when nothing is reported.
    pub async fn reports_settled(&self, within: Duration) -> bool {
        match &self.inner.reporter {
            Some(reporter) => reporter.settled(within).await,
            None => true,
        }
    }

    pub async fn classify(&self, input: ClassifyInput) -> Result<ClassifyOutput, LlmError> {
        let (model, system) = self
            .inner
            .config
            .model_for(Operation::Classify, input.model.as_ref());
        let span = self.call_span(Operation::Classify, &model, &system, &input.job_id);
        async {
            let mut log = self.start_log(Operation::Classify, &model, &system, &input.job_id);
            let result = match &self.inner.backend {
                Backend::Mock(m) => mock_classify(m, &input, &mut log).await,
                Backend::OpenAi(o) => o.classify(&input, &model, &mut log).await,
            };
            self.finish(log, result.as_ref().err().map(Failure::from));
            result
        }
        .instrument(span)
        .await
    }

    /// Writes an answer as a stream of deltas. Errors before the first delta (after retries)
    /// come back as `Err`; later ones as the stream's last item. A call is never retried once a
    /// delta has been yielded. Dropping the stream cancels the call.
    pub async fn answer(&self, input: AnswerInput) -> Result<AnswerStream, LlmError> {
        let (model, system) = self
            .inner
            .config
            .model_for(Operation::Answer, input.model.as_ref());
        let span = self.call_span(Operation::Answer, &model, &system, &input.job_id);
        let (tx, rx) = mpsc::channel(32);
        match &self.inner.backend {
            Backend::Mock(m) => {
                let log = span
                    .in_scope(|| self.start_log(Operation::Answer, &model, &system, &input.job_id));
                let task = mock_answer(self.clone(), m.draw_latency(), input, log, tx);
                tokio::spawn(task.instrument(span));
            }
            Backend::OpenAi(o) => {
                let started = async {
                    let mut log = self.start_log(Operation::Answer, &model, &system, &input.job_id);
                    let body = openai::answer_body(&input, &model, o.stream_options());
                    log.request_body = body.to_string();
                    let estimate = openai::answer_estimate(&input);
                    let mut budget = o.budget();
                    match o.send(&body, estimate, &mut budget).await {
                        Ok(admitted) => Ok((
                            openai::Started {
                                admitted,
                                budget,
                                body,
                                estimate,
                            },
                            log,
                        )),
                        Err(e) => {
                            self.finish(log, Some(Failure::from(&e)));
                            Err(e)
                        }
                    }
                }
                .instrument(span.clone())
                .await;
                let (started, log) = started?;
                let task = openai::answer_task(self.clone(), o.clone(), started, log, tx);
                tokio::spawn(task.instrument(span));
            }
        }
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    fn call_span(&self, operation: Operation, model: &str, system: &str, job_id: &str) -> Span {
        let (address, port) = match &self.inner.server {
            Some((host, port)) => (Some(host.as_str()), Some(*port)),
            None => (None, None),
        };
        tracing::info_span!(
            "llm.call",
            otel.name = %format!("chat {model}"),
            otel.kind = "client",
            otel.status_code = Empty,
            gen_ai.system = %system,
            gen_ai.operation.name = "chat",
            gen_ai.request.model = %model,
            gen_ai.response.model = Empty,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            gen_ai.server.time_to_first_token_ms = Empty,
            error.type = Empty,
            otel.status_description = Empty,
            llm.operation = operation.as_str(),
            llm.call_id = Empty,
            job.id = %job_id,
            server.address = address,
            server.port = port,
        )
    }

    /// Starts the record of a call; must run inside the call's span (for the trace id).
    fn start_log(&self, operation: Operation, model: &str, system: &str, job_id: &str) -> CallLog {
        let call_id = uuid::Uuid::now_v7().to_string();
        Span::current().record("llm.call_id", call_id.as_str());
        CallLog {
            call_id,
            operation,
            model: model.to_owned(),
            system: system.to_owned(),
            job_id: job_id.to_owned(),
            trace_id: ecoscan_common::telemetry::current_trace_id(),
            started: Instant::now(),
            started_at: SystemTime::now(),
            request_body: String::new(),
            response_body: String::new(),
            input_tokens: 0,
            output_tokens: 0,
            cached_input_tokens: 0,
            ttft: None,
        }
    }

    /// Records the outcome on the current (call) span and reports it to analytics.
    fn finish(&self, log: CallLog, failure: Option<Failure>) {
        let span = Span::current();
        let latency = log.started.elapsed();
        span.record("gen_ai.response.model", log.model.as_str());
        // As i64: OpenTelemetry attributes have no unsigned type (u64 would become a string).
        span.record("gen_ai.usage.input_tokens", i64::from(log.input_tokens));
        span.record("gen_ai.usage.output_tokens", i64::from(log.output_tokens));
        if let Some(ttft) = log.ttft {
            span.record("gen_ai.server.time_to_first_token_ms", ms(ttft));
        }
        match &failure {
            Some(f) => {
                ecoscan_common::telemetry::record_error(&span, f.kind, &f.message);
                tracing::warn!(error = %f.message, latency_ms = ms(latency), "llm call failed");
            }
            None => tracing::info!(
                latency_ms = ms(latency),
                input_tokens = log.input_tokens,
                output_tokens = log.output_tokens,
                "llm call finished"
            ),
        }
        if let Some(metrics) = self.inner.metrics.get() {
            metrics.record(&metrics::CallRecord {
                provider: &log.system,
                model: &log.model,
                operation: log.operation.as_str(),
                status: failure.as_ref().map_or("ok", |f| f.kind),
                input_tokens: log.input_tokens,
                output_tokens: log.output_tokens,
                latency_seconds: latency.as_secs_f64(),
                ttft_seconds: log.ttft.map(|t| t.as_secs_f64()),
            });
        }
        let Some(reporter) = &self.inner.reporter else {
            return;
        };
        reporter.report(LlmCall {
            call_id: log.call_id,
            service: self.inner.service.to_owned(),
            provider: log.system,
            model: log.model,
            operation: log.operation.as_str().to_owned(),
            input_tokens: log.input_tokens,
            output_tokens: log.output_tokens,
            latency_ms: ms(latency),
            ttft_ms: log.ttft.map_or(0.0, ms),
            status: if failure.is_some() {
                CallStatus::Error
            } else {
                CallStatus::Ok
            } as i32,
            error: failure.map(|f| f.message).unwrap_or_default(),
            request_body: openai::truncate(log.request_body, MAX_REPORTED_BODY),
            response_body: openai::truncate(log.response_body, MAX_REPORTED_BODY),
            job_id: log.job_id,
            trace_id: log.trace_id,
            started_at: Some(ecoscan_proto::timestamp(log.started_at)),
            // A classification sends the one photo; an answer, text only.
            images: u32::from(log.operation == Operation::Classify),
            cached_input_tokens: log.cached_input_tokens,
            // Analytics prices the call from its own table.
            cost_micros: None,
            price_version: String::new(),
        });
    }
}

/// What a call did, gathered while it runs and reported when it ends.
struct CallLog {
    call_id: String,
    operation: Operation,
    /// Requested model, replaced by the one the provider reports.
    model: String,
    /// The model's vendor (`gen_ai.system`): "mock", "openai" or as `LLM_MODELS` names it.
    system: String,
    job_id: String,
    trace_id: String,
    started: Instant,
    started_at: SystemTime,
    request_body: String,
    response_body: String,
    input_tokens: u32,
    output_tokens: u32,
    /// Of `input_tokens`, those the provider read from its prompt cache.
    cached_input_tokens: u32,
    ttft: Option<Duration>,
}

struct Failure {
    kind: &'static str,
    message: String,
}

impl From<&LlmError> for Failure {
    fn from(e: &LlmError) -> Self {
        Self {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

impl Failure {
    fn cancelled() -> Self {
        Self {
            kind: "cancelled",
            message: "the caller stopped reading the answer stream".to_owned(),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

async fn mock_classify(
    m: &mock::Mock,
    input: &ClassifyInput,
    log: &mut CallLog,
) -> Result<ClassifyOutput, LlmError> {
    let (_, redacted) = openai::image_urls(input);
    let request = json!({
        "hint": input.hint,
        "image_url": redacted,
        "taxonomy_paths": input.taxonomy.len(),
        "situation_tags": input.situation_tags.len(),
    });
    log.request_body = request.to_string();
    let text_bytes = input.hint.len()
        + input
            .taxonomy
            .iter()
            .map(|p| p.major.len() + p.middle.len() + p.minor.len() + p.name_en.len())
            .sum::<usize>()
        + input.situation_tags.iter().map(String::len).sum::<usize>();
    log.input_tokens = mock::input_tokens(text_bytes, Some(input.image.len()));
    tokio::time::sleep(m.draw_latency()).await;
    let mut output = m.classify(input).ok_or_else(|| {
        LlmError::Malformed("the mock cannot classify without a taxonomy to choose from".into())
    })?;
    // The mock plays the model it was asked for; its vendor stays "mock".
    output.model.clone_from(&log.model);
    let response = json!({
        "mock": true,
        "major": output.major,
        "middle": output.middle,
        "minor": output.minor,
        "item_name": output.item_name,
        "confidence": output.confidence,
        "situation_tags": output.situation_tags,
    });
    log.response_body = response.to_string();
    log.output_tokens = mock::output_tokens(log.response_body.len());
    Ok(output)
}

type ChunkSender = mpsc::Sender<Result<AnswerChunk, LlmError>>;

async fn mock_answer(
    llm: Llm,
    latency: Duration,
    input: AnswerInput,
    mut log: CallLog,
    tx: ChunkSender,
) {
    log.request_body = openai::answer_body(&input, &log.model, true).to_string();
    log.input_tokens =
        mock::input_tokens(input.system_prompt.len() + input.user_prompt.len(), None);
    let text = mock::answer_text(input.locale, &input.subject, &input.steps);
    let parts = mock::chunks(&text);
    // A quarter of the latency before the first token, the rest spread over the chunks, the
    // way a real model's answer arrives.
    let first = latency.mul_f64(0.25);
    let between = latency.mul_f64(0.75) / u32::try_from(parts.len().max(1)).unwrap_or(u32::MAX);
    tokio::time::sleep(first).await;
    for (i, part) in parts.into_iter().enumerate() {
        if i == 0 {
            log.ttft = Some(log.started.elapsed());
        } else {
            tokio::time::sleep(between).await;
        }
        if tx.send(Ok(AnswerChunk::Delta(part))).await.is_err() {
            llm.finish(log, Some(Failure::cancelled()));
            return;
        }
    }
    log.output_tokens = mock::output_tokens(text.len());
    log.response_body = text;
    let usage = AnswerUsage {
        provider: Provider::Mock.as_str().to_owned(),
        model: log.model.clone(),
        input_tokens: log.input_tokens,
        output_tokens: log.output_tokens,
        ttft: log.ttft,
    };
    llm.finish(log, None);
    let _ = tx.send(Ok(AnswerChunk::Done(usage))).await;
}
