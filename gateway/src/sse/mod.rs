//! Turning gRPC event streams into Server-Sent Events.
//!
//! Framing is axum's (`Sse`, `Event`, `KeepAlive`); this module only decides which SSE event a
//! `ScanEvent`, a `Resync` or a `Notification` becomes, and when a stream ends. What an event is
//! to the gateway (its kind, shared by a job's clients) is `crate::event`; how the OpenAPI
//! document describes the streams is [`doc`].

pub(crate) mod doc;
pub(crate) mod resync;

use std::{convert::Infallible, sync::Arc, time::Duration};

use axum::response::{
    IntoResponse, Response,
    sse::{Event, KeepAlive, Sse},
};
use ecoscan_common::CancellationToken;
use ecoscan_proto::{
    Timestamp,
    event::{stage_name, status_name},
    v1::{
        Answer, Classification, DisposalRules, ErrorInfo, Notification, RewardDecision, ScanEvent,
        scan_event::Payload,
    },
};
use futures::{
    Stream, StreamExt,
    stream::{self, BoxStream},
};
use serde::Serialize;
use tonic::{Status, Streaming};

use crate::{
    error::{ApiError, ErrorJson},
    event::{Item, Kind, SharedEvent, finish_upstream, kind},
    limits::SseSlot,
};

/// How long an SSE response may live, and how much silence on it gets a `: keepalive`
/// comment (which keeps idle connections, and the proxies on their way, open).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamTimes {
    pub(crate) lifetime: Duration,
    pub(crate) keepalive: Duration,
}

/// How long to wait for a stream's first message before answering with SSE headers. An error
/// within this window still gets a proper HTTP status (e.g. 404 for an unknown job).
pub(crate) const FIRST_MESSAGE_WAIT: Duration = Duration::from_millis(500);

pub(crate) fn error_info_json(info: &ErrorInfo) -> ErrorJson {
    ErrorJson {
        code: info.code.clone(),
        http_status: u16::try_from(info.http_status).unwrap_or(500),
        message: info.message.clone(),
        retryable: info.retryable,
    }
}

/// The SSE `event:` name of a user's notifications.
pub(crate) const NOTIFICATION_EVENT: &str = "notification";

/// The `data:` of a scan event (`stage`, `delta`, `ready` and `error` events).
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = ScanEventData)]
pub(crate) struct EventData<'a> {
    /// The event's position in the job's log, `<milliseconds>-<sequence>`; also its SSE `id:`,
    /// what `Last-Event-ID` takes to resume after it.
    #[schema(pattern = r"^[0-9]{1,20}-[0-9]{1,20}$")]
    event_id: &'a str,
    /// The job (a UUID).
    job_id: &'a str,
    /// 1-based sequence number within the job, without gaps: a gap the log cannot fill is
    /// announced by a `resync` event instead.
    seq: u64,
    /// The stage the event is about.
    #[schema(schema_with = crate::schema::stage_schema)]
    stage: &'static str,
    /// What happened to it.
    #[schema(schema_with = crate::schema::event_status_schema)]
    status: &'static str,
    /// Fraction of the whole job done, from 0 to 1.
    progress: f32,
    /// Short human-readable description, e.g. "vision started".
    message: &'a str,
    /// When the event was appended (RFC 3339); `null` when unknown.
    #[schema(schema_with = crate::schema::nullable_timestamp_schema, required = true)]
    ts: Option<&'a Timestamp>,
    /// The job's trace (32 hex digits); empty when untraced.
    trace_id: &'a str,
    /// On `stage` events of vision completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = crate::schema::refs::classification)]
    classification: Option<&'a Classification>,
    /// On `stage` events of rule completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = crate::schema::refs::disposal_rules)]
    rules: Option<&'a DisposalRules>,
    /// On `stage` events of answer completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = crate::schema::refs::answer)]
    answer: Option<&'a Answer>,
    /// On `stage` events of reward completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = crate::schema::refs::reward_decision)]
    reward: Option<&'a RewardDecision>,
    /// On `delta` events: the next piece of the answer text.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    delta: Option<&'a str>,
    /// On `delta` events: where `delta` goes in the answer text, in Unicode code points (not
    /// bytes, not UTF-16 units). Keep the first `offset` code points of the text you have and
    /// append `delta`. Each run of the answer stage starts at 0 (`restarted` announces a run
    /// after the first).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    offset: Option<u32>,
    /// On `ready`: where the finished result is.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    result_url: Option<String>,
    /// On `error`, and on `stage` events of a stage that failed: why.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    error: Option<ErrorJson>,
}

/// The SSE event of `ev`; `result_url` builds the public result URL of a job (the same for
/// every client of this gateway, so the rendering is shared).
fn sse_event(ev: &SharedEvent, result_url: &dyn Fn(&str) -> String) -> (Event, Kind) {
    let kind = ev.kind();
    let json = ev.data(|item| match item {
        Item::Event(e) => scan_event_json(e, result_url).0,
        Item::Resync(r) => resync::json(r, result_url),
    });
    let event = with_id(Event::default().event(kind.name()), ev.event_id());
    (event.data(json), kind)
}

