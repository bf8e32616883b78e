//! The vocabulary of a job's events, as every side writes and reads it: the event id
//! (`<milliseconds>-<sequence>`), the short names of stages and statuses the JSON APIs use, and
//! which event is a job's last. Ingest writes events and the gateway passes them on; both take
//! these from here, so each wire format is parsed and printed in one place.

use std::{fmt, str::FromStr};

use crate::v1::{EventStatus, JobStatus, ScanEvent, Stage};

/// An event's position in its job's log, `<milliseconds>-<sequence>` like a Redis stream id, so
/// the same ids work whichever log stores them. Ordered. Both logs give a job's events the ids
/// `<T>-<seq>`, where `T` is the job's own time (the millisecond of its UUIDv7 id) and `seq` the
/// event's 1-based number: ids are dense and say where an event is in its job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId {
    pub ms: u64,
    pub n: u64,
}

impl EventId {
    /// The most digits either part of an id has as the edge takes it: a `u64` has at most 20.
    pub const MAX_DIGITS: usize = 20;

    /// The id of `job_id`'s event number `seq`: `<T>-<seq>`, `T` the millisecond timestamp in
    /// the job's UUIDv7 id (0 for ids that are not UUIDv7, as in some tests).
    pub fn of(job_id: &str, seq: u64) -> Self {
        let ms = uuid::Uuid::parse_str(job_id)
            .ok()
            .and_then(|u| u.get_timestamp())
            .map_or(0, |t| {
                let (secs, nanos) = t.to_unix();
                secs * 1000 + u64::from(nanos) / 1_000_000
            });
        Self { ms, n: seq }
    }

    /// Whether `s` has the shape of an event id: two runs of 1 to [`Self::MAX_DIGITS`] ASCII
    /// digits joined by `-`. What the edge checks of an id a client sends before passing it on
    /// (a value too large for `u64` has the shape, and the log refuses it when it parses it).
    pub fn is_well_formed(s: &str) -> bool {
        let Some((ms, n)) = s.split_once('-') else {
            return false;
        };
        let digits = |p: &str| {
            (1..=Self::MAX_DIGITS).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit())
        };
        digits(ms) && digits(n)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.n)
    }
}

impl FromStr for EventId {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            format!(
                "event id {s:?} is malformed; expected <milliseconds>-<sequence>, e.g. 1732950000000-0"
            )
        };
        let (ms, n) = s.split_once('-').ok_or_else(bad)?;
        if ms.is_empty() || n.is_empty() || !ms.bytes().chain(n.bytes()).all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        Ok(Self {
            ms: ms.parse().map_err(|_| bad())?,
            n: n.parse().map_err(|_| bad())?,
        })
    }
}

/// `STAGE_VISION` → `vision` (`unspecified` for a value the protos do not name): the names the
/// API, the logs and the spans give stages.
pub fn stage_name(stage: i32) -> &'static str {
    match Stage::try_from(stage).unwrap_or(Stage::Unspecified) {
        Stage::Unspecified => "unspecified",
        Stage::Queued => "queued",
        Stage::Vision => "vision",
        Stage::Rule => "rule",
        Stage::Answer => "answer",
        Stage::Reward => "reward",
        Stage::Done => "done",
    }
}

/// `EVENT_STATUS_STARTED` → `started` (`unspecified` for a value the protos do not name).
pub fn status_name(status: i32) -> &'static str {
    match EventStatus::try_from(status).unwrap_or(EventStatus::Unspecified) {
        EventStatus::Unspecified => "unspecified",
        EventStatus::Started => "started",
        EventStatus::Progress => "progress",
        EventStatus::Delta => "delta",
        EventStatus::Completed => "completed",
        EventStatus::Failed => "failed",
        EventStatus::Restarted => "restarted",
    }
}

/// `JOB_STATUS_RUNNING` → `running` (`unspecified` for a value the protos do not name).
pub fn job_status_name(status: i32) -> &'static str {
    match JobStatus::try_from(status).unwrap_or(JobStatus::Unspecified) {
        JobStatus::Unspecified => "unspecified",
        JobStatus::Queued => "queued",
        JobStatus::Running => "running",
        JobStatus::Succeeded => "succeeded",
        JobStatus::Failed => "failed",
    }
}

/// Whether `ev` is a job's final event (stage `done`): nothing follows it.
pub fn is_final(ev: &ScanEvent) -> bool {
    ev.stage == Stage::Done as i32
}

#[cfg(test)]
mod tests;
