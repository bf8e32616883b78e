//! The OpenAPI 3.1 document of the HTTP edge, served at `GET /api/v1/openapi.json`.
//!
//! - **Operations** come from `#[utoipa::path]` on the handlers, listed in [`ApiDoc`]; the router
//!   serves exactly [`crate::ROUTES`], and tests hold the document to that list.
//! - **The gateway's own bodies** (errors, the answers to a scan, SSE payloads, probes) derive
//!   `ToSchema` where they are defined.
//! - **The protobuf messages the gateway passes through** as proto3 JSON (a scan result,
//!   notifications, characters, usage) are described from the descriptor set the protos compile
//!   to, comments included ([`proto`]), so the document follows the protos without a copy of them.
//! - **Server-Sent Events**: a `text/event-stream` response's `schema` is the schema of one event
//!   (its `event` name, `id`, and `data` as a JSON string whose `contentSchema` is the payload's
//!   schema), as OpenAPI 3.2 says of `itemSchema` and as OpenAPI 3.1 tools that validate streams
//!   (Schemathesis) read `schema`. The response's description lists the events.
//! - **Credentials** depend on the gateway: the bearer token always (and, on the SSE routes, a
//!   single-use ticket in `?ticket=` or the token in the `ecoscan_token` cookie); in header mode
//!   the `X-User-Id` header too (and `X-User-Roles` with `force`).

use std::collections::BTreeMap;

use axum::{body::Bytes, extract::State, http::header, response::IntoResponse};
use serde_json::{Value, json};
use utoipa::{
    OpenApi, PartialSchema, ToResponse, ToSchema,
    openapi::{
        self, Components, ContentBuilder, HeaderBuilder, Ref, RefOr, ResponseBuilder,
        extensions::Extensions,
        schema::{
            AdditionalProperties, AllOfBuilder, ObjectBuilder, OneOfBuilder, Schema, SchemaFormat,
            Type,
        },
        security::{
            ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
        },
    },
};

use crate::{
    auth::TrustHeader,
    error::{ErrorBody, ErrorJson},
    routes::{self, scan::job_status_name},
    sse::{self, EventData, Kind, StreamErrorData, resync::ResyncData},
};

/// Security scheme: `Authorization: Bearer <JWT>`.
pub(crate) const BEARER: &str = "bearerAuth";
/// Security scheme: a single-use ticket in `?ticket=` (SSE routes only).
pub(crate) const QUERY_TICKET: &str = "sseTicket";
/// Security scheme: the token in the `ecoscan_token` cookie (SSE routes only).
pub(crate) const COOKIE_TOKEN: &str = "tokenCookie";
/// Security scheme: the trusted `X-User-Id` header (only where the gateway trusts it).
pub(crate) const USER_HEADER: &str = "userHeader";
/// Security scheme: the trusted `X-User-Roles` header (only where the gateway trusts it).
pub(crate) const ROLES_HEADER: &str = "rolesHeader";
/// The role `GET /api/v1/analytics/usage` needs, as its security requirements name it.
pub(crate) const ADMIN_ROLE: &str = "admin";

/// The document, less what depends on the running gateway (see [`document`]).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "ecoscan gateway",
        description = "The HTTP edge of ecoscan: submit a photo of waste, follow its scan as \
                       Server-Sent Events, read the result, the characters it earned and the \
                       notifications it sent. Every error answer is JSON `{\"code\", \"message\"}` \
                       (`ErrorBody`); `Retry-After` accompanies 429 and most 503 answers.",
        license(name = "MIT", identifier = "MIT"),
    ),
    paths(
        routes::index,
        routes::scan::submit,
        routes::scan::completion,
        routes::scan::result,
        routes::scan::events,
        routes::account::characters,
        routes::account::notifications,
        routes::account::schedule,
        routes::account::notification_stream,
        routes::account::usage,
        crate::auth::tickets::sse_ticket,
        routes::health::healthz,
        serve,
    ),
    components(
        schemas(ErrorBody, ErrorJson, EventData, StreamErrorData, ResyncData),
        responses(
            BadRequest,
            Unauthorized,
            Forbidden,
            NotFound,
            RequestTimeout,
            PayloadTooLarge,
            UnsupportedMediaType,
            TooManyRequests,
            Internal,
            Unavailable,
            GatewayTimeout,
            ScanEvents,
            NotificationEvents,
        ),
    ),
    tags(
        (name = "scans", description = "Submit photos and follow their scans."),
        (name = "account", description = "The caller's characters, notifications and usage."),
        (name = "operations", description = "Liveness, this document and the demo page."),
    ),
)]
pub(crate) struct ApiDoc;

