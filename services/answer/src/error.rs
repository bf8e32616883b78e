//! Everything `Generate` can fail with, and its one mapping to a gRPC status.

use ecoscan_common::codes;
use ecoscan_llm::LlmError;
use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("classification is missing; pass the vision stage's result in `classification`")]
    MissingClassification,
    #[error("rules are missing; pass the rule stage's result in `rules`")]
    MissingRules,
    #[error("classification names no category; fill at least `major_category`")]
    NoCategory,
    #[error("locale {0:?} is not supported; use \"ko\" or \"en\"")]
    UnsupportedLocale(String),
    #[error("answer stream ended without a final message")]
    Truncated,
    #[error(transparent)]
    ModelRefused(#[from] ecoscan_common::models::ModelRefused),
    #[error(transparent)]
    Llm(#[from] LlmError),
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            // Each names its field (INVALID_FIELD with a BadRequest).
            Error::MissingClassification => {
                ecoscan_common::reasons::invalid_field("classification", e.to_string())
            }
            Error::MissingRules => ecoscan_common::reasons::invalid_field("rules", e.to_string()),
            Error::NoCategory => ecoscan_common::reasons::invalid_field(
                "classification.major_category",
                e.to_string(),
            ),
            Error::UnsupportedLocale(_) => {
                ecoscan_common::reasons::invalid_field("locale", e.to_string())
            }
            Error::ModelRefused(_) => {
                ecoscan_common::reasons::invalid_field("model", e.to_string())
            }
            Error::Truncated => {
                tracing::error!(error = %e, "answer failed");
                Status::internal(e.to_string())
            }
            // Transient provider trouble (429, 5xx, timeouts, connection failures): worth a
            // retry by the caller, unless the model client already spent its retries on it.
            // One plain sentence per kind of failure: the provider's own text stays in the log
            // and the call's span.
            Error::Llm(ref llm) if llm.is_retryable() => {
                tracing::warn!(error = %llm, "model call failed");
                let status = Status::unavailable(llm.public_message());
                if llm.retries_exhausted() {
                    codes::mark_retried(status)
                } else {
                    status
                }
            }
            Error::Llm(ref llm) => {
                tracing::error!(error = %llm, "model call failed");
                Status::internal("model provider could not write the answer")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn every_error_maps_to_the_documented_code() {
        let cases = [
            (Error::MissingClassification, Code::InvalidArgument),
            (Error::MissingRules, Code::InvalidArgument),
            (Error::NoCategory, Code::InvalidArgument),
            (Error::UnsupportedLocale("fr".into()), Code::InvalidArgument),
            (Error::Truncated, Code::Internal),
            (
                Error::Llm(LlmError::Timeout(std::time::Duration::from_secs(1))),
                Code::Unavailable,
            ),
            (Error::Llm(LlmError::Malformed("x".into())), Code::Internal),
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
            last: Box::new(LlmError::Upstream {
                status: 503,
                body: "overloaded".into(),
            }),
        }));
        assert_eq!(exhausted.code(), Code::Unavailable);
        assert!(!codes::worth_retrying(&exhausted));

        // A stream that broke mid-answer was not retried by the client: the caller may.
        let broken = Status::from(Error::Llm(LlmError::Interrupted(
            "connection reset by secret.internal".into(),
        )));
        assert_eq!(broken.code(), Code::Unavailable);
        assert!(codes::worth_retrying(&broken));
        assert!(!broken.message().contains("secret"), "{}", broken.message());
        let upstream = Status::from(Error::Llm(LlmError::Upstream {
            status: 502,
            body: "secret body".into(),
        }));
        assert!(
            !upstream.message().contains("secret"),
            "{}",
            upstream.message()
        );
    }
}
