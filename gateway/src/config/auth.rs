//! Authentication settings, and the checks that make them fail closed: a setting that would
//! let a forged or unchecked token through stops the start with what to set instead.

use std::{net::IpAddr, time::Duration};

use anyhow::{bail, ensure};

/// Whether (and from whom) `X-User-Id` is believed (`GATEWAY_TRUST_USER_HEADER`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TrustHeader {
    /// Never (the default): every caller proves who it is with a token.
    #[default]
    Off,
    /// From a direct loopback peer only, without forwarding headers, with a `Host` naming the
    /// listener; roles never.
    Loopback,
    /// From anyone, with roles: only for a gateway that nothing but an authenticating proxy can
    /// reach (that proxy sets the headers itself).
    Force,
}

impl std::str::FromStr for TrustHeader {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "false" | "off" | "no" | "0" => Ok(Self::Off),
            "loopback" | "true" | "on" | "yes" | "1" => Ok(Self::Loopback),
            "force" => Ok(Self::Force),
            other => Err(format!("{other:?} is not one of off, loopback, force")),
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
    /// Required `iss` (`GATEWAY_JWT_ISSUER`): checked when set, and required with a JWKS.
    pub issuer: Option<String>,
    /// Required `aud` (`GATEWAY_JWT_AUDIENCE`): checked when set, and required with a JWKS.
    pub audience: Option<String>,
    /// The claim that grants `admin` (`GATEWAY_JWT_ADMIN_CLAIM`): admin when it equals
    /// `admin_value`, is `true`, or is a list holding `admin_value`.
    pub admin_claim: String,
    pub admin_value: String,
    /// `GATEWAY_TRUST_USER_HEADER`.
    pub trust_header: TrustHeader,
    /// How long a JWKS is used before it is fetched again (`GATEWAY_JWKS_MAX_AGE`).
    pub jwks_max_age: Duration,
    /// The shortest time between two JWKS fetches (`GATEWAY_JWKS_MIN_REFRESH`): a rotated key
    /// is picked up within it; forged `kid`s cannot make fetches more frequent.
    pub jwks_min_refresh: Duration,
    /// Key of SSE tickets (`GATEWAY_SSE_TICKET_SECRET`), shared by replicas; unset, each
    /// process makes its own (a ticket then works only on the replica that issued it).
    pub ticket_secret: Option<String>,
    /// How long a spent SSE ticket stays good for reconnects of the stream it opened
    /// (`GATEWAY_SSE_TICKET_RESUME`): an `EventSource` reconnects with the URL it was given.
    pub ticket_resume: Duration,
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
            trust_header: TrustHeader::Off,
            jwks_max_age: Duration::from_secs(10 * 60),
            jwks_min_refresh: Duration::from_secs(30),
            ticket_secret: None,
            ticket_resume: Duration::from_secs(60 * 60),
        }
    }
}