/// The document a gateway serves; `header` says whether (and how) it believes `X-User-Id`.
pub(crate) fn document(header: TrustHeader) -> openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    let components = doc.components.get_or_insert_with(Components::new);
    for (name, schema) in proto_components() {
        components.schemas.entry(name).or_insert(schema);
    }
    add_security_schemes(components, header);
    if header != TrustHeader::Off {
        offer_trusted_header(&mut doc, header);
    }
    doc
}

/// [`document`] as the JSON `GET /api/v1/openapi.json` answers with.
pub(crate) fn render(header: TrustHeader) -> Bytes {
    let doc = document(header);
    Bytes::from(serde_json::to_vec(&doc).expect("an OpenAPI document serializes"))
}

/// `GET /api/v1/openapi.json`.
#[utoipa::path(
    get,
    path = "/api/v1/openapi.json",
    tag = "operations",
    operation_id = "openapi",
    summary = "This document",
    description = "The OpenAPI 3.1 document of the gateway's REST and SSE routes, generated \
                   from the code. No authentication; outside the concurrency limit.",
    responses(
        (status = 200, description = "The document.", content_type = "application/json",
            body = inline(Object)),
    ),
)]
pub(crate) async fn serve(State(doc): State<Bytes>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], doc)
}

fn add_security_schemes(components: &mut Components, header: TrustHeader) {
    components.add_security_scheme(
        BEARER,
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .bearer_format("JWT")
                .description(Some(
                    "A JWT: HS256 signed with the gateway's secret, or RS256/ES256 from the \
                 identity provider's JWKS. `sub` is the user; the admin role comes from a \
                 configurable claim (`roles` containing `admin` by default). `ecoscan token \
                 --user NAME [--admin]` mints one for `ecoscan up`. A missing or refused token \
                 gets 401 with `WWW-Authenticate: Bearer`.",
                ))
                .build(),
        ),
    );
    components.add_security_scheme(
        QUERY_TICKET,
        SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::with_description(
            "ticket",
            "A single-use ticket from `POST /api/v1/sse-tickets`, good for 60 s, for the SSE \
             routes only (an `EventSource` cannot set headers; a token never goes in a URL).",
        ))),
    );
    components.add_security_scheme(
        COOKIE_TOKEN,
        SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
            crate::auth::TOKEN_COOKIE,
            "The bearer token in a cookie, for the SSE routes only (`EventSource` with \
             `withCredentials`).",
        ))),
    );
    if header != TrustHeader::Off {
        components.add_security_scheme(
            USER_HEADER,
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-User-Id",
                "The acting user, believed without proof in header mode \
                 (GATEWAY_TRUST_USER_HEADER): `loopback` believes it from a direct loopback \
                 peer whose request names this gateway in `Host` and carries no forwarding \
                 header; `force` from anyone. 1-128 characters of letters, digits and \
                 `_.@|:+-` (400 otherwise).",
            ))),
        );
    }
    if header == TrustHeader::Force {
        components.add_security_scheme(
            ROLES_HEADER,
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-User-Roles",
                "Roles of the acting user, believed as `X-User-Id` is: `admin` grants the \
                 admin role.",
            ))),
        );
    }
}

