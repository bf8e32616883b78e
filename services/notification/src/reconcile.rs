//! Puts scheduled notifications the scheduler lost back on it.
//!
//! The row store is the truth: a notification is due for delivery while its row is `scheduled`.
//! The scheduler (Redis' schedule) can lose entries behind the rows' back: an add that failed after
//! the row was written (Redis down or too slow), or a Redis that came back empty (a restart
//! without persistence, `FLUSHALL`, a failover to a replica that had not caught up). A sweep
//! walks the scheduled rows, earliest due first, in pages, and hands each page to
//! [`Scheduler::add_missing`], which adds only ids that are neither waiting nor claimed (one
//! atomic script per page on Redis). Sweeps run every `NOTIFICATION_RECONCILE_INTERVAL`, soon after
//! the Redis subscription comes back from a lost connection, and soon after an add failed.
//!
//! Exactly-once delivery does not rest on the sweep: delivery is the row's guarded update
//! `scheduled` → `delivered` (`NotificationStore::mark_delivered`), and only the caller whose
//! update matched publishes. A sweep racing a delivery can at worst hand an id out once more;
//! that claim finds the row delivered and publishes nothing.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use ecoscan_common::CancellationToken;

use crate::{
    metrics::NotificationMetrics,
    scheduler::{Scheduler, SchedulerError},
    store::{NotificationStore, StoreError},
};

/// Scheduled rows read per page (one SQL query, one scheduler call).
pub const PAGE: usize = 1000;
/// The shortest time between two sweeps, whatever asks for them (the interval when shorter).
const MIN_GAP: Duration = Duration::from_secs(1);

pub use crate::kick::Kick;

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// Scheduled rows looked at.
    pub checked: usize,
    /// Of those, how many the scheduler was missing and got back.
    pub restored: usize,
}

/// Walks the scheduled rows earliest due first, at most `limit` of them (all when `None`), and
/// gives the scheduler back every one it is missing. Each page restored counts in `metrics` as
/// it goes, so a sweep that fails halfway still counts what it restored.
// A trace of its own per sweep, named for what it does: the loop that runs it lives as long as
// the process, and its statements under a span that never ends would reach the trace backend
// as orphans (or as context-free `SELECT notifications` traces).
#[tracing::instrument(name = "reconcile scheduled notifications", parent = None, skip_all)]
pub async fn sweep(
    store: &dyn NotificationStore,
    scheduler: &dyn Scheduler,
    limit: Option<usize>,
    metrics: &NotificationMetrics,
) -> anyhow::Result<Swept> {
    let mut swept = Swept::default();
    let mut after: Option<(i64, String)> = None;
    loop {
        let want = limit.map_or(PAGE, |l| PAGE.min(l - swept.checked));
        if want == 0 {
            break;
        }
        let page = store
            .scheduled_page(after.as_ref().map(|(due, id)| (*due, id.as_str())), want)
            .await?;
        swept.checked += page.len();
        if !page.is_empty() {
            let restored = scheduler.add_missing(&page).await?;
            metrics.reconciled(restored);
            swept.restored += restored;
        }
        if page.len() < want {
            break;
        }
        after = page.last().map(|(id, due)| (*due, id.clone()));
    }
    Ok(swept)
}

/// Waits between reload attempts at start: the first, and the most.
const RELOAD_FIRST_RETRY: Duration = Duration::from_secs(1);
const RELOAD_MAX_RETRY: Duration = Duration::from_secs(30);

/// The reload at start: [`sweep`] over every scheduled row. Tried again, 1 s doubling to 30 s
/// apart, for as long as a store is unavailable — a pooler with no server connection free, a
/// database or Redis still starting — so that the service waits for its stores instead of
/// exiting (and taking `ecoscan up`'s other services with it). `None` when `stop` came first;
/// an error that trying again cannot mend (a row that does not decode, a refused command) is
/// returned at once.
pub async fn reload(
    store: &dyn NotificationStore,
    scheduler: &dyn Scheduler,
    stop: &CancellationToken,
) -> anyhow::Result<Option<Swept>> {
    let uncounted = NotificationMetrics::default();
    let attempt = || sweep(store, scheduler, None, &uncounted);
    let retried = attempt
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(RELOAD_FIRST_RETRY)
                .with_max_delay(RELOAD_MAX_RETRY)
                .without_max_times()
                .with_jitter(),
        )
        .when(is_transient)
        .notify(|e, after| {
            tracing::warn!(
                error = %format!("{e:#}"),
                retry_in = ?after,
                "could not reload the scheduled notifications, a store is unavailable; \
                 trying again (the service answers once they are loaded)"
            );
        });
    tokio::select! {
        () = stop.cancelled() => Ok(None),
        reloaded = retried => reloaded
            .map(Some)
            .context("failed to reload the scheduled notifications"),
    }
}

