//! Sending spans out: the OTLP exporter the environment asks for, run on the service's Tokio
//! runtime, and the resource each service's spans carry.

use std::{sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use opentelemetry::KeyValue;
use opentelemetry_sdk::{
    Resource,
    error::{OTelSdkError, OTelSdkResult},
    trace::{SdkTracerProvider, SpanData, SpanExporter},
};

/// Whether an OTLP endpoint is configured.
pub(super) fn export_enabled() -> bool {
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

/// A provider exporting under `service`'s resource (not installed globally).
pub(super) fn service_provider(service: &str, export: bool) -> anyhow::Result<SdkTracerProvider> {
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
