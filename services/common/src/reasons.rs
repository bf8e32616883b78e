//! The stable reasons of ecoscan's gRPC errors, in one place, and the `google.rpc` details that
//! carry them (AIP-193): every error built here has one `ErrorInfo` (`reason`, [`DOMAIN`], its
//! values in `metadata`) in `grpc-status-details-bin`, and a retryable one a `RetryInfo` too.
//! docs/api.md lists the reasons; a client reads them with any gRPC library's status details
//! (Rust: `tonic_types::StatusExt::get_error_details`).

use std::{collections::HashMap, time::Duration};

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The `domain` of every `ErrorInfo` ecoscan sends.
pub const DOMAIN: &str = "ecoscan";

/// Why a call failed, as a client can branch on it: UPPER_SNAKE, never renamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// UNAUTHENTICATED: the call carries no identity assertion.
    IdentityMissing,
    /// UNAUTHENTICATED: the identity names an unusable user id.
    IdentityInvalid,
    /// UNAUTHENTICATED: the assertion is bad, expired, too long-lived or for another service.
    IdentityRefused,
    /// OUT_OF_RANGE: the request is larger than the server accepts.
    MessageTooLarge,
    /// RESOURCE_EXHAUSTED: too many scans wait; retry after the `RetryInfo` delay.
    BacklogFull,
    /// RESOURCE_EXHAUSTED: every image-fetch slot is taken; retry after the delay.
    FetchBusy,
    /// UNAVAILABLE: a store the call needs (`store` in the metadata: `redis`, `postgres`) has
    /// stopped answering; refused at once, retry after the delay.
    StoreUnavailable,
    /// FAILED_PRECONDITION: the direct upload named by a submit expired (`upload_id` in the
    /// metadata): create a new one.
    UploadExpired,
    /// FAILED_PRECONDITION: the direct upload was submitted already (an upload is submitted
    /// once).
    UploadSubmitted,
    /// FAILED_PRECONDITION: nothing was uploaded yet under the direct upload: PUT the photo to
    /// its URL first.
    UploadEmpty,
}

impl Reason {
    /// Every reason, for the docs and their test.
    pub const ALL: [Reason; 10] = [
        Reason::IdentityMissing,
        Reason::IdentityInvalid,
        Reason::IdentityRefused,
        Reason::MessageTooLarge,
        Reason::BacklogFull,
        Reason::FetchBusy,
        Reason::StoreUnavailable,
        Reason::UploadExpired,
        Reason::UploadSubmitted,
        Reason::UploadEmpty,
    ];

    /// The reason as sent: UPPER_SNAKE.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::IdentityMissing => "IDENTITY_MISSING",
            Reason::IdentityInvalid => "IDENTITY_INVALID",
            Reason::IdentityRefused => "IDENTITY_REFUSED",
            Reason::MessageTooLarge => "MESSAGE_TOO_LARGE",
            Reason::BacklogFull => "BACKLOG_FULL",
            Reason::FetchBusy => "FETCH_BUSY",
            Reason::StoreUnavailable => "STORE_UNAVAILABLE",
            Reason::UploadExpired => "UPLOAD_EXPIRED",
            Reason::UploadSubmitted => "UPLOAD_SUBMITTED",
            Reason::UploadEmpty => "UPLOAD_EMPTY",
        }
    }
}

/// A status of `code` saying `message`, with an `ErrorInfo` of `reason` and `metadata`, and a
/// `RetryInfo` of `retry` when given.
pub fn status(
    code: Code,
    message: impl Into<String>,
    reason: Reason,
    metadata: &[(&str, String)],
    retry: Option<Duration>,
) -> Status {
    let metadata: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect();
    let mut details = ErrorDetails::new();
    details.set_error_info(reason.as_str(), DOMAIN, metadata);
    if let Some(delay) = retry {
        details.set_retry_info(Some(delay));
    }
    Status::with_error_details(code, message, details)
}

