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

// One module per concern, each re-exported here, so the API stays `telemetry::…` whatever
// module holds it: `init` installs the subscriber and the tracer providers, `export` builds
// what sends spans out, `messages` marks each message of a stream on its span, and
// `propagation` moves a trace context in and out of carriers, `status` marks a failed span.
mod export;
mod init;
pub mod log_ids;
mod messages;
mod propagation;
pub mod routing;
mod status;

pub use export::resource;
pub use init::{
    DEFAULT_LOG_FILTER, DEFAULT_TRACE_FILTER, TelemetryGuard, init, init_for_tests, init_routed,
};
pub use messages::{
    GrpcMessageEvents, STREAM_TARGET, SseMessageEvents, message_received, message_sent,
};
/// A span's context, as [`current_span_context`] returns it and [`link_to_each`] links to.
pub use opentelemetry::trace::SpanContext;
pub use propagation::{
    MAX_LINKS, carrier_span_context, context_from_carrier, context_from_headers, current_carrier,
    current_span_context, current_trace_id, inject_headers, link_to_carrier, link_to_each,
};
pub use routing::{SERVICE_FIELD, ServiceRoutes, current_service};
pub use status::record_error;

#[cfg(test)]
mod tests;
