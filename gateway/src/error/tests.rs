use super::*;

const ALL_CODES: [Code; 17] = [
    Code::Ok,
    Code::Cancelled,
    Code::Unknown,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::OutOfRange,
    Code::Unimplemented,
    Code::Internal,
    Code::Unavailable,
    Code::DataLoss,
    Code::Unauthenticated,
];

fn upstream(code: Code, msg: &str) -> ApiError {
    ApiError::upstream("ingest", tonic::Status::new(code, msg))
}

#[test]
fn upstream_codes_follow_the_shared_table_except_resource_exhausted_and_cancelled() {
    for code in ALL_CODES {
        let err = upstream(code, "x");
        let (expected, name) = match code {
            Code::ResourceExhausted => (503, "RESOURCE_EXHAUSTED"),
            // A backend's connection broke under the call: retry, elsewhere.
            Code::Cancelled => (503, "UNAVAILABLE"),
            // A backend refusing the gateway's own identity: the operator's fault, not a 401.
            Code::Unauthenticated => (500, "INTERNAL"),
            _ => (codes::http_status(code), codes::code_name(code)),
        };
        assert_eq!(err.http_status().as_u16(), expected, "{code:?}");
        assert_eq!(err.code(), name, "{code:?}");
    }
    let cut = upstream(Code::Unknown, "transport error");
    assert_eq!(cut.http_status().as_u16(), 503);
    assert!(cut.retryable());
}

