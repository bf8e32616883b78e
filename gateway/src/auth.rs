//! Who is calling: JWT bearer tokens (HS256 with a shared secret, or RS256/ES256 from an OIDC
//! provider's JWKS), and — for local use only — a trusted `X-User-Id` header.
//!
//! A verified token's `sub` is the user; a configurable claim grants the `admin` role. The
//! gateway forwards the caller to the services in `x-user-id` (and `x-user-roles: admin`)
//! metadata: inside, that is the only place a user comes from.
//!
//! `EventSource` cannot send headers, so the SSE routes also take the token from an
//! `access_token` query parameter or an `ecoscan_token` cookie (never logged: spans record the
//! path only).

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    extract::{FromRequestParts, MatchedPath},
    http::{header, request::Parts},
};
use jsonwebtoken::{Algorithm, DecodingKey, Validation, jwk::JwkSet};
use serde::Deserialize;
use serde_json::Value;

use crate::{AppState, error::ApiError};

/// Header naming the acting user when the header is trusted (local use).
pub const USER_HEADER: &str = "x-user-id";
/// Header granting roles when the user header is trusted (`admin`).
pub const ROLES_HEADER: &str = "x-user-roles";
/// Cookie an `EventSource` may carry the token in.
pub const TOKEN_COOKIE: &str = "ecoscan_token";
/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;
/// The JWKS is fetched again after this long, or at once for an unknown `kid` — but never more
/// often than [`JWKS_MIN_REFRESH`], so unknown `kid`s cannot make the gateway hammer the
/// provider.
const JWKS_MAX_AGE: Duration = Duration::from_secs(10 * 60);
const JWKS_MIN_REFRESH: Duration = Duration::from_secs(30);
const JWKS_FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the `X-User-Id` header is believed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrustHeader {
    /// Believed when the gateway listens on loopback only (the default).
    Auto,
    /// Never.
    Off,
    /// Believed, but the gateway refuses to start on a non-loopback address.
    Loopback,
    /// Believed on any address (anyone can be anyone: for a gateway behind a proxy that sets
    /// the header itself).
    Force,
}

impl std::str::FromStr for TrustHeader {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Self::Auto),
            "false" | "off" | "no" | "0" => Ok(Self::Off),
            "true" | "on" | "yes" | "1" => Ok(Self::Loopback),
            "force" => Ok(Self::Force),
            other => Err(format!("{other:?} is not one of auto, true, false, force")),
        }
    }
}

/// Authentication settings (see the gateway's `Config` for the variables).
#[derive(Clone, Debug)]
pub struct AuthConfig {
    /// HS256 shared secret (`GATEWAY_JWT_SECRET`).
    pub hs256_secret: Option<String>,
    /// An OIDC provider's JWKS URL for RS256/ES256 tokens (`GATEWAY_JWKS_URL`).
    pub jwks_url: Option<String>,
    /// Required `iss` (`GATEWAY_JWT_ISSUER`), when set.
    pub issuer: Option<String>,
    /// Required `aud` (`GATEWAY_JWT_AUDIENCE`), when set.
    pub audience: Option<String>,
    /// The claim that grants `admin` (`GATEWAY_JWT_ADMIN_CLAIM`): admin when it equals
    /// `admin_value`, is `true`, or is a list holding `admin_value`.
    pub admin_claim: String,
    pub admin_value: String,
    /// `GATEWAY_TRUST_USER_HEADER`.
    pub trust_header: TrustHeader,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            hs256_secret: None,
            jwks_url: None,
            issuer: None,
            audience: None,
            admin_claim: "roles".into(),
            admin_value: "admin".into(),
            trust_header: TrustHeader::Auto,
        }
    }
}

impl AuthConfig {
    fn has_tokens(&self) -> bool {
        self.hs256_secret.is_some() || self.jwks_url.is_some()
    }

