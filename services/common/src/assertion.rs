//! Identity inside: a service believes only an identity it can verify.
//!
//! A caller's identity travels between services as a short-lived signed assertion in the
//! `x-ecoscan-identity` metadata: a JWT (HS256) naming the user (`sub`), the admin role (`adm`),
//! the one gRPC service it is for (`aud`, e.g. `ecoscan.v1.NotificationService`) and an expiry
//! [`ASSERTION_TTL`] away. It is signed with the key the services share
//! (`ECOSCAN_IDENTITY_KEY`; unset, a key of the process's own, which is what `ecoscan up` and
//! in-process tests run on, and which makes separate processes refuse each other's identities).
//!
//! Code keeps naming the acting user in `x-user-id` / `x-user-roles` metadata
//! ([`crate::client::request_as`], [`crate::client::as_admin`]): the client interceptor
//! ([`crate::client::TraceContext`]) replaces them with an assertion for the service called, and
//! the server layer ([`IdentityLayer`]) drops whatever `x-user-id` / `x-user-roles` a caller sent
//! and sets them again from a verified assertion only. A call with a bad, expired or misdirected
//! assertion is refused with `UNAUTHENTICATED`; a call without one acts for nobody.

use std::{
    sync::OnceLock,
    task::{Context, Poll},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, ensure};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::identity::{ROLES_HEADER, USER_ID_HEADER};

/// Metadata key of the assertion.
pub const ASSERTION_HEADER: &str = "x-ecoscan-identity";
/// How long an assertion is good for: long enough for a call to reach its server, short enough
/// that one copied from a log is useless.
pub const ASSERTION_TTL: Duration = Duration::from_secs(60);
/// The variable holding the shared key.
pub const KEY_VAR: &str = "ECOSCAN_IDENTITY_KEY";

struct Keys {
    encoding: EncodingKey,
    decoding: DecodingKey,
}

static KEYS: OnceLock<Keys> = OnceLock::new();

fn keys_from(secret: &[u8]) -> anyhow::Result<Keys> {
    Ok(Keys {
        encoding: EncodingKey::from_secret(secret).context("unusable identity key")?,
        decoding: DecodingKey::from_secret(secret).context("unusable identity key")?,
    })
}

/// Sets the key this process signs and verifies with (before any call is made or served):
/// `ecoscan up` sets its data directory's. An error when a key is in use already.
pub fn set_key(secret: &str) -> anyhow::Result<()> {
    ensure!(
        secret.len() >= 32,
        "the identity key must be at least 32 bytes"
    );
    KEYS.set(keys_from(secret.as_bytes())?)
        .map_err(|_| anyhow::anyhow!("the identity key is already in use"))
}

/// Checks `ECOSCAN_IDENTITY_KEY` at start (a service binary calls this), so that a bad key stops
/// the start instead of every call.
pub fn check_env() -> anyhow::Result<()> {
    if let Some(secret) = crate::config::env_opt(KEY_VAR) {
        ensure!(
            secret.len() >= 32,
            "{KEY_VAR} must be at least 32 bytes (e.g. `openssl rand -base64 32`), the same in \
             every ecoscan process"
        );
        if let Some(why) = crate::config::placeholder(&secret) {
            anyhow::bail!(
                "{KEY_VAR} looks like a placeholder ({why}): generate one, e.g. `openssl rand \
                 -base64 32`, the same in every ecoscan process"
            );
        }
    }
    Ok(())
}

fn keys() -> &'static Keys {
    KEYS.get_or_init(|| {
        let secret = crate::config::env_opt("ECOSCAN_IDENTITY_KEY")
            .filter(|s| s.len() >= 32)
            .unwrap_or_else(|| {
                format!(
                    "{}{}",
                    uuid::Uuid::new_v4().simple(),
                    uuid::Uuid::new_v4().simple()
                )
            });
        keys_from(secret.as_bytes()).expect("an HS256 key of any bytes")
    })
}

