//! `ecoscan.v1.RuleService` over the dataset.

use std::sync::Arc;

use ecoscan_proto::v1::{
    ListCategoriesRequest, ListCategoriesResponse, LookupRequest, LookupResponse, Progress,
    lookup_response::Event, rule_service_server::RuleService,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{Instrument, Span, field::Empty};

use ecoscan_common::metrics::{Labels1, Metrics};
use prometheus_client::metrics::{counter::Counter, family::Family};

use crate::{
    dataset::{Dataset, Locale},
    error::Error,
};

/// The gRPC service: answers every request from the dataset loaded at startup.
#[derive(Debug, Clone)]
pub struct RuleApi {
    dataset: Arc<Dataset>,
    /// `rule_lookups_total{outcome}`.
    lookups: Family<Labels1, Counter>,
}

impl RuleApi {
    pub fn new(dataset: Arc<Dataset>) -> Self {
        Self {
            dataset,
            lookups: Family::default(),
        }
    }

    /// Counts lookups in `metrics` as `rule_lookups_total{outcome}`.
    #[must_use]
    pub fn with_metrics(self, metrics: &mut Metrics) -> Self {
        metrics.registry().register(
            "rule_lookups",
            "Lookups by outcome: item (an item matched), category (category rules only), \
             invalid (bad request) or unknown_category",
            self.lookups.clone(),
        );
        self
    }
}

/// The `outcome` label of a lookup that failed with `e`.
fn failed_outcome(e: &Error) -> &'static str {
    match e {
        Error::UnknownMajor { .. } | Error::UnknownMiddle { .. } => "unknown_category",
        Error::MissingClassification
        | Error::EmptyMajor { .. }
        | Error::UnsupportedLocale(_)
        | Error::MissingMiddle { .. } => "invalid",
        Error::ReadDataset { .. } | Error::ParseDataset(_) | Error::InvalidDataset { .. } => {
            "error"
        }
    }
}

fn progress(step: &str, fraction: f32, message: String) -> LookupResponse {
    LookupResponse {
        event: Some(Event::Progress(Progress {
            step: step.to_owned(),
            fraction,
            message,
        })),
    }
}

/// Everything a lookup streams, computed before the stream starts so that a bad request fails
/// the call itself with its status rather than a half-sent stream; and the lookup's outcome
/// label (`item` or `category`).
fn lookup_events(
    dataset: &Dataset,
    req: &LookupRequest,
) -> Result<(Vec<LookupResponse>, &'static str), Error> {
    let locale = Locale::parse(&req.locale)?;
    let c = req
        .classification
        .as_ref()
        .ok_or(Error::MissingClassification)?;
    let span = Span::current();
    span.record("rule.category.major", c.major_category.as_str());
    span.record("rule.category.middle", c.middle_category.as_str());
    span.record("rule.category.minor", c.minor_category.as_str());
    span.record("rule.locale", locale.code());

    let resolved = dataset.lookup(&c.major_category, &c.middle_category, &c.minor_category)?;

    let mut events = Vec::with_capacity(4);
    let mut message = format!("resolved {}", resolved.category_path());
    for note in &resolved.notes {
        message.push_str("; ");
        message.push_str(note);
    }
    events.push(progress("resolve_category", 0.3, message));

    let outcome = if resolved.item().is_some() {
        "item"
    } else {
        "category"
    };
    let item_message = match resolved.item() {
        Some(item) => format!(
            "matched item {item} ({} item-specific step(s))",
            resolved.item_step_count()
        ),
        None => resolved
            .item_note
            .clone()
            .unwrap_or_else(|| "no item matched; returning the category rules".into()),
    };
    events.push(progress("resolve_item", 0.6, item_message));

    let out = resolved.rules(locale, &c.situation_tags);
    let mut tag_message = format!(
        "{} situation tag(s), {} piece(s) of advice",
        c.situation_tags.len(),
        out.rules.situation_advice.len()
    );
    if !out.unknown_tags.is_empty() {
        tag_message.push_str(&format!(
            "; ignored tags outside the vocabulary: {}",
            out.unknown_tags.join(", ")
        ));
    }
    if !out.tags_without_advice.is_empty() {
        tag_message.push_str(&format!(
            "; no advice for: {}",
            out.tags_without_advice.join(", ")
        ));
    }
    events.push(progress("apply_situation_tags", 0.9, tag_message));
    events.push(LookupResponse {
        event: Some(Event::Rules(out.rules)),
    });
    Ok((events, outcome))
}

#[tonic::async_trait]
impl RuleService for RuleApi {
    type LookupStream = ReceiverStream<Result<LookupResponse, Status>>;

    #[tracing::instrument(
        name = "rule.lookup",
        skip_all,
        fields(rule.category.major = Empty, rule.category.middle = Empty, rule.category.minor = Empty, rule.locale = Empty)
    )]
    async fn lookup(
        &self,
        request: Request<LookupRequest>,
    ) -> Result<Response<Self::LookupStream>, Status> {
        let looked_up = lookup_events(&self.dataset, request.get_ref());
        let outcome = looked_up
            .as_ref()
            .map_or_else(failed_outcome, |(_, outcome)| *outcome);
        self.lookups
            .get_or_create(&[("outcome", outcome.to_owned())])
            .inc();
        let (events, _) = looked_up.map_err(|e| {
            tracing::info!(error = %e, "lookup refused");
            Status::from(e)
        })?;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(
            async move {
                for event in events {
                    match &event.event {
                        Some(Event::Progress(p)) => {
                            tracing::info!(step = %p.step, fraction = p.fraction, message = %p.message, "lookup progress");
                        }
                        Some(Event::Rules(r)) => {
                            tracing::info!(
                                recyclable = r.recyclable,
                                item_steps = r.item_steps.len(),
                                advice = r.situation_advice.len(),
                                "lookup rules"
                            );
                        }
                        None => {}
                    }
                    if tx.send(Ok(event)).await.is_err() {
                        tracing::debug!("client went away before the lookup finished");
                        break;
                    }
                }
            }
            .instrument(Span::current()),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    #[tracing::instrument(name = "rule.list_categories", skip_all)]
    async fn list_categories(
        &self,
        _request: Request<ListCategoriesRequest>,
    ) -> Result<Response<ListCategoriesResponse>, Status> {
        let categories = self.dataset.categories();
        tracing::info!(categories = categories.len(), "listing categories");
        Ok(Response::new(ListCategoriesResponse {
            categories,
            situation_tags: self.dataset.situation_tags().to_vec(),
        }))
    }
}
