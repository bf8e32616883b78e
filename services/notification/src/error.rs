//! The notification service's errors and their one mapping to gRPC statuses.

use tonic::Status;

use crate::store::StoreError;

/// Everything an RPC of the notification service can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Identity(#[from] ecoscan_common::identity::IdentityError),
    #[error("title is empty; send a short title for the notification")]
    EmptyTitle,
    #[error("id is empty; send the id of the notification to cancel")]
    EmptyId,
    #[error("due_at is missing; send when the notification is due")]
    MissingDueAt,
    #[error("due_at is more than a year ahead; schedule within 365 days")]
    DueTooFar,
    #[error("no notification {0} for this user")]
    NotFound(String),
    #[error("notification {0} was already delivered and cannot be cancelled")]
    AlreadyDelivered(String),
    #[error(
        "subscriber fell behind by {0} notifications; subscribe again and read the rest with List"
    )]
    SubscriberLagged(u64),
    #[error("the server is shutting down; subscribe again")]
    ShuttingDown,
    #[error("internal storage error")]
    Store(#[from] StoreError),
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::Identity(e) => Status::from(e),
            // Each names its field (INVALID_FIELD with a BadRequest).
            Error::EmptyTitle => ecoscan_common::reasons::invalid_field("title", e.to_string()),
            Error::EmptyId => ecoscan_common::reasons::invalid_field("id", e.to_string()),
            Error::MissingDueAt | Error::DueTooFar => {
                ecoscan_common::reasons::invalid_field("due_at", e.to_string())
            }
            Error::NotFound(_) => Status::not_found(e.to_string()),
            Error::AlreadyDelivered(_) => Status::failed_precondition(e.to_string()),
            Error::SubscriberLagged(_) => Status::resource_exhausted(e.to_string()),
            Error::ShuttingDown => Status::unavailable(e.to_string()),
            // The database is down or a connection dropped: the caller may try again.
            Error::Store(ref cause) if cause.is_transient() => {
                tracing::warn!(error = ?cause, "notification store unavailable");
                Status::unavailable("the notification store is unavailable; try again")
            }
            Error::Store(ref cause) => {
                tracing::error!(error = ?cause, "notification store failed");
                Status::internal(e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn errors_map_to_the_right_codes_and_hide_internal_causes() {
        assert_eq!(
            Status::from(Error::Identity(
                ecoscan_common::identity::IdentityError::Missing
            ))
            .code(),
            Code::Unauthenticated
        );
        for e in [
            Error::EmptyTitle,
            Error::EmptyId,
            Error::MissingDueAt,
            Error::DueTooFar,
        ] {
            assert_eq!(Status::from(e).code(), Code::InvalidArgument);
        }
        assert_eq!(
            Status::from(Error::NotFound("n".into())).code(),
            Code::NotFound
        );
        assert_eq!(
            Status::from(Error::AlreadyDelivered("n".into())).code(),
            Code::FailedPrecondition
        );
        assert_eq!(
            Status::from(Error::SubscriberLagged(3)).code(),
            Code::ResourceExhausted
        );
        assert_eq!(Status::from(Error::ShuttingDown).code(), Code::Unavailable);
        let internal = Status::from(Error::Store(StoreError::Corrupt("/secret".into())));
        assert_eq!(internal.code(), Code::Internal);
        assert!(!internal.message().contains("secret"));
    }
}