    /// Whether the user header is believed by a gateway listening on `addr`; an error (saying
    /// what to set) when this configuration must not run there.
    pub fn header_trusted(&self, loopback: bool, addr: &str) -> anyhow::Result<bool> {
        match (self.trust_header, loopback) {
            (TrustHeader::Force, _) => {
                tracing::warn!(%addr, "X-User-Id is trusted from anyone (GATEWAY_TRUST_USER_HEADER=force)");
                Ok(true)
            }
            (TrustHeader::Off, _) => Ok(false),
            (TrustHeader::Auto | TrustHeader::Loopback, true) => Ok(true),
            (TrustHeader::Loopback, false) => anyhow::bail!(
                "GATEWAY_TRUST_USER_HEADER=true lets anyone act as anyone, and the gateway listens \
                 on {addr}, beyond this machine: use JWT authentication (GATEWAY_JWT_SECRET or \
                 GATEWAY_JWKS_URL), or set GATEWAY_TRUST_USER_HEADER=force if a proxy in front \
                 sets X-User-Id itself"
            ),
            (TrustHeader::Auto, false) if self.has_tokens() => Ok(false),
            (TrustHeader::Auto, false) => anyhow::bail!(
                "the gateway listens on {addr}, beyond this machine, without authentication: set \
                 GATEWAY_JWT_SECRET (HS256) or GATEWAY_JWKS_URL (RS256/ES256 from your identity \
                 provider), or GATEWAY_TRUST_USER_HEADER=force if a proxy in front authenticates \
                 and sets X-User-Id"
            ),
        }
    }
}

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
    #[error("this needs the admin role")]
    Forbidden,
    /// A trusted `X-User-Id` that is not a user id: the request is malformed (400), not
    /// unauthenticated.
    #[error("X-User-Id must be 1-128 characters of letters, digits and _.@|:+-")]
    BadUserHeader,
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

/// Verifies tokens and tells who calls.
pub struct Authenticator {
    config: AuthConfig,
    header_trusted: bool,
    default_user: String,
    jwks: Option<Jwks>,
}

/// An OIDC provider's keys, cached.
struct Jwks {
    url: String,
    http: reqwest::Client,
    state: tokio::sync::Mutex<JwksState>,
}

#[derive(Default)]
struct JwksState {
    keys: HashMap<String, (Algorithm, DecodingKey)>,
    fetched: Option<Instant>,
}

impl Jwks {
    /// The key for `kid`, fetching the set when it is stale or the `kid` is unknown (at most
    /// every [`JWKS_MIN_REFRESH`]).
    async fn key(&self, kid: &str) -> Result<(Algorithm, DecodingKey), AuthError> {
        let mut state = self.state.lock().await;
        let stale = state.fetched.is_none_or(|t| t.elapsed() > JWKS_MAX_AGE);
        let unknown = !state.keys.contains_key(kid);
        let may_refresh = state.fetched.is_none_or(|t| t.elapsed() > JWKS_MIN_REFRESH);
        if (stale || unknown) && may_refresh {
            match self.fetch().await {
                Ok(keys) => {
                    state.keys = keys;
                    state.fetched = Some(Instant::now());
                }
                Err(e) => {
                    tracing::warn!(error = %e, url = %self.url, "cannot fetch the JWKS");
                    // Do not retry on every request while the provider is down.
                    state.fetched = Some(Instant::now());
                }
            }
        }
        state
            .keys
            .get(kid)
            .cloned()
            .ok_or_else(|| AuthError::Invalid(format!("no key {kid:?} in the provider's key set")))
    }

    async fn fetch(&self) -> anyhow::Result<HashMap<String, (Algorithm, DecodingKey)>> {
        let set: JwkSet = self
            .http
            .get(&self.url)
            .timeout(JWKS_FETCH_TIMEOUT)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let mut keys = HashMap::new();
        for jwk in &set.keys {
            let Some(kid) = jwk.common.key_id.clone() else {
                continue;
            };
            let alg = match &jwk.algorithm {
                jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => Algorithm::RS256,
                jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => Algorithm::ES256,
                _ => continue,
            };
            match DecodingKey::from_jwk(jwk) {
                Ok(key) => {
                    keys.insert(kid, (alg, key));
                }
                Err(e) => tracing::warn!(kid, error = %e, "skipping an unusable JWKS key"),
            }
        }
        Ok(keys)
    }
}

