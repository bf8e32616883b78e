//! The one error type of the ingest service, mapped to `tonic::Status` in one place.

use std::time::Duration;

use tonic::{Code, Status, metadata::MetadataValue};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("job {0} not found")]
    JobNotFound(String),
    #[error("too many scans waiting ({backlog}); try again in {} s", retry_after.as_secs())]
    Overloaded { backlog: u64, retry_after: Duration },
    #[error("could not fetch the image: {0}")]
    ImageFetch(String),
    #[error("store failure: {0}")]
    Store(#[from] StoreError),
    #[error("service is shutting down")]
    ShuttingDown,
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
    #[error("{0}")]
    Unavailable(String),
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

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidArgument(m) => Status::invalid_argument(m),
            Error::JobNotFound(_) => Status::not_found(e.to_string()),
            Error::Overloaded { retry_after, .. } => {
                let mut s = Status::resource_exhausted(e.to_string());
                // Callers (the gateway) turn this into an HTTP `Retry-After`.
                s.metadata_mut().insert(
                    "retry-after",
                    MetadataValue::from(retry_after.as_secs().max(1)),
                );
                s
            }
            Error::ImageFetch(m) => Status::new(
                Code::InvalidArgument,
                format!("could not fetch the image: {m}"),
            ),
            Error::Store(inner) => {
                tracing::error!(error = %inner, "storage failure");
                Status::unavailable("storage is unavailable; try again")
            }
            Error::ShuttingDown => Status::unavailable("service is shutting down; try again"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_the_expected_codes() {
        assert_eq!(
            Status::from(Error::InvalidArgument("x".into())).code(),
            Code::InvalidArgument
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
        let s = Status::from(Error::Store(StoreError::Unavailable(
            "redis down at 10.0.0.1".into(),
        )));
        assert_eq!(s.code(), Code::Unavailable);
        assert!(
            !s.message().contains("10.0.0.1"),
            "internal detail leaked: {}",
            s.message()
        );
    }
}
