//! The process's event hub: one reader takes the event log's feed — every event appended to
//! any job, at a cost that does not depend on how many jobs or watchers there are — and fans
//! each event out in memory to the watchers of its job. Watchers of jobs nobody watches cost
//! nothing: their events are skipped without being decoded.
//!
//! What a watcher does with what the hub hands it — the watch protocol every `Watch` and `Scan`
//! stream follows — is the `watch` module's: the hub only delivers, and each watch runs in a
//! task of its own, so the one reader never waits on a watcher's log reads.

mod watch;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use ecoscan_proto::v1::ScanEvent;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::{
    error::StoreError,
    pending::PendingCache,
    store::{FeedItem, Stores},
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
}
