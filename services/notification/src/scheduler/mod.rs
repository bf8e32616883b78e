//! When scheduled notifications fall due. The delivery loop talks to [`Scheduler`] only, as an
//! `Arc<dyn Scheduler>`: [`MemoryScheduler`] is the embedded implementation, [`RedisScheduler`]
//! the production one shared by every replica; `serve` picks one by the configuration.
//! The SQL row stays the truth: a scheduler may hand an id out more than once, and delivery is
//! guarded there.

use std::time::Duration;

use async_trait::async_trait;

mod memory;
pub(crate) mod redis;

pub use memory::MemoryScheduler;
pub use redis::RedisScheduler;

/// What a scheduler operation fails with: Redis did not answer or refused a command (only the
/// Redis scheduler fails; the memory one cannot). The delivery loop logs it and tries again on
/// its next round; a failed add is left to the reconcile sweep, which restores the entry from
/// its SQL row.
#[derive(Debug, thiserror::Error)]
#[error("the scheduler failed to {what}: {source}")]
pub struct SchedulerError {
    /// The operation, for the log ("claim due notifications", …).
    what: &'static str,
    #[source]
    source: ecoscan_redis::redis::RedisError,
}

impl SchedulerError {
    /// A `map_err` from a Redis error, naming the operation that failed.
    pub(crate) fn redis(
        what: &'static str,
    ) -> impl FnOnce(ecoscan_redis::redis::RedisError) -> Self {
        move |source| Self { what, source }
    }

    /// Whether the same call may pass when tried again: Redis was slow, unreachable, dropped
    /// the connection or is still loading its data, not a refused command.
    pub fn is_transient(&self) -> bool {
        use ecoscan_redis::redis::{ErrorKind, ServerErrorKind};
        let e = &self.source;
        e.is_timeout()
            || e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || matches!(
                e.kind(),
                ErrorKind::Server(ServerErrorKind::BusyLoading | ServerErrorKind::TryAgain)
            )
    }
}

/// Due-time ordering with leased claims.
#[async_trait]
pub trait Scheduler: Send + Sync + 'static {
    /// Adds `id`, due at `due_at_us` (microseconds since the Unix epoch), unless it is waiting or
    /// claimed already: [`Self::add_missing`] of one entry.
    async fn add(&self, id: String, due_at_us: i64) -> Result<(), SchedulerError> {
        self.add_missing(&[(id, due_at_us)]).await.map(drop)
    }

    /// Claims up to `max` ids due at `now_us`, earliest due first (to within a second of due time
    /// on Redis), each leased for `lease`: an id not acknowledged before its lease ends can be
    /// claimed again (a delivery that failed is retried).
    async fn claim_due(
        &self,
        now_us: i64,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<String>, SchedulerError>;

    /// Adds each `(id, due_at_us)` whose id is neither waiting nor claimed, and returns how many
    /// it added: an entry already there keeps its due time, and a claimed one its lease, so a
    /// notification being delivered is not handed out again. Safe to repeat, and to run from
    /// several replicas at once (on Redis one script per call checks and adds atomically). What
    /// the reconcile sweep, the reload at start and a retried `Schedule` use.
    async fn add_missing(&self, entries: &[(String, i64)]) -> Result<usize, SchedulerError>;

    /// Forgets a claimed id: it was delivered, or there was nothing left to deliver. Also when
    /// its lease ran out meanwhile and it waits again. An id that was never claimed may stay
    /// scheduled (Redis keeps waiting entries by due time, which an acknowledgement does not
    /// know); its row says there is nothing to deliver when it is claimed.
    async fn ack(&self, id: &str) -> Result<(), SchedulerError>;

    /// [`Self::ack`] for many ids at once (one round trip on Redis).
    async fn ack_many(&self, ids: &[String]) -> Result<(), SchedulerError>;

    /// Resolves when something may be claimable (an earlier entry arrived, a due time or a lease
    /// end was reached), or after `max_wait` at the latest.
    async fn wait(&self, max_wait: Duration);

    /// Entries not yet acknowledged (waiting plus claimed), for the backlog gauge.
    async fn backlog(&self) -> Result<u64, SchedulerError>;
}