/// A status of `INVALID_ARGUMENT` saying `message`, with an `ErrorInfo` of reason
/// `INVALID_FIELD` (`metadata.field`) and a `BadRequest` naming `field` (the request message's
/// field, as the proto names it) and what is wrong with it.
pub fn invalid_field(field: &str, message: impl Into<String>) -> Status {
    let message = message.into();
    let mut details = ErrorDetails::new();
    details.set_error_info(
        INVALID_FIELD,
        DOMAIN,
        HashMap::from([("field".to_owned(), field.to_owned())]),
    );
    details.add_bad_request_violation(field, message.clone());
    Status::with_error_details(Code::InvalidArgument, message, details)
}

/// The `ErrorInfo` reason of [`invalid_field`]: a field of the request is invalid, the
/// `BadRequest` says which and why.
pub const INVALID_FIELD: &str = "INVALID_FIELD";

/// How long a caller should wait before trying an `UNAVAILABLE` call again when nothing more
/// precise is known.
const DEFAULT_RETRY: Duration = Duration::from_secs(1);

/// `status` with the details every ecoscan error carries (AIP-193), whatever built it: an
/// `ErrorInfo` (one it has, else the code's name as the reason), a `RequestInfo` whose
/// `request_id` is `trace_id` (the trace to look the call up in) when there is one, on
/// `UNAVAILABLE` a `RetryInfo` (from the `retry-after` metadata, else 1 s) when it has none, and
/// for a caller that asked for a language (`accept-language` metadata: Korean or English) a
/// `LocalizedMessage` in it: the message itself in English, in Korean a sentence per reason (or
/// per code) that says what happened and what to do. `OK` comes back as it is.
pub fn with_details_for(status: Status, trace_id: &str, accept_language: Option<&str>) -> Status {
    if status.code() == Code::Ok {
        return status;
    }
    let mut details = status.get_error_details();
    let mut changed = false;
    if details.error_info().is_none() {
        details.set_error_info(
            crate::codes::code_name(status.code()),
            DOMAIN,
            HashMap::new(),
        );
        changed = true;
    }
    if details.request_info().is_none() && !trace_id.is_empty() {
        details.set_request_info(trace_id, "");
        changed = true;
    }
    if details.retry_info().is_none() && status.code() == Code::Unavailable {
        let delay = status
            .metadata()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(DEFAULT_RETRY, Duration::from_secs);
        details.set_retry_info(Some(delay));
        changed = true;
    }
    if details.localized_message().is_none()
        && let Some(locale) = accept_language.and_then(locale_of)
    {
        let reason = details
            .error_info()
            .map(|i| i.reason.clone())
            .unwrap_or_default();
        let message = match locale {
            "ko-KR" => korean(&reason, status.code(), &details),
            _ => status.message().to_owned(),
        };
        details.set_localized_message(locale, message);
        changed = true;
    }
    if !changed {
        return status;
    }
    let mut enriched = Status::with_error_details(status.code(), status.message(), details);
    *enriched.metadata_mut() = status.metadata().clone();
    enriched
}

/// The locale of a `LocalizedMessage` for an `accept-language` value: its first language if
/// it is Korean or English.
fn locale_of(accept_language: &str) -> Option<&'static str> {
    let first = accept_language
        .split(',')
        .next()?
        .split(';')
        .next()?
        .trim()
        .to_ascii_lowercase();
    match first.split('-').next()? {
        "ko" => Some("ko-KR"),
        "en" => Some("en-US"),
        _ => None,
    }
}