impl Authenticator {
    /// An authenticator for a gateway whose header trust was decided at start.
    pub fn new(
        config: AuthConfig,
        header_trusted: bool,
        default_user: String,
    ) -> anyhow::Result<Self> {
        let jwks = match &config.jwks_url {
            Some(url) => Some(Jwks {
                url: url.clone(),
                http: reqwest::Client::builder()
                    .redirect(reqwest::redirect::Policy::none())
                    .build()?,
                state: tokio::sync::Mutex::default(),
            }),
            None => None,
        };
        Ok(Self {
            config,
            header_trusted,
            default_user,
            jwks,
        })
    }

    fn validation(&self, alg: Algorithm) -> Validation {
        let mut v = Validation::new(alg);
        v.leeway = LEEWAY_SECS;
        v.validate_nbf = true;
        v.set_required_spec_claims(&["exp", "sub"]);
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
            .map_err(|e| AuthError::Invalid(format!("malformed token ({e})")))?;
        let (alg, key) = match header.alg {
            Algorithm::HS256 => {
                let secret = self.config.hs256_secret.as_ref().ok_or_else(|| {
                    AuthError::Invalid("HS256 tokens are not accepted here".into())
                })?;
                let key = DecodingKey::from_secret(secret.as_bytes())
                    .map_err(|e| AuthError::Invalid(format!("unusable secret ({e})")))?;
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
            .map_err(|e| AuthError::Invalid(e.to_string()))?;
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

    /// The caller of a request: its bearer token (or, on the SSE routes, the token in the
    /// query or cookie), else the trusted header, else nobody.
    pub async fn caller(&self, parts: &Parts, sse_route: bool) -> Result<Caller, AuthError> {
        if let Some(token) = bearer(parts).or_else(|| sse_route.then(|| sse_token(parts)).flatten())
        {
            return self.verify(&token).await;
        }
        if !self.header_trusted {
            return Err(AuthError::Missing);
        }
        let user = match parts.headers.get(USER_HEADER) {
            None => self.default_user.clone(),
            Some(v) => {
                let v = v.to_str().unwrap_or_default();
                if !ecoscan_common::identity::valid_user_id(v) {
                    return Err(AuthError::BadUserHeader);
                }
                v.to_owned()
            }
        };
        let admin = parts
            .headers
            .get(ROLES_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|roles| roles.split(',').any(|r| r.trim() == "admin"));
        Ok(Caller { user, admin })
    }
}

fn bearer(parts: &Parts) -> Option<String> {
    let value = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_owned())
}

/// The token an `EventSource` can carry: `?access_token=` or the `ecoscan_token` cookie.
fn sse_token(parts: &Parts) -> Option<String> {
    let from_query = parts.uri.query().and_then(|q| {
        q.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (k == "access_token" && !v.is_empty()).then(|| v.to_owned())
        })
    });
    from_query.or_else(|| {
        parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .find_map(|c| {
                let (k, v) = c.trim().split_once('=')?;
                (k == TOKEN_COOKIE && !v.is_empty()).then(|| v.to_owned())
            })
    })
}

