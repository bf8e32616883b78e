//! The document's security schemes, which depend on the gateway: whether (and how) it believes
//! `X-User-Id` decides which schemes there are and which operations take them.

use serde_json::Value;
use utoipa::openapi::{
    self, Components,
    security::{
        ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
    },
};

use crate::{auth::TOKEN_COOKIE, config::TrustHeader};

/// Security scheme: `Authorization: Bearer <JWT>`.
const BEARER: &str = "bearerAuth";
/// Security scheme: a ticket in `?ticket=` (SSE routes only).
const QUERY_TICKET: &str = "sseTicket";
/// Security scheme: the token of the gateway's upload URL (`PUT /api/v1/uploads/{id}` only).
const UPLOAD_TOKEN: &str = "uploadToken";
/// Security scheme: the token in the `ecoscan_token` cookie (SSE routes only).
const COOKIE_TOKEN: &str = "tokenCookie";
/// Security scheme: the trusted `X-User-Id` header (only where the gateway trusts it).
const USER_HEADER: &str = "userHeader";
/// Security scheme: the trusted `X-User-Roles` header (only where the gateway trusts it).
const ROLES_HEADER: &str = "rolesHeader";
/// The role `GET /api/v1/analytics/usage` needs, as its security requirements name it.
const ADMIN_ROLE: &str = "admin";

/// Adds the schemes a gateway in `header` mode offers.
pub(super) fn add_schemes(components: &mut Components, header: TrustHeader) {
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
            "A ticket from `POST /api/v1/sse-tickets` (first use within 60 s, then good for \
             that stream's reconnects), for the SSE routes only (an `EventSource` cannot set \
             headers; a token never goes in a URL).",
        ))),
    );
    components.add_security_scheme(
        UPLOAD_TOKEN,
        SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::with_description(
            "token",
            "The token of an `upload_url` from `POST /api/v1/uploads` (embedded store), for \
             `PUT /api/v1/uploads/{id}` only and its only credential: it names the upload, its \
             owner and the declared type and size, and expires with the upload.",
        ))),
    );
    components.add_security_scheme(
        COOKIE_TOKEN,
        SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
            TOKEN_COOKIE,
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
pub(super) fn offer_trusted_header(doc: &mut openapi::OpenApi, header: TrustHeader) {
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
