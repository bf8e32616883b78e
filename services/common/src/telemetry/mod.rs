//! Telemetry set up in one call: logs (`RUST_LOG` filter, `LOG_FORMAT=json|text`), OpenTelemetry
//! spans with W3C trace-context and baggage propagation, and OTLP export when an endpoint is
//! set. Also the small helpers that move a trace context in and out of headers, gRPC metadata
//! and queue entries, and that mark each message of a stream on the current span.
//!
//! Environment (the `OTEL_*` names are the OpenTelemetry standard ones):
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) | unset | export spans there; unset means no export |
//! | `OTEL_EXPORTER_OTLP_PROTOCOL` (or `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`) | `grpc` | `grpc` or `http/protobuf` (`/v1/traces` is appended to the generic endpoint) |
//! | `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG` | `parentbased_always_on` | read by the SDK: `always_on`, `always_off`, `traceidratio`, `parentbased_always_on`, `parentbased_always_off`, `parentbased_traceidratio` |
//! | `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, `OTEL_BSP_EXPORT_TIMEOUT` | 5000 ms, 2048, 512, 30000 ms | read by the SDK's batch processor |
//! | `OTEL_RESOURCE_ATTRIBUTES` | unset | extra resource attributes (`service.name` is always `ecoscan-<service>`) |
//! | `ECOSCAN_TRACE_FILTER` | [`DEFAULT_TRACE_FILTER`] | which spans and events become OpenTelemetry spans and span events, independent of `RUST_LOG` |
//!
//! Log lines written inside a span carry its `trace_id` and `span_id` (both formats; see
//! [`log_ids`]). In `ecoscan up`, several services share the process and each still exports
//! under its own resource ([`init_routed`], [`routing`]).
//!
//! Export never blocks a request: spans go to a bounded queue (the SDK's batch processor, which
//! drops when full) and a background thread sends them; the network part of an export runs on
//! the service's Tokio runtime. [`TelemetryGuard`] flushes what is queued when dropped.

