//! The gateway's one error type and its one mapping to HTTP responses.
//!
//! Every error answer is an RFC 9457 problem (`application/problem+json`): `type`, `title`,
//! `status`, `detail`, `instance`, and the members ecoscan adds, `code`, `reason`, `message` and
//! `retryable` ([`ErrorBody`]). Upstream gRPC statuses map
//! through the shared table (`ecoscan_common::codes::http_status`), with one exception for load
//! shedding (see [`ApiError::http_status`]). Messages of server-side failures never reach the
//! caller: they are logged, and the caller gets a short generic message.
//!
//! A leaf: it knows no other module of the gateway (`auth` turns its `AuthError` into an
//! [`ApiError`]).

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use ecoscan_common::codes;
use serde::Serialize;
use tonic::Code;

/// Seconds a caller should wait after a load-shedding answer when the upstream named none.
pub(crate) const DEFAULT_RETRY_AFTER_SECS: u64 = 5;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request as a whole is wrong (400): a body that does not parse, a query string that
    /// does not decode. Use [`ApiError::InvalidField`] when one field is the problem.
    #[error("{0}")]
    InvalidArgument(String),
    /// One field of the request is wrong (400, reason `INVALID_FIELD`, the reason a backend's
    /// `BadRequest` carries): the problem names it in `errors`, as the gRPC services name
    /// theirs in a `BadRequest` field violation.
    #[error("{message}")]
    InvalidField {
        /// The fields as the API names them: a body or form member (`locale`), a path or query
        /// parameter (`job_id`, `limit`), or a header (`Idempotency-Key`); more than one when
        /// the problem is between them (send exactly one of two).
        fields: Vec<&'static str>,
        /// What is wrong with it and what to send instead.
        message: String,
    },
    /// The body or image is larger than allowed (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The request's or the image's type is not one we take (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// No such route or resource (404).
    #[error("{0}")]
    NotFound(String),
    /// The gateway itself is at its concurrency limit (503).
    #[error("the gateway is at capacity; try again shortly")]
    Overloaded,
    /// Not authenticated (401): no usable credentials; `message` says what was missing or refused.
    #[error("{message}")]
    Unauthenticated {
        message: String,
        /// Credentials were sent and refused, as `WWW-Authenticate` says (RFC 6750
        /// `error="invalid_token"`).
        invalid_token: bool,
    },
    /// Not allowed (403).
    #[error("{0}")]
    Forbidden(String),
    /// This caller sent too much too fast (429), or holds too many streams.
    #[error("{message}")]
    TooMany {
        message: String,
        retry_after_secs: u64,
    },
    /// The request's body arrived too slowly (408).
    #[error("{0}")]
    Timeout(String),
    /// Something inside the gateway failed (500); the cause is logged, not returned.
    #[error("internal error")]
    Internal(String),
    /// A backend refused the identity assertion the gateway signed for a caller it had
    /// verified (`UNAUTHENTICATED` from upstream): the operator's misconfiguration (a replica
    /// with another `ECOSCAN_IDENTITY_KEY`, clocks apart), never the caller's token. A 500 with
    /// a plain reason and an ERROR log line, never a 401.
    #[error("{service} refused the gateway's identity assertion: {message}")]
    IdentityRefused {
        service: &'static str,
        /// What the backend said (for the log only).
        message: String,
    },
    /// A backend answered with a gRPC error.
    #[error("{service} answered {}: {}", .status.code(), .status.message())]
    Upstream {
        service: &'static str,
        status: tonic::Status,
    },
}

/// Why a request failed, in full (an internal cause included), carried on the error response
/// for the request span's status description; never sent to the caller.
#[derive(Clone, Debug)]
pub(crate) struct FailureReason(pub String);