/// Whether [`sweep`]'s error may pass when tried again: the database or Redis unavailable.
pub fn is_transient(e: &anyhow::Error) -> bool {
    if let Some(e) = e.downcast_ref::<StoreError>() {
        return e.is_transient();
    }
    e.downcast_ref::<SchedulerError>()
        .is_some_and(SchedulerError::is_transient)
}

/// When the reconcile loop sweeps and how much.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Between two sweeps when nothing asks for one sooner.
    pub interval: Duration,
    /// Scheduled rows one sweep looks at, earliest due first. Later ones come into view as the
    /// earlier ones are delivered; they are due later, so they are restored before their time
    /// unless more than this many fall due within one interval.
    pub limit: usize,
}

/// Sweeps every `settings.interval`, and soon after `kick` asks, until `stop` is cancelled. A
/// failed sweep (the database or Redis unavailable) is retried after 1 s, 2 s, 4 s … up to the
/// interval; a kick brings the retry forward. Sweeps are at least a second apart (the interval,
/// when that is shorter), however often they are asked for.
pub async fn run(
    store: Arc<dyn NotificationStore>,
    scheduler: Arc<dyn Scheduler>,
    metrics: NotificationMetrics,
    settings: Settings,
    kick: Kick,
    stop: CancellationToken,
) {
    let gap = MIN_GAP.min(settings.interval);
    let mut delay = settings.interval;
    let mut backoff = gap;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
            () = kick.asked() => {}
        }
        let started = Instant::now();
        let result = sweep(&*store, &*scheduler, Some(settings.limit), &metrics).await;
        metrics.reconcile_swept(started.elapsed(), result.is_ok());
        match result {
            Ok(swept) => {
                if swept.restored > 0 {
                    tracing::warn!(
                        checked = swept.checked,
                        restored = swept.restored,
                        "scheduled notifications were missing from the scheduler; restored them"
                    );
                } else {
                    tracing::debug!(
                        checked = swept.checked,
                        "reconcile sweep found nothing missing"
                    );
                }
                delay = settings.interval;
                backoff = gap;
            }
            Err(e) => {
                tracing::warn!(error = ?e, retry_in = ?backoff, "reconcile sweep failed");
                delay = backoff;
                backoff = (backoff * 2).min(settings.interval.max(gap));
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(gap) => {}
        }
        delay = delay.saturating_sub(gap);
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use ecoscan_redis::redis::RedisError;

    use super::*;

    fn redis(e: RedisError) -> anyhow::Error {
        SchedulerError::redis("add missing notifications")(e).into()
    }

    #[test]
    fn an_unavailable_store_is_tried_again_and_a_broken_one_is_not() {
        // What a pooler with no server connection free, or a database still starting, gives.
        assert!(is_transient(
            &StoreError::from(sqlx::Error::PoolTimedOut).into()
        ));
        assert!(is_transient(
            &StoreError::from(sqlx::Error::Io(io::ErrorKind::ConnectionRefused.into())).into()
        ));
        assert!(is_transient(&redis(
            io::Error::from(io::ErrorKind::ConnectionRefused).into()
        )));
        assert!(is_transient(&redis(
            io::Error::from(io::ErrorKind::TimedOut).into()
        )));
        // A row no version writes, a command Redis refuses, anything else: no use trying again.
        assert!(!is_transient(
            &StoreError::Corrupt("due_at is not a number".into()).into()
        ));
        assert!(!is_transient(&redis(RedisError::from((
            ecoscan_redis::redis::ServerErrorKind::ResponseError.into(),
            "ERR unknown command",
        )))));
        assert!(!is_transient(&anyhow::anyhow!("something else")));
    }
}
