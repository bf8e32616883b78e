use std::sync::Mutex;

use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::{
    error::OTelSdkResult,
    trace::{SdkTracerProvider, SpanData, SpanExporter},
};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

use super::*;

/// Keeps every exported span.
#[derive(Clone, Debug, Default)]
struct InMemorySpanExporter(Arc<Mutex<Vec<SpanData>>>);

impl InMemorySpanExporter {
    fn get_finished_spans(&self) -> Result<Vec<SpanData>, ()> {
        Ok(self.0.lock().expect("spans lock").clone())
    }
}

impl SpanExporter for InMemorySpanExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().expect("spans lock").extend(batch);
        Ok(())
    }
}

/// A provider per service exporting to one in-memory exporter each, and the routed
/// subscriber over them.
fn routed() -> (
    impl Subscriber + Send + Sync,
    HashMap<&'static str, (SdkTracerProvider, InMemorySpanExporter)>,
) {
    let routes = Arc::new(
        ServiceRoutes::default()
            .service("gateway", &["gateway_crate"], &[])
            .service("ingest", &["ingest_crate"], &["ecoscan.v1.ScanService"]),
    );
    let mut providers = HashMap::new();
    for name in ["suite", "gateway", "ingest"] {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_resource(crate::telemetry::resource(name))
            .with_simple_exporter(exporter.clone())
            .build();
        providers.insert(name, (provider, exporter));
    }
    let tracer = |name: &str| providers[name].0.tracer("ecoscan");
    let by_service = HashMap::from([("gateway", tracer("gateway")), ("ingest", tracer("ingest"))]);
    let subscriber = tracing_subscriber::registry()
        .with(ServiceLayer::new(routes))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(RoutingTracer::new(tracer("suite"), by_service)),
        );
    (subscriber, providers)
}

fn names(exporter: &InMemorySpanExporter) -> Vec<String> {
    let mut names: Vec<String> = exporter
        .get_finished_spans()
        .expect("finished spans")
        .into_iter()
        .map(|s| {
            assert!(
                !s.attributes
                    .iter()
                    .any(|kv| kv.key.as_str() == SERVICE_FIELD),
                "the routing mark is not exported: {s:?}"
            );
            s.name.into_owned()
        })
        .collect();
    names.sort();
    names
}

#[test]
fn spans_go_to_the_tracer_of_their_crate_rpc_service_field_or_parent() {
    let (subscriber, providers) = routed();
    tracing::subscriber::with_default(subscriber, || {
        // A root span of the gateway's crate, and a child from a shared crate.
        let request = tracing::info_span!(target: "gateway_crate::http", "request");
        request.in_scope(|| {
            tracing::info_span!(target: "shared_crate", "gateway child").in_scope(|| {});
        });
        // A server span opened by shared code, routed by its gRPC service.
        let rpc = tracing::info_span!(
            target: "shared_crate::server",
            "rpc",
            rpc.service = "ecoscan.v1.ScanService"
        );
        rpc.set_parent(request.context())
            .expect("a parent before the span starts");
        let _ = tracing::info_span!(target: "shared_crate", parent: &rpc, "ingest child");
        // A background root span naming its service.
        let report = tracing::info_span!(
            target: "shared_crate",
            parent: None,
            "report",
            ecoscan.service = tracing::field::Empty
        );
        report.record(SERVICE_FIELD, "ingest");
        drop(report);
        let _ = tracing::info_span!(target: "unknown_crate", "nobody's");
        drop(rpc);
        drop(request);
        assert_eq!(
            current_service_in(tracing::info_span!(target: "ingest_crate", "x")),
            Some("ingest")
        );
    });
    assert_eq!(
        names(&providers["gateway"].1),
        ["gateway child", "request"],
        "the gateway's spans"
    );
    assert_eq!(
        names(&providers["ingest"].1),
        ["ingest child", "report", "rpc", "x"],
        "ingest's spans"
    );
    assert_eq!(names(&providers["suite"].1), ["nobody's"]);
}

fn current_service_in(span: tracing::Span) -> Option<&'static str> {
    // `current_service` reads the registry of the global dispatcher or of `with_default`'s.
    span.in_scope(current_service)
}

#[tokio::test]
async fn a_child_in_a_task_keeps_its_parents_service_and_trace() {
    let (subscriber, providers) = routed();
    let _guard = tracing::subscriber::set_default(subscriber);
    let request = tracing::info_span!(target: "gateway_crate", "request");
    async {
        tracing::info_span!(target: "shared_crate", "call").in_scope(|| tracing::info!("inside"));
    }
    .instrument(request.clone())
    .await;
    let trace_id = request.context().span().span_context().trace_id();
    drop(request);
    let spans = providers["gateway"].1.get_finished_spans().expect("spans");
    assert_eq!(spans.len(), 2, "{spans:?}");
    assert!(spans.iter().all(|s| s.span_context.trace_id() == trace_id));
}
