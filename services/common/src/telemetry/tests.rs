use std::time::Duration;

use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{init::targets_only, messages::sse_messages, *};

fn frame(len: u32) -> Vec<u8> {
    let mut f = vec![0];
    f.extend_from_slice(&len.to_be_bytes());
    f.extend(std::iter::repeat_n(7, len as usize));
    f
}

#[test]
fn grpc_message_events_count_each_message_across_chunk_boundaries() {
    let mut body = frame(3);
    body.extend(frame(0));
    body.extend(frame(300));
    let mut one = GrpcMessageEvents::default();
    assert_eq!(one.feed(&body), 3, "three messages in one chunk");
    for split in [1, 2, 5, 6, 8, 9, 100] {
        let mut ev = GrpcMessageEvents::default();
        let (a, b) = body.split_at(split);
        assert_eq!(ev.feed(a) + ev.feed(b), 3, "split at {split}");
    }
    let mut bytewise = GrpcMessageEvents::default();
    assert_eq!(body.iter().map(|b| bytewise.feed(&[*b])).sum::<u64>(), 3);
}

#[test]
fn sse_messages_are_events_and_data_but_not_comments() {
    let text = "id: 1\nevent: stage\ndata: {}\n\n: keepalive\n\ndata: x\n\n";
    assert_eq!(sse_messages(text), ["stage", "message"]);
    assert!(sse_messages(":keepalive\n\n").is_empty());
}

#[test]
fn only_a_body_that_starts_as_an_event_stream_is_read_for_messages() {
    use tower_http::trace::OnBodyChunk as _;
    init_for_tests();
    let span = tracing::info_span!("request");
    let json = b"{\"text\":\"a\n\ndata: b\n\n\"}".to_vec();
    let mut events = SseMessageEvents::default();
    events.on_body_chunk(&json, Duration::ZERO, &span);
    events.on_body_chunk(&b"data: c\n\n".to_vec(), Duration::ZERO, &span);
    assert_eq!(events.sent, 0, "a JSON body is not an event stream");
    let mut events = SseMessageEvents::default();
    for chunk in [
        &b"retry: 1000\n\n"[..],
        b"id: 1\nevent: stage\ndata: {}\n\n",
        b": keepalive\n\n",
    ] {
        events.on_body_chunk(&chunk.to_vec(), Duration::ZERO, &span);
    }
    assert_eq!(events.sent, 1);
}

#[test]
fn the_carrier_keeps_the_callers_trace_and_baggage() {
    init_for_tests();
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "traceparent",
        http::HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    );
    headers.insert("baggage", http::HeaderValue::from_static("tenant=acme"));
    let span = tracing::info_span!("request");
    span.set_parent(context_from_headers(&headers))
        .expect("span accepts a parent before it starts");
    let (trace_id, carrier) = span.in_scope(|| (current_trace_id(), current_carrier()));
    assert_eq!(trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert!(
        carrier["traceparent"].starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
        "{carrier:?}"
    );
    assert!(
        !carrier["traceparent"].contains("00f067aa0ba902b7"),
        "the carrier names our span, not the caller's: {carrier:?}"
    );
    assert_eq!(
        carrier.get("baggage").map(String::as_str),
        Some("tenant=acme")
    );
    let back = context_from_carrier(&carrier);
    assert_eq!(
        back.span().span_context().trace_id().to_string(),
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
}

#[test]
fn the_resource_names_the_service_and_this_process() {
    let r = resource("vision");
    let get = |k: &'static str| r.get(&opentelemetry::Key::from_static_str(k));
    assert_eq!(
        get("service.name").map(|v| v.to_string()),
        Some("ecoscan-vision".into())
    );
    assert!(get("service.version").is_some());
    let a = get("service.instance.id").expect("instance id");
    let b = resource("vision")
        .get(&opentelemetry::Key::from_static_str("service.instance.id"))
        .expect("instance id");
    assert_ne!(a, b, "a fresh id per provider");
}

#[test]
fn target_and_level_filters_skip_span_tracking_and_span_directives_keep_it() {
    // The defaults and a usual RUST_LOG are decided per callsite, without span tracking.
    for spec in [
        DEFAULT_TRACE_FILTER,
        DEFAULT_LOG_FILTER,
        "debug",
        "ecoscan_ingest=trace,warn",
    ] {
        assert!(targets_only(spec).is_some(), "{spec}");
    }
    // Span and field directives would lose their meaning as target names.
    for spec in [
        "[rpc]=debug",
        "info,ecoscan_ingest[run]=trace",
        "ecoscan[{job.id}]=debug",
    ] {
        assert!(targets_only(spec).is_none(), "{spec}");
    }
    // A target-and-level filter still means what the EnvFilter did.
    let targets = targets_only("info,h2=off").unwrap();
    assert!(targets.would_enable("ecoscan_ingest::pipeline", &tracing::Level::INFO));
    assert!(!targets.would_enable("ecoscan_ingest::pipeline", &tracing::Level::DEBUG));
    assert!(!targets.would_enable("h2::proto::connection", &tracing::Level::ERROR));
}
