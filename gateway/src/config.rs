//! Gateway configuration from the environment.

use anyhow::{Context, ensure};
use ecoscan_common::config::{env_opt, env_or};

/// Address the binary listens on when `GATEWAY_ADDR` is unset.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8080";

const MIB: usize = 1024 * 1024;

/// What the gateway needs to run. Read by [`Config::from_env`]; every variable is optional:
///
/// | variable | default | meaning |
/// |---|---|---|
/// | `GATEWAY_ADDR` | `127.0.0.1:8080` | listen address (read by the binary, not stored here) |
/// | `INGEST_URL` | `http://127.0.0.1:50051` | `ScanService` |
/// | `REWARD_URL` | `http://127.0.0.1:50055` | `RewardService` |
/// | `ANALYTICS_URL` | `http://127.0.0.1:50056` | `AnalyticsService` |
/// | `NOTIFICATION_URL` | `http://127.0.0.1:50057` | `NotificationService` |
/// | `GATEWAY_MAX_IMAGE_BYTES` | `10485760` (10 MiB) | largest image accepted (decoded bytes) |
/// | `GATEWAY_MAX_BODY_BYTES` | 4/3 of the image limit + 64 KiB | largest request body (room for base64 and multipart framing) |
/// | `GATEWAY_CONCURRENCY_LIMIT` | `1024` | requests handled at once before new ones are shed with 503 |
/// | `GATEWAY_DEFAULT_USER` | `local` | user id when a request carries no `X-User-Id` |
/// | `GATEWAY_PUBLIC_BASE_URL` | unset | prefix for the URLs the gateway hands out (`https://scan.example.com`); relative URLs when unset |
/// | `GATEWAY_SSE_MAX_LIFETIME` | `30m` | longest life of one SSE response; clients reconnect with `Last-Event-ID` |
#[derive(Clone, Debug)]
pub struct Config {
    pub ingest_url: String,
    pub reward_url: String,
    pub analytics_url: String,
    pub notification_url: String,
    /// Checked at the edge so that oversized images never travel to ingest.
    pub max_image_bytes: usize,
    /// Bounds the memory one request can take, whatever its content type.
    pub max_body_bytes: usize,
    /// Requests in flight at once; past it the gateway sheds load instead of queueing.
    pub concurrency_limit: usize,
    /// Acting user when a request names none (until JWT auth arrives).
    pub default_user: String,
    /// When set, `Location`, `events_url`, `result_url` are absolute URLs under it.
    pub public_base_url: Option<String>,
    /// Every SSE response ends after this long (an `EventSource` reconnects by itself), so no
    /// connection is held forever.
    pub sse_max_lifetime: std::time::Duration,
}

impl Default for Config {
    fn default() -> Self {
        let max_image_bytes = 10 * MIB;
        Self {
            ingest_url: "http://127.0.0.1:50051".to_owned(),
            reward_url: "http://127.0.0.1:50055".to_owned(),
            analytics_url: "http://127.0.0.1:50056".to_owned(),
            notification_url: "http://127.0.0.1:50057".to_owned(),
            max_image_bytes,
            max_body_bytes: default_body_limit(max_image_bytes),
            concurrency_limit: 1024,
            default_user: "local".to_owned(),
            public_base_url: None,
            sse_max_lifetime: std::time::Duration::from_secs(30 * 60),
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
        let d = Self::default();
        let max_image_bytes = env_or("GATEWAY_MAX_IMAGE_BYTES", d.max_image_bytes)?;
        let config = Self {
            ingest_url: env_or("INGEST_URL", d.ingest_url)?,
            reward_url: env_or("REWARD_URL", d.reward_url)?,
            analytics_url: env_or("ANALYTICS_URL", d.analytics_url)?,
            notification_url: env_or("NOTIFICATION_URL", d.notification_url)?,
            max_image_bytes,
            max_body_bytes: env_or(
                "GATEWAY_MAX_BODY_BYTES",
                default_body_limit(max_image_bytes),
            )?,
            concurrency_limit: env_or("GATEWAY_CONCURRENCY_LIMIT", d.concurrency_limit)?,
            default_user: env_or("GATEWAY_DEFAULT_USER", d.default_user)?,
            public_base_url: env_opt("GATEWAY_PUBLIC_BASE_URL"),
            sse_max_lifetime: ecoscan_common::config::env_duration(
                "GATEWAY_SSE_MAX_LIFETIME",
                d.sse_max_lifetime,
            )?,
        };
        config.validate().context("invalid gateway configuration")?;
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
        ensure!(
            self.concurrency_limit > 0,
            "GATEWAY_CONCURRENCY_LIMIT must be positive"
        );
        ensure!(
            crate::input::valid_user_id(&self.default_user),
            "GATEWAY_DEFAULT_USER must be 1-128 characters of [A-Za-z0-9_.@-]"
        );
        if let Some(base) = &self.public_base_url {
            ensure!(
                base.starts_with("http://") || base.starts_with("https://"),
                "GATEWAY_PUBLIC_BASE_URL must be an http(s) URL"
            );
        }
        Ok(())
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

    #[test]
    fn defaults_are_valid_and_leave_room_for_base64() {
        let c = Config::default();
        c.validate().unwrap();
        assert_eq!(c.max_image_bytes, 10 * MIB);
        assert!(c.max_body_bytes > c.max_image_bytes * 4 / 3);
        assert_eq!(c.default_user, "local");
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
    fn validate_rejects_a_body_limit_below_the_image_limit() {
        let c = Config {
            max_body_bytes: 10,
            ..Config::default()
        };
        assert!(c.validate().is_err());
    }
}
