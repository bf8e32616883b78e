//! Rows of running jobs kept in memory for `GetResult`, each dropped by the next feed item of
//! its job.
//!
//! A client polls a running scan's result (`202` + `Retry-After` at the gateway) far more often
//! than the row changes, and each poll was a statement on the job store. Every change a
//! result shows — claimed (`running`), each stage started or checkpointed, finished, failed,
//! requeued — is written to the row *before* the job's log takes an event or fence marker for
//! it, and the hub reads every item the log's feed carries. So a row read after an entry's slot
//! was reserved here stays the row until the feed brings an item of that job, and the hub drops
//! the entry as that item arrives, before any watcher of the job sees it: a client that saw an
//! event on its stream and then asks this replica for the result never gets the row from before
//! it.
//!
//! A read reserves its job's slot ([`PendingCache::lookup`]) before it goes to the store and
//! fills it afterwards ([`PendingCache::fill`]) only if the slot is still its own: a feed item
//! that arrived meanwhile removed the reservation, and the row read may be older than it.
//!
//! What the feed cannot announce is bounded by age: an entry is used for at most `max_age`
//! after its read began. That covers a process that changed a row and died before the log took
//! the event, and a feed cut before it said so ([`crate::store::FeedItem::Resync`] clears
//! everything; while the feed is being reopened nothing is kept). Only running and queued jobs
//! are kept: a finished row is the gateway's to cache, and this process holds at most
//! `capacity` entries.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Instant,
};

pub use crate::config::PendingConfig;
use crate::store::Job;

/// What [`PendingCache::lookup`] found.
#[derive(Debug)]
pub enum Lookup {
    /// The job's row as a read found it, with no feed item of the job since.
    Hit(Arc<Job>),
    /// Read the row; with `Some(slot)`, hand it to [`PendingCache::fill`] afterwards.
    Miss(Option<Slot>),
}

/// A reservation of one job's entry by one read.
#[derive(Debug)]
#[must_use = "a reservation is filled with the row the read found"]
pub struct Slot {
    job_id: String,
    token: u64,
}

enum State {
    Reserved(u64),
    Kept(Arc<Job>),
}

struct Entry {
    state: State,
    /// When the read behind it began.
    since: Instant,
}

struct Inner {
    entries: HashMap<String, Entry>,
    next_token: u64,
    /// False while the feed is down: no entry could be dropped when its job changes.
    live: bool,
}

/// See the module docs. Shared by the hub (which drops entries) and `GetResult` (which reads
/// and fills them).
pub struct PendingCache {
    config: PendingConfig,
    inner: Mutex<Inner>,
}

