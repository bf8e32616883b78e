//! Scans: submit, submit-and-stream, result, and a job's event stream.

use std::sync::Arc;

use axum::{
    Json,
    extract::{
        Path, Query, Request, State,
        rejection::{PathRejection, QueryRejection},
    },
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
};
use ecoscan_proto::{
    event::{EventId, job_status_name, stage_name},
    v1::{GetResultRequest, JobStatus, ScanRequest, ScanResult, SubmitRequest, WatchRequest},
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};

use crate::{
    AppState, SCAN_STREAM_DEADLINE, SUBMIT_DEADLINE, UNARY_DEADLINE,
    auth::Caller,
    error::ApiError,
    event::SharedEvent,
    input::{ScanInput, idempotency_key, job_id, valid_event_id},
    results::Finished,
    schema::{BodyErrors, CommonErrors, NotFound, ScanForm, ScanJson, TooManyRequests},
    sse::{self, doc::ScanEvents, error_info_json},
    watch::{Refused, retryable},
};
use futures::StreamExt as _;

fn ingest_error(status: tonic::Status) -> ApiError {
    ApiError::upstream("ingest", status)
}

/// Reads and checks the scan; nothing reaches ingest unless this succeeds.
async fn submit_request(state: &AppState, req: Request) -> Result<SubmitRequest, ApiError> {
    let idempotency_key = idempotency_key(req.headers())?;
    let input = ScanInput::from_request(req, state).await?;
    tracing::info!(
        image_bytes = input.image.len(),
        content_type = %input.content_type,
        by_url = !input.image_url.is_empty(),
        model = %input.model,
        upload.id = %input.upload_id,
        "scan accepted at the edge"
    );
    Ok(SubmitRequest {
        // No copy: the buffer read from the body is handed over as is.
        image: Vec::from(input.image),
        content_type: input.content_type,
        image_url: input.image_url,
        hint: input.hint,
        idempotency_key,
        locale: input.locale,
        model: input.model,
        upload_id: input.upload_id,
    })
}

/// A path's job id, as [`job_id`] reads it; a path that does not decode is a 400 too.
fn path_job_id(path: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    let Path(raw) = path.map_err(|e| ApiError::InvalidArgument(e.body_text()))?;
    job_id(&raw)
}

/// The answer to an accepted scan (202). Fields are in alphabetical order, as the JSON they
/// replace had them.
#[derive(Serialize, ToSchema)]
pub(crate) struct ScanAccepted {
    /// True when an earlier scan had the same `Idempotency-Key`: this is that scan's job.
    duplicate: bool,
    /// The job's events (SSE): `GET` it to follow the scan.
    events_url: String,
    /// The job's id (a UUID).
    job_id: String,
    /// The job's result: `GET` it to poll (the `Location` header too).
    result_url: String,
    /// Where the job is: `queued` for a new one.
    #[schema(schema_with = crate::schema::job_status_schema)]
    status: &'static str,
}

/// A job that has not finished yet (202 of `GET /api/v1/scan/{id}`). Fields are in alphabetical
/// order, as the JSON they replace had them.
#[derive(Serialize, ToSchema)]
pub(crate) struct ScanPending {
    /// The job's events (SSE).
    events_url: String,
    /// The job's id (a UUID).
    job_id: String,
    /// The job's result: poll again after `Retry-After`.
    result_url: String,
    /// The stage running now.
    #[schema(schema_with = crate::schema::stage_schema)]
    stage: &'static str,
    /// `queued` or `running`.
    #[schema(schema_with = crate::schema::job_status_schema)]
    status: &'static str,
}