/// The media type of every error answer (RFC 9457).
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// The error body every failed request gets: an RFC 9457 problem with ecoscan's members.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(example = json!({
    "type": "urn:ecoscan:problem:BACKLOG_FULL",
    "title": "Service Unavailable",
    "status": 503,
    "detail": "the ingest service is busy; try again later",
    "instance": "urn:ecoscan:trace:4bf92f3577b34da6a3ce929d0e0e4736",
    "code": "RESOURCE_EXHAUSTED",
    "reason": "BACKLOG_FULL",
    "message": "the ingest service is busy; try again later",
    "retryable": true
}))]
pub(crate) struct ErrorBody {
    /// The problem type: `urn:ecoscan:problem:` and the [`reason`](ErrorBody::reason).
    #[serde(rename = "type")]
    #[schema(pattern = "^urn:ecoscan:problem:[A-Z_]+$")]
    pub kind: String,
    /// A short summary of the HTTP status, the same for every occurrence.
    pub title: &'static str,
    /// The HTTP status of this answer.
    #[schema(minimum = 400, maximum = 599)]
    pub status: u16,
    /// What went wrong and what to do, for a person (server-side failures get a generic
    /// message; the cause is in the log under the trace id).
    pub detail: String,
    /// This occurrence: `urn:ecoscan:trace:` and the request's trace id, to find it in the
    /// traces and logs. Absent when the request was not traced.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^urn:ecoscan:trace:[0-9a-f]{32}$")]
    pub instance: Option<String>,
    /// Machine-readable: a gRPC code name (`INVALID_ARGUMENT`, `NOT_FOUND`, `UNAVAILABLE`, …) or
    /// an HTTP-only condition (`PAYLOAD_TOO_LARGE`, `UNSUPPORTED_MEDIA_TYPE`).
    #[schema(pattern = "^[A-Z_]+$")]
    pub code: &'static str,
    /// Why, as a client may branch on it: the `ErrorInfo` reason the backend sent (the same as
    /// a gRPC caller gets, docs/api.md lists them), else the code.
    #[schema(pattern = "^[A-Z_]+$")]
    pub reason: String,
    /// The same as `detail` (the member error answers had before they were problems).
    pub message: String,
    /// True when the same request may succeed later (`Retry-After` says when, where sent).
    pub retryable: bool,
    /// The fields of the request that are invalid (reason `INVALID_FIELD`): each field's name,
    /// as the API names it, and what is wrong with it. Absent when none is known.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
}

/// One invalid field of a request.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct FieldError {
    /// The field, as the request names it (`locale`, `image`, …).
    pub field: String,
    /// What is wrong with it and what to send instead.
    pub detail: String,
}

/// An error as SSE `error` events and failed scan results carry it (the shape of `ErrorInfo`).
#[derive(Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub(crate) struct ErrorJson {
    /// gRPC status code name, e.g. `UNAVAILABLE`.
    #[schema(pattern = "^[A-Z_]+$")]
    pub code: String,
    /// The HTTP status a REST caller would see for it, e.g. 503.
    pub http_status: u16,
    /// What went wrong, for a person.
    pub message: String,
    /// True when submitting the scan again may succeed.
    pub retryable: bool,
}

impl ApiError {
    /// One field of the request is wrong: `message` says what and what to send instead.
    pub fn invalid_field(field: &'static str, message: impl Into<String>) -> Self {
        Self::invalid_fields(&[field], message)
    }

    /// Fields of the request that are wrong together (send exactly one of them, …).
    pub fn invalid_fields(fields: &[&'static str], message: impl Into<String>) -> Self {
        Self::InvalidField {
            fields: fields.to_vec(),
            message: message.into(),
        }
    }

    /// An upstream gRPC failure of `service`.
    pub fn upstream(service: &'static str, status: tonic::Status) -> Self {
        // The gateway never cancels a call it still answers: a CANCELLED (or a transport error)
        // here is the backend's connection breaking (a replica died, it is draining), which is
        // 503 and worth retrying, not the 499 "client closed request" of the shared table.
        if status.code() == Code::Unauthenticated {
            // The gateway verified its caller before calling: a backend that still finds no
            // identity refuses what the gateway signed.
            return Self::IdentityRefused {
                service,
                message: status.message().to_owned(),
            };
        }
        Self::Upstream {
            service,
            status: codes::connection_lost_is_unavailable(status),
        }
    }

    /// The HTTP status for this error.
    pub fn http_status(&self) -> StatusCode {
        match self {
            Self::InvalidArgument(_) | Self::InvalidField { .. } => StatusCode::BAD_REQUEST,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::Unauthenticated { .. } => StatusCode::UNAUTHORIZED,
            Self::TooMany { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Internal(_) | Self::IdentityRefused { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            // grpc-gateway maps RESOURCE_EXHAUSTED to 429 (the shared table does too), but here it
            // means a backend is shedding load (ingest's backlog is full), not that this caller
            // sent too much: DESIGN says the edge answers 503 with Retry-After, so clients and
            // load balancers treat it as a temporary capacity problem. This is the one exception.
            Self::Upstream { status, .. } if status.code() == Code::ResourceExhausted => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Upstream { status, .. } => {
                StatusCode::from_u16(codes::http_status(status.code()))
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    /// The machine-readable code: a gRPC code name, or an HTTP-only condition's name.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidArgument(_) | Self::InvalidField { .. } => "INVALID_ARGUMENT",
            Self::PayloadTooLarge(_) => "PAYLOAD_TOO_LARGE",
            Self::UnsupportedMediaType(_) => "UNSUPPORTED_MEDIA_TYPE",
            Self::NotFound(_) => "NOT_FOUND",
            Self::Overloaded => "UNAVAILABLE",
            Self::Forbidden(_) => "PERMISSION_DENIED",
            Self::Unauthenticated { .. } => "UNAUTHENTICATED",
            Self::TooMany { .. } => "RESOURCE_EXHAUSTED",
            Self::Timeout(_) => "DEADLINE_EXCEEDED",
            Self::Internal(_) | Self::IdentityRefused { .. } => "INTERNAL",
            Self::Upstream { status, .. } => codes::code_name(status.code()),
        }
    }

    /// Whether the same request may succeed later.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Overloaded | Self::TooMany { .. } | Self::Timeout(_) => true,
            Self::Upstream { status, .. } => codes::retryable(status.code()),
            _ => false,
        }
    }

    /// Seconds for `Retry-After`, on load-shedding answers and on a backend that is down (the
    /// routes that need it answer 503 while the others go on).
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::Overloaded => Some(1),
            Self::TooMany {
                retry_after_secs, ..
            } => Some(*retry_after_secs),
            Self::Upstream { status, .. }
                if matches!(status.code(), Code::ResourceExhausted | Code::Unavailable) =>
            {
                Some(
                    status
                        .metadata()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .unwrap_or(DEFAULT_RETRY_AFTER_SECS),
                )
            }
            _ => None,
        }
    }

