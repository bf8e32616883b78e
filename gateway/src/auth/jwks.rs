//! An OIDC provider's signing keys (`GATEWAY_JWKS_URL`), cached.
//!
//! Verification never waits on the network for a key it already has: the keys are a snapshot
//! read without a lock, and a stale set is refreshed in the background while the old keys keep
//! verifying. Only a token naming an unknown `kid` waits — for the one refresh in flight, which
//! every such token shares — and refreshes for unknown `kid`s are at most one per
//! `min_refresh`, so a storm of forged `kid`s costs the provider one request per interval.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant},
};

use jsonwebtoken::{
    Algorithm, DecodingKey,
    jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm, PublicKeyUse},
};

use super::AuthError;

const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

type Keys = HashMap<String, (Algorithm, DecodingKey)>;

/// The key cache of one provider.
pub(super) struct Jwks {
    url: String,
    http: reqwest::Client,
    /// The refresh interval of a set that is in use.
    max_age: Duration,
    /// The shortest time between two fetches.
    min_refresh: Duration,
    keys: RwLock<Arc<Keys>>,
    /// When the last fetch began (successful or not).
    last_attempt: Mutex<Option<Instant>>,
    /// When the current keys were fetched.
    fetched: Mutex<Option<Instant>>,
    /// Held by the one fetch in flight.
    refreshing: tokio::sync::Mutex<()>,
}

impl Jwks {
    pub(super) fn new(
        url: String,
        max_age: Duration,
        min_refresh: Duration,
    ) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            url,
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()?,
            max_age,
            min_refresh,
            keys: RwLock::default(),
            last_attempt: Mutex::default(),
            fetched: Mutex::default(),
            refreshing: tokio::sync::Mutex::const_new(()),
        }))
    }

    fn snapshot(&self) -> Arc<Keys> {
        self.keys.read().expect("jwks lock poisoned").clone()
    }

    fn may_fetch(&self) -> bool {
        self.last_attempt
            .lock()
            .expect("jwks lock poisoned")
            .is_none_or(|t| t.elapsed() >= self.min_refresh)
    }

    fn stale(&self) -> bool {
        self.fetched
            .lock()
            .expect("jwks lock poisoned")
            .is_none_or(|t| t.elapsed() >= self.max_age)
    }

    /// The key for `kid`.
    pub(super) async fn key(
        self: &Arc<Self>,
        kid: &str,
    ) -> Result<(Algorithm, DecodingKey), AuthError> {
        if let Some(found) = self.snapshot().get(kid).cloned() {
            if self.stale() && self.may_fetch() {
                // Refresh behind this request; it goes on with the key it has.
                let this = self.clone();
                tokio::spawn(async move { this.refresh().await });
            }
            return Ok(found);
        }
        if self.may_fetch() {
            self.refresh().await;
        } else {
            // Another request's refresh may be in flight: wait for it rather than fail a token
            // whose key it is about to bring.
            drop(self.refreshing.lock().await);
        }
        self.snapshot()
            .get(kid)
            .cloned()
            .ok_or_else(|| AuthError::Invalid(format!("no key {kid:?} in the provider's key set")))
    }

    /// Fetches the set, unless another fetch is in flight (then waits for it) or one began
    /// less than `min_refresh` ago.
    async fn refresh(&self) {
        let _one = self.refreshing.lock().await;
        {
            let mut last = self.last_attempt.lock().expect("jwks lock poisoned");
            if last.is_some_and(|t| t.elapsed() < self.min_refresh) {
                return;
            }
            *last = Some(Instant::now());
        }
        match self.fetch().await {
            Ok(keys) => {
                tracing::info!(keys = keys.len(), url = %self.url, "fetched the JWKS");
                *self.keys.write().expect("jwks lock poisoned") = Arc::new(keys);
                *self.fetched.lock().expect("jwks lock poisoned") = Some(Instant::now());
            }
            // The old keys stay in use; the next try is after `min_refresh`.
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), url = %self.url, "cannot fetch the JWKS")
            }
        }
    }

    async fn fetch(&self) -> anyhow::Result<Keys> {
        let set: JwkSet = self
            .http
            .get(&self.url)
            .timeout(FETCH_TIMEOUT)
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
            match usable(jwk) {
                Ok(alg) => match DecodingKey::from_jwk(jwk) {
                    Ok(key) => {
                        keys.insert(kid, (alg, key));
                    }
                    Err(e) => tracing::warn!(kid, error = %e, "skipping an unusable JWKS key"),
                },
                Err(why) => tracing::warn!(kid, why, "skipping a JWKS key"),
            }
        }
        Ok(keys)
    }
}

/// The algorithm a key verifies, when it may verify token signatures at all: `use` absent or
/// `sig`, an RSA key for RS256 or a P-256 key for ES256, and `alg`, when the provider names one,
/// the same.
pub(super) fn usable(jwk: &Jwk) -> Result<Algorithm, &'static str> {
    if matches!(&jwk.common.public_key_use, Some(u) if *u != PublicKeyUse::Signature) {
        return Err("its `use` is not `sig`");
    }
    let alg = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P256 => {
            Algorithm::ES256
        }
        AlgorithmParameters::EllipticCurve(_) => return Err("only P-256 curve keys are accepted"),
        _ => return Err("only RSA and EC keys are accepted"),
    };
    match jwk.common.key_algorithm {
        None => Ok(alg),
        Some(KeyAlgorithm::RS256) if alg == Algorithm::RS256 => Ok(alg),
        Some(KeyAlgorithm::ES256) if alg == Algorithm::ES256 => Ok(alg),
        Some(_) => Err("its `alg` is not RS256 or ES256 for its key type"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwk(v: serde_json::Value) -> Jwk {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn only_signature_keys_of_the_accepted_algorithms_are_used() {
        let rsa = |extra: serde_json::Value| {
            let mut v = serde_json::json!({"kty": "RSA", "kid": "r", "n": "sXch", "e": "AQAB"});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            jwk(v)
        };
        assert_eq!(usable(&rsa(serde_json::json!({}))), Ok(Algorithm::RS256));
        assert_eq!(
            usable(&rsa(serde_json::json!({"use": "sig", "alg": "RS256"}))),
            Ok(Algorithm::RS256)
        );
        assert!(usable(&rsa(serde_json::json!({"use": "enc"}))).is_err());
        assert!(usable(&rsa(serde_json::json!({"alg": "RS512"}))).is_err());
        assert!(usable(&rsa(serde_json::json!({"alg": "ES256"}))).is_err());
        let ec = |crv: &str, alg: &str| {
            jwk(
                serde_json::json!({"kty": "EC", "kid": "e", "crv": crv, "alg": alg,
                "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
                "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}),
            )
        };
        assert_eq!(usable(&ec("P-256", "ES256")), Ok(Algorithm::ES256));
        assert!(usable(&ec("P-384", "ES384")).is_err());
        assert!(usable(&ec("P-256", "RS256")).is_err());
        let oct = jwk(serde_json::json!({"kty": "oct", "kid": "h", "k": "c2VjcmV0"}));
        assert!(
            usable(&oct).is_err(),
            "a shared secret never comes from a JWKS"
        );
    }
}