/// In header mode every authenticated operation also takes the header; with `force` the admin
/// operation takes `X-User-Roles: admin` too.
fn offer_trusted_header(doc: &mut openapi::OpenApi, header: TrustHeader) {
    for item in doc.paths.paths.values_mut() {
        for op in [&mut item.get, &mut item.post].into_iter().flatten() {
            let Some(security) = op.security.as_mut() else {
                continue;
            };
            let required: Vec<Value> = security
                .iter()
                .map(|r| serde_json::to_value(r).expect("a security requirement serializes"))
                .collect();
            if !required.iter().any(|r| r.get(BEARER).is_some()) {
                continue;
            }
            let admin = required
                .iter()
                .any(|r| r[BEARER].as_array().is_some_and(|s| !s.is_empty()));
            if !admin {
                security.push(SecurityRequirement::new(USER_HEADER, Vec::<String>::new()));
            } else if header == TrustHeader::Force {
                security.push(SecurityRequirement::new(ROLES_HEADER, [ADMIN_ROLE]));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Error responses

/// The JSON error body response most statuses share.
fn error_response(description: &str, headers: &[(&str, &str)]) -> RefOr<openapi::Response> {
    let mut response = ResponseBuilder::new().description(description).content(
        "application/json",
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name(ErrorBody::name())))
            .build(),
    );
    for (name, description) in headers {
        let schema = if *name == "Retry-After" {
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(0))
                .build()
        } else {
            ObjectBuilder::new().schema_type(Type::String).build()
        };
        response = response.header(
            *name,
            HeaderBuilder::new()
                .schema(schema)
                .description(Some(*description))
                .build(),
        );
    }
    response.build().into()
}

/// Error responses, as reusable components the handlers name in `responses(...)`.
macro_rules! error_responses {
    ($($name:ident: $description:expr $(, [$(($header:expr, $header_doc:expr)),*])?;)*) => {$(
        #[doc = concat!("The `", stringify!($name), "` error response.")]
        pub(crate) struct $name;

        impl<'r> ToResponse<'r> for $name {
            fn response() -> (&'r str, RefOr<openapi::Response>) {
                (
                    stringify!($name),
                    error_response($description, &[$($(($header, $header_doc)),*)?]),
                )
            }
        }
    )*};
}

error_responses! {
    BadRequest: "The request is malformed: a path, query or header parameter or a body field \
                 is invalid (`INVALID_ARGUMENT`; the message says which), or a service refused it \
                 as such (`FAILED_PRECONDITION`, `OUT_OF_RANGE`).";
    Unauthorized: "No usable credentials: no token where one is needed, or a token that is \
                   malformed, expired, of the wrong issuer or audience, or not signed by a known \
                   key (`UNAUTHENTICATED`).",
        [("WWW-Authenticate", "`Bearer realm=\"ecoscan\"`, with `error=\"invalid_token\"` when \
                               a token was refused (RFC 6750).")];
    Forbidden: "The caller may not do this: it needs the admin role, or the resource is another \
                user's (`PERMISSION_DENIED`).";
    NotFound: "No such resource, e.g. no job with this id for this caller (`NOT_FOUND`).";
    RequestTimeout: "The request's body arrived too slowly: slower than the minimum rate over a \
                     5 s window, or not within the body deadline (`DEADLINE_EXCEEDED`).";
    PayloadTooLarge: "The body is larger than the gateway takes, or the image is larger than \
                      the image limit (10 MiB by default) (`PAYLOAD_TOO_LARGE`).";
    UnsupportedMediaType: "The body's `Content-Type` is not one this route takes, or the image \
                           is not a JPEG, PNG, GIF or WebP file (`UNSUPPORTED_MEDIA_TYPE`).";
    TooManyRequests: "This caller sent too much too fast (scans and schedules are rate-limited \
                      per user) or holds too many open event streams (`RESOURCE_EXHAUSTED`).",
        [("Retry-After", "Seconds to wait before trying again.")];
    Internal: "Something inside failed; the cause is logged, not returned (`INTERNAL`, \
               `UNKNOWN`, `DATA_LOSS`).";
    Unavailable: "The gateway is at its concurrency limit or a backend is shedding load or \
                  unreachable (`UNAVAILABLE`); try again shortly. `Retry-After` is sent when \
                  load is shed.";
    GatewayTimeout: "A backend did not answer within its deadline (`DEADLINE_EXCEEDED`).";
}

// ---------------------------------------------------------------------------------------------
// Server-Sent Events

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
        "{intro}\n\nA `text/event-stream` of these events (`: keepalive` comments every 15 s \
         in between):\n"
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
                        sse::NOTIFICATION_EVENT,
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

// ---------------------------------------------------------------------------------------------
// Schemas the handlers name

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
                .map(|s| sse::stage_name(s as i32))
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
                .map(|s| sse::status_name(s as i32))
        }),
    )
}

