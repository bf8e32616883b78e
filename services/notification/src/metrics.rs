//! notification's Prometheus series: deliveries by kind, due-to-delivery lag, the scheduled
//! backlog, live subscribers, and what the reconcile sweeps restore.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use ecoscan_common::metrics::{Labels1, Metrics};
use prometheus_client::metrics::{
    counter::Counter, family::Family, gauge::Gauge, histogram::Histogram,
};

use crate::{hub::Hub, scheduler::Scheduler};

/// Distinct `kind` label values kept; later new kinds are counted as `other`. `kind` comes from
/// callers, so it must not be able to grow the series without bound.
const MAX_KINDS: usize = 32;

/// The series notification records into. Cheap to clone; clones share the series.
#[derive(Clone, Debug)]
pub struct NotificationMetrics {
    delivered: Family<Labels1, Counter>,
    lag: Histogram,
    kinds: Arc<Mutex<HashSet<String>>>,
    reconciled: Counter,
    reconcile_duration: Histogram,
    reconcile_failures: Counter,
}

impl Default for NotificationMetrics {
    /// Series registered nowhere (for tests that do not scrape).
    fn default() -> Self {
        Self {
            delivered: Family::default(),
            lag: ecoscan_common::metrics::seconds_histogram(),
            kinds: Arc::default(),
            reconciled: Counter::default(),
            reconcile_duration: ecoscan_common::metrics::seconds_histogram(),
            reconcile_failures: Counter::default(),
        }
    }
}

impl NotificationMetrics {
    /// Registers notification's series in `metrics`; the backlog is read from `scheduler` and
    /// the subscribers from `hub` at each scrape.
    pub fn register(metrics: &mut Metrics, scheduler: Arc<dyn Scheduler>, hub: Arc<Hub>) -> Self {
        let this = Self::default();
        let backlog = Gauge::<i64>::default();
        let r = metrics.registry();
        ecoscan_common::register_series! {
            r;
            ("notification_delivered", "Notifications delivered (published to live subscribers and marked delivered), by kind", this.delivered.clone());
            ("notification_delivery_lag_seconds", "Time from a scheduled notification's due time to its delivery", this.lag.clone());
            ("notification_scheduled_backlog", "Scheduled notifications not yet delivered (waiting plus claimed)", backlog.clone());
            ("notification_reconciled", "Scheduled notifications put back on the schedule after it lost them (reconcile sweeps and retried Schedule calls)", this.reconciled.clone());
            ("notification_reconcile_duration_seconds", "Duration of reconcile sweeps (failed ones included)", this.reconcile_duration.clone());
            ("notification_reconcile_failures", "Reconcile sweeps that failed (database or Redis unavailable); retried with backoff", this.reconcile_failures.clone());
        }
        metrics.gauge_fn(
            "notification_subscribers",
            "Live Subscribe streams in this process",
            move || i64::try_from(hub.subscribers()).unwrap_or(i64::MAX),
        );
        metrics.sample("notification_scheduled_backlog", move || {
            let (scheduler, backlog) = (scheduler.clone(), backlog.clone());
            async move {
                match scheduler.backlog().await {
                    Ok(n) => {
                        backlog.set(i64::try_from(n).unwrap_or(i64::MAX));
                        true
                    }
                    Err(e) => {
                        tracing::warn!(error = ?e, "failed to read the scheduled backlog");
                        false
                    }
                }
            }
        });
        this
    }

    pub(crate) fn delivered(&self, kind: &str) {
        let kind = {
            let mut kinds = self.kinds.lock().unwrap_or_else(PoisonError::into_inner);
            let tidy = !kind.is_empty()
                && kind.len() <= 64
                && kind
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
            if tidy && (kinds.contains(kind) || kinds.len() < MAX_KINDS) {
                kinds.insert(kind.to_owned());
                kind.to_owned()
            } else {
                "other".to_owned()
            }
        };
        self.delivered.get_or_create(&[("kind", kind)]).inc();
    }

    pub(crate) fn delivery_lag(&self, lag: Duration) {
        self.lag.observe(lag.as_secs_f64());
    }

    /// `n` scheduled notifications were put back on the schedule.
    pub(crate) fn reconciled(&self, n: usize) {
        if n > 0 {
            self.reconciled.inc_by(n as u64);
        }
    }

    /// A reconcile sweep took `took`, and succeeded or not.
    pub(crate) fn reconcile_swept(&self, took: Duration, ok: bool) {
        self.reconcile_duration.observe(took.as_secs_f64());
        if !ok {
            self.reconcile_failures.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_beyond_the_cap_or_untidy_ones_count_as_other() {
        let m = NotificationMetrics::default();
        for i in 0..MAX_KINDS + 3 {
            m.delivered(&format!("kind{i}"));
        }
        m.delivered("has spaces");
        m.delivered("kind0");

        let count = |k: &str| m.delivered.get_or_create(&[("kind", k.to_owned())]).get();
        assert_eq!(count("kind0"), 2);
        assert_eq!(count("other"), 4);
    }
}