use std::{collections::HashMap, sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use opentelemetry::{
    Context, KeyValue,
    propagation::TextMapCompositePropagator,
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::{
    Resource,
    error::{OTelSdkError, OTelSdkResult},
    propagation::{BaggagePropagator, TraceContextPropagator},
    trace::{SdkTracerProvider, SpanData, SpanExporter},
};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    EnvFilter, Layer, filter::Targets, layer::SubscriberExt, util::SubscriberInitExt,
};

pub mod log_ids;
pub mod routing;

pub use routing::{SERVICE_FIELD, ServiceRoutes, current_service};

/// Target of the per-message stream events ([`message_sent`], [`message_received`]). They go to
/// traces (span events) but not to the log by default: a scan streams hundreds of messages.
pub const STREAM_TARGET: &str = "ecoscan_stream";

/// Log filter when `RUST_LOG` is unset.
pub const DEFAULT_LOG_FILTER: &str =
    "info,h2=warn,hyper=warn,tower=warn,sqlx=warn,ecoscan_stream=warn";

/// Span filter when `ECOSCAN_TRACE_FILTER` is unset: our spans and events at `info` and above
/// (stream messages included), none from the transport crates underneath.
pub const DEFAULT_TRACE_FILTER: &str =
    "info,h2=off,hyper=off,hyper_util=off,tower=off,sqlx=off,reqwest=off,opentelemetry=off";

/// Keeps the tracer providers alive; flushes pending spans when dropped (last thing at shutdown).
#[must_use = "dropping the guard flushes and stops span export"]
pub struct TelemetryGuard {
    providers: Vec<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Flushes and stops span export now.
    pub fn shutdown(&mut self) {
        for provider in self.providers.drain(..) {
            if let Err(e) = provider.shutdown() {
                eprintln!("failed to flush telemetry: {e}");
            }
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Installs the global subscriber, tracer provider and propagator for `service`
/// (exported as `service.name = ecoscan-<service>`). Call it inside the Tokio runtime.
pub fn init(service: &str) -> anyhow::Result<TelemetryGuard> {
    let provider = provider(service, export_enabled())?;
    let otel = otel_layer().with_tracer(provider.tracer("ecoscan"));
    install(None, otel.with_filter(trace_filter()?).boxed())?;
    Ok(TelemetryGuard {
        providers: vec![provider],
    })
}

/// Like [`init`] for a process running several services (`ecoscan up`): each service in
/// `routes` exports under its own resource (`service.name = ecoscan-<service>`, a provider and
/// exporter each), so a trace viewer shows every service and the calls between them; spans of
/// no service export as `ecoscan-<default>`.
pub fn init_routed(default: &str, routes: ServiceRoutes) -> anyhow::Result<TelemetryGuard> {
    let export = export_enabled();
    let fallback = provider(default, export)?;
    let mut providers = vec![fallback.clone()];
    let mut tracers = HashMap::new();
    for service in routes.services() {
        let p = service_provider(service, export)?;
        tracers.insert(*service, p.tracer("ecoscan"));
        providers.push(p);
    }
    let tracer = routing::RoutingTracer::new(fallback.tracer("ecoscan"), tracers);
    let otel = otel_layer().with_tracer(tracer);
    install(
        Some(routing::ServiceLayer::new(Arc::new(routes))),
        otel.with_filter(trace_filter()?).boxed(),
    )?;
    Ok(TelemetryGuard { providers })
}

/// The OpenTelemetry layer without the two per-span extras it adds by default: the thread's id
/// and name (an async span is polled on whichever worker thread is free, so the thread it was
/// created on says nothing) and the busy/idle times, which cost a clock read and a lock on every
/// poll of every instrumented future. Both were measurable in the `capacity` benchmark's
/// profile; a span's start and end times stay.
fn otel_layer<S>()
-> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry::trace::noop::NoopTracer>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    tracing_opentelemetry::layer()
        .with_threads(false)
        // `target` (the Rust module path) is no attribute of the conventions; the span's
        // `service.name` and name say where it comes from.
        .with_target(false)
        .with_tracked_inactivity(false)
        // Nothing here reads OpenTelemetry's own current context (trace context is taken from
        // the `tracing` span: `OpenTelemetrySpanExt::context`), so entering a span need not
        // clone and attach it: that was the layer's costliest work on every poll.
        .with_context_activation(false)
}

/// The filter a directive string asks for. Targets and levels only (`info,h2=off`, the
/// defaults and nearly every `RUST_LOG`) become a [`Targets`] filter, decided once per
/// callsite; anything more (span or field directives) an [`EnvFilter`], which must also track
/// every span entered and left under a lock, on every poll of every instrumented future.
fn filter_from<S>(spec: &str, var: &str) -> anyhow::Result<DynFilter<S>>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    if let Some(targets) = targets_only(spec) {
        return Ok(Box::new(targets));
    }
    Ok(Box::new(
        EnvFilter::try_new(spec).with_context(|| format!("invalid {var} {spec:?}"))?,
    ))
}

/// `spec` as a [`Targets`] filter when it holds targets and levels only. A span or field
/// directive (`[rpc]=debug`, `ecoscan[{job.id}]=debug`) needs an [`EnvFilter`]: `Targets`
/// would parse `[rpc]` as the name of a target and silently match nothing.
fn targets_only(spec: &str) -> Option<Targets> {
    if spec.contains(['[', '{']) {
        return None;
    }
    spec.parse().ok()
}

/// A filter of either kind ([`filter_from`]).
type DynFilter<S> = Box<dyn tracing_subscriber::layer::Filter<S> + Send + Sync + 'static>;

/// The span filter: `ECOSCAN_TRACE_FILTER`, else [`DEFAULT_TRACE_FILTER`].
fn trace_filter<S>() -> anyhow::Result<DynFilter<S>>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let spec = crate::config::env_opt("ECOSCAN_TRACE_FILTER");
    filter_from(
        spec.as_deref().unwrap_or(DEFAULT_TRACE_FILTER),
        "ECOSCAN_TRACE_FILTER",
    )
}

type Registry = tracing_subscriber::Registry;
type Capture = tracing_subscriber::filter::Filtered<
    log_ids::CaptureDispatch,
    tracing_subscriber::filter::LevelFilter,
    Registry,
>;
type Routing = tracing_subscriber::layer::Layered<
    Option<
        tracing_subscriber::filter::Filtered<
            routing::ServiceLayer,
            DynFilter<tracing_subscriber::layer::Layered<Capture, Registry>>,
            tracing_subscriber::layer::Layered<Capture, Registry>,
        >,
    >,
    tracing_subscriber::layer::Layered<Capture, Registry>,
>;

/// The global subscriber: the log layer (`RUST_LOG`, `LOG_FORMAT`, trace ids on every line in a
/// span), then `routing` when several services share the process, then the OpenTelemetry
/// layer on top (it must come after `routing`, which marks each new span first).
fn install(
    routing: Option<routing::ServiceLayer>,
    otel: Box<dyn Layer<Routing> + Send + Sync>,
) -> anyhow::Result<()> {
    // An unset or unusable RUST_LOG falls back to the default, as `EnvFilter` always did.
    let log_filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|spec| filter_from(&spec, "RUST_LOG").ok())
        .map_or_else(|| filter_from(DEFAULT_LOG_FILTER, "RUST_LOG"), Ok)?;
    let json = std::env::var("LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let (fmt, capture) = if json {
        let (format, capture) =
            log_ids::with_trace_ids(tracing_subscriber::fmt::format().json(), true);
        (
            tracing_subscriber::fmt::layer()
                .json()
                .event_format(format)
                .boxed(),
            capture,
        )
    } else {
        // Colours only on a terminal: a log file or collector gets plain text. (A line inside
        // a span is formatted aside to add its ids, and loses its colours either way.)
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
        let (format, capture) =
            log_ids::with_trace_ids(tracing_subscriber::fmt::format().with_ansi(ansi), false);
        (
            tracing_subscriber::fmt::layer()
                .with_ansi(ansi)
                .event_format(format)
                .boxed(),
            capture,
        )
    };
    // Every layer carries a filter of its own. A layer without one votes for every span and
    // event of every crate: the callsites the trace and log filters both turn off (h2's and
    // hyper's spans around every poll and frame) were then created, entered and closed all the
    // same (with the per-poll work below, tracing was 28 % of `ecoscan up`'s CPU per scan in
    // the `capacity` benchmark, 14 % without). The capture layer sees nothing (it only needs
    // the dispatch); `routing` sees what the OpenTelemetry layer sees.
    let routing = routing
        .map(|routing| trace_filter().map(|filter| routing.with_filter(filter)))
        .transpose()?;
    tracing_subscriber::registry()
        .with(capture.with_filter(tracing_subscriber::filter::LevelFilter::OFF))
        .with(routing)
        .with(otel)
        .with(fmt.with_filter(log_filter))
        .try_init()?;
    Ok(())
}

