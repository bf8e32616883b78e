//! `event: resync`: a gap in a job's events that its log can no longer fill, said to the client
//! instead of skipped, with what the client needs to act on it.

use ecoscan_proto::v1::{Resync, ResyncReason};
use serde::Serialize;

/// The `data:` of a `resync` event.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = ResyncData)]
pub(crate) struct ResyncData<'a> {
    /// The job (a UUID).
    pub(crate) job_id: &'a str,
    /// The position the client resumed from (its `Last-Event-ID`, or the last event it was
    /// sent); empty when it read from the start.
    pub(crate) after_event_id: &'a str,
    /// The position the stream goes on after, also the event's SSE `id:`: the events that
    /// follow come after it. Empty (and no `id:`) when the job's log has expired.
    #[schema(pattern = r"^([0-9]{1,20}-[0-9]{1,20})?$")]
    pub(crate) event_id: &'a str,
    /// The `seq` of `event_id`; 0 when it is empty.
    pub(crate) seq: u64,
    /// Why the log cannot fill the gap: `events_lost` (trimmed, or lost with the store's
    /// data), `log_expired` (only the result remains) or `past_end` (the resume id is past the
    /// log's end: an id this job never sent, or one from before its log lost its data).
    #[schema(schema_with = reason_schema)]
    pub(crate) reason: String,
    /// The same, for a person.
    pub(crate) message: &'a str,
    /// The job's result (`GET` it): the state to take instead of what the missed events
    /// would have said, answer text included.
    pub(crate) result_url: String,
}

/// `RESYNC_REASON_EVENTS_LOST` → `events_lost`.
pub(crate) fn reason_name(reason: i32) -> String {
    ResyncReason::try_from(reason)
        .unwrap_or(ResyncReason::Unspecified)
        .as_str_name()
        .trim_start_matches("RESYNC_REASON_")
        .to_ascii_lowercase()
}

fn reason_schema() -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    let names: Vec<String> = (1..)
        .map_while(|i| {
            ResyncReason::try_from(i)
                .ok()
                .map(|r| reason_name(r as i32))
        })
        .collect();
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(names))
        .description(Some("Why the log cannot fill the gap."))
        .build()
        .into()
}

/// The `data:` JSON of `resync`.
pub(crate) fn json(resync: &Resync, result_url: &dyn Fn(&str) -> String) -> String {
    super::to_json(&ResyncData {
        job_id: &resync.job_id,
        after_event_id: &resync.after_event_id,
        event_id: &resync.event_id,
        seq: resync.seq,
        reason: reason_name(resync.reason),
        message: &resync.message,
        result_url: result_url(&resync.job_id),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resync_names_its_reason_and_the_result_to_read() {
        let r = Resync {
            job_id: "job".into(),
            after_event_id: "1700000000000-4".into(),
            event_id: "1700000000000-9".into(),
            seq: 9,
            reason: ResyncReason::EventsLost as i32,
            message: "gone".into(),
        };
        let v: serde_json::Value =
            serde_json::from_str(&json(&r, &|id| format!("/api/v1/scan/{id}"))).unwrap();
        assert_eq!(v["reason"], "events_lost");
        assert_eq!(v["result_url"], "/api/v1/scan/job");
        assert_eq!(v["event_id"], "1700000000000-9");
        assert_eq!(v["seq"], 9);
        assert_eq!(reason_name(ResyncReason::PastEnd as i32), "past_end");
        assert_eq!(reason_name(99), "unspecified");
    }
}