impl PendingCache {
    pub fn new(config: PendingConfig) -> Self {
        Self {
            config,
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                next_token: 0,
                live: true,
            }),
        }
    }

    fn enabled(&self) -> bool {
        !self.config.max_age.is_zero() && self.config.capacity > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("pending cache lock poisoned")
    }

    /// The job's kept row, or a reservation for the read that will fetch it (none when the
    /// cache is off or full, the feed is down, or another read holds the slot).
    pub fn lookup(&self, job_id: &str) -> Lookup {
        if !self.enabled() {
            return Lookup::Miss(None);
        }
        let now = Instant::now();
        let max_age = self.config.max_age;
        let mut inner = self.lock();
        if !inner.live {
            return Lookup::Miss(None);
        }
        if let Some(entry) = inner.entries.get(job_id)
            && now.duration_since(entry.since) < max_age
        {
            return match &entry.state {
                State::Kept(job) => Lookup::Hit(Arc::clone(job)),
                State::Reserved(_) => Lookup::Miss(None),
            };
        }
        if inner.entries.len() >= self.config.capacity && !inner.entries.contains_key(job_id) {
            inner
                .entries
                .retain(|_, e| now.duration_since(e.since) < max_age);
            if inner.entries.len() >= self.config.capacity {
                return Lookup::Miss(None);
            }
        }
        inner.next_token += 1;
        let token = inner.next_token;
        inner.entries.insert(
            job_id.to_owned(),
            Entry {
                state: State::Reserved(token),
                since: now,
            },
        );
        Lookup::Miss(Some(Slot {
            job_id: job_id.to_owned(),
            token,
        }))
    }

    /// Keeps the row `slot`'s read found, if nothing of its job came through the feed since the
    /// slot was reserved and the job is still to finish; otherwise frees the slot.
    pub fn fill(&self, slot: Slot, row: Option<&Job>) {
        let mut inner = self.lock();
        let Some(entry) = inner.entries.get_mut(&slot.job_id) else {
            return;
        };
        if !matches!(entry.state, State::Reserved(t) if t == slot.token) {
            return;
        }
        match row {
            Some(job) if !job.is_terminal() => entry.state = State::Kept(Arc::new(job.clone())),
            _ => {
                inner.entries.remove(&slot.job_id);
            }
        }
    }

    /// Whether the feed's items of `job_id` matter here (the hub decodes them only then).
    pub fn holds(&self, job_id: &str) -> bool {
        self.enabled() && self.lock().entries.contains_key(job_id)
    }

    /// An item of `job_id` came through the feed: its row may have changed.
    pub fn changed(&self, job_id: &str) {
        if self.enabled() {
            self.lock().entries.remove(job_id);
        }
    }

    /// The feed may have missed items (`live`: it goes on), or stopped (`!live`: keep nothing
    /// until [`PendingCache::resume`]).
    pub fn forget_all(&self, live: bool) {
        let mut inner = self.lock();
        inner.entries.clear();
        inner.live = live;
    }

    /// The feed is open again; what it missed was forgotten when it stopped.
    pub fn resume(&self) {
        self.forget_all(true);
    }

    /// Entries held (reserved or kept), for tests and metrics.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use ecoscan_proto::v1::{JobStatus, Stage};

    use super::*;

    fn job(id: &str, status: JobStatus, stage: Stage) -> Job {
        Job {
            id: id.into(),
            user_id: "u1".into(),
            status,
            stage,
            image_key: "k".into(),
            content_type: "image/png".into(),
            hint: String::new(),
            locale: "en".into(),
            model: String::new(),
            idempotency_key: None,
            trace_carrier: HashMap::new(),
            classification: None,
            rules: None,
            answer: None,
            reward: None,
            error: None,
            attempts: 0,
            lease_epoch: 0,
            created_at: SystemTime::now(),
            finished_at: None,
            dead_at: None,
            end_seq: None,
            dead_reason: None,
            auto_requeues: 0,
        }
    }

    fn cache(max_age: Duration, capacity: usize) -> PendingCache {
        PendingCache::new(PendingConfig { max_age, capacity })
    }

    fn reserve(cache: &PendingCache, id: &str) -> Slot {
        match cache.lookup(id) {
            Lookup::Miss(Some(slot)) => slot,
            other => panic!("expected a reservation of {id}, got {other:?}"),
        }
    }

    fn hit(cache: &PendingCache, id: &str) -> Option<Arc<Job>> {
        match cache.lookup(id) {
            Lookup::Hit(job) => Some(job),
            Lookup::Miss(slot) => {
                // Leave no reservation behind for the next assertion.
                if let Some(slot) = slot {
                    cache.fill(slot, None);
                }
                None
            }
        }
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn a_filled_row_is_kept_until_an_item_of_its_job_comes() {
        let c = cache(HOUR, 10);
        let running = job("a", JobStatus::Running, Stage::Vision);
        c.fill(reserve(&c, "a"), Some(&running));
        c.fill(
            reserve(&c, "b"),
            Some(&job("b", JobStatus::Queued, Stage::Queued)),
        );
        assert_eq!(hit(&c, "a").as_deref(), Some(&running));
        assert!(c.holds("a") && c.holds("b") && !c.holds("c"));
        c.changed("a");
        assert!(hit(&c, "a").is_none(), "an item of the job drops it");
        assert!(hit(&c, "b").is_some(), "an item of another job does not");
    }

    #[test]
    fn an_item_between_reservation_and_fill_keeps_the_read_row_out() {
        let c = cache(HOUR, 10);
        let slot = reserve(&c, "a");
        // The row changed after the read and its event came through the feed meanwhile.
        c.changed("a");
        c.fill(slot, Some(&job("a", JobStatus::Queued, Stage::Queued)));
        assert!(hit(&c, "a").is_none());
        // Likewise a resync.
        let slot = reserve(&c, "a");
        c.forget_all(true);
        c.fill(slot, Some(&job("a", JobStatus::Queued, Stage::Queued)));
        assert!(hit(&c, "a").is_none());
    }

    #[test]
    fn a_later_reservation_owns_the_slot_over_an_earlier_read() {
        let c = cache(HOUR, 10);
        let first = reserve(&c, "a");
        c.changed("a");
        let second = reserve(&c, "a");
        c.fill(first, Some(&job("a", JobStatus::Queued, Stage::Queued)));
        assert!(
            hit_only(&c, "a").is_none(),
            "the older read's row is not kept"
        );
        let newer = job("a", JobStatus::Running, Stage::Rule);
        c.fill(second, Some(&newer));
        assert_eq!(hit(&c, "a").as_deref(), Some(&newer));
    }

    /// A lookup that must not reserve (the slot is another read's).
    fn hit_only(c: &PendingCache, id: &str) -> Option<Arc<Job>> {
        match c.lookup(id) {
            Lookup::Hit(job) => Some(job),
            Lookup::Miss(None) => None,
            Lookup::Miss(Some(slot)) => panic!("slot {slot:?} was free"),
        }
    }

    #[test]
    fn finished_and_missing_jobs_are_not_kept() {
        let c = cache(HOUR, 10);
        c.fill(
            reserve(&c, "a"),
            Some(&job("a", JobStatus::Succeeded, Stage::Done)),
        );
        c.fill(
            reserve(&c, "b"),
            Some(&job("b", JobStatus::Failed, Stage::Done)),
        );
        c.fill(reserve(&c, "c"), None);
        assert!(c.is_empty());
    }

    #[test]
    fn entries_are_used_for_at_most_max_age() {
        // Ages far above a busy machine's scheduling delays, so "still fresh" holds there too.
        let c = cache(Duration::from_millis(500), 10);
        c.fill(
            reserve(&c, "a"),
            Some(&job("a", JobStatus::Running, Stage::Vision)),
        );
        assert!(hit(&c, "a").is_some());
        std::thread::sleep(Duration::from_millis(600));
        // Past its age the entry is read again: a new reservation.
        c.fill(reserve(&c, "a"), None);
        // A reservation whose read never filled it (the call was cancelled) frees itself too.
        let _abandoned = reserve(&c, "b");
        assert!(hit_only(&c, "b").is_none());
        std::thread::sleep(Duration::from_millis(600));
        let _ = reserve(&c, "b");
    }

    #[test]
    fn capacity_bounds_the_entries_and_expired_ones_make_room() {
        let c = cache(Duration::from_millis(500), 2);
        for id in ["a", "b"] {
            c.fill(
                reserve(&c, id),
                Some(&job(id, JobStatus::Running, Stage::Vision)),
            );
        }
        assert!(
            matches!(c.lookup("c"), Lookup::Miss(None)),
            "full: read, keep nothing"
        );
        assert!(hit(&c, "a").is_some(), "what is kept stays");
        std::thread::sleep(Duration::from_millis(600));
        c.fill(
            reserve(&c, "c"),
            Some(&job("c", JobStatus::Running, Stage::Vision)),
        );
        assert_eq!(c.len(), 1, "the expired entries made room");
    }

    #[test]
    fn nothing_is_kept_while_the_feed_is_down_nor_when_off() {
        let c = cache(HOUR, 10);
        c.fill(
            reserve(&c, "a"),
            Some(&job("a", JobStatus::Running, Stage::Vision)),
        );
        c.forget_all(false);
        assert!(c.is_empty());
        assert!(matches!(c.lookup("a"), Lookup::Miss(None)));
        c.resume();
        let _ = reserve(&c, "a");

        for off in [cache(Duration::ZERO, 10), cache(HOUR, 0)] {
            assert!(matches!(off.lookup("a"), Lookup::Miss(None)));
            assert!(!off.holds("a"));
        }
    }
}