/// `POST /api/v1/scan`: accepts a scan and answers 202 with where to follow it.
#[utoipa::path(
    post,
    path = "/api/v1/scan",
    tag = "scans",
    operation_id = "submitScan",
    summary = "Submit a scan",
    description = "Accepts a photo of waste and answers at once with where to follow its \
                   scan (vision, rules, answer, reward). The photo comes as a multipart form \
                   (`image` file) or as JSON (`image_base64`, or `image_url` for ingest to \
                   fetch). It is checked here (emptiness, size, type sniffed from its bytes) \
                   before anything reaches ingest. Rate-limited per user.",
    params(IdempotencyKey),
    request_body(
        description = "The scan: the photo and optional `hint`, `locale` and `model`.",
        content(
            (ScanForm = "multipart/form-data"),
            (ScanJson = "application/json"),
        ),
    ),
    responses(
        (status = 202, description = "Accepted; follow `events_url`, or poll `result_url`.",
            body = ScanAccepted,
            headers(("Location" = String, description = "The job's result URL."))),
        (status = 404, response = NotFound),
        CommonErrors,
        BodyErrors,
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn submit(
    State(state): State<AppState>,
    caller: Caller,
    req: Request,
) -> Result<Response, ApiError> {
    state.rate.scan(&caller.user)?;
    let msg = submit_request(&state, req).await?;
    let res = state
        .scan
        .clone()
        .submit(crate::auth::request(msg, SUBMIT_DEADLINE, &caller))
        .await
        .map_err(ingest_error)?
        .into_inner();
    let result_url = state.result_url(&res.job_id);
    let body = ScanAccepted {
        duplicate: res.duplicate,
        events_url: state.events_url(&res.job_id),
        status: job_status_name(res.status),
        result_url: result_url.clone(),
        job_id: res.job_id,
    };
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, result_url)],
        Json(body),
    )
        .into_response())
}

/// The `Idempotency-Key` request header.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)]
pub(crate) struct IdempotencyKey {
    /// Makes a repeated request return the first one's result instead of doing it again: the
    /// same job for a scan, the same notification for a schedule. 1-128 visible ASCII
    /// characters.
    #[param(
        rename = "Idempotency-Key",
        pattern = "^[!-~]{1,128}$",
        nullable = false
    )]
    idempotency_key: Option<String>,
}

