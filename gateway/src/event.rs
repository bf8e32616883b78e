//! A job's events as the gateway passes them on: what each becomes on the wire ([`Kind`]), one
//! event shared by every client of its job ([`SharedEvent`]), and the two stream helpers both the
//! shared watches (`watch`) and the SSE responses (`sse`) need: ending after the job's final
//! event, and letting the upstream call end cleanly after it.
//!
//! A leaf: it imports no other gateway module, so `watch` and `sse` can both use it without
//! needing each other.

use std::{sync::Arc, sync::OnceLock, time::Duration};

use ecoscan_proto::{
    event::is_final,
    v1::{EventStatus, Resync, ScanEvent},
};
use futures::{Stream, StreamExt};
use tonic::Status;

/// What a `ScanEvent` (or a `Resync`) becomes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Stage,
    Delta,
    Ready,
    Error,
    /// A gap the log cannot fill (see `sse::resync`).
    Resync,
}

impl Kind {
    /// Every kind, for the OpenAPI document.
    pub(crate) const ALL: [Self; 5] = [
        Self::Stage,
        Self::Delta,
        Self::Ready,
        Self::Error,
        Self::Resync,
    ];

    /// The SSE `event:` name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Stage => "stage",
            Self::Delta => "delta",
            Self::Ready => "ready",
            Self::Error => "error",
            Self::Resync => "resync",
        }
    }

    pub(crate) fn is_terminal(self) -> bool {
        matches!(self, Self::Ready | Self::Error)
    }
}

pub(crate) fn kind(ev: &ScanEvent) -> Kind {
    let status = EventStatus::try_from(ev.status).unwrap_or(EventStatus::Unspecified);
    // Only the job's final event (stage `done`) ends the stream: a stage that failed is a
    // transition like any other (`stage`, with its error), and the `error` event follows it.
    if is_final(ev) {
        if status == EventStatus::Completed {
            Kind::Ready
        } else {
            Kind::Error
        }
    } else if status == EventStatus::Delta {
        Kind::Delta
    } else {
        Kind::Stage
    }
}

/// A scan event (or a resync) on its way to SSE clients, shared by every client of its job:
/// its `data:` JSON is rendered once, however many clients it goes to.
#[derive(Debug)]
pub(crate) struct SharedEvent {
    item: Item,
    data: OnceLock<String>,
}

/// What ingest sent: an event of the job's log, or a gap it announced.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "nearly every item is an event, held once in an Arc for all of a job's clients: \
              boxing it would add an allocation per event to spare the rare resync a few bytes"
)]
pub(crate) enum Item {
    Event(ScanEvent),
    Resync(Resync),
}

impl SharedEvent {
    pub(crate) fn new(event: ScanEvent) -> Self {
        Self::of(Item::Event(event))
    }

    pub(crate) fn resync(resync: Resync) -> Self {
        Self::of(Item::Resync(resync))
    }

    /// A `Watch`/`Scan` response's message: its event, else its resync.
    pub(crate) fn from_parts(event: Option<ScanEvent>, resync: Option<Resync>) -> Option<Self> {
        event.map(Self::new).or_else(|| resync.map(Self::resync))
    }

    fn of(item: Item) -> Self {
        Self {
            item,
            data: OnceLock::new(),
        }
    }

    /// Its position in the job's log (the SSE `id:`); empty for a resync of an expired log.
    pub(crate) fn event_id(&self) -> &str {
        match &self.item {
            Item::Event(e) => &e.event_id,
            Item::Resync(r) => &r.event_id,
        }
    }

    pub(crate) fn job_id(&self) -> &str {
        match &self.item {
            Item::Event(e) => &e.job_id,
            Item::Resync(r) => &r.job_id,
        }
    }

    pub(crate) fn kind(&self) -> Kind {
        match &self.item {
            Item::Event(e) => kind(e),
            Item::Resync(_) => Kind::Resync,
        }
    }

    /// Its `data:` JSON: rendered by `render` for the first client that needs it, the same
    /// text for every other.
    pub(crate) fn data(&self, render: impl FnOnce(&Item) -> String) -> &str {
        self.data.get_or_init(|| render(&self.item))
    }
}

/// How long the gateway waits, after a job's final event, for the upstream call to end.
const UPSTREAM_FINISH: Duration = Duration::from_secs(2);

/// Lets the upstream call end on its own after the job's final event. Dropping it at once would
/// cancel the call (`RST_STREAM`) just before ingest sends its trailers, so ingest would see a
/// cancelled call and its span no `grpc-status`; reading on to the end (bounded, off the
/// client's path) ends the call cleanly with `OK`.
pub(crate) fn finish_upstream<S: Stream + Send + Unpin + 'static>(mut upstream: S) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(UPSTREAM_FINISH, async {
            while upstream.next().await.is_some() {}
        })
        .await;
    });
}

/// `events` up to and including the job's final event.
pub(crate) fn until_final<S>(events: S) -> impl Stream<Item = S::Item> + Send
where
    S: Stream<Item = Result<Arc<SharedEvent>, Status>> + Send,
{
    events.scan(false, |ended, item| {
        if *ended {
            return futures::future::ready(None);
        }
        *ended = item.as_ref().map_or(true, |ev| ev.kind().is_terminal());
        futures::future::ready(Some(item))
    })
}
