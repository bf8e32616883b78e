//! Log lines that a caller could multiply (refused credentials, deadlines that ran out), at most
//! one per kind per interval: an attack cannot flood the logs, and an operator still sees that it
//! happens and how often (each line counts the lines held back since the last one).

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
    time::{Duration, Instant},
};

/// At most one line per kind in this long.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// Admits one line per kind per interval.
#[derive(Debug)]
pub struct LogLimiter {
    interval: Duration,
    kinds: Mutex<HashMap<&'static str, Window>>,
}

#[derive(Debug)]
struct Window {
    last: Instant,
    suppressed: u64,
}

impl LogLimiter {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line of `kind` may be written at `now`: `Some(n)`, with `n` the lines of that
    /// kind held back since the last one written, or `None` (held back, and counted).
    pub fn admit(&self, kind: &'static str, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|e| e.into_inner());
        match kinds.get_mut(kind) {
            Some(w) if now.saturating_duration_since(w.last) < self.interval => {
                w.suppressed += 1;
                None
            }
            Some(w) => {
                w.last = now;
                Some(std::mem::take(&mut w.suppressed))
            }
            None => {
                kinds.insert(
                    kind,
                    Window {
                        last: now,
                        suppressed: 0,
                    },
                );
                Some(0)
            }
        }
    }
}

static LIMITER: LazyLock<LogLimiter> = LazyLock::new(|| LogLimiter::new(INTERVAL));

/// Whether a line of `kind` may be written now, by the process-wide limiter ([`INTERVAL`]):
/// `Some(lines held back since the last one)` or `None`.
pub fn admit(kind: &'static str) -> Option<u64> {
    LIMITER.admit(kind, Instant::now())
}

/// Logs an RPC that ended refused (`UNAUTHENTICATED`, at `info`) or at its deadline
/// (`DEADLINE_EXCEEDED`, at `warn`), rate-limited per code; other codes are not logged here.
pub(crate) fn rpc_outcome(code: tonic::Code, method: &str, message: &str) {
    let (kind, warn) = match code {
        tonic::Code::Unauthenticated => ("UNAUTHENTICATED", false),
        tonic::Code::DeadlineExceeded => ("DEADLINE_EXCEEDED", true),
        _ => return,
    };
    let Some(suppressed) = admit(kind) else {
        return;
    };
    let every_s = INTERVAL.as_secs();
    if warn {
        tracing::warn!(
            rpc.method = method,
            error.type = kind,
            reason = message,
            suppressed,
            "call ended at its deadline (at most one such line per {every_s} s; `suppressed` counts the others)"
        );
    } else {
        tracing::info!(
            rpc.method = method,
            error.type = kind,
            reason = message,
            suppressed,
            "call refused: no valid credentials (at most one such line per {every_s} s; `suppressed` counts the others)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_kind_per_interval_and_the_rest_counted() {
        let limiter = LogLimiter::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(limiter.admit("a", t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(limiter.admit("a", t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(
            limiter.admit("b", t0 + Duration::from_secs(1)),
            Some(0),
            "kinds are limited apart"
        );
        assert_eq!(
            limiter.admit("a", t0 + Duration::from_secs(10)),
            Some(1000),
            "the next line counts the lines held back"
        );
        assert_eq!(limiter.admit("a", t0 + Duration::from_secs(11)), None);
        assert_eq!(limiter.admit("a", t0 + Duration::from_secs(21)), Some(1));
    }
}
