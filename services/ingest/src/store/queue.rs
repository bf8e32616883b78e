//! The dispatch queue: at-least-once delivery with leases. A claimed entry that is not
//! acknowledged before its lease runs out is handed to another worker.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Mutex,
    time::{Duration, Instant, SystemTime},
};

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::error::StoreError;

/// What a queue entry carries: the job and the trace context of the request that submitted it.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueEntry {
    pub job_id: String,
    /// W3C `traceparent`/`tracestate`/`baggage`, so the worker's span joins the request's trace.
    pub carrier: HashMap<String, String>,
    /// How many times the entry was claimed before (0 on the first claim).
    pub deliveries: u32,
    pub enqueued_at: SystemTime,
}

impl QueueEntry {
    /// A new entry for `job`, carrying the trace context of the request that submitted it:
    /// what a submit, the sweeper and a requeue put on the queue.
    pub fn for_job(job: &super::Job) -> Self {
        Self {
            job_id: job.id.clone(),
            carrier: job.trace_carrier.clone(),
            deliveries: 0,
            enqueued_at: SystemTime::now(),
        }
    }
}

/// A claimed entry; valid until acknowledged or until the lease runs out.
#[derive(Clone, Debug)]
pub struct Lease {
    pub entry: QueueEntry,
    /// The queue's own handle of this claim (opaque to callers).
    pub id: String,
    /// When the request that claimed, or last renewed, this lease was sent, by this process's
    /// clock (the holder moves it on each renewal [`Queue::extend_many`] confirmed). A queue
    /// on a remote store uses it to refuse a renewal that reaches the store later than its
    /// sender waited for it: see [`Queue::extend_many`].
    pub renewed: tokio::time::Instant,
}

