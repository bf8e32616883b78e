//! Log lines joined to traces: every line written inside a span carries the `trace_id` and
//! `span_id` of that span's OpenTelemetry span, in the text format (`… trace_id=… span_id=…`
//! at the end of the line) and in JSON (two top-level keys), so a log search can jump to the
//! trace and a trace to its logs.

use std::{
    fmt,
    sync::{Arc, OnceLock},
};

use opentelemetry::trace::TraceContextExt as _;
use tracing::{Dispatch, Event, Subscriber, dispatcher::WeakDispatch};
use tracing_subscriber::{
    Layer,
    fmt::{FmtContext, FormatEvent, FormatFields, format::Writer},
    registry::LookupSpan,
};

/// Wraps an event formatter (text or JSON) and adds the ids of the span the event is in.
pub struct WithTraceIds<F> {
    inner: F,
    json: bool,
    dispatch: Arc<OnceLock<WeakDispatch>>,
}

/// Captures the subscriber [`WithTraceIds`] runs in: the ids are read from the OpenTelemetry
/// layer through it. Install it in the same subscriber.
pub struct CaptureDispatch {
    dispatch: Arc<OnceLock<WeakDispatch>>,
}

impl<S: Subscriber> Layer<S> for CaptureDispatch {
    fn on_register_dispatch(&self, subscriber: &Dispatch) {
        let _ = self.dispatch.set(subscriber.downgrade());
    }
}

/// A formatter adding trace ids to `inner`'s lines (`json`: `inner` writes JSON objects), and
/// the layer that must sit in the same subscriber.
pub fn with_trace_ids<F>(inner: F, json: bool) -> (WithTraceIds<F>, CaptureDispatch) {
    let dispatch = Arc::new(OnceLock::new());
    (
        WithTraceIds {
            inner,
            json,
            dispatch: dispatch.clone(),
        },
        CaptureDispatch { dispatch },
    )
}

impl<F> WithTraceIds<F> {
    /// The trace and span id of the innermost span around `event` that has an OpenTelemetry
    /// span (spans kept out of traces by `ECOSCAN_TRACE_FILTER` lend their parent's).
    fn ids<S, N>(&self, ctx: &FmtContext<'_, S, N>) -> Option<(String, String)>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
        N: for<'w> FormatFields<'w> + 'static,
    {
        let dispatch = self.dispatch.get()?.upgrade()?;
        let scope = ctx.event_scope()?;
        scope.into_iter().find_map(|span| {
            let cx = tracing_opentelemetry::get_otel_context(&span.id(), &dispatch)?;
            let sc = cx.span().span_context().clone();
            sc.is_valid()
                .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
        })
    }
}

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let Some((trace_id, span_id)) = self.ids(ctx) else {
            return self.inner.format_event(ctx, writer, event);
        };
        // The line is formatted aside to add the ids; text loses its colours on the way.
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        let had_newline = line.ends_with('\n');
        let body = line.trim_end_matches('\n');
        if self.json {
            match body.strip_prefix('{') {
                Some(rest) => {
                    let sep = if rest.trim_start().starts_with('}') {
                        ""
                    } else {
                        ","
                    };
                    write!(
                        writer,
                        "{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"{sep}{rest}"
                    )?;
                }
                None => writer.write_str(body)?,
            }
        } else {
            write!(writer, "{body} trace_id={trace_id} span_id={span_id}")?;
        }
        if had_newline {
            writer.write_char('\n')?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
