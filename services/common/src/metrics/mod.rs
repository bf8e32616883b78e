//! Prometheus metrics: one [`Metrics`] (a `prometheus-client` registry) per service, served as
//! `GET /metrics` in the Prometheus text format, and the RED metrics of every RPC, recorded by
//! [`RpcMetricsLayer`] in [`crate::server::serve_with_metrics`].
//!
//! Each service builds its own registry (no global state), so in the one-process suite every
//! service's `/metrics` shows its own series only; a constant `service` label on every series
//! keeps a scrape of the whole suite unambiguous.

use std::{
    borrow::Cow,
    collections::HashSet,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        exemplar::HistogramWithExemplars,
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::Histogram,
    },
    registry::Registry,
};
use prost::Message as _;

/// `Content-Type` of the Prometheus text format (version 0.0.4) served on `/metrics`.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// `Content-Type` of the OpenMetrics text format, served on `/metrics` to a scraper that asks
/// for it (Prometheus does): the one that carries exemplars.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Bucket bounds (seconds) shared by every duration histogram: 1 ms to 2 min, enough for a
/// unary call and for a model call or a whole scan stream alike.
pub const SECONDS_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0,
];

/// Registers series in a registry, one line each, in braces (which rustfmt leaves as written):
/// `register_series! { registry; ("name", "help", metric); … }`, `metric` a cheap clone of the
/// series the caller keeps. One table per set of series, instead of five lines per series that
/// differ only in their strings.
#[macro_export]
macro_rules! register_series {
    ($registry:expr; $(($name:expr, $help:expr, $metric:expr $(,)?);)+) => {{
        let registry = $registry;
        $(registry.register($name, $help, $metric);)+
    }};
}

/// A histogram over [`SECONDS_BUCKETS`].
pub fn seconds_histogram() -> Histogram {
    Histogram::new(SECONDS_BUCKETS)
}