    /// The message the caller sees. Upstream messages of caller-side codes are written for the
    /// caller and pass through; server-side failures get a generic message.
    pub fn public_message(&self) -> String {
        match self {
            Self::Upstream { service, status } => match status.code() {
                Code::InvalidArgument
                | Code::NotFound
                | Code::AlreadyExists
                | Code::PermissionDenied
                | Code::Unauthenticated
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::Aborted => status.message().to_owned(),
                Code::ResourceExhausted => {
                    format!("the {service} service is busy; try again later")
                }
                // Names what is down, so a person knows which part of the API waits on it: the
                // backend, or the store the backend cannot reach (it refuses at once while the
                // store does not answer).
                Code::Unavailable | Code::Cancelled => match store_down(status) {
                    Some(store) => format!(
                        "{service} cannot reach its {store} store, try again in {} s",
                        self.retry_after().unwrap_or(DEFAULT_RETRY_AFTER_SECS)
                    ),
                    None => format!(
                        "{service} is unavailable, try again in {} s",
                        self.retry_after().unwrap_or(DEFAULT_RETRY_AFTER_SECS)
                    ),
                },
                Code::DeadlineExceeded => format!("the {service} service did not answer in time"),
                Code::Unimplemented => format!("the {service} service does not support this"),
                Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => {
                    "internal error".to_owned()
                }
            },
            Self::IdentityRefused { service, .. } => format!(
                "the {service} service refused the identity the gateway sent for you: a server \
                 misconfiguration, not a problem with your token; try again later, and tell \
                 the operator if it lasts"
            ),
            other => other.to_string(),
        }
    }

    /// The error in the shape of `ErrorInfo`, for SSE `error` events.
    pub(crate) fn to_json(&self) -> ErrorJson {
        ErrorJson {
            code: self.code().to_owned(),
            http_status: self.http_status().as_u16(),
            message: self.public_message(),
            retryable: self.retryable(),
        }
    }

    /// Why, for a client to branch on: the `ErrorInfo` reason a backend sent with its status
    /// (`BACKLOG_FULL`, …), else the code.
    pub(crate) fn error_reason(&self) -> String {
        use tonic_types::StatusExt;
        if let Self::InvalidField { .. } = self {
            return ecoscan_common::reasons::INVALID_FIELD.to_owned();
        }
        if let Self::Upstream { status, .. } = self
            && let Some(info) = status.get_details_error_info()
            && !info.reason.is_empty()
        {
            return info.reason;
        }
        self.code().to_owned()
    }

