//! When scheduled notifications fall due. The delivery loop talks to [`Scheduler`] only;
//! [`MemoryScheduler`] is the embedded implementation, `RedisScheduler` (in `redis_store`) the
//! production one shared by every replica, and [`AnyScheduler`] the one the configuration picks.
//! The SQL row stays the truth: a scheduler may hand an id out more than once, and delivery is
//! guarded there.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    future::Future,
    sync::Mutex,
    time::Duration,
};

use tokio::sync::Notify;

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
    Redis(crate::redis_store::RedisScheduler),
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

#[derive(Default)]
struct State {
    /// Unclaimed entries, earliest due first. An entry counts only while `queued` maps its id to
    /// its due time; others are left-overs of an ack or a re-add, skipped when they surface.
    heap: BinaryHeap<Reverse<(i64, String)>>,
    /// Unclaimed entries: id → due time.
    queued: HashMap<String, i64>,
    /// Claimed entries: id → (lease end, due time to restore on expiry).
    leased: HashMap<String, (i64, i64)>,
}

impl State {
    fn push(&mut self, id: String, due: i64) {
        self.queued.insert(id.clone(), due);
        self.heap.push(Reverse((due, id)));
    }

    /// The earliest live unclaimed entry, dropping left-overs on the way.
    fn peek(&mut self) -> Option<i64> {
        while let Some(Reverse((due, id))) = self.heap.peek() {
            if self.queued.get(id) == Some(due) {
                return Some(*due);
            }
            self.heap.pop();
        }
        None
    }
}

/// [`Scheduler`] in memory: a min-heap by due time plus a lease table. Entries are lost with the
/// process, which is why the service reloads scheduled rows from SQL at start.
#[derive(Default)]
pub struct MemoryScheduler {
    state: Mutex<State>,
    /// Wakes the waiting delivery loop when an entry earlier than all others arrives. A wake-up
    /// that comes while nobody waits is kept (a permit), so none is lost between claim and wait.
    earlier: Notify,
}

impl MemoryScheduler {
    /// An empty scheduler.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The critical sections below cannot panic halfway, so a poisoned lock still holds a
        // consistent state.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Entries not yet acknowledged (unclaimed and leased).
    pub fn len(&self) -> usize {
        let s = self.lock();
        s.queued.len() + s.leased.len()
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Scheduler for MemoryScheduler {
    async fn add(&self, id: String, due_at_us: i64) -> anyhow::Result<()> {
        let earliest = {
            let mut s = self.lock();
            let earliest = s.peek().is_none_or(|due| due_at_us < due);
            s.push(id, due_at_us);
            earliest
        };
        if earliest {
            self.earlier.notify_one();
        }
        Ok(())
    }

    async fn add_missing(&self, entries: &[(String, i64)]) -> anyhow::Result<usize> {
        let (added, earliest) = {
            let mut s = self.lock();
            let before = s.peek();
            let mut added = 0;
            for (id, due) in entries {
                if !s.queued.contains_key(id) && !s.leased.contains_key(id) {
                    s.push(id.clone(), *due);
                    added += 1;
                }
            }
            (added, s.peek() != before)
        };
        if earliest {
            self.earlier.notify_one();
        }
        Ok(added)
    }

    async fn claim_due(
        &self,
        now_us: i64,
        max: usize,
        lease: Duration,
    ) -> anyhow::Result<Vec<String>> {
        let lease_us = i64::try_from(lease.as_micros()).unwrap_or(i64::MAX);
        let mut s = self.lock();
        let expired: Vec<(String, i64)> = s
            .leased
            .iter()
            .filter(|(_, (until, _))| *until <= now_us)
            .map(|(id, (_, due))| (id.clone(), *due))
            .collect();
        for (id, due) in expired {
            s.leased.remove(&id);
            if !s.queued.contains_key(&id) {
                s.push(id, due);
            }
        }
        let mut claimed = Vec::new();
        while claimed.len() < max {
            match s.peek() {
                Some(due) if due <= now_us => {}
                _ => break,
            }
            let Reverse((due, id)) = s.heap.pop().expect("peeked just above");
            s.queued.remove(&id);
            s.leased
                .insert(id.clone(), (now_us.saturating_add(lease_us), due));
            claimed.push(id);
        }
        Ok(claimed)
    }

    async fn ack(&self, id: &str) -> anyhow::Result<()> {
        // Out of both, as on Redis: had the lease run out meanwhile, the entry was queued again,
        // and it needs no second round either.
        let mut s = self.lock();
        s.leased.remove(id);
        s.queued.remove(id);
        Ok(())
    }

    async fn ack_many(&self, ids: &[String]) -> anyhow::Result<()> {
        let mut s = self.lock();
        for id in ids {
            s.leased.remove(id.as_str());
            s.queued.remove(id.as_str());
        }
        Ok(())
    }

    async fn wait(&self, max_wait: Duration) {
        let next = {
            let mut s = self.lock();
            let next_due = s.peek();
            let next_lease = s.leased.values().map(|(until, _)| *until).min();
            next_due.into_iter().chain(next_lease).min()
        };
        let wait = next.map_or(max_wait, |at| {
            let us = u64::try_from(at.saturating_sub(crate::now_us())).unwrap_or(0);
            Duration::from_micros(us).min(max_wait)
        });
        if wait.is_zero() {
            return;
        }
        tokio::select! {
            () = self.earlier.notified() => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn only_due_entries_are_claimed_in_due_order() {
        let s = MemoryScheduler::new();
        s.add("late".into(), 300).await.unwrap();
        s.add("early".into(), 100).await.unwrap();
        s.add("mid".into(), 200).await.unwrap();

        assert_eq!(s.claim_due(250, 10, LEASE).await.unwrap(), ["early", "mid"]);
        assert!(s.claim_due(250, 10, LEASE).await.unwrap().is_empty());
        assert_eq!(s.claim_due(300, 10, LEASE).await.unwrap(), ["late"]);
    }

    #[tokio::test]
    async fn an_unacknowledged_claim_comes_back_after_its_lease() {
        let s = MemoryScheduler::new();
        s.add("a".into(), 0).await.unwrap();
        s.add("b".into(), 0).await.unwrap();
        let lease = Duration::from_micros(1_000);

        let first = s.claim_due(10, 10, lease).await.unwrap();
        s.ack("a").await.unwrap();

        assert_eq!(first, ["a", "b"]);
        assert!(s.claim_due(500, 10, lease).await.unwrap().is_empty());
        assert_eq!(s.claim_due(1_010, 10, lease).await.unwrap(), ["b"]);
        s.ack("b").await.unwrap();
        assert!(s.is_empty());
    }

    #[tokio::test]
    async fn claims_are_capped_at_max() {
        let s = MemoryScheduler::new();
        for i in 0..5 {
            s.add(format!("n{i}"), i).await.unwrap();
        }
        assert_eq!(s.claim_due(100, 2, LEASE).await.unwrap().len(), 2);
        assert_eq!(s.claim_due(100, 10, LEASE).await.unwrap().len(), 3);
    }

    #[tokio::test]
    async fn an_earlier_entry_wakes_a_waiter() {
        let s = std::sync::Arc::new(MemoryScheduler::new());
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.wait(Duration::from_secs(3600)).await }
        });
        s.add("now".into(), crate::now_us() + 3_600_000_000)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter woke up")
            .unwrap();
    }
}
