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
    /// The provider could not be reached, or the connection broke before an answer began.
    #[error("model provider unreachable: {0}")]
    Transport(String),
    /// A streamed answer broke off: the provider was reached and began to answer, then the
    /// stream ended (or failed) before the answer was complete.
    #[error("model answer stream broke off: {0}")]
    Interrupted(String),
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
            LlmError::RateLimited { .. }
            | LlmError::Timeout(_)
            | LlmError::Transport(_)
            | LlmError::Interrupted(_) => true,
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
            LlmError::Interrupted(_) => "interrupted",
            LlmError::RetriesExhausted { last, .. } => last.kind(),
        }
    }

    /// One plain sentence per kind of failure, for people and for callers outside the
    /// service: never the provider's own text (an error body may quote the request, name
    /// internal hosts or the account), which stays in the logs, the call's span and analytics.
    pub fn public_message(&self) -> String {
        let what = match self.cause() {
            LlmError::RateLimited { .. } => "the model provider is rate limiting requests",
            LlmError::Upstream { status, .. } if *status >= 500 => {
                "the model provider failed to answer"
            }
            LlmError::Upstream { .. } => "the model provider refused the request",
            LlmError::Timeout(_) => "the model provider did not answer in time",
            LlmError::Malformed(_) => "the model's answer could not be read",
            LlmError::Transport(_) => "the model provider could not be reached",
            LlmError::Interrupted(_) => "the model's answer broke off before it was complete",
            // `cause()` unwraps it; were it ever nested, this is still true.
            LlmError::RetriesExhausted { .. } => "the model call failed",
        };
        match self {
            LlmError::RetriesExhausted { attempts, .. } => format!(
                "{what}; gave up after {attempts} attempt{}",
                if *attempts == 1 { "" } else { "s" }
            ),
            _ => what.to_owned(),
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
    fn public_messages_never_carry_the_provider_text() {
        let e = LlmError::RetriesExhausted {
            attempts: 4,
            last: Box::new(LlmError::Upstream {
                status: 503,
                body: "upstream 10.1.2.3 said: secret".into(),
            }),
        };
        assert_eq!(
            e.public_message(),
            "the model provider failed to answer; gave up after 4 attempts"
        );
        let cut = LlmError::Interrupted("connection reset by 10.1.2.3".into());
        assert!(cut.is_retryable());
        assert!(!cut.public_message().contains("10.1.2.3"));
        assert!(cut.to_string().starts_with("model answer stream broke off"));
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