fn short_names(description: &str, names: impl Iterator<Item = String>) -> Schema {
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

/// The JSON form of a scan, as `input::ScanInput` reads `application/json`.
pub(crate) struct ScanJson;

impl PartialSchema for ScanJson {
    fn schema() -> RefOr<Schema> {
        let fields = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "image_url",
                ObjectBuilder::new()
                    .schema_type(nullable_string())
                    .format(Some(SchemaFormat::Custom("uri".into())))
                    .pattern(Some("^https?://"))
                    .max_length(Some(2048))
                    .description(Some(
                        "An absolute http(s) URL of the photo; ingest fetches it (public \
                         addresses only, size and time limited).",
                    )),
            )
            .property(
                "image_base64",
                ObjectBuilder::new()
                    .schema_type(nullable_string())
                    .content_encoding("base64")
                    .description(Some(
                        "The photo's bytes in standard base64 (padding optional), or a \
                         `data:image/...;base64,` URL as browsers make them. JPEG, PNG, GIF or \
                         WebP.",
                    )),
            )
            .property("hint", hint_schema())
            .property("locale", locale_schema())
            .additional_properties(Some(AdditionalProperties::<Schema>::FreeForm(false)))
            .description(Some(
                "A scan as JSON: exactly one of `image_url` and `image_base64` (a `null` is the \
                 same as absent).",
            ))
            .build();
        // A `null` is the same as absent, so "exactly one" counts the non-null values.
        let exactly_one = OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .property("image_url", String::schema())
                    .required("image_url"),
            )
            .item(
                ObjectBuilder::new()
                    .property("image_base64", String::schema())
                    .required("image_base64"),
            )
            .build();
        AllOfBuilder::new()
            .item(fields)
            .item(Schema::OneOf(exactly_one))
            .examples([json!({
                "image_base64": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==",
                "hint": "plastic bottle",
                "locale": "en",
            })])
            .into()
    }
}

impl ToSchema for ScanJson {}

/// A string or `null` (which the gateway reads as absent).
fn nullable_string() -> openapi::schema::SchemaType {
    openapi::schema::SchemaType::from_iter([Type::String, Type::Null])
}

/// The multipart form of a scan, as `input::ScanInput` reads `multipart/form-data`.
pub(crate) struct ScanForm;

impl PartialSchema for ScanForm {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "image",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .content_media_type("application/octet-stream")
                    .description(Some(
                        "The photo, as a file: JPEG, PNG, GIF or WebP (its type is read from \
                         its bytes). Exactly one.",
                    )),
            )
            .required("image")
            .property("hint", hint_schema())
            .property("locale", locale_schema())
            .description(Some(
                "A scan as a form: the photo in `image`; other fields are ignored.",
            ))
            .into()
    }
}

impl ToSchema for ScanForm {}

fn hint_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .max_length(Some(1000))
        .description(Some(
            "What the person thinks it is, e.g. \"plastic bottle\"; at most 1000 characters.",
        ))
        .build()
        .into()
}

fn locale_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(["", "ko", "en"]))
        .description(Some(
            "The answer's language; empty for the default (Korean).",
        ))
        .build()
        .into()
}

// ---------------------------------------------------------------------------------------------
// Protobuf messages passed through as proto3 JSON