#[async_trait]
pub trait Queue: Send + Sync + 'static {
    async fn enqueue(&self, entry: QueueEntry) -> Result<(), StoreError>;
    /// Claims up to `max` entries for `lease`, waiting up to `wait` for the first to arrive
    /// (an empty result when none came). Entries whose lease ran out are claimed again before
    /// new ones. Every claimer of one queue is expected to use the same lease (the Redis queue
    /// reclaims entries idle longer than the claimer's lease, the memory queue those past the
    /// deadline of their own).
    async fn claim_many(
        &self,
        lease: Duration,
        wait: Duration,
        max: usize,
    ) -> Result<Vec<Lease>, StoreError>;
    /// [`Queue::claim_many`] of one entry.
    async fn claim(&self, lease: Duration, wait: Duration) -> Result<Option<Lease>, StoreError> {
        Ok(self.claim_many(lease, wait, 1).await?.pop())
    }
    /// Pushes each lease's deadline `by` from now, in one round trip; for each, false when
    /// the lease was lost (another claimer holds the entry now, or it is gone).
    ///
    /// A renewal is good only while its sender waits for the answer: one that reaches the
    /// store after that (its connection given up on and the bytes delivered late, after a
    /// network fault) does nothing, judged by the store's clock — the Redis queue refuses it
    /// when the entry has been idle longer than the time from [`Lease::renewed`] to the call
    /// plus the response timeout, which no renewal that arrived in time can see.
    async fn extend_many(&self, leases: &[Lease], by: Duration) -> Result<Vec<bool>, StoreError>;
    /// [`Queue::extend_many`] of one lease.
    async fn extend(&self, lease: &Lease, by: Duration) -> Result<bool, StoreError> {
        Ok(self
            .extend_many(std::slice::from_ref(lease), by)
            .await?
            .first()
            .copied()
            .unwrap_or(false))
    }
    /// Removes the entry for good.
    async fn ack(&self, lease: &Lease) -> Result<(), StoreError>;
    /// Removes the entry only while `lease` still holds it, and says whether it did. A worker
    /// fenced off its job by a newer claim drops its entry with this: the newer claim came
    /// from another entry of the job (a requeue raced the sweeper, or a sweep after a loss
    /// met a job being enqueued) and holds that one, so this entry would only come back when
    /// its lease ran out and fence that claim in turn — or it came from this very entry,
    /// claimed again after this lease ran out, which then is no longer this lease's to drop.
    /// The default is [`Queue::ack`], right for a queue whose `ack` goes by the claim (an
    /// entry claimed again has another handle), as the memory queue's does.
    async fn ack_held(&self, lease: &Lease) -> Result<bool, StoreError> {
        self.ack(lease).await.map(|()| true)
    }
    /// Entries waiting plus entries claimed and not yet acknowledged.
    async fn backlog(&self) -> Result<u64, StoreError>;
    /// Whether the store answers, for a queue reached over the network (Redis).
    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        None
    }
    /// Which of `job_ids` have an entry in the queue, waiting or claimed (for the sweeper).
    async fn queued(&self, job_ids: &[String]) -> Result<HashSet<String>, StoreError>;
    /// Hands the leases' entries back at once, as if their leases had run out: the next claim
    /// of any process takes them (the Redis queue's claimers look for such entries every
    /// quarter lease). A process that is shutting down releases the jobs it could not finish
    /// rather than leaving them to wait out their whole lease.
    async fn release(&self, leases: &[Lease]) -> Result<(), StoreError>;
    /// Reserves, for `hold`, the right to re-enqueue `job_id` for `holder` (one sweeper): true
    /// when nobody else holds it. Sweepers of several replicas may find the same lost job at
    /// once; only the one holding the reservation enqueues it, so a job is not put back twice.
    /// A holder that reserves again gets it again (its hold renewed): a sweeper whose enqueue
    /// failed after it reserved (Redis refused the write: `OOM`, a restart) puts the job back
    /// at its next pass instead of being held off by its own reservation.
    async fn reserve_requeue(
        &self,
        job_id: &str,
        hold: Duration,
        holder: &str,
    ) -> Result<bool, StoreError>;
    /// Resolves when the queue notices that its store lost entries (Redis restarted without
    /// persistence, `FLUSHALL`, a failover that had not caught up): every unfinished job
    /// whose entry went with them must be put back now, not after the sweeper's grace. Each
    /// loss noticed wakes one waiter (a loss noticed while nobody waits wakes the next).
    /// Queues that cannot lose entries without their process never resolve it.
    async fn lost(&self) {
        std::future::pending::<()>().await;
    }
    /// Forgets claimers (other processes) that hold nothing and have not claimed for `idle`:
    /// processes that are gone. Returns how many. Queues without named claimers have none.
    async fn forget_idle_claimers(&self, _idle: Duration) -> Result<usize, StoreError> {
        Ok(0)
    }
}

/// In-memory queue for the embedded suite.
#[derive(Default)]
pub struct MemoryQueue {
    state: Mutex<State>,
    ready: Notify,
}

#[derive(Default)]
struct State {
    waiting: VecDeque<QueueEntry>,
    claimed: HashMap<String, (QueueEntry, Instant)>,
    next_id: u64,
    /// Re-enqueue reservations: when each lapses, and whose it is.
    requeues: HashMap<String, (Instant, String)>,
}

impl MemoryQueue {
    pub fn new() -> Self {
        Self::default()
    }

    fn try_claim(&self, lease: Duration) -> Option<Lease> {
        let mut st = self.state.lock().expect("queue lock poisoned");
        let now = Instant::now();
        let expired = st
            .claimed
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= now)
            .min_by_key(|(_, (_, deadline))| *deadline)
            .map(|(id, _)| id.clone());
        let mut entry = match &expired {
            Some(id) => st.claimed.remove(id).map(|(e, _)| e)?,
            None => st.waiting.pop_front()?,
        };
        if expired.is_some() {
            entry.deliveries += 1;
        }
        st.next_id += 1;
        let id = st.next_id.to_string();
        st.claimed.insert(id.clone(), (entry.clone(), now + lease));
        Some(Lease {
            entry,
            id,
            renewed: tokio::time::Instant::now(),
        })
    }

    fn next_deadline(&self) -> Option<Instant> {
        let st = self.state.lock().expect("queue lock poisoned");
        st.claimed.values().map(|(_, d)| *d).min()
    }
}

