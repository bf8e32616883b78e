//! The process's event hub, and the watch protocol every `Watch` and `Scan` stream follows.
//!
//! One reader takes the event log's feed — every event appended to any job, at a cost that
//! does not depend on how many jobs or watchers there are — and fans each event out in memory
//! to the watchers of its job. Watchers of jobs nobody watches cost nothing: their events are
//! skipped without being decoded.
//!
//! A watcher subscribes first, then reads the job's log after the position it resumes from,
//! then forwards live events, skipping any it already sent. Whenever it may have missed one — a
//! gap in `seq`, its own buffer overflowing, the feed announcing a resync, or a quiet spell — it
//! catches up from the job's log, which is the record. A watch always ends: with the job's final
//! event, at once when it resumes at or past the end of a finished job (from the row when the
//! log has expired), or when its lifetime runs out (the caller reconnects with the last id).

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use ecoscan_proto::v1::{ResyncReason, ScanEvent};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::Instrument;

use crate::{
    error::{Error, StoreError},
    event::{Watched, close_log, is_final, rebuilt_end, resync},
    pending::PendingCache,
    store::{EventId, FeedItem, Job, Stores},
};

pub use crate::config::HubConfig;

/// What the hub hands a watcher.
#[derive(Clone, Debug)]
pub enum HubItem {
    /// Shared by every watcher of the job: one copy, however many watch. With `Some(epoch)`,
    /// the log may have refused it (see [`FeedItem::Event`]).
    Event(Arc<ScanEvent>, Option<u64>),
    /// A claim of this epoch raised the job's fence (see [`FeedItem::Fence`]).
    Fence(u64),
    /// Something may have been missed: read the log.
    Resync,
}

/// Fan-out of live events to watchers, keyed by job. Clones share the hub.
#[derive(Clone)]
pub struct Hub {
    inner: Arc<Inner>,
}

struct Inner {
    stores: Stores,
    config: HubConfig,
    jobs: Mutex<HashMap<String, broadcast::Sender<HubItem>>>,
    /// Rows of running jobs `GetResult` read, each dropped by the next item of its job.
    pending: PendingCache,
    watchers: AtomicU64,
    shutdown: CancellationToken,
}

/// A watcher's subscription; unregisters itself when dropped.
pub struct Subscription {
    rx: broadcast::Receiver<HubItem>,
    hub: Hub,
    job_id: String,
}

impl Subscription {
    /// The next item; a watcher that fell behind gets [`HubItem::Resync`]. `None` when the hub
    /// stopped.
    pub async fn recv(&mut self) -> Option<HubItem> {
        match self.rx.recv().await {
            Ok(item) => Some(item),
            Err(broadcast::error::RecvError::Lagged(_)) => Some(HubItem::Resync),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub.inner.watchers.fetch_sub(1, Ordering::Relaxed);
        let mut jobs = self.hub.inner.jobs.lock().expect("hub lock poisoned");
        // The receiver is dropped after this body runs, so the last watcher still counts as one.
        if jobs
            .get(&self.job_id)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            jobs.remove(&self.job_id);
        }
    }
}

