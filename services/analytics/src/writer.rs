//! Group commit: one task takes calls from every caller and forms batches; each batch's bodies
//! are written as one object and its rows with multi-row INSERTs in one transaction, then each
//! caller is acknowledged after the commit. Under a backlog a few full batches are written at
//! once ([`BatchOptions::max_in_flight`]): one batch's upload overlaps another's rows, and the
//! next batch forms meanwhile. When the stores fail (or take longer than the store timeout), the
//! batch goes to the [`Spool`] instead and the callers are acknowledged once it is on disk;
//! while the stores are known to be failing, new batches go to the spool at once.

use std::{collections::HashSet, sync::Arc, time::Duration};

use anyhow::Context;
use ecoscan_common::CancellationToken;
use tokio::{
    sync::{mpsc, oneshot},
    task::{JoinHandle, JoinSet},
    time::Instant,
};
use tracing::Instrument;

use bytes::Bytes;
use ecoscan_objects::ObjectStore;

pub use crate::{batch::Batch, metrics::WriterMetrics};
use crate::{
    metrics::SpoolMetrics,
    spool::{PushError, Spool},
    store::{CallRow, CallStore},
};

/// A validated call waiting to be written.
#[derive(Debug)]
pub struct NewCall {
    /// The row; the writer fills in the body location.
    pub row: CallRow,
    pub request_body: String,
    pub response_body: String,
}

/// What a caller learns once its call's batch is settled.
pub type Ack = Result<Accepted, Refused>;

/// The call is durably accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepted {
    /// Committed to the stores; `duplicate` when its id was already stored.
    Committed { duplicate: bool },
    /// The stores failed; the call is in the spool (fsynced) and will be written when they
    /// recover. Whether it repeats a stored id is not known yet.
    Spooled,
}

/// Nothing of the call's batch was stored (the cause is logged by the writer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The stores failed and the spool is full: `used` of `max` bytes.
    SpoolFull {
        used: u64,
        max: u64,
        retry_after: Duration,
    },
    /// The stores failed and the spool could not be written either.
    Unavailable,
}

struct Pending {
    call: NewCall,
    ack: oneshot::Sender<Ack>,
    /// The request that handed the call over (`Record`, `RecordStream`): the batch that writes
    /// it links to it.
    from: Option<ecoscan_common::telemetry::SpanContext>,
}

/// How batches are formed and written.
#[derive(Debug, Clone, Copy)]
pub struct BatchOptions {
    /// Most rows per batch (and per transaction).
    pub max_rows: usize,
    /// How long a batch waits for more rows after its first one when the queue is empty.
    pub linger: Duration,
    /// Calls queued for the writer at most; callers wait for room beyond it.
    pub queue_capacity: usize,
    /// Longest a batch may take to reach the stores before it is spooled instead.
    pub store_timeout: Duration,
    /// Batches being written at once, at most. One alone leaves the stores idle in turn: the
    /// object store while the rows commit, the database while the bodies upload, both while
    /// the next batch forms. Only a full batch (`max_rows`) goes out beside another; one that
    /// is not waits for the one on its way and then lingers, as with one at a time.
    pub max_in_flight: usize,
    /// The retry delay suggested to callers refused because the spool is full.
    pub full_retry_after: Duration,
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
    pub fn spawn(
        store: Arc<dyn CallStore>,
        bodies: Arc<dyn ObjectStore>,
        spool: Arc<Spool>,
        options: BatchOptions,
        metrics: WriterMetrics,
        spool_metrics: SpoolMetrics,
        stop: CancellationToken,
    ) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(options.queue_capacity.max(1));
        let target = Target {
            store,
            bodies,
            spool,
            options,
            metrics,
            spool_metrics,
        };
        let handle = tokio::spawn(run(target, rx, stop));
        (Self { tx }, handle)
    }

    /// Queues `call`, waiting while the queue is full (back-pressure), and returns where its
    /// acknowledgement will arrive.
    pub async fn submit(&self, call: NewCall) -> Result<oneshot::Receiver<Ack>, WriterClosed> {
        let (ack, rx) = oneshot::channel();
        self.tx
            .send(Pending {
                call,
                ack,
                from: ecoscan_common::telemetry::current_span_context(),
            })
            .await
            .map_err(|_| WriterClosed)?;
        Ok(rx)
    }
}