/// Schemas of the `ecoscan.v1` messages the gateway answers with as proto3 JSON, read from the
/// descriptor set compiled into `ecoscan-proto` (comments included).
///
/// The JSON is pbjson's, as `ecoscan-proto` configures it: proto field names, every field
/// emitted (scalars and lists at their defaults too, message fields only when set), 64-bit
/// integers as decimal strings, enums as their names, bytes as base64, `Timestamp` as RFC 3339.
pub(crate) mod proto {
    use std::{
        borrow::Cow,
        collections::{BTreeMap, HashMap},
        sync::LazyLock,
    };

    use prost::Message as _;
    use prost_types::{
        DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorSet,
        field_descriptor_proto::{Label, Type as ProtoType},
    };
    use utoipa::{
        PartialSchema, ToSchema,
        openapi::{
            Ref, RefOr,
            schema::{
                AdditionalProperties, ArrayBuilder, KnownFormat, ObjectBuilder, Schema,
                SchemaFormat, Type,
            },
        },
    };

    /// The package the REST API passes messages of.
    const PACKAGE: &str = ".ecoscan.v1.";

    struct Message {
        descriptor: DescriptorProto,
        description: Option<String>,
        /// Each field's description, by field index.
        fields: Vec<Option<String>>,
    }

    #[derive(Default)]
    struct Index {
        messages: HashMap<String, Message>,
        enums: HashMap<String, EnumDescriptorProto>,
    }

    static INDEX: LazyLock<Index> = LazyLock::new(Index::load);

    /// A comment as a one-paragraph description.
    fn clean(comment: &str) -> String {
        comment
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    }

    impl Index {
        fn load() -> Self {
            let set = FileDescriptorSet::decode(ecoscan_proto::FILE_DESCRIPTOR_SET)
                .expect("the descriptor set compiled into ecoscan-proto decodes");
            let mut index = Self::default();
            for file in &set.file {
                let comments: HashMap<Vec<i32>, String> = file
                    .source_code_info
                    .iter()
                    .flat_map(|info| &info.location)
                    .filter_map(|l| Some((l.path.clone(), clean(l.leading_comments.as_ref()?))))
                    .collect();
                let scope = format!(".{}", file.package());
                for (i, m) in file.message_type.iter().enumerate() {
                    index.add_message(&scope, m, vec![4, i as i32], &comments);
                }
                for e in &file.enum_type {
                    index
                        .enums
                        .insert(format!("{scope}.{}", e.name()), e.clone());
                }
            }
            index
        }

        fn add_message(
            &mut self,
            scope: &str,
            m: &DescriptorProto,
            path: Vec<i32>,
            comments: &HashMap<Vec<i32>, String>,
        ) {
            let full = format!("{scope}.{}", m.name());
            for (k, nested) in m.nested_type.iter().enumerate() {
                let mut p = path.clone();
                p.extend([3, k as i32]);
                self.add_message(&full, nested, p, comments);
            }
            for e in &m.enum_type {
                self.enums.insert(format!("{full}.{}", e.name()), e.clone());
            }
            let fields = (0..m.field.len())
                .map(|j| {
                    let mut p = path.clone();
                    p.extend([2, j as i32]);
                    comments.get(&p).cloned()
                })
                .collect();
            self.messages.insert(
                full,
                Message {
                    descriptor: m.clone(),
                    description: comments.get(&path).cloned(),
                    fields,
                },
            );
        }

        /// The schema of message `name` (without package), and the messages it refers to.
        fn schema(&self, name: &str) -> (Schema, Vec<String>) {
            let full = format!("{PACKAGE}{name}");
            let msg = self
                .messages
                .get(&full)
                .unwrap_or_else(|| panic!("no message {full} in the descriptor set"));
            let mut deps = Vec::new();
            let mut object = ObjectBuilder::new()
                .schema_type(Type::Object)
                .description(msg.description.clone());
            for (field, description) in msg.descriptor.field.iter().zip(&msg.fields) {
                let schema = self.field(field, description.clone(), &mut deps);
                object = object.property(field.name(), schema);
                if always_emitted(field) {
                    object = object.required(field.name());
                }
            }
            (object.build().into(), deps)
        }

