//! The event contract, as rules over what each client saw (its histories) and what the stores
//! hold (the job row in PostgreSQL, every event ever seen in the job's Redis log).
//!
//! Every rule that could be read more than one way is decided in [`RULES`], in one place:
//! which SSE events end a job, the answer-delta rule (offsets in characters or bytes, the
//! `restarted` stage status), what a `resync` event is called, how soon an end must come.

use std::time::{Duration, Instant};

use ecoscan_proto::v1::{JobStatus, ScanEvent, scan_event::Payload};
use serde_json::Value;

pub use super::record::{Connection, EventId, History, Kind, Outcome, Received, Stored, Violation};

/// [`Rules::end_within`], or `HISTORY_END_WITHIN` when set.
fn end_within() -> Duration {
    std::env::var("HISTORY_END_WITHIN")
        .ok()
        .and_then(|v| humantime::parse_duration(v.trim()).ok())
        .unwrap_or(RULES.end_within)
}

/// How offsets on `delta` events count.
#[allow(dead_code)] // One of them is the contract.
#[derive(Clone, Copy, Debug)]
pub enum OffsetUnit {
    Chars,
    Bytes,
}

/// The contract's choices.
pub struct Rules {
    /// The longest a client may wait for the job's end after the job ended, or after the
    /// connection that delivers it began (a resume): "at once". `HISTORY_END_WITHIN` (e.g.
    /// `3s`) overrides it for a machine too busy to tell a late end from a starved test.
    pub end_within: Duration,
    /// The SSE event announcing a gap the log can no longer fill.
    pub resync_event: &'static str,
    /// The field of a `delta` event's data that says where in the answer text it goes.
    pub delta_offset_field: &'static str,
    pub offset_unit: OffsetUnit,
    /// The `stage` event status of a stage that runs again: the client drops what that stage
    /// sent so far (for the answer: its text).
    pub restarted_status: &'static str,
    /// Whether an `error` event without an id (a failed upstream stream, not the job's end)
    /// is tolerated. It is not: a client shows it as the scan failing.
    pub idless_error_tolerated: bool,
    /// Whether a resume with another job's id may be refused with 400 (it is not an id of
    /// this job's log); the client then starts over from the start.
    pub foreign_id_may_be_refused: bool,
    /// Whether the job's end rebuilt from its row, when the final event never reached the
    /// log, may stand at the log's last position (that event's id and seq: a client that saw
    /// that event then gets the end with the same id). It may not: it stands right after the
    /// log's last event, the position the final event takes (the row finishes a moment
    /// before the log takes it), so ids strictly increase.
    pub rebuilt_end_at_last_position: bool,
}

pub const RULES: Rules = Rules {
    end_within: Duration::from_secs(1),
    resync_event: "resync",
    delta_offset_field: "offset",
    offset_unit: OffsetUnit::Chars,
    restarted_status: "restarted",
    idless_error_tolerated: false,
    foreign_id_may_be_refused: true,
    rebuilt_end_at_last_position: false,
};