/// `POST /api/v1/scan/completion`: submits and answers with the job's events as SSE.
#[utoipa::path(
    post,
    path = "/api/v1/scan/completion",
    tag = "scans",
    operation_id = "scanAndStream",
    summary = "Submit a scan and stream its events",
    description = "Takes the same scan as `POST /api/v1/scan` and answers with its events as \
                   Server-Sent Events until the result is ready. A failure to start (a full \
                   backlog, a refused image) is an HTTP error, not an event. Rate-limited per \
                   user; the stream counts against the caller's open streams.",
    params(IdempotencyKey),
    request_body(
        description = "The scan: the photo and optional `hint`, `locale` and `model`.",
        content(
            (ScanForm = "multipart/form-data"),
            (ScanJson = "application/json"),
        ),
    ),
    responses(
        (status = 200, response = ScanEvents),
        (status = 404, response = NotFound),
        CommonErrors,
        BodyErrors,
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn completion(
    State(state): State<AppState>,
    caller: Caller,
    req: Request,
) -> Result<Response, ApiError> {
    // The stream's slot first: a caller at its cap gets 429 before any work is done.
    let slot = state.sse.take(&caller.user)?;
    state.rate.scan(&caller.user)?;
    let msg = ScanRequest::from(submit_request(&state, req).await?);
    let stream = state
        .scan
        .clone()
        .scan(crate::auth::request(msg, SCAN_STREAM_DEADLINE, &caller))
        .await
        .map_err(ingest_error)?
        .into_inner();
    let mut stream = sse::scan_stream(stream, |r| SharedEvent::from_parts(r.event, r.resync));
    let first = sse::first_message(&mut stream, "ingest").await?;
    Ok(sse::scan_events(
        stream,
        first,
        String::new(),
        state.result_url_fn(),
        slot,
        state.shutdown.clone(),
        state.stream_times(),
    ))
}

/// `GET /api/v1/scan/{id}`: 202 while the job runs, 200 with the result once it has finished.
#[utoipa::path(
    get,
    path = "/api/v1/scan/{id}",
    tag = "scans",
    operation_id = "getScanResult",
    summary = "A scan's result",
    description = "The finished result (200, with a strong `ETag`; 304 when `If-None-Match` \
                   names it), or where the job is while it runs (202 with `Retry-After`). A \
                   succeeded result never changes: `Cache-Control: private, max-age=…, \
                   immutable`.",
    params(
        ("id" = String, Path, format = "uuid", description = "The job's id (a UUID)."),
        ("If-None-Match" = Option<String>, Header,
            description = "The `ETag` of a result the caller has: 304 when it is still the result."),
    ),
    responses(
        (status = 200, description = "The job has finished, successfully or not (`status`).",
            body = crate::schema::ScanResult,
            headers(
                ("ETag" = String, description = "A strong tag of this result's bytes."),
                ("Cache-Control" = String, description = "`private, max-age=…, immutable` for a \
                    succeeded result, `private, no-cache` for a failed one."),
            )),
        (status = 304, description = "The result the caller has (`If-None-Match`) is still \
            the result; no body.",
            headers(("ETag" = String, description = "The result's tag."))),
        (status = 202, description = "The job is queued or running.", body = ScanPending,
            headers(("Retry-After" = u64, description = "Seconds to wait before polling again."))),
        CommonErrors,
        (status = 404, response = NotFound),
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn result(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = path_job_id(path)?;
    // A succeeded result ingest gave this caller before: the same answer, without asking.
    if let Some(kept) = state.results.get(&caller.user, &id).await {
        return Ok(state.results.answer(&kept, &headers));
    }
    let msg = GetResultRequest { job_id: id.clone() };
    let result = state
        .scan
        .clone()
        .get_result(crate::auth::request(msg, UNARY_DEADLINE, &caller))
        .await
        .map_err(ingest_error)?
        .into_inner()
        .result
        .ok_or_else(|| {
            ApiError::Internal(format!("ingest answered GetResult of {id} without it"))
        })?;
    match JobStatus::try_from(result.status) {
        Ok(JobStatus::Queued | JobStatus::Running) => {
            let body = ScanPending {
                events_url: state.events_url(&id),
                result_url: state.result_url(&id),
                stage: stage_name(result.stage),
                status: job_status_name(result.status),
                job_id: id,
            };
            Ok((
                StatusCode::ACCEPTED,
                [(header::RETRY_AFTER, "1")],
                Json(body),
            )
                .into_response())
        }
        Ok(status @ (JobStatus::Succeeded | JobStatus::Failed)) => {
            let body = serde_json::to_vec(&result_json(&result)?).map_err(|e| {
                ApiError::Internal(format!("failed to serialize a scan result: {e}"))
            })?;
            let finished = Arc::new(Finished::new(body.into()));
            if status == JobStatus::Succeeded {
                state
                    .results
                    .keep(&caller.user, &id, finished.clone())
                    .await;
                Ok(state.results.answer(&finished, &headers))
            } else {
                Ok(crate::results::answer_uncached(&finished, &headers))
            }
        }
        Ok(JobStatus::Unspecified) | Err(_) => Err(ApiError::Internal(format!(
            "ingest returned job {id} with status {}",
            result.status
        ))),
    }
}

/// The finished result: the proto3 JSON of `ScanResult`, with `status` and `stage` as the short
/// lowercase names the rest of the API uses, and `error` in the same shape as SSE errors.
fn result_json(result: &ScanResult) -> Result<serde_json::Value, ApiError> {
    // Through the text: `to_value` widens an f32 to an f64 (0.93 -> 0.9300000071525574).
    let mut value: serde_json::Value = serde_json::to_vec(result)
        .and_then(|text| serde_json::from_slice(&text))
        .map_err(|e| ApiError::Internal(format!("failed to serialize a scan result: {e}")))?;
    if let Some(obj) = value.as_object_mut() {
        obj.insert("status".into(), json!(job_status_name(result.status)));
        obj.insert("stage".into(), json!(stage_name(result.stage)));
        if let Some(err) = &result.error {
            obj.insert("error".into(), json!(error_info_json(err)));
        }
    }
    Ok(value)
}

/// Where to resume a job's events.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct EventsQuery {
    /// Resume after this event id, for clients that cannot send `Last-Event-ID` (the header
    /// wins when both are sent); empty: from the start.
    #[param(pattern = "^([0-9]{1,20}-[0-9]{1,20})?$", nullable = false)]
    last_event_id: Option<String>,
}

/// The `Last-Event-ID` request header.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)]
pub(crate) struct LastEventId {
    /// Resume after this event id (`<milliseconds>-<sequence>`), as a reconnecting
    /// `EventSource` sends it: events after it are replayed, then live ones follow. Empty:
    /// from the start.
    #[param(
        rename = "Last-Event-ID",
        pattern = "^([0-9]{1,20}-[0-9]{1,20})?$",
        nullable = false
    )]
    last_event_id: Option<String>,
}

