//! Moving a trace context (W3C trace-context and baggage) in and out of HTTP headers and of
//! carriers that outlive a request, such as queue entries.

use std::collections::HashMap;

use opentelemetry::{Context, trace::TraceContextExt};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use tracing_opentelemetry::OpenTelemetrySpanExt;

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
    if let Some(linked) = carrier_span_context(carrier) {
        span.add_link(linked);
    }
}

/// The span context `carrier` holds (written by [`current_carrier`]), to link to; `None` when
/// it holds no valid one.
pub fn carrier_span_context(
    carrier: &HashMap<String, String>,
) -> Option<opentelemetry::trace::SpanContext> {
    let sc = context_from_carrier(carrier).span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// The current span's own context, to link to later (a batch that carries what this request
/// handed over); `None` outside a trace.
pub fn current_span_context() -> Option<opentelemetry::trace::SpanContext> {
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// Links `span` to each of `contexts` (distinct ones once, at most [`MAX_LINKS`]): a batch's
/// span to the requests whose work it carries, by the messaging conventions' batch links.
pub fn link_to_each(
    span: &tracing::Span,
    contexts: impl IntoIterator<Item = opentelemetry::trace::SpanContext>,
) {
    let mut seen = std::collections::HashSet::new();
    for sc in contexts {
        if seen.len() == MAX_LINKS {
            break;
        }
        if sc.is_valid() && seen.insert((sc.trace_id(), sc.span_id())) {
            span.add_link(sc);
        }
    }
}

/// The most links [`link_to_each`] adds to one span: the OpenTelemetry SDK's default limit.
pub const MAX_LINKS: usize = 128;

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
