//! Group commit: one task takes calls from every caller, writes each batch's bodies as one object
//! and its rows with multi-row INSERTs in one transaction, then acknowledges each caller after the
//! commit.

use std::{sync::Arc, time::Duration};

use ecoscan_common::CancellationToken;
use prometheus_client::metrics::{
    counter::Counter,
    histogram::{Histogram, exponential_buckets},
};
use tokio::{
    sync::{mpsc, oneshot},
    task::JoinHandle,
    time::Instant,
};
use tracing::Instrument;

use bytes::Bytes;
use ecoscan_objects::ObjectStore;

use crate::store::{CallRow, CallStore};

/// A validated call waiting to be written.
#[derive(Debug)]
pub struct NewCall {
    /// The row; the writer fills in the body location.
    pub row: CallRow,
    pub request_body: String,
    pub response_body: String,
}

/// What a caller learns once its call's batch is settled: `Ok(duplicate)` after the commit, or
/// `Err` when the batch could not be written (the cause is logged by the writer).
pub type Ack = Result<bool, BatchFailed>;

/// The batch holding the call failed to be written; nothing of it was committed.
#[derive(Debug, Clone, Copy)]
pub struct BatchFailed;

struct Pending {
    call: NewCall,
    ack: oneshot::Sender<Ack>,
}

/// How batches are formed.
#[derive(Debug, Clone, Copy)]
pub struct BatchOptions {
    /// Most rows per batch (and per transaction).
    pub max_rows: usize,
    /// How long a batch waits for more rows after its first one when the queue is empty.
    pub linger: Duration,
    /// Calls queued for the writer at most; callers wait for room beyond it.
    pub queue_capacity: usize,
}

/// Handle to the writer task; cheap to clone.
#[derive(Debug, Clone)]
pub struct Writer {
    tx: mpsc::Sender<Pending>,
}

/// The writer has stopped (the server is shutting down).
#[derive(Debug, Clone, Copy)]
pub struct WriterClosed;

impl Writer {
    /// Starts the writer task. Cancelling `stop` makes it write what is already queued, refuse
    /// new calls and end.
    pub fn spawn<S: CallStore>(
        store: Arc<S>,
        bodies: Arc<dyn ObjectStore>,
        options: BatchOptions,
        metrics: WriterMetrics,
        stop: CancellationToken,
    ) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(options.queue_capacity.max(1));
        let handle = tokio::spawn(run(store, bodies, rx, options, metrics, stop));
        (Self { tx }, handle)
    }

    /// Queues `call`, waiting while the queue is full (back-pressure), and returns where its
    /// acknowledgement will arrive.
    pub async fn submit(&self, call: NewCall) -> Result<oneshot::Receiver<Ack>, WriterClosed> {
        let (ack, rx) = oneshot::channel();
        self.tx
            .send(Pending { call, ack })
            .await
            .map_err(|_| WriterClosed)?;
        Ok(rx)
    }
}

