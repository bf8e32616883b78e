//! Provider limits: calls in flight and tokens per minute.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

/// A token bucket refilled continuously at `per_minute / 60` tokens a second, holding at most
/// one minute's worth. Waiters are not queued fairly; with a handful of concurrent calls
/// (bounded by the concurrency semaphore) that is good enough.
pub(crate) struct TokenBucket {
    capacity: f64,
    per_second: f64,
    state: Mutex<BucketState>,
}

struct BucketState {
    available: f64,
    refilled_at: Instant,
}

impl TokenBucket {
    pub(crate) fn per_minute(tokens: u32) -> Self {
        let capacity = f64::from(tokens.max(1));
        Self {
            capacity,
            per_second: capacity / 60.0,
            state: Mutex::new(BucketState {
                available: capacity,
                refilled_at: Instant::now(),
            }),
        }
    }

    /// Takes `tokens` (capped at the capacity, so one huge request cannot wait forever), waiting
    /// until the bucket holds them.
    pub(crate) async fn acquire(&self, tokens: u32) {
        let want = f64::from(tokens).min(self.capacity);
        loop {
            let wait = {
                let mut s = self
                    .state
                    .lock()
                    .expect("token bucket lock is never poisoned");
                let now = Instant::now();
                let elapsed = now.duration_since(s.refilled_at).as_secs_f64();
                s.available = (s.available + elapsed * self.per_second).min(self.capacity);
                s.refilled_at = now;
                if s.available >= want {
                    s.available -= want;
                    return;
                }
                Duration::from_secs_f64((want - s.available) / self.per_second)
            };
            tracing::debug!(
                wait_ms = wait.as_millis() as u64,
                "waiting for the tokens-per-minute budget"
            );
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
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