/// The `data:` JSON of a scan event and the SSE event it becomes.
fn scan_event_json(ev: &ScanEvent, result_url: &dyn Fn(&str) -> String) -> (String, Kind) {
    let kind = kind(ev);
    let mut data = EventData {
        event_id: &ev.event_id,
        job_id: &ev.job_id,
        seq: ev.seq,
        stage: stage_name(ev.stage),
        status: status_name(ev.status),
        progress: ev.progress,
        message: &ev.message,
        ts: ev.ts.as_ref(),
        trace_id: &ev.trace_id,
        classification: None,
        rules: None,
        answer: None,
        reward: None,
        delta: None,
        offset: None,
        result_url: None,
        error: None,
    };
    match &ev.payload {
        Some(Payload::Classification(c)) => data.classification = Some(c),
        Some(Payload::Rules(r)) => data.rules = Some(r),
        Some(Payload::Answer(a)) => data.answer = Some(a),
        Some(Payload::Reward(r)) => data.reward = Some(r),
        Some(Payload::Delta(d)) => {
            data.delta = Some(d);
            data.offset = Some(ev.offset);
        }
        None => {}
        Some(Payload::Error(e)) => data.error = Some(error_info_json(e)),
    }
    match kind {
        // The gateway is the public edge, so the result URL a client follows is the gateway's,
        // whatever internal URL ingest recorded.
        Kind::Ready => data.result_url = Some(result_url(&ev.job_id)),
        Kind::Error if data.error.is_none() => {
            data.error = Some(ErrorJson {
                code: "INTERNAL".to_owned(),
                http_status: 500,
                message: if ev.message.is_empty() {
                    "the scan failed".to_owned()
                } else {
                    ev.message.clone()
                },
                retryable: false,
            });
        }
        _ => {}
    }
    (to_json(&data), kind)
}

/// Sets `id:` unless the id could break the framing (ids come from the event log, but the edge
/// must never panic on them).
fn with_id(event: Event, id: &str) -> Event {
    if id.is_empty() || id.contains(['\n', '\r', '\0']) {
        event
    } else {
        event.id(id)
    }
}

fn json_event<T: Serialize>(event: Event, data: &T) -> Event {
    event.data(to_json(data))
}

fn to_json<T: Serialize>(data: &T) -> String {
    serde_json::to_string(data).unwrap_or_else(|e| {
        tracing::error!(error = %e, "failed to serialize an sse event");
        "{}".to_owned()
    })
}

/// The `data:` of an `error` event sent when the upstream stream itself fails.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = StreamErrorData)]
pub(crate) struct StreamErrorData<'a> {
    /// The job whose stream failed; empty on the notification stream.
    job_id: &'a str,
    /// Why.
    error: ErrorJson,
}

/// The `event: error` sent when the upstream stream itself fails; it has no id, so a
/// reconnecting client resumes after the last real event.
fn stream_error_event(job_id: &str, err: &ApiError) -> Event {
    err.log();
    json_event(
        Event::default().event(Kind::Error.name()),
        &StreamErrorData {
            job_id,
            error: err.to_json(),
        },
    )
}

/// How long a client waits before it resumes a stream the gateway ended because ingest could
/// not be reached (the `retry:` hint of [`resume_hint`]).
const RESUME_AFTER: Duration = Duration::from_secs(1);

/// The last words of a job's stream whose upstream broke for a passing reason (ingest
/// unreachable or restarting, its stream's lifetime): not the job's end, so no `error` event,
/// which a client shows as the scan failing, but a `retry` hint and a comment. The client
/// resumes with its `Last-Event-ID`, as after any dropped connection, and misses nothing.
fn resume_hint(status: &Status) -> Event {
    tracing::info!(code = ?status.code(), error = %status.message(), "job stream broke upstream; the client resumes");
    // Ingest refusing a new watch because a store of its own does not answer says which.
    let comment = match crate::error::store_down(status) {
        Some(store) => {
            format!("ingest cannot reach its {store} store for now; reconnect with Last-Event-ID")
        }
        None => "ingest is unavailable for now; reconnect with Last-Event-ID".to_owned(),
    };
    Event::default().retry(RESUME_AFTER).comment(comment)
}

/// A stream of one job's events from ingest (shared by the clients of a job: hence `Arc`).
pub(crate) type ScanEvents = BoxStream<'static, Result<Arc<SharedEvent>, Status>>;

/// The events of a `Scan` or `Watch` response stream: each response carries one event (or
/// one resync).
pub(crate) fn scan_stream<R: Send + 'static>(
    upstream: Streaming<R>,
    event: fn(R) -> Option<SharedEvent>,
) -> ScanEvents {
    upstream
        .map(move |item| {
            item.and_then(|r| {
                event(r).map(Arc::new).ok_or_else(|| {
                    Status::internal("ingest sent a stream message without an event")
                })
            })
        })
        .boxed()
}