/// For tests: installs telemetry once per process (never exporting); logs go to the test output
/// only when `TEST_LOG` is set.
pub fn init_for_tests() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(provider) = provider("test", false) else {
            return;
        };
        let filter = if std::env::var_os("TEST_LOG").is_some() {
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("debug,h2=warn,hyper=warn"))
        } else {
            EnvFilter::new("off")
        };
        let _ = tracing_subscriber::registry()
            .with(
                otel_layer()
                    .with_tracer(provider.tracer("ecoscan"))
                    .with_filter(EnvFilter::new(DEFAULT_TRACE_FILTER)),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .with_test_writer()
                    .with_filter(filter),
            )
            .try_init();
        // Tests never flush: the provider lives as long as the process.
        std::mem::forget(provider);
    });
}

/// Whether an OTLP endpoint is configured.
fn export_enabled() -> bool {
    crate::config::env_opt("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
        || crate::config::env_opt("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
}

/// The resource every span of `service` carries: `service.name = ecoscan-<service>`, the
/// version, and an id unique to this process (so replicas of a service stay apart).
pub fn resource(service: &str) -> Resource {
    Resource::builder()
        .with_service_name(format!("ecoscan-{service}"))
        .with_attributes([
            KeyValue::new("service.namespace", "ecoscan"),
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            KeyValue::new("service.instance.id", uuid::Uuid::new_v4().to_string()),
        ])
        .build()
}

fn provider(service: &str, export: bool) -> anyhow::Result<SdkTracerProvider> {
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    let provider = service_provider(service, export)?;
    opentelemetry::global::set_tracer_provider(provider.clone());
    Ok(provider)
}

/// A provider exporting under `service`'s resource (not installed globally).
fn service_provider(service: &str, export: bool) -> anyhow::Result<SdkTracerProvider> {
    // A provider is installed even without an exporter so that every span has a real trace id
    // to propagate and to stamp on events. The sampler comes from `OTEL_TRACES_SAMPLER` (the
    // SDK's default configuration reads it).
    let mut builder = SdkTracerProvider::builder().with_resource(resource(service));
    if export {
        builder = builder.with_batch_exporter(exporter()?);
    }
    Ok(builder.build())
}

/// The OTLP exporter chosen by `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`; it reads its endpoint,
/// headers and timeout from the standard variables itself.
fn exporter() -> anyhow::Result<OnRuntime<opentelemetry_otlp::SpanExporter>> {
    use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig};
    let protocol = crate::config::env_opt("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| crate::config::env_opt("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "grpc".to_owned());
    let exporter = match protocol.trim() {
        "grpc" => SpanExporter::builder().with_tonic().build(),
        "http/protobuf" => SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build(),
        other => bail!(
            "unsupported OTEL_EXPORTER_OTLP_PROTOCOL {other:?}; use \"grpc\" or \"http/protobuf\""
        ),
    }
    .context("failed to build the OTLP span exporter")?;
    let runtime = tokio::runtime::Handle::try_current()
        .context("telemetry with OTLP export must be initialised inside a Tokio runtime")?;
    Ok(OnRuntime {
        inner: Arc::new(exporter),
        runtime,
    })
}

/// Runs each export on the service's Tokio runtime. The SDK's batch processor exports from a
/// thread of its own, where neither the gRPC nor the HTTP client could do I/O (both need a
/// Tokio reactor); spawning onto the runtime keeps the export off every request's path.
#[derive(Debug)]
struct OnRuntime<E> {
    inner: Arc<E>,
    runtime: tokio::runtime::Handle,
}

impl<E: SpanExporter + 'static> SpanExporter for OnRuntime<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let inner = self.inner.clone();
        match self
            .runtime
            .spawn(async move { inner.export(batch).await })
            .await
        {
            Ok(result) => result,
            Err(e) => Err(OTelSdkError::InternalFailure(format!(
                "span export task failed: {e}"
            ))),
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called once while the provider is built, before any export could share the exporter.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

/// Marks `span` as failed, the way OpenTelemetry wants it and a trace viewer shows it: status
/// ERROR with `message` as the status description (plain text, never percent-encoded) and
/// `error.type` (a gRPC code name, an HTTP status code or an error kind). The span must declare
/// `otel.status_code`, `otel.status_description` and `error.type` (as `Empty`).
///
/// tracing-opentelemetry reads the status description from `otel.status_description` (not
/// `otel.status_message`, which it would export as a plain attribute), and the last status
/// recorded wins: the code is recorded first, the description after it.
pub fn record_error(span: &tracing::Span, error_type: &str, message: &str) {
    span.record("error.type", error_type);
    span.record("otel.status_code", "ERROR");
    let message = if message.is_empty() {
        error_type
    } else {
        message
    };
    span.record("otel.status_description", message);
}

/// Marks one message a server-streaming RPC (or an SSE response) sent, as an event on the
/// current span: the OpenTelemetry RPC conventions' `message` event with `message.type = SENT`
/// and `message.id` (1, 2, … within the stream). `kind` says what the message was (`progress`,
/// `delta`, `stage`, …).
pub fn message_sent(id: u64, kind: &str) {
    tracing::event!(
        target: STREAM_TARGET,
        tracing::Level::INFO,
        { "rpc.message.type" = "SENT",
        rpc.message.id = id,
        rpc.message.kind = kind },
        "message"
    );
}

/// Marks one message a client-streaming RPC received, as an event on the current span.
pub fn message_received(id: u64, kind: &str) {
    tracing::event!(
        target: STREAM_TARGET,
        tracing::Level::INFO,
        { "rpc.message.type" = "RECEIVED",
        rpc.message.id = id,
        rpc.message.kind = kind },
        "message"
    );
}

/// A span event per gRPC message in a response body, for `TraceLayer::on_body_chunk`: walks the
/// gRPC length-prefixed framing (a flag byte and a 4-byte length per message) across chunks, so
/// every message a server stream sends is marked on the RPC span, whatever the handler.
#[derive(Clone, Debug, Default)]
pub struct GrpcMessageEvents {
    sent: u64,
    /// Bytes of the current message's prefix seen so far.
    prefix: Vec<u8>,
    /// Bytes of the current message's body still to skip.
    remaining: usize,
}

impl GrpcMessageEvents {
    /// Reads `buf` and returns how many messages started in it.
    fn feed(&mut self, mut buf: &[u8]) -> u64 {
        let mut started = 0;
        while !buf.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(buf.len());
                self.remaining -= n;
                buf = &buf[n..];
                continue;
            }
            let n = (5 - self.prefix.len()).min(buf.len());
            self.prefix.extend_from_slice(&buf[..n]);
            buf = &buf[n..];
            if self.prefix.len() == 5 {
                let len = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]);
                self.prefix.clear();
                self.remaining = len as usize;
                started += 1;
            }
        }
        started
    }
}

