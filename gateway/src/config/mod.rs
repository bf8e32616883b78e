//! Gateway configuration from the environment. A leaf: settings import nothing of the modules
//! they configure.

mod auth;
mod proxy;

use anyhow::{Context, ensure};
use ecoscan_common::config::{env_duration, env_opt, env_or};

pub use auth::{AuthConfig, TrustHeader};
#[cfg(test)]
pub(crate) use proxy::parse_trusted;
pub use proxy::{ForwardedHeader, ProxyConfig, ProxyProtocol};

/// Address the binary listens on when `GATEWAY_ADDR` is unset.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8080";

const MIB: usize = 1024 * 1024;

/// What the gateway needs to run. Read by [`Config::from_env`]; every variable is optional:
///
/// | variable | default | meaning |
/// |---|---|---|
/// | `GATEWAY_ADDR` | `127.0.0.1:8080` | listen address (read by the binary, not stored here) |
/// | `INGEST_URL` | `http://127.0.0.1:50051` | `ScanService` |
/// | `RULE_URL` | `http://127.0.0.1:50053` | `RuleService` (the taxonomy, `GET /api/v1/scan/categories`) |
/// | `REWARD_URL` | `http://127.0.0.1:50055` | `RewardService` |
/// | `ANALYTICS_URL` | `http://127.0.0.1:50056` | `AnalyticsService` |
/// | `NOTIFICATION_URL` | `http://127.0.0.1:50057` | `NotificationService` |
/// | `GATEWAY_MAX_IMAGE_BYTES` | `10485760` (10 MiB) | largest image accepted (decoded bytes) |
/// | `GATEWAY_MAX_BODY_BYTES` | 4/3 of the image limit + 64 KiB | largest request body (room for base64 and multipart framing) |
/// | `GATEWAY_CONCURRENCY_LIMIT` | `1024` | requests handled at once before new ones are shed with 503 |
/// | `GATEWAY_PUBLIC_BASE_URL` | unset | prefix for the URLs the gateway hands out (`https://scan.example.com`); relative URLs when unset |
/// | `GATEWAY_SSE_MAX_LIFETIME` | `30m` | longest life of one SSE response; clients reconnect with `Last-Event-ID` |
/// | `GATEWAY_SSE_KEEPALIVE` | `15s` | a `: keepalive` comment after this much silence on an SSE stream (below every proxy's idle timeout) |
/// | `GATEWAY_SSE_TICKET_RESUME` | `1h` | how long a spent SSE ticket stays good for the reconnects of the stream it opened |
/// | `GATEWAY_TRUSTED_PROXIES` | unset | addresses or networks of the proxies in front, whose word about the client's address is taken |
/// | `GATEWAY_TRUSTED_PROXY_HEADER` | `x-forwarded-for` | the header those proxies name the client in: `x-forwarded-for` or `forwarded` |
/// | `GATEWAY_PROXY_PROTOCOL` | `off` | `v2`: connections from a trusted proxy begin with a PROXY protocol v2 header naming the client |
/// | `GATEWAY_JWT_SECRET` | unset | accept HS256 bearer tokens signed with this secret |
/// | `GATEWAY_JWKS_URL` | unset | accept RS256/ES256 bearer tokens signed by a key of this JWKS (an OIDC provider's) |
/// | `GATEWAY_JWT_ISSUER` / `GATEWAY_JWT_AUDIENCE` | unset | required `iss` / `aud` of tokens (both must be set with a JWKS) |
/// | `GATEWAY_JWKS_MAX_AGE` / `GATEWAY_JWKS_MIN_REFRESH` | `10m` / `30s` | a key set is fetched again after this long / never more often than this |
/// | `GATEWAY_SSE_TICKET_SECRET` | unset (derived from `ECOSCAN_IDENTITY_KEY`, else a key per process) | signs SSE tickets; the same on every replica |
/// | `GATEWAY_JWT_ADMIN_CLAIM` / `GATEWAY_JWT_ADMIN_VALUE` | `roles` / `admin` | the claim (and value) that grants the admin role |
/// | `GATEWAY_TRUST_USER_HEADER` | `off` | believe `X-User-Id`: `off`, `loopback` (direct loopback peers naming the listener, no roles), `force` (anyone, with `X-User-Roles`) |
/// | `GATEWAY_SCANS_PER_MINUTE` | `60` | scans one user may submit per minute (burst: as many at once) |
/// | `GATEWAY_SCHEDULES_PER_MINUTE` | `30` | notifications one user may schedule per minute |
/// | `GATEWAY_MAX_SSE_PER_USER` / `GATEWAY_MAX_SSE` | `64` / `16384` | SSE streams open at once per user / in all |
/// | `GATEWAY_MAX_CONNECTIONS` | `16384` | connections open at once; past it new ones wait in the listen backlog |
/// | `GATEWAY_HEADER_TIMEOUT` | `10s` | a request's headers must arrive within this (also how long an idle keep-alive connection stays) |
/// | `GATEWAY_FIRST_BYTE_TIMEOUT` | `5s` | a new connection's first byte must arrive within this |
/// | `GATEWAY_IDLE_TIMEOUT` | `60s` | a connection with no request in flight (HTTP/2 included) is closed after this |
/// | `GATEWAY_H2_KEEPALIVE_INTERVAL` / `GATEWAY_H2_KEEPALIVE_TIMEOUT` | `30s` / `10s` | HTTP/2 pings, and how long an answer may take before the connection is closed |
/// | `GATEWAY_MAX_CONNECTIONS_PER_IP` | `512` | connections open at once from one address (IPv6: one /64); past it new ones are closed |
/// | `GATEWAY_UNAUTHENTICATED_PER_MINUTE` | `300` | requests that prove no user (public routes, refused authentication) one address may make per minute |
/// | `GATEWAY_BODIES_PER_CALLER` | `4` | full-size bodies one caller may have in flight at once (its share of the body budget) |
/// | `GATEWAY_BODY_TIMEOUT` / `GATEWAY_BODY_MIN_RATE` | `60s` / `16384` | a body must arrive within this, and at least this many bytes per second (checked every 5 s) |
/// | `GATEWAY_CORS_ORIGINS` | unset (no CORS) | comma-separated origins allowed to call the API from a browser |
/// | `GATEWAY_JAEGER_URL` | unset | Jaeger UI base URL; the demo page links each scan's trace to `<url>/trace/<trace_id>` |
/// | `GATEWAY_RESULT_CACHE_BYTES` / `GATEWAY_RESULT_CACHE_TTL` | `64MiB` (67108864) / `10m` | succeeded results kept in memory per gateway (bytes) and for how long, served without calling ingest; also their `max-age` |
#[derive(Clone, Debug)]
pub struct Config {
    pub ingest_url: String,
    pub rule_url: String,
    pub reward_url: String,
    pub analytics_url: String,
    pub notification_url: String,
    /// Checked at the edge so that oversized images never travel to ingest.
    pub max_image_bytes: usize,
    /// Bounds the memory one request can take, whatever its content type.
    pub max_body_bytes: usize,
    /// Requests in flight at once; past it the gateway sheds load instead of queueing.
    pub concurrency_limit: usize,
    /// When set, `Location`, `events_url`, `result_url` are absolute URLs under it.
    pub public_base_url: Option<String>,
    /// Every SSE response ends after this long (an `EventSource` reconnects by itself), so no
    /// connection is held forever.
    pub sse_max_lifetime: std::time::Duration,
    /// Silence on an SSE stream longer than this gets a `: keepalive` comment, so that no proxy
    /// between the gateway and the client takes the stream for dead.
    pub sse_keepalive: std::time::Duration,
    pub auth: AuthConfig,
    /// The proxies in front, and how they name the client.
    pub proxies: ProxyConfig,
    pub limits: Limits,
    /// Origins allowed to call the API from a browser (CORS); none by default.
    pub cors_origins: Vec<String>,
    /// Where the demo page links a scan's trace id (a Jaeger UI); no link when unset.
    pub jaeger_url: Option<String>,
    /// Bytes of succeeded results kept for serving again (0: none kept).
    pub result_cache_bytes: u64,
    /// How long a kept result is served (and how long a browser may keep it).
    pub result_cache_ttl: std::time::Duration,
}

