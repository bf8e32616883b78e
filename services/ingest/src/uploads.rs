//! Direct uploads: a photo sent to the object store by the client itself, then named by a
//! submit (`upload_id`), so that with S3 the bytes never pass through the gateway or ingest on
//! their way in. `CreateUpload` records the upload (owner, declared type and size, expiry) on
//! the job store and, when the store can, presigns a `PUT` with the type and size signed into
//! it; the embedded store cannot, and its photos come through `PutUpload` (the gateway's signed
//! upload URL calls it). A submit checks the object against what was declared and sniffs it as
//! it checks `image` bytes, before the job is queued. Uploads never submitted are deleted by
//! [`spawn_sweep`] once expired, their objects too.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use ecoscan_proto::v1::{
    CreateUploadRequest, CreateUploadResponse, PutUploadRequest, PutUploadResponse,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use ecoscan_common::image::declared_type;

use crate::{
    error::{Error, StoreError},
    metrics::IngestMetrics,
    store::{Stores, Upload},
};

/// Where an upload's photo is kept until its submit copies it to the images.
fn object_key(id: &str) -> String {
    format!("uploads/{id}")
}

fn parse_upload_id(id: &str) -> Result<String, Error> {
    uuid::Uuid::parse_str(id)
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| {
            Error::invalid(
                "upload_id",
                format!("upload id {id:?} is not a UUID; use the id CreateUpload returned"),
            )
        })
}

/// Direct uploads on ingest's stores.
#[derive(Clone)]
pub(crate) struct Uploads {
    stores: Stores,
    metrics: IngestMetrics,
    ttl: Duration,
    max_bytes: usize,
}

/// An upload's photo, checked against its declaration, for a submit.
pub(crate) struct Photo {
    pub upload: Upload,
    pub bytes: Bytes,
    /// What the bytes are (sniffed): the declared type.
    pub content_type: &'static str,
}

impl Uploads {
    pub(crate) fn new(
        stores: Stores,
        metrics: IngestMetrics,
        ttl: Duration,
        max_bytes: usize,
    ) -> Self {
        Self {
            stores,
            metrics,
            ttl,
            max_bytes,
        }
    }

    /// `CreateUpload` for `user_id`.
    pub(crate) async fn create(
        &self,
        user_id: String,
        req: CreateUploadRequest,
    ) -> Result<CreateUploadResponse, Error> {
        let content_type = declared_type(&req.content_type).ok_or_else(|| {
            Error::invalid(
                "content_type",
                format!(
                    "content_type {:?} is not an image type we take; declare image/jpeg, \
                     image/png, image/webp or image/gif",
                    req.content_type
                ),
            )
        })?;
        let max = self.max_bytes as u64;
        if req.size_bytes == 0 || req.size_bytes > max {
            return Err(Error::invalid(
                "size_bytes",
                format!(
                    "size_bytes is {}; declare the photo's exact size, from 1 to {max} bytes",
                    req.size_bytes
                ),
            ));
        }
        self.stores.check()?;
        let id = uuid::Uuid::new_v4().hyphenated().to_string();
        let key = object_key(&id);
        let now = SystemTime::now();
        let upload = Upload {
            id: id.clone(),
            user_id,
            object_key: key.clone(),
            content_type: content_type.to_owned(),
            size_bytes: req.size_bytes,
            created_at: now,
            expires_at: now + self.ttl,
            job_id: None,
        };
        // Signed before the row is written: a store that cannot sign leaves nothing behind.
        let presigned = self
            .stores
            .objects
            .presign_put(&key, content_type, req.size_bytes, self.ttl)
            .await?;
        self.stores.jobs.create_upload(&upload).await?;
        self.metrics.upload("created");
        tracing::info!(upload.id = %id, presigned = presigned.is_some(), "upload created");
        let (upload_url, headers) = match presigned {
            Some(p) => (p.url, p.headers.into_iter().collect()),
            None => (String::new(), Default::default()),
        };
        Ok(CreateUploadResponse {
            upload_id: id,
            upload_url,
            headers,
            expires_at: Some(ecoscan_proto::timestamp(upload.expires_at)),
            content_type: upload.content_type,
            size_bytes: upload.size_bytes,
        })
    }

    /// The caller's upload, while it may still take a photo or be submitted.
    async fn open(&self, user_id: &str, id: &str) -> Result<Upload, Error> {
        let id = parse_upload_id(id)?;
        let upload = match self.stores.jobs.get_upload(&id).await? {
            Some(u) if u.user_id == user_id => u,
            // Another user's upload is reported as missing: its existence is not theirs to know.
            _ => return Err(Error::UploadNotFound(id)),
        };
        if upload.job_id.is_some() {
            return Err(Error::UploadSubmitted(id));
        }
        if SystemTime::now() >= upload.expires_at {
            return Err(Error::UploadExpired(id));
        }
        Ok(upload)
    }

