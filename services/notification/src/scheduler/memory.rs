//! The embedded scheduler: a heap of due entries and a map of leases, in this process.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::Mutex,
    time::Duration,
};

use tokio::sync::Notify;

use super::{Scheduler, SchedulerError};

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

#[async_trait::async_trait]
impl Scheduler for MemoryScheduler {
    async fn backlog(&self) -> Result<u64, SchedulerError> {
        Ok(self.len() as u64)
    }

    async fn add_missing(&self, entries: &[(String, i64)]) -> Result<usize, SchedulerError> {
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
    ) -> Result<Vec<String>, SchedulerError> {
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

    async fn ack(&self, id: &str) -> Result<(), SchedulerError> {
        // Out of both: had the lease run out meanwhile, the entry was queued again, and it needs
        // no second round either (Redis finds those too, in their returned segments).
        let mut s = self.lock();
        s.leased.remove(id);
        s.queued.remove(id);
        Ok(())
    }

    async fn ack_many(&self, ids: &[String]) -> Result<(), SchedulerError> {
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
