//! When scheduled notifications fall due. The delivery loop talks to [`Scheduler`] only;
//! [`MemoryScheduler`] is the embedded implementation, [`RedisScheduler`] the
//! production one shared by every replica, and [`AnyScheduler`] the one the configuration picks.
//! The SQL row stays the truth: a scheduler may hand an id out more than once, and delivery is
//! guarded there.

use std::{future::Future, time::Duration};

mod memory;
pub(crate) mod redis;

pub use memory::MemoryScheduler;
pub use redis::RedisScheduler;

/// Due-time ordering with leased claims.
pub trait Scheduler: Send + Sync + 'static {
    /// Adds `id`, due at `due_at_us` (microseconds since the Unix epoch).
    fn add(&self, id: String, due_at_us: i64) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Claims up to `max` ids due at `now_us`, each leased for `lease`: an id not acknowledged
    /// before its lease ends can be claimed again (a delivery that failed is retried).
    fn claim_due(
        &self,
        now_us: i64,
        max: usize,
        lease: Duration,
    ) -> impl Future<Output = anyhow::Result<Vec<String>>> + Send;

    /// Adds each `(id, due_at_us)` whose id is neither waiting nor claimed, and returns how many
    /// it added: an entry already there keeps its due time, and a claimed one its lease, so a
    /// notification being delivered is not handed out again. Safe to repeat, and to run from
    /// several replicas at once (on Redis one script per call checks and adds atomically). What
    /// the reconcile sweep, the reload at start and a retried `Schedule` use.
    fn add_missing(
        &self,
        entries: &[(String, i64)],
    ) -> impl Future<Output = anyhow::Result<usize>> + Send;

    /// Forgets a claimed id: it was delivered, or there was nothing left to deliver.
    fn ack(&self, id: &str) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// [`Self::ack`] for many ids at once (one round trip on Redis).
    fn ack_many(&self, ids: &[String]) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Resolves when something may be claimable (an earlier entry arrived, a due time or a lease
    /// end was reached), or after `max_wait` at the latest.
    fn wait(&self, max_wait: Duration) -> impl Future<Output = ()> + Send;
}

/// The scheduler the configuration names: Redis when `REDIS_URL` is set, memory otherwise.
pub enum AnyScheduler {
    Memory(MemoryScheduler),
    Redis(RedisScheduler),
}

impl AnyScheduler {
    /// Entries not yet acknowledged (waiting plus claimed), for the backlog gauge.
    pub async fn backlog(&self) -> anyhow::Result<u64> {
        match self {
            Self::Memory(s) => Ok(s.len() as u64),
            Self::Redis(s) => s.backlog().await,
        }
    }
}

impl Scheduler for AnyScheduler {
    async fn add(&self, id: String, due_at_us: i64) -> anyhow::Result<()> {
        match self {
            Self::Memory(s) => s.add(id, due_at_us).await,
            Self::Redis(s) => s.add(id, due_at_us).await,
        }
    }

    async fn claim_due(
        &self,
        now_us: i64,
        max: usize,
        lease: Duration,
    ) -> anyhow::Result<Vec<String>> {
        match self {
            Self::Memory(s) => s.claim_due(now_us, max, lease).await,
            Self::Redis(s) => s.claim_due(now_us, max, lease).await,
        }
    }

    async fn add_missing(&self, entries: &[(String, i64)]) -> anyhow::Result<usize> {
        match self {
            Self::Memory(s) => s.add_missing(entries).await,
            Self::Redis(s) => s.add_missing(entries).await,
        }
    }

    async fn ack(&self, id: &str) -> anyhow::Result<()> {
        match self {
            Self::Memory(s) => s.ack(id).await,
            Self::Redis(s) => s.ack(id).await,
        }
    }

    async fn ack_many(&self, ids: &[String]) -> anyhow::Result<()> {
        match self {
            Self::Memory(s) => s.ack_many(ids).await,
            Self::Redis(s) => s.ack_many(ids).await,
        }
    }

    async fn wait(&self, max_wait: Duration) {
        match self {
            Self::Memory(s) => s.wait(max_wait).await,
            Self::Redis(s) => s.wait(max_wait).await,
        }
    }
}
