//! One upstream `Watch` per job, shared by every SSE client of that job on this gateway.
//!
//! The first client of a job starts a [`JobFeed`]: one `ScanService.Watch` stream to ingest,
//! whose events go into a bounded replay ring and out to every subscriber through one broadcast
//! channel (events are reference-counted, so a hundred clients of a job hold one copy). Later
//! clients, and clients resuming with `Last-Event-ID` inside the ring, join without another call
//! to ingest. A client that falls too far behind is dropped — it reconnects with its last id —
//! rather than slowing the others down. The upstream stream reconnects by itself (from the last
//! event it got) when it ends for a retryable reason, such as its lifetime or an ingest replica
//! going away; it stops when the job's final event has arrived or the last client has left.
//!
//! Feeds are keyed by (user, job): ingest checks ownership when the feed starts, and a client
//! of another user never shares a feed it could not open itself.
//!
//! The feed passes on what ingest sends, trusting its order, with two exceptions to "nothing
//! at or before the last id": the job's end, which a resume at or past the end gets again at
//! the log's final position (however the resume id compares with it), and a resync, after
//! which the stream goes on from the position it names.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use ecoscan_common::client::TracedChannel;
use ecoscan_proto::{
    event::EventId,
    v1::{WatchRequest, scan_service_client::ScanServiceClient},
};
use futures::{Stream, StreamExt};
use tokio::sync::{broadcast, watch};
use tonic::{Code, Status};
use tracing::Instrument;

use crate::{
    auth::Caller,
    event::{Kind, SharedEvent, finish_upstream, until_final},
};

/// Events a feed keeps for late joiners and resumes (a whole job's log, usually).
const RING_EVENTS: usize = 1024;
/// Messages a subscriber may fall behind before it is dropped.
const SUBSCRIBER_LAG: usize = 512;
/// Upper bound of the wait between reconnects of an upstream stream.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Reconnects without a single event in between before the feed gives up with the last error.
const MAX_FRUITLESS_RECONNECTS: u32 = 8;
/// How long a feed that has streamed nothing tries again while ingest refuses it for a store
/// it cannot reach, and how often: a store blip (a restart, a pause) costs its new watchers a
/// few hundred milliseconds once ingest's circuit lets a call through again, not a reconnect
/// of their own; an outage ends their streams with the resume hint within about this long.
const NEW_FEED_STORE_GRACE: Duration = Duration::from_secs(2);
const NEW_FEED_STORE_RETRY: Duration = Duration::from_millis(250);

/// What subscribers receive.
#[derive(Clone, Debug)]
pub(crate) enum FeedItem {
    Event(Arc<SharedEvent>),
    /// The upstream failed for good (e.g. the job is not the caller's): the stream ends with it.
    Failed(Status),
}

/// How far a feed has come, for subscribers waiting on its first answer.
#[derive(Clone, Debug)]
enum Started {
    Waiting,
    /// At least one event arrived (or the upstream stream is established and quiet).
    Streaming,
    /// With the whole status: its details say why (a store ingest cannot reach, say).
    Failed(Status),
}

/// The state a feed's subscribers read.
struct Shared {
    ring: Mutex<Ring>,
    live: broadcast::Sender<FeedItem>,
    started: watch::Sender<Started>,
}

/// The feed's recent events: everything after `start_after` (the whole log when `None`).
#[derive(Default)]
struct Ring {
    /// The id the ring's events follow: the resume point the feed started from, then the id
    /// of the last event trimmed from the front.
    start_after: Option<String>,
    events: VecDeque<Arc<SharedEvent>>,
    /// The job's final event has arrived: nothing more will.
    done: bool,
    /// The upstream failed for good after these events: a joining client ends with it.
    failed: Option<Status>,
}

/// A job's shared upstream stream; dropped (and its upstream stopped) with its last subscriber.
pub(crate) struct JobFeed {
    shared: Arc<Shared>,
    pump: tokio::task::AbortHandle,
}

impl Drop for JobFeed {
    fn drop(&mut self) {
        self.pump.abort();
    }
}

/// (user, job): whose watch of which job a feed is.
type FeedKey = (String, String);

