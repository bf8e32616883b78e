//! Telemetry set up in one call: logs (`RUST_LOG` filter, `LOG_FORMAT=json|text`), OpenTelemetry
//! spans with W3C trace-context and baggage propagation, and OTLP export when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set. Also the small helpers that move a trace context in and
//! out of headers, gRPC metadata and queue entries.

use std::collections::HashMap;

use opentelemetry::{
    Context, KeyValue,
    propagation::{Extractor, Injector, TextMapCompositePropagator},
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_sdk::{
    Resource,
    propagation::{BaggagePropagator, TraceContextPropagator},
    trace::SdkTracerProvider,
};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

/// Keeps the tracer provider alive; flushes pending spans when dropped (last thing at shutdown).
#[must_use = "dropping the guard flushes and stops span export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Flushes and stops span export now.
    pub fn shutdown(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("failed to flush telemetry: {e}");
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Installs the global subscriber, tracer provider and propagator for `service`
/// (exported as `service.name = ecoscan-<service>`).
pub fn init(service: &str) -> anyhow::Result<TelemetryGuard> {
    let (provider, tracer) = tracer(service)?;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,h2=warn,hyper=warn,tower=warn,sqlx=warn"));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let fmt = if json {
        tracing_subscriber::fmt::layer().json().boxed()
    } else {
        tracing_subscriber::fmt::layer().boxed()
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init()?;
    Ok(TelemetryGuard {
        provider: Some(provider),
    })
}

/// For tests: installs telemetry once per process; logs go to the test output only when
/// `TEST_LOG` is set.
pub fn init_for_tests() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok((provider, tracer)) = tracer("test") else {
            return;
        };
        let filter = if std::env::var_os("TEST_LOG").is_some() {
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("debug,h2=warn,hyper=warn"))
        } else {
            EnvFilter::new("off")
        };
        let _ = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(tracer))
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

fn tracer(service: &str) -> anyhow::Result<(SdkTracerProvider, opentelemetry_sdk::trace::Tracer)> {
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    let resource = Resource::builder()
        .with_service_name(format!("ecoscan-{service}"))
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    // A provider is installed even without an exporter so that every span has a real trace id
    // to propagate and to stamp on events.
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(endpoint) = crate::config::env_opt("OTEL_EXPORTER_OTLP_ENDPOINT") {
        use opentelemetry_otlp::WithExportConfig;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    let tracer = provider.tracer("ecoscan");
    Ok((provider, tracer))
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

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}
