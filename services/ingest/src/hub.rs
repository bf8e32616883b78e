//! The process's event hub: one reader of the event log's feed, fanning every event out in memory
//! to the watchers of its job. Backend connections stay constant whatever the number of watchers.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use ecoscan_proto::v1::ScanEvent;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::{error::StoreError, store::EventLog};

/// Fan-out of live events to watchers, keyed by job.
#[derive(Clone)]
pub struct Hub {
    inner: Arc<Inner>,
}

struct Inner {
    /// Told which jobs are watched, so it reads only those (through its fixed connections).
    log: Arc<dyn EventLog>,
    jobs: Mutex<HashMap<String, broadcast::Sender<ScanEvent>>>,
    watchers: AtomicU64,
}

/// A watcher's subscription; unregisters itself when dropped.
pub struct Subscription {
    pub rx: broadcast::Receiver<ScanEvent>,
    hub: Hub,
    job_id: String,
    /// Whether the log was told about this watcher (and so must be told when it leaves).
    watching: bool,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if self.watching {
            self.hub.inner.log.unwatch(&self.job_id);
        }
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
    /// Starts the hub's single reader over `log`'s feed; it stops with `shutdown`.
    pub fn start(log: Arc<dyn EventLog>, shutdown: CancellationToken) -> Self {
        let mut feed = log.feed();
        let hub = Self {
            inner: Arc::new(Inner {
                log,
                jobs: Mutex::default(),
                watchers: AtomicU64::new(0),
            }),
        };
        let reader = hub.clone();
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    () = shutdown.cancelled() => break,
                    ev = feed.recv() => ev,
                };
                match event {
                    Ok(ev) => reader.publish(ev),
                    // Watchers notice the gap in `seq` and catch up from the log.
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "event hub lagged behind the log");
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
            }
        });
        hub
    }

    /// Registers interest in `job_id`. Subscribe before reading the log's backlog, so that no
    /// event can fall between the two: once this returns, every event appended to the job
    /// reaches the subscription.
    pub async fn subscribe(&self, job_id: &str) -> Result<Subscription, StoreError> {
        let rx = {
            let mut jobs = self.inner.jobs.lock().expect("hub lock poisoned");
            jobs.entry(job_id.to_owned())
                .or_insert_with(|| broadcast::channel(256).0)
                .subscribe()
        };
        self.inner.watchers.fetch_add(1, Ordering::Relaxed);
        let mut sub = Subscription {
            rx,
            hub: self.clone(),
            job_id: job_id.to_owned(),
            watching: false,
        };
        self.inner.log.watch(job_id).await?;
        sub.watching = true;
        Ok(sub)
    }

    /// Watchers currently registered.
    pub fn watchers(&self) -> u64 {
        self.inner.watchers.load(Ordering::Relaxed)
    }

    fn publish(&self, event: ScanEvent) {
        let jobs = self.inner.jobs.lock().expect("hub lock poisoned");
        if let Some(tx) = jobs.get(&event.job_id) {
            let _ = tx.send(event);
        }
    }
}