#[derive(Serialize, Deserialize)]
struct Claims {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sub: Option<String>,
    #[serde(default)]
    adm: bool,
    aud: String,
    exp: u64,
}

/// An assertion that `user` (or nobody, for a role-only call) with the admin role if `admin`
/// calls the gRPC service `audience`.
pub fn sign(user: Option<&str>, admin: bool, audience: &str) -> String {
    sign_for(user, admin, audience, ASSERTION_TTL)
}

/// [`sign`], good for `ttl` (`ecoscan token --grpc`, for a person typing grpcurl commands).
pub fn sign_for(user: Option<&str>, admin: bool, audience: &str, ttl: Duration) -> String {
    let exp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
        + ttl.as_secs();
    let claims = Claims {
        sub: user.map(str::to_owned),
        adm: admin,
        aud: audience.to_owned(),
        exp,
    };
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &keys().encoding)
        .expect("HS256 signing does not fail")
}

/// The user and admin role an assertion for `audience` names; why not, when it is not one.
pub fn verify(assertion: &str, audience: &str) -> Result<(Option<String>, bool), String> {
    let mut v = Validation::new(Algorithm::HS256);
    v.set_audience(&[audience]);
    v.set_required_spec_claims(&["exp", "aud"]);
    v.leeway = 5;
    let claims = jsonwebtoken::decode::<Claims>(assertion, &keys().decoding, &v)
        .map_err(|e| refused(audience, &e))?
        .claims;
    // The user id itself is checked by the service that reads it (`identity::caller`), with the
    // same answer whoever signed it.
    Ok((claims.sub, claims.adm))
}

/// Why an assertion for `audience` is refused, and what to do, in plain words.
fn refused(audience: &str, e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind;
    let fix = match e.kind() {
        ErrorKind::InvalidSignature => format!(
            "it was signed with another key than this service's: every ecoscan process must \
             share the same {KEY_VAR}"
        ),
        _ => format!("mint a fresh one: `ecoscan token --grpc {audience} --user <id>`"),
    };
    format!(
        "the identity assertion ({ASSERTION_HEADER}) is refused: {}; {fix}",
        crate::jwt::refusal(e)
    )
}

/// The gRPC service a request path names (`/ecoscan.v1.ScanService/Submit` →
/// `ecoscan.v1.ScanService`).
pub fn service_of(path: &str) -> &str {
    path.trim_start_matches('/')
        .split_once('/')
        .map_or("", |(service, _)| service)
}

/// Replaces `x-user-id` / `x-user-roles` in outgoing `metadata` with an assertion for
/// `service` (the client side).
pub fn attach(metadata: &mut tonic::metadata::MetadataMap, service: &str) {
    let user = metadata
        .remove(USER_ID_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned));
    let admin = metadata
        .remove(ROLES_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned))
        .is_some_and(|roles| roles.split(',').any(|r| r.trim() == "admin"));
    if user.is_none() && !admin {
        return;
    }
    let assertion = sign(user.as_deref(), admin, service);
    if let Ok(v) = assertion.parse() {
        metadata.insert(ASSERTION_HEADER, v);
    }
}

/// The server side: every request's `x-user-id` / `x-user-roles` come from its verified
/// assertion or nowhere.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdentityLayer;

impl<S> tower::Layer<S> for IdentityLayer {
    type Service = Identity<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Identity { inner }
    }
}

