//! The one table from gRPC status codes to HTTP statuses (the mapping grpc-gateway uses), and
//! which codes are worth retrying.

use tonic::{Code, Status};

/// Metadata key a service sets (to `"true"`) on a failed call's status when it already retried
/// the failure itself, e.g. a stage whose model client spent its retries on a provider 429:
/// the code stays what it is (`UNAVAILABLE`: trying later may work), but a caller retrying at
/// once would only multiply the attempts. See [`mark_retried`] and [`worth_retrying`].
pub const RETRIED_METADATA: &str = "ecoscan-retried";

/// HTTP status a REST caller sees for a gRPC code (grpc-gateway's `HTTPStatusFromCode`).
pub fn http_status(code: Code) -> u16 {
    match code {
        Code::Ok => 200,
        Code::Cancelled => 499,
        Code::Unknown => 500,
        Code::InvalidArgument => 400,
        Code::DeadlineExceeded => 504,
        Code::NotFound => 404,
        Code::AlreadyExists => 409,
        Code::PermissionDenied => 403,
        Code::Unauthenticated => 401,
        Code::ResourceExhausted => 429,
        Code::FailedPrecondition => 400,
        Code::Aborted => 409,
        Code::OutOfRange => 400,
        Code::Unimplemented => 501,
        Code::Internal => 500,
        Code::Unavailable => 503,
        Code::DataLoss => 500,
    }
}

/// The canonical upper-case name of a code, e.g. `INVALID_ARGUMENT`.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::Unauthenticated => "UNAUTHENTICATED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
    }
}

/// Whether a call that failed with `code` may succeed when tried again unchanged.
pub fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted | Code::Aborted
    )
}

/// Marks `status` as already retried by the service that returns it (see [`RETRIED_METADATA`]).
pub fn mark_retried(mut status: Status) -> Status {
    status.metadata_mut().insert(
        RETRIED_METADATA,
        tonic::metadata::MetadataValue::from_static("true"),
    );
    status
}

/// Whether the service that returned `status` already retried the failure (see
/// [`mark_retried`]).
pub fn already_retried(status: &Status) -> bool {
    status
        .metadata()
        .get(RETRIED_METADATA)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// Whether a caller should try a failed call again at once: its code is transient
/// ([`retryable`]) and the service that answered did not already retry it ([`already_retried`]).
/// What a user is told stays [`retryable`]: a later try may well work.
pub fn worth_retrying(status: &Status) -> bool {
    retryable(status.code()) && !already_retried(status)
}

/// What tonic says when it ends a call at its deadline (`tonic::TimeoutExpired`), as `CANCELLED`.
const TIMEOUT_EXPIRED: &str = "Timeout expired";

/// A call whose connection broke before the server sent a status (its process died, the
/// connection was cut) comes back from tonic as `UNKNOWN` "h2 protocol error: …" or "transport
/// error", or as `CANCELLED` when the stream was reset under it; gRPC calls that `UNAVAILABLE`,
/// a transient failure to retry (elsewhere), not a verdict on the request. A caller that did not
/// cancel its own call applies this to what comes back.
pub fn connection_lost_is_unavailable(status: Status) -> Status {
    let lost = ["h2 protocol error", "transport error"]
        .iter()
        .any(|m| status.message().starts_with(m));
    match status.code() {
        Code::Unknown if lost => Status::unavailable(status.message()),
        // tonic's own bound on a call (`grpc-timeout`, the endpoint's timeout) comes back as
        // `CANCELLED` "Timeout expired": the deadline ran out, which gRPC calls so.
        Code::Cancelled if status.message() == TIMEOUT_EXPIRED => {
            Status::deadline_exceeded("the call's deadline ran out before the service answered")
        }
        Code::Cancelled => Status::unavailable(format!("call cancelled: {}", status.message())),
        _ => status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_connection_is_unavailable_and_a_verdict_is_kept() {
        for lost in [
            Status::unknown("h2 protocol error: error reading a body from connection"),
            Status::unknown("transport error"),
            Status::cancelled("operation was canceled"),
        ] {
            let mapped = connection_lost_is_unavailable(lost);
            assert_eq!(mapped.code(), Code::Unavailable, "{mapped:?}");
            assert!(worth_retrying(&mapped));
        }
        let timed_out =
            connection_lost_is_unavailable(Status::from_error(tonic::TimeoutExpired(()).into()));
        assert_eq!(timed_out.code(), Code::DeadlineExceeded, "{timed_out:?}");
        let verdict = connection_lost_is_unavailable(Status::unknown("model said no"));
        assert_eq!(verdict.code(), Code::Unknown);
        let invalid = connection_lost_is_unavailable(Status::invalid_argument("bad"));
        assert_eq!(invalid.code(), Code::InvalidArgument);
    }

    #[test]
    fn a_status_marked_as_retried_is_not_worth_retrying_but_stays_retryable() {
        let plain = Status::unavailable("connection reset");
        assert!(worth_retrying(&plain));
        let marked = mark_retried(Status::unavailable("model provider rate limit reached"));
        assert!(already_retried(&marked));
        assert!(!worth_retrying(&marked));
        assert!(retryable(marked.code()), "a later try may still work");
        assert!(!worth_retrying(&Status::invalid_argument("bad image")));
    }

    #[test]
    fn the_retried_mark_survives_the_wire_format() {
        let marked = mark_retried(Status::unavailable("x"));
        let mut headers = http::HeaderMap::new();
        marked.add_header(&mut headers).unwrap();
        let parsed = Status::from_header_map(&headers).unwrap();
        assert!(already_retried(&parsed));
        assert_eq!(parsed.code(), Code::Unavailable);
    }

    #[test]
    fn client_errors_map_to_4xx_and_server_errors_to_5xx() {
        assert_eq!(http_status(Code::InvalidArgument), 400);
        assert_eq!(http_status(Code::NotFound), 404);
        assert_eq!(http_status(Code::ResourceExhausted), 429);
        assert_eq!(http_status(Code::Unavailable), 503);
        assert_eq!(http_status(Code::Internal), 500);
        assert_eq!(http_status(Code::Cancelled), 499);
    }

    #[test]
    fn only_transient_codes_are_retryable() {
        assert!(retryable(Code::Unavailable));
        assert!(!retryable(Code::InvalidArgument));
        assert!(!retryable(Code::NotFound));
        assert_eq!(code_name(Code::FailedPrecondition), "FAILED_PRECONDITION");
    }
}