/// Every shared feed of this gateway.
#[derive(Clone)]
pub(crate) struct Watches {
    scan: ScanServiceClient<TracedChannel>,
    feeds: Arc<Mutex<HashMap<FeedKey, Weak<JobFeed>>>>,
    /// Deadline of one upstream `Watch` call (it reconnects after it).
    stream_deadline: Duration,
    /// How long a subscriber waits for the feed's first answer before streaming anyway.
    first_wait: Duration,
}

/// A subscription: the replay, then live events.
pub(crate) struct Subscription {
    _feed: Arc<JobFeed>,
    replay: VecDeque<Arc<SharedEvent>>,
    /// How the replay ends when the feed has failed already.
    failed: Option<Status>,
    live: Option<broadcast::Receiver<FeedItem>>,
}

/// Why a subscription could not be served from a shared feed.
pub(crate) enum Refused {
    /// The feed failed before its first event (unknown job, another user's, bad id …).
    Upstream(Status),
    /// The resume point is outside the replay window: the caller needs a watch of its own.
    OutsideWindow,
}

impl Watches {
    pub(crate) fn new(
        scan: ScanServiceClient<TracedChannel>,
        stream_deadline: Duration,
        first_wait: Duration,
    ) -> Self {
        Self {
            scan,
            feeds: Arc::default(),
            stream_deadline,
            first_wait,
        }
    }

    /// Shared feeds alive now.
    pub(crate) fn feeds(&self) -> usize {
        self.feeds
            .lock()
            .expect("feeds lock poisoned")
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }

    /// Subscribes `user` to `job_id`'s events after `after` (all of them when `None`).
    pub(crate) async fn subscribe(
        &self,
        caller: &Caller,
        job_id: &str,
        after: Option<&str>,
    ) -> Result<Subscription, Refused> {
        let feed = self.feed(caller, job_id, after);
        // Wait (briefly) for the feed's first answer, so that a failure to start is an HTTP
        // error (404 for an unknown job) rather than an SSE stream.
        let mut started = feed.shared.started.subscribe();
        let _ = tokio::time::timeout(
            self.first_wait,
            started.wait_for(|s| !matches!(s, Started::Waiting)),
        )
        .await;
        let failed = match &*started.borrow() {
            Started::Failed(status) => Some(status.clone()),
            _ => None,
        };
        if let Some(status) = failed {
            self.forget(&caller.user, job_id, &feed);
            // A feed's start is its first client's request: a failure of it (that client's
            // resume id was refused, say) is that request's. A client that joined from another
            // position asks for itself.
            let started_after = feed
                .shared
                .ring
                .lock()
                .expect("ring lock poisoned")
                .start_after
                .clone();
            if started_after.as_deref() != after {
                return Err(Refused::OutsideWindow);
            }
            return Err(Refused::Upstream(status));
        }
        let ring = feed.shared.ring.lock().expect("ring lock poisoned");
        let replay: VecDeque<Arc<SharedEvent>> = match after {
            // The ring follows exactly this point: all of it.
            _ if ring.start_after.as_deref() == after => ring.events.clone(),
            None => return Err(Refused::OutsideWindow),
            Some(after) => match ring.events.iter().position(|e| e.event_id() == after) {
                // Resumed at the final event: the job's end, again, so the client stops.
                Some(i) if i + 1 == ring.events.len() && ring.done => {
                    ring.events.iter().skip(i).cloned().collect()
                }
                Some(i) => ring.events.iter().skip(i + 1).cloned().collect(),
                None => return Err(Refused::OutsideWindow),
            },
        };
        // Subscribed while the ring is locked: no event falls between the replay and live.
        let failed = ring.failed.clone();
        let live = (!ring.done && failed.is_none()).then(|| feed.shared.live.subscribe());
        drop(ring);
        Ok(Subscription {
            _feed: feed,
            replay,
            failed,
            live,
        })
    }