/// Where batches go.
struct Target {
    store: Arc<dyn CallStore>,
    bodies: Arc<dyn ObjectStore>,
    spool: Arc<Spool>,
    options: BatchOptions,
    metrics: WriterMetrics,
    spool_metrics: SpoolMetrics,
}

async fn run(target: Target, mut rx: mpsc::Receiver<Pending>, stop: CancellationToken) {
    let options = target.options;
    let max = options.max_rows.max(1);
    let max_in_flight = options.max_in_flight.max(1);
    let target = Arc::new(target);
    // Each batch is written by a task of its own, so that it progresses while this one forms
    // the next; a batch acknowledges its own callers, in whatever order the batches finish.
    let mut writing = JoinSet::new();
    let mut batch = Vec::with_capacity(max);
    loop {
        // At most `max_in_flight` batches at once: meanwhile calls queue (and callers wait once
        // the queue is full), so the next batch takes up to `max` of them at once.
        while writing.len() >= max_in_flight {
            reap(writing.join_next().await);
        }
        let received = tokio::select! {
            n = rx.recv_many(&mut batch, max) => n,
            () = stop.cancelled() => break,
        };
        if received == 0 {
            break;
        }
        linger(&mut rx, &mut batch, max, options.linger).await;
        // While a batch is on its way, one that is not full waits for it and takes calls
        // meanwhile: at a steady rate, two half batches would cost the stores twice the
        // requests for the same calls (the tail at 2,000/s doubled, measured); only a backlog,
        // which fills batches, has them written side by side. When the one on its way is done,
        // this one lingers as it would have after it with one batch at a time, so a steady
        // rate forms the same batches whatever `max_in_flight` is.
        while !writing.is_empty() && batch.len() < max {
            let room = max - batch.len();
            tokio::select! {
                done = writing.join_next() => {
                    reap(done);
                    linger(&mut rx, &mut batch, max, options.linger).await;
                    break;
                }
                n = rx.recv_many(&mut batch, room) => if n == 0 { break },
            }
        }
        spawn_write(&mut writing, &target, &mut batch);
    }
    // Stopping: refuse new calls, write everything already accepted.
    rx.close();
    while rx.recv_many(&mut batch, max).await > 0 {
        spawn_write(&mut writing, &target, &mut batch);
    }
    while let Some(done) = writing.join_next().await {
        reap(Some(done));
    }
}

/// Waits up to `linger` for company when the queue ran dry before `batch` filled to `max`: many
/// rows per transaction is what makes the throughput.
async fn linger(
    rx: &mut mpsc::Receiver<Pending>,
    batch: &mut Vec<Pending>,
    max: usize,
    linger: Duration,
) {
    let deadline = Instant::now() + linger;
    while batch.len() < max && !linger.is_zero() {
        let room = max - batch.len();
        tokio::select! {
            n = rx.recv_many(batch, room) => if n == 0 { break },
            () = tokio::time::sleep_until(deadline) => break,
        }
    }
}

/// Writes the calls in `batch` as one batch, by a task of its own; `batch` is left empty.
fn spawn_write(writing: &mut JoinSet<()>, target: &Arc<Target>, batch: &mut Vec<Pending>) {
    let full = std::mem::replace(batch, Vec::with_capacity(batch.capacity()));
    let target = Arc::clone(target);
    writing.spawn(async move { write_batch(&target, full).await });
}

/// A batch's task ended. It cannot fail by itself (each outcome is sent to its callers); a
/// panic is logged, and its callers, whose senders were dropped with it, get `UNAVAILABLE`.
fn reap(done: Option<Result<(), tokio::task::JoinError>>) {
    if let Some(Err(e)) = done {
        tracing::error!(error = %e, "a batch write task failed");
    }
}

/// Writes `batch`'s body object, then its rows in one transaction, within `timeout`; returns the
/// ids inserted. Safe to repeat: the object is rewritten with the same bytes, and rows already
/// stored are skipped.
pub(crate) async fn store_batch(
    store: &dyn CallStore,
    bodies: &dyn ObjectStore,
    batch: &Batch,
    timeout: Duration,
) -> anyhow::Result<HashSet<String>> {
    let write = async {
        if !batch.object.is_empty() {
            bodies
                .put(&batch.key, batch.object.clone())
                .await
                .context("failed to upload the batch's bodies")?;
        }
        Ok::<_, anyhow::Error>(store.insert_batch(&batch.rows).await?)
    };
    tokio::time::timeout(timeout, write)
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the stores took longer than {timeout:?}")))
}

