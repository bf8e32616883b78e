//! Everything `Classify` can fail with, and its one mapping to a gRPC status.

use ecoscan_common::codes;
use ecoscan_llm::LlmError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("image is empty; send the photo bytes in `image`")]
    EmptyImage,
    #[error(
        "content type {0:?} is not supported; send the photo as image/jpeg, image/png, image/webp or image/gif"
    )]
    UnsupportedContentType(String),
    #[error("image bytes are not a JPEG, PNG, WebP or GIF picture; send the photo file itself")]
    NotAnImage,
    #[error("rule service at {url} is unreachable ({reason}); start ecoscan-rule or set RULE_URL")]
    RuleUnavailable { url: String, reason: String },
    #[error("rule service at {0} returned an empty taxonomy; load its rule dataset")]
    EmptyTaxonomy(String),
    #[error("model answered outside the taxonomy: {0}")]
    OutsideTaxonomy(String),
    #[error(transparent)]
    Llm(#[from] LlmError),
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::EmptyImage | Error::UnsupportedContentType(_) | Error::NotAnImage => {
                Status::invalid_argument(e.to_string())
            }
            Error::RuleUnavailable { .. } => Status::unavailable(e.to_string()),
            Error::EmptyTaxonomy(_) => Status::failed_precondition(e.to_string()),
            Error::OutsideTaxonomy(_) => {
                tracing::error!(error = %e, "model output rejected");
                Status::internal(e.to_string())
            }
            // Transient provider trouble (429, 5xx, timeouts, connection failures): worth a
            // retry by the caller, unless the model client already spent its retries on it.
            // The message is one plain sentence per kind of failure: the provider's own text
            // (which may quote hosts, the account or the request) stays in the log and the
            // call's span.
            Error::Llm(ref llm) if llm.is_retryable() => {
                tracing::warn!(error = %llm, "model call failed");
                let status = Status::new(Code::Unavailable, llm.public_message());
                if llm.retries_exhausted() {
                    codes::mark_retried(status)
                } else {
                    status
                }
            }
            Error::Llm(ref llm) => {
                tracing::error!(error = %llm, "model call failed");
                let message = match llm.cause() {
                    LlmError::Malformed(_) => {
                        "the model's answer could not be used as a classification"
                    }
                    _ => "the model provider refused the classification request",
                };
                Status::internal(message)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_maps_to_the_documented_code() {
        let cases = [
            (Error::EmptyImage, Code::InvalidArgument),
            (
                Error::UnsupportedContentType("text/plain".into()),
                Code::InvalidArgument,
            ),
            (Error::NotAnImage, Code::InvalidArgument),
            (
                Error::RuleUnavailable {
                    url: "http://x".into(),
                    reason: "refused".into(),
                },
                Code::Unavailable,
            ),
            (
                Error::EmptyTaxonomy("http://x".into()),
                Code::FailedPrecondition,
            ),
            (Error::OutsideTaxonomy("a/b/c".into()), Code::Internal),
            (
                Error::Llm(LlmError::RateLimited { retry_after: None }),
                Code::Unavailable,
            ),
            (Error::Llm(LlmError::Malformed("x".into())), Code::Internal),
            (
                Error::Llm(LlmError::Upstream {
                    status: 401,
                    body: "bad key".into(),
                }),
                Code::Internal,
            ),
        ];
        for (error, code) in cases {
            let text = error.to_string();
            assert_eq!(Status::from(error).code(), code, "{text}");
        }
    }

    #[test]
    fn a_provider_failure_the_client_already_retried_is_unavailable_and_marked_as_retried() {
        let exhausted = Status::from(Error::Llm(LlmError::RetriesExhausted {
            attempts: 4,
            last: Box::new(LlmError::RateLimited {
                retry_after: Some(std::time::Duration::from_secs(1)),
            }),
        }));
        assert_eq!(exhausted.code(), Code::Unavailable);
        assert!(codes::already_retried(&exhausted));
        assert!(!codes::worth_retrying(&exhausted));
        assert!(
            exhausted.message().contains("gave up after 4 attempts"),
            "{}",
            exhausted.message()
        );

        // Not retried by the client (a timeout): the caller may retry.
        let timeout = Status::from(Error::Llm(LlmError::Timeout(
            std::time::Duration::from_secs(1),
        )));
        assert_eq!(timeout.code(), Code::Unavailable);
        assert!(codes::worth_retrying(&timeout));
        // Other transient trouble (the rule service unreachable) stays retryable too.
        let rule = Status::from(Error::RuleUnavailable {
            url: "http://x".into(),
            reason: "refused".into(),
        });
        assert!(codes::worth_retrying(&rule));
    }

    #[test]
    fn internal_messages_do_not_leak_provider_bodies() {
        let status = Status::from(Error::Llm(LlmError::Upstream {
            status: 400,
            body: "secret detail".into(),
        }));
        assert!(!status.message().contains("secret"));
    }

    #[test]
    fn retryable_failures_do_not_leak_provider_bodies_either() {
        for llm in [
            LlmError::Upstream {
                status: 503,
                body: "secret upstream detail".into(),
            },
            LlmError::RetriesExhausted {
                attempts: 2,
                last: Box::new(LlmError::Transport("dns error: secret.internal".into())),
            },
            LlmError::Interrupted("reset by secret peer".into()),
        ] {
            let status = Status::from(Error::Llm(llm));
            assert_eq!(status.code(), Code::Unavailable);
            assert!(!status.message().contains("secret"), "{}", status.message());
        }
    }
}