        fn field(
            &self,
            field: &FieldDescriptorProto,
            description: Option<String>,
            deps: &mut Vec<String>,
        ) -> RefOr<Schema> {
            if field.label() == Label::Repeated {
                if let Some(entry) = self.map_entry(field) {
                    let value = &entry.field[1];
                    let values = self.single(value, None, deps);
                    return ObjectBuilder::new()
                        .schema_type(Type::Object)
                        .additional_properties(Some(AdditionalProperties::RefOr(values)))
                        .description(description)
                        .into();
                }
                let items = self.single(field, None, deps);
                return ArrayBuilder::new()
                    .items(items)
                    .description(description)
                    .into();
            }
            self.single(field, description, deps)
        }

        fn map_entry(&self, field: &FieldDescriptorProto) -> Option<&DescriptorProto> {
            if field.r#type() != ProtoType::Message {
                return None;
            }
            let entry = &self.messages.get(field.type_name())?.descriptor;
            entry
                .options
                .as_ref()
                .is_some_and(|o| o.map_entry())
                .then_some(entry)
        }

        /// One value of `field`, as pbjson writes it.
        fn single(
            &self,
            field: &FieldDescriptorProto,
            description: Option<String>,
            deps: &mut Vec<String>,
        ) -> RefOr<Schema> {
            let object = |t: Type| ObjectBuilder::new().schema_type(t);
            let builder = match field.r#type() {
                ProtoType::Double | ProtoType::Float => object(Type::Number),
                ProtoType::Int32 | ProtoType::Sint32 | ProtoType::Sfixed32 => object(Type::Integer)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int32))),
                ProtoType::Uint32 | ProtoType::Fixed32 => object(Type::Integer)
                    .minimum(Some(0))
                    .maximum(Some(u32::MAX)),
                // 64-bit integers are decimal strings in proto3 JSON.
                ProtoType::Int64 | ProtoType::Sint64 | ProtoType::Sfixed64 => {
                    object(Type::String).pattern(Some("^-?[0-9]+$"))
                }
                ProtoType::Uint64 | ProtoType::Fixed64 => {
                    object(Type::String).pattern(Some("^[0-9]+$"))
                }
                ProtoType::Bool => object(Type::Boolean),
                ProtoType::String => object(Type::String),
                ProtoType::Bytes => object(Type::String).content_encoding("base64"),
                ProtoType::Enum => {
                    let names: Vec<String> = self
                        .enums
                        .get(field.type_name())
                        .map(|e| e.value.iter().map(|v| v.name().to_owned()).collect())
                        .unwrap_or_default();
                    object(Type::String).enum_values(Some(names))
                }
                ProtoType::Message | ProtoType::Group => match field.type_name() {
                    ".google.protobuf.Timestamp" => object(Type::String)
                        .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))),
                    name => {
                        let short = name.strip_prefix(PACKAGE).unwrap_or(name).to_owned();
                        deps.push(short.clone());
                        let mut r = Ref::from_schema_name(short);
                        r.description = description.unwrap_or_default();
                        return r.into();
                    }
                },
            };
            builder.description(description).into()
        }

        /// `(name, schema)` of every message `roots` refer to, directly or not, roots excluded.
        fn dependencies(&self, roots: &[String], out: &mut Vec<(String, RefOr<Schema>)>) {
            let mut seen: BTreeMap<String, ()> = roots.iter().map(|r| (r.clone(), ())).collect();
            let mut todo: Vec<String> = Vec::new();
            for root in roots {
                if self.messages.contains_key(&format!("{PACKAGE}{root}")) {
                    todo.extend(self.schema(root).1);
                }
            }
            while let Some(name) = todo.pop() {
                if seen.insert(name.clone(), ()).is_some() {
                    continue;
                }
                let (schema, deps) = self.schema(&name);
                out.push((name, schema.into()));
                todo.extend(deps);
            }
        }
    }

    /// Whether pbjson always writes `field` (it does, with `emit_fields`, unless the field is a
    /// message, part of a `oneof` or `optional`).
    fn always_emitted(field: &FieldDescriptorProto) -> bool {
        field.label() == Label::Repeated
            || (field.r#type() != ProtoType::Message
                && field.oneof_index.is_none()
                && !field.proto3_optional())
    }

    /// The schema of message `name` of `ecoscan.v1`, for the patches the gateway makes.
    pub(super) fn message(name: &str) -> Schema {
        INDEX.schema(name).0
    }

    /// What `name`'s schema refers to, for [`ToSchema::schemas`].
    pub(super) fn dependencies(name: &str, out: &mut Vec<(String, RefOr<Schema>)>) {
        INDEX.dependencies(&[name.to_owned()], out);
    }

    macro_rules! messages {
        ($($name:ident),* $(,)?) => {$(
            #[doc = concat!("The proto3 JSON of `ecoscan.v1.", stringify!($name), "`.")]
            pub(crate) struct $name;

            impl PartialSchema for $name {
                fn schema() -> RefOr<Schema> {
                    message(stringify!($name)).into()
                }
            }

            impl ToSchema for $name {
                fn name() -> Cow<'static, str> {
                    Cow::Borrowed(stringify!($name))
                }

                fn schemas(out: &mut Vec<(String, RefOr<Schema>)>) {
                    dependencies(stringify!($name), out);
                }
            }
        )*};
    }

    messages!(
        Classification,
        DisposalRules,
        Answer,
        RewardDecision,
        Notification,
        ListOwnedResponse,
        ListResponse,
        UsageResponse,
    );
}

