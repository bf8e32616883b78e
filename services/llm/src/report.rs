//! Reporting every model call to the analytics service without ever slowing the caller.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use backon::{ExponentialBuilder, Retryable};
use ecoscan_proto::v1::{
    LlmCall, RecordStreamRequest, analytics_service_client::AnalyticsServiceClient,
};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use tokio::sync::mpsc;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Calls buffered in memory before new ones are dropped (and counted).
pub const DEFAULT_BUFFER: usize = 1024;
/// Calls sent on one `RecordStream`.
const MAX_BATCH: usize = 256;
const SEND_DEADLINE: Duration = Duration::from_secs(10);
/// At most one "dropped" warning per this interval; the counter keeps the exact number.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Sends [`LlmCall`]s to `AnalyticsService.RecordStream` from a background task.
///
/// `report` never waits: calls go into a bounded buffer, and when it is full (analytics slow or
/// down) the call is dropped, counted in [`AnalyticsReporter::dropped`] and warned about. A
/// batch that still fails after a few retries is dropped the same way. Clones share the buffer;
/// the background task ends once every clone is gone and the buffer is drained.
///
/// Tracing: one `RecordStream` carries calls from many traces, so each batch is sent from a
/// `report llm calls` span that links every reported call's span (in Jaeger: "references").
/// When all calls of a batch belong to one trace — a single scan's call, the usual case below
/// saturation — that span is also a child of the call's span, so analytics' side of the report
/// shows up inside the scan's trace. A mixed batch is a trace of its own; each call still
/// carries its `trace_id` in the stored record.
#[derive(Clone)]
pub struct AnalyticsReporter {
    inner: Arc<Inner>,
}

/// A call to report and the span of the call it records (invalid when there was none).
struct Reported {
    call: LlmCall,
    span: SpanContext,
    /// The service that made the call, when several share the process (`ecoscan up`): the
    /// report span is exported as that service's.
    service: Option<&'static str>,
}

struct Inner {
    tx: mpsc::Sender<Reported>,
    counters: Arc<Counters>,
    last_warning: Mutex<Option<Instant>>,
}

