//! Identity inside: a service believes only an identity it can verify.
//!
//! A caller's identity travels between services as a short-lived signed assertion in the
//! `x-ecoscan-identity` metadata: a JWT (HS256) naming the user (`sub`), the admin role (`adm`),
//! the ecoscan service that makes the call on its own account (`act`, e.g. `ingest` running a
//! job's stages), the one gRPC service it is for (`aud`, e.g. `ecoscan.v1.NotificationService`),
//! when it was issued (`iat`) and an expiry [`ASSERTION_TTL`] away.
//!
//! Short-lived by rule: no assertion lives longer than [`MAX_LIFETIME`] (5 min). The minting side
//! refuses to sign a longer one ([`sign_for`], `ecoscan token --grpc --ttl`), and every service
//! refuses one without `iat`, one whose `exp - iat` is over the cap, and one issued more than the
//! cap ago, whatever its `exp` says; clocks may differ by [`LEEWAY`] (5 s). It is signed with the key the services share
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

use crate::identity::{ACTOR_HEADER, ROLES_HEADER, USER_ID_HEADER};

/// Metadata key of the assertion.
pub const ASSERTION_HEADER: &str = "x-ecoscan-identity";
/// How long an assertion is good for: long enough for a call to reach its server, short enough
/// that one copied from a log is useless.
pub const ASSERTION_TTL: Duration = Duration::from_secs(60);
/// The longest an assertion may live (`exp - iat`), and the oldest one a service believes.
pub const MAX_LIFETIME: Duration = Duration::from_secs(300);
/// Clock skew tolerated between the signing and the verifying process, on `exp` and `iat`.
pub const LEEWAY: Duration = Duration::from_secs(5);
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    act: Option<String>,
    aud: String,
    #[serde(default)]
    iat: Option<u64>,
    exp: u64,
}

/// Who a verified assertion says calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verified {
    /// The user the call acts for (`sub`).
    pub user: Option<String>,
    /// Whether it carries the admin role (`adm`).
    pub admin: bool,
    /// The ecoscan service making the call on its own account (`act`).
    pub actor: Option<String>,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// An assertion that `user` (or nobody, for a role-only call) with the admin role if `admin`
/// calls the gRPC service `audience`.
pub fn sign(user: Option<&str>, admin: bool, audience: &str) -> String {
    sign_claims(user, admin, None, audience, ASSERTION_TTL)
}

fn sign_claims(
    user: Option<&str>,
    admin: bool,
    actor: Option<&str>,
    audience: &str,
    ttl: Duration,
) -> String {
    let iat = now_secs();
    let claims = Claims {
        sub: user.map(str::to_owned),
        adm: admin,
        act: actor.map(str::to_owned),
        aud: audience.to_owned(),
        iat: Some(iat),
        exp: iat + ttl.as_secs(),
    };
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &keys().encoding)
        .expect("HS256 signing does not fail")
}

/// [`sign`], good for `ttl` (`ecoscan token --grpc`, for a person typing grpcurl commands); an
/// error when `ttl` is over [`MAX_LIFETIME`], which no service would believe.
pub fn sign_for(
    user: Option<&str>,
    admin: bool,
    audience: &str,
    ttl: Duration,
) -> anyhow::Result<String> {
    check_lifetime(ttl)?;
    Ok(sign_claims(user, admin, None, audience, ttl))
}

/// Whether an assertion may live `ttl`: at most [`MAX_LIFETIME`].
pub fn check_lifetime(ttl: Duration) -> anyhow::Result<()> {
    ensure!(
        ttl <= MAX_LIFETIME && !ttl.is_zero(),
        "an identity assertion lives at most {} (asked for {}): services refuse longer ones; \
         mint a new one when it runs out (e.g. `--ttl 5m`, or `-H \"$(ecoscan token --grpc …)\"` \
         on every grpcurl command)",
        spoken(MAX_LIFETIME),
        spoken(ttl),
    );
    Ok(())
}

