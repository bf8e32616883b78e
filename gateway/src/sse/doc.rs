//! The SSE responses as the OpenAPI document describes them: a `text/event-stream` response's
//! `schema` is the schema of one event (its `event` name, `id`, and `data` as a JSON string whose
//! `contentSchema` is the payload's schema), as OpenAPI 3.2 says of `itemSchema` and as OpenAPI
//! 3.1 tools that validate streams (Schemathesis) read `schema`. The response's description
//! lists the events.
//!
//! These sit with the payloads they describe (`EventData`, `StreamErrorData`, `ResyncData`)
//! rather than in `crate::schema`, whose field schemas the payloads use: so `schema` stays a
//! leaf, and a new kind of event is documented where it is sent.

use serde_json::{Value, json};
use utoipa::{
    ToResponse, ToSchema,
    openapi::{
        self, ContentBuilder, RefOr, ResponseBuilder,
        extensions::Extensions,
        schema::{ObjectBuilder, OneOfBuilder, Schema, Type},
    },
};

use super::{EventData, NOTIFICATION_EVENT, StreamErrorData, resync::ResyncData};
use crate::{event::Kind, schema::proto};

/// A `data:` JSON string described by `content` (JSON Schema's `contentMediaType` and
/// `contentSchema`).
fn json_data(content: Value) -> Schema {
    let mut data = ObjectBuilder::new()
        .schema_type(Type::String)
        .content_media_type("application/json")
        .description(Some("The event's payload: one line of JSON."))
        .build();
    // utoipa has no `contentSchema`; its extensions are written as they are given.
    data.extensions = Some(Extensions::from_iter([("contentSchema", content)]));
    Schema::Object(data)
}

fn schema_ref(name: impl Into<String>) -> Value {
    json!({"$ref": format!("#/components/schemas/{}", name.into())})
}

/// One SSE event: its `event:` name, its optional `id:`, and its `data:` JSON.
fn sse_event(name: &str, description: &str, data: Value, id: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .title(Some(format!("event: {name}")))
        .description(Some(description))
        .property(
            "event",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some([name])),
        )
        .required("event")
        .property(
            "id",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some(id)),
        )
        .property("data", json_data(data))
        .required("data")
        .into()
}

/// A `text/event-stream` 200 response whose events are `events`: `(name, what it means, data
/// schema name(s))`.
fn sse_response(intro: &str, events: &[(&str, &str, Value, &str)]) -> RefOr<openapi::Response> {
    let mut description = format!(
        "{intro}\n\nA `text/event-stream` of these events (a `: keepalive` comment after each \
         `GATEWAY_SSE_KEEPALIVE` of silence, 15 s by default, in between):\n"
    );
    let mut one_of = OneOfBuilder::new();
    for (name, meaning, data, _) in events {
        let refs = data_schema_names(data);
        description.push_str(&format!("\n- `event: {name}`: {meaning} `data`: {refs}."));
    }
    for (name, meaning, data, id) in events {
        one_of = one_of.item(sse_event(name, meaning, data.clone(), id));
    }
    ResponseBuilder::new()
        .description(description)
        .content(
            "text/event-stream",
            ContentBuilder::new()
                .schema(Some(Schema::OneOf(one_of.build())))
                .build(),
        )
        .build()
        .into()
}

/// The schemas a data schema refers to, as a description names them.
fn data_schema_names(data: &Value) -> String {
    let mut names = Vec::new();
    collect_refs(data, &mut names);
    names
        .iter()
        .map(|n| format!("[`{n}`](#/components/schemas/{n})"))
        .collect::<Vec<_>>()
        .join(" or ")
}

fn collect_refs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref")
                && let Some(name) = r.strip_prefix("#/components/schemas/")
            {
                out.push(name.to_owned());
            }
            map.values().for_each(|v| collect_refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

/// The 200 response of the scan event streams (`POST /api/v1/scan/completion`,
/// `GET /api/v1/scan/{id}/events`).
pub(crate) struct ScanEvents;

impl<'r> ToResponse<'r> for ScanEvents {
    fn response() -> (&'r str, RefOr<openapi::Response>) {
        let event_id = "The event's id in the job's log (`<milliseconds>-<sequence>`): send it \
                        back as `Last-Event-ID` to resume after it.";
        let scan = || schema_ref(EventData::name());
        let events = Kind::ALL.map(|kind| match kind {
            Kind::Stage => (
                kind.name(),
                "A stage started, progressed, completed (with its output: `classification`, \
                 `rules`, `answer` or `reward`) or failed (with `error`).",
                scan(),
                event_id,
            ),
            Kind::Delta => (
                kind.name(),
                "A piece of the answer text, in `delta`, that goes at `offset` (code points): \
                 keep that much of your text and append it. A stage event `restarted` starts \
                 the text again.",
                scan(),
                event_id,
            ),
            Kind::Ready => (
                kind.name(),
                "The job succeeded; `result_url` is its result. The stream ends.",
                scan(),
                event_id,
            ),
            Kind::Error => (
                kind.name(),
                "The job failed (a scan event with `error`), or the stream itself failed (no \
                 `id`; reconnect with the last id to resume). The stream ends.",
                json!({"anyOf": [scan(), schema_ref(StreamErrorData::name())]}),
                "Present when the job failed, absent when the stream failed.",
            ),
            Kind::Resync => (
                kind.name(),
                "A gap the job's log can no longer fill (events trimmed or lost, the log \
                 expired, or `Last-Event-ID` past its end): read `result_url` for the job's \
                 state and go on with the events that follow.",
                schema_ref(ResyncData::name()),
                "Where the stream goes on; absent when the log has expired.",
            ),
        });
        (
            "ScanEvents",
            sse_response(
                "The job's events as Server-Sent Events, until `ready` or `error` (or the \
                 stream's lifetime, 30 minutes by default: reconnect with `Last-Event-ID`).",
                &events,
            ),
        )
    }
}

/// The 200 response of `GET /api/v1/notifications/stream`.
pub(crate) struct NotificationEvents;

impl<'r> ToResponse<'r> for NotificationEvents {
    fn response() -> (&'r str, RefOr<openapi::Response>) {
        (
            "NotificationEvents",
            sse_response(
                "The caller's notifications as they are delivered, as Server-Sent Events. The \
                 stream stays open (up to its lifetime, 30 minutes by default; an `EventSource` \
                 reconnects by itself).",
                &[
                    (
                        NOTIFICATION_EVENT,
                        "A notification was delivered.",
                        schema_ref(proto::Notification::name()),
                        "The notification's id.",
                    ),
                    (
                        Kind::Error.name(),
                        "The stream failed; it ends.",
                        schema_ref(StreamErrorData::name()),
                        "Absent.",
                    ),
                ],
            ),
        )
    }
}
