//! The one error type of the ingest service, mapped to `tonic::Status` in one place.

use std::time::Duration;

use ecoscan_common::{reasons::Reason, store_health::Down};
use tonic::{Status, metadata::MetadataValue};

/// What a caller is told about any `image_url` that could not be fetched, whatever the reason
/// (a refused address, a failed lookup, a closed port, a timeout, an error status, a body too
/// large or not an image, …): one message, so the answer reveals nothing about what lies
/// behind the URL. The reason is logged (see [`crate::fetch`]).
pub const IMAGE_FETCH_FAILED: &str =
    "could not fetch the image from image_url; check that it is a public http(s) URL of an image";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A field of the request is invalid: `field` as the proto names it, `message` why and
    /// what to send instead (a `BadRequest` carries both).
    #[error("{message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    /// The call carries no usable identity.
    #[error(transparent)]
    Identity(#[from] ecoscan_common::identity::IdentityError),
    #[error("job {0} not found")]
    JobNotFound(String),
    #[error("too many scans waiting ({backlog}); try again in {} s", retry_after.as_secs())]
    Overloaded { backlog: u64, retry_after: Duration },
    /// Fetching `image_url` failed or was refused; the reason is in the log.
    #[error("{}", IMAGE_FETCH_FAILED)]
    ImageFetch,
    /// Every `image_url` fetch slot (`INGEST_FETCH_CONCURRENCY`) is taken.
    #[error(
        "too many images are being fetched by URL; try again in {} s, or send the image's bytes",
        retry_after.as_secs()
    )]
    FetchBusy { retry_after: Duration },
    #[error("store failure: {0}")]
    Store(#[from] StoreError),
    /// A store this call needs is known to be down (its circuit is open): refused at once.
    #[error(transparent)]
    StoreDown(#[from] Down),
    #[error("service is shutting down")]
    ShuttingDown,
    #[error(
        "this needs the admin role: send an identity assertion with it (`ecoscan token --grpc \
         ecoscan.v1.ScanAdminService --user <id> --admin` prints one)"
    )]
    NotAdmin,
    #[error("job {0} is not dead-lettered; only a dead-lettered job can be requeued")]
    NotDeadLettered(String),
    /// No such direct upload, or another user's (whose existence is not the caller's to know),
    /// or one the sweep deleted after it expired.
    #[error(
        "upload {0} not found: it is not yours, or it expired and was deleted; create a new one \
         (CreateUpload, POST /api/v1/uploads)"
    )]
    UploadNotFound(String),
    #[error(
        "upload {0} expired; create a new one (CreateUpload, POST /api/v1/uploads) and upload \
         the photo again"
    )]
    UploadExpired(String),
    #[error(
        "upload {0} was submitted already; an upload makes one scan (repeat the submit with its \
         idempotency key to get the same job)"
    )]
    UploadSubmitted(String),
    #[error("nothing was uploaded under upload {0} yet; PUT the photo to its upload_url first")]
    UploadEmpty(String),
}