/// Whether `url`'s host is this machine (http is allowed there, for tests and a local provider).
fn loopback_host(url: &str) -> bool {
    let Ok(uri) = url.parse::<axum::http::Uri>() else {
        return false;
    };
    let Some(host) = uri.host() else { return false };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl AuthConfig {
    /// Whether any token is accepted.
    pub(crate) fn has_tokens(&self) -> bool {
        self.hs256_secret.is_some() || self.jwks_url.is_some()
    }

    /// Refuses settings that would accept what they should not, or nothing at all.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if !self.has_tokens() && self.trust_header == TrustHeader::Off {
            bail!(
                "no way to authenticate callers: set GATEWAY_JWT_SECRET (HS256) or \
                 GATEWAY_JWKS_URL (RS256/ES256 from your identity provider); for development \
                 on this machine only, GATEWAY_TRUST_USER_HEADER=loopback"
            );
        }
        if let Some(secret) = &self.hs256_secret {
            ensure!(
                secret.len() >= 32,
                "GATEWAY_JWT_SECRET must be at least 32 bytes (e.g. `openssl rand -base64 32`)"
            );
            if let Some(why) = ecoscan_common::config::placeholder(secret) {
                bail!(
                    "GATEWAY_JWT_SECRET looks like a placeholder ({why}): generate one, e.g. \
                     `openssl rand -base64 32`"
                );
            }
        }
        if let Some(secret) = &self.ticket_secret {
            ensure!(
                secret.len() >= 32 && ecoscan_common::config::placeholder(secret).is_none(),
                "GATEWAY_SSE_TICKET_SECRET must be a generated secret of at least 32 bytes \
                 (e.g. `openssl rand -base64 32`)"
            );
        }
        if let Some(url) = &self.jwks_url {
            ensure!(
                url.starts_with("https://") || (url.starts_with("http://") && loopback_host(url)),
                "GATEWAY_JWKS_URL must be an https URL (plain http only to this machine, for \
                 tests): the keys it serves decide who anyone is"
            );
            ensure!(
                self.issuer.is_some() && self.audience.is_some(),
                "with GATEWAY_JWKS_URL, set GATEWAY_JWT_ISSUER and GATEWAY_JWT_AUDIENCE: an \
                 identity provider signs tokens for other applications too, and only `iss` and \
                 `aud` tell which are for this one"
            );
        }
        ensure!(
            !self.jwks_min_refresh.is_zero() && self.jwks_max_age >= self.jwks_min_refresh,
            "GATEWAY_JWKS_MIN_REFRESH must be positive and at most GATEWAY_JWKS_MAX_AGE"
        );
        if self.trust_header == TrustHeader::Force {
            tracing::warn!(
                "X-User-Id and X-User-Roles are believed from anyone (GATEWAY_TRUST_USER_HEADER=force): \
                 only a proxy that authenticates may reach this gateway"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut AuthConfig)) -> anyhow::Result<()> {
        let mut c = AuthConfig {
            hs256_secret: Some("kq3Zx9LrT0vYp2WmB7nHc4JdF8sG1aE6".into()),
            ..AuthConfig::default()
        };
        f(&mut c);
        c.validate()
    }

    #[test]
    fn placeholder_and_short_secrets_are_refused() {
        with(|_| {}).unwrap();
        for bad in [
            "dev-only-secret-change-me-0123456789abcdef",
            "changeme-changeme-changeme-changeme",
            "replace-me-with-a-long-random-value-please",
            &"s".repeat(40),
            "abababababababababababababababababab",
            "short",
        ] {
            let e = with(|c| c.hs256_secret = Some(bad.into())).unwrap_err();
            assert!(e.to_string().contains("GATEWAY_JWT_SECRET"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_jwks_needs_https_an_issuer_and_an_audience() {
        let jwks = |url: &str, iss: bool, aud: bool| {
            with(|c| {
                c.hs256_secret = None;
                c.jwks_url = Some(url.into());
                c.issuer = iss.then(|| "https://id.example.com/".into());
                c.audience = aud.then(|| "ecoscan".into());
            })
        };
        jwks("https://id.example.com/jwks.json", true, true).unwrap();
        jwks("http://127.0.0.1:9999/jwks.json", true, true).unwrap();
        jwks("http://localhost:9999/jwks.json", true, true).unwrap();
        jwks("http://[::1]:9999/jwks.json", true, true).unwrap();
        for url in [
            "http://id.example.com/jwks.json",
            "http://10.0.0.1/jwks",
            "ftp://x/y",
        ] {
            assert!(
                jwks(url, true, true)
                    .unwrap_err()
                    .to_string()
                    .contains("https"),
                "{url}"
            );
        }
        assert!(jwks("https://id.example.com/j", false, true).is_err());
        assert!(jwks("https://id.example.com/j", true, false).is_err());
    }

    #[test]
    fn no_way_to_authenticate_is_refused() {
        let e = with(|c| c.hs256_secret = None).unwrap_err().to_string();
        assert!(
            e.contains("GATEWAY_JWT_SECRET") && e.contains("loopback"),
            "{e}"
        );
        with(|c| {
            c.hs256_secret = None;
            c.trust_header = TrustHeader::Loopback;
        })
        .unwrap();
    }
}
