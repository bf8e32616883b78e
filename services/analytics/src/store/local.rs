//! The embedded [`BodyStore`]: one file per object in a local directory.

use std::{
    io::ErrorKind,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use tokio::io::AsyncWriteExt;

use super::BodyStore;

/// [`BodyStore`] on a local directory.
#[derive(Debug, Clone)]
pub struct LocalDirBodyStore {
    dir: PathBuf,
}

impl LocalDirBodyStore {
    /// Uses `dir`, creating it if needed.
    pub async fn open(dir: impl AsRef<Path>) -> anyhow::Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        tokio::fs::create_dir_all(&dir)
            .await
            .with_context(|| format!("failed to create body directory {}", dir.display()))?;
        Ok(Self { dir })
    }

    fn path(&self, key: &str) -> anyhow::Result<PathBuf> {
        // Keys become file names: refuse anything that could leave the directory.
        let safe = !key.is_empty()
            && !key.starts_with('.')
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !safe {
            bail!("invalid object key {key:?}");
        }
        Ok(self.dir.join(key))
    }
}

impl BodyStore for LocalDirBodyStore {
    async fn put(&self, key: &str, bytes: Vec<u8>) -> anyhow::Result<()> {
        let path = self.path(key)?;
        // Write aside and rename, so a reader never sees half an object.
        let tmp = self.dir.join(format!(".{key}.tmp"));
        let mut file = tokio::fs::File::create(&tmp)
            .await
            .with_context(|| format!("failed to create {}", tmp.display()))?;
        file.write_all(&bytes)
            .await
            .context("failed to write body object")?;
        file.sync_data()
            .await
            .context("failed to sync body object")?;
        drop(file);
        tokio::fs::rename(&tmp, &path)
            .await
            .with_context(|| format!("failed to move body object into {}", path.display()))?;
        Ok(())
    }

    async fn get(&self, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
        let path = self.path(key)?;
        match tokio::fs::read(&path).await {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("failed to read {}", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn objects_round_trip_and_unknown_keys_are_none() {
        let dir = tempfile::TempDir::new().unwrap();
        let store = LocalDirBodyStore::open(dir.path().join("b")).await.unwrap();
        store.put("k1.bin", b"hello".to_vec()).await.unwrap();
        assert_eq!(store.get("k1.bin").await.unwrap().unwrap(), b"hello");
        assert!(store.get("missing.bin").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn keys_that_could_escape_the_directory_are_refused() {
        let dir = tempfile::TempDir::new().unwrap();
        let store = LocalDirBodyStore::open(dir.path()).await.unwrap();
        for key in ["../x", "a/b", "", ".hidden"] {
            assert!(store.put(key, vec![1]).await.is_err(), "{key}");
        }
    }
}
