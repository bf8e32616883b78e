//! A store that remembers what it wrote last: ingest writes a photo at intake and reads it back
//! seconds later for the vision stage, usually in the same process. Keeping the most recent
//! writes in memory (bounded in bytes, oldest out first) saves that read from the remote store;
//! a miss (another replica wrote it, or it left the cache) reads through.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{ObjectError, ObjectStore};

/// [`ObjectStore`] over `inner` that serves recent writes from memory; see the module docs.
pub struct RecentWrites {
    inner: Arc<dyn ObjectStore>,
    cache: Mutex<Cache>,
}

struct Cache {
    max_bytes: usize,
    bytes: usize,
    order: VecDeque<String>,
    objects: HashMap<String, Bytes>,
}

impl Cache {
    fn insert(&mut self, key: &str, body: Bytes) {
        if body.len() > self.max_bytes {
            return;
        }
        if let Some(old) = self.objects.insert(key.to_owned(), body.clone()) {
            self.bytes -= old.len();
            self.order.retain(|k| k != key);
        }
        self.bytes += body.len();
        self.order.push_back(key.to_owned());
        while self.bytes > self.max_bytes {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(gone) = self.objects.remove(&oldest) {
                self.bytes -= gone.len();
            }
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(gone) = self.objects.remove(key) {
            self.bytes -= gone.len();
            self.order.retain(|k| k != key);
        }
    }
}

impl RecentWrites {
    /// Keeps up to `max_bytes` of the most recent writes to `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>, max_bytes: usize) -> Self {
        Self {
            inner,
            cache: Mutex::new(Cache {
                max_bytes,
                bytes: 0,
                order: VecDeque::new(),
                objects: HashMap::new(),
            }),
        }
    }
}

#[async_trait]
impl ObjectStore for RecentWrites {
    async fn put(&self, key: &str, body: Bytes) -> Result<(), ObjectError> {
        self.inner.put(key, body.clone()).await?;
        self.cache
            .lock()
            .expect("cache lock poisoned")
            .insert(key, body);
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>, ObjectError> {
        let cached = self
            .cache
            .lock()
            .expect("cache lock poisoned")
            .objects
            .get(key)
            .cloned();
        match cached {
            Some(body) => Ok(Some(body)),
            None => self.inner.get(key).await,
        }
    }

    async fn delete(&self, key: &str) -> Result<(), ObjectError> {
        self.cache.lock().expect("cache lock poisoned").remove(key);
        self.inner.delete(key).await
    }

    // Both go to the store itself: what a presigned URL writes never passes through this cache,
    // so the cache cannot say how large it is.
    async fn size(&self, key: &str) -> Result<Option<u64>, ObjectError> {
        self.inner.size(key).await
    }

    async fn presign_put(
        &self,
        key: &str,
        content_type: &str,
        content_length: u64,
        expires_in: std::time::Duration,
    ) -> Result<Option<crate::PresignedPut>, ObjectError> {
        self.inner
            .presign_put(key, content_type, content_length, expires_in)
            .await
    }
}