/// What one caller, and everyone together, may hold or send.
#[derive(Clone, Debug)]
pub struct Limits {
    pub scans_per_minute: u32,
    pub schedules_per_minute: u32,
    pub max_sse_per_user: usize,
    pub max_sse: usize,
    pub max_connections: usize,
    pub header_timeout: std::time::Duration,
    pub body_timeout: std::time::Duration,
    /// Bytes per second a body must keep up, measured over windows of 5 s.
    pub body_min_rate: u64,
    /// A new connection's first byte must come within this.
    pub first_byte_timeout: std::time::Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: std::time::Duration,
    pub h2_keepalive_interval: std::time::Duration,
    pub h2_keepalive_timeout: std::time::Duration,
    pub max_connections_per_ip: usize,
    pub unauthenticated_per_minute: u32,
    /// Full-size bodies one caller may have in flight at once.
    pub bodies_per_caller: usize,
}

impl Limits {
    /// The `GATEWAY_*` limit variables, falling back to the defaults.
    pub fn from_env() -> anyhow::Result<Self> {
        let d = Self::default();
        Ok(Self {
            scans_per_minute: env_or("GATEWAY_SCANS_PER_MINUTE", d.scans_per_minute)?,
            schedules_per_minute: env_or("GATEWAY_SCHEDULES_PER_MINUTE", d.schedules_per_minute)?,
            max_sse_per_user: env_or("GATEWAY_MAX_SSE_PER_USER", d.max_sse_per_user)?,
            max_sse: env_or("GATEWAY_MAX_SSE", d.max_sse)?,
            max_connections: env_or("GATEWAY_MAX_CONNECTIONS", d.max_connections)?,
            header_timeout: env_duration("GATEWAY_HEADER_TIMEOUT", d.header_timeout)?,
            body_timeout: env_duration("GATEWAY_BODY_TIMEOUT", d.body_timeout)?,
            body_min_rate: env_or("GATEWAY_BODY_MIN_RATE", d.body_min_rate)?,
            first_byte_timeout: env_duration("GATEWAY_FIRST_BYTE_TIMEOUT", d.first_byte_timeout)?,
            idle_timeout: env_duration("GATEWAY_IDLE_TIMEOUT", d.idle_timeout)?,
            h2_keepalive_interval: env_duration(
                "GATEWAY_H2_KEEPALIVE_INTERVAL",
                d.h2_keepalive_interval,
            )?,
            h2_keepalive_timeout: env_duration(
                "GATEWAY_H2_KEEPALIVE_TIMEOUT",
                d.h2_keepalive_timeout,
            )?,
            max_connections_per_ip: env_or(
                "GATEWAY_MAX_CONNECTIONS_PER_IP",
                d.max_connections_per_ip,
            )?,
            unauthenticated_per_minute: env_or(
                "GATEWAY_UNAUTHENTICATED_PER_MINUTE",
                d.unauthenticated_per_minute,
            )?,
            bodies_per_caller: env_or("GATEWAY_BODIES_PER_CALLER", d.bodies_per_caller)?,
        })
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            scans_per_minute: 60,
            schedules_per_minute: 30,
            max_sse_per_user: 64,
            max_sse: 16_384,
            max_connections: 16_384,
            header_timeout: std::time::Duration::from_secs(10),
            body_timeout: std::time::Duration::from_secs(60),
            body_min_rate: 16 * 1024,
            first_byte_timeout: std::time::Duration::from_secs(5),
            idle_timeout: std::time::Duration::from_secs(60),
            h2_keepalive_interval: std::time::Duration::from_secs(30),
            h2_keepalive_timeout: std::time::Duration::from_secs(10),
            max_connections_per_ip: 512,
            unauthenticated_per_minute: 300,
            bodies_per_caller: 4,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        let max_image_bytes = 10 * MIB;
        Self {
            ingest_url: "http://127.0.0.1:50051".to_owned(),
            rule_url: "http://127.0.0.1:50053".to_owned(),
            reward_url: "http://127.0.0.1:50055".to_owned(),
            analytics_url: "http://127.0.0.1:50056".to_owned(),
            notification_url: "http://127.0.0.1:50057".to_owned(),
            max_image_bytes,
            max_body_bytes: default_body_limit(max_image_bytes),
            concurrency_limit: 1024,
            public_base_url: None,
            sse_max_lifetime: std::time::Duration::from_secs(30 * 60),
            sse_keepalive: std::time::Duration::from_secs(15),
            auth: AuthConfig::default(),
            proxies: ProxyConfig::default(),
            limits: Limits::default(),
            cors_origins: Vec::new(),
            jaeger_url: None,
            result_cache_bytes: 64 * MIB as u64,
            result_cache_ttl: std::time::Duration::from_secs(10 * 60),
        }
    }
}