async fn run<S: CallStore>(
    store: Arc<S>,
    bodies: Arc<dyn ObjectStore>,
    mut rx: mpsc::Receiver<Pending>,
    options: BatchOptions,
    metrics: WriterMetrics,
    stop: CancellationToken,
) {
    let max = options.max_rows.max(1);
    let mut batch = Vec::with_capacity(max);
    loop {
        let received = tokio::select! {
            n = rx.recv_many(&mut batch, max) => n,
            () = stop.cancelled() => break,
        };
        if received == 0 {
            return;
        }
        // Wait a little for company when the queue ran dry before the batch filled: many rows
        // per transaction is what makes the throughput.
        let deadline = Instant::now() + options.linger;
        while batch.len() < max && !options.linger.is_zero() {
            let room = max - batch.len();
            tokio::select! {
                n = rx.recv_many(&mut batch, room) => if n == 0 { break },
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        write_batch(&*store, &*bodies, &mut batch, &metrics).await;
    }
    // Stopping: refuse new calls, write everything already accepted.
    rx.close();
    while rx.recv_many(&mut batch, max).await > 0 {
        write_batch(&*store, &*bodies, &mut batch, &metrics).await;
    }
}

async fn write_batch<S: CallStore>(
    store: &S,
    bodies: &dyn ObjectStore,
    batch: &mut Vec<Pending>,
    metrics: &WriterMetrics,
) {
    let span = tracing::info_span!(
        "analytics.write_batch",
        rows = batch.len(),
        duplicates = tracing::field::Empty
    );
    async {
        // All bodies of the batch go into one object: one PUT per batch, not one per call.
        let key = format!("{}.bin", uuid::Uuid::now_v7());
        let mut object = Vec::new();
        let mut rows = Vec::with_capacity(batch.len());
        let mut acks = Vec::with_capacity(batch.len());
        for Pending { call, ack } in batch.drain(..) {
            let NewCall {
                mut row,
                request_body,
                response_body,
            } = call;
            if !request_body.is_empty() || !response_body.is_empty() {
                row.body_key.clone_from(&key);
                row.body_offset = len_i64(object.len());
                row.request_len = len_i64(request_body.len());
                row.response_len = len_i64(response_body.len());
                object.extend_from_slice(request_body.as_bytes());
                object.extend_from_slice(response_body.as_bytes());
            }
            rows.push(row);
            acks.push(ack);
        }
        let started = std::time::Instant::now();
        let written = async {
            if !object.is_empty() {
                bodies.put(&key, Bytes::from(object)).await?;
            }
            store.insert_batch(&rows).await
        }
        .await;
        match written {
            Ok(mut inserted) => {
                metrics.committed(rows.len(), inserted.len(), started.elapsed());
                let mut duplicates = 0_u64;
                for (row, ack) in rows.iter().zip(acks) {
                    // The first occurrence of an inserted id takes it; any later one is a repeat.
                    let duplicate = !inserted.remove(&row.call_id);
                    duplicates += u64::from(duplicate);
                    // A caller that went away no longer needs its answer; its row is stored.
                    let _ = ack.send(Ok(duplicate));
                }
                tracing::Span::current().record("duplicates", duplicates);
            }
            Err(e) => {
                tracing::error!(error = ?e, rows = rows.len(), "failed to write a batch of llm calls");
                for ack in acks {
                    let _ = ack.send(Err(BatchFailed));
                }
            }
        }
    }
    .instrument(span)
    .await;
}

fn len_i64(n: usize) -> i64 {
    i64::try_from(n).expect("a batch object is far below i64::MAX bytes")
}

/// The writer's Prometheus series. Cheap to clone; clones share the series.
#[derive(Clone, Debug)]
pub struct WriterMetrics {
    recorded: Counter,
    batch_rows: Histogram,
    commit: Histogram,
}

impl Default for WriterMetrics {
    /// Series registered nowhere (for tests that do not scrape).
    fn default() -> Self {
        Self {
            recorded: Counter::default(),
            batch_rows: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            commit: ecoscan_common::metrics::seconds_histogram(),
        }
    }
}

impl WriterMetrics {
    /// Registers `analytics_calls_recorded_total`, `analytics_batch_rows` and
    /// `analytics_commit_duration_seconds` in `metrics`.
    pub fn register(metrics: &mut ecoscan_common::metrics::Metrics) -> Self {
        let this = Self::default();
        let r = metrics.registry();
        r.register(
            "analytics_calls_recorded",
            "LLM calls committed (repeats of a call id not counted)",
            this.recorded.clone(),
        );
        r.register(
            "analytics_batch_rows",
            "Rows per committed batch (group commit)",
            this.batch_rows.clone(),
        );
        r.register(
            "analytics_commit_duration_seconds",
            "Time to write a batch: its bodies object and its rows in one transaction",
            this.commit.clone(),
        );
        this
    }

    fn committed(&self, rows: usize, inserted: usize, took: std::time::Duration) {
        self.recorded.inc_by(inserted as u64);
        self.batch_rows.observe(rows as f64);
        self.commit.observe(took.as_secs_f64());
    }
}
