//! Scans: submit, submit-and-stream, result, and a job's event stream.

use axum::{
    Json,
    extract::{Path, Query, Request, State, rejection::QueryRejection},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
};
use ecoscan_proto::v1::{
    GetResultRequest, JobStatus, ScanRequest, ScanResult, SubmitRequest, WatchRequest,
};
use serde::Deserialize;
use serde_json::json;

use crate::{
    AppState, SCAN_STREAM_DEADLINE, SUBMIT_DEADLINE, UNARY_DEADLINE,
    auth::Caller,
    error::ApiError,
    input::{ScanInput, idempotency_key, job_id, valid_event_id},
    sse::{self, error_info_json, stage_name},
    watch::Refused,
};
use futures::StreamExt as _;

fn ingest_error(status: tonic::Status) -> ApiError {
    ApiError::upstream("ingest", status)
}

/// `JOB_STATUS_RUNNING` → `running`.
fn job_status_name(status: i32) -> String {
    JobStatus::try_from(status)
        .unwrap_or(JobStatus::Unspecified)
        .as_str_name()
        .trim_start_matches("JOB_STATUS_")
        .to_ascii_lowercase()
}

/// Reads and checks the scan; nothing reaches ingest unless this succeeds.
async fn submit_request(state: &AppState, req: Request) -> Result<SubmitRequest, ApiError> {
    let idempotency_key = idempotency_key(req.headers())?;
    let input = ScanInput::from_request(req, state).await?;
    tracing::info!(
        image_bytes = input.image.len(),
        content_type = %input.content_type,
        by_url = !input.image_url.is_empty(),
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
    })
}

/// `POST /api/v1/scan`: accepts a scan and answers 202 with where to follow it.
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
    let body = json!({
        "job_id": res.job_id,
        "status": job_status_name(res.status),
        "events_url": state.events_url(&res.job_id),
        "result_url": result_url,
        "duplicate": res.duplicate,
    });
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, result_url)],
        Json(body),
    )
        .into_response())
}

/// `POST /api/v1/scan/completion`: submits and answers with the job's events as SSE.
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
    let mut stream = sse::scan_stream(stream, |r| r.event);
    let first = sse::first_message(&mut stream, "ingest").await?;
    Ok(sse::scan_events(
        stream,
        first,
        String::new(),
        state.result_url_fn(),
        slot,
        state.shutdown.clone(),
        state.config.sse_max_lifetime,
    ))
}

/// `GET /api/v1/scan/{id}`: 202 while the job runs, 200 with the result once it has finished.
pub(crate) async fn result(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw_id): Path<String>,
) -> Result<Response, ApiError> {
    let id = job_id(&raw_id)?;
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
            let body = json!({
                "job_id": id,
                "status": job_status_name(result.status),
                "stage": stage_name(result.stage),
                "events_url": state.events_url(&id),
                "result_url": state.result_url(&id),
            });
            Ok((
                StatusCode::ACCEPTED,
                [(header::RETRY_AFTER, "1")],
                Json(body),
            )
                .into_response())
        }
        Ok(JobStatus::Succeeded | JobStatus::Failed) => {
            Ok((StatusCode::OK, Json(result_json(&result)?)).into_response())
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
    let mut value = serde_json::to_value(result)
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

#[derive(Debug, Deserialize)]
pub(crate) struct EventsQuery {
    last_event_id: Option<String>,
}

/// `GET /api/v1/scan/{id}/events`: the job's events as SSE, after `Last-Event-ID` when given.
pub(crate) async fn events(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw_id): Path<String>,
    query: Result<Query<EventsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = job_id(&raw_id)?;
    let Query(query) = query.map_err(|e| ApiError::InvalidArgument(e.body_text()))?;
    let slot = state.sse.take(&caller.user)?;
    // The header is what a reconnecting EventSource sends; the query is for clients that
    // cannot set headers.
    let after = match headers.get("last-event-id") {
        Some(v) => Some(v.to_str().unwrap_or("\u{0}").to_owned()),
        None => query.last_event_id,
    }
    .unwrap_or_default();
    if !after.is_empty() && !valid_event_id(&after) {
        return Err(ApiError::InvalidArgument(
            "Last-Event-ID must be an event id like 1718000000000-0".into(),
        ));
    }
    // Every client of a job shares one upstream watch; a resume from outside its replay
    // window gets a watch of its own.
    let (stream, first) = match state
        .watches
        .subscribe(&caller, &id, (!after.is_empty()).then_some(after.as_str()))
        .await
    {
        Ok(sub) => (sub.into_stream().boxed(), None),
        Err(Refused::Upstream(status)) => return Err(ingest_error(status)),
        Err(Refused::OutsideWindow) => {
            let msg = WatchRequest {
                job_id: id.clone(),
                after_event_id: after,
            };
            let stream = state
                .scan
                .clone()
                .watch(crate::auth::request(msg, SCAN_STREAM_DEADLINE, &caller))
                .await
                .map_err(ingest_error)?
                .into_inner();
            let mut stream = sse::scan_stream(stream, |r| r.event);
            let first = sse::first_message(&mut stream, "ingest").await?;
            (stream, first)
        }
    };
    Ok(sse::scan_events(
        stream,
        first,
        id,
        state.result_url_fn(),
        slot,
        state.shutdown.clone(),
        state.config.sse_max_lifetime,
    ))
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
            ..ScanResult::default()
        };
        let v = result_json(&result).unwrap();
        assert_eq!(v["status"], "failed");
        assert_eq!(v["stage"], "vision");
        assert_eq!(v["job_id"], "j");
        assert_eq!(v["error"]["http_status"], 503);
        assert_eq!(v["error"]["retryable"], true);
    }
}
