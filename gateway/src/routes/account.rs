//! A person's things: characters, notifications, and model usage.

use std::time::{Duration, SystemTime};

use axum::{
    Json,
    body::Bytes,
    extract::{
        Query, State,
        rejection::{BytesRejection, QueryRejection},
    },
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};
use ecoscan_proto::{
    Timestamp,
    v1::{ListOwnedRequest, ListRequest, ScheduleRequest, SubscribeRequest, UsageRequest},
};
use futures::StreamExt;
use serde::Deserialize;
use utoipa::{
    IntoParams, PartialSchema, ToSchema,
    openapi::{
        RefOr,
        schema::{AllOfBuilder, ObjectBuilder, OneOfBuilder, Schema},
    },
};

use crate::{
    AppState, NOTIFICATION_STREAM_DEADLINE, UNARY_DEADLINE,
    auth::{Admin, Caller},
    error::ApiError,
    input::idempotency_key,
    routes::scan::IdempotencyKey,
    schema::{BodyErrors, CommonErrors, Forbidden, TooManyRequests, proto},
    sse::{self, doc::NotificationEvents},
};

/// Longest delay a notification may be scheduled for.
const MAX_DELAY: Duration = Duration::from_secs(366 * 24 * 60 * 60);

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::InvalidArgument(e.body_text()))
}

/// Parses an RFC 3339 time (`2026-05-01T09:00:00+09:00`) the way proto3 JSON does.
fn rfc3339(name: &'static str, value: &str) -> Result<Timestamp, ApiError> {
    serde_json::from_value(serde_json::Value::String(value.to_owned())).map_err(|_| {
        ApiError::invalid_field(
            name,
            format!("{name} must be an RFC 3339 time such as 2026-05-01T09:00:00Z"),
        )
    })
}

/// `GET /api/v1/characters/me`: the characters the caller owns.
#[utoipa::path(
    get,
    path = "/api/v1/characters/me",
    tag = "account",
    operation_id = "myCharacters",
    summary = "The caller's characters",
    description = "The characters the caller has earned with scans, oldest first.",
    responses(
        (status = 200, description = "The caller's collection.",
            body = proto::ListOwnedResponse),
        CommonErrors,
    ),
    security(("bearerAuth" = [])),
)]
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

/// How much of the inbox to read.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// At most this many notifications, 1-500; 50 when absent.
    #[param(minimum = 1, maximum = 500, nullable = false)]
    limit: Option<u32>,
}

/// `GET /api/v1/notifications?limit=`: the caller's inbox, newest first.
#[utoipa::path(
    get,
    path = "/api/v1/notifications",
    tag = "account",
    operation_id = "listNotifications",
    summary = "The caller's inbox",
    description = "The caller's notifications, newest first (scheduled and cancelled ones \
                   included).",
    params(ListQuery),
    responses(
        (status = 200, description = "The inbox.", body = proto::ListResponse),
        CommonErrors,
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn notifications(
    State(state): State<AppState>,
    caller: Caller,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let limit = q.limit.unwrap_or(50);
    if !(1..=500).contains(&limit) {
        return Err(ApiError::invalid_field(
            "limit",
            "limit must be between 1 and 500",
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
#[utoipa::path(
    get,
    path = "/api/v1/notifications/stream",
    tag = "account",
    operation_id = "notificationStream",
    summary = "The caller's notifications, live",
    description = "The caller's notifications as Server-Sent Events as they are delivered. The \
                   headers go out at once; a quiet inbox sends only keepalive comments. For an \
                   `EventSource`, a ticket (`POST /api/v1/sse-tickets`) may come \
                   in `?ticket=`, or the token in the `ecoscan_token` cookie. Counts against the caller's open streams.",
    responses(
        (status = 200, response = NotificationEvents),
        CommonErrors,
        (status = 429, response = TooManyRequests),
    ),
    security(("bearerAuth" = []), ("sseTicket" = []), ("tokenCookie" = [])),
)]
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
        state.stream_times(),
    ))
}

/// The body of `POST /api/v1/notifications`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ScheduleBody {
    /// Short title, 1-200 characters (not only spaces).
    #[schema(min_length = 1, max_length = 200, pattern = r"\S")]
    title: String,
    /// Text, at most 2000 characters.
    #[serde(default)]
    #[schema(max_length = 2000)]
    body: String,
    /// What it is about: 1-64 characters of a-z and `_`; `reminder` when absent or `null`.
    #[schema(pattern = "^[a-z_]{1,64}$")]
    kind: Option<String>,
    /// When to deliver it: an RFC 3339 time, e.g. `2026-05-01T09:00:00+09:00` (`null` is
    /// the same as absent).
    #[schema(format = DateTime)]
    due_at: Option<String>,
    /// When to deliver it: this many seconds from now, at most a year (366 days) (`null` is
    /// the same as absent).
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 0, maximum = 31_622_400)]
    delay_seconds: Option<u64>,
}

/// `delay_seconds` as JSON Schema's `integer` reads it: any number without a fractional part,
/// `3600.0` too (beyond `u64` it saturates, and is then refused as more than a year).
fn whole_seconds<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    if let Some(secs) = n.as_u64() {
        return Ok(Some(secs));
    }
    match n.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 => Ok(Some(f as u64)),
        _ => Err(serde::de::Error::custom(format!(
            "delay_seconds must be a whole number of seconds, not {n}"
        ))),
    }
}

