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
    ModelRefused(#[from] ecoscan_common::models::ModelRefused),
    #[error(transparent)]
    Llm(#[from] LlmError),
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            // Each names its field (INVALID_FIELD with a BadRequest).
            Error::EmptyImage | Error::NotAnImage => {
                ecoscan_common::reasons::invalid_field("image", e.to_string())
            }
            Error::UnsupportedContentType(_) => {
                ecoscan_common::reasons::invalid_field("content_type", e.to_string())
            }
            Error::ModelRefused(_) => {
                ecoscan_common::reasons::invalid_field("model", e.to_string())
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
mod tests;
