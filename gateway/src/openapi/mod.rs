//! The OpenAPI 3.1 document of the HTTP edge, served at `GET /api/v1/openapi.json`.
//!
//! - **Operations** come from `#[utoipa::path]` on the handlers, listed in [`ApiDoc`]; the router
//!   serves exactly [`crate::ROUTES`], and tests hold the document to that list.
//! - **The gateway's own bodies** (errors, the answers to a scan, SSE payloads, probes) derive
//!   `ToSchema` where they are defined; what the handlers name beside them (error responses,
//!   the forms of a scan, short names) is in `crate::schema`.
//! - **The protobuf messages the gateway passes through** as proto3 JSON (a scan result,
//!   notifications, characters, usage) are described from the descriptor set the protos compile
//!   to, comments included (`crate::schema::proto`), so the document follows the protos without
//!   a copy of them.
//! - **Server-Sent Events**: a `text/event-stream` response's `schema` is the schema of one event
//!   (`crate::sse::doc`), and the response's description lists the events.
//! - **Credentials** depend on the gateway ([`security`]): the bearer token always (and, on the
//!   SSE routes, a ticket in `?ticket=` or the token in the `ecoscan_token` cookie);
//!   in header mode the `X-User-Id` header too (and `X-User-Roles` with `force`).
//!
//! Nothing imports this module but the router: it names the handlers, never the other way round.

mod security;

use axum::{body::Bytes, extract::State, http::header, response::IntoResponse};
use utoipa::{
    OpenApi,
    openapi::{self, Components},
};

use crate::{
    auth,
    config::TrustHeader,
    error::{ErrorBody, ErrorJson, FieldError},
    routes,
    schema::{
        self, BadRequest, Forbidden, GatewayTimeout, Internal, NotFound, PayloadTooLarge,
        RequestTimeout, TooManyRequests, Unauthorized, Unavailable, UnsupportedMediaType,
    },
    sse::{
        EventData, StreamErrorData,
        doc::{NotificationEvents, ScanEvents},
        resync::ResyncData,
    },
};

/// The document, less what depends on the running gateway (see [`document`]).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "ecoscan gateway",
        description = "The HTTP edge of ecoscan: submit a photo of waste, follow its scan as \
                       Server-Sent Events, read the result, the characters it earned and the \
                       notifications it sent. Every error answer is an RFC 9457 problem \
                       (`application/problem+json`, `ErrorBody`): `type`, `title`, `status`, \
                       `detail`, `instance` (the trace), and `code`, `reason` (the same reasons \
                       gRPC callers get), `message` and `retryable`; `Retry-After` accompanies \
                       429 and most 503 answers.",
        license(name = "MIT", identifier = "MIT"),
    ),
    paths(
        routes::index,
        routes::scan::submit,
        routes::scan::completion,
        routes::scan::result,
        routes::scan::events,
        routes::catalogue::categories,
        routes::catalogue::characters,
        routes::account::characters,
        routes::catalogue::character,
        routes::account::notifications,
        routes::account::schedule,
        routes::account::notification_stream,
        routes::account::usage,
        routes::uploads::create,
        routes::uploads::put,
        auth::tickets::sse_ticket,
        routes::health::healthz,
        serve,
    ),
    components(
        schemas(ErrorBody, ErrorJson, FieldError, EventData, StreamErrorData, ResyncData),
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
    for (name, schema) in schema::proto::components() {
        components.schemas.entry(name).or_insert(schema);
    }
    security::add_schemes(components, header);
    if header != TrustHeader::Off {
        security::offer_trusted_header(&mut doc, header);
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
