//! The `AnalyticsService` RPCs: recording calls through the writer, reading them back, usage.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::Arc,
};

use ecoscan_objects::ObjectStore;
use ecoscan_proto::{
    now_us, timestamp_from_us as us_to_ts, timestamp_us as ts_to_us,
    v1::{
        CallStatus, GetCallRequest, GetCallResponse, LlmCall, RecordRequest, RecordResponse,
        RecordStreamRequest, RecordStreamResponse, UsageRequest, UsageResponse, UsageRow,
        analytics_service_server::AnalyticsService,
    },
};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status, Streaming};

use crate::{
    error::Error,
    prices::{PriceTable, Usage},
    store::{CallRow, CallStore, UsageSample},
    writer::{Accepted, Ack, NewCall, Refused, Writer},
};
/// The AnalyticsService implementation over any [`CallStore`] and object store.
pub struct Analytics {
    store: Arc<dyn CallStore>,
    bodies: Arc<dyn ObjectStore>,
    writer: Writer,
    prices: Arc<PriceTable>,
}

/// Acks a record stream may leave outstanding before it waits for the oldest: bounds a long
/// stream's memory while keeping enough calls in flight to fill batches.
const MAX_UNACKED_PER_STREAM: usize = 2048;

impl Analytics {
    /// A service reading from `store` and `bodies` and writing through `writer`.
    pub fn new(store: Arc<dyn CallStore>, bodies: Arc<dyn ObjectStore>, writer: Writer) -> Self {
        Self {
            store,
            bodies,
            writer,
            prices: Arc::default(),
        }
    }

    /// Prices every call by `prices` (without, only the mock's calls have a cost).
    #[must_use]
    pub fn with_prices(self, prices: Arc<PriceTable>) -> Self {
        Self { prices, ..self }
    }

    /// The call, checked and priced.
    fn accept(&self, call: LlmCall) -> Result<NewCall, Error> {
        let mut call = validate(call)?;
        let row = &mut call.row;
        if let Some(cost) = self.prices.cost(&Usage {
            provider: &row.provider,
            model: &row.model,
            started_at_us: row.started_at_us,
            input_tokens: row.input_tokens,
            cached_input_tokens: row.cached_input_tokens,
            output_tokens: row.output_tokens,
            images: row.images,
        }) {
            row.cost_micros = Some(cost.micros);
            row.price_version = cost.version;
        }
        Ok(call)
    }