impl<B: AsRef<[u8]>> tower_http::trace::OnBodyChunk<B> for GrpcMessageEvents {
    fn on_body_chunk(&mut self, chunk: &B, _latency: Duration, span: &tracing::Span) {
        // Untraced calls (health, reflection) have no span to mark.
        if span.is_disabled() {
            return;
        }
        for _ in 0..self.feed(chunk.as_ref()) {
            self.sent += 1;
            span.in_scope(|| message_sent(self.sent, "grpc"));
        }
    }
}

/// A span event per Server-Sent Event in a response body, for `TraceLayer::on_body_chunk` on
/// an HTTP server: each `event:`/`data:` block is one message (its `event:` name as the kind);
/// comments such as `: keepalive` are not messages.
/// Only a body that starts as an event stream is read: a JSON answer (most answers; a finished
/// result is 4 KB) is recognised by its first byte and passed by untouched, where scanning it
/// for messages was 4 % of the gateway's CPU serving finished results.
#[derive(Clone, Debug, Default)]
pub struct SseMessageEvents {
    sent: u64,
    /// Whether the body is an event stream, known from its first non-empty chunk.
    is_stream: Option<bool>,
}

/// Whether a body that starts with `chunk` is an event stream: every SSE block starts with a
/// field (`data`, `event`, `id`, `retry`) or a comment (`:`).
fn starts_an_event_stream(chunk: &[u8]) -> bool {
    chunk.starts_with(b":")
        || [&b"data:"[..], b"event:", b"id:", b"retry:"]
            .iter()
            .any(|field| chunk.starts_with(field))
}