/// The exemplar a duration carries: `trace_id`, the trace it was measured in, so that a
/// latency spike on a dashboard leads to the trace of one request in it.
pub type TraceExemplar = [(&'static str, String); 1];

/// A histogram over [`SECONDS_BUCKETS`] whose buckets keep the trace of their latest
/// observation as an exemplar (shown in the OpenMetrics exposition only).
pub type SecondsHistogram = HistogramWithExemplars<TraceExemplar>;

/// A histogram family whose members are [`SecondsHistogram`]s: the RED durations (per RPC,
/// per route, per stage, per model call).
pub type SecondsFamily<L> = Family<L, SecondsHistogram, fn() -> SecondsHistogram>;

fn seconds_histogram_with_exemplars() -> SecondsHistogram {
    HistogramWithExemplars::new(SECONDS_BUCKETS.into_iter())
}

/// An empty [`SecondsFamily`].
pub fn seconds_family<L: Clone + std::hash::Hash + Eq>() -> SecondsFamily<L> {
    Family::new_with_constructor(seconds_histogram_with_exemplars as fn() -> SecondsHistogram)
}

/// Observes `seconds` in `histogram` with the current span's trace as the exemplar (none
/// outside a trace).
pub fn observe_traced(histogram: &SecondsHistogram, seconds: f64) {
    observe_in_trace(histogram, seconds, &crate::telemetry::current_trace_id());
}

/// Observes `seconds` in `histogram` with `trace_id` (32 hex digits; empty for none) as the
/// exemplar.
pub fn observe_in_trace(histogram: &SecondsHistogram, seconds: f64, trace_id: &str) {
    let exemplar = (!trace_id.is_empty()).then(|| [("trace_id", trace_id.to_owned())]);
    histogram.observe(seconds, exemplar, None);
}

/// Whether a scrape's `Accept` header asks for OpenMetrics (Prometheus' does, first).
pub fn wants_openmetrics(accept: Option<&http::HeaderValue>) -> bool {
    accept
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"))
}

/// Label set with one label.
pub type Labels1 = [(&'static str, String); 1];
/// Label set with two labels.
pub type Labels2 = [(&'static str, String); 2];
/// Label set with three labels.
pub type Labels3 = [(&'static str, String); 3];
/// Label set with four labels.
pub type Labels4 = [(&'static str, String); 4];

type Refresh = Box<dyn Fn() -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;

/// How long a scrape waits for a value read from a store ([`Metrics::sample`]) before it serves
/// the last one read: `/metrics` answers within this (plus encoding) during any store fault,
/// well inside Prometheus' 10 s scrape timeout, instead of waiting out the store's timeout.
pub const SAMPLE_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// A value read from a store at scrape time: its read, at most one at a time (a read that
/// outlives a scrape goes on in the background and serves the next), and when a read last
/// succeeded.
struct Sample {
    name: &'static str,
    read: Refresh,
    in_flight: std::sync::Mutex<Option<tokio::sync::watch::Receiver<bool>>>,
    last_ok: Arc<std::sync::Mutex<Option<Instant>>>,
    /// The last read took longer than [`SAMPLE_WAIT`]: the store is slow, and waiting for the
    /// next read would only spend the scrape's whole wait (a Redis 200 ms away put every
    /// scrape at 50 ms and some past 100 ms; services/suite/tests/partition.rs).
    slow: Arc<std::sync::atomic::AtomicBool>,
}

/// A service's metrics registry, plus the values read at scrape time. Build it in `serve()`,
/// register the service's metrics, then hand it to [`crate::server::serve_with_metrics`].
#[derive(Default)]
pub struct Metrics {
    registry: Registry,
    samples: Vec<Arc<Sample>>,
    /// `metrics_sample_age_seconds{sample}`: how old each sampled value is.
    sample_age: Option<Family<Labels1, Gauge<f64, std::sync::atomic::AtomicU64>>>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics")
            .field("registry", &self.registry)
            .field("samples", &self.samples.len())
            .finish()
    }
}

impl Metrics {
    /// An empty registry whose series all carry the constant label `service="<service>"`.
    pub fn new(service: &str) -> Self {
        Self {
            registry: Registry::with_labels(std::iter::once((
                Cow::Borrowed("service"),
                Cow::Owned(service.to_owned()),
            ))),
            samples: Vec::new(),
            sample_age: None,
        }
    }

    /// Where to register the service's own metrics.
    pub fn registry(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// A value that needs an async read from a store (a queue's backlog in Redis): `read` runs
    /// at each scrape, writes it into a gauge it owns and says whether it could. A scrape
    /// waits for it at most [`SAMPLE_WAIT`] and otherwise serves the last value, the read
    /// going on in the background (one at a time), so a store that stopped answering never
    /// holds `/metrics` up. `metrics_sample_age_seconds{sample="<name>"}` says how old the
    /// value is (absent until a read succeeded).
    pub fn sample<F, Fut>(&mut self, name: &'static str, read: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        if self.sample_age.is_none() {
            let family = Family::default();
            self.registry.register(
                "metrics_sample_age_seconds",
                "Age of each value read from a store for /metrics (served without waiting for a \
                 store that does not answer), by sample",
                family.clone(),
            );
            self.sample_age = Some(family);
        }
        self.samples.push(Arc::new(Sample {
            name,
            read: Box::new(move || Box::pin(read())),
            in_flight: std::sync::Mutex::new(None),
            last_ok: Arc::new(std::sync::Mutex::new(None)),
            slow: Arc::default(),
        }));
    }

    /// Registers a gauge whose value is `read` at scrape time (a count kept elsewhere).
    pub fn gauge_fn(
        &mut self,
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> i64 + Send + Sync + 'static,
    ) {
        self.registry.register_collector(Box::new(FnMetric {
            name,
            help,
            read: Read::Gauge(Box::new(read)),
        }));
    }

    /// Registers a counter whose value is `read` at scrape time (a monotonic count kept
    /// elsewhere). `name` is without the `_total` suffix, which the encoder adds.
    pub fn counter_fn(
        &mut self,
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        self.registry.register_collector(Box::new(FnMetric {
            name,
            help,
            read: Read::Counter(Box::new(read)),
        }));
    }

    /// Refreshes the scrape-time values and encodes every series in the Prometheus text format.
    pub async fn render(&self) -> String {
        self.refresh().await;
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            .expect("writing to a String never fails");
        out
    }

    /// Refreshes the scrape-time values and encodes every series in the OpenMetrics text
    /// format, exemplars included.
    pub async fn render_openmetrics(&self) -> String {
        self.refresh().await;
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String never fails");
        out
    }

    /// `/metrics` for a scrape that sent `accept`: `(Content-Type, body)`, OpenMetrics when it
    /// asks for it, else the Prometheus text format.
    pub async fn scrape(&self, accept: Option<&http::HeaderValue>) -> (&'static str, String) {
        if wants_openmetrics(accept) {
            (OPENMETRICS_CONTENT_TYPE, self.render_openmetrics().await)
        } else {
            (CONTENT_TYPE, self.render().await)
        }
    }

    /// Reads the scrape-time values, each within [`SAMPLE_WAIT`].
    async fn refresh(&self) {
        let mut reads = Vec::new();
        for sample in &self.samples {
            // A read an earlier scrape started and that is still under way has outlived a wait
            // already (the store is away), and a store whose last read took longer than the
            // wait is slow: either way this scrape serves the last value at once. Waiting
            // SAMPLE_WAIT on every scrape of a Redis outage or a slow Redis left /metrics no
            // margin for its 100 ms (services/suite/tests/partition.rs).
            if let (done, true) = sample.start() {
                reads.push(done);
            }
        }
        // All at once, within one bound: a read that does not finish serves its last value.
        let deadline = tokio::time::Instant::now() + SAMPLE_WAIT;
        for mut done in reads {
            let _ = tokio::time::timeout_at(deadline, done.wait_for(|d| *d)).await;
        }
        if let Some(ages) = &self.sample_age {
            for sample in &self.samples {
                let last = *sample.last_ok.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(at) = last {
                    ages.get_or_create(&[("sample", sample.name.to_owned())])
                        .set(at.elapsed().as_secs_f64());
                }
            }
        }
    }
}

impl Sample {
    /// The read under way, or a new one: a receiver that turns true when it is done, and
    /// whether a scrape should wait for it (a new read of a store that answered the last one
    /// within [`SAMPLE_WAIT`]).
    fn start(&self) -> (tokio::sync::watch::Receiver<bool>, bool) {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = in_flight.as_ref().filter(|d| !*d.borrow()) {
            return (done.clone(), false);
        }
        let (tx, rx) = tokio::sync::watch::channel(false);
        let (read, last_ok, slow) = ((self.read)(), self.last_ok.clone(), self.slow.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            if read.await {
                *last_ok.lock().unwrap_or_else(|e| e.into_inner()) = Some(started);
            }
            slow.store(
                started.elapsed() > SAMPLE_WAIT,
                std::sync::atomic::Ordering::Relaxed,
            );
            let _ = tx.send(true);
        });
        *in_flight = Some(rx.clone());
        (rx, !self.slow.load(std::sync::atomic::Ordering::Relaxed))
    }
}

enum Read {
    Gauge(Box<dyn Fn() -> i64 + Send + Sync>),
    Counter(Box<dyn Fn() -> u64 + Send + Sync>),
}

/// A metric read from a closure at scrape time.
struct FnMetric {
    name: &'static str,
    help: &'static str,
    read: Read,
}

impl fmt::Debug for FnMetric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnMetric")
            .field("name", &self.name)
            .finish()
    }
}

impl Collector for FnMetric {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        match &self.read {
            Read::Gauge(read) => {
                let gauge = ConstGauge::new(read());
                let metric =
                    encoder.encode_descriptor(self.name, self.help, None, gauge.metric_type())?;
                gauge.encode(metric)
            }
            Read::Counter(read) => {
                let counter = ConstCounter::new(read());
                let metric =
                    encoder.encode_descriptor(self.name, self.help, None, counter.metric_type())?;
                counter.encode(metric)
            }
        }
    }
}

/// RED metrics of the RPCs a server answers.
#[derive(Clone, Debug)]
pub struct RpcMetrics {
    requests: Family<Labels2, Counter>,
    duration: SecondsFamily<Labels1>,
    in_flight: Family<Labels1, Gauge>,
    /// `/pkg.Service/Method` paths of the served services: anything else (health, reflection,
    /// unknown methods) is not recorded, so a caller cannot create series at will.
    methods: Arc<HashSet<String>>,
}

impl RpcMetrics {
    /// Registers `rpc_server_requests_total{method,code}`, `rpc_server_duration_seconds{method}`
    /// and `rpc_server_in_flight{method}` for the methods of `service_names` (fully-qualified
    /// names found in the ecoscan descriptor set).
    pub fn register(registry: &mut Registry, service_names: &[&str]) -> Self {
        let metrics = Self {
            requests: Family::default(),
            duration: seconds_family(),
            in_flight: Family::default(),
            methods: Arc::new(method_paths(service_names)),
        };
        crate::register_series! {
            registry;
            ("rpc_server_requests", "RPCs finished, by method and gRPC status code", metrics.requests.clone());
            ("rpc_server_duration_seconds", "Time from request to end of response (streaming RPCs: the end of the stream)", metrics.duration.clone());
            ("rpc_server_in_flight", "RPCs started and not finished (open streams included)", metrics.in_flight.clone());
        }
        metrics
    }

    /// Starts recording a call to `path`; `None` when the path is not one of ours.
    fn start(&self, path: &str) -> Option<Call> {
        if !self.methods.contains(path) {
            return None;
        }
        let method = path.trim_start_matches('/').to_owned();
        self.in_flight
            .get_or_create(&[("method", method.clone())])
            .inc();
        Some(Call {
            metrics: self.clone(),
            method,
            started: Instant::now(),
            // The request's span is current here (the trace layer wraps this one).
            trace_id: crate::telemetry::current_trace_id(),
            code: None,
            message: String::new(),
        })
    }
}

/// Every `/pkg.Service/Method` of `service_names` in the ecoscan descriptor set.
fn method_paths(service_names: &[&str]) -> HashSet<String> {
    let set = prost_types::FileDescriptorSet::decode(ecoscan_proto::FILE_DESCRIPTOR_SET)
        .expect("the compiled-in descriptor set decodes");
    let mut paths = HashSet::new();
    for file in &set.file {
        for svc in &file.service {
            let name = format!("{}.{}", file.package(), svc.name());
            if service_names.contains(&name.as_str()) {
                paths.extend(svc.method.iter().map(|m| format!("/{name}/{}", m.name())));
            }
        }
    }
    paths
}

/// One RPC being recorded; records when dropped (end of stream, or the caller went away).
struct Call {
    metrics: RpcMetrics,
    method: String,
    started: Instant,
    /// The call's trace, the exemplar of its duration.
    trace_id: String,
    /// `grpc-status` once seen (trailers-only response or trailers).
    code: Option<tonic::Code>,
    /// `grpc-message` (decoded) with it.
    message: String,
}

impl Call {
    fn saw(&mut self, headers: &http::HeaderMap) {
        if let Some(code) = headers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
        {
            self.code = Some(tonic::Code::from_i32(code));
            if let Some(status) = tonic::Status::from_header_map(headers) {
                self.message = status.message().to_owned();
            }
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let method = std::mem::take(&mut self.method);
        // No status means the stream ended without one: the caller cancelled (a deadline that
        // ran out is answered `DEADLINE_EXCEEDED` by `deadline::CallEndLayer`).
        let code = self.code.unwrap_or(tonic::Code::Cancelled);
        // Refusals and deadline ends, which only metrics recorded, reach the logs too.
        crate::log_limit::rpc_outcome(code, &method, &self.message);
        let code = crate::codes::code_name(code);
        let m = &self.metrics;
        m.in_flight
            .get_or_create(&[("method", method.clone())])
            .dec();
        observe_in_trace(
            &m.duration.get_or_create(&[("method", method.clone())]),
            self.started.elapsed().as_secs_f64(),
            &self.trace_id,
        );
        m.requests
            .get_or_create(&[("method", method), ("code", code.to_owned())])
            .inc();
    }
}

/// Records [`RpcMetrics`] for every call through the wrapped service.
#[derive(Clone, Debug)]
pub struct RpcMetricsLayer(pub RpcMetrics);

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcMetricsService {
            inner,
            metrics: self.0.clone(),
        }
    }
}

/// The service [`RpcMetricsLayer`] makes.
#[derive(Clone, Debug)]
pub struct RpcMetricsService<S> {
    inner: S,
    metrics: RpcMetrics,
}

impl<S, B, ResB> tower::Service<http::Request<B>> for RpcMetricsService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<RpcBody<ResB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // Started before the handler runs; dropped with the future if the caller leaves early.
        let mut call = self.metrics.start(req.uri().path());
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = response.await?;
            let (parts, body) = response.into_parts();
            if let Some(c) = &mut call {
                c.saw(&parts.headers);
                // A trailers-only response (an error) is complete: record it before the caller
                // can see it.
                if c.code.is_some() {
                    call = None;
                }
            }
            Ok(http::Response::from_parts(
                parts,
                RpcBody {
                    inner: Box::pin(body),
                    call,
                },
            ))
        })
    }
}

/// A response body that finishes its call's record at the end of the stream.
pub struct RpcBody<B> {
    inner: Pin<Box<B>>,
    call: Option<Call>,
}

impl<B: http_body::Body> http_body::Body for RpcBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = self.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(trailers), Some(call)) = (frame.trailers_ref(), self.call.as_mut()) {
                    call.saw(trailers);
                    // Trailers end a gRPC response: record before the caller sees them.
                    self.call = None;
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(call) = self.call.as_mut() {
                    call.code.get_or_insert(tonic::Code::Internal);
                }
                self.call = None;
            }
            Poll::Ready(None) => self.call = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests;