    async fn submit(&self, call: NewCall) -> Result<oneshot::Receiver<Ack>, Error> {
        self.writer
            .submit(call)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// Records one call and returns after it is committed, or — when the stores fail — after it
    /// is durably spooled (then `duplicate` is false: whether it repeats a stored id is not known
    /// yet). Refused with [`Error::SpoolFull`] when the stores fail and the spool is full.
    pub async fn record(&self, call: Option<LlmCall>) -> Result<RecordResponse, Error> {
        let call = self.accept(call.ok_or(Error::MissingCall)?)?;
        let call_id = call.row.call_id.clone();
        let duplicate = settle(self.submit(call).await?).await?;
        Ok(RecordResponse { call_id, duplicate })
    }

    /// Records a stream of calls; see [`AnalyticsService::record_stream`].
    pub async fn record_stream(
        &self,
        mut stream: Streaming<RecordStreamRequest>,
    ) -> Result<RecordStreamResponse, Status> {
        let mut unacked = VecDeque::new();
        let mut counts = RecordStreamResponse::default();
        let mut index = 0_u64;
        let outcome = loop {
            match stream.message().await {
                Ok(Some(item)) => match item
                    .call
                    .ok_or(Error::MissingCall)
                    .and_then(|c| self.accept(c))
                {
                    Ok(call) => {
                        tracing::info!(index, call_id = %call.row.call_id, "call received");
                        unacked.push_back(self.submit(call).await?);
                        if unacked.len() > MAX_UNACKED_PER_STREAM
                            && let Some(oldest) = unacked.pop_front()
                        {
                            count(&mut counts, settle(oldest).await?);
                        }
                    }
                    Err(e) => {
                        break Err(Status::from(Error::InvalidStreamItem {
                            index,
                            source: Box::new(e),
                        }));
                    }
                },
                Ok(None) => break Ok(()),
                // The client broke the stream; what it sent before is committed anyway.
                Err(status) => break Err(status),
            }
            index += 1;
        };
        // Every call accepted before the end (or the bad one) is committed before answering, so
        // the error message can promise it.
        for rx in unacked {
            count(&mut counts, settle(rx).await?);
        }
        tracing::info!(
            recorded = counts.recorded,
            duplicates = counts.duplicates,
            "record stream settled"
        );
        outcome.map(|()| counts)
    }

    /// Aggregates per (service, model) over the window; see [`UsageRequest`].
    pub async fn usage(&self, req: UsageRequest) -> Result<UsageResponse, Error> {
        let until = req.until.map_or_else(now_us, |t| ts_to_us(&t));
        let since = req
            .since
            .map_or(until.saturating_sub(24 * 3600 * 1_000_000), |t| {
                ts_to_us(&t)
            });
        if since > until {
            return Err(Error::InvalidWindow);
        }
        let samples = self.store.usage_samples(since, until).await?;
        Ok(UsageResponse {
            since: Some(us_to_ts(since)),
            until: Some(us_to_ts(until)),
            rows: aggregate(samples),
        })
    }

    /// The call with `call_id`, bodies included.
    pub async fn get_call(&self, call_id: &str) -> Result<LlmCall, Error> {
        let call_id = canonical_call_id(call_id)?;
        let row = self
            .store
            .get(&call_id)
            .await?
            .ok_or_else(|| Error::NotFound(call_id.clone()))?;
        let (request_body, response_body) = if row.body_key.is_empty() {
            (String::new(), String::new())
        } else {
            let object = self
                .bodies
                .get(&row.body_key)
                .await
                .map_err(|e| Error::Internal(e.into()))?
                .ok_or_else(|| {
                    Error::Internal(anyhow::anyhow!("body object {} is missing", row.body_key))
                })?;
            split_bodies(&object, &row).map_err(Error::Internal)?
        };
        Ok(row_to_call(row, request_body, response_body))
    }
}

fn count(counts: &mut RecordStreamResponse, duplicate: bool) {
    if duplicate {
        counts.duplicates += 1;
    } else {
        counts.recorded += 1;
    }
}

/// Waits for the call's acknowledgement: `Ok(duplicate)` once it is committed or spooled (a
/// spooled call is not known to be a repeat, so it counts as recorded).
async fn settle(rx: oneshot::Receiver<Ack>) -> Result<bool, Error> {
    match rx.await {
        Ok(Ok(Accepted::Committed { duplicate })) => Ok(duplicate),
        Ok(Ok(Accepted::Spooled)) => Ok(false),
        Ok(Err(Refused::SpoolFull {
            used,
            max,
            retry_after,
        })) => Err(Error::SpoolFull {
            used,
            max,
            retry_after,
        }),
        Ok(Err(Refused::Unavailable)) => Err(Error::Unavailable),
        Err(_) => Err(Error::ShuttingDown),
    }
}

fn canonical_call_id(id: &str) -> Result<String, Error> {
    let id = id.trim();
    if id.is_empty() {
        return Err(Error::EmptyCallId);
    }
    // One spelling per id, so "ABC…" and "abc…" are the same call.
    uuid::Uuid::parse_str(id)
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| Error::InvalidCallId(id.to_owned()))
}

fn valid_duration(field: &'static str, ms: f64) -> Result<f64, Error> {
    if ms.is_finite() && ms >= 0.0 {
        Ok(ms)
    } else {
        Err(Error::InvalidDuration { field })
    }
}

