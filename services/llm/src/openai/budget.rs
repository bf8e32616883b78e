//! A call's retry budget: how many requests it may still make and how long it may keep trying.
//! One budget is shared by everything a call sends — retries of a failed request, the repair
//! request of an unreadable classification, an answer stream restarted before its first delta —
//! so `LLM_MAX_RETRIES` and `LLM_RETRY_BUDGET` bound the whole call, whatever went wrong.

use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

use crate::LlmError;

/// The longest backoff between two attempts when the provider names no wait.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

pub(crate) struct Budget {
    /// Yields one delay per retry left; `None` once `max_retries` retries were made.
    backoff: ExponentialBackoff,
    /// When the first attempt began: set once its permit (and token budget) is granted.
    started: Option<Instant>,
    attempts: usize,
    limit: Duration,
}

impl Budget {
    pub(crate) fn new(max_retries: usize, base_delay: Duration, limit: Duration) -> Self {
        Self {
            backoff: ExponentialBuilder::default()
                .with_min_delay(base_delay)
                .with_max_delay(MAX_BACKOFF)
                .with_max_times(max_retries)
                .with_jitter()
                .build(),
            started: None,
            attempts: 0,
            limit,
        }
    }

    /// Marks the start of the call (the first attempt only).
    pub(crate) fn start(&mut self) {
        self.started.get_or_insert_with(Instant::now);
    }

    pub(crate) fn count_attempt(&mut self) {
        self.attempts += 1;
    }

    pub(crate) fn attempts(&self) -> usize {
        self.attempts
    }

    fn elapsed(&self) -> Duration {
        self.started.map_or(Duration::ZERO, |s| s.elapsed())
    }

    /// After a transient failure: how long to wait before the next attempt (the provider's
    /// `retry_after` when it named one, else the backoff's), or the failure wrapped as
    /// [`LlmError::RetriesExhausted`] when no retry is left or the wait would end past the
    /// budget.
    pub(crate) fn next_wait(
        &mut self,
        error: LlmError,
        retry_after: Option<Duration>,
    ) -> Result<Duration, LlmError> {
        let exhausted = |error: LlmError, attempts| LlmError::RetriesExhausted {
            attempts,
            last: Box::new(error),
        };
        let Some(delay) = self.backoff.next() else {
            return Err(exhausted(error, self.attempts));
        };
        let wait = retry_after.unwrap_or(delay);
        if self.elapsed() + wait > self.limit {
            tracing::warn!(
                error = %error,
                wait_ms = wait.as_millis() as u64,
                budget_ms = self.limit.as_millis() as u64,
                "llm call failed, and waiting to retry would outlast the retry budget"
            );
            return Err(exhausted(error, self.attempts));
        }
        tracing::warn!(
            error = %error,
            attempt = self.attempts,
            wait_ms = wait.as_millis() as u64,
            "llm call failed, retrying"
        );
        Ok(wait)
    }

    /// Takes one retry for a request that needs no wait (a repair): `false` when the call has
    /// no retry or no time left.
    pub(crate) fn take_extra(&mut self) -> bool {
        self.elapsed() < self.limit && self.backoff.next().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_gives_max_retries_waits_then_gives_up_with_the_attempt_count() {
        let mut budget = Budget::new(2, Duration::from_millis(1), Duration::from_secs(60));
        budget.start();
        for _ in 0..2 {
            budget.count_attempt();
            budget
                .next_wait(LlmError::Transport("x".into()), None)
                .unwrap();
        }
        budget.count_attempt();
        let err = budget
            .next_wait(LlmError::Transport("x".into()), None)
            .unwrap_err();
        assert!(
            matches!(err, LlmError::RetriesExhausted { attempts: 3, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn a_repair_spends_a_retry_of_the_same_budget() {
        let mut budget = Budget::new(1, Duration::from_millis(1), Duration::from_secs(60));
        budget.start();
        assert!(budget.take_extra());
        assert!(!budget.take_extra(), "one retry, spent on the repair");
        let mut none = Budget::new(0, Duration::from_millis(1), Duration::from_secs(60));
        assert!(!none.take_extra(), "LLM_MAX_RETRIES=0 allows no repair");
    }

    #[test]
    fn a_wait_past_the_budget_is_refused_at_once() {
        let mut budget = Budget::new(3, Duration::from_millis(1), Duration::from_secs(30));
        budget.start();
        budget.count_attempt();
        let err = budget
            .next_wait(
                LlmError::RateLimited { retry_after: None },
                Some(Duration::from_secs(120)),
            )
            .unwrap_err();
        assert!(matches!(
            err,
            LlmError::RetriesExhausted { attempts: 1, .. }
        ));
    }
}