impl Hub {
    /// Opens the log's feed and starts the hub's one reader; it stops with `shutdown`.
    pub async fn start(
        stores: Stores,
        config: HubConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, StoreError> {
        let feed = stores.events.feed().await?;
        let hub = Self {
            inner: Arc::new(Inner {
                stores,
                pending: PendingCache::new(config.pending.clone()),
                config,
                jobs: Mutex::default(),
                watchers: AtomicU64::new(0),
                shutdown,
            }),
        };
        tokio::spawn(hub.clone().read(feed));
        Ok(hub)
    }

    /// The reader: every feed item to the watchers it concerns, after it dropped the job's
    /// kept row (so a watcher that saw the item and then asks for the result reads the row
    /// anew). A feed that stops (its store went away) is opened again; watchers catch up
    /// meanwhile, and no row is kept until it is open.
    async fn read(self, mut feed: Box<dyn crate::store::Feed>) {
        let inner = self.inner.clone();
        let wanted = move |job: &str| {
            inner
                .jobs
                .lock()
                .expect("hub lock poisoned")
                .contains_key(job)
                || inner.pending.holds(job)
        };
        loop {
            let item = tokio::select! {
                () = self.inner.shutdown.cancelled() => return,
                item = feed.recv(&wanted) => item,
            };
            match item {
                Some(FeedItem::Event(ev, epoch)) => {
                    self.inner.pending.changed(&ev.job_id);
                    let ev = Arc::new(*ev);
                    self.send(&ev.job_id, HubItem::Event(Arc::clone(&ev), epoch));
                }
                Some(FeedItem::Fence { job_id, epoch }) => {
                    self.inner.pending.changed(&job_id);
                    self.send(&job_id, HubItem::Fence(epoch));
                }
                Some(FeedItem::Resync) => {
                    self.inner.pending.forget_all(true);
                    self.resync_all();
                }
                None => {
                    tracing::warn!("event feed stopped; opening it again");
                    self.inner.pending.forget_all(false);
                    self.resync_all();
                    feed = loop {
                        tokio::select! {
                            () = self.inner.shutdown.cancelled() => return,
                            () = tokio::time::sleep(Duration::from_secs(1)) => {}
                        }
                        match self.inner.stores.events.feed().await {
                            Ok(f) => {
                                self.inner.pending.resume();
                                break f;
                            }
                            Err(e) => tracing::warn!(error = %e, "cannot open the event feed yet"),
                        }
                    };
                }
            }
        }
    }

    /// Registers interest in `job_id`. Subscribe before reading the log's backlog, so that no
    /// event can fall between the two: once this returns, every event appended to the job
    /// reaches the subscription (or a resync does).
    pub fn subscribe(&self, job_id: &str) -> Subscription {
        let rx = {
            let mut jobs = self.inner.jobs.lock().expect("hub lock poisoned");
            jobs.entry(job_id.to_owned())
                .or_insert_with(|| broadcast::channel(self.inner.config.watcher_buffer.max(1)).0)
                .subscribe()
        };
        self.inner.watchers.fetch_add(1, Ordering::Relaxed);
        Subscription {
            rx,
            hub: self.clone(),
            job_id: job_id.to_owned(),
        }
    }

    /// The rows of running jobs kept for `GetResult` (see [`crate::pending`]).
    pub fn pending(&self) -> &PendingCache {
        &self.inner.pending
    }

    /// Watchers currently registered.
    pub fn watchers(&self) -> u64 {
        self.inner.watchers.load(Ordering::Relaxed)
    }

    fn send(&self, job_id: &str, item: HubItem) {
        let jobs = self.inner.jobs.lock().expect("hub lock poisoned");
        if let Some(tx) = jobs.get(job_id) {
            let _ = tx.send(item);
        }
    }

    fn resync_all(&self) {
        let jobs = self.inner.jobs.lock().expect("hub lock poisoned");
        for tx in jobs.values() {
            let _ = tx.send(HubItem::Resync);
        }
    }

    /// Streams `job`'s events after `after` until its final event, for at most `lifetime`
    /// (capped at the configured maximum); see the module docs for the protocol.
    pub fn watch(
        &self,
        job: Job,
        after: Option<EventId>,
        lifetime: Option<Duration>,
    ) -> Pin<Box<dyn Stream<Item = Result<Watched, Status>> + Send>> {
        let (tx, rx) = mpsc::channel(8);
        let watcher = Watcher {
            hub: self.clone(),
            sub: self.subscribe(&job.id),
            job,
            last: after,
            last_seq: None,
            fence: 0,
            tx,
        };
        // A caller's deadline is ended a little ahead, so that the status reaches it before its
        // own timer resets the stream (a reset says nothing; `DEADLINE_EXCEEDED` says reconnect).
        let lifetime = lifetime.map_or(self.inner.config.max_lifetime, |l| {
            l.saturating_sub(AHEAD_OF_CALLER.min(l / 2))
                .min(self.inner.config.max_lifetime)
        });
        let span = tracing::info_span!("watch", job.id = %watcher.job.id);
        tokio::spawn(
            async move {
                let tx = watcher.tx.clone();
                let ended = tokio::time::timeout(lifetime, watcher.run()).await;
                let status = match ended {
                    Ok(Ok(())) => return,
                    Ok(Err(status)) => status,
                    Err(_) => Status::deadline_exceeded(format!(
                        "the stream reached its lifetime of {:.1} s; reconnect with the last event id",
                        lifetime.as_secs_f64()
                    )),
                };
                let _ = tx.send(Err(status)).await;
            }
            .instrument(span),
        );
        Box::pin(ReceiverStream::new(rx))
    }
}

/// How long before the caller's deadline a watch stream ends itself (at most half the time).
const AHEAD_OF_CALLER: Duration = Duration::from_millis(250);

/// One watch stream's state.
struct Watcher {
    hub: Hub,
    sub: Subscription,
    job: Job,
    /// The last event sent (or the position resumed from).
    last: Option<EventId>,
    last_seq: Option<u64>,
    /// The newest claim of the job known to this watcher: live events of older claims were
    /// refused by the log and are dropped. Read with the log (after subscribing, so no newer
    /// fence marker can fall between the two), raised by the markers on the feed.
    fence: u64,
    tx: mpsc::Sender<Result<Watched, Status>>,
}

/// Whether the watch goes on after sending.
enum Sent {
    More,
    Ended,
}

impl Watcher {
    fn stores(&self) -> &Stores {
        &self.hub.inner.stores
    }

