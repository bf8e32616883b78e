//! Span events per message of a stream: the OpenTelemetry RPC conventions' `message` events,
//! marked by hand ([`message_sent`], [`message_received`]) or read from a response body as it
//! goes out (gRPC framing, Server-Sent Events).

use std::time::Duration;

/// Target of the per-message stream events ([`message_sent`], [`message_received`]). They go to
/// traces (span events) but not to the log by default: a scan streams hundreds of messages.
pub const STREAM_TARGET: &str = "ecoscan_stream";

/// Marks one message a server-streaming RPC (or an SSE response) sent, as an event on the
/// current span: the OpenTelemetry RPC conventions' `message` event with `message.type = SENT`
/// and `message.id` (1, 2, … within the stream). `kind` says what the message was (`progress`,
/// `delta`, `stage`, …).
pub fn message_sent(id: u64, kind: &str) {
    tracing::event!(
        target: STREAM_TARGET,
        tracing::Level::INFO,
        { "rpc.message.type" = "SENT",
        rpc.message.id = id,
        rpc.message.kind = kind },
        "message"
    );
}

/// Marks one message a client-streaming RPC received, as an event on the current span.
pub fn message_received(id: u64, kind: &str) {
    tracing::event!(
        target: STREAM_TARGET,
        tracing::Level::INFO,
        { "rpc.message.type" = "RECEIVED",
        rpc.message.id = id,
        rpc.message.kind = kind },
        "message"
    );
}

/// A span event per gRPC message in a response body, for `TraceLayer::on_body_chunk`: walks the
/// gRPC length-prefixed framing (a flag byte and a 4-byte length per message) across chunks, so
/// every message a server stream sends is marked on the RPC span, whatever the handler.
#[derive(Clone, Debug, Default)]
pub struct GrpcMessageEvents {
    sent: u64,
    /// Bytes of the current message's prefix seen so far.
    prefix: Vec<u8>,
    /// Bytes of the current message's body still to skip.
    remaining: usize,
}

impl GrpcMessageEvents {
    /// Reads `buf` and returns how many messages started in it. (Its tests are the telemetry
    /// module's.)
    pub(super) fn feed(&mut self, mut buf: &[u8]) -> u64 {
        let mut started = 0;
        while !buf.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(buf.len());
                self.remaining -= n;
                buf = &buf[n..];
                continue;
            }
            let n = (5 - self.prefix.len()).min(buf.len());
            self.prefix.extend_from_slice(&buf[..n]);
            buf = &buf[n..];
            if self.prefix.len() == 5 {
                let len = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]);
                self.prefix.clear();
                self.remaining = len as usize;
                started += 1;
            }
        }
        started
    }
}

impl<B: AsRef<[u8]>> tower_http::trace::OnBodyChunk<B> for GrpcMessageEvents {
    fn on_body_chunk(&mut self, chunk: &B, _latency: Duration, span: &tracing::Span) {
        // Untraced calls (health, reflection) have no span to mark.
        if span.is_disabled() {
            return;
        }
        for _ in 0..self.feed(chunk.as_ref()) {
            self.sent += 1;
            span.in_scope(|| message_sent(self.sent, "grpc"));
        }
    }
}

/// A span event per Server-Sent Event in a response body, for `TraceLayer::on_body_chunk` on
/// an HTTP server: each `event:`/`data:` block is one message (its `event:` name as the kind);
/// comments such as `: keepalive` are not messages.
/// Only a body that starts as an event stream is read: a JSON answer (most answers; a finished
/// result is 4 KB) is recognised by its first byte and passed by untouched, where scanning it
/// for messages was 4 % of the gateway's CPU serving finished results.
#[derive(Clone, Debug, Default)]
pub struct SseMessageEvents {
    /// Messages marked so far (read by the telemetry module's tests).
    pub(super) sent: u64,
    /// Whether the body is an event stream, known from its first non-empty chunk.
    is_stream: Option<bool>,
}

/// Whether a body that starts with `chunk` is an event stream: every SSE block starts with a
/// field (`data`, `event`, `id`, `retry`) or a comment (`:`).
fn starts_an_event_stream(chunk: &[u8]) -> bool {
    chunk.starts_with(b":")
        || [&b"data:"[..], b"event:", b"id:", b"retry:"]
            .iter()
            .any(|field| chunk.starts_with(field))
}

/// The SSE messages in `text`, by their `event:` name (`message` when unnamed). (Its tests are
/// the telemetry module's.)
pub(super) fn sse_messages(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut kind = None;
            let mut is_message = false;
            for line in block.lines() {
                if let Some(name) = line.strip_prefix("event:") {
                    kind = Some(name.trim());
                }
                is_message |= line.starts_with("data:") || line.starts_with("event:");
            }
            is_message.then(|| kind.unwrap_or("message"))
        })
        .collect()
}

impl<B: AsRef<[u8]>> tower_http::trace::OnBodyChunk<B> for SseMessageEvents {
    fn on_body_chunk(&mut self, chunk: &B, _latency: Duration, span: &tracing::Span) {
        let chunk = chunk.as_ref();
        if span.is_disabled() || chunk.is_empty() {
            return;
        }
        if !*self
            .is_stream
            .get_or_insert_with(|| starts_an_event_stream(chunk))
        {
            return;
        }
        let Ok(text) = std::str::from_utf8(chunk) else {
            return;
        };
        for kind in sse_messages(text) {
            self.sent += 1;
            span.in_scope(|| message_sent(self.sent, kind));
        }
    }
}