/// The SSE messages in `text`, by their `event:` name (`message` when unnamed).
fn sse_messages(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut kind = None;
            let mut is_message = false;
            for line in block.lines() {
                if let Some(name) = line.strip_prefix("event:") {
                    kind = Some(name.trim());
                }
                is_message |= line.starts_with("data:") || line.starts_with("event:");
            }
            is_message.then(|| kind.unwrap_or("message"))
        })
        .collect()
}

impl<B: AsRef<[u8]>> tower_http::trace::OnBodyChunk<B> for SseMessageEvents {
    fn on_body_chunk(&mut self, chunk: &B, _latency: Duration, span: &tracing::Span) {
        let chunk = chunk.as_ref();
        if span.is_disabled() || chunk.is_empty() {
            return;
        }
        if !*self
            .is_stream
            .get_or_insert_with(|| starts_an_event_stream(chunk))
        {
            return;
        }
        let Ok(text) = std::str::from_utf8(chunk) else {
            return;
        };
        for kind in sse_messages(text) {
            self.sent += 1;
            span.in_scope(|| message_sent(self.sent, kind));
        }
    }
}

/// The trace id of the current span, as 32 hex digits (empty when there is none).
pub fn current_trace_id() -> String {
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    if sc.is_valid() {
        sc.trace_id().to_string()
    } else {
        String::new()
    }
}

/// The current span's trace context as `traceparent`/`tracestate`/`baggage` entries, for a queue
/// entry or any other carrier that outlives the request.
pub fn current_carrier() -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier
}

/// A context from entries written by [`current_carrier`].
pub fn context_from_carrier(carrier: &HashMap<String, String>) -> Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(carrier))
}

/// Links `span` to the span whose context `carrier` holds (a job's submitting request, written
/// by [`current_carrier`]): an OpenTelemetry span link, which Jaeger shows as a reference, so a
/// trace of its own (a watch of the job, say) is joined to the story it belongs to. Nothing
/// when the carrier holds no valid context.
pub fn link_to_carrier(span: &tracing::Span, carrier: &HashMap<String, String>) {
    let linked = context_from_carrier(carrier).span().span_context().clone();
    if linked.is_valid() {
        span.add_link(linked);
    }
}

/// A context from HTTP headers (`traceparent`, `baggage`).
pub fn context_from_headers(headers: &http::HeaderMap) -> Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// Writes the current span's context into HTTP headers.
pub fn inject_headers(headers: &mut http::HeaderMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut HeaderInjector(headers));
    });
}

#[cfg(test)]
mod tests;
