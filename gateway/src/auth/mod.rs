//! Who is calling: JWT bearer tokens (HS256 with a shared secret, or RS256/ES256 from an OIDC
//! provider's JWKS), SSE tickets (one stream and its reconnects each), and — only when asked for — a trusted `X-User-Id`
//! header ([`header`]). There is no anonymous caller: a request that proves nobody is 401.
//!
//! A verified token's `sub` is the user; a configurable claim grants the `admin` role. The
//! caller is found by the [`authenticate`] middleware before a request's body is read, so an
//! unauthenticated upload costs the gateway its headers only; handlers take it as a [`Caller`].
//! The gateway names the caller to the services in `x-user-id` (and `x-user-roles: admin`)
//! metadata, which its gRPC client turns into a signed identity assertion for the service called
//! (`ecoscan_common::assertion`): inside, a verified assertion is the only place a user comes
//! from.
//!
//! `EventSource` cannot send headers, so the SSE routes also take a ticket (`?ticket=`, from
//! `POST /api/v1/sse-tickets`) or the token in an `ecoscan_token` cookie; never a token in the
//! URL, where proxies and browser histories keep it.

pub mod header;
mod jwks;
pub(crate) mod tickets;
pub(crate) mod uploads;

use std::{net::IpAddr, sync::Arc, time::Duration};

use axum::{
    extract::{FromRequestParts, MatchedPath, Request, State},
    http::{header as http_header, request::Parts},
    middleware::Next,
    response::{IntoResponse, Response},
};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::Value;

pub use header::Peer;

use crate::{
    AppState,
    config::{AuthConfig, TrustHeader},
    error::ApiError,
    limits::IpLimits,
    proxy::ClientAddr,
};

/// Cookie an `EventSource` may carry the token in.
pub const TOKEN_COOKIE: &str = "ecoscan_token";
/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;

/// The authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub user: String,
    pub admin: bool,
}

/// Why a request is not authenticated (401), or not allowed (403).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("authentication required: send `Authorization: Bearer <token>`")]
    Missing,
    #[error("the token is not valid: {0}")]
    Invalid(String),
    /// Header mode is on, but this request may not use it.
    #[error(
        "X-User-Id is not believed for this request ({0}): send `Authorization: Bearer <token>`"
    )]
    HeaderRefused(String),
    /// A token in the URL: refused, so nobody learns to put one there.
    #[error(
        "tokens are not accepted in URLs, where proxies and histories keep them: send \
         `Authorization: Bearer <token>`, or for an EventSource get a ticket from \
         `POST /api/v1/sse-tickets` and open the stream with `?ticket=`"
    )]
    TokenInUrl,
    #[error("this needs the admin role")]
    Forbidden,
    /// A trusted `X-User-Id` that is not a user id: the request is malformed (400), not
    /// unauthenticated.
    #[error("X-User-Id must be 1-128 characters of letters, digits and _.@|:+-")]
    BadUserHeader,
}

/// How a request that is not authenticated is answered: 401 (saying whether a token was
/// refused), 403, or 400 for a trusted header that names no user.
impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Forbidden => Self::Forbidden(e.to_string()),
            AuthError::BadUserHeader => Self::invalid_field("X-User-Id", e.to_string()),
            AuthError::Invalid(_) => Self::Unauthenticated {
                message: e.to_string(),
                invalid_token: true,
            },
            AuthError::Missing | AuthError::HeaderRefused(_) | AuthError::TokenInUrl => {
                Self::Unauthenticated {
                    message: e.to_string(),
                    invalid_token: false,
                }
            }
        }
    }
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

/// Verifies tokens and tickets and tells who calls.
pub struct Authenticator {
    config: AuthConfig,
    jwks: Option<Arc<jwks::Jwks>>,
    tickets: tickets::Tickets,
    uploads: uploads::UploadTokens,
}

