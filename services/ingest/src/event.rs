//! The event vocabulary of a scan: how events are built, the stages' names and where each
//! stage sits in the job's progress, and the final event of a finished job. The RPC layer, the
//! hub and the pipeline all speak it.

use ecoscan_proto::v1::{ErrorInfo, EventStatus, JobStatus, ScanEvent, Stage, scan_event::Payload};

use crate::store::Job;

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

pub(crate) fn stage_name(stage: Stage) -> &'static str {
    match stage {
        Stage::Vision => "vision",
        Stage::Rule => "rule",
        Stage::Answer => "answer",
        Stage::Reward => "reward",
        Stage::Done => "done",
        Stage::Queued => "queued",
        Stage::Unspecified => "unspecified",
    }
}

/// Whether `ev` is a job's final event (stage `done`): nothing follows it.
pub fn is_final(ev: &ScanEvent) -> bool {
    ev.stage == Stage::Done as i32
}
