//! ingest's Prometheus series: intake, dispatch backlog and lag, jobs by outcome, stage
//! durations and hub watchers.

use std::{sync::Arc, time::Duration};

use ecoscan_common::metrics::{Labels1, Labels2, Metrics, SecondsFamily, seconds_family};
use prometheus_client::metrics::{
    counter::Counter, family::Family, gauge::Gauge, histogram::Histogram,
};

use crate::{hub::Hub, store::Queue};

/// The `outcome` labels of `ingest_uploads_total`.
pub const UPLOAD_OUTCOMES: [&str; 5] = ["created", "stored", "submitted", "refused", "expired"];

/// The series ingest records into. Cheap to clone; clones share the series.
#[derive(Clone, Debug)]
pub struct IngestMetrics {
    submitted: Counter,
    rejected: Family<Labels1, Counter>,
    jobs: Family<Labels1, Counter>,
    lag: Histogram,
    stages: SecondsFamily<Labels2>,
    dead_lettered: Family<Labels1, Counter>,
    requeued: Family<Labels1, Counter>,
    returned: Counter,
    fenced: Counter,
    result_reads: Family<Labels1, Counter>,
    uploads: Family<Labels1, Counter>,
}

impl Default for IngestMetrics {
    /// Series registered nowhere (for tests that do not scrape).
    fn default() -> Self {
        Self {
            submitted: Counter::default(),
            rejected: Family::default(),
            jobs: Family::default(),
            lag: ecoscan_common::metrics::seconds_histogram(),
            stages: seconds_family(),
            dead_lettered: Family::default(),
            requeued: Family::default(),
            returned: Counter::default(),
            fenced: Counter::default(),
            result_reads: Family::default(),
            uploads: Family::default(),
        }
    }
}

impl IngestMetrics {
    /// Registers ingest's series in `metrics`; the backlog is read from `queue` and the
    /// watchers from `hub` at each scrape.
    pub fn register(metrics: &mut Metrics, queue: Arc<dyn Queue>, hub: Hub) -> Self {
        let this = Self::default();
        let backlog = Gauge::<i64>::default();
        let r = metrics.registry();
        ecoscan_common::register_series! {
            r;
            ("ingest_jobs_submitted", "Scan jobs accepted (a repeat of an idempotency key is not counted)", this.submitted.clone());
            ("ingest_submit_rejected", "Scans refused at intake, by reason (overloaded or invalid)", this.rejected.clone());
            ("ingest_jobs", "Scan jobs finished, by status (succeeded or failed)", this.jobs.clone());
            ("ingest_dispatch_lag_seconds", "Time from enqueue to a worker's first claim of the job", this.lag.clone());
            ("ingest_stage_duration_seconds", "Time of a pipeline stage, retries included, by stage and outcome (ok, failed, store_error)", this.stages.clone());
            ("ingest_jobs_dead_lettered", "Jobs failed and set aside for an operator, by reason (attempts: tried too often; store: a record that cannot be read)", this.dead_lettered.clone());
            ("ingest_jobs_requeued", "Dead-lettered jobs put back on the queue, by who: operator (RequeueDeadLetter) or schedule (INGEST_DEAD_LETTER_RETRY)", this.requeued.clone());
            ("ingest_dead_letters_returned", "Jobs dead-lettered again after the schedule requeued them: retrying does not mend them", this.returned.clone());
            ("ingest_workers_fenced", "Workers stopped because their job was claimed again (a write with a stale lease epoch was refused)", this.fenced.clone());
            ("ingest_result_reads", "GetResult calls by where the row came from: kept (a running job's row the hub keeps until the next event of the job) or store", this.result_reads.clone());
            ("ingest_uploads", "Direct uploads by outcome: created (CreateUpload), stored (PutUpload: the photo came through ingest, the embedded store), submitted (a scan was made of it), refused (a submit found its object not what was declared or not an image), expired (never submitted; the sweep deleted it)", this.uploads.clone());
            ("ingest_dispatch_backlog", "Jobs on the dispatch queue: waiting plus claimed and not yet acknowledged", backlog.clone());
        }
        // Both `by` series from the start, at 0: a dashboard's rate of them has a series to
        // read before the first requeue.
        for by in ["operator", "schedule"] {
            drop(this.requeued.get_or_create(&[("by", by.to_owned())]));
        }
        // Every outcome from the start, at 0, for the same reason.
        for outcome in UPLOAD_OUTCOMES {
            drop(
                this.uploads
                    .get_or_create(&[("outcome", outcome.to_owned())]),
            );
        }
        let kept = hub.clone();
        metrics.gauge_fn(
            "ingest_hub_watchers",
            "Watch streams currently subscribed to the event hub",
            move || i64::try_from(hub.watchers()).unwrap_or(i64::MAX),
        );
        metrics.gauge_fn(
            "ingest_result_rows_kept",
            "Running jobs' rows the hub keeps for GetResult (or reserved by a read under way)",
            move || i64::try_from(kept.pending().len()).unwrap_or(i64::MAX),
        );
        metrics.sample("ingest_dispatch_backlog", move || {
            let (queue, backlog) = (queue.clone(), backlog.clone());
            async move {
                match queue.backlog().await {
                    Ok(n) => {
                        backlog.set(i64::try_from(n).unwrap_or(i64::MAX));
                        true
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "failed to read the dispatch backlog");
                        false
                    }
                }
            }
        });
        this
    }

    pub(crate) fn submitted(&self) {
        self.submitted.inc();
    }

    pub(crate) fn rejected(&self, reason: &'static str) {
        self.rejected
            .get_or_create(&[("reason", reason.to_owned())])
            .inc();
    }

    pub(crate) fn finished(&self, status: &'static str) {
        self.jobs
            .get_or_create(&[("status", status.to_owned())])
            .inc();
    }

    pub(crate) fn dead_lettered(&self, reason: &'static str) {
        self.dead_lettered
            .get_or_create(&[("reason", reason.to_owned())])
            .inc();
    }

    /// A dead letter put back on the queue `by` an operator or the schedule.
    pub(crate) fn requeued(&self, by: &'static str) {
        self.requeued.get_or_create(&[("by", by.to_owned())]).inc();
    }

    /// A job the schedule requeued was dead-lettered again.
    pub(crate) fn dead_letter_returned(&self) {
        self.returned.inc();
    }

    pub(crate) fn result_read(&self, source: &'static str) {
        self.result_reads
            .get_or_create(&[("source", source.to_owned())])
            .inc();
    }

    /// A direct upload reached `outcome`, one of [`UPLOAD_OUTCOMES`].
    pub(crate) fn upload(&self, outcome: &'static str) {
        debug_assert!(UPLOAD_OUTCOMES.contains(&outcome), "{outcome}");
        self.uploads
            .get_or_create(&[("outcome", outcome.to_owned())])
            .inc();
    }

    pub(crate) fn fenced(&self) {
        self.fenced.inc();
    }

    pub(crate) fn dispatch_lag(&self, lag: Duration) {
        self.lag.observe(lag.as_secs_f64());
    }

    pub(crate) fn stage(&self, stage: &'static str, outcome: &'static str, took: Duration) {
        // In the job's pipeline span: the scan's trace is the exemplar.
        ecoscan_common::metrics::observe_traced(
            &self
                .stages
                .get_or_create(&[("stage", stage.to_owned()), ("outcome", outcome.to_owned())]),
            took.as_secs_f64(),
        );
    }
}
