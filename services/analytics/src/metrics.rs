//! The Prometheus series of the writer and of the spool. Each side counts into the other's (the
//! replayer records calls in the writer's series, the writer counts refusals in the spool's),
//! so both live here, in a module that imports neither.

use prometheus_client::metrics::{
    counter::Counter,
    gauge::Gauge,
    histogram::{Histogram, exponential_buckets},
};

/// The writer's Prometheus series. Cheap to clone; clones share the series.
#[derive(Clone, Debug)]
pub struct WriterMetrics {
    recorded: Counter,
    batch_rows: Histogram,
    commit: Histogram,
    cost_micros: Counter,
    unpriced: Counter,
}

impl Default for WriterMetrics {
    /// Series registered nowhere (for tests that do not scrape).
    fn default() -> Self {
        Self {
            recorded: Counter::default(),
            batch_rows: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            commit: ecoscan_common::metrics::seconds_histogram(),
            cost_micros: Counter::default(),
            unpriced: Counter::default(),
        }
    }
}

impl WriterMetrics {
    /// Registers `analytics_calls_recorded_total`, `analytics_batch_rows`,
    /// `analytics_commit_duration_seconds`, `analytics_cost_micros_total` and
    /// `analytics_calls_unpriced_total` in `metrics`.
    pub fn register(metrics: &mut ecoscan_common::metrics::Metrics) -> Self {
        let this = Self::default();
        let r = metrics.registry();
        ecoscan_common::register_series! {
            r;
            ("analytics_calls_recorded", "LLM calls committed, directly or by a replay of the spool (repeats of a call id not counted)", this.recorded.clone());
            ("analytics_batch_rows", "Rows per committed batch (group commit)", this.batch_rows.clone());
            ("analytics_commit_duration_seconds", "Time to write a batch: its bodies object and its rows in one transaction", this.commit.clone());
            ("analytics_cost_micros", "What the recorded model calls cost by the price table, in micro-units of its currency (priced calls only; see analytics_calls_unpriced_total)", this.cost_micros.clone());
            ("analytics_calls_unpriced", "Recorded model calls whose cost is unknown: the price table had no price for their model when they were made", this.unpriced.clone());
        }
        this
    }

    /// Counts a batch committed directly: its calls inserted, its rows, how long it took.
    pub(crate) fn committed(&self, rows: usize, inserted: usize, took: std::time::Duration) {
        self.recorded.inc_by(inserted as u64);
        self.batch_rows.observe(rows as f64);
        self.commit.observe(took.as_secs_f64());
    }

    /// Adds the cost of the rows whose ids were inserted (each id once): what they cost, or
    /// that their cost is unknown.
    pub(crate) fn priced<'a>(
        &self,
        rows: impl IntoIterator<Item = &'a crate::store::CallRow>,
        inserted: &std::collections::HashSet<String>,
    ) {
        let mut seen = std::collections::HashSet::with_capacity(inserted.len());
        for row in rows {
            if !inserted.contains(&row.call_id) || !seen.insert(row.call_id.as_str()) {
                continue;
            }
            match row.cost_micros {
                Some(c) => self.cost_micros.inc_by(u64::try_from(c).unwrap_or(0)),
                None => self.unpriced.inc(),
            };
        }
    }

    /// Counts the calls a replay of the spool inserted.
    pub(crate) fn replayed(&self, inserted: usize) {
        self.recorded.inc_by(inserted as u64);
    }
}

/// The spool's Prometheus series. Cheap to clone; clones share the series.
#[derive(Clone, Debug, Default)]
pub struct SpoolMetrics {
    pub(crate) bytes: Gauge,
    pub(crate) batches: Gauge,
    pub(crate) spooled: Counter,
    pub(crate) replayed: Counter,
    pub(crate) full: Counter,
    pub(crate) corrupt: Counter,
    pub(crate) rejected: Counter,
}

impl SpoolMetrics {
    /// Registers `analytics_spool_bytes`, `analytics_spool_batches`, `analytics_spooled_total`,
    /// `analytics_spool_replayed_total`, `analytics_spool_full_total`,
    /// `analytics_spool_corrupt_total` and `analytics_spool_rejected_total` in `metrics`.
    pub fn register(metrics: &mut ecoscan_common::metrics::Metrics) -> Self {
        let this = Self::default();
        let r = metrics.registry();
        ecoscan_common::register_series! {
            r;
            ("analytics_spool_bytes", "Bytes of batches waiting in the spool for the stores", this.bytes.clone());
            ("analytics_spool_batches", "Batches waiting in the spool for the stores", this.batches.clone());
            ("analytics_spooled", "Batches written to the spool because the stores failed", this.spooled.clone());
            ("analytics_spool_replayed", "Spooled batches written to the stores and removed from the spool", this.replayed.clone());
            ("analytics_spool_full", "Calls refused with RESOURCE_EXHAUSTED because the stores failed and the spool was full", this.full.clone());
            ("analytics_spool_corrupt", "Unreadable spool files moved to corrupt/", this.corrupt.clone());
            ("analytics_spool_rejected", "Spooled batches the stores kept refusing while taking others, moved to rejected/", this.rejected.clone());
        }
        this
    }

    /// Counts `calls` refused because the spool was full.
    pub(crate) fn refused(&self, calls: usize) {
        self.full
            .inc_by(u64::try_from(calls).expect("lengths fit in u64"));
    }
}
