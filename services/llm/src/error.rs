//! What can go wrong in a model call.

use std::time::Duration;

/// A failed model call. Callers decide the gRPC code; [`LlmError::is_retryable`] tells whether
/// the same call may succeed later.
#[derive(Clone, Debug, thiserror::Error)]
pub enum LlmError {
    /// The provider answered 429 and every retry did too.
    #[error("model provider rate limit reached{}", retry_after_text(*.retry_after))]
    RateLimited { retry_after: Option<Duration> },
    /// The provider answered an error status.
    #[error("model provider answered {status}: {body}")]
    Upstream { status: u16, body: String },
    /// No answer (or no next chunk of a stream) within the configured timeout.
    #[error("model call timed out after {0:?}")]
    Timeout(Duration),
    /// The answer did not parse or does not have the requested shape.
    #[error("model answer is malformed: {0}")]
    Malformed(String),
    /// The provider could not be reached, or the connection broke.
    #[error("model provider unreachable: {0}")]
    Transport(String),
}

fn retry_after_text(d: Option<Duration>) -> String {
    d.map(|d| format!(" (retry after {}s)", d.as_secs()))
        .unwrap_or_default()
}

impl LlmError {
    /// Whether the same call may succeed when made again later.
    pub fn is_retryable(&self) -> bool {
        match self {
            LlmError::RateLimited { .. } | LlmError::Timeout(_) | LlmError::Transport(_) => true,
            LlmError::Upstream { status, .. } => *status >= 500,
            LlmError::Malformed(_) => false,
        }
    }

    /// Short machine-readable kind, used as the span's `error.type`.
    pub fn kind(&self) -> &'static str {
        match self {
            LlmError::RateLimited { .. } => "rate_limited",
            LlmError::Upstream { .. } => "upstream",
            LlmError::Timeout(_) => "timeout",
            LlmError::Malformed(_) => "malformed",
            LlmError::Transport(_) => "transport",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transient_failures_are_retryable() {
        assert!(LlmError::RateLimited { retry_after: None }.is_retryable());
        assert!(
            LlmError::Upstream {
                status: 503,
                body: String::new()
            }
            .is_retryable()
        );
        assert!(
            !LlmError::Upstream {
                status: 401,
                body: String::new()
            }
            .is_retryable()
        );
        assert!(!LlmError::Malformed("x".into()).is_retryable());
    }

    #[test]
    fn rate_limit_message_names_the_wait() {
        let e = LlmError::RateLimited {
            retry_after: Some(Duration::from_secs(7)),
        };
        assert_eq!(
            e.to_string(),
            "model provider rate limit reached (retry after 7s)"
        );
    }
}
