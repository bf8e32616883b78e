//! The watch protocol every `Watch` and `Scan` stream follows, on what the [`Hub`] hands it.
//!
//! A watcher subscribes first, then reads the job's log after the position it resumes from,
//! then forwards live events, skipping any it already sent. Whenever it may have missed one — a
//! gap in `seq`, its own buffer overflowing, the feed announcing a resync, or a quiet spell — it
//! catches up from the job's log, which is the record. A watch always ends: with the job's final
//! event, at once when it resumes at or past the end of a finished job (from the row when the
//! log has expired), or when its lifetime runs out (the caller reconnects with the last id).

use std::{pin::Pin, sync::Arc, time::Duration};

use ecoscan_proto::v1::{ResyncReason, ScanEvent};
use tokio::sync::mpsc;
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::Status;
use tracing::Instrument;

use super::{Hub, HubItem, Subscription};
use crate::{
    error::{Error, StoreError},
    event::{Watched, close_log, is_final, rebuilt_end, resync},
    store::{EventId, Job, Stores},
};

// The watch's entry point is the hub's, beside the protocol it starts.
impl Hub {
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
