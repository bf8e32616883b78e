//! The replayer: the background task writing spooled batches to the stores, oldest first,
//! with backoff, deleting each file once the stores have taken it, and setting aside the files
//! that cannot be read or that the stores keep refusing.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_objects::ObjectStore;
use futures::{StreamExt, TryStreamExt};
use tokio::{task::JoinHandle, time::Instant};

use super::{
    files::{CORRUPT_DIR, REJECTED_DIR},
    format::len_u64,
    queue::{LoadError, Spool},
};
use crate::{
    batch::Batch,
    metrics::WriterMetrics,
    store::{CallRow, CallStore},
};

/// Failed attempts, with other writes succeeding between them, after which a batch is moved to
/// `rejected/` (about 25 s of retries with the default backoff).
pub const STRIKES_BEFORE_REJECT: u32 = 8;
/// Body objects uploaded at once by one replay.
const PUT_CONCURRENCY: usize = 16;
/// First delay between replay attempts after a failure (it doubles up to the configured most).
const RETRY_MIN: Duration = Duration::from_millis(100);

/// How the replayer retries.
#[derive(Debug, Clone, Copy)]
pub struct ReplayOptions {
    /// Longest one attempt to write to the stores may take.
    pub store_timeout: Duration,
    /// Longest pause between attempts while the stores keep failing.
    pub retry_max: Duration,
    /// Most rows one replay writes in one transaction (a single spooled batch may hold more).
    pub max_rows: usize,
}

/// The pause after the `n`th failure in a row: 100 ms doubling up to `max`.
pub(super) fn backoff(n: u32, max: Duration) -> Duration {
    RETRY_MIN
        .saturating_mul(1_u32 << n.saturating_sub(1).min(20))
        .min(max)
        .max(RETRY_MIN.min(max))
}

/// Starts the task writing spooled batches to the stores, oldest first, with backoff, until
/// `stop` is cancelled (what is left stays on disk for the next start).
pub fn spawn_replayer(
    spool: Arc<Spool>,
    store: Arc<dyn CallStore>,
    bodies: Arc<dyn ObjectStore>,
    options: ReplayOptions,
    metrics: WriterMetrics,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(replay(spool, store, bodies, options, metrics, stop))
}

/// A batch that failed on its own and waits before its next attempt.
struct Parked {
    failures: u32,
    retry_at: Instant,
    /// `Spool::store_writes` at its first failure: when writes succeed after it while this batch
    /// keeps failing, the batch is at fault.
    writes_at_first_failure: u64,
}

async fn replay(
    spool: Arc<Spool>,
    store: Arc<dyn CallStore>,
    bodies: Arc<dyn ObjectStore>,
    options: ReplayOptions,
    metrics: WriterMetrics,
    stop: CancellationToken,
) {
    let mut parked: HashMap<u64, Parked> = HashMap::new();
    // After a group failed, batches go one at a time until one succeeds, so a bad one is found.
    let mut one_at_a_time = false;
    let mut failures_in_a_row = 0_u32;
    // The batch whose attempt just failed on its own: the next attempt tries another one when
    // there is one, so a batch at fault cannot keep the others from the stores.
    let mut last_failed: Option<u64> = None;
    let mut replayed_since_empty = 0_u64;
    loop {
        parked.retain(|&seq, _| spool.contains(seq));
        let now = Instant::now();
        let mut ready = spool.oldest(|seq| parked.get(&seq).is_none_or(|p| p.retry_at <= now));
        if ready.is_empty() {
            if replayed_since_empty > 0 && spool.batches() == 0 {
                tracing::info!(
                    batches = replayed_since_empty,
                    "the analytics spool is empty: every spooled batch is stored"
                );
                replayed_since_empty = 0;
            }
            let next_due = parked.values().map(|p| p.retry_at).min();
            tokio::select! {
                () = spool.wake.notified() => {}
                () = async {
                    match next_due {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
                () = stop.cancelled() => return,
            }
            continue;
        }
        if let Some(failed) = last_failed
            && ready.len() > 1
        {
            ready.retain(|&seq| seq != failed);
        }
        if one_at_a_time {
            ready.truncate(1);
        }

        let mut group: Vec<(u64, Batch)> = Vec::with_capacity(ready.len());
        let mut rows = 0;
        for seq in ready {
            match spool.load(seq).await {
                Ok(batch) => {
                    if !group.is_empty() && rows + batch.rows.len() > options.max_rows {
                        break;
                    }
                    rows += batch.rows.len();
                    group.push((seq, batch));
                }
                Err(LoadError::Missing) => {
                    tracing::warn!(seq, "a spooled batch's file is gone; skipping it");
                    spool.forget(seq);
                }
                Err(LoadError::Corrupt(e)) => {
                    let to = spool.set_aside(seq, CORRUPT_DIR).await;
                    spool.metrics.corrupt.inc();
                    tracing::error!(
                        error = format!("{e:#}"),
                        moved_to = %to.display(),
                        "a spool file is unreadable (truncated or corrupt); moved aside, its calls are not replayed"
                    );
                }
            }
        }
        if group.is_empty() {
            continue;
        }

        let attempt = tokio::select! {
            r = tokio::time::timeout(options.store_timeout, store_group(&*store, &*bodies, &group)) => {
                r.unwrap_or_else(|_| Err(anyhow::anyhow!(
                    "the stores took longer than {:?}", options.store_timeout
                )))
            }
            // Abandoning the attempt is safe: the replay at the next start writes the same.
            () = stop.cancelled() => return,
        };
        match attempt {
            Ok(inserted) => {
                // Counted before the files go, so the series agree whenever the spool looks
                // empty.
                let recorded =
                    stored_by_these_batches(&*store, &group, &inserted, options.store_timeout)
                        .await;
                metrics.replayed(recorded);
                metrics.priced(group.iter().flat_map(|(_, b)| &b.rows), &inserted);
                spool.metrics.replayed.inc_by(len_u64(group.len()));
                for (seq, _) in &group {
                    spool.remove(*seq).await;
                }
                spool.store_write_succeeded();
                replayed_since_empty += len_u64(group.len());
                tracing::debug!(
                    batches = group.len(),
                    rows,
                    inserted = inserted.len(),
                    "replayed spooled batches"
                );
                failures_in_a_row = 0;
                one_at_a_time = false;
                last_failed = None;
            }
            Err(e) => {
                failures_in_a_row += 1;
                spool.store_write_failed(&e);
                if failures_in_a_row == 1 || failures_in_a_row.is_multiple_of(10) {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        batches = group.len(),
                        waiting = spool.batches(),
                        failures_in_a_row,
                        "replaying the analytics spool failed; retrying with backoff"
                    );
                }
                if group.len() > 1 {
                    one_at_a_time = true;
                    last_failed = None;
                } else {
                    let seq = group[0].0;
                    last_failed = Some(seq);
                    let writes = spool.store_writes();
                    let p = parked.entry(seq).or_insert(Parked {
                        failures: 0,
                        retry_at: Instant::now(),
                        writes_at_first_failure: writes,
                    });
                    p.failures += 1;
                    p.retry_at = Instant::now() + backoff(p.failures, options.retry_max);
                    if p.failures >= STRIKES_BEFORE_REJECT && writes > p.writes_at_first_failure {
                        let to = spool.set_aside(seq, REJECTED_DIR).await;
                        spool.metrics.rejected.inc();
                        tracing::error!(
                            error = format!("{e:#}"),
                            attempts = p.failures,
                            rows = group[0].1.rows.len(),
                            moved_to = %to.display(),
                            "the stores keep refusing a spooled batch while taking others; moved \
                             it aside (move it back into the spool directory to replay it at the \
                             next start)"
                        );
                        parked.remove(&seq);
                        // That failure was the batch's, not the stores': trust them again.
                        spool.stores_down.store(false, Ordering::Relaxed);
                    }
                }
                let pause = backoff(failures_in_a_row, options.retry_max);
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = stop.cancelled() => return,
                }
            }
        }
    }
}

