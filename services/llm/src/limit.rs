//! Provider limits: calls in flight and tokens per minute.

use std::num::NonZeroU32;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

/// A token budget refilled continuously at `per_minute / 60` tokens a second, holding at most
/// one minute's worth (governor's GCRA, which is a token bucket in effect). Waiters are not
/// queued fairly; with a handful of concurrent calls (bounded by the concurrency semaphore)
/// that is good enough.
pub(crate) struct TokenBucket {
    limiter: DefaultDirectRateLimiter,
    capacity: NonZeroU32,
}

impl TokenBucket {
    pub(crate) fn per_minute(tokens: u32) -> Self {
        let capacity = NonZeroU32::new(tokens.max(1)).unwrap_or(NonZeroU32::MIN);
        Self {
            limiter: RateLimiter::direct(Quota::per_minute(capacity)),
            capacity,
        }
    }

    /// Takes `tokens` (capped at the capacity, so one huge request cannot wait forever), waiting
    /// until the budget holds them.
    pub(crate) async fn acquire(&self, tokens: u32) {
        let Some(want) = NonZeroU32::new(tokens.min(self.capacity.get())) else {
            return;
        };
        if self.limiter.check_n(want).is_ok_and(|r| r.is_ok()) {
            return;
        }
        tracing::debug!(tokens, "waiting for the tokens-per-minute budget");
        // `want` never exceeds the burst, so the limiter always grants it in time.
        if let Err(e) = self.limiter.until_n_ready(want).await {
            tracing::warn!(error = %e, "token budget refused a request within its capacity");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[tokio::test]
    async fn bucket_grants_up_to_its_capacity_at_once_then_makes_callers_wait() {
        let bucket = TokenBucket::per_minute(60_000);
        let start = Instant::now();
        bucket.acquire(60_000).await;
        assert!(start.elapsed() < Duration::from_millis(50));
        // 1,000 tokens a second: 100 more take about 100 ms.
        bucket.acquire(100).await;
        assert!(start.elapsed() >= Duration::from_millis(80));
    }
}
