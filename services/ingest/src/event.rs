//! The event vocabulary of a scan: how events are built, the stages' names and where each
//! stage sits in the job's progress, and the final event of a finished job. The RPC layer, the
//! hub and the pipeline all speak it.

use ecoscan_proto::v1::{
    ErrorInfo, EventStatus, JobStatus, Resync, ResyncReason, ScanEvent, Stage, scan_event::Payload,
};

use std::time::Duration;

use crate::{
    error::StoreError,
    store::{EventId, Job, Stores},
};

/// What a watch stream carries: the job's events, and the gaps its log could not fill.
#[derive(Clone, Debug, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "nearly every item is an event, moved once into its response: boxing it would add \
              an allocation per event to spare the rare resync a few bytes"
)]
pub enum Watched {
    Event(ScanEvent),
    /// Said instead of skipped (see [`resync`]).
    Resync(Resync),
}

impl Watched {
    /// The event, if it is one.
    pub fn into_event(self) -> Option<ScanEvent> {
        match self {
            Self::Event(e) => Some(e),
            Self::Resync(_) => None,
        }
    }
}

/// Builds an event; the log assigns `event_id` and `seq`.
pub fn event(
    job_id: &str,
    stage: Stage,
    status: EventStatus,
    progress: f32,
    message: &str,
    payload: Option<Payload>,
) -> ScanEvent {
    ScanEvent {
        event_id: String::new(),
        job_id: job_id.to_owned(),
        seq: 0,
        stage: stage as i32,
        status: status as i32,
        // Three decimals are plenty, and keep the JSON free of float noise (0.39499998).
        progress: (progress * 1000.0).round() / 1000.0,
        message: message.to_owned(),
        ts: Some(ecoscan_proto::now()),
        trace_id: ecoscan_common::telemetry::current_trace_id(),
        payload,
        offset: 0,
    }
}

/// The final event of a finished job, rebuilt from its row. A success carries no payload: the
/// result is the job's, and the gateway knows where it publishes results.
pub fn terminal_event_from_row(job: &Job) -> ScanEvent {
    if job.status == JobStatus::Succeeded {
        event(
            &job.id,
            Stage::Done,
            EventStatus::Completed,
            1.0,
            "scan complete",
            None,
        )
    } else {
        let error = job.error.clone().unwrap_or_else(|| ErrorInfo {
            code: "UNKNOWN".into(),
            http_status: 500,
            message: "the scan failed".into(),
            retryable: false,
        });
        event(
            &job.id,
            Stage::Done,
            EventStatus::Failed,
            1.0,
            &error.message.clone(),
            Some(Payload::Error(error)),
        )
    }
}

/// The final event of a finished job for a watcher, rebuilt from its row: it takes the
/// position of the log's final event, `end` (its id and `seq`, as the row recorded it or the
/// log holds it), so a watcher that has it already recognizes it as the same event. Without
/// a log (it expired) the position is the watcher's own, `resumed`, when it gave one: nothing
/// newer is left to name.
pub fn rebuilt_end(job: &Job, end: Option<EventId>, resumed: Option<EventId>) -> ScanEvent {
    let mut ev = terminal_event_from_row(job);
    if let Some(at) = end.or(resumed) {
        ev.event_id = at.to_string();
        ev.seq = at.n;
    }
    ev
}

/// A gap announced to a watcher that was at `after`: the stream goes on after `at` (`None`
/// when the log holds nothing of the job).
pub fn resync(
    job_id: &str,
    after: Option<EventId>,
    at: Option<EventId>,
    reason: ResyncReason,
) -> Resync {
    let message = match reason {
        ResyncReason::EventsLost => {
            "events after your position are no longer in the job's log; read the job's result \
             for its state"
        }
        ResyncReason::LogExpired => {
            "the job's event log has expired; read the job's result for its state"
        }
        ResyncReason::PastEnd => {
            "your position is past the end of the job's log; the stream goes on from the log's \
             end: read the job's result for its state"
        }
        ResyncReason::Unspecified => "read the job's result for its state",
    };
    Resync {
        job_id: job_id.to_owned(),
        after_event_id: after.map(|a| a.to_string()).unwrap_or_default(),
        event_id: at.map(|a| a.to_string()).unwrap_or_default(),
        seq: at.map_or(0, |a| a.n),
        reason: reason as i32,
        message: message.to_owned(),
    }
}

