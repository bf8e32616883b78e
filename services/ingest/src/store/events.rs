//! The per-job event log: append-only, resumable by event id, with a feed of new events for the
//! process's hub.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::Mutex,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use ecoscan_common::store_health::StoreHealth;
use ecoscan_proto::v1::ScanEvent;
use tokio::sync::broadcast;

use crate::error::StoreError;

/// An event's position in its job's log (`<T>-<seq>`): the event vocabulary every part of the
/// suite shares ([`ecoscan_proto::event`]).
pub use ecoscan_proto::event::EventId;

/// Seqs one run of a job's log can use. A claim that finds its job's log gone although the
/// job may have had events (Redis lost it: a restart without persistence, `FLUSHALL`, a
/// failover that had not caught up) numbers from `epoch × RUN_SPAN`, above every seq an
/// earlier run can have given, so a watcher that saw the lost events takes the new run's for
/// a gap to read, never for events it has seen. A run is a few dozen events (a few thousand
/// when every stage and answer retry runs to its deadline), far from the next run's base, and
/// `epoch × RUN_SPAN` stays an exact number for JavaScript clients (below 2^53) for millions
/// of claims.
pub const RUN_SPAN: u64 = 1_000_000_000;

pub use crate::config::DEFAULT_EVENT_MAX_LEN;

/// What a log's feed delivers.
#[derive(Debug, Clone, PartialEq)]
pub enum FeedItem {
    /// An event appended to its job's log. With `Some(epoch)` it was published by its writer,
    /// of claim `epoch`, beside its append and not after it, so the log may have refused it:
    /// it is the log's only when no newer claim of its job has been announced
    /// ([`FeedItem::Fence`], [`EventLog::epoch`]). With `None` the log took it.
    Event(Box<ScanEvent>, Option<u64>),
    /// A claim of `epoch` raised the job's fence: every event of the job from an older claim
    /// that the feed carries after this was refused by the log.
    Fence { job_id: String, epoch: u64 },
    /// Events may have been missed before this point (the feed fell behind, or its
    /// connection was renewed): watchers catch up from the per-job log.
    Resync,
}