#[async_trait]
impl Queue for MemoryQueue {
    async fn release(&self, leases: &[Lease]) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut st = self.state.lock().expect("queue lock poisoned");
        for lease in leases {
            if let Some((_, deadline)) = st.claimed.get_mut(&lease.id) {
                *deadline = now;
            }
        }
        drop(st);
        self.ready.notify_waiters();
        Ok(())
    }

    async fn reserve_requeue(
        &self,
        job_id: &str,
        hold: Duration,
        holder: &str,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut state = self.state.lock().expect("queue lock poisoned");
        state.requeues.retain(|_, (until, _)| *until > now);
        if state
            .requeues
            .get(job_id)
            .is_some_and(|(_, held_by)| held_by != holder)
        {
            return Ok(false);
        }
        state
            .requeues
            .insert(job_id.to_owned(), (now + hold, holder.to_owned()));
        Ok(true)
    }

    async fn enqueue(&self, entry: QueueEntry) -> Result<(), StoreError> {
        self.state
            .lock()
            .expect("queue lock poisoned")
            .waiting
            .push_back(entry);
        self.ready.notify_one();
        Ok(())
    }

    async fn claim_many(
        &self,
        lease: Duration,
        wait: Duration,
        max: usize,
    ) -> Result<Vec<Lease>, StoreError> {
        let until = Instant::now() + wait;
        loop {
            // Register interest before looking, so an enqueue in between is not missed.
            let notified = self.ready.notified();
            let claimed: Vec<Lease> = std::iter::from_fn(|| self.try_claim(lease))
                .take(max)
                .collect();
            if !claimed.is_empty() {
                return Ok(claimed);
            }
            let now = Instant::now();
            if now >= until {
                return Ok(Vec::new());
            }
            // Wake for a new entry, an expiring lease, or the end of the wait.
            let wake = self.next_deadline().map_or(until, |d| d.min(until));
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(wake.into()) => {}
            }
        }
    }

    async fn extend_many(&self, leases: &[Lease], by: Duration) -> Result<Vec<bool>, StoreError> {
        let mut st = self.state.lock().expect("queue lock poisoned");
        let deadline = Instant::now() + by;
        Ok(leases
            .iter()
            .map(|lease| match st.claimed.get_mut(&lease.id) {
                Some((_, d)) => {
                    *d = deadline;
                    true
                }
                None => false,
            })
            .collect())
    }

    async fn ack(&self, lease: &Lease) -> Result<(), StoreError> {
        self.state
            .lock()
            .expect("queue lock poisoned")
            .claimed
            .remove(&lease.id);
        Ok(())
    }

    async fn ack_held(&self, lease: &Lease) -> Result<bool, StoreError> {
        // An entry claimed again has a lease id of its own: this one is then gone.
        Ok(self
            .state
            .lock()
            .expect("queue lock poisoned")
            .claimed
            .remove(&lease.id)
            .is_some())
    }

    async fn backlog(&self) -> Result<u64, StoreError> {
        let st = self.state.lock().expect("queue lock poisoned");
        Ok((st.waiting.len() + st.claimed.len()) as u64)
    }

    async fn queued(&self, job_ids: &[String]) -> Result<HashSet<String>, StoreError> {
        let wanted: HashSet<&str> = job_ids.iter().map(String::as_str).collect();
        let st = self.state.lock().expect("queue lock poisoned");
        Ok(st
            .waiting
            .iter()
            .chain(st.claimed.values().map(|(e, _)| e))
            .filter(|e| wanted.contains(e.job_id.as_str()))
            .map(|e| e.job_id.clone())
            .collect())
    }
}
