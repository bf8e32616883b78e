//! Prometheus metrics of model calls: counts by outcome, tokens, latency and time to first
//! token, by provider, model and operation; and the analytics reports dropped.

use ecoscan_common::metrics::{
    Labels3, Labels4, Metrics, SecondsFamily, observe_traced, seconds_family,
};
use prometheus_client::metrics::{counter::Counter, family::Family};

use crate::AnalyticsReporter;

/// The model-call series of one service. Cheap to clone; clones share the series.
#[derive(Clone, Debug)]
pub struct LlmMetrics {
    calls: Family<Labels4, Counter>,
    tokens: Family<Labels4, Counter>,
    duration: SecondsFamily<Labels3>,
    ttft: SecondsFamily<Labels3>,
}

impl LlmMetrics {
    /// Registers the `llm_*` series in `metrics`; `reporter` (when given) feeds
    /// `llm_reports_dropped_total`.
    pub fn register(metrics: &mut Metrics, reporter: Option<&AnalyticsReporter>) -> Self {
        let this = Self {
            calls: Family::default(),
            tokens: Family::default(),
            duration: seconds_family(),
            ttft: seconds_family(),
        };
        let registry = metrics.registry();
        ecoscan_common::register_series! {
            registry;
            ("llm_calls", "Model calls finished, by provider, model, operation and status (ok or the error kind)", this.calls.clone());
            ("llm_tokens", "Tokens of finished model calls, by direction (input or output)", this.tokens.clone());
            ("llm_call_duration_seconds", "Model call latency, from request to the last token", this.duration.clone());
            ("llm_time_to_first_token_seconds", "Time from request to the first streamed token (streaming calls)", this.ttft.clone());
        }
        let reporter = reporter.cloned();
        metrics.counter_fn(
            "llm_reports_dropped",
            "Call reports dropped before reaching analytics (buffer full or analytics down)",
            move || reporter.as_ref().map_or(0, AnalyticsReporter::dropped),
        );
        this
    }

    /// Records one finished call.
    pub(crate) fn record(&self, call: &CallRecord<'_>) {
        let key = |last: (&'static str, String)| {
            [
                ("provider", call.provider.to_owned()),
                ("model", call.model.to_owned()),
                ("operation", call.operation.to_owned()),
                last,
            ]
        };
        self.calls
            .get_or_create(&key(("status", call.status.to_owned())))
            .inc();
        self.tokens
            .get_or_create(&key(("direction", "input".to_owned())))
            .inc_by(u64::from(call.input_tokens));
        self.tokens
            .get_or_create(&key(("direction", "output".to_owned())))
            .inc_by(u64::from(call.output_tokens));
        let labels = [
            ("provider", call.provider.to_owned()),
            ("model", call.model.to_owned()),
            ("operation", call.operation.to_owned()),
        ];
        // Inside the call's span: its trace is each duration's exemplar.
        observe_traced(&self.duration.get_or_create(&labels), call.latency_seconds);
        if let Some(ttft) = call.ttft_seconds {
            observe_traced(&self.ttft.get_or_create(&labels), ttft);
        }
    }
}

/// What [`LlmMetrics::record`] needs of a finished call.
pub(crate) struct CallRecord<'a> {
    pub provider: &'a str,
    pub model: &'a str,
    pub operation: &'a str,
    pub status: &'a str,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub latency_seconds: f64,
    pub ttft_seconds: Option<f64>,
}