/// Failures of a storage backend; the detail goes to the log, never to the caller.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sql: {0}")]
    Sql(#[from] sqlx::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("redis: {0}")]
    Redis(#[from] ecoscan_redis::redis::RedisError),
    #[error("objects: {0}")]
    Object(#[from] ecoscan_objects::ObjectError),
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// Another writer changed the record first (e.g. another worker holds the job now).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The job was claimed again since this worker claimed it (its lease epoch is stale): the
    /// write was refused and the worker must stop.
    #[error("fenced: job {job} was claimed again (epoch {epoch} is stale)")]
    Fenced { job: String, epoch: u64 },
    #[error("{0}")]
    Unavailable(String),
}

impl StoreError {
    /// Whether trying the same thing again later may succeed: a store that is down or slow, a
    /// dropped connection. A record that does not decode, or an object that is missing, stays
    /// so however often a job is retried.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Corrupt(_) | Self::Fenced { .. } => false,
            Self::Object(e) => !matches!(e, ecoscan_objects::ObjectError::InvalidKey(_)),
            Self::Sql(e) => ecoscan_sql::is_transient(e),
            Self::Io(_) | Self::Redis(_) | Self::Conflict(_) | Self::Unavailable(_) => true,
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(StoreError::Sql(e))
    }
}

impl From<ecoscan_objects::ObjectError> for Error {
    fn from(e: ecoscan_objects::ObjectError) -> Self {
        Self::Store(StoreError::Object(e))
    }
}

impl Error {
    /// [`Error::InvalidArgument`] of `field`.
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            message: message.into(),
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidArgument { field, message } => {
                ecoscan_common::reasons::invalid_field(field, message)
            }
            Error::Identity(e) => Status::from(e),
            Error::JobNotFound(_) => Status::not_found(e.to_string()),
            Error::Overloaded { retry_after, .. } | Error::FetchBusy { retry_after } => {
                let (reason, metadata) = match &e {
                    Error::Overloaded { backlog, .. } => {
                        (Reason::BacklogFull, vec![("backlog", backlog.to_string())])
                    }
                    _ => (Reason::FetchBusy, Vec::new()),
                };
                // RetryInfo for any gRPC client, and the `retry-after` trailer the gateway reads.
                let mut s = ecoscan_common::reasons::status(
                    tonic::Code::ResourceExhausted,
                    e.to_string(),
                    reason,
                    &metadata,
                    Some(retry_after.max(Duration::from_secs(1))),
                );
                // Callers (the gateway) turn this into an HTTP `Retry-After`.
                s.metadata_mut().insert(
                    "retry-after",
                    MetadataValue::from(retry_after.as_secs().max(1)),
                );
                s
            }
            Error::ImageFetch => Status::invalid_argument(IMAGE_FETCH_FAILED),
            Error::Store(inner) => {
                // One line per call would be a flood during an outage (the store's health says
                // once that it stopped answering): at most one per interval, the rest counted.
                if let Some(suppressed) = ecoscan_common::log_limit::admit("ingest storage failure")
                {
                    tracing::error!(
                        error = %inner,
                        suppressed,
                        "a call failed on a store (at most one such line per {} s; `suppressed` \
                         counts the others)",
                        ecoscan_common::log_limit::INTERVAL.as_secs()
                    );
                }
                Status::unavailable("storage is unavailable; try again")
            }
            Error::StoreDown(down) => {
                let retry_after = down.retry_after.max(Duration::from_secs(1));
                let mut s = ecoscan_common::reasons::status(
                    tonic::Code::Unavailable,
                    down.to_string(),
                    Reason::StoreUnavailable,
                    &[
                        ("store", down.store.to_owned()),
                        ("fault", down.fault.as_str().to_owned()),
                    ],
                    Some(retry_after),
                );
                s.metadata_mut().insert(
                    "retry-after",
                    MetadataValue::from(retry_after.as_secs().max(1)),
                );
                s
            }
            Error::ShuttingDown => Status::unavailable("service is shutting down; try again"),
            Error::NotAdmin => Status::permission_denied(e.to_string()),
            Error::NotDeadLettered(_) => Status::failed_precondition(e.to_string()),
            Error::UploadNotFound(_) => Status::not_found(e.to_string()),
            Error::UploadExpired(ref id)
            | Error::UploadSubmitted(ref id)
            | Error::UploadEmpty(ref id) => {
                let reason = match &e {
                    Error::UploadExpired(_) => Reason::UploadExpired,
                    Error::UploadSubmitted(_) => Reason::UploadSubmitted,
                    _ => Reason::UploadEmpty,
                };
                ecoscan_common::reasons::status(
                    tonic::Code::FailedPrecondition,
                    e.to_string(),
                    reason,
                    &[("upload_id", id.clone())],
                    None,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn errors_map_to_the_expected_codes() {
        assert_eq!(
            Status::from(Error::invalid("hint", "x")).code(),
            Code::InvalidArgument
        );
        assert_eq!(
            Status::from(Error::Identity(
                ecoscan_common::identity::IdentityError::Missing
            ))
            .code(),
            Code::Unauthenticated
        );
        assert_eq!(
            Status::from(Error::JobNotFound("j".into())).code(),
            Code::NotFound
        );
        let s = Status::from(Error::Overloaded {
            backlog: 10,
            retry_after: Duration::from_secs(7),
        });
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.metadata().get("retry-after").unwrap(), "7");
        use tonic_types::StatusExt as _;
        let details = s.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "BACKLOG_FULL");
        assert_eq!(details.error_info().unwrap().metadata["backlog"], "10");
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(7))
        );
        let s = Status::from(Error::ImageFetch);
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), IMAGE_FETCH_FAILED);
        assert_eq!(Error::ImageFetch.to_string(), IMAGE_FETCH_FAILED);
        let s = Status::from(Error::FetchBusy {
            retry_after: Duration::from_secs(1),
        });
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.metadata().get("retry-after").unwrap(), "1");
        let s = Status::from(Error::Store(StoreError::Unavailable(
            "redis down at 10.0.0.1".into(),
        )));
        assert_eq!(s.code(), Code::Unavailable);
        assert!(
            !s.message().contains("10.0.0.1"),
            "internal detail leaked: {}",
            s.message()
        );
        let s = Status::from(Error::StoreDown(Down {
            store: "redis",
            fault: ecoscan_common::store_health::FaultKind::TimedOut,
            retry_after: Duration::from_secs(1),
        }));
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(
            s.message(),
            "redis is not answering (timed out); try again in 1 s"
        );
        assert_eq!(s.metadata().get("retry-after").unwrap(), "1");
        let details = s.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "STORE_UNAVAILABLE");
        assert_eq!(details.error_info().unwrap().metadata["store"], "redis");
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(1))
        );
        let s = Status::from(Error::UploadNotFound("u".into()));
        assert_eq!(s.code(), Code::NotFound);
        for (e, reason) in [
            (Error::UploadExpired("u".into()), "UPLOAD_EXPIRED"),
            (Error::UploadSubmitted("u".into()), "UPLOAD_SUBMITTED"),
            (Error::UploadEmpty("u".into()), "UPLOAD_EMPTY"),
        ] {
            let s = Status::from(e);
            assert_eq!(s.code(), Code::FailedPrecondition);
            let details = s.get_error_details();
            assert_eq!(details.error_info().unwrap().reason, reason);
            assert_eq!(details.error_info().unwrap().metadata["upload_id"], "u");
        }
    }
}