/// A finished scan (`GET /api/v1/scan/{id}`, 200): the proto3 JSON of `ScanResult`, with
/// `status` and `stage` as short names and `error` in the shape SSE errors have (see
/// `routes::scan::result_json`).
pub(crate) struct ScanResult;

impl PartialSchema for ScanResult {
    fn schema() -> RefOr<Schema> {
        let mut schema = proto::message("ScanResult");
        if let Schema::Object(object) = &mut schema {
            object
                .properties
                .insert("status".into(), job_status_schema().into());
            object
                .properties
                .insert("stage".into(), stage_schema().into());
            let mut error = Ref::from_schema_name(ErrorJson::name());
            error.description = "Set when the job failed.".into();
            object.properties.insert("error".into(), error.into());
        }
        schema.into()
    }
}

impl ToSchema for ScanResult {
    fn schemas(out: &mut Vec<(String, RefOr<Schema>)>) {
        proto::dependencies("ScanResult", out);
        out.retain(|(name, _)| name != "ErrorInfo");
        out.push((ErrorJson::name().into_owned(), ErrorJson::schema()));
    }
}

/// Schema references for fields whose types the document describes from the protos.
pub(crate) mod refs {
    use utoipa::{ToSchema, openapi::Ref};

    use super::proto;

    pub(crate) fn classification() -> Ref {
        Ref::from_schema_name(proto::Classification::name())
    }

    pub(crate) fn disposal_rules() -> Ref {
        Ref::from_schema_name(proto::DisposalRules::name())
    }

    pub(crate) fn answer() -> Ref {
        Ref::from_schema_name(proto::Answer::name())
    }

    pub(crate) fn reward_decision() -> Ref {
        Ref::from_schema_name(proto::RewardDecision::name())
    }
}

/// Every proto message schema the document needs beside those the handlers' bodies bring.
pub(crate) fn proto_components() -> BTreeMap<String, RefOr<Schema>> {
    let mut out = Vec::new();
    for (name, schema) in [
        (
            proto::Classification::name(),
            proto::Classification::schema(),
        ),
        (proto::DisposalRules::name(), proto::DisposalRules::schema()),
        (proto::Answer::name(), proto::Answer::schema()),
        (
            proto::RewardDecision::name(),
            proto::RewardDecision::schema(),
        ),
        (proto::Notification::name(), proto::Notification::schema()),
    ] {
        proto::dependencies(&name, &mut out);
        out.push((name.into_owned(), schema));
    }
    out.into_iter().collect()
}