/// A duration as a person says it: `5 min`, `5000 days`.
fn spoken(d: Duration) -> String {
    match d.as_secs() {
        s if s >= 86_400 && s % 86_400 == 0 => format!("{} days", s / 86_400),
        s if s >= 3_600 && s % 3_600 == 0 => format!("{} h", s / 3_600),
        s if s >= 60 && s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// Who an assertion for `audience` names; why not, when it is not one.
pub fn verify(assertion: &str, audience: &str) -> Result<Verified, String> {
    verify_at(assertion, audience, now_secs())
}

fn verify_at(assertion: &str, audience: &str, now: u64) -> Result<Verified, String> {
    let mut v = Validation::new(Algorithm::HS256);
    v.set_audience(&[audience]);
    v.set_required_spec_claims(&["exp", "aud"]);
    v.leeway = LEEWAY.as_secs();
    let claims = jsonwebtoken::decode::<Claims>(assertion, &keys().decoding, &v)
        .map_err(|e| refused(audience, &crate::jwt::refusal(&e), e.kind()))?
        .claims;
    let (cap, leeway) = (MAX_LIFETIME.as_secs(), LEEWAY.as_secs());
    let short_lived = match claims.iat {
        None => Err("it carries no `iat` claim (when it was issued)".to_owned()),
        Some(iat) if iat > now + leeway => {
            Err("it was issued in the future (the clocks differ)".to_owned())
        }
        Some(iat) if claims.exp.saturating_sub(iat) > cap => Err(format!(
            "it lives {} s, longer than the {cap} s an assertion may",
            claims.exp.saturating_sub(iat)
        )),
        Some(iat) if now.saturating_sub(iat) > cap + leeway => Err(format!(
            "it was issued {} s ago, more than the {cap} s an assertion lives",
            now.saturating_sub(iat)
        )),
        Some(_) => Ok(()),
    };
    short_lived.map_err(|why| {
        refused(
            audience,
            &why,
            &jsonwebtoken::errors::ErrorKind::ExpiredSignature,
        )
    })?;
    // The user id itself is checked by the service that reads it (`identity::caller`), with the
    // same answer whoever signed it.
    Ok(Verified {
        user: claims.sub,
        admin: claims.adm,
        actor: claims.act,
    })
}

/// Why an assertion for `audience` is refused, and what to do, in plain words.
fn refused(audience: &str, why: &str, kind: &jsonwebtoken::errors::ErrorKind) -> String {
    use jsonwebtoken::errors::ErrorKind;
    let fix = match kind {
        // `why` says already that another key signed it.
        ErrorKind::InvalidSignature => {
            format!("every ecoscan process must share the same {KEY_VAR}")
        }
        _ => format!("mint a fresh one: `ecoscan token --grpc {audience} --user <id>`"),
    };
    format!("the identity assertion ({ASSERTION_HEADER}) is refused: {why}; {fix}")
}

/// The gRPC service a request path names (`/ecoscan.v1.ScanService/Submit` →
/// `ecoscan.v1.ScanService`).
pub fn service_of(path: &str) -> &str {
    path.trim_start_matches('/')
        .split_once('/')
        .map_or("", |(service, _)| service)
}

/// Replaces `x-user-id` / `x-user-roles` / `x-ecoscan-actor` in outgoing `metadata` with an
/// assertion for `service` (the client side).
pub fn attach(metadata: &mut tonic::metadata::MetadataMap, service: &str) {
    let user = metadata
        .remove(USER_ID_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned));
    let admin = metadata
        .remove(ROLES_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned))
        .is_some_and(|roles| roles.split(',').any(|r| r.trim() == "admin"));
    let actor = metadata
        .remove(ACTOR_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned));
    if user.is_none() && !admin && actor.is_none() {
        return;
    }
    let assertion = sign_claims(
        user.as_deref(),
        admin,
        actor.as_deref(),
        service,
        ASSERTION_TTL,
    );
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
        headers.remove(ACTOR_HEADER);
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
                Ok(Verified { user, admin, actor }) => {
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
                    if let Some(v) = actor.and_then(|a| http::HeaderValue::from_str(&a).ok()) {
                        headers.insert(ACTOR_HEADER, v);
                    }
                }
                Err(why) => {
                    tracing::debug!(why, "refusing a call with a bad identity assertion");
                    let status = crate::reasons::status(
                        tonic::Code::Unauthenticated,
                        why,
                        crate::reasons::Reason::IdentityRefused,
                        &[("service", service.clone())],
                        None,
                    );
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
            Ok(Verified {
                user: Some("ann".to_owned()),
                admin: true,
                actor: None
            })
        );
        assert!(verify(&a, "ecoscan.v1.RewardService").is_err());
        assert!(verify("not.an.assertion", "ecoscan.v1.RewardService").is_err());
        let role_only = sign(None, true, "ecoscan.v1.AnalyticsService");
        assert_eq!(
            verify(&role_only, "ecoscan.v1.AnalyticsService"),
            Ok(Verified {
                user: None,
                admin: true,
                actor: None
            })
        );
        // Signed with another key: a token minted elsewhere.
        let forged = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &Claims {
                sub: Some("ann".into()),
                adm: true,
                act: None,
                aud: "ecoscan.v1.NotificationService".into(),
                iat: Some(now_secs()),
                exp: now_secs() + 60,
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

    /// An assertion signed with this process's key, with the claims given.
    fn signed(iat: Option<u64>, exp: u64) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &Claims {
                sub: Some("ann".into()),
                adm: false,
                act: None,
                aud: "ecoscan.v1.RewardService".into(),
                iat,
                exp,
            },
            &keys().encoding,
        )
        .unwrap()
    }

    #[test]
    fn assertions_are_short_lived_by_rule() {
        let aud = "ecoscan.v1.RewardService";
        let now = now_secs();
        let cap = MAX_LIFETIME.as_secs();
        // The minting side: at most the cap.
        let long = sign_for(Some("ann"), false, aud, Duration::from_secs(5000 * 86_400));
        let why = long.unwrap_err().to_string();
        assert!(why.contains("at most 5 min (asked for 5000 days)"), "{why}");
        assert!(sign_for(Some("ann"), false, aud, MAX_LIFETIME).is_ok());
        // The verifying side, whatever the `exp`.
        for (what, assertion, expected) in [
            ("no iat", signed(None, now + 60), "no `iat`"),
            (
                "a lifetime over the cap",
                signed(Some(now), now + 5000 * 86_400),
                "longer than the 300 s",
            ),
            (
                // An older one has expired too, since it lives the cap at most.
                "issued too long ago",
                signed(Some(now - cap - 60), now - 60),
                "it has expired",
            ),
            (
                "issued in the future",
                signed(Some(now + 60), now + 120),
                "in the future",
            ),
        ] {
            let why = verify(&assertion, aud).unwrap_err();
            assert!(why.contains(expected), "{what}: {why}");
            assert!(why.contains("mint a fresh one"), "{what}: {why}");
        }
        // Within the cap and the leeway: believed.
        assert!(verify(&signed(Some(now - 78), now + 60), aud).is_ok());
        assert!(verify(&signed(Some(now - cap), now), aud).is_ok());
        assert!(verify(&signed(Some(now + 3), now + 63), aud).is_ok());
        assert!(verify_at(&signed(Some(now), now + cap), aud, now + cap + 5).is_ok());
        assert!(verify_at(&signed(Some(now), now + cap), aud, now + cap + 6).is_err());
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
            Ok(Verified {
                user: Some("bo".to_owned()),
                admin: false,
                actor: None
            })
        );
        let mut service = tonic::metadata::MetadataMap::new();
        service.insert(ACTOR_HEADER, "ingest".parse().unwrap());
        attach(&mut service, "ecoscan.v1.RewardService");
        let a = service.get(ASSERTION_HEADER).unwrap().to_str().unwrap();
        assert_eq!(
            verify(a, "ecoscan.v1.RewardService")
                .unwrap()
                .actor
                .as_deref(),
            Some("ingest")
        );
        let mut empty = tonic::metadata::MetadataMap::new();
        attach(&mut empty, "ecoscan.v1.RewardService");
        assert!(empty.is_empty());
    }
}
