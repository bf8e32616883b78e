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
    /// Every attempt the client's retry budget allows failed transiently (`last` is the last
    /// failure): `LLM_MAX_RETRIES` retries were made, or the next wait would have ended past
    /// `LLM_RETRY_BUDGET`. The call was already retried here; a caller should not retry it
    /// again at once, though the same call may well succeed later.
    #[error("{last}; gave up after {attempts} attempt{}", if *.attempts == 1 { "" } else { "s" })]
    RetriesExhausted {
        attempts: usize,
        last: Box<LlmError>,
    },
}

fn retry_after_text(d: Option<Duration>) -> String {
    d.map(|d| {
        if d.subsec_millis() == 0 {
            format!(" (retry after {}s)", d.as_secs())
        } else {
            format!(" (retry after {:.1}s)", d.as_secs_f64())
        }
    })
    .unwrap_or_default()
}

impl LlmError {
    /// Whether the same call may succeed when made again later.
    pub fn is_retryable(&self) -> bool {
        match self {
            LlmError::RateLimited { .. } | LlmError::Timeout(_) | LlmError::Transport(_) => true,
            LlmError::Upstream { status, .. } => *status >= 500,
            LlmError::Malformed(_) => false,
            LlmError::RetriesExhausted { last, .. } => last.is_retryable(),
        }
    }

    /// Whether the client already spent its retry budget on this call (see
    /// [`LlmError::RetriesExhausted`]): callers map this to a status that tells their own
    /// callers not to retry on top.
    pub fn retries_exhausted(&self) -> bool {
        matches!(self, LlmError::RetriesExhausted { .. })
    }

    /// The failure itself: the last attempt's error when retries were exhausted, else `self`.
    pub fn cause(&self) -> &LlmError {
        match self {
            LlmError::RetriesExhausted { last, .. } => last.cause(),
            other => other,
        }
    }

    /// Short machine-readable kind, used as the span's `error.type` and the `status` label of
    /// `llm_calls`: the kind of the failure itself, also when retries were exhausted.
    pub fn kind(&self) -> &'static str {
        match self {
            LlmError::RateLimited { .. } => "rate_limited",
            LlmError::Upstream { .. } => "upstream",
            LlmError::Timeout(_) => "timeout",
            LlmError::Malformed(_) => "malformed",
            LlmError::Transport(_) => "transport",
            LlmError::RetriesExhausted { last, .. } => last.kind(),
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
        let e = LlmError::RateLimited {
            retry_after: Some(Duration::from_millis(1_500)),
        };
        assert_eq!(
            e.to_string(),
            "model provider rate limit reached (retry after 1.5s)"
        );
    }

    #[test]
    fn exhausted_retries_keep_the_failure_and_say_how_many_attempts_were_made() {
        let e = LlmError::RetriesExhausted {
            attempts: 4,
            last: Box::new(LlmError::RateLimited {
                retry_after: Some(Duration::from_secs(1)),
            }),
        };
        assert!(e.retries_exhausted());
        assert!(e.is_retryable(), "a later call may succeed");
        assert_eq!(e.kind(), "rate_limited");
        assert!(matches!(e.cause(), LlmError::RateLimited { .. }));
        assert_eq!(
            e.to_string(),
            "model provider rate limit reached (retry after 1s); gave up after 4 attempts"
        );
        assert!(!LlmError::Timeout(Duration::from_secs(1)).retries_exhausted());
    }
}