impl Authenticator {
    pub fn new(config: AuthConfig) -> anyhow::Result<Self> {
        config.validate()?;
        let jwks = match &config.jwks_url {
            Some(url) => Some(jwks::Jwks::new(
                url.clone(),
                config.jwks_max_age,
                config.jwks_min_refresh,
            )?),
            None => None,
        };
        let tickets = tickets::Tickets::new(config.ticket_secret.as_deref(), config.ticket_resume)?;
        let uploads = uploads::UploadTokens::new(config.ticket_secret.as_deref())?;
        Ok(Self {
            config,
            jwks,
            tickets,
            uploads,
        })
    }

    /// Whether `X-User-Id` may ever be believed (the OpenAPI document says so).
    pub fn header_mode(&self) -> TrustHeader {
        self.config.trust_header
    }

    fn validation(&self, alg: Algorithm) -> Validation {
        let mut v = Validation::new(alg);
        v.leeway = LEEWAY_SECS;
        v.validate_nbf = true;
        // A configured `iss` or `aud` must be present, not only right when present.
        let mut required = vec!["exp", "sub"];
        required.extend(self.config.issuer.as_ref().map(|_| "iss"));
        required.extend(self.config.audience.as_ref().map(|_| "aud"));
        v.set_required_spec_claims(&required);
        match &self.config.issuer {
            Some(iss) => v.set_issuer(&[iss]),
            None => v.iss = None,
        }
        match &self.config.audience {
            Some(aud) => v.set_audience(&[aud]),
            None => v.validate_aud = false,
        }
        v
    }

    /// Verifies `token` and returns its caller.
    pub async fn verify(&self, token: &str) -> Result<Caller, AuthError> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| AuthError::Invalid(ecoscan_common::jwt::refusal(&e)))?;
        let (alg, key) = match header.alg {
            Algorithm::HS256 => {
                let secret = self.config.hs256_secret.as_ref().ok_or_else(|| {
                    AuthError::Invalid("HS256 tokens are not accepted here".into())
                })?;
                let key = DecodingKey::from_secret(secret.as_bytes()).map_err(|e| {
                    tracing::error!(error = %e, "the HS256 secret is not a usable key");
                    AuthError::Invalid("it cannot be checked here".into())
                })?;
                (Algorithm::HS256, key)
            }
            Algorithm::RS256 | Algorithm::ES256 => {
                let jwks = self.jwks.as_ref().ok_or_else(|| {
                    AuthError::Invalid(format!("{:?} tokens are not accepted here", header.alg))
                })?;
                let kid = header
                    .kid
                    .ok_or_else(|| AuthError::Invalid("the token names no key (kid)".into()))?;
                let (alg, key) = jwks.key(&kid).await?;
                if alg != header.alg {
                    return Err(AuthError::Invalid(
                        "the token's algorithm is not its key's".into(),
                    ));
                }
                (alg, key)
            }
            other => {
                return Err(AuthError::Invalid(format!(
                    "algorithm {other:?} is not accepted"
                )));
            }
        };
        let data = jsonwebtoken::decode::<Claims>(token, &key, &self.validation(alg))
            .map_err(|e| AuthError::Invalid(ecoscan_common::jwt::refusal(&e)))?;
        let claims = data.claims;
        if !ecoscan_common::identity::valid_user_id(&claims.sub) {
            return Err(AuthError::Invalid(
                "the token's subject is not a usable user id".into(),
            ));
        }
        let admin = match claims.rest.get(&self.config.admin_claim) {
            Some(Value::Bool(b)) => *b,
            Some(Value::String(s)) => *s == self.config.admin_value,
            Some(Value::Array(items)) => items
                .iter()
                .any(|v| v.as_str() == Some(self.config.admin_value.as_str())),
            _ => false,
        };
        Ok(Caller {
            user: claims.sub,
            admin,
        })
    }

    /// The caller of a request: its bearer token; on the SSE routes a ticket or the token
    /// cookie; in header mode a header it may use; else nobody (401).
    pub async fn caller(&self, parts: &Parts) -> Result<Caller, AuthError> {
        // The gateway's upload URL: its token is its one credential (see [`uploads`]).
        if let Some(upload_id) = upload_route(parts) {
            return self.upload_grant(parts, &upload_id).map(|g| g.caller);
        }
        if let Some(token) = bearer(parts) {
            return self.verify(&token).await;
        }
        if query_param(parts, "access_token").is_some() {
            return Err(AuthError::TokenInUrl);
        }
        if is_sse_route(parts) {
            if let Some(ticket) = query_param(parts, "ticket") {
                return self.tickets.spend(&ticket, parts.uri.path());
            }
            if let Some(token) = token_cookie(parts) {
                return self.verify(&token).await;
            }
        }
        header::identify(self.config.trust_header, parts)?.ok_or(AuthError::Missing)
    }

    /// What the `?token=` of a request to the upload URL of `upload_id` allows.
    pub(crate) fn upload_grant(
        &self,
        parts: &Parts,
        upload_id: &str,
    ) -> Result<uploads::UploadGrant, AuthError> {
        let token = query_param(parts, "token").ok_or_else(|| {
            AuthError::Invalid(
                "an upload URL carries its token in `?token=`; use the whole upload_url that \
                 POST /api/v1/uploads returned"
                    .into(),
            )
        })?;
        self.uploads.check(&token, upload_id)
    }

    /// A token for the gateway's upload URL of `grant`, good until `expires_at`.
    pub(crate) fn issue_upload_token(
        &self,
        grant: &uploads::UploadGrant,
        expires_at: std::time::SystemTime,
    ) -> Result<String, AuthError> {
        self.uploads.issue(grant, expires_at)
    }

    /// An SSE ticket for `caller`, bound to `stream` when one is named.
    pub(crate) fn issue_ticket(
        &self,
        caller: &Caller,
        stream: Option<&str>,
    ) -> Result<String, AuthError> {
        self.tickets.issue(caller, stream)
    }
}

