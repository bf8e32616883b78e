//! Objects in any S3-compatible endpoint, with path-style addressing (`endpoint/bucket/key`), so
//! MinIO, moto, Ceph and AWS all work without wildcard DNS.
//!
//! The settings are always compiled; the client only with the crate's `s3` feature. The AWS SDK
//! is a fifth of a cold release build on 2 cores, and the embedded suite (the README's first
//! command) never talks to S3, so a build without the feature says so when S3 is configured
//! instead of carrying the SDK for nothing.

#[cfg(feature = "s3")]
mod client;

use std::sync::Arc;

#[cfg(feature = "s3")]
pub use client::S3ObjectStore;

use crate::{ObjectStore, env_opt};

/// What a build without the `s3` feature answers when S3 is configured.
pub const NOT_BUILT: &str = "S3_ENDPOINT and S3_BUCKET select S3, but this ecoscan was built without S3 support: build it with `--features s3` (`cargo build --release -p ecoscan --features s3`; the container image has it), or unset them to keep objects in local files";

/// Where the objects go. Variables read by [`S3Config::from_env`]:
///
/// | variable | meaning |
/// |---|---|
/// | `S3_ENDPOINT` | e.g. `http://127.0.0.1:9000` or `https://s3.eu-west-1.amazonaws.com` |
/// | `S3_BUCKET` | created at start when missing |
/// | `S3_REGION` | [`us-east-1`] |
/// | `S3_ACCESS_KEY_ID` / `S3_SECRET_ACCESS_KEY` | static credentials; unset = the standard AWS chain (`AWS_ACCESS_KEY_ID`, profile, web identity, ECS, IMDS) |
#[derive(Clone)]
pub struct S3Config {
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    /// Static credentials; `None` uses the standard AWS credential chain.
    pub credentials: Option<(String, String)>,
    /// Prepended to every key, so services (and tests) can share a bucket.
    pub key_prefix: String,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret key stays out of logs.
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("static_credentials", &self.credentials.is_some())
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}

impl S3Config {
    /// The S3 settings, or `None` unless both `S3_ENDPOINT` and `S3_BUCKET` are set.
    /// A build without the `s3` feature refuses the variables here, at start, with
    /// [`NOT_BUILT`].
    pub fn from_env(key_prefix: &str) -> anyhow::Result<Option<Self>> {
        let (Some(endpoint), Some(bucket)) = (env_opt("S3_ENDPOINT"), env_opt("S3_BUCKET")) else {
            return Ok(None);
        };
        anyhow::ensure!(cfg!(feature = "s3"), NOT_BUILT);
        let credentials = match (env_opt("S3_ACCESS_KEY_ID"), env_opt("S3_SECRET_ACCESS_KEY")) {
            (Some(id), Some(secret)) => Some((id, secret)),
            (None, None) => None,
            _ => anyhow::bail!("set both S3_ACCESS_KEY_ID and S3_SECRET_ACCESS_KEY, or neither"),
        };
        Ok(Some(Self {
            endpoint,
            bucket,
            region: env_opt("S3_REGION").unwrap_or_else(|| "us-east-1".into()),
            credentials,
            key_prefix: key_prefix.to_owned(),
        }))
    }
}

/// Opens the bucket ([`S3ObjectStore::connect`]); without the `s3` feature, the error
/// [`NOT_BUILT`].
pub async fn open(config: S3Config) -> anyhow::Result<Arc<dyn ObjectStore>> {
    #[cfg(feature = "s3")]
    {
        Ok(Arc::new(S3ObjectStore::connect(config).await?))
    }
    #[cfg(not(feature = "s3"))]
    {
        let _ = config;
        anyhow::bail!(NOT_BUILT)
    }
}

#[cfg(all(test, not(feature = "s3")))]
mod tests {
    use super::*;

    /// Only a build without the feature runs this (`cargo test -p ecoscan-objects`, which the
    /// test command runs besides the workspace's tests, where the feature is on).
    #[tokio::test]
    async fn a_build_without_the_feature_refuses_s3_and_says_how_to_build_it() {
        let config = S3Config {
            endpoint: "http://127.0.0.1:9".into(),
            bucket: "b".into(),
            region: "us-east-1".into(),
            credentials: None,
            key_prefix: String::new(),
        };
        let Err(e) = open(config.clone()).await else {
            panic!("S3 opened without the s3 feature");
        };
        assert!(e.to_string().contains("--features s3"), "{e}");
        let Err(e) = crate::ObjectStoreConfig::S3(config).open().await else {
            panic!("S3 opened without the s3 feature");
        };
        assert!(e.to_string().contains("built without S3 support"), "{e}");
    }
}
