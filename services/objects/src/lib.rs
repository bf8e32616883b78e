//! Object storage behind one small trait, for every service that keeps blobs (images, LLM
//! request/response bodies): a local directory in the embedded suite, any S3-compatible endpoint
//! (AWS S3, MinIO, moto, …) in production. Nothing outside this crate names aws-sdk-s3 types.
//! The S3 client is the `s3` feature ([`s3`] says why it is not default).

mod local;
mod recent;
pub mod s3;

use std::{path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;

pub use local::LocalObjectStore;
pub use recent::RecentWrites;
pub use s3::S3Config;
#[cfg(feature = "s3")]
pub use s3::S3ObjectStore;

/// Failures of an object store; the detail is for logs, never for callers.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("invalid object key {0:?}")]
    InvalidKey(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("s3: {0}")]
    S3(String),
}

/// A URL a client sends one object to itself (HTTP `PUT`), so the bytes never pass through
/// the service that asked for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresignedPut {
    /// Where to `PUT` the object; it carries its signature and expiry in its query.
    pub url: String,
    /// Headers the `PUT` must carry exactly as given: they are part of the signature
    /// (`Content-Type`, `Content-Length`), so a request with other values is refused.
    pub headers: Vec<(String, String)>,
}

/// A blob store with flat `/`-separated keys.
#[async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// Stores `body` under `key`, replacing what was there. A reader sees the old or the new
    /// object, never half of one.
    async fn put(&self, key: &str, body: Bytes) -> Result<(), ObjectError>;
    /// The object, or `None` when there is none under `key`.
    async fn get(&self, key: &str) -> Result<Option<Bytes>, ObjectError>;
    /// Removes the object; removing a missing one is not an error.
    async fn delete(&self, key: &str) -> Result<(), ObjectError>;
    /// The object's size in bytes without reading it, or `None` when there is none under
    /// `key`: a caller can refuse an object too large before it reads the object into memory.
    /// The default reads it (a store that can ask for the size alone does so).
    async fn size(&self, key: &str) -> Result<Option<u64>, ObjectError> {
        Ok(self.get(key).await?.map(|b| b.len() as u64))
    }
    /// A URL that lets whoever holds it store one object under `key` for `expires_in`, with
    /// `content_type` and exactly `content_length` bytes signed into it; `None` when the store
    /// cannot hand out such URLs (a local directory: its bytes come through the service).
    async fn presign_put(
        &self,
        key: &str,
        content_type: &str,
        content_length: u64,
        expires_in: Duration,
    ) -> Result<Option<PresignedPut>, ObjectError> {
        let _ = (key, content_type, content_length, expires_in);
        Ok(None)
    }
}

/// Refuses keys that are empty, absolute, or could leave the store's root (`.`/`..`/empty
/// segments). Both implementations apply it, so a key valid on one is valid on the other.
pub fn validate_key(key: &str) -> Result<(), ObjectError> {
    if key.is_empty()
        || key.len() > 1024
        || key.starts_with('/')
        || key
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
        || key.chars().any(char::is_control)
    {
        return Err(ObjectError::InvalidKey(key.to_owned()));
    }
    Ok(())
}

/// Reads an optional variable; unset or blank is `None`.
pub(crate) fn env_opt(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Which object store to use.
#[derive(Clone, Debug)]
pub enum ObjectStoreConfig {
    /// Files under a directory (the embedded default).
    Local(PathBuf),
    S3(S3Config),
}

impl ObjectStoreConfig {
    /// S3 when `S3_ENDPOINT` and `S3_BUCKET` are both set (see [`S3Config::from_env`]), else the
    /// local directory `local_dir`. `key_prefix` separates services sharing one bucket
    /// (e.g. `images/`-style keys of ingest and analytics bodies never collide).
    pub fn from_env(local_dir: PathBuf, key_prefix: &str) -> anyhow::Result<Self> {
        Ok(match S3Config::from_env(key_prefix)? {
            Some(s3) => Self::S3(s3),
            None => Self::Local(local_dir),
        })
    }

    /// Opens the store: creates the directory, or checks the endpoint and creates the bucket
    /// when it is missing (without the `s3` feature, an S3 configuration is an error).
    pub async fn open(&self) -> anyhow::Result<Arc<dyn ObjectStore>> {
        Ok(match self {
            Self::Local(dir) => Arc::new(LocalObjectStore::open(dir).await?),
            Self::S3(config) => s3::open(config.clone()).await?,
        })
    }
}

/// True when the S3 variables select S3 (`S3_ENDPOINT` and `S3_BUCKET` both set).
pub fn s3_configured() -> bool {
    env_opt("S3_ENDPOINT").is_some() && env_opt("S3_BUCKET").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_could_escape_or_are_malformed_are_refused() {
        for bad in ["", "/abs", "../x", "a/../b", "a//b", "a/./b", "a/", "a\nb"] {
            assert!(validate_key(bad).is_err(), "{bad:?} should be refused");
        }
        for good in ["a", "images/ab/abcdef", "bodies/2026/01/x.json"] {
            assert!(validate_key(good).is_ok(), "{good:?} should be accepted");
        }
    }
}
