//! How a span says it failed.

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