/// How many calls of `group` are stored by these very batches: those the replay inserted, plus
/// those an earlier attempt committed although it reported failure (a timeout or a lost
/// connection after COMMIT, or a crash before the spool file was deleted). Those are told from a
/// repeat of the call id by their row: the same `recorded_at_us` and body key. Counted for
/// `analytics_calls_recorded_total` only; when the reads fail, only the inserted are counted.
async fn stored_by_these_batches(
    store: &dyn CallStore,
    group: &[(u64, Batch)],
    inserted: &HashSet<String>,
    timeout: Duration,
) -> usize {
    let mut seen: HashSet<&str> = HashSet::new();
    let earlier: Vec<&CallRow> = group
        .iter()
        .flat_map(|(_, b)| &b.rows)
        .filter(|r| !inserted.contains(&r.call_id) && seen.insert(&r.call_id))
        .collect();
    if earlier.is_empty() {
        return inserted.len();
    }
    let check = async {
        let mut n = 0;
        for row in earlier {
            if let Some(stored) = store.get(&row.call_id).await?
                && stored.recorded_at_us == row.recorded_at_us
                && stored.body_key == row.body_key
            {
                n += 1;
            }
        }
        anyhow::Ok(n)
    };
    match tokio::time::timeout(timeout, check).await {
        Ok(Ok(n)) => inserted.len() + n,
        Ok(Err(e)) => {
            tracing::debug!(
                error = format!("{e:#}"),
                "could not check which replayed calls were stored before"
            );
            inserted.len()
        }
        Err(_) => {
            tracing::debug!("checking which replayed calls were stored before took too long");
            inserted.len()
        }
    }
}

/// Uploads each batch's body object again (same key, same bytes) and inserts all their rows in
/// one transaction.
async fn store_group(
    store: &dyn CallStore,
    bodies: &dyn ObjectStore,
    group: &[(u64, Batch)],
) -> anyhow::Result<HashSet<String>> {
    futures::stream::iter(group.iter().filter(|(_, b)| !b.object.is_empty()))
        .map(Ok)
        .try_for_each_concurrent(PUT_CONCURRENCY, |(_, b)| {
            bodies.put(&b.key, b.object.clone())
        })
        .await
        .context("failed to upload a spooled batch's bodies")?;
    if let [(_, only)] = group {
        return Ok(store.insert_batch(&only.rows).await?);
    }
    let rows: Vec<CallRow> = group
        .iter()
        .flat_map(|(_, b)| b.rows.iter().cloned())
        .collect();
    Ok(store.insert_batch(&rows).await?)
}