/// Which jobs' events a feed reader wants.
pub type Wanted<'w> = dyn for<'a> Fn(&'a str) -> bool + Sync + 'w;

/// Every event appended to any job's log, live, for the process's hub. Reading it costs the
/// same however many jobs and watchers there are.
#[async_trait]
pub trait Feed: Send {
    /// The next item; events of jobs for which `wanted` is false are skipped (cheaply: they
    /// are not decoded). `None` once the feed has stopped for good.
    async fn recv(&mut self, wanted: &Wanted<'_>) -> Option<FeedItem>;
}

/// Append-only event log per job, and the live feed of what is appended.
///
/// Writers are fenced: a worker raises its job's fence to the epoch of its claim
/// ([`EventLog::fence`]) and appends with that epoch, and an append with an epoch below the
/// job's fence is refused ([`StoreError::Fenced`]). A worker that lost its job to a newer
/// claim can so never add to the job's log. Epoch 0 is the writer before any claim (the
/// `queued` event at submit).
#[async_trait]
pub trait EventLog: Send + Sync + 'static {
    /// Appends `event` to its job's log as the writer of claim `epoch`, assigning `event_id`
    /// and `seq`; returns the stored event.
    async fn append_as(&self, event: ScanEvent, epoch: u64) -> Result<ScanEvent, StoreError>;
    /// [`EventLog::append_as`] before any claim (epoch 0).
    async fn append(&self, event: ScanEvent) -> Result<ScanEvent, StoreError> {
        self.append_as(event, 0).await
    }
    /// Appends the job's final (`done`) event unless its log already has one, atomically:
    /// `None` when one was there. However many workers finish the same job (a resumed job
    /// whose first worker was only slow, a redelivery after a crash between the row and the
    /// log), its log holds one final event.
    async fn append_final_as(
        &self,
        event: ScanEvent,
        epoch: u64,
    ) -> Result<Option<ScanEvent>, StoreError>;
    /// [`EventLog::append_final_as`] before any claim (epoch 0).
    async fn append_final(&self, event: ScanEvent) -> Result<Option<ScanEvent>, StoreError> {
        self.append_final_as(event, 0).await
    }
    /// Raises the job's fence to `epoch`: appends of older claims are refused from now on.
    /// `Fenced` when a newer claim raised it past `epoch` already. A log that has no record of
    /// the job may number the claim's events from `epoch × RUN_SPAN + 1` rather than 1 (the
    /// Redis log does, as its record may have been lost: see [`RUN_SPAN`]).
    async fn fence(&self, job_id: &str, epoch: u64) -> Result<(), StoreError>;
    /// Empties the job's log and starts it again with `event` (an operator requeued the job):
    /// watchers from the start see the new run only, and ids keep increasing.
    async fn restart(&self, event: ScanEvent) -> Result<ScanEvent, StoreError>;
    /// The job's events strictly after `after` (all of them when `None`), in order.
    async fn read_after(
        &self,
        job_id: &str,
        after: Option<EventId>,
    ) -> Result<Vec<ScanEvent>, StoreError>;
    /// The id of the job's last event, if its log has any.
    async fn last_id(&self, job_id: &str) -> Result<Option<EventId>, StoreError>;
    /// The epoch of the job's newest claim as its log knows it (0 before any claim): feed
    /// events of older claims were refused (see [`FeedItem::Event`]).
    async fn epoch(&self, job_id: &str) -> Result<u64, StoreError>;
    /// Lets the job's log expire `ttl` from now (called when the job has finished).
    async fn expire(&self, job_id: &str, ttl: Duration) -> Result<(), StoreError>;
    /// Starts reading every event appended from now on, of every job (the process's hub
    /// holds one).
    async fn feed(&self) -> Result<Box<dyn Feed>, StoreError>;
    /// Whether the store answers, for a log reached over the network (Redis).
    fn health(&self) -> Option<StoreHealth> {
        None
    }
}

/// In-memory log for the embedded suite: a bounded ring per job, dropped some time after the job
/// ends.
pub struct MemoryEventLog {
    inner: Mutex<HashMap<String, JobLog>>,
    /// When each log given an expiry may go, soonest first (taken after `inner`): each
    /// `expire` removes the logs whose time has come without walking every log kept.
    expiries: Mutex<BinaryHeap<Reverse<(Instant, String)>>>,
    feed: broadcast::Sender<ScanEvent>,
    max_len: usize,
}

/// Events the in-memory feed holds for a reader that fell behind; past it the reader resyncs.
pub const DEFAULT_FEED_CAPACITY: usize = 4096;

struct JobLog {
    events: std::collections::VecDeque<ScanEvent>,
    last_id: EventId,
    seq: u64,
    /// Whether the final event was appended (it may have left the ring since).
    finished: bool,
    /// The newest claim's epoch; appends of older ones are refused.
    fence: u64,
    expires_at: Option<Instant>,
}

impl JobLog {
    fn new() -> Self {
        Self {
            events: Default::default(),
            last_id: EventId { ms: 0, n: 0 },
            seq: 0,
            finished: false,
            fence: 0,
            expires_at: None,
        }
    }
}

impl MemoryEventLog {
    /// A log keeping at most `max_len` events per job (the oldest are dropped, like `XADD MAXLEN`).
    pub fn new(max_len: usize) -> Self {
        Self::with_feed_capacity(max_len, DEFAULT_FEED_CAPACITY)
    }

    /// [`Self::new`] with a feed holding `capacity` events for a reader that falls behind (a
    /// tiny one makes the hub resync often, which tests use).
    pub fn with_feed_capacity(max_len: usize, capacity: usize) -> Self {
        let (feed, _) = broadcast::channel(capacity.max(1));
        Self {
            inner: Mutex::new(HashMap::new()),
            expiries: Mutex::default(),
            feed,
            max_len: max_len.max(1),
        }
    }

    /// Appends `event` as claim `epoch`; when `is_final`, only if the job has no final event
    /// yet (else `None`); when `restart`, after emptying the log.
    fn push(
        &self,
        mut event: ScanEvent,
        epoch: u64,
        is_final: bool,
        restart: bool,
    ) -> Result<Option<ScanEvent>, StoreError> {
        {
            let mut map = self.inner.lock().expect("event log lock poisoned");
            // A claim's writer that finds no record of its job (the log expired: a watcher
            // closing the log of a job that finished long ago) numbers a new run, as the
            // Redis log does, above every seq the expired log gave.
            let log = map.entry(event.job_id.clone()).or_insert_with(|| JobLog {
                seq: epoch.saturating_mul(RUN_SPAN),
                ..JobLog::new()
            });
            if epoch < log.fence {
                return Err(StoreError::Fenced {
                    job: event.job_id,
                    epoch,
                });
            }
            if restart {
                log.events.clear();
                log.finished = false;
                log.expires_at = None;
            }
            if is_final {
                if log.finished {
                    return Ok(None);
                }
                log.finished = true;
            }
            log.seq += 1;
            let id = EventId::of(&event.job_id, log.seq);
            log.last_id = id;
            event.event_id = id.to_string();
            event.seq = log.seq;
            log.events.push_back(event.clone());
            while log.events.len() > self.max_len {
                log.events.pop_front();
            }
        }
        // No receiver simply means no one is watching right now.
        let _ = self.feed.send(event.clone());
        Ok(Some(event))
    }

    /// Drops the logs whose expiry has come. A log given a later expiry since its entry was
    /// queued (expired again) stays until that one.
    fn sweep(&self, map: &mut HashMap<String, JobLog>) {
        let now = Instant::now();
        let mut expiries = self.expiries.lock().expect("event log lock poisoned");
        while let Some(Reverse((at, _))) = expiries.peek()
            && *at <= now
        {
            let Some(Reverse((_, job_id))) = expiries.pop() else {
                break;
            };
            if map
                .get(&job_id)
                .and_then(|log| log.expires_at)
                .is_some_and(|t| t <= now)
            {
                map.remove(&job_id);
            }
        }
    }
}

#[async_trait]
impl EventLog for MemoryEventLog {
    async fn append_as(&self, event: ScanEvent, epoch: u64) -> Result<ScanEvent, StoreError> {
        Ok(self
            .push(event, epoch, false, false)?
            .expect("a plain append always appends"))
    }

    async fn append_final_as(
        &self,
        event: ScanEvent,
        epoch: u64,
    ) -> Result<Option<ScanEvent>, StoreError> {
        self.push(event, epoch, true, false)
    }

    async fn fence(&self, job_id: &str, epoch: u64) -> Result<(), StoreError> {
        let mut map = self.inner.lock().expect("event log lock poisoned");
        let log = map.entry(job_id.to_owned()).or_insert_with(JobLog::new);
        if epoch < log.fence {
            return Err(StoreError::Fenced {
                job: job_id.to_owned(),
                epoch,
            });
        }
        log.fence = epoch;
        Ok(())
    }

    async fn epoch(&self, job_id: &str) -> Result<u64, StoreError> {
        Ok(self
            .inner
            .lock()
            .expect("event log lock poisoned")
            .get(job_id)
            .map_or(0, |log| log.fence))
    }

    async fn restart(&self, event: ScanEvent) -> Result<ScanEvent, StoreError> {
        let fence = self
            .inner
            .lock()
            .expect("event log lock poisoned")
            .get(&event.job_id)
            .map_or(0, |log| log.fence);
        Ok(self
            .push(event, fence, false, true)?
            .expect("a restart always appends"))
    }

    async fn read_after(
        &self,
        job_id: &str,
        after: Option<EventId>,
    ) -> Result<Vec<ScanEvent>, StoreError> {
        let map = self.inner.lock().expect("event log lock poisoned");
        let Some(log) = map.get(job_id) else {
            return Ok(Vec::new());
        };
        Ok(log
            .events
            .iter()
            .filter(|e| match after {
                None => true,
                Some(a) => e.event_id.parse::<EventId>().is_ok_and(|id| id > a),
            })
            .cloned()
            .collect())
    }

    async fn last_id(&self, job_id: &str) -> Result<Option<EventId>, StoreError> {
        let map = self.inner.lock().expect("event log lock poisoned");
        Ok(map
            .get(job_id)
            .and_then(|log| log.events.back())
            .and_then(|e| e.event_id.parse().ok()))
    }

    async fn feed(&self) -> Result<Box<dyn Feed>, StoreError> {
        Ok(Box::new(MemoryFeed(self.feed.subscribe())))
    }

    async fn expire(&self, job_id: &str, ttl: Duration) -> Result<(), StoreError> {
        let mut map = self.inner.lock().expect("event log lock poisoned");
        if let Some(log) = map.get_mut(job_id) {
            let at = Instant::now() + ttl;
            log.expires_at = Some(at);
            self.expiries
                .lock()
                .expect("event log lock poisoned")
                .push(Reverse((at, job_id.to_owned())));
        }
        self.sweep(&mut map);
        Ok(())
    }
}

/// The in-memory log's feed: the broadcast of every append.
struct MemoryFeed(broadcast::Receiver<ScanEvent>);

#[async_trait]
impl Feed for MemoryFeed {
    async fn recv(&mut self, wanted: &Wanted<'_>) -> Option<FeedItem> {
        loop {
            match self.0.recv().await {
                // Published under the log's lock, after the append: the log took it.
                Ok(ev) if wanted(&ev.job_id) => return Some(FeedItem::Event(Box::new(ev), None)),
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::warn!(
                        missed,
                        "event feed fell behind; watchers catch up from the log"
                    );
                    return Some(FeedItem::Resync);
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(job: &str) -> ScanEvent {
        ScanEvent {
            job_id: job.into(),
            ..Default::default()
        }
    }

    async fn kept(log: &MemoryEventLog, job: &str) -> bool {
        !log.read_after(job, None).await.unwrap().is_empty()
    }

    /// Expiries given in any order go when their time comes, each `expire` dropping only those
    /// due; a log given a later expiry since keeps until that one.
    #[tokio::test]
    async fn logs_go_when_their_own_expiry_comes_whatever_the_order() {
        let log = MemoryEventLog::new(100);
        for job in ["late", "soon", "again"] {
            log.append(queued(job)).await.unwrap();
        }
        log.expire("late", Duration::from_secs(3600)).await.unwrap();
        log.expire("again", Duration::from_millis(20))
            .await
            .unwrap();
        log.expire("soon", Duration::from_millis(20)).await.unwrap();
        // Expired again, later, before its first expiry came.
        log.expire("again", Duration::from_secs(3600))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(
            kept(&log, "soon").await,
            "nothing sweeps before an `expire`"
        );
        // Any later `expire` sweeps what is due.
        log.expire("late", Duration::from_secs(3600)).await.unwrap();
        assert!(!kept(&log, "soon").await, "due: gone");
        assert!(kept(&log, "late").await, "not due: kept");
        assert!(kept(&log, "again").await, "expired again, later: kept");
        assert_eq!(
            log.expiries.lock().unwrap().len(),
            3,
            "only the entries still to come are queued"
        );
    }
}
