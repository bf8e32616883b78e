use std::{
    io,
    sync::{Arc, Mutex},
};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::{fmt::MakeWriter, layer::SubscriberExt as _};

use super::*;

/// Collects what the fmt layer writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn lines(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().expect("lock").clone())
            .expect("utf-8")
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Self;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Logs one line outside any span and one inside a traced span, in `json` or text, and
/// returns the lines with the span's trace and span id.
fn log_in_a_span(json: bool) -> (Vec<String>, String, String) {
    let provider = SdkTracerProvider::builder().build();
    let out = Captured::default();
    let (fmt, capture) = if json {
        let (format, capture) = with_trace_ids(tracing_subscriber::fmt::format().json(), true);
        (
            tracing_subscriber::fmt::layer()
                .json()
                .event_format(format)
                .with_writer(out.clone())
                .boxed(),
            capture,
        )
    } else {
        let (format, capture) =
            with_trace_ids(tracing_subscriber::fmt::format().with_ansi(false), false);
        (
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .event_format(format)
                .with_writer(out.clone())
                .boxed(),
            capture,
        )
    };
    let subscriber = tracing_subscriber::registry()
        .with(fmt)
        .with(capture)
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let (trace_id, span_id) = tracing::subscriber::with_default(subscriber, || {
        tracing::info!("outside");
        let span = tracing::info_span!("scan", job.id = "j1");
        span.in_scope(|| {
            tracing::info!(stage = "vision", "inside");
            let sc = tracing::Span::current()
                .context()
                .span()
                .span_context()
                .clone();
            (sc.trace_id().to_string(), sc.span_id().to_string())
        })
    });
    (out.lines(), trace_id, span_id)
}

#[test]
fn a_text_line_inside_a_span_ends_with_its_trace_and_span_id() {
    let (lines, trace_id, span_id) = log_in_a_span(false);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        !lines[0].contains("trace_id"),
        "outside a span: {}",
        lines[0]
    );
    assert!(
        lines[1].ends_with(&format!(" trace_id={trace_id} span_id={span_id}")),
        "{}",
        lines[1]
    );
    assert!(lines[1].contains("inside"), "{}", lines[1]);
    assert!(lines[1].contains("stage=\"vision\""), "{}", lines[1]);
}

#[test]
fn a_json_line_inside_a_span_has_trace_id_and_span_id_keys() {
    let (lines, trace_id, span_id) = log_in_a_span(true);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    let outside = json(&lines[0]);
    assert!(outside.get("trace_id").is_none(), "{outside}");
    let inside = json(&lines[1]);
    assert_eq!(inside["trace_id"], trace_id.as_str(), "{inside}");
    assert_eq!(inside["span_id"], span_id.as_str(), "{inside}");
    assert_eq!(inside["fields"]["message"], "inside", "{inside}");
    assert_eq!(inside["span"]["job.id"], "j1", "{inside}");
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}