/// Lays the batch out: one body object under a fresh key, each row pointing into it.
fn prepare(batch: &mut Vec<Pending>) -> (Batch, Vec<oneshot::Sender<Ack>>) {
    // All bodies of the batch go into one object: one PUT per batch, not one per call.
    let key = format!("{}.bin", uuid::Uuid::now_v7());
    let mut object = Vec::new();
    let mut rows = Vec::with_capacity(batch.len());
    let mut acks = Vec::with_capacity(batch.len());
    for Pending { call, ack, .. } in batch.drain(..) {
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
    let batch = Batch {
        key,
        object: Bytes::from(object),
        rows,
    };
    (batch, acks)
}

/// Writes the batch to the stores; `None` (and the stores marked failing) when that fails.
async fn write_direct(target: &Target, batch: &Batch) -> Option<HashSet<String>> {
    let started = std::time::Instant::now();
    match store_batch(
        &*target.store,
        &*target.bodies,
        batch,
        target.options.store_timeout,
    )
    .await
    {
        Ok(inserted) => {
            target.spool.store_write_succeeded();
            target
                .metrics
                .committed(batch.rows.len(), inserted.len(), started.elapsed());
            target.metrics.priced(&batch.rows, &inserted);
            Some(inserted)
        }
        Err(e) => {
            tracing::debug!(
                error = format!("{e:#}"),
                "writing a batch to the stores failed"
            );
            target.spool.store_write_failed(&e);
            None
        }
    }
}

async fn write_batch(target: &Target, mut batch: Vec<Pending>) {
    let span = tracing::info_span!(
        "analytics.write_batch",
        analytics.rows = batch.len(),
        analytics.duplicates = tracing::field::Empty,
        analytics.spooled = tracing::field::Empty,
    );
    // Batch links (the messaging conventions): to every request whose calls this batch writes,
    // each of which links to the model calls it reported.
    ecoscan_common::telemetry::link_to_each(&span, batch.iter().filter_map(|p| p.from.clone()));
    async {
        let (batch, acks) = prepare(&mut batch);
        let spool = &target.spool;
        // While the stores are known to fail, callers don't wait on them: the batch is spooled
        // at once (the replayer finds out when the stores are back).
        let tried = !spool.stores_down();
        if tried && let Some(inserted) = write_direct(target, &batch).await {
            ack_committed(&batch.rows, acks, inserted);
            return;
        }
        let outcome = match spool.push(&batch).await {
            Ok(()) => {
                tracing::Span::current().record("analytics.spooled", true);
                Ok(Accepted::Spooled)
            }
            Err(PushError::Full { used, max }) => {
                target.spool_metrics.refused(acks.len());
                tracing::warn!(
                    rows = acks.len(),
                    used,
                    max,
                    "the analytics stores fail and the spool is full; refusing the batch"
                );
                Err(Refused::SpoolFull {
                    used,
                    max,
                    retry_after: target.options.full_retry_after,
                })
            }
            Err(PushError::Io(e)) => {
                tracing::error!(
                    error = %e,
                    spool = %spool.dir().display(),
                    rows = acks.len(),
                    "failed to write a batch to the analytics spool"
                );
                // The stores may be back (with an empty spool, nothing else would find out).
                if !tried && let Some(inserted) = write_direct(target, &batch).await {
                    ack_committed(&batch.rows, acks, inserted);
                    return;
                }
                Err(Refused::Unavailable)
            }
        };
        for ack in acks {
            // A caller that went away no longer needs its answer.
            let _ = ack.send(outcome);
        }
    }
    .instrument(span)
    .await;
}

fn ack_committed(rows: &[CallRow], acks: Vec<oneshot::Sender<Ack>>, mut inserted: HashSet<String>) {
    let mut duplicates = 0_u64;
    for (row, ack) in rows.iter().zip(acks) {
        // The first occurrence of an inserted id takes it; any later one is a repeat.
        let duplicate = !inserted.remove(&row.call_id);
        duplicates += u64::from(duplicate);
        // A caller that went away no longer needs its answer; its row is stored.
        let _ = ack.send(Ok(Accepted::Committed { duplicate }));
    }
    tracing::Span::current().record("analytics.duplicates", duplicates);
}

fn len_i64(n: usize) -> i64 {
    i64::try_from(n).expect("a batch object is far below i64::MAX bytes")
}
