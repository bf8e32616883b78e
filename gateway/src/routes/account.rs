//! A person's things: characters, notifications, and model usage.

use std::time::{Duration, SystemTime};

use axum::{
    Json,
    body::Bytes,
    extract::{Query, State, rejection::QueryRejection},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
};
use ecoscan_proto::{
    Timestamp,
    v1::{ListOwnedRequest, ListRequest, ScheduleRequest, SubscribeRequest, UsageRequest},
};
use futures::StreamExt;
use serde::Deserialize;

use crate::{
    AppState, NOTIFICATION_STREAM_DEADLINE, UNARY_DEADLINE,
    auth::{Admin, Caller},
    error::ApiError,
    input::idempotency_key,
    sse,
};

/// Longest delay a notification may be scheduled for.
const MAX_DELAY: Duration = Duration::from_secs(366 * 24 * 60 * 60);

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::InvalidArgument(e.body_text()))
}

/// Parses an RFC 3339 time (`2026-05-01T09:00:00+09:00`) the way proto3 JSON does.
fn rfc3339(name: &str, value: &str) -> Result<Timestamp, ApiError> {
    serde_json::from_value(serde_json::Value::String(value.to_owned())).map_err(|_| {
        ApiError::InvalidArgument(format!(
            "{name} must be an RFC 3339 time such as 2026-05-01T09:00:00Z"
        ))
    })
}

/// `GET /api/v1/characters/me`: the characters the caller owns.
pub(crate) async fn characters(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Response, ApiError> {
    let msg = ListOwnedRequest {};
    let res = state
        .reward
        .clone()
        .list_owned(crate::auth::request(msg, UNARY_DEADLINE, &caller))
        .await
        .map_err(|s| ApiError::upstream("reward", s))?
        .into_inner();
    Ok(Json(res).into_response())
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    limit: Option<u32>,
}

/// `GET /api/v1/notifications?limit=`: the caller's inbox, newest first.
pub(crate) async fn notifications(
    State(state): State<AppState>,
    caller: Caller,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let limit = q.limit.unwrap_or(50);
    if !(1..=500).contains(&limit) {
        return Err(ApiError::InvalidArgument(
            "limit must be between 1 and 500".into(),
        ));
    }
    let msg = ListRequest { limit };
    let res = state
        .notification
        .clone()
        .list(crate::auth::request(msg, UNARY_DEADLINE, &caller))
        .await
        .map_err(|s| ApiError::upstream("notification", s))?
        .into_inner();
    Ok(Json(res).into_response())
}

/// `GET /api/v1/notifications/stream`: the caller's notifications as they are delivered (SSE).
pub(crate) async fn notification_stream(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Response, ApiError> {
    let slot = state.sse.take(&caller.user)?;
    let msg = SubscribeRequest {};
    let stream = state
        .notification
        .clone()
        .subscribe(crate::auth::request(
            msg,
            NOTIFICATION_STREAM_DEADLINE,
            &caller,
        ))
        .await
        .map_err(|s| ApiError::upstream("notification", s))?
        .into_inner()
        .map(|item| {
            item.and_then(|r| {
                r.notification.ok_or_else(|| {
                    tonic::Status::internal("notification sent a stream message without one")
                })
            })
        });
    // No wait for a first message here: a quiet inbox is the normal case, and the headers
    // should go out at once.
    Ok(sse::notification_events(
        stream,
        None,
        slot,
        state.shutdown.clone(),
        state.config.sse_max_lifetime,
    ))
}

/// The body of `POST /api/v1/notifications`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleBody {
    title: String,
    #[serde(default)]
    body: String,
    kind: Option<String>,
    due_at: Option<String>,
    delay_seconds: Option<u64>,
}

/// `POST /api/v1/notifications`: schedules a notification for the caller; 201 with it.
/// An `Idempotency-Key` makes a repeat return the first notification.
pub(crate) async fn schedule(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().starts_with("application/json"));
    if !is_json {
        return Err(ApiError::UnsupportedMediaType(
            "send the notification as application/json".into(),
        ));
    }
    state.rate.schedule(&caller.user)?;
    let dedupe_key = idempotency_key(&headers)?;
    let b: ScheduleBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
    let title = b.title.trim().to_owned();
    if title.is_empty() || title.chars().count() > 200 {
        return Err(ApiError::InvalidArgument(
            "title must be 1-200 characters".into(),
        ));
    }
    if b.body.chars().count() > 2_000 {
        return Err(ApiError::InvalidArgument(
            "body must be at most 2000 characters".into(),
        ));
    }
    let kind = b.kind.unwrap_or_else(|| "reminder".to_owned());
    if kind.is_empty()
        || kind.len() > 64
        || !kind.bytes().all(|c| c.is_ascii_lowercase() || c == b'_')
    {
        return Err(ApiError::InvalidArgument(
            "kind must be 1-64 characters of a-z and _".into(),
        ));
    }
    let due_at = match (b.due_at, b.delay_seconds) {
        (Some(at), None) => rfc3339("due_at", &at)?,
        (None, Some(secs)) => {
            let delay = Duration::from_secs(secs);
            if delay > MAX_DELAY {
                return Err(ApiError::InvalidArgument(
                    "delay_seconds must be at most one year".into(),
                ));
            }
            ecoscan_proto::timestamp(SystemTime::now() + delay)
        }
        _ => {
            return Err(ApiError::InvalidArgument(
                "send exactly one of `due_at` and `delay_seconds`".into(),
            ));
        }
    };
    let msg = ScheduleRequest {
        kind,
        title,
        body: b.body,
        due_at: Some(due_at),
        dedupe_key,
    };
    let notification = state
        .notification
        .clone()
        .schedule(crate::auth::request(msg, UNARY_DEADLINE, &caller))
        .await
        .map_err(|s| ApiError::upstream("notification", s))?
        .into_inner()
        .notification
        .ok_or_else(|| ApiError::Internal("notification answered Schedule without it".into()))?;
    Ok((StatusCode::CREATED, Json(notification)).into_response())
}

#[derive(Debug, Deserialize)]
pub(crate) struct UsageQuery {
    since: Option<String>,
    until: Option<String>,
}

/// `GET /api/v1/analytics/usage?since=&until=`: model usage per service and model.
pub(crate) async fn usage(
    State(state): State<AppState>,
    Admin(caller): Admin,
    q: Result<Query<UsageQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let since = q
        .since
        .as_deref()
        .map(|v| rfc3339("since", v))
        .transpose()?;
    let until = q
        .until
        .as_deref()
        .map(|v| rfc3339("until", v))
        .transpose()?;
    if let (Some(s), Some(u)) = (&since, &until)
        && (s.seconds, s.nanos) > (u.seconds, u.nanos)
    {
        return Err(ApiError::InvalidArgument(
            "since must not be after until".into(),
        ));
    }
    let res = state
        .analytics
        .clone()
        .usage(crate::auth::request(
            UsageRequest { since, until },
            UNARY_DEADLINE,
            &caller,
        ))
        .await
        .map_err(|s| ApiError::upstream("analytics", s))?
        .into_inner();
    Ok(Json(res).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_accepts_offsets_and_rejects_garbage() {
        let t = rfc3339("due_at", "2026-05-01T09:00:00+09:00").unwrap();
        assert_eq!(t.seconds, 1_777_593_600);
        assert!(rfc3339("due_at", "tomorrow").is_err());
        assert!(rfc3339("due_at", "2026-05-01").is_err());
    }
}