    /// The invalid fields: the gateway's own, or those a backend named in its `BadRequest`.
    fn field_errors(&self) -> Vec<FieldError> {
        use tonic_types::StatusExt;
        if let Self::InvalidField { fields, message } = self {
            return fields
                .iter()
                .map(|field| FieldError {
                    field: (*field).to_owned(),
                    detail: message.clone(),
                })
                .collect();
        }
        let Self::Upstream { status, .. } = self else {
            return Vec::new();
        };
        status
            .get_details_bad_request()
            .map(|bad| {
                bad.field_violations
                    .into_iter()
                    .map(|v| FieldError {
                        field: http_field_name(&v.field).unwrap_or(&v.field).to_owned(),
                        detail: v.description,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The reason in full, for traces and logs: the cause an internal failure hides.
    fn reason(&self) -> String {
        match self {
            Self::Internal(cause) => format!("internal error: {cause}"),
            other => other.to_string(),
        }
    }

    /// Logs what the caller will not see: server-side failures with their cause.
    pub(crate) fn log(&self) {
        let status = self.http_status();
        // Refused credentials and deadlines that ran out are seen at `info`/`warn`, but at most
        // one line per kind per interval: a caller could otherwise multiply them at will.
        let limited = match self.code() {
            "UNAUTHENTICATED" => Some(("http UNAUTHENTICATED", false)),
            "DEADLINE_EXCEEDED" => Some(("http DEADLINE_EXCEEDED", true)),
            _ => None,
        };
        if let Some((kind, warn)) = limited {
            let Some(suppressed) = ecoscan_common::log_limit::admit(kind) else {
                return;
            };
            let every_s = ecoscan_common::log_limit::INTERVAL.as_secs();
            if warn {
                tracing::warn!(error = %self, http.status = status.as_u16(), suppressed,
                    "request ended at a deadline (at most one such line per {every_s} s; `suppressed` counts the others)");
            } else {
                tracing::info!(error = %self, http.status = status.as_u16(), suppressed,
                    "request refused: no valid credentials (at most one such line per {every_s} s; `suppressed` counts the others)");
            }
            return;
        }
        if let Self::IdentityRefused { service, message } = self {
            tracing::error!(
                upstream = service,
                error = %message,
                http.status = status.as_u16(),
                "a service refused the gateway's identity assertion: the gateway and the service \
                 must share ECOSCAN_IDENTITY_KEY (and agree on the time)"
            );
        } else if status.is_server_error() {
            tracing::warn!(error = %self, http.status = status.as_u16(), "request failed");
        } else {
            tracing::debug!(error = %self, http.status = status.as_u16(), "request rejected");
        }
    }
}

/// The HTTP API's name for a field of a gRPC request the gateway makes, where the two differ:
/// a caller fixes what it sent, not the message the gateway built from it. The rest (`image`,
/// `hint`, `locale`, `job_id`, …) are named alike.
fn http_field_name(grpc: &str) -> Option<&'static str> {
    Some(match grpc {
        // Submit's key is the `Idempotency-Key` header; Watch's resume position is the
        // `Last-Event-ID` header (or the `last_event_id` query, which it stands in for).
        "idempotency_key" => "Idempotency-Key",
        "after_event_id" => "Last-Event-ID",
        // The declared type of an image is the multipart part's own `Content-Type`.
        "content_type" => "image",
        _ => return None,
    })
}

/// On a response: the backend that refused the identity the gateway signed for the request
/// (counted by [`crate::metrics::track`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct IdentityRefusedBy(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.log();
        let status = self.http_status();
        let reason = self.error_reason();
        let trace_id = ecoscan_common::telemetry::current_trace_id();
        let detail = self.public_message();
        let body = ErrorBody {
            kind: format!("urn:ecoscan:problem:{reason}"),
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            instance: (!trace_id.is_empty()).then(|| format!("urn:ecoscan:trace:{trace_id}")),
            code: self.code(),
            reason,
            message: detail.clone(),
            detail,
            retryable: self.retryable(),
            errors: self.field_errors(),
        };
        let mut res = (
            status,
            [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))],
            serde_json::to_vec(&body).expect("an error body serializes"),
        )
            .into_response();
        // For the request span (`on_response`): the reason, which the body may not say.
        res.extensions_mut().insert(FailureReason(self.reason()));
        if let Some(secs) = self.retry_after() {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Self::IdentityRefused { service, .. } = &self {
            // For the request metrics (`gateway_identity_refused`): the alert's signal.
            res.extensions_mut().insert(IdentityRefusedBy(service));
        }
        if let Self::Unauthenticated { invalid_token, .. } = &self {
            // RFC 6750: say how to authenticate, and why a token was refused.
            let value = if *invalid_token {
                r#"Bearer realm="ecoscan", error="invalid_token""#
            } else {
                r#"Bearer realm="ecoscan""#
            };
            res.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(value));
        }
        res
    }
}

/// The store a backend said it cannot reach (`STORE_UNAVAILABLE`, see
/// `ecoscan_common::reasons`): one of the names a store goes by, never free text from the wire.
pub(crate) fn store_down(status: &tonic::Status) -> Option<&'static str> {
    use tonic_types::StatusExt as _;
    let details = status.get_error_details();
    let info = details.error_info()?;
    if info.reason != ecoscan_common::reasons::Reason::StoreUnavailable.as_str() {
        return None;
    }
    Some(match info.metadata.get("store").map(String::as_str) {
        Some("redis") => "redis",
        Some("postgres") => "postgres",
        _ => "data",
    })
}

#[cfg(test)]
mod tests;