    /// The job's feed, started (after `after`, where its first client resumes) when there is
    /// none: single flight, one per user and job.
    fn feed(&self, caller: &Caller, job_id: &str, after: Option<&str>) -> Arc<JobFeed> {
        let key = (caller.user.clone(), job_id.to_owned());
        let mut feeds = self.feeds.lock().expect("feeds lock poisoned");
        // A feed that gave up (ingest was unreachable for a while) is not joined: its end is
        // stale for a client that comes now, which gets a feed of its own.
        if let Some(feed) = feeds.get(&key).and_then(Weak::upgrade)
            && feed
                .shared
                .ring
                .lock()
                .expect("ring lock poisoned")
                .failed
                .is_none()
        {
            return feed;
        }
        // Forget feeds whose clients have all gone, now and then, so the map stays small.
        if feeds.len() > 64 && feeds.len().is_power_of_two() {
            feeds.retain(|_, w| w.strong_count() > 0);
        }
        let shared = Arc::new(Shared {
            ring: Mutex::new(Ring {
                start_after: after.map(str::to_owned),
                ..Ring::default()
            }),
            live: broadcast::channel(SUBSCRIBER_LAG).0,
            started: watch::channel(Started::Waiting).0,
        });
        let pump = tokio::spawn(
            pump(
                self.scan.clone(),
                caller.clone(),
                job_id.to_owned(),
                after.map(str::to_owned),
                shared.clone(),
                self.stream_deadline,
            )
            .instrument(tracing::info_span!("job feed", job.id = %job_id)),
        );
        let feed = Arc::new(JobFeed {
            shared,
            pump: pump.abort_handle(),
        });
        feeds.insert(key, Arc::downgrade(&feed));
        feed
    }

    fn forget(&self, user: &str, job_id: &str, feed: &Arc<JobFeed>) {
        let mut feeds = self.feeds.lock().expect("feeds lock poisoned");
        let key = (user.to_owned(), job_id.to_owned());
        if feeds
            .get(&key)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(feed)))
        {
            feeds.remove(&key);
        }
    }
}

impl Subscription {
    /// The events, in order, ending after the job's final event; `Err` when the upstream
    /// failed for good. A subscriber that fell too far behind simply ends (it reconnects).
    pub(crate) fn into_stream(self) -> impl Stream<Item = Result<Arc<SharedEvent>, Status>> + Send {
        let Self {
            _feed,
            replay,
            failed,
            live,
        } = self;
        let live = live.map(|rx| {
            let rx = tokio_stream::wrappers::BroadcastStream::new(rx);
            tokio_stream::StreamExt::map_while(rx, |item| match item {
                Ok(FeedItem::Event(ev)) => Some(Ok(ev)),
                Ok(FeedItem::Failed(status)) => Some(Err(status)),
                Err(_lagged) => {
                    tracing::debug!("sse client fell behind its job's feed; dropping it");
                    None
                }
            })
        });
        // Keep the feed alive as long as the stream is.
        let keep = futures::stream::once(async move {
            drop(_feed);
        })
        .filter_map(|()| async { None });
        // Ends after the final event: the live channel stays open as long as the feed does.
        until_final(
            futures::stream::iter(replay.into_iter().map(Ok))
                .chain(futures::stream::iter(failed.map(Err)))
                .chain(futures::stream::iter(live).flatten()),
        )
        .chain(keep)
    }
}