fn bearer(parts: &Parts) -> Option<String> {
    let value = parts
        .headers
        .get(http_header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_owned())
}

fn query_param(parts: &Parts, name: &str) -> Option<String> {
    parts.uri.query().and_then(|q| {
        q.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (k == name && !v.is_empty()).then(|| v.to_owned())
        })
    })
}

/// The token an `EventSource` with credentials can carry: the `ecoscan_token` cookie.
fn token_cookie(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get_all(http_header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == TOKEN_COOKIE && !v.is_empty()).then(|| v.to_owned())
        })
}

/// The routes an `EventSource` reads, which may carry a ticket or the cookie.
fn is_sse_route(parts: &Parts) -> bool {
    parts.extensions.get::<MatchedPath>().is_some_and(|p| {
        matches!(
            p.as_str(),
            "/api/v1/scan/{id}/events" | "/api/v1/notifications/stream"
        )
    })
}

/// The upload id of a request to the gateway's upload URL (`PUT /api/v1/uploads/{id}`).
fn upload_route(parts: &Parts) -> Option<String> {
    let matched = parts.extensions.get::<MatchedPath>()?;
    if matched.as_str() != "/api/v1/uploads/{id}" || parts.method != axum::http::Method::PUT {
        return None;
    }
    parts
        .uri
        .path()
        .strip_prefix("/api/v1/uploads/")
        .map(str::to_owned)
}

/// Whether a route answers without a caller: the page, the API's description, the probes,
/// and anything unmatched (a 404).
fn is_public(route: Option<&str>) -> bool {
    match route {
        // The taxonomy is the same for everyone, and an app shows it before anyone signs in.
        Some(p) => {
            !p.starts_with("/api/v1/")
                || p == "/api/v1/openapi.json"
                || p == "/api/v1/scan/categories"
        }
        None => true,
    }
}

/// Whether `route` is a probe or scrape, which no per-address limit may refuse.
fn is_probe(route: Option<&str>) -> bool {
    matches!(route, Some("/healthz" | "/readyz" | "/metrics"))
}

