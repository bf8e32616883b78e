//! Objects as files under a directory.

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{ObjectError, ObjectStore, validate_key};

/// Objects as files under a directory (the embedded default).
pub struct LocalObjectStore {
    root: PathBuf,
}

impl LocalObjectStore {
    /// Uses `root`, creating it when missing.
    pub async fn open(root: impl AsRef<Path>) -> Result<Self, ObjectError> {
        let root = root.as_ref().to_path_buf();
        tokio::fs::create_dir_all(&root).await?;
        Ok(Self { root })
    }

    fn path(&self, key: &str) -> Result<PathBuf, ObjectError> {
        validate_key(key)?;
        Ok(self.root.join(key))
    }
}

/// Writes `body` to a temporary name beside `path` and renames it there, so a reader never sees
/// half an object; makes the parent directories when they are missing.
fn write_atomically(path: &Path, body: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", uuid::Uuid::new_v4()));
    let written = match std::fs::write(&tmp, body) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => path
            .parent()
            .map_or(Err(e), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, body)),
        written => written,
    };
    // A failed write or rename leaves no temporary file behind.
    written
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

#[async_trait]
impl ObjectStore for LocalObjectStore {
    async fn put(&self, key: &str, body: Bytes) -> Result<(), ObjectError> {
        let path = self.path(key)?;
        // One trip to the blocking pool for the whole put (each `tokio::fs` call is one), and
        // the directory is made only when the write finds it missing: an object store writes
        // into the same few hundred directories over and over.
        tokio::task::spawn_blocking(move || write_atomically(&path, &body))
            .await
            .map_err(std::io::Error::other)??;
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>, ObjectError> {
        match tokio::fs::read(self.path(key)?).await {
            Ok(b) => Ok(Some(Bytes::from(b))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn size(&self, key: &str) -> Result<Option<u64>, ObjectError> {
        match tokio::fs::metadata(self.path(key)?).await {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn delete(&self, key: &str) -> Result<(), ObjectError> {
        match tokio::fs::remove_file(self.path(key)?).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
