//! notification's Prometheus series: deliveries by kind, due-to-delivery lag, the scheduled
//! backlog and live subscribers.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use ecoscan_common::metrics::{Labels1, Metrics};
use prometheus_client::metrics::{
    counter::Counter, family::Family, gauge::Gauge, histogram::Histogram,
};

use crate::{hub::Hub, scheduler::AnyScheduler};

/// Distinct `kind` label values kept; later new kinds are counted as `other`. `kind` comes from
/// callers, so it must not be able to grow the series without bound.
const MAX_KINDS: usize = 32;

/// The series notification records into. Cheap to clone; clones share the series.
#[derive(Clone, Debug)]
pub struct NotificationMetrics {
    delivered: Family<Labels1, Counter>,
    lag: Histogram,
    kinds: Arc<Mutex<HashSet<String>>>,
}

impl Default for NotificationMetrics {
    /// Series registered nowhere (for tests that do not scrape).
    fn default() -> Self {
        Self {
            delivered: Family::default(),
            lag: ecoscan_common::metrics::seconds_histogram(),
            kinds: Arc::default(),
        }
    }
}

impl NotificationMetrics {
    /// Registers notification's series in `metrics`; the backlog is read from `scheduler` and
    /// the subscribers from `hub` at each scrape.
    pub fn register(metrics: &mut Metrics, scheduler: Arc<AnyScheduler>, hub: Arc<Hub>) -> Self {
        let this = Self::default();
        let backlog = Gauge::<i64>::default();
        let r = metrics.registry();
        r.register(
            "notification_delivered",
            "Notifications delivered (published to live subscribers and marked delivered), by kind",
            this.delivered.clone(),
        );
        r.register(
            "notification_delivery_lag_seconds",
            "Time from a scheduled notification's due time to its delivery",
            this.lag.clone(),
        );
        r.register(
            "notification_scheduled_backlog",
            "Scheduled notifications not yet delivered (waiting plus claimed)",
            backlog.clone(),
        );
        metrics.gauge_fn(
            "notification_subscribers",
            "Live Subscribe streams in this process",
            move || i64::try_from(hub.subscribers()).unwrap_or(i64::MAX),
        );
        metrics.on_scrape(move || {
            let (scheduler, backlog) = (scheduler.clone(), backlog.clone());
            async move {
                match scheduler.backlog().await {
                    Ok(n) => {
                        backlog.set(i64::try_from(n).unwrap_or(i64::MAX));
                    }
                    Err(e) => tracing::warn!(error = ?e, "failed to read the scheduled backlog"),
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