/// Waits briefly for the first message so that a failure to start (unknown job, backlog full)
/// becomes an HTTP error instead of an SSE stream. `Ok(None)` means nothing came yet, or the
/// stream ended: streaming may start.
pub(crate) async fn first_message<T, S>(
    stream: &mut S,
    service: &'static str,
) -> Result<Option<T>, ApiError>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    match first_item(stream).await {
        Some(Ok(m)) => Ok(Some(m)),
        Some(Err(status)) => Err(ApiError::upstream(service, status)),
        None => Ok(None),
    }
}

/// The stream's first item if it comes within a short wait; `None` when nothing came yet or
/// the stream ended.
pub(crate) async fn first_item<T, S>(stream: &mut S) -> Option<Result<T, Status>>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    // Polling a stream through `next` is cancel-safe: nothing is lost when the wait ends.
    tokio::time::timeout(FIRST_MESSAGE_WAIT, stream.next())
        .await
        .ok()
        .flatten()
}

fn respond<S>(events: S, shutdown: CancellationToken, times: StreamTimes) -> Response
where
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    // End streams at shutdown: open SSE connections would otherwise hold graceful shutdown open.
    // And after their lifetime: no connection is held forever; the client reconnects with its
    // last event id.
    let events = events
        .take_until(shutdown.cancelled_owned())
        .take_until(tokio::time::sleep(times.lifetime));
    let mut res = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(times.keepalive).text("keepalive"))
        .into_response();
    // Tell buffering reverse proxies (nginx) to pass events through as they come.
    res.headers_mut().insert(
        "x-accel-buffering",
        axum::http::HeaderValue::from_static("no"),
    );
    res
}

struct ScanStreamState {
    upstream: ScanEvents,
    pending: Option<Arc<SharedEvent>>,
    job_id: String,
    result_url: Arc<dyn Fn(&str) -> String + Send + Sync>,
    done: bool,
    _guard: SseSlot,
}

/// An SSE response of a job's events: ends after `ready` or `error`, or when upstream ends.
/// `first` is a message already read by [`first_message`].
pub(crate) fn scan_events(
    upstream: ScanEvents,
    first: Option<Arc<SharedEvent>>,
    job_id: String,
    result_url: Arc<dyn Fn(&str) -> String + Send + Sync>,
    guard: SseSlot,
    shutdown: CancellationToken,
    times: StreamTimes,
) -> Response {
    let state = ScanStreamState {
        upstream,
        pending: first,
        job_id,
        result_url,
        done: false,
        _guard: guard,
    };
    let events = stream::unfold(state, |mut st| async move {
        if st.done {
            finish_upstream(st.upstream);
            return None;
        }
        let next = match st.pending.take() {
            Some(ev) => Ok(Some(ev)),
            None => st.upstream.next().await.transpose(),
        };
        let event = match next {
            Ok(Some(ev)) => {
                if st.job_id.is_empty() {
                    ev.job_id().clone_into(&mut st.job_id);
                }
                let (event, kind) = sse_event(&ev, st.result_url.as_ref());
                tracing::debug!(event_id = %ev.event_id(), kind = kind.name(), "sse scan event");
                st.done = kind.is_terminal();
                event
            }
            Ok(None) => return None,
            Err(status) if crate::watch::retryable(&status) => {
                st.done = true;
                resume_hint(&status)
            }
            Err(status) => {
                st.done = true;
                stream_error_event(&st.job_id, &ApiError::upstream("ingest", status))
            }
        };
        Some((Ok::<_, Infallible>(event), st))
    });
    respond(events, shutdown, times)
}

/// An SSE response of a user's notifications (`event: notification`), until upstream ends.
pub(crate) fn notification_events<S>(
    upstream: S,
    first: Option<Notification>,
    guard: SseSlot,
    shutdown: CancellationToken,
    times: StreamTimes,
) -> Response
where
    S: Stream<Item = Result<Notification, Status>> + Send + Unpin + 'static,
{
    let events = stream::unfold(
        (upstream, first, false, guard),
        |(mut upstream, pending, done, guard)| async move {
            if done {
                return None;
            }
            let next = match pending {
                Some(n) => Ok(Some(n)),
                None => upstream.next().await.transpose(),
            };
            let (event, done) = match next {
                Ok(Some(n)) => (
                    json_event(
                        with_id(Event::default().event(NOTIFICATION_EVENT), &n.id),
                        &n,
                    ),
                    false,
                ),
                Ok(None) => return None,
                Err(status) => (
                    stream_error_event("", &ApiError::upstream("notification", status)),
                    true,
                ),
            };
            Some((Ok::<_, Infallible>(event), (upstream, None, done, guard)))
        },
    );
    respond(events, shutdown, times)
}

#[cfg(test)]
mod tests;
