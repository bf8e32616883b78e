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
}

impl Reason {
    /// Every reason, for the docs and their test.
    pub const ALL: [Reason; 7] = [
        Reason::IdentityMissing,
        Reason::IdentityInvalid,
        Reason::IdentityRefused,
        Reason::MessageTooLarge,
        Reason::BacklogFull,
        Reason::FetchBusy,
        Reason::StoreUnavailable,
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