/// The `restarted` event of a stage that runs again from its start (a retry after a failed
/// attempt): what it streamed before is void, and answer text starts again at offset 0.
pub(crate) fn restarted(job_id: &str, stage: Stage, attempt: usize) -> ScanEvent {
    let (lo, _) = progress_range(stage);
    event(
        job_id,
        stage,
        EventStatus::Restarted,
        lo,
        &format!("{} restarted (attempt {attempt})", stage_name(stage)),
        None,
    )
}

/// The `delta` event of answer text `text` that goes at `offset` (in code points) of the
/// answer of this run of the stage.
pub(crate) fn delta(
    job_id: &str,
    stage: Stage,
    progress: f32,
    text: String,
    offset: usize,
) -> ScanEvent {
    let mut ev = event(
        job_id,
        stage,
        EventStatus::Delta,
        progress,
        "",
        Some(Payload::Delta(text)),
    );
    ev.offset = u32::try_from(offset).unwrap_or(u32::MAX);
    ev
}

/// The `failed` event of the stage a job failed in: it carries the error, at the top of the
/// stage's progress range.
pub(crate) fn failed(job_id: &str, stage: Stage, error: &ErrorInfo) -> ScanEvent {
    let (_, hi) = progress_range(stage);
    event(
        job_id,
        stage,
        EventStatus::Failed,
        hi,
        &error.message,
        Some(Payload::Error(error.clone())),
    )
}

/// The error a job that failed in `stage` with `status` keeps and shows: code, HTTP status and
/// retryability from the status, and a message a person can read. A stage's verdict on the
/// input (`INVALID_ARGUMENT`, `FAILED_PRECONDITION`, …) is written for the person and passes
/// through; for every other code the person gets one plain sentence per code, never the
/// status's own text, which may carry a model provider's error body, internal addresses or a
/// transport's diagnostics (that text is logged where the failure is handled).
pub(crate) fn stage_error(stage: Stage, status: &tonic::Status) -> ErrorInfo {
    use ecoscan_common::codes;
    use tonic::Code;
    let name = stage_name(stage);
    let plain = match status.code() {
        // Vision judges the person's own photo, in words written for them; every other
        // refusal is between our services, and its text (a service's address, a setting's
        // name) is for the operator: the log and the trace keep it.
        Code::InvalidArgument if stage == Stage::Vision => status.message(),
        Code::FailedPrecondition => {
            "it is not set up to do this right now; try again later, and if it keeps failing, \
             report the scan's id"
        }
        Code::Unavailable => {
            "a service or model it needs is unavailable right now; try again later"
        }
        Code::DeadlineExceeded => "it did not finish in time; try again later",
        Code::ResourceExhausted => "it is over capacity right now; try again later",
        Code::Cancelled | Code::Aborted => "it was interrupted; try again",
        _ => "it failed on our side; try again, and if it keeps failing, report the scan's id",
    };
    ErrorInfo {
        code: codes::code_name(status.code()).to_owned(),
        http_status: u32::from(codes::http_status(status.code())),
        message: format!("{name} stage failed: {plain}"),
        retryable: codes::retryable(status.code()),
    }
}

/// Where each stage sits in the job's overall progress.
pub(crate) fn progress_range(stage: Stage) -> (f32, f32) {
    match stage {
        Stage::Vision => (0.05, 0.35),
        Stage::Rule => (0.35, 0.5),
        Stage::Answer => (0.5, 0.85),
        Stage::Reward => (0.85, 0.95),
        Stage::Done => (1.0, 1.0),
        Stage::Queued | Stage::Unspecified => (0.0, 0.0),
    }
}

