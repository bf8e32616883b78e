//! The pieces of the OpenAPI document that handlers and bodies name: error responses and the
//! sets of them operations share ([`errors`]), what a scan takes and answers with ([`scan`]), the
//! protobuf messages passed through as proto3 JSON ([`proto`]), and the schemas of the short
//! names the JSON uses for stages and statuses.
//!
//! A leaf below the handlers and the SSE payloads, which name these in their attributes: it
//! imports no other gateway module but `error`. The document itself is assembled in `openapi`.

mod errors;
pub(crate) mod proto;
mod scan;

use ecoscan_proto::event::{job_status_name, stage_name, status_name};
use utoipa::openapi::{
    self,
    schema::{ObjectBuilder, Schema, SchemaFormat, Type},
};

pub(crate) use errors::{
    BadRequest, BodyErrors, CommonErrors, Forbidden, GatewayTimeout, Internal, NotFound,
    PayloadTooLarge, RequestTimeout, TooManyRequests, Unauthorized, Unavailable,
    UnsupportedMediaType,
};
pub(crate) use proto::refs;
pub(crate) use scan::{ScanForm, ScanJson, ScanResult};

/// `queued`, `running`, … (`JobStatus` without its prefix, lowercase).
pub(crate) fn job_status_schema() -> Schema {
    short_names(
        "Where the job is: `queued`, `running`, `succeeded` or `failed`.",
        (1..).map_while(|i| {
            ecoscan_proto::v1::JobStatus::try_from(i)
                .ok()
                .map(|s| job_status_name(s as i32))
        }),
    )
}

/// `queued`, `vision`, … (`Stage` without its prefix, lowercase).
pub(crate) fn stage_schema() -> Schema {
    short_names(
        "The stage: `queued`, `vision`, `rule`, `answer`, `reward` or `done`.",
        (1..).map_while(|i| {
            ecoscan_proto::v1::Stage::try_from(i)
                .ok()
                .map(|s| stage_name(s as i32))
        }),
    )
}

/// `started`, `progress`, … (`EventStatus` without its prefix, lowercase).
pub(crate) fn event_status_schema() -> Schema {
    short_names(
        "What happened to the stage: `started`, `progress`, `delta`, `completed`, `failed` \
         or `restarted` (it runs again from its start; answer text starts again).",
        (1..).map_while(|i| {
            ecoscan_proto::v1::EventStatus::try_from(i)
                .ok()
                .map(|s| status_name(s as i32))
        }),
    )
}

fn short_names(description: &str, names: impl Iterator<Item = &'static str>) -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(names.collect::<Vec<_>>()))
        .description(Some(description))
        .build()
        .into()
}

/// An RFC 3339 time, or `null`.
pub(crate) fn nullable_timestamp_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(openapi::schema::SchemaType::from_iter([
            Type::String,
            Type::Null,
        ]))
        .format(Some(SchemaFormat::KnownFormat(
            openapi::schema::KnownFormat::DateTime,
        )))
        .build()
        .into()
}