    async fn run(mut self) -> Result<(), Status> {
        if let Some(after) = self.last
            && let Sent::Ended = self.resume_at(after).await?
        {
            return Ok(());
        }
        let backlog = self.read_log().await?;
        let log_was_empty = backlog.is_empty() && self.last.is_none();
        if let Sent::Ended = self.send_all(backlog).await {
            return Ok(());
        }
        if log_was_empty && let Sent::Ended = self.end_if_finished().await? {
            return Ok(());
        }
        let idle = self.hub.inner.config.idle_check;
        loop {
            let item = tokio::select! {
                () = self.hub.inner.shutdown.cancelled() => {
                    return Err(Status::unavailable(
                        "ingest is shutting down; reconnect with the last event id",
                    ));
                }
                () = self.tx.closed() => return Ok(()),
                r = tokio::time::timeout(idle, self.sub.recv()) => r,
            };
            let events = match item {
                Ok(Some(HubItem::Fence(epoch))) => {
                    self.fence = self.fence.max(epoch);
                    continue;
                }
                // Published by a writer whose claim is stale: the log refused it.
                Ok(Some(HubItem::Event(_, Some(epoch)))) if epoch < self.fence => continue,
                // The next event after the last one sent (ids are `<T>-<seq>`); anything else
                // is a gap the log fills or announces.
                Ok(Some(HubItem::Event(ev, _)))
                    if ev.seq == self.last_seq.or(self.last.map(|l| l.n)).unwrap_or(0) + 1 =>
                {
                    vec![Arc::unwrap_or_clone(ev)]
                }
                // A gap, a resync, or a quiet spell: the log says what was missed.
                Ok(Some(HubItem::Event(..) | HubItem::Resync)) => self.read_log().await?,
                Err(_quiet) => {
                    let events = self.read_log().await?;
                    if events.is_empty()
                        && let Sent::Ended = self.end_if_finished().await?
                    {
                        return Ok(());
                    }
                    events
                }
                Ok(None) => {
                    return Err(Status::unavailable(
                        "event hub closed; reconnect with the last event id",
                    ));
                }
            };
            if let Sent::Ended = self.send_all(events).await {
                return Ok(());
            }
        }
    }

    /// The job's events after the last one sent, and its newest claim, as the log has them.
    /// A gap between the last event sent and the first the log still has (it was trimmed, or
    /// lost its data) is announced first, never skipped.
    async fn read_log(&mut self) -> Result<Vec<ScanEvent>, Status> {
        let events = &self.hub.inner.stores.events;
        let (read, fence) = tokio::join!(
            events.read_after(&self.job.id, self.last),
            events.epoch(&self.job.id)
        );
        self.fence = self.fence.max(fence.map_err(Error::from)?);
        let read = read.map_err(Error::from)?;
        if let Some(first) = read.first()
            && let Ok(id) = first.event_id.parse::<EventId>()
        {
            // Ids are dense (`<T>-<seq>`): the next event is the last one's n + 1. A log read
            // from its start begins with `queued` (a log an operator restarted, too).
            let lost = match self.last {
                Some(last) => id.n > last.n + 1,
                None => id.n > 1 && first.stage != ecoscan_proto::v1::Stage::Queued as i32,
            };
            if lost {
                let at = EventId { n: id.n - 1, ..id };
                self.announce(ResyncReason::EventsLost, Some(at)).await;
            }
        }
        Ok(read)
    }

    /// Tells the watcher that the log cannot give it everything after its position; the
    /// stream goes on after `at`.
    async fn announce(&mut self, reason: ResyncReason, at: Option<EventId>) {
        tracing::info!(job.id = %self.job.id, reason = reason.as_str_name(), after = ?self.last.map(|l| l.to_string()), "announcing a gap to a watcher");
        let gap = resync(&self.job.id, self.last, at, reason);
        let _ = self.tx.send(Ok(Watched::Resync(gap))).await;
        if at.is_some() {
            self.last = at;
            self.last_seq = at.map(|a| a.n);
        }
    }

