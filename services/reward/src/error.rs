//! The reward service's errors and their one mapping to gRPC statuses.

use tonic::Status;

use crate::store::StoreError;

/// Everything an RPC of the reward service can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("job_id is empty; send the id of the scan being rewarded")]
    EmptyJobId,
    #[error(transparent)]
    Identity(#[from] ecoscan_common::identity::IdentityError),
    #[error("classification is missing; send the scan's classification")]
    MissingClassification,
    /// `Evaluate` called by anyone but ingest.
    #[error(
        "only ingest evaluates a scan's reward, for a job it ran: scan with ScanService (or \
         POST /api/v1/scan) and the reward follows"
    )]
    NotIngest,
    #[error("job {0} was already evaluated for another user")]
    JobOfAnotherUser(String),
    #[error("name is empty; send a character's code or its Korean or English name")]
    EmptyCharacterName,
    #[error(
        "the catalogue has no character {0:?}; ListCatalogue (GET /api/v1/characters) lists \
         each one's code and names"
    )]
    NoSuchCharacter(String),
    #[error("internal storage error")]
    Store(#[from] StoreError),
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::Identity(e) => Status::from(e),
            // Each names its field (INVALID_FIELD with a BadRequest).
            Error::EmptyJobId => ecoscan_common::reasons::invalid_field("job_id", e.to_string()),
            Error::MissingClassification => {
                ecoscan_common::reasons::invalid_field("classification", e.to_string())
            }
            Error::JobOfAnotherUser(_) => Status::failed_precondition(e.to_string()),
            Error::EmptyCharacterName => {
                ecoscan_common::reasons::invalid_field("name", e.to_string())
            }
            Error::NoSuchCharacter(_) => Status::not_found(e.to_string()),
            Error::NotIngest => Status::permission_denied(e.to_string()),
            // The database is down or a connection dropped: the caller (ingest's pipeline)
            // retries, where INTERNAL would fail the scan for good.
            Error::Store(ref cause) if cause.is_transient() => {
                tracing::warn!(error = ?cause, "reward store unavailable");
                Status::unavailable("the reward store is unavailable; try again")
            }
            Error::Store(ref cause) => {
                tracing::error!(error = ?cause, "reward store failed");
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
            Status::from(Error::EmptyJobId).code(),
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
            Status::from(Error::MissingClassification).code(),
            Code::InvalidArgument
        );
        assert_eq!(
            Status::from(Error::NotIngest).code(),
            Code::PermissionDenied
        );
        assert_eq!(
            Status::from(Error::JobOfAnotherUser("j".into())).code(),
            Code::FailedPrecondition
        );
        let internal = Status::from(Error::Store(StoreError::Failed(sqlx::Error::Protocol(
            "disk on fire at /secret".into(),
        ))));
        assert_eq!(internal.code(), Code::Internal);
        assert!(!internal.message().contains("secret"));
    }

    #[test]
    fn a_store_that_is_down_is_unavailable_and_a_bad_row_is_internal() {
        let down = StoreError::from(sqlx::Error::Protocol("failed to begin".into()));
        let s = Status::from(Error::Store(down));
        assert_eq!(s.code(), Code::Unavailable);
        assert!(!s.message().contains("begin"));
        let bad = StoreError::from(sqlx::Error::ColumnNotFound("reason".into()));
        assert_eq!(Status::from(Error::Store(bad)).code(), Code::Internal);
    }
}