#[derive(Clone, Debug)]
pub struct Identity<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for Identity<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        futures::future::Ready<Result<http::Response<R>, S::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let service = service_of(req.uri().path()).to_owned();
        let headers = req.headers_mut();
        // Never believed as sent: only what a verified assertion says.
        headers.remove(USER_ID_HEADER);
        headers.remove(ROLES_HEADER);
        // Health and reflection act for nobody: a tool that sends its assertion on every call
        // (grpcurl's `-H` reaches reflection too) is not refused there.
        if service.starts_with("grpc.") {
            headers.remove(ASSERTION_HEADER);
        }
        if let Some(assertion) = req.headers_mut().remove(ASSERTION_HEADER) {
            let verified = assertion
                .to_str()
                .map_err(|_| {
                    format!(
                        "the identity assertion ({ASSERTION_HEADER}) is refused: it is not ASCII"
                    )
                })
                .and_then(|a| verify(a, &service));
            match verified {
                Ok((user, admin)) => {
                    if let Some(user) = &user {
                        // The RPC's span (the trace layer calls in it).
                        tracing::Span::current().record("user.id", user.as_str());
                    }
                    let headers = req.headers_mut();
                    if let Some(v) = user.and_then(|u| http::HeaderValue::from_str(&u).ok()) {
                        headers.insert(USER_ID_HEADER, v);
                    }
                    if admin {
                        headers.insert(ROLES_HEADER, http::HeaderValue::from_static("admin"));
                    }
                }
                Err(why) => {
                    tracing::debug!(why, "refusing a call with a bad identity assertion");
                    let status = tonic::Status::unauthenticated(why);
                    return futures::future::Either::Right(futures::future::ready(Ok(
                        status.into_http()
                    )));
                }
            }
        }
        futures::future::Either::Left(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assertion_is_good_for_its_service_only() {
        let a = sign(Some("ann"), true, "ecoscan.v1.NotificationService");
        assert_eq!(
            verify(&a, "ecoscan.v1.NotificationService"),
            Ok((Some("ann".to_owned()), true))
        );
        assert!(verify(&a, "ecoscan.v1.RewardService").is_err());
        assert!(verify("not.an.assertion", "ecoscan.v1.RewardService").is_err());
        let role_only = sign(None, true, "ecoscan.v1.AnalyticsService");
        assert_eq!(
            verify(&role_only, "ecoscan.v1.AnalyticsService"),
            Ok((None, true))
        );
        // Signed with another key: a token minted elsewhere.
        let forged = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &Claims {
                sub: Some("ann".into()),
                adm: true,
                aud: "ecoscan.v1.NotificationService".into(),
                exp: u64::MAX / 2,
            },
            &EncodingKey::from_secret(b"someone else's key, 32 bytes long!").unwrap(),
        )
        .unwrap();
        assert!(verify(&forged, "ecoscan.v1.NotificationService").is_err());
    }

    #[test]
    fn a_refused_assertion_is_told_in_plain_words() {
        let a = sign(Some("ann"), false, "ecoscan.v1.NotificationService");
        let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJ4In0.";
        for (assertion, audience, expected) in [
            (a.as_str(), "ecoscan.v1.RewardService", "another audience"),
            (none, "ecoscan.v1.RewardService", "algorithm not accepted"),
            ("x", "ecoscan.v1.RewardService", "not a JWT"),
        ] {
            let why = verify(assertion, audience).unwrap_err();
            assert!(why.contains(expected), "{why}");
            assert!(
                why.contains("ecoscan token --grpc ecoscan.v1.RewardService"),
                "{why}"
            );
            for library in ["InvalidAudience", "JSON error", "variant"] {
                assert!(!why.contains(library), "{why}");
            }
        }
    }

    #[test]
    fn paths_name_their_service() {
        assert_eq!(
            service_of("/ecoscan.v1.ScanService/Submit"),
            "ecoscan.v1.ScanService"
        );
        assert_eq!(service_of("/metrics"), "");
    }

    #[test]
    fn attach_turns_plain_metadata_into_an_assertion() {
        let mut m = tonic::metadata::MetadataMap::new();
        m.insert(USER_ID_HEADER, "bo".parse().unwrap());
        attach(&mut m, "ecoscan.v1.RewardService");
        assert!(m.get(USER_ID_HEADER).is_none());
        let a = m.get(ASSERTION_HEADER).unwrap().to_str().unwrap();
        assert_eq!(
            verify(a, "ecoscan.v1.RewardService"),
            Ok((Some("bo".to_owned()), false))
        );
        let mut empty = tonic::metadata::MetadataMap::new();
        attach(&mut empty, "ecoscan.v1.RewardService");
        assert!(empty.is_empty());
    }
}
