//! The error answers, as reusable response components (`#/components/responses/…`) the
//! handlers name in `responses(...)`, and the sets of them most operations share.

use utoipa::{
    IntoResponses, ToResponse, ToSchema,
    openapi::{
        self, ContentBuilder, HeaderBuilder, Ref, RefOr, ResponseBuilder,
        schema::{ObjectBuilder, Type},
    },
};

use crate::error::{ErrorBody, PROBLEM_JSON};

/// The error body response every status shares: an RFC 9457 problem.
fn error_response(description: &str, headers: &[(&str, &str)]) -> RefOr<openapi::Response> {
    let mut response = ResponseBuilder::new().description(description).content(
        PROBLEM_JSON,
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
    NotFound: "No such resource, e.g. no job or direct upload with this id for this caller (`NOT_FOUND`).";
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

/// Sets of the components above that operations name together in `responses(...)`: each
/// variant is the component of the same name at its status. Written once here so a set cannot
/// name a component under another status than the one its variant says.
macro_rules! error_sets {
    ($($(#[$meta:meta])* $set:ident { $($status:literal => $name:ident),* $(,)? })*) => {$(
        $(#[$meta])*
        #[derive(IntoResponses)]
        #[allow(
            dead_code,
            reason = "never built: it only lists responses for `#[utoipa::path]`"
        )]
        pub(crate) enum $set {
            $(
                #[response(status = $status)]
                $name(#[ref_response] $name),
            )*
        }
    )*};
}

error_sets! {
    /// The errors every operation that calls a backend for a caller documents: a request
    /// refused as malformed, no usable credentials, and a failure inside the gateway or behind
    /// it.
    CommonErrors {
        400 => BadRequest,
        401 => Unauthorized,
        500 => Internal,
        503 => Unavailable,
        504 => GatewayTimeout,
    }

    /// What the operations that take a body, and are rate-limited per user, document beside
    /// [`CommonErrors`]: a body too slow, too large or of a type they do not take, and too many
    /// requests.
    BodyErrors {
        408 => RequestTimeout,
        413 => PayloadTooLarge,
        415 => UnsupportedMediaType,
        429 => TooManyRequests,
    }
}