/// The request body of `POST /api/v1/notifications`: a [`ScheduleBody`] with exactly one of
/// `due_at` and `delay_seconds`.
pub(crate) struct ScheduleNotification;

impl PartialSchema for ScheduleNotification {
    fn schema() -> RefOr<Schema> {
        AllOfBuilder::new()
            .item(ScheduleBody::schema())
            .item(
                // A `null` is the same as absent, so "one of" counts the non-null values.
                OneOfBuilder::new()
                    .item(
                        ObjectBuilder::new()
                            .property("due_at", String::schema())
                            .required("due_at"),
                    )
                    .item(
                        ObjectBuilder::new()
                            .property("delay_seconds", u64::schema())
                            .required("delay_seconds"),
                    ),
            )
            .description(Some(
                "A notification to schedule for the caller: exactly one of `due_at` and \
                 `delay_seconds`.",
            ))
            .examples([serde_json::json!({
                "title": "Take the recycling out",
                "body": "Bottles and cans go out on Tuesday.",
                "delay_seconds": 3600,
            })])
            .into()
    }
}

impl ToSchema for ScheduleNotification {}

/// `POST /api/v1/notifications`: schedules a notification for the caller; 201 with it.
/// An `Idempotency-Key` makes a repeat return the first notification.
#[utoipa::path(
    post,
    path = "/api/v1/notifications",
    tag = "account",
    operation_id = "scheduleNotification",
    summary = "Schedule a notification",
    description = "Schedules a notification for the caller, delivered (to its live streams and \
                   inbox) at `due_at` or after `delay_seconds`. With an `Idempotency-Key`, a \
                   repeat returns the first notification. Rate-limited per user.",
    params(IdempotencyKey),
    request_body(content = ScheduleNotification, content_type = "application/json"),
    responses(
        (status = 201, description = "Scheduled.", body = proto::Notification),
        CommonErrors,
        BodyErrors,
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn schedule(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: ScheduleBody = crate::input::json_body(&headers, body, "the notification")?;
    state.rate.schedule(&caller.user)?;
    let dedupe_key = idempotency_key(&headers)?;
    let title = b.title.trim().to_owned();
    if title.is_empty() || title.chars().count() > 200 {
        return Err(ApiError::invalid_field(
            "title",
            "title must be 1-200 characters",
        ));
    }
    if b.body.chars().count() > 2_000 {
        return Err(ApiError::invalid_field(
            "body",
            "body must be at most 2000 characters",
        ));
    }
    let kind = b.kind.unwrap_or_else(|| "reminder".to_owned());
    if kind.is_empty()
        || kind.len() > 64
        || !kind.bytes().all(|c| c.is_ascii_lowercase() || c == b'_')
    {
        return Err(ApiError::invalid_field(
            "kind",
            "kind must be 1-64 characters of a-z and _",
        ));
    }
    let due_at = match (b.due_at, b.delay_seconds) {
        (Some(at), None) => rfc3339("due_at", &at)?,
        (None, Some(secs)) => {
            let delay = Duration::from_secs(secs);
            if delay > MAX_DELAY {
                return Err(ApiError::invalid_field(
                    "delay_seconds",
                    "delay_seconds must be at most one year",
                ));
            }
            ecoscan_proto::timestamp(SystemTime::now() + delay)
        }
        _ => {
            return Err(ApiError::invalid_fields(
                &["due_at", "delay_seconds"],
                "send exactly one of `due_at` and `delay_seconds`",
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

/// The window of a usage query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct UsageQuery {
    /// Window start (inclusive), RFC 3339; 24 hours before `until` when absent.
    #[param(format = DateTime, nullable = false)]
    since: Option<String>,
    /// Window end (exclusive), RFC 3339; now when absent. Not before `since`.
    #[param(format = DateTime, nullable = false)]
    until: Option<String>,
}

/// `GET /api/v1/analytics/usage?since=&until=`: model usage per service and model.
#[utoipa::path(
    get,
    path = "/api/v1/analytics/usage",
    tag = "account",
    operation_id = "modelUsage",
    summary = "Model usage (admin)",
    description = "Calls, errors, tokens and latency of the model calls in a window, per \
                   service and model. Needs the admin role.",
    params(UsageQuery),
    responses(
        (status = 200, description = "Usage in the window, defaults applied.",
            body = proto::UsageResponse),
        CommonErrors,
        (status = 403, response = Forbidden),
    ),
    security(("bearerAuth" = ["admin"])),
)]
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
        return Err(ApiError::invalid_fields(
            &["since", "until"],
            "since must not be after until",
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

    #[test]
    fn schedule_body_reads_integers_as_json_schema_does_and_null_as_absent() {
        let read = |v: serde_json::Value| serde_json::from_value::<ScheduleBody>(v);
        let b = read(serde_json::json!({"title": "x", "delay_seconds": 3600.0})).unwrap();
        assert_eq!(b.delay_seconds, Some(3600));
        let b = read(serde_json::json!({"title": "x", "delay_seconds": 60, "kind": null})).unwrap();
        assert_eq!((b.delay_seconds, b.kind), (Some(60), None));
        let b = read(serde_json::json!({"title": "x", "delay_seconds": null})).unwrap();
        assert_eq!(b.delay_seconds, None);
        assert!(read(serde_json::json!({"title": "x", "delay_seconds": 1.5})).is_err());
        assert!(read(serde_json::json!({"title": "x", "delay_seconds": -1})).is_err());
        assert!(read(serde_json::json!({"title": "x", "delay_seconds": "60"})).is_err());
    }
}