#[test]
fn edge_errors_have_their_own_statuses() {
    let cases = [
        (
            ApiError::InvalidArgument("a".into()),
            400,
            "INVALID_ARGUMENT",
        ),
        (
            ApiError::PayloadTooLarge("a".into()),
            413,
            "PAYLOAD_TOO_LARGE",
        ),
        (
            ApiError::UnsupportedMediaType("a".into()),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        (ApiError::NotFound("a".into()), 404, "NOT_FOUND"),
        (ApiError::Overloaded, 503, "UNAVAILABLE"),
        (ApiError::Internal("db exploded".into()), 500, "INTERNAL"),
    ];
    for (err, status, code) in cases {
        assert_eq!(err.http_status().as_u16(), status);
        assert_eq!(err.code(), code);
    }
}

#[test]
fn resource_exhausted_uses_the_upstream_retry_after_or_a_default() {
    let mut status = tonic::Status::resource_exhausted("backlog full");
    status
        .metadata_mut()
        .insert("retry-after", "7".parse().unwrap());
    assert_eq!(ApiError::upstream("ingest", status).retry_after(), Some(7));
    assert_eq!(
        upstream(Code::ResourceExhausted, "backlog full").retry_after(),
        Some(DEFAULT_RETRY_AFTER_SECS)
    );
    assert_eq!(upstream(Code::NotFound, "x").retry_after(), None);
}

#[test]
fn a_backend_that_is_down_is_503_with_retry_after_naming_it() {
    let err = upstream(Code::Unavailable, "tcp connect error: connection refused");
    assert_eq!(err.http_status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(err.retry_after(), Some(DEFAULT_RETRY_AFTER_SECS));
    assert_eq!(
        err.public_message(),
        "ingest is unavailable, try again in 5 s"
    );
    // A connection cut mid-call is the same outage.
    let cut = ApiError::upstream("analytics", tonic::Status::cancelled("h2 reset"));
    assert_eq!(cut.retry_after(), Some(DEFAULT_RETRY_AFTER_SECS));
    assert_eq!(
        cut.public_message(),
        "analytics is unavailable, try again in 5 s"
    );
}

#[test]
fn a_backend_whose_store_is_down_says_which_store_with_its_retry_after() {
    let mut status = ecoscan_common::reasons::status(
        Code::Unavailable,
        "redis is not answering (timed out); try again in 1 s",
        ecoscan_common::reasons::Reason::StoreUnavailable,
        &[("store", "redis".into()), ("fault", "timed_out".into())],
        Some(std::time::Duration::from_secs(1)),
    );
    status
        .metadata_mut()
        .insert("retry-after", "1".parse().unwrap());
    let err = ApiError::upstream("ingest", status);
    assert_eq!(err.http_status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(err.retry_after(), Some(1));
    assert_eq!(
        err.public_message(),
        "ingest cannot reach its redis store, try again in 1 s"
    );
}

#[test]
fn internal_details_never_reach_the_caller() {
    for code in [
        Code::Internal,
        Code::Unknown,
        Code::DataLoss,
        Code::Unavailable,
    ] {
        let msg = upstream(code, "sqlx: connection refused at 10.0.0.3").public_message();
        assert!(!msg.contains("sqlx"), "{code:?} leaked: {msg}");
    }
    assert_eq!(
        ApiError::Internal("secret".into()).public_message(),
        "internal error"
    );
    assert_eq!(
        upstream(Code::InvalidArgument, "image is empty").public_message(),
        "image is empty"
    );
}

#[test]
fn error_json_carries_code_status_and_retryable() {
    let json = upstream(Code::Unavailable, "down").to_json();
    assert_eq!(json.code, "UNAVAILABLE");
    assert_eq!(json.http_status, 503);
    assert!(json.retryable);
    assert!(!upstream(Code::NotFound, "gone").to_json().retryable);
}

#[test]
fn a_backend_refusing_the_gateway_s_identity_is_a_500_never_a_401() {
    let e = upstream(
        Code::Unauthenticated,
        "the identity assertion (x-ecoscan-identity) is refused: its signature does not match",
    );
    assert!(matches!(e, ApiError::IdentityRefused { .. }), "{e:?}");
    assert_eq!(e.http_status().as_u16(), 500);
    assert_eq!(e.code(), "INTERNAL");
    assert!(!e.retryable());
    let words = e.public_message();
    assert!(words.contains("not a problem with your token"), "{words}");
    assert!(
        !words.contains("signature"),
        "the backend's words stay in the log: {words}"
    );
    let res = e.into_response();
    assert_eq!(res.status().as_u16(), 500);
    assert!(res.headers().get(header::WWW_AUTHENTICATE).is_none());
}

#[test]
fn a_field_the_gateway_refuses_is_named_with_reason_invalid_field() {
    let err = ApiError::invalid_fields(&["due_at", "delay_seconds"], "send exactly one");
    assert_eq!(err.http_status().as_u16(), 400);
    assert_eq!(err.code(), "INVALID_ARGUMENT");
    assert_eq!(err.error_reason(), "INVALID_FIELD");
    assert_eq!(err.public_message(), "send exactly one");
    let named: Vec<_> = err
        .field_errors()
        .into_iter()
        .map(|e| (e.field, e.detail))
        .collect();
    assert_eq!(
        named,
        [
            ("due_at".to_owned(), "send exactly one".to_owned()),
            ("delay_seconds".to_owned(), "send exactly one".to_owned())
        ]
    );
    // A request that is wrong as a whole names no field, and its reason is the code.
    let whole = ApiError::InvalidArgument("invalid JSON body".into());
    assert!(whole.field_errors().is_empty());
    assert_eq!(whole.error_reason(), "INVALID_ARGUMENT");
}

#[test]
fn a_backend_s_field_is_named_as_the_http_request_names_it() {
    for (grpc, http) in [
        ("after_event_id", "Last-Event-ID"),
        ("idempotency_key", "Idempotency-Key"),
        ("content_type", "image"),
        ("hint", "hint"),
    ] {
        let err = ApiError::upstream(
            "ingest",
            ecoscan_common::reasons::invalid_field(grpc, "wrong"),
        );
        assert_eq!(err.error_reason(), "INVALID_FIELD");
        let fields: Vec<_> = err.field_errors().into_iter().map(|e| e.field).collect();
        assert_eq!(fields, [http], "{grpc}");
    }
}