/// `GET /api/v1/scan/{id}/events`: the job's events as SSE, after `Last-Event-ID` when given.
#[utoipa::path(
    get,
    path = "/api/v1/scan/{id}/events",
    tag = "scans",
    operation_id = "scanEvents",
    summary = "A scan's events",
    description = "The job's events as Server-Sent Events, from the start or after \
                   `Last-Event-ID`, until `ready` or `error`; a finished job replays and ends, \
                   and a resume at or past its end is answered 204. \
                   Every client of a job shares one upstream watch. For an `EventSource`, a \
                   ticket (`POST /api/v1/sse-tickets`) may come in `?ticket=`, or \
                   the token in the `ecoscan_token` cookie. An \
                   unknown job is a 404, not an event. Counts against the caller's open \
                   streams.",
    params(
        ("id" = String, Path, format = "uuid", description = "The job's id (a UUID)."),
        LastEventId,
        EventsQuery,
    ),
    responses(
        (status = 200, response = ScanEvents),
        (status = 204, description = "The job has ended at or before `Last-Event-ID`: the \
                                      client has its end, and nothing follows (an \
                                      `EventSource` stops reconnecting). Its result is at \
                                      `/api/v1/scan/{id}`."),
        CommonErrors,
        (status = 404, response = NotFound),
        (status = 429, response = TooManyRequests),
    ),
    security(("bearerAuth" = []), ("sseTicket" = []), ("tokenCookie" = [])),
)]
pub(crate) async fn events(
    State(state): State<AppState>,
    caller: Caller,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<EventsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = path_job_id(path)?;
    let Query(query) = query.map_err(|e| ApiError::InvalidArgument(e.body_text()))?;
    // A malformed query id is refused even when the header wins: it is still bad input.
    if let Some(q) = query.last_event_id.as_deref()
        && !q.is_empty()
        && !valid_event_id(q)
    {
        return Err(ApiError::invalid_field(
            "last_event_id",
            "last_event_id must be an event id like 1718000000000-0",
        ));
    }
    let slot = state.sse.take(&caller.user)?;
    // The header is what a reconnecting EventSource sends; the query is for clients that
    // cannot set headers.
    let after = match headers.get("last-event-id") {
        Some(v) => Some(v.to_str().unwrap_or("\u{0}").to_owned()),
        None => query.last_event_id,
    }
    .unwrap_or_default();
    if !after.is_empty() && !valid_event_id(&after) {
        return Err(ApiError::invalid_field(
            "Last-Event-ID",
            "Last-Event-ID must be an event id like 1718000000000-0",
        ));
    }
    // Every client of a job shares one upstream watch; a resume from outside its replay
    // window gets a watch of its own.
    // Ingest out of reach for a passing reason (restarting, its stores down) is no answer
    // about the job: the stream opens and ends at once with the hint to come back, as when
    // ingest goes away mid-stream. A 503 would be worse for the clients this route serves:
    // an `EventSource` that gets one gives up for good, and a resume at a finished job's end
    // is promised its end, never a 5xx.
    let come_back = |status: tonic::Status| -> sse::ScanEvents {
        futures::stream::once(std::future::ready(Err(status))).boxed()
    };
    let (stream, first) = match state
        .watches
        .subscribe(&caller, &id, (!after.is_empty()).then_some(after.as_str()))
        .await
    {
        Ok(sub) => (sub.into_stream().boxed(), None),
        Err(Refused::Upstream(status)) if retryable(&status) => (come_back(status), None),
        Err(Refused::Upstream(status)) => return Err(ingest_error(status)),
        Err(Refused::OutsideWindow) => {
            let msg = WatchRequest {
                job_id: id.clone(),
                after_event_id: after.clone(),
            };
            match state
                .scan
                .clone()
                .watch(crate::auth::request(msg, SCAN_STREAM_DEADLINE, &caller))
                .await
            {
                Ok(res) => {
                    let mut stream = sse::scan_stream(res.into_inner(), |r| {
                        SharedEvent::from_parts(r.event, r.resync)
                    });
                    match sse::first_item(&mut stream).await {
                        Some(Ok(first)) => (stream, Some(first)),
                        Some(Err(status)) if retryable(&status) => (come_back(status), None),
                        Some(Err(status)) => return Err(ingest_error(status)),
                        None => (stream, None),
                    }
                }
                Err(status) if retryable(&status) => (come_back(status), None),
                Err(status) => return Err(ingest_error(status)),
            }
        }
    };
    let (stream, first) = if after.is_empty() {
        (stream, first)
    } else {
        peek(stream, first).await
    };
    // A client resuming at (or past) the job's end has it: nothing follows, which 204 says.
    // For an `EventSource` it is the one answer that stops its reconnecting (the standard's
    // "no content"); every client knows the job is over and may read its result.
    if let Some(ev) = &first
        && ev.kind().is_terminal()
        && ev.event_id().parse::<EventId>().ok() <= after.parse::<EventId>().ok()
    {
        crate::event::finish_upstream(stream);
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok(sse::scan_events(
        stream,
        first,
        id,
        state.result_url_fn(),
        slot,
        state.shutdown.clone(),
        state.stream_times(),
    ))
}

/// The stream's first message, waited for briefly when none was read yet; an error is put back
/// for the stream to end with, as it would have.
async fn peek(
    mut stream: sse::ScanEvents,
    first: Option<Arc<SharedEvent>>,
) -> (sse::ScanEvents, Option<Arc<SharedEvent>>) {
    if first.is_some() {
        return (stream, first);
    }
    match sse::first_item(&mut stream).await {
        Some(Ok(ev)) => (stream, Some(ev)),
        Some(Err(status)) => (
            futures::stream::once(std::future::ready(Err(status)))
                .chain(stream)
                .boxed(),
            None,
        ),
        None => (stream, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ecoscan_proto::v1::{ErrorInfo, Stage};

    #[test]
    fn finished_results_use_short_names_and_the_sse_error_shape() {
        let result = ScanResult {
            job_id: "j".into(),
            status: JobStatus::Failed as i32,
            stage: Stage::Vision as i32,
            error: Some(ErrorInfo {
                code: "UNAVAILABLE".into(),
                http_status: 503,
                message: "vision is down".into(),
                retryable: true,
            }),
            classification: Some(ecoscan_proto::v1::Classification {
                confidence: 0.93,
                ..Default::default()
            }),
            ..ScanResult::default()
        };
        let v = result_json(&result).unwrap();
        // Served as stored, without f32 noise.
        assert_eq!(v["classification"]["confidence"], 0.93);
        assert_eq!(v["status"], "failed");
        assert_eq!(v["stage"], "vision");
        assert_eq!(v["job_id"], "j");
        assert_eq!(v["error"]["http_status"], 503);
        assert_eq!(v["error"]["retryable"], true);
    }
}