/// The routes an `EventSource` reads, which may carry the token outside the headers.
fn is_sse_route(parts: &Parts) -> bool {
    parts.extensions.get::<MatchedPath>().is_some_and(|p| {
        matches!(
            p.as_str(),
            "/api/v1/scan/{id}/events" | "/api/v1/notifications/stream"
        )
    })
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let caller = state
            .auth
            .caller(parts, is_sse_route(parts))
            .await
            .map_err(|e| match e {
                AuthError::BadUserHeader => ApiError::InvalidArgument(e.to_string()),
                e => ApiError::Auth(e),
            })?;
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
            Err(ApiError::Auth(AuthError::Forbidden))
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
mod tests {
    use super::*;

    fn config(trust: TrustHeader, secret: bool) -> AuthConfig {
        AuthConfig {
            hs256_secret: secret.then(|| "x".repeat(32)),
            trust_header: trust,
            ..AuthConfig::default()
        }
    }

    #[test]
    fn the_user_header_is_believed_on_loopback_only_unless_forced() {
        use TrustHeader::*;
        // (mode, has a token key, loopback) -> trusted, or refused at start.
        for (mode, tokens, loopback, expect) in [
            (Auto, false, true, Some(true)),
            (Auto, true, true, Some(true)),
            (Auto, true, false, Some(false)),
            (Auto, false, false, None),
            (Loopback, false, true, Some(true)),
            (Loopback, true, false, None),
            (Off, false, true, Some(false)),
            (Off, true, false, Some(false)),
            (Force, false, false, Some(true)),
        ] {
            let got = config(mode, tokens).header_trusted(loopback, "192.0.2.1:8080");
            match expect {
                Some(trusted) => assert_eq!(got.unwrap(), trusted, "{mode:?} {tokens} {loopback}"),
                None => {
                    let e = got.expect_err("must refuse to start").to_string();
                    assert!(
                        e.contains("GATEWAY_JWT_SECRET") && e.contains("192.0.2.1:8080"),
                        "the refusal says what to set: {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn trust_modes_parse_and_bad_ones_are_named() {
        assert_eq!("".parse::<TrustHeader>(), Ok(TrustHeader::Auto));
        assert_eq!("TRUE".parse::<TrustHeader>(), Ok(TrustHeader::Loopback));
        assert_eq!("off".parse::<TrustHeader>(), Ok(TrustHeader::Off));
        assert_eq!("force".parse::<TrustHeader>(), Ok(TrustHeader::Force));
        assert!(
            "always"
                .parse::<TrustHeader>()
                .unwrap_err()
                .contains("always")
        );
    }

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut req = axum::http::Request::builder().uri(uri);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn tokens_come_from_the_bearer_header_or_for_sse_the_query_and_cookie() {
        let p = parts("/x", &[("authorization", "bearer abc")]);
        assert_eq!(bearer(&p).as_deref(), Some("abc"));
        assert_eq!(
            bearer(&parts("/x", &[("authorization", "Basic abc")])),
            None
        );
        let p = parts(
            "/x?a=1&access_token=q1",
            &[("cookie", "a=b; ecoscan_token=c1")],
        );
        assert_eq!(sse_token(&p).as_deref(), Some("q1"));
        let p = parts("/x?access_token=", &[("cookie", "a=b; ecoscan_token=c1")]);
        assert_eq!(sse_token(&p).as_deref(), Some("c1"));
        assert_eq!(sse_token(&parts("/x", &[("cookie", "other=1")])), None);
    }

    #[tokio::test]
    async fn minted_tokens_verify_and_carry_the_admin_role() {
        let secret = "s".repeat(40);
        let auth = Authenticator::new(
            AuthConfig {
                hs256_secret: Some(secret.clone()),
                issuer: Some("iss".into()),
                audience: Some("aud".into()),
                ..AuthConfig::default()
            },
            false,
            "local".into(),
        )
        .unwrap();
        let ttl = Duration::from_secs(60);
        let t = mint(&secret, "alice", false, "iss", "aud", ttl).unwrap();
        assert_eq!(
            auth.verify(&t).await.unwrap(),
            Caller {
                user: "alice".into(),
                admin: false
            }
        );
        let t = mint(&secret, "root", true, "iss", "aud", ttl).unwrap();
        assert!(auth.verify(&t).await.unwrap().admin);
        let t = mint(&secret, "alice", false, "other", "aud", ttl).unwrap();
        assert!(matches!(auth.verify(&t).await, Err(AuthError::Invalid(_))));
        assert!(mint(&secret, "not a user", false, "iss", "aud", ttl).is_err());
    }
}