fn stage_name(stage: i32) -> String {
    ecoscan_proto::v1::Stage::try_from(stage)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("STAGE_")
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

fn status_name(status: i32) -> String {
    ecoscan_proto::v1::EventStatus::try_from(status)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("EVENT_STATUS_")
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

/// Whether what a client got for `id` is what the log holds: same seq, stage, status, text.
fn same_as_logged(got: &Received, logged: &ScanEvent) -> Result<(), String> {
    let seq = got.data["seq"].as_u64().unwrap_or(u64::MAX);
    let stage = got.data["stage"].as_str().unwrap_or_default();
    let status = got.data["status"].as_str().unwrap_or_default();
    let mut diffs = Vec::new();
    if seq != logged.seq {
        diffs.push(format!("seq {seq} (logged {})", logged.seq));
    }
    if stage != stage_name(logged.stage) {
        diffs.push(format!(
            "stage {stage} (logged {})",
            stage_name(logged.stage)
        ));
    }
    if status != status_name(logged.status) {
        diffs.push(format!(
            "status {status} (logged {})",
            status_name(logged.status)
        ));
    }
    if let Some(Payload::Delta(text)) = &logged.payload
        && got.data["delta"].as_str() != Some(text.as_str())
    {
        diffs.push(format!(
            "delta {:?} (logged {text:?})",
            got.data["delta"].as_str()
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(diffs.join(", "))
    }
}

/// The answer text as a client rebuilds it by the documented rule; `None` once it cannot
/// know it (it joined mid-answer, or a gap was announced).
struct AnswerText(Option<String>);

impl AnswerText {
    fn apply(&mut self, ev: &Received) -> Result<(), String> {
        let data = &ev.data;
        if ev.event == RULES.resync_event {
            self.0 = None;
            return Ok(());
        }
        if ev.event == "stage"
            && data["stage"] == "answer"
            && data["status"] == RULES.restarted_status
        {
            self.0 = Some(String::new());
            return Ok(());
        }
        if ev.event != "delta" {
            return Ok(());
        }
        let piece = data["delta"].as_str().unwrap_or_default();
        match data[RULES.delta_offset_field].as_u64() {
            None => {
                if let Some(text) = &mut self.0 {
                    text.push_str(piece);
                }
            }
            Some(offset) => {
                let offset = offset as usize;
                if offset == 0 {
                    self.0 = Some(String::new());
                }
                let Some(text) = &mut self.0 else {
                    return Ok(());
                };
                let cut = match RULES.offset_unit {
                    OffsetUnit::Bytes => {
                        (text.len() >= offset && text.is_char_boundary(offset)).then_some(offset)
                    }
                    OffsetUnit::Chars => match text.char_indices().nth(offset) {
                        Some((i, _)) => Some(i),
                        None => (text.chars().count() == offset).then_some(text.len()),
                    },
                };
                let Some(cut) = cut else {
                    let len = text.chars().count();
                    self.0 = None;
                    return Err(format!(
                        "delta at offset {offset} beyond the {len} characters the client has"
                    ));
                };
                text.truncate(cut);
                text.push_str(piece);
            }
        }
        Ok(())
    }
}

fn in_outage(stored: &Stored, at: Instant) -> bool {
    outage_over(stored, at).is_some()
}

/// When the process outage that `at` falls in (or follows by at most 2 s) was over: a
/// connection that began then could be answered only once the process was back.
fn outage_over(stored: &Stored, at: Instant) -> Option<Instant> {
    stored
        .outages
        .iter()
        .filter(|(from, to)| *from <= at && at <= *to + Duration::from_secs(2))
        .map(|(_, to)| *to)
        .max()
}

/// Checks one client's history against the contract and the stores.
pub fn check(client: &str, h: &History, stored: &Stored) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut v = |rule: &'static str, detail: String| {
        out.push(Violation {
            job: h.job.clone(),
            client: client.to_owned(),
            rule,
            detail,
        });
    };

    // Answers: a malformed id is 400 with a message; a resume at or past the end of a
    // finished job is never a 5xx; no 4xx for a valid resume.
    for c in &h.connections {
        match (&h.kind, &c.outcome) {
            (Kind::Malformed, Outcome::Refused(400, body)) => {
                let message = serde_json::from_str::<Value>(body).ok().and_then(|b| {
                    b["message"]
                        .as_str()
                        .or(b["error"]["message"].as_str())
                        .map(str::to_owned)
                });
                if message.is_none_or(|m| m.trim().is_empty()) {
                    v(
                        "malformed-id-400",
                        format!("400 without a message: {body:?}"),
                    );
                }
            }
            (Kind::Malformed, Outcome::Refused(status, body)) => v(
                "malformed-id-400",
                format!("{:?} answered {status}: {body}", c.after),
            ),
            (Kind::Malformed, Outcome::Streamed { .. }) => v(
                "malformed-id-400",
                format!("{:?} answered 200 with a stream", c.after),
            ),
            (Kind::Malformed, Outcome::Ended) => {
                v("malformed-id-400", format!("{:?} answered 204", c.after))
            }
            (Kind::Malformed, Outcome::NoAnswer(e)) => {
                v("malformed-id-400", format!("{:?}: no answer: {e}", c.after));
            }
            (Kind::AtEnd | Kind::PastEnd | Kind::Expired, Outcome::Refused(status, body))
                if *status >= 500 && !in_outage(stored, c.began) =>
            {
                v(
                    "end-resume-no-5xx",
                    format!(
                        "resume after {:?} at {:.1} s answered {status}: {body}",
                        c.after,
                        c.began.duration_since(stored.run_began).as_secs_f64()
                    ),
                );
            }
            (Kind::ForeignId, Outcome::Refused(400, body))
                if RULES.foreign_id_may_be_refused
                    && c.after == h.first_after
                    && !body.contains("message") =>
            {
                v("foreign-id", format!("400 without a message: {body:?}"));
            }
            (Kind::ForeignId, Outcome::Refused(400, _))
                if RULES.foreign_id_may_be_refused && c.after == h.first_after => {}
            (_, Outcome::Refused(status, body)) if (400..500).contains(status) => v(
                "valid-resume-not-4xx",
                format!("resume after {:?} answered {status}: {body}", c.after),
            ),
            _ => {}
        }
    }
    if h.kind == Kind::Malformed {
        return out;
    }

    // The log's final position: its `done`, else (the final event never reached the log)
    // where an end rebuilt from the row stands: the log's last event, or (by the rules) the
    // position after it, which the final event takes.
    let last_logged = stored.log.keys().filter_map(|id| EventId::parse(id)).max();
    let final_id = stored
        .log
        .values()
        .filter(|e| e.stage == ecoscan_proto::v1::Stage::Done as i32)
        .filter_map(|e| EventId::parse(&e.event_id))
        .max()
        .or_else(|| {
            last_logged.map(|EventId(ms, n)| {
                if RULES.rebuilt_end_at_last_position {
                    EventId(ms, n)
                } else {
                    EventId(ms, n + 1)
                }
            })
        });
    let mut last_id = h.first_after.as_deref().and_then(EventId::parse);
    // Seq continuity: the next event's seq, once the client knows where it is. An id of
    // this job's is `<the job's ms>-<seq>`: a client resuming from one knows its seq.
    let job_ms = stored
        .log
        .keys()
        .filter_map(|id| EventId::parse(id))
        .map(|id| id.0)
        .next();
    let mut next_seq: Option<u64> = match h.first_after.as_deref().map(EventId::parse) {
        None => Some(1),
        Some(Some(EventId(ms, seq))) if Some(ms) == job_ms => Some(seq + 1),
        Some(_) => None,
    };
    let mut text = AnswerText(h.first_after.is_none().then(String::new));
    let mut ends: Vec<&Received> = Vec::new();
    let mut after_end = 0;
    let mut any_event = false;
    for (conn, ev) in h.events() {
        // Its id refused, the client started over: from here on, a client from the start.
        if !any_event && conn.after.is_none() && h.first_after.is_some() {
            last_id = None;
            next_seq = Some(1);
            text = AnswerText(Some(String::new()));
        }
        any_event = true;
        if !ends.is_empty() {
            after_end += 1;
        }
        if let Err(e) = text.apply(ev) {
            v("answer-deltas", e);
        }
        // A resync: the stream goes on after its id (which may be below the client's
        // position: past the end, or from before the log lost its data), its seq next.
        if ev.event == RULES.resync_event {
            let seq = ev.data["seq"].as_u64().unwrap_or(0);
            next_seq = (seq > 0).then_some(seq + 1);
            last_id = ev.id.as_deref().and_then(EventId::parse);
            continue;
        }
        let Some(id_text) = ev.id.as_deref() else {
            if ev.event == "error" && !RULES.idless_error_tolerated {
                v(
                    "one-end",
                    format!(
                        "an `error` without an id (not the job's end) at {:.1} s on the connection \
                         after {:?}: {}",
                        ev.at.duration_since(stored.run_began).as_secs_f64(),
                        conn.after,
                        ev.data["error"]["message"]
                    ),
                );
            }
            continue;
        };
        let Some(id) = EventId::parse(id_text) else {
            v("ids-increase", format!("unparsable id {id_text:?}"));
            continue;
        };
        let seq = ev.data["seq"].as_u64().unwrap_or(0);
        if ev.is_end() {
            ends.push(ev);
        }

        // Ids strictly increase; the end alone may repeat the final id, to a client that
        // resumed at or past it.
        // The end at the log's final position, which the client may have reached already.
        let end_at_final = ev.is_end() && final_id.is_none_or(|f| id == f);
        let repeat_of_end = end_at_final && last_id.is_some_and(|prev| id <= prev);
        if let Some(prev) = last_id
            && id <= prev
            && !repeat_of_end
        {
            v(
                "ids-increase",
                format!("{} {id} after {prev} (seq {seq})", ev.event),
            );
        }
        last_id = Some(last_id.map_or(id, |p| p.max(id)));

        // Every event is one the store holds, or the row's end rebuilt with the log's last seq.
        match stored.log.get(id_text) {
            Some(logged) if ev.is_end() && seq == 0 => v(
                "rebuilt-end-seq",
                format!(
                    "{} {id} carries seq 0; the log's event {id} has seq {}",
                    ev.event, logged.seq
                ),
            ),
            // The row's end standing at the log's final position, whose event is not the
            // `done` (the final event never reached the log): the same seq.
            Some(logged)
                if end_at_final
                    && RULES.rebuilt_end_at_last_position
                    && logged.stage != ecoscan_proto::v1::Stage::Done as i32 =>
            {
                if seq != logged.seq {
                    v(
                        "rebuilt-end-seq",
                        format!(
                            "{} {id} rebuilt from the row carries seq {seq}; the log's last seq is {}",
                            ev.event, logged.seq
                        ),
                    );
                }
            }
            // An end rebuilt from the row, standing at a position of the log that is not
            // its end: it claims an event's id (and seq) that the log gave another event.
            Some(logged)
                if ev.is_end() && logged.stage != ecoscan_proto::v1::Stage::Done as i32 =>
            {
                v(
                    "rebuilt-end-seq",
                    format!(
                        "{} {id} (seq {seq}) rebuilt from the row stands at the log's {} {} \
                         event, not at its end (last seq {})",
                        ev.event,
                        stage_name(logged.stage),
                        status_name(logged.status),
                        stored.last_seq
                    ),
                );
            }
            Some(logged) => {
                if let Err(diff) = same_as_logged(ev, logged) {
                    v(
                        "event-is-stored",
                        format!("{} {id}: differs from the log: {diff}", ev.event),
                    );
                }
            }
            None if ev.is_end() => {
                // Not in the log: the final event never reached it, and the end stands where
                // the rules put it.
                let at = if RULES.rebuilt_end_at_last_position {
                    stored.last_seq
                } else {
                    stored.last_seq + 1
                };
                if seq == 0 || seq != at || !end_at_final {
                    v(
                        "rebuilt-end-seq",
                        format!(
                            "{} {id} rebuilt from the row carries seq {seq}; the log's last seq is {}",
                            ev.event, stored.last_seq
                        ),
                    );
                }
            }
            None => v(
                "event-is-stored",
                format!(
                    "{} {id} (seq {seq}, {} {}) is not in the job's log",
                    ev.event, ev.data["stage"], ev.data["status"]
                ),
            ),
        }

        // No gap skipped: seqs follow each other unless a resync announced the gap. The end
        // repeated at a resume carries the seq the client already has.
        match next_seq {
            // Flagged above as the rebuilt end's seq.
            _ if ev.is_end() && seq == 0 => {}
            _ if repeat_of_end => {}
            Some(want) if seq == want => {}
            Some(want) if seq > want => v(
                "no-silent-gap",
                format!(
                    "{} {id} has seq {seq}; seqs {want}..{} were skipped without a resync",
                    ev.event,
                    seq - 1
                ),
            ),
            Some(want) => v(
                "no-silent-gap",
                format!(
                    "{} {id} has seq {seq}, expected {want} (numbering went back)",
                    ev.event
                ),
            ),
            None => {}
        }
        next_seq = Some(seq + 1);
    }

    // Exactly one end, the last thing sent, equal to the stored status, in time.
    let expected = match stored.status {
        Some(JobStatus::Succeeded) => Some("ready"),
        Some(JobStatus::Failed) => Some("error"),
        _ => None,
    };
    // A 204 says the job ended at or before the client's position: the end it has already.
    let ended = h
        .connections
        .last()
        .filter(|c| matches!(c.outcome, Outcome::Ended));
    match (ends.as_slice(), ended) {
        ([], Some(c)) => {
            let at = c.after.as_deref().and_then(EventId::parse);
            if expected.is_none() {
                v(
                    "one-end",
                    format!("204 after {:?} for a job that has not ended", c.after),
                );
            } else if at.is_none() || final_id.is_some_and(|f| at < Some(f)) {
                v(
                    "one-end",
                    format!(
                        "204 after {:?}, before the job's end {:?}: the client never got it",
                        c.after,
                        final_id.map(|EventId(ms, n)| format!("{ms}-{n}"))
                    ),
                );
            }
        }
        (_, Some(c)) => v(
            "one-end",
            format!("204 after {:?} following an end already sent", c.after),
        ),
        _ => {}
    }
    match ends.as_slice() {
        [] if ended.is_some() => {}
        [] if h.gave_up => v(
            "one-end",
            format!(
                "no end within the client's deadline ({} connections, last after {:?}: {:?})",
                h.connections.len(),
                h.connections.last().and_then(|c| c.after.clone()),
                h.connections.last().map(|c| &c.outcome)
            ),
        ),
        [] => v("one-end", "the client got no end".to_owned()),
        [end] => {
            if after_end > 0 {
                v("one-end", format!("{after_end} events after the end"));
            }
            if Some(end.event.as_str()) != expected {
                v(
                    "end-is-stored-status",
                    format!(
                        "got `{}` ({}), the row says {:?}",
                        end.event, end.data, stored.status
                    ),
                );
            }
            let conn = h
                .events()
                .find(|(_, e)| std::ptr::eq(*e, *end))
                .map(|(c, _)| c.began);
            let back = conn.and_then(|c| outage_over(stored, c));
            let mut since = [stored.ended_at, conn, back].into_iter().flatten().max();
            // An end due while a store did not answer is due once it answers again.
            if let Some(due) = since {
                for (from, to) in &stored.store_outages {
                    if due + end_within() >= *from && due <= *to {
                        since = Some(due.max(*to));
                    }
                }
            }
            if let Some(since) = since {
                let waited = end.at.saturating_duration_since(since);
                if waited > end_within() {
                    v(
                        "end-in-time",
                        format!(
                            "`{}` came {:.1} s after the job ended or the resume began (within {:?} promised)",
                            end.event,
                            waited.as_secs_f64(),
                            end_within()
                        ),
                    );
                }
            }
        }
        more => v(
            "one-end",
            format!(
                "{} ends: {:?}",
                more.len(),
                more.iter()
                    .map(|e| format!("{} {:?}", e.event, e.id))
                    .collect::<Vec<_>>()
            ),
        ),
    }

    // The answer, rebuilt by the delta rule, is the stored one.
    if let (Some(got), Some(want), Some("ready")) = (
        &text.0,
        &stored.answer,
        ends.first().map(|e| e.event.as_str()),
    ) && got != want
    {
        v(
            "answer-deltas",
            format!("the deltas give {got:?}; the stored answer is {want:?}"),
        );
    }
    out
}