/// What [`authenticate`] needs.
#[derive(Clone)]
pub(crate) struct Gate {
    pub(crate) auth: SharedAuth,
    pub(crate) per_ip: Arc<IpLimits>,
}

/// Middleware: finds the caller of every API request from its headers alone, before anything
/// reads its body, and refuses it (401, the body unread) when it proves nobody. Requests that
/// prove nobody — to the public routes, or refused — count against their address's limit
/// ([`IpLimits`]), since no user's limit can hold them.
pub(crate) async fn authenticate(State(gate): State<Gate>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    // The client as a trusted proxy names it: the proxy's other clients are not held to this
    // one's limit.
    let ip: Option<IpAddr> = req.extensions().get::<ClientAddr>().map(|c| c.ip);
    let route = route.as_deref();
    if is_public(route) {
        if !is_probe(route)
            && let Some(ip) = ip
            && let Err(e) = gate.per_ip.check(ip)
        {
            return e.into_response();
        }
        return next.run(req).await;
    }
    let (mut parts, body) = req.into_parts();
    match gate.auth.caller(&parts).await {
        Ok(caller) => {
            tracing::Span::current().record("user.id", caller.user.as_str());
            parts.extensions.insert(caller);
            next.run(Request::from_parts(parts, body)).await
        }
        Err(e) => {
            if let Some(ip) = ip
                && let Err(limited) = gate.per_ip.check(ip)
            {
                return limited.into_response();
            }
            let mut res = ApiError::from(e).into_response();
            // The body is never read: tell the client the connection ends with this answer.
            res.headers_mut().insert(
                http_header::CONNECTION,
                http_header::HeaderValue::from_static("close"),
            );
            res
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        // Found by `authenticate` before the body was read; a route it did not cover (none
        // should) authenticates here.
        if let Some(caller) = parts.extensions.get::<Caller>() {
            return Ok(caller.clone());
        }
        let caller = state.auth.caller(parts).await?;
        tracing::Span::current().record("user.id", caller.user.as_str());
        Ok(caller)
    }
}

/// A caller with the admin role (403 for anyone else).
pub struct Admin(pub Caller);

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let caller = Caller::from_request_parts(parts, state).await?;
        if caller.admin {
            Ok(Self(caller))
        } else {
            Err(AuthError::Forbidden.into())
        }
    }
}

/// The metadata the services read the caller from.
pub fn forward<T>(request: &mut tonic::Request<T>, caller: &Caller) {
    if let Ok(v) = caller.user.parse() {
        request
            .metadata_mut()
            .insert(ecoscan_common::USER_ID_HEADER, v);
    }
    if caller.admin {
        request.metadata_mut().insert(
            ecoscan_common::identity::ROLES_HEADER,
            "admin".parse().expect("ascii"),
        );
    }
}

/// Mints a token for local use (`ecoscan token`): HS256 with `secret`, `sub` = `user`.
pub fn mint(
    secret: &str,
    user: &str,
    admin: bool,
    issuer: &str,
    audience: &str,
    ttl: Duration,
) -> anyhow::Result<String> {
    anyhow::ensure!(
        ecoscan_common::identity::valid_user_id(user),
        "user must be 1-128 characters of letters, digits and _.@|:+-"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let mut claims = serde_json::json!({
        "sub": user,
        "iss": issuer,
        "aud": audience,
        "iat": now,
        "nbf": now,
        "exp": now + ttl.as_secs(),
    });
    if admin {
        claims["roles"] = serde_json::json!(["admin"]);
    }
    Ok(jsonwebtoken::encode(
        &jsonwebtoken::Header::new(Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes())?,
    )?)
}

/// Shared between requests.
pub type SharedAuth = Arc<Authenticator>;

/// A request to a service with a deadline, acting for `caller`.
pub fn request<T>(message: T, deadline: Duration, caller: &Caller) -> tonic::Request<T> {
    let mut request = ecoscan_common::client::request(message, deadline);
    forward(&mut request, caller);
    request
}

#[cfg(test)]
mod tests;