struct Counters {
    dropped: AtomicU64,
    sent: AtomicU64,
    /// Calls queued for the background task so far.
    queued: AtomicU64,
    /// Calls the background task is done with (acknowledged or dropped), in queue order.
    settled: tokio::sync::watch::Sender<u64>,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            dropped: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            settled: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl AnalyticsReporter {
    /// A reporter for the analytics service at `url` (e.g. `http://127.0.0.1:50056`). Connects
    /// lazily; must be called inside a Tokio runtime.
    pub fn new(url: &str) -> anyhow::Result<Self> {
        Self::with_buffer(url, DEFAULT_BUFFER)
    }

    /// Like [`AnalyticsReporter::new`] with a buffer of `capacity` calls.
    pub fn with_buffer(url: &str, capacity: usize) -> anyhow::Result<Self> {
        let client = AnalyticsServiceClient::new(ecoscan_common::client::channel(url)?);
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let counters = Arc::new(Counters::default());
        // Deliberately not instrumented: sends must not join the trace of whichever call
        // happened to be first in the batch.
        tokio::spawn(drain(client, rx, counters.clone()));
        Ok(Self {
            inner: Arc::new(Inner {
                tx,
                counters,
                last_warning: Mutex::new(None),
            }),
        })
    }

    /// Queues `call` for sending; never waits. Call it inside the model call's span: the
    /// report links to it.
    pub fn report(&self, call: LlmCall) {
        let span = tracing::Span::current()
            .context()
            .span()
            .span_context()
            .clone();
        let service = ecoscan_common::telemetry::current_service();
        // Counted before sending: the background task may settle the call at once.
        self.inner.counters.queued.fetch_add(1, Ordering::SeqCst);
        if self
            .inner
            .tx
            .try_send(Reported {
                call,
                span,
                service,
            })
            .is_err()
        {
            self.inner.counters.queued.fetch_sub(1, Ordering::SeqCst);
            let total = self.inner.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            self.warn_dropped(total);
        }
    }

    /// Waits until every call reported so far has reached analytics (or was given up on), for
    /// at most `within`; false if the time ran out. A stage calls it before it answers: once
    /// its answer is out, the process may be killed, and a report still in this process's
    /// memory would be lost with it. Bounded, so an analytics outage slows stages by at most
    /// `within` and loses nothing that the background retries can still deliver.
    pub async fn settled(&self, within: Duration) -> bool {
        let target = self.inner.counters.queued.load(Ordering::SeqCst);
        let mut settled = self.inner.counters.settled.subscribe();
        tokio::time::timeout(within, settled.wait_for(|n| *n >= target))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Calls dropped so far (buffer full, or analytics unreachable after retries).
    pub fn dropped(&self) -> u64 {
        self.inner.counters.dropped.load(Ordering::Relaxed)
    }

    /// Calls acknowledged by analytics so far.
    pub fn sent(&self) -> u64 {
        self.inner.counters.sent.load(Ordering::Relaxed)
    }

    fn warn_dropped(&self, total: u64) {
        let mut last = self
            .inner
            .last_warning
            .lock()
            .expect("warning lock is never poisoned");
        if last.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!(
                dropped_total = total,
                "analytics buffer full, llm call reports are being dropped"
            );
        }
    }
}

type Client = AnalyticsServiceClient<ecoscan_common::client::TracedChannel>;

async fn drain(client: Client, mut rx: mpsc::Receiver<Reported>, counters: Arc<Counters>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let reported = std::mem::take(&mut batch);
        let span = report_span(&reported);
        // Analytics records for a caller that proves who it is: the service reporting its
        // own model calls.
        let actor = reported.iter().find_map(|r| r.service).unwrap_or("llm");
        let calls: Vec<LlmCall> = reported.into_iter().map(|r| r.call).collect();
        let n = calls.len() as u64;
        let send = || {
            let mut client = client.clone();
            let calls = calls.clone();
            async move {
                client
                    .record_stream(ecoscan_common::client::by_actor(
                        ecoscan_common::client::request(
                            tokio_stream::iter(
                                calls
                                    .into_iter()
                                    .map(|call| RecordStreamRequest { call: Some(call) }),
                            ),
                            SEND_DEADLINE,
                        ),
                        actor,
                    ))
                    .await
            }
        };
        let result = send
            // Long enough to outlast a restart of analytics (a few seconds): while a batch
            // waits, new calls queue in the buffer; only a longer outage drops calls.
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(5))
                    .with_max_times(8)
                    .with_jitter(),
            )
            .sleep(tokio::time::sleep)
            .instrument(span)
            .await;
        match result {
            Ok(_) => {
                counters.sent.fetch_add(n, Ordering::Relaxed);
                counters.settled.send_modify(|s| *s += n);
            }
            Err(status) => {
                let total = counters.dropped.fetch_add(n, Ordering::Relaxed) + n;
                tracing::warn!(
                    calls = n,
                    dropped_total = total,
                    code = ?status.code(),
                    error = %status.message(),
                    "failed to report llm calls to analytics, dropping them"
                );
                counters.settled.send_modify(|s| *s += n);
            }
        }
    }
}

/// The span a batch is sent from: linked to every reported call's span, and a child of the
/// calls' span when they all belong to one trace (see [`AnalyticsReporter`]).
fn report_span(batch: &[Reported]) -> tracing::Span {
    let contexts: Vec<&SpanContext> = batch
        .iter()
        .map(|r| &r.span)
        .filter(|c| c.is_valid())
        .collect();
    let one_trace = contexts
        .first()
        .filter(|first| contexts.iter().all(|c| c.trace_id() == first.trace_id()));
    let span = tracing::info_span!(
        parent: None,
        "analytics.report",
        otel.name = "report llm calls",
        otel.kind = "client",
        llm.calls = i64::try_from(batch.len()).unwrap_or(i64::MAX),
        llm.traces_joined = one_trace.is_some(),
        ecoscan.service = tracing::field::Empty,
    );
    if let Some(service) = batch.iter().find_map(|r| r.service) {
        span.record(ecoscan_common::telemetry::SERVICE_FIELD, service);
    }
    if let Some(parent) = one_trace {
        let _ = span
            .set_parent(opentelemetry::Context::new().with_remote_span_context((*parent).clone()));
    }
    for c in contexts {
        span.add_link(c.clone());
    }
    span
}
