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

/// `STAGE_VISION` → `vision` (`unspecified` for a value the protos do not name).
pub fn stage_name(stage: i32) -> String {
    Stage::try_from(stage)
        .unwrap_or(Stage::Unspecified)
        .as_str_name()
        .trim_start_matches("STAGE_")
        .to_ascii_lowercase()
}

/// `EVENT_STATUS_STARTED` → `started` (`unspecified` for a value the protos do not name).
pub fn status_name(status: i32) -> String {
    EventStatus::try_from(status)
        .unwrap_or(EventStatus::Unspecified)
        .as_str_name()
        .trim_start_matches("EVENT_STATUS_")
        .to_ascii_lowercase()
}

/// `JOB_STATUS_RUNNING` → `running` (`unspecified` for a value the protos do not name).
pub fn job_status_name(status: i32) -> String {
    JobStatus::try_from(status)
        .unwrap_or(JobStatus::Unspecified)
        .as_str_name()
        .trim_start_matches("JOB_STATUS_")
        .to_ascii_lowercase()
}

/// Whether `ev` is a job's final event (stage `done`): nothing follows it.
pub fn is_final(ev: &ScanEvent) -> bool {
    ev.stage == Stage::Done as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ids_print_parse_and_order_as_numbers() {
        let id: EventId = "1732950000000-12".parse().unwrap();
        assert_eq!(
            id,
            EventId {
                ms: 1_732_950_000_000,
                n: 12
            }
        );
        assert_eq!(id.to_string(), "1732950000000-12");
        let earlier: EventId = "1732950000000-9".parse().unwrap();
        assert!(earlier < id, "9 comes before 12, whatever the text says");
        assert!(id < "1732950000001-0".parse().unwrap());
    }

    #[test]
    fn malformed_event_ids_are_refused_with_the_expected_form() {
        for bad in [
            "",
            "12",
            "-1",
            "1-",
            "a-1",
            "1-2-3",
            "+1-2",
            "1 -2",
            "99999999999999999999-0",
        ] {
            let e = bad.parse::<EventId>().unwrap_err();
            assert_eq!(
                e,
                format!(
                    "event id {bad:?} is malformed; expected <milliseconds>-<sequence>, e.g. \
                     1732950000000-0"
                )
            );
        }
    }

    #[test]
    fn an_event_id_of_a_job_takes_the_jobs_uuidv7_time() {
        // 0x0193a5b00000 ms: the timestamp field of this UUIDv7.
        let id = EventId::of("0193a5b0-0000-7000-8000-000000000000", 7);
        assert_eq!(
            id,
            EventId {
                ms: 0x0193_a5b0_0000,
                n: 7
            }
        );
        assert_eq!(EventId::of("not-a-uuid", 3), EventId { ms: 0, n: 3 });
        assert_eq!(
            EventId::of("7f8e2a9c-1d2b-4c3d-8e9f-0a1b2c3d4e5f", 1).ms,
            0,
            "a UUIDv4 has no time"
        );
    }

    #[test]
    fn well_formed_ids_have_two_runs_of_at_most_twenty_digits() {
        assert!(EventId::is_well_formed("1718000000000-0"));
        assert!(EventId::is_well_formed("1-12"));
        assert!(EventId::is_well_formed("99999999999999999999-0"));
        for bad in [
            "1718000000000",
            "abc-1",
            "1-",
            "-1",
            "1-2-3",
            "+1-2",
            "123456789012345678901-0",
        ] {
            assert!(!EventId::is_well_formed(bad), "{bad}");
        }
    }

    #[test]
    fn names_are_short_and_lowercase_and_only_done_is_final() {
        assert_eq!(stage_name(Stage::Vision as i32), "vision");
        assert_eq!(stage_name(Stage::Done as i32), "done");
        assert_eq!(status_name(EventStatus::Completed as i32), "completed");
        assert_eq!(status_name(99), "unspecified");
        assert_eq!(job_status_name(JobStatus::Running as i32), "running");
        let ev = |stage: Stage| ScanEvent {
            stage: stage as i32,
            ..ScanEvent::default()
        };
        assert!(is_final(&ev(Stage::Done)));
        assert!(!is_final(&ev(Stage::Reward)));
    }
}