/// Base64 makes an image 4/3 as large; 64 KiB more covers the other fields and multipart framing.
fn default_body_limit(max_image_bytes: usize) -> usize {
    max_image_bytes.saturating_mul(4) / 3 + 64 * 1024
}

impl Config {
    /// Reads the variables listed on [`Config`], falling back to the defaults.
    pub fn from_env() -> anyhow::Result<Self> {
        let config = Self::read_env()?;
        config.validate().context("invalid gateway configuration")?;
        Ok(config)
    }

    /// [`Config::from_env`] without its checks, for a caller that sets the rest itself (the
    /// one-process suite: the services' addresses and the local tokens); the gateway checks
    /// what it is given when it starts.
    pub fn read_env() -> anyhow::Result<Self> {
        let d = Self::default();
        let max_image_bytes = env_or("GATEWAY_MAX_IMAGE_BYTES", d.max_image_bytes)?;
        let config = Self {
            ingest_url: env_or("INGEST_URL", d.ingest_url)?,
            rule_url: env_or("RULE_URL", d.rule_url)?,
            reward_url: env_or("REWARD_URL", d.reward_url)?,
            analytics_url: env_or("ANALYTICS_URL", d.analytics_url)?,
            notification_url: env_or("NOTIFICATION_URL", d.notification_url)?,
            max_image_bytes,
            max_body_bytes: env_or(
                "GATEWAY_MAX_BODY_BYTES",
                default_body_limit(max_image_bytes),
            )?,
            concurrency_limit: env_or("GATEWAY_CONCURRENCY_LIMIT", d.concurrency_limit)?,
            public_base_url: env_opt("GATEWAY_PUBLIC_BASE_URL"),
            sse_max_lifetime: env_duration("GATEWAY_SSE_MAX_LIFETIME", d.sse_max_lifetime)?,
            sse_keepalive: env_duration("GATEWAY_SSE_KEEPALIVE", d.sse_keepalive)?,
            auth: AuthConfig {
                hs256_secret: env_opt("GATEWAY_JWT_SECRET"),
                jwks_url: env_opt("GATEWAY_JWKS_URL"),
                issuer: env_opt("GATEWAY_JWT_ISSUER"),
                audience: env_opt("GATEWAY_JWT_AUDIENCE"),
                admin_claim: env_or("GATEWAY_JWT_ADMIN_CLAIM", d.auth.admin_claim)?,
                admin_value: env_or("GATEWAY_JWT_ADMIN_VALUE", d.auth.admin_value)?,
                trust_header: env_or("GATEWAY_TRUST_USER_HEADER", d.auth.trust_header)?,
                jwks_max_age: env_duration("GATEWAY_JWKS_MAX_AGE", d.auth.jwks_max_age)?,
                jwks_min_refresh: env_duration(
                    "GATEWAY_JWKS_MIN_REFRESH",
                    d.auth.jwks_min_refresh,
                )?,
                // Unset: derived from the identity key when there is one, which every replica
                // shares already, so a ticket works on any of them without another secret.
                ticket_secret: env_opt("GATEWAY_SSE_TICKET_SECRET").or_else(|| {
                    env_opt(ecoscan_common::assertion::KEY_VAR)
                        .filter(|k| k.len() >= 32)
                        .map(|k| format!("ecoscan-sse-ticket/{k}"))
                }),
                ticket_resume: env_duration("GATEWAY_SSE_TICKET_RESUME", d.auth.ticket_resume)?,
            },
            proxies: ProxyConfig {
                trusted: env_opt("GATEWAY_TRUSTED_PROXIES")
                    .map(|v| proxy::parse_trusted(&v))
                    .transpose()?
                    .unwrap_or_default(),
                header: env_or("GATEWAY_TRUSTED_PROXY_HEADER", d.proxies.header)?,
                protocol: env_or("GATEWAY_PROXY_PROTOCOL", d.proxies.protocol)?,
            },
            limits: Limits::from_env()?,
            cors_origins: env_opt("GATEWAY_CORS_ORIGINS")
                .map(|v| {
                    v.split(',')
                        .map(|o| o.trim().to_owned())
                        .filter(|o| !o.is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            jaeger_url: env_opt("GATEWAY_JAEGER_URL"),
            result_cache_bytes: env_or("GATEWAY_RESULT_CACHE_BYTES", d.result_cache_bytes)?,
            result_cache_ttl: env_duration("GATEWAY_RESULT_CACHE_TTL", d.result_cache_ttl)?,
        };
        Ok(config)
    }

    /// Rejects settings the gateway cannot run with.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        ensure!(
            self.max_image_bytes > 0,
            "GATEWAY_MAX_IMAGE_BYTES must be positive"
        );
        ensure!(
            self.max_body_bytes >= self.max_image_bytes,
            "GATEWAY_MAX_BODY_BYTES ({}) must be at least GATEWAY_MAX_IMAGE_BYTES ({})",
            self.max_body_bytes,
            self.max_image_bytes
        );
        ensure!(
            !self.sse_max_lifetime.is_zero(),
            "GATEWAY_SSE_MAX_LIFETIME must be positive"
        );
        // (A keepalive longer than a stream's lifetime is allowed: it never fires, which is
        // what a short lifetime, as in tests, wants.)
        ensure!(
            !self.sse_keepalive.is_zero(),
            "GATEWAY_SSE_KEEPALIVE must be positive (it is the longest silence on an SSE stream)"
        );
        ensure!(
            self.concurrency_limit > 0,
            "GATEWAY_CONCURRENCY_LIMIT must be positive"
        );
        let l = &self.limits;
        ensure!(
            l.scans_per_minute > 0 && l.schedules_per_minute > 0,
            "GATEWAY_SCANS_PER_MINUTE and GATEWAY_SCHEDULES_PER_MINUTE must be positive"
        );
        ensure!(
            l.max_sse_per_user > 0 && l.max_sse > 0 && l.max_connections > 0,
            "GATEWAY_MAX_SSE_PER_USER, GATEWAY_MAX_SSE and GATEWAY_MAX_CONNECTIONS must be positive"
        );
        ensure!(
            !l.header_timeout.is_zero() && !l.body_timeout.is_zero(),
            "GATEWAY_HEADER_TIMEOUT and GATEWAY_BODY_TIMEOUT must be positive"
        );
        ensure!(
            [
                l.first_byte_timeout,
                l.idle_timeout,
                l.h2_keepalive_interval,
                l.h2_keepalive_timeout
            ]
            .iter()
            .all(|d| !d.is_zero()),
            "GATEWAY_FIRST_BYTE_TIMEOUT, GATEWAY_IDLE_TIMEOUT and GATEWAY_H2_KEEPALIVE_* must be \
             positive"
        );
        ensure!(
            l.max_connections_per_ip > 0
                && l.unauthenticated_per_minute > 0
                && l.bodies_per_caller > 0,
            "GATEWAY_MAX_CONNECTIONS_PER_IP, GATEWAY_UNAUTHENTICATED_PER_MINUTE and \
             GATEWAY_BODIES_PER_CALLER must be positive"
        );
        self.auth.validate()?;
        self.proxies.validate()?;
        for origin in &self.cors_origins {
            ensure!(
                origin.starts_with("https://") || origin.starts_with("http://"),
                "GATEWAY_CORS_ORIGINS entries must be origins such as https://app.example.com"
            );
        }
        if let Some(url) = &self.jaeger_url {
            ensure!(
                url.starts_with("http://") || url.starts_with("https://"),
                "GATEWAY_JAEGER_URL must be an http(s) URL such as http://localhost:16686"
            );
        }
        if let Some(base) = &self.public_base_url {
            ensure!(
                base.starts_with("http://") || base.starts_with("https://"),
                "GATEWAY_PUBLIC_BASE_URL must be an http(s) URL"
            );
        }
        Ok(())
    }

    /// The defaults with header mode on loopback (valid settings for router-level tests).
    #[cfg(test)]
    pub(crate) fn local_for_tests() -> Self {
        Self {
            auth: AuthConfig {
                trust_header: TrustHeader::Loopback,
                ..Default::default()
            },
            ..Self::default()
        }
    }

    /// `path` as the caller should see it: under `public_base_url` when one is set.
    pub(crate) fn public_url(&self, path: &str) -> String {
        match &self.public_base_url {
            Some(base) => format!("{}{path}", base.trim_end_matches('/')),
            None => path.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Valid settings: header mode on loopback.
    fn local() -> Config {
        let c = Config::local_for_tests();
        c.validate().unwrap();
        c
    }

    #[test]
    fn defaults_are_valid_and_leave_room_for_base64() {
        let c = Config::default();
        // Nothing can authenticate until a secret, a key set or header mode is chosen.
        assert!(c.validate().is_err());
        Config::local_for_tests().validate().unwrap();
        assert_eq!(c.max_image_bytes, 10 * MIB);
        assert!(c.max_body_bytes > c.max_image_bytes * 4 / 3);
    }

    #[test]
    fn public_url_uses_the_base_when_set() {
        let mut c = Config::default();
        assert_eq!(c.public_url("/api/v1/scan/x"), "/api/v1/scan/x");
        c.public_base_url = Some("https://scan.example.com/".to_owned());
        assert_eq!(
            c.public_url("/api/v1/scan/x"),
            "https://scan.example.com/api/v1/scan/x"
        );
    }

    #[test]
    fn validate_rejects_a_jaeger_url_that_is_not_http() {
        let c = Config {
            jaeger_url: Some("javascript:alert(1)".to_owned()),
            ..local()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn validate_rejects_a_body_limit_below_the_image_limit() {
        let c = Config {
            max_body_bytes: 10,
            ..local()
        };
        assert!(c.validate().is_err());
    }
}