/// What went wrong, in Korean, for `reason` (else the code).
fn korean(reason: &str, code: Code, details: &ErrorDetails) -> String {
    let field = details
        .error_info()
        .and_then(|i| i.metadata.get("field").cloned())
        .unwrap_or_default();
    match reason {
        "IDENTITY_MISSING" => "이 호출에는 사용자 신원이 필요합니다. 서명된 `x-ecoscan-identity` \
                               값을 함께 보내세요(`ecoscan token --grpc <서비스> --user <id>`로 \
                               발급합니다)."
            .to_owned(),
        "IDENTITY_INVALID" => {
            "신원에 담긴 사용자 ID를 쓸 수 없습니다. 올바른 사용자 ID로 다시 발급받으세요."
                .to_owned()
        }
        "IDENTITY_REFUSED" => "신원 값(`x-ecoscan-identity`)이 거부되었습니다. 호출하는 \
                               서비스용으로 새로 발급받아 다시 보내세요."
            .to_owned(),
        "MESSAGE_TOO_LARGE" => {
            "요청이 허용된 크기보다 큽니다. 더 작은 이미지(최대 10 MiB)를 보내세요.".to_owned()
        }
        "BACKLOG_FULL" => {
            "처리를 기다리는 스캔이 너무 많습니다. 잠시 후 다시 시도하세요.".to_owned()
        }
        "FETCH_BUSY" => {
            "이미지를 가져오는 작업이 모두 사용 중입니다. 잠시 후 다시 시도하세요.".to_owned()
        }
        "STORE_UNAVAILABLE" => {
            "서비스의 저장소가 응답하지 않습니다. 잠시 후 다시 시도하세요.".to_owned()
        }
        "UPLOAD_EXPIRED" => {
            "업로드 기한이 지났습니다. 업로드를 새로 만들어 사진을 다시 올리세요.".to_owned()
        }
        "UPLOAD_SUBMITTED" => {
            "이 업로드는 이미 스캔으로 제출되었습니다. 새 사진은 새 업로드로 올리세요.".to_owned()
        }
        "UPLOAD_EMPTY" => {
            "업로드에 아직 사진이 없습니다. 업로드 URL로 사진을 먼저 올리세요.".to_owned()
        }
        INVALID_FIELD => {
            format!("요청의 `{field}` 값이 올바르지 않습니다. 값을 고쳐 다시 보내세요.")
        }
        _ => match code {
            Code::InvalidArgument => "요청이 올바르지 않습니다. 값을 고쳐 다시 보내세요.",
            Code::NotFound => "요청한 대상을 찾을 수 없습니다.",
            Code::AlreadyExists => "이미 있는 대상입니다.",
            Code::PermissionDenied => "이 작업을 할 권한이 없습니다.",
            Code::Unauthenticated => "인증되지 않은 호출입니다. 신원을 함께 보내세요.",
            Code::FailedPrecondition => "지금 상태에서는 할 수 없는 요청입니다.",
            Code::OutOfRange => "허용 범위를 벗어난 요청입니다.",
            Code::ResourceExhausted => "요청이 너무 많습니다. 잠시 후 다시 시도하세요.",
            Code::Unavailable => "서비스를 잠시 쓸 수 없습니다. 잠시 후 다시 시도하세요.",
            Code::DeadlineExceeded => "정해진 시간 안에 끝나지 않았습니다. 다시 시도하세요.",
            Code::Cancelled => "호출이 취소되었습니다.",
            Code::Aborted => "다른 작업과 충돌했습니다. 다시 시도하세요.",
            Code::Unimplemented => "이 서비스가 지원하지 않는 호출입니다.",
            Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => {
                "서버 내부 오류입니다. 계속되면 운영자에게 알려 주세요."
            }
        }
        .to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_upper_snake_and_unique() {
        let names: std::collections::HashSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        for name in names {
            assert!(
                name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
                "{name}"
            );
        }
    }

    #[test]
    fn the_docs_list_every_reason() {
        let api = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/api.md"),
        )
        .unwrap();
        for reason in Reason::ALL {
            assert!(
                api.contains(&format!("| `{}` |", reason.as_str())),
                "docs/api.md does not list {}",
                reason.as_str()
            );
        }
    }

    #[test]
    fn every_error_gets_an_error_info_a_request_info_and_a_retry_when_unavailable() {
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let plain = with_details_for(Status::not_found("no job abc"), trace, None);
        let details = plain.get_error_details();
        assert_eq!(plain.code(), Code::NotFound);
        assert_eq!(plain.message(), "no job abc");
        let info = details.error_info().expect("an ErrorInfo");
        assert_eq!(
            (info.reason.as_str(), info.domain.as_str()),
            ("NOT_FOUND", DOMAIN)
        );
        assert_eq!(details.request_info().unwrap().request_id, trace);
        assert!(details.retry_info().is_none(), "NOT_FOUND is not retried");

        // A specific reason stays; the trace and a retry are added.
        let mut down = status(
            Code::Unavailable,
            "redis is not answering",
            Reason::BacklogFull,
            &[],
            None,
        );
        down.metadata_mut()
            .insert("retry-after", tonic::metadata::MetadataValue::from(3u64));
        let down = with_details_for(down, trace, None);
        let details = down.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "BACKLOG_FULL");
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            down.metadata().get("retry-after").unwrap(),
            "3",
            "metadata kept"
        );

        // Outside a trace: no RequestInfo; OK untouched.
        let untraced = with_details_for(Status::internal("x"), "", None);
        assert!(untraced.get_error_details().request_info().is_none());
        assert!(
            with_details_for(Status::ok(""), trace, None)
                .get_error_details()
                .error_info()
                .is_none()
        );
    }

    #[test]
    fn a_caller_that_asks_for_korean_or_english_gets_a_localized_message() {
        let refused = || {
            status(
                Code::ResourceExhausted,
                "too many scans waiting (3); try again in 5 s",
                Reason::BacklogFull,
                &[],
                None,
            )
        };
        let ko =
            with_details_for(refused(), "", Some("ko-KR,ko;q=0.9,en;q=0.8")).get_error_details();
        let ko = ko.localized_message().expect("a Korean message");
        assert_eq!(ko.locale, "ko-KR");
        assert!(ko.message.contains("잠시 후 다시 시도"), "{}", ko.message);
        let en = with_details_for(refused(), "", Some("en")).get_error_details();
        assert_eq!(
            en.localized_message()
                .map(|m| (m.locale.as_str(), m.message.as_str())),
            Some(("en-US", "too many scans waiting (3); try again in 5 s"))
        );
        // A field names itself; another language, or none asked: no LocalizedMessage.
        let field = with_details_for(invalid_field("locale", "locale \"fr\""), "", Some("ko"))
            .get_error_details();
        assert!(
            field
                .localized_message()
                .unwrap()
                .message
                .contains("`locale`")
        );
        for asked in [Some("fr-FR"), None] {
            assert!(
                with_details_for(refused(), "", asked)
                    .get_error_details()
                    .localized_message()
                    .is_none()
            );
        }
    }

    #[test]
    fn an_invalid_field_names_the_field_in_a_bad_request() {
        let s = invalid_field("job_id", "job id \"x\" is not a UUID");
        assert_eq!(s.code(), Code::InvalidArgument);
        let details = s.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, INVALID_FIELD);
        assert_eq!(details.error_info().unwrap().metadata["field"], "job_id");
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].field, "job_id");
        assert_eq!(violations[0].description, s.message());
    }

    #[test]
    fn details_survive_the_wire_format() {
        let s = status(
            Code::ResourceExhausted,
            "busy",
            Reason::BacklogFull,
            &[("backlog", "12".into())],
            Some(Duration::from_secs(7)),
        );
        let mut headers = http::HeaderMap::new();
        s.add_header(&mut headers).unwrap();
        let parsed = Status::from_header_map(&headers).unwrap();
        let details = parsed.get_error_details();
        let info = details.error_info().unwrap();
        assert_eq!(info.reason, "BACKLOG_FULL");
        assert_eq!(info.domain, DOMAIN);
        assert_eq!(info.metadata["backlog"], "12");
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(7))
        );
    }
}