fn validate(call: LlmCall) -> Result<NewCall, Error> {
    let call_id = canonical_call_id(&call.call_id)?;
    if call.service.trim().is_empty() {
        return Err(Error::EmptyService);
    }
    if call.model.trim().is_empty() {
        return Err(Error::EmptyModel);
    }
    // PostgreSQL text cannot hold NUL; refused here, such a call can never fail a batch (the
    // bodies go to the object store and may hold anything).
    for (field, value) in [
        ("service", &call.service),
        ("provider", &call.provider),
        ("model", &call.model),
        ("operation", &call.operation),
        ("error", &call.error),
        ("job_id", &call.job_id),
        ("trace_id", &call.trace_id),
    ] {
        if value.contains('\0') {
            return Err(Error::NulInField { field });
        }
    }
    let latency_ms = valid_duration("latency_ms", call.latency_ms)?;
    let ttft_ms = valid_duration("ttft_ms", call.ttft_ms)?;
    if CallStatus::try_from(call.status).is_err() {
        return Err(Error::InvalidStatus(call.status));
    }
    let now = now_us();
    Ok(NewCall {
        row: CallRow {
            call_id,
            service: call.service,
            provider: call.provider,
            model: call.model,
            operation: call.operation,
            input_tokens: i64::from(call.input_tokens),
            output_tokens: i64::from(call.output_tokens),
            latency_ms,
            ttft_ms,
            status: call.status,
            error: call.error,
            body_key: String::new(),
            body_offset: 0,
            request_len: 0,
            response_len: 0,
            job_id: call.job_id,
            trace_id: call.trace_id,
            // A call without a start time is counted as starting when it was recorded.
            started_at_us: call.started_at.map_or(now, |t| ts_to_us(&t)),
            recorded_at_us: now,
            cached_input_tokens: i64::from(call.cached_input_tokens.min(call.input_tokens)),
            images: i64::from(call.images),
            // Priced by analytics from its own table: a caller's figure is never taken.
            cost_micros: None,
            price_version: String::new(),
        },
        request_body: call.request_body,
        response_body: call.response_body,
    })
}

fn split_bodies(object: &[u8], row: &CallRow) -> anyhow::Result<(String, String)> {
    let start = usize::try_from(row.body_offset)?;
    let mid = start + usize::try_from(row.request_len)?;
    let end = mid + usize::try_from(row.response_len)?;
    let (Some(request), Some(response)) = (object.get(start..mid), object.get(mid..end)) else {
        anyhow::bail!(
            "body object {} is shorter than the call's bodies ({end} > {} bytes)",
            row.body_key,
            object.len()
        );
    };
    Ok((
        String::from_utf8(request.to_vec())?,
        String::from_utf8(response.to_vec())?,
    ))
}

fn row_to_call(row: CallRow, request_body: String, response_body: String) -> LlmCall {
    LlmCall {
        call_id: row.call_id,
        service: row.service,
        provider: row.provider,
        model: row.model,
        operation: row.operation,
        input_tokens: u32::try_from(row.input_tokens).unwrap_or(u32::MAX),
        output_tokens: u32::try_from(row.output_tokens).unwrap_or(u32::MAX),
        latency_ms: row.latency_ms,
        ttft_ms: row.ttft_ms,
        status: row.status,
        error: row.error,
        request_body,
        response_body,
        job_id: row.job_id,
        trace_id: row.trace_id,
        started_at: Some(us_to_ts(row.started_at_us)),
        cached_input_tokens: u32::try_from(row.cached_input_tokens).unwrap_or(u32::MAX),
        images: u32::try_from(row.images).unwrap_or(u32::MAX),
        cost_micros: row.cost_micros,
        price_version: row.price_version,
    }
}

#[derive(Default)]
struct Group {
    calls: u64,
    errors: u64,
    input_tokens: u64,
    output_tokens: u64,
    cost_micros: i64,
    unpriced: u64,
    latencies: Vec<f64>,
}

/// Sums and nearest-rank latency percentiles per (service, model), sorted by service then model.
fn aggregate(samples: Vec<UsageSample>) -> Vec<UsageRow> {
    let mut groups: BTreeMap<(String, String), Group> = BTreeMap::new();
    for s in samples {
        let g = groups.entry((s.service, s.model)).or_default();
        g.calls += 1;
        g.errors += u64::from(s.status == CallStatus::Error as i32);
        g.input_tokens += u64::try_from(s.input_tokens).unwrap_or(0);
        g.output_tokens += u64::try_from(s.output_tokens).unwrap_or(0);
        match s.cost_micros {
            Some(c) => g.cost_micros = g.cost_micros.saturating_add(c),
            None => g.unpriced += 1,
        }
        g.latencies.push(s.latency_ms);
    }
    groups
        .into_iter()
        .map(|((service, model), mut g)| {
            g.latencies.sort_by(f64::total_cmp);
            UsageRow {
                service,
                model,
                calls: g.calls,
                errors: g.errors,
                input_tokens: g.input_tokens,
                output_tokens: g.output_tokens,
                latency_p50_ms: nearest_rank(&g.latencies, 50),
                latency_p95_ms: nearest_rank(&g.latencies, 95),
                cost_micros: g.cost_micros,
                unpriced_calls: g.unpriced,
            }
        })
        .collect()
}