    /// A resume after `after`: at or past the end of a finished job's log, the watch ends at
    /// once with the job's end; past the end of a running job's log, it announces a resync and
    /// goes on from the log's end (ids this log never gave, or the log lost its data).
    async fn resume_at(&mut self, after: EventId) -> Result<Sent, Status> {
        // A finished job whose row knows where its end stands: answered from the row alone
        // (read when the watch began), whatever the log's store is doing.
        if let Some(end) = self.end_from_row(&self.job)
            && after >= end
        {
            return self.end_at(&self.job.clone(), Some(end)).await;
        }
        let last = self
            .stores()
            .events
            .last_id(&self.job.id)
            .await
            .map_err(Error::from)?;
        match last {
            Some(last) if after >= last => {
                if let Sent::Ended = self.end_if_finished().await? {
                    return Ok(Sent::Ended);
                }
                if after > last {
                    self.announce(ResyncReason::PastEnd, Some(last)).await;
                }
            }
            // No log: it expired (the row knows the outcome), or its store lost it while the
            // job runs (what is appended from now on follows).
            None => {
                if let Sent::Ended = self.end_if_finished().await? {
                    return Ok(Sent::Ended);
                }
                self.announce(ResyncReason::EventsLost, None).await;
                self.last = None;
                self.last_seq = None;
            }
            Some(_) => {}
        }
        Ok(Sent::More)
    }

    /// Ends the watch if the job has finished: with what its log took since it was last read
    /// (the final event among it), else with the final event at the position the row recorded
    /// for it ([`rebuilt_end`]). A finished row without that position means the log has not
    /// taken its final event yet — a moment after the row finished, or for good when the
    /// writer's append failed (Redis refused it, lost the log, or the process died) — and the
    /// watcher closes the log itself, as the claim that finished the job would
    /// ([`close_log`]): the end so stands where the log holds it, one final event
    /// whoever appended it, and never at a position the watcher guessed (a log Redis lost
    /// starts a new numbering that no reader could foresee). When a newer claim fences the
    /// watcher off, that claim closes the log and the watch goes on until its event comes.
    async fn end_if_finished(&mut self) -> Result<Sent, Status> {
        let row = self
            .stores()
            .jobs
            .get(&self.job.id)
            .await
            .map_err(Error::from)?;
        let Some(row) = row.filter(Job::is_terminal) else {
            return Ok(Sent::More);
        };
        // The job may have run and finished since the log was read: what it appended comes
        // first, so that a gap below is one the log really has.
        let events = self.read_log().await?;
        if let Sent::Ended = self.send_all(events).await {
            return Ok(Sent::Ended);
        }
        if let Some(end) = self.end_from_row(&row) {
            return self.end_at(&row, Some(end)).await;
        }
        let ttl = self.hub.inner.config.event_ttl;
        let end = match close_log(self.stores(), &row, row.lease_epoch, ttl).await {
            Ok(end) => end.map(|seq| EventId::of(&self.job.id, seq)),
            Err(StoreError::Fenced { .. }) => return Ok(Sent::More),
            Err(e) => return Err(Error::from(e).into()),
        };
        tracing::info!(job.id = %self.job.id, end = ?end.map(|e| e.to_string()), "a watcher closed its finished job's log");
        // The final event, now in the log, after the watcher's position (a resume at or past
        // it gets it again below).
        let events = self.read_log().await?;
        if let Sent::Ended = self.send_all(events).await {
            return Ok(Sent::Ended);
        }
        self.end_at(&row, end).await
    }

    /// The position of a finished job's final event as its row recorded it.
    fn end_from_row(&self, row: &Job) -> Option<EventId> {
        row.is_terminal()
            .then_some(row.end_seq)
            .flatten()
            .map(|seq| EventId::of(&self.job.id, seq))
    }

    /// Sends the end of finished job `row` at `end` (`None`: nothing of the log is left to
    /// name a position). Events between the watcher's position and the end that the log no
    /// longer gives (it expired, or its store lost it) are announced first, never skipped.
    async fn end_at(&mut self, row: &Job, end: Option<EventId>) -> Result<Sent, Status> {
        let resumed = self.last;
        match end {
            None => self.announce(ResyncReason::LogExpired, None).await,
            Some(end) if self.last.map_or(end.n > 1, |l| l.n + 1 < end.n) => {
                let before = EventId {
                    n: end.n - 1,
                    ..end
                };
                self.announce(ResyncReason::LogExpired, Some(before)).await;
            }
            Some(_) => {}
        }
        let _ = self
            .tx
            .send(Ok(Watched::Event(rebuilt_end(row, end, resumed))))
            .await;
        Ok(Sent::Ended)
    }

    /// Sends the events after the last one sent, in order; ends after a final event.
    async fn send_all(&mut self, events: Vec<ScanEvent>) -> Sent {
        for ev in events {
            let Ok(id) = ev.event_id.parse::<EventId>() else {
                continue;
            };
            if self.last.is_some_and(|l| id <= l) {
                continue;
            }
            self.last = Some(id);
            self.last_seq = Some(ev.seq);
            let end = is_final(&ev);
            if self.tx.send(Ok(Watched::Event(ev))).await.is_err() || end {
                return Sent::Ended;
            }
        }
        Sent::More
    }
}