/// The feed's upstream: `Watch` from the last event received, again after every retryable end,
/// until the job's final event.
async fn pump(
    mut scan: ScanServiceClient<TracedChannel>,
    caller: Caller,
    job_id: String,
    mut last: Option<String>,
    shared: Arc<Shared>,
    deadline: Duration,
) {
    let mut backoff = Duration::from_millis(100);
    let mut fruitless = 0;
    let began = tokio::time::Instant::now();
    loop {
        let request = WatchRequest {
            job_id: job_id.clone(),
            after_event_id: last.clone().unwrap_or_default(),
        };
        let ended = match scan
            .watch(crate::auth::request(request, deadline, &caller))
            .await
        {
            Ok(response) => {
                shared.started.send_if_modified(|s| {
                    let was = matches!(s, Started::Waiting);
                    if was {
                        *s = Started::Streaming;
                    }
                    was
                });
                let mut stream = response.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(r)) => {
                            let Some(ev) = SharedEvent::from_parts(r.event, r.resync) else {
                                continue;
                            };
                            let kind = ev.kind();
                            // A reconnect resumes after the last event, so anything not newer
                            // is a repeat; but the end is the end wherever it stands (a
                            // resume at or past it gets it at the log's final id), and a
                            // resync moves the position (back, too: past the log's end).
                            let repeat = last.as_deref().is_some_and(|l| !newer(ev.event_id(), l));
                            if repeat && !kind.is_terminal() && kind != Kind::Resync {
                                continue;
                            }
                            backoff = Duration::from_millis(100);
                            fruitless = 0;
                            if kind != Kind::Resync || !ev.event_id().is_empty() {
                                last = Some(ev.event_id().to_owned()).filter(|id| !id.is_empty());
                            } else {
                                // The log holds nothing to resume after: from its start.
                                last = None;
                            }
                            if publish(&shared, ev) {
                                finish_upstream(stream);
                                return;
                            }
                        }
                        Ok(None) => break Status::unavailable("ingest ended the stream"),
                        Err(status) => break status,
                    }
                }
            }
            Err(status) => status,
        };
        fruitless += 1;
        // Ingest refusing a new watch because a store of its own does not answer: a feed that
        // has streamed nothing yet tries again often for a short while (the store may be back
        // by its next probe), then passes it on instead of retrying for seconds; one that was
        // streaming waits it out as for any outage.
        let refused_new = crate::error::store_down(&ended).is_some()
            && shared
                .ring
                .lock()
                .expect("ring lock poisoned")
                .events
                .is_empty();
        let give_up_new = refused_new && began.elapsed() >= NEW_FEED_STORE_GRACE;
        if !retryable(&ended) || fruitless > MAX_FRUITLESS_RECONNECTS || give_up_new {
            tracing::info!(code = ?ended.code(), error = %ended.message(), "job feed failed");
            let mut ring = shared.ring.lock().expect("ring lock poisoned");
            if ring.events.is_empty() {
                // Nothing was streamed: the clients' requests fail with an HTTP status.
                shared.started.send_replace(Started::Failed(ended.clone()));
            }
            ring.failed = Some(ended.clone());
            let _ = shared.live.send(FeedItem::Failed(ended));
            return;
        }
        tracing::debug!(code = ?ended.code(), error = %ended.message(), "job feed reconnecting");
        if refused_new {
            tokio::time::sleep(NEW_FEED_STORE_RETRY).await;
            // Not counted against the reconnects a broken stream gets.
            fruitless -= 1;
            continue;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Adds `ev` to the ring and sends it live; true when it was the job's final event.
fn publish(shared: &Shared, ev: SharedEvent) -> bool {
    let is_final = ev.kind().is_terminal();
    let ev = Arc::new(ev);
    {
        let mut ring = shared.ring.lock().expect("ring lock poisoned");
        ring.events.push_back(ev.clone());
        while ring.events.len() > RING_EVENTS {
            if let Some(old) = ring.events.pop_front() {
                ring.start_after = Some(old.event_id().to_owned());
            }
        }
        ring.done = is_final;
        // Sent under the lock, so a subscriber joining now gets it either from the ring or live.
        let _ = shared.live.send(FeedItem::Event(ev));
    }
    is_final
}

/// Whether an ended upstream stream is worth opening again: it ended because of the
/// transport or the server's own limits (its lifetime, a replica shutting down or dying: a
/// broken connection surfaces as `UNKNOWN` or `CANCELLED`), not because of the request or a
/// failure ingest reported (`INTERNAL` goes to the clients as an error event).
pub(crate) fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::Unknown
            | Code::Cancelled
    )
}

/// Whether event id `a` comes after `b`, compared as [`EventId`]s (`<ms>-<n>` as numbers); ids
/// that do not parse count as newer when they differ.
fn newer(a: &str, b: &str) -> bool {
    match (a.parse::<EventId>(), b.parse::<EventId>()) {
        (Ok(a), Ok(b)) => a > b,
        _ => a != b,
    }
}