    /// `PutUpload` for `user_id`: the photo stored as a presigned `PUT` would, held to the same
    /// declaration (type and exact size).
    pub(crate) async fn put(
        &self,
        user_id: &str,
        req: PutUploadRequest,
    ) -> Result<PutUploadResponse, Error> {
        let upload = self.open(user_id, &req.upload_id).await?;
        if declared_type(&req.content_type) != Some(upload.content_type.as_str()) {
            return Err(Error::invalid(
                "content_type",
                format!(
                    "the upload was declared {}, not {:?}; send it with that type, or create \
                     another upload",
                    upload.content_type, req.content_type
                ),
            ));
        }
        if req.image.len() as u64 != upload.size_bytes {
            return Err(Error::invalid(
                "image",
                format!(
                    "the photo is {} bytes; the upload was declared {} bytes",
                    req.image.len(),
                    upload.size_bytes
                ),
            ));
        }
        self.stores
            .objects
            .put(&upload.object_key, Bytes::from(req.image))
            .await?;
        self.metrics.upload("stored");
        Ok(PutUploadResponse {
            expires_at: Some(ecoscan_proto::timestamp(upload.expires_at)),
        })
    }

    /// The photo of upload `id` for a submit by `user_id`: the caller's, neither expired nor
    /// submitted, present, of the declared size, and an image of the declared type (the checks
    /// `image` bytes get). A photo that fails the checks leaves the upload as it was, so a
    /// corrected `PUT` may follow while the upload lives.
    pub(crate) async fn photo(&self, user_id: &str, id: &str) -> Result<Photo, Error> {
        let upload = self.open(user_id, id).await?;
        // The size first, from the store alone: an object larger than declared is refused
        // before it is read into memory.
        let size = self
            .stores
            .objects
            .size(&upload.object_key)
            .await?
            .ok_or_else(|| Error::UploadEmpty(upload.id.clone()))?;
        if size != upload.size_bytes {
            self.metrics.upload("refused");
            return Err(Error::invalid(
                "upload_id",
                format!(
                    "the uploaded photo is {size} bytes; the upload was declared {} bytes: \
                     upload the photo it was created for",
                    upload.size_bytes
                ),
            ));
        }
        let bytes = self
            .stores
            .objects
            .get(&upload.object_key)
            .await?
            .ok_or_else(|| Error::UploadEmpty(upload.id.clone()))?;
        match crate::image::validate(&bytes, &upload.content_type, self.max_bytes) {
            Ok(content_type) => Ok(Photo {
                upload,
                bytes,
                content_type,
            }),
            Err(e) => {
                self.metrics.upload("refused");
                Err(match e {
                    Error::InvalidArgument { message, .. } => Error::invalid(
                        "upload_id",
                        format!("the uploaded photo was refused: {message}"),
                    ),
                    other => other,
                })
            }
        }
    }

    /// Marks the upload submitted as `job_id`, once.
    pub(crate) async fn claim(&self, upload: &Upload, job_id: &str) -> Result<(), Error> {
        if self.stores.jobs.claim_upload(&upload.id, job_id).await? {
            Ok(())
        } else {
            Err(Error::UploadSubmitted(upload.id.clone()))
        }
    }

    /// Gives the upload back after its submit failed past the claim: the caller may try again.
    pub(crate) async fn release(&self, upload: &Upload, job_id: &str) {
        if let Err(e) = self.stores.jobs.release_upload(&upload.id, job_id).await {
            tracing::warn!(upload.id = %upload.id, error = %e, "could not release an upload after its submit failed; it stays submitted");
        }
    }

    /// After the submit made its job: the photo is kept with the images now, and the upload's
    /// own object goes (the row stays until its expiry, so a second submit is told it was
    /// submitted).
    pub(crate) async fn submitted(&self, upload: &Upload) {
        self.metrics.upload("submitted");
        if let Err(e) = self.stores.objects.delete(&upload.object_key).await {
            tracing::warn!(upload.id = %upload.id, error = %e, "could not delete a submitted upload's object; the sweep deletes it after its expiry");
        }
    }
}

/// Rows read per page of a sweep, and pages per pass (the rest waits for the next pass).
const PAGE: u32 = 500;
const MAX_PAGES: usize = 10;

/// One pass: deletes every upload expired before `now`, the object first and then the row, so
/// a pass that fails half-way leaves the row for the next one. Returns how many of them were
/// never submitted (counted `expired`).
#[tracing::instrument(name = "sweep expired uploads", parent = None, skip_all)]
pub async fn sweep_uploads(
    stores: &Stores,
    metrics: &IngestMetrics,
    now: SystemTime,
) -> Result<usize, StoreError> {
    let mut expired = 0;
    for _ in 0..MAX_PAGES {
        let page = stores.jobs.expired_uploads(now, PAGE).await?;
        for upload in &page {
            stores.objects.delete(&upload.object_key).await?;
            // Another replica's sweep may have taken the row meanwhile: counted once.
            if stores.jobs.delete_upload(&upload.id).await? && upload.job_id.is_none() {
                metrics.upload("expired");
                expired += 1;
            }
        }
        if page.len() < PAGE as usize {
            break;
        }
    }
    Ok(expired)
}

/// Runs [`sweep_uploads`] every `interval` until `shutdown`.
pub fn spawn_sweep(
    stores: Stores,
    metrics: IngestMetrics,
    interval: Duration,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => {}
            }
            match sweep_uploads(&stores, &metrics, SystemTime::now()).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(expired = n, "deleted uploads that were never submitted"),
                Err(e) => {
                    tracing::warn!(error = %e, "upload sweep failed; the next pass tries again")
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upload_ids_are_uuids() {
        assert!(parse_upload_id("not-a-uuid").is_err());
        let id = uuid::Uuid::new_v4().to_string();
        assert_eq!(parse_upload_id(&id.to_uppercase()).unwrap(), id);
    }
}
