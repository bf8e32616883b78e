//! Installing telemetry: the global subscriber (the log layer, the OpenTelemetry layer and
//! their filters), the tracer providers and the propagator, once per process.

use std::{collections::HashMap, sync::Arc};

use anyhow::Context as _;
use opentelemetry::{propagation::TextMapCompositePropagator, trace::TracerProvider as _};
use opentelemetry_sdk::{
    propagation::{BaggagePropagator, TraceContextPropagator},
    trace::SdkTracerProvider,
};
use tracing_subscriber::{
    EnvFilter, Layer, filter::Targets, layer::SubscriberExt, util::SubscriberInitExt,
};

use super::{
    export::{export_enabled, service_provider},
    log_ids,
    routing::{self, ServiceRoutes},
};

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
/// would parse `[rpc]` as the name of a target and silently match nothing. (Its tests are
/// the telemetry module's.)
pub(super) fn targets_only(spec: &str) -> Option<Targets> {
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

fn provider(service: &str, export: bool) -> anyhow::Result<SdkTracerProvider> {
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    let provider = service_provider(service, export)?;
    opentelemetry::global::set_tracer_provider(provider.clone());
    Ok(provider)
}