/// The `percent`th percentile of ascending `sorted` by the nearest-rank method: the value at rank
/// ⌈percent/100 · n⌉ (1-based). 0 for no values.
fn nearest_rank(sorted: &[f64], percent: usize) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (percent * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

#[tonic::async_trait]
impl AnalyticsService for Analytics {
    #[tracing::instrument(skip_all, fields(
        llm.call_id = %request.get_ref().call.as_ref().map_or("", |c| c.call_id.as_str()),
        llm.service = %request.get_ref().call.as_ref().map_or("", |c| c.service.as_str()),
    ))]
    async fn record(
        &self,
        request: Request<RecordRequest>,
    ) -> Result<Response<RecordResponse>, Status> {
        require_identity(&request)?;
        let res = Analytics::record(self, request.into_inner().call).await?;
        tracing::info!(duplicate = res.duplicate, "call recorded");
        Ok(Response::new(res))
    }

    /// Items are validated as they arrive; an invalid one ends the stream with INVALID_ARGUMENT
    /// naming its index, and every call received before it is committed (the message says so).
    #[tracing::instrument(skip_all)]
    async fn record_stream(
        &self,
        request: Request<Streaming<RecordStreamRequest>>,
    ) -> Result<Response<RecordStreamResponse>, Status> {
        require_identity(&request)?;
        Analytics::record_stream(self, request.into_inner())
            .await
            .map(Response::new)
    }

    #[tracing::instrument(skip_all)]
    async fn usage(
        &self,
        request: Request<UsageRequest>,
    ) -> Result<Response<UsageResponse>, Status> {
        require_admin(&request)?;
        let res = Analytics::usage(self, request.into_inner()).await?;
        tracing::info!(rows = res.rows.len(), "usage aggregated");
        Ok(Response::new(res))
    }

    #[tracing::instrument(skip_all, fields(llm.call_id = %request.get_ref().call_id))]
    async fn get_call(
        &self,
        request: Request<GetCallRequest>,
    ) -> Result<Response<GetCallResponse>, Status> {
        require_admin(&request)?;
        let call = Analytics::get_call(self, &request.into_inner().call_id).await?;
        Ok(Response::new(GetCallResponse { call: Some(call) }))
    }
}

/// `Record` and `RecordStream` write: a caller that proves nobody may not (the network inside
/// is not trusted). Ecoscan services sign their reports as themselves (the `act` claim).
fn require_identity<T>(request: &Request<T>) -> Result<(), Error> {
    if ecoscan_common::identity::has_identity(request.metadata()) {
        Ok(())
    } else {
        Err(ecoscan_common::identity::IdentityError::Missing.into())
    }
}

/// `Usage` and `GetCall` read every user's calls: only an admin may.
fn require_admin<T>(request: &Request<T>) -> Result<(), Error> {
    if ecoscan_common::identity::is_admin(request.metadata()) {
        Ok(())
    } else {
        Err(Error::NotAdmin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_picks_the_ceiling_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 50), 5.0);
        assert_eq!(nearest_rank(&v, 95), 10.0);
        assert_eq!(nearest_rank(&[7.0], 50), 7.0);
        assert_eq!(nearest_rank(&[], 95), 0.0);
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 95), 19.0);
    }

    #[test]
    fn call_ids_are_canonicalised_and_checked() {
        let id = "6F9619FF-8B86-D011-B42D-00C04FC964FF";
        assert_eq!(
            canonical_call_id(id).unwrap(),
            "6f9619ff-8b86-d011-b42d-00c04fc964ff"
        );
        assert!(matches!(canonical_call_id(" "), Err(Error::EmptyCallId)));
        assert!(matches!(
            canonical_call_id("nope"),
            Err(Error::InvalidCallId(_))
        ));
    }
}
