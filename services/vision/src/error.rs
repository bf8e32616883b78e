//! Everything `Classify` can fail with, and its one mapping to a gRPC status.

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
            // retry by the caller.
            Error::Llm(ref llm) if llm.is_retryable() => {
                tracing::warn!(error = %llm, "model call failed");
                Status::new(
                    Code::Unavailable,
                    format!("model provider unavailable: {llm}"),
                )
            }
            Error::Llm(ref llm) => {
                tracing::error!(error = %llm, "model call failed");
                let message = match llm {
                    LlmError::Malformed(_) => "model answer could not be read as a classification",
                    _ => "model provider rejected the classification request",
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
    fn internal_messages_do_not_leak_provider_bodies() {
        let status = Status::from(Error::Llm(LlmError::Upstream {
            status: 400,
            body: "secret detail".into(),
        }));
        assert!(!status.message().contains("secret"));
    }
}