/// A stage's short name (`vision`), as the API, the logs and the spans give it.
pub(crate) fn stage_name(stage: Stage) -> &'static str {
    ecoscan_proto::event::stage_name(stage as i32)
}

pub use ecoscan_proto::event::is_final;

/// Ends finished job `job`'s log as the writer of claim `epoch`: its final event, from the
/// row, unless the log has one, then its position on the row (so that a watcher's end is
/// known from the row alone), then the log's expiry. Whoever finds the row finished and
/// the log not closed calls it — the claim that finished the job, a later claim, a watcher
/// — and the log takes one final event whoever appends it; a claim newer than `epoch`
/// refuses it (`Fenced`) and closes the log itself. Returns the final event's seq, `None`
/// when the log says nothing of it (it holds no event).
pub async fn close_log(
    stores: &Stores,
    job: &Job,
    epoch: u64,
    ttl: Duration,
) -> Result<Option<u64>, StoreError> {
    let appended = stores
        .events
        .append_final_as(terminal_event_from_row(job), epoch)
        .await?;
    let seq = match appended {
        Some(ev) => Some(ev.seq),
        // The log has its final event already, as its last; the row may know it too.
        None if job.end_seq.is_some() => job.end_seq,
        None => stores.events.last_id(&job.id).await?.map(|id| id.n),
    };
    if let Some(seq) = seq.filter(|s| job.end_seq != Some(*s)) {
        stores.jobs.set_end_seq(&job.id, seq).await?;
    }
    stores.events.expire(&job.id, ttl).await?;
    Ok(seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_failure_shows_people_a_plain_message_per_code_and_never_the_provider_text() {
        let leaky = tonic::Status::unavailable(
            "model provider unavailable: model provider answered 503: {\"error\": \"upstream 10.2.3.4 overloaded\"}",
        );
        let error = stage_error(Stage::Answer, &leaky);
        assert_eq!(error.code, "UNAVAILABLE");
        assert_eq!(error.http_status, 503);
        assert!(error.retryable);
        assert_eq!(
            error.message,
            "answer stage failed: a service or model it needs is unavailable right now; try again later"
        );
        for code in [
            tonic::Code::Internal,
            tonic::Code::Unknown,
            tonic::Code::DeadlineExceeded,
        ] {
            let error = stage_error(Stage::Vision, &tonic::Status::new(code, "secret 10.2.3.4"));
            assert!(
                !error.message.contains("secret"),
                "{code:?}: {}",
                error.message
            );
        }
        // A refusal between services names them (an address, a setting); people get a plain
        // sentence instead.
        let misconfigured = tonic::Status::failed_precondition(
            "rule service at http://rule.internal:50052 returned an empty taxonomy",
        );
        let error = stage_error(Stage::Vision, &misconfigured);
        assert!(
            !error.message.contains("rule.internal"),
            "{}",
            error.message
        );
        assert_eq!(error.code, "FAILED_PRECONDITION");
        for code in [
            tonic::Code::NotFound,
            tonic::Code::PermissionDenied,
            tonic::Code::Unauthenticated,
            tonic::Code::AlreadyExists,
        ] {
            let status = tonic::Status::new(code, "identity for http://answer:50053 refused");
            let error = stage_error(Stage::Answer, &status);
            assert!(
                !error.message.contains("http"),
                "{code:?}: {}",
                error.message
            );
        }
        let internal = tonic::Status::invalid_argument("classification missing in request");
        assert!(
            !stage_error(Stage::Answer, &internal)
                .message
                .contains("classification")
        );
        // A verdict on the person's input is for the person.
        let verdict = tonic::Status::invalid_argument("the photo shows no object");
        assert_eq!(
            stage_error(Stage::Vision, &verdict).message,
            "vision stage failed: the photo shows no object"
        );
    }
}
