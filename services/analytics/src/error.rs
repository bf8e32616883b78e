//! The analytics service's errors and their one mapping to gRPC statuses.

use std::time::Duration;

use tonic::{Status, metadata::MetadataValue};

use crate::store::StoreError;

/// Everything an RPC of the analytics service can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("call is missing; send the llm call to record in `call`")]
    MissingCall,
    #[error("call_id is empty; send a client-generated uuid")]
    EmptyCallId,
    #[error("call_id {0:?} is not a uuid; send a client-generated uuid")]
    InvalidCallId(String),
    #[error("service is empty; name the service that made the call, e.g. \"vision\"")]
    EmptyService,
    #[error("model is empty; send the model name the provider reported")]
    EmptyModel,
    #[error("{field} must be a finite, non-negative number of milliseconds")]
    InvalidDuration { field: &'static str },
    #[error("status {0} is not a known CallStatus")]
    InvalidStatus(i32),
    #[error("{field} contains a NUL character, which the store cannot keep")]
    NulInField { field: &'static str },
    #[error("since is after until; send a window whose start precedes its end")]
    InvalidWindow,
    #[error(
        "call #{index} of the stream is invalid: {source}; the {index} calls before it were committed"
    )]
    InvalidStreamItem {
        index: u64,
        #[source]
        source: Box<Error>,
    },
    /// Recording needs an identity: the service that made the model call (its `act` claim) or a
    /// user.
    #[error(transparent)]
    Identity(#[from] ecoscan_common::identity::IdentityError),
    #[error("no llm call with id {0}")]
    NotFound(String),
    #[error(
        "reading model calls needs the admin role: they cover every user (send an identity \
         assertion with it: the gateway signs one for an admin's token, `ecoscan token --grpc \
         ecoscan.v1.AnalyticsService --user <id> --admin` prints one)"
    )]
    NotAdmin,
    #[error("the analytics writer is shutting down; retry on another instance")]
    ShuttingDown,
    #[error(
        "analytics is refusing calls: its stores are failing and its spool is full ({used} of \
         {max} bytes); calls not acknowledged were not stored, retry them in {} s (a resent \
         call_id is stored once)",
        retry_after.as_secs()
    )]
    SpoolFull {
        used: u64,
        max: u64,
        retry_after: Duration,
    },
    #[error(
        "analytics could not store the calls: its stores and its spool failed; calls not \
         acknowledged were not stored, retry them"
    )]
    Unavailable,
    #[error("internal storage error")]
    Store(#[from] StoreError),
    #[error("internal storage error")]
    Internal(#[source] anyhow::Error),
}

/// The request field an invalid-argument error is about, as the proto names it (a recorded
/// call's fields under `call`).
fn invalid_field_of(e: &Error) -> String {
    match e {
        Error::MissingCall => "call".to_owned(),
        Error::EmptyCallId | Error::InvalidCallId(_) => "call.call_id".to_owned(),
        Error::EmptyService => "call.service".to_owned(),
        Error::EmptyModel => "call.model".to_owned(),
        Error::InvalidDuration { field } | Error::NulInField { field } => format!("call.{field}"),
        Error::InvalidStatus(_) => "call.status".to_owned(),
        Error::InvalidWindow => "since".to_owned(),
        Error::InvalidStreamItem { source, .. } => invalid_field_of(source),
        _ => String::new(),
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            // Each names its field (INVALID_FIELD with a BadRequest); a stream item's, the
            // field of the call it is about.
            Error::MissingCall
            | Error::EmptyCallId
            | Error::InvalidCallId(_)
            | Error::EmptyService
            | Error::EmptyModel
            | Error::InvalidDuration { .. }
            | Error::InvalidStatus(_)
            | Error::NulInField { .. }
            | Error::InvalidWindow
            | Error::InvalidStreamItem { .. } => {
                ecoscan_common::reasons::invalid_field(&invalid_field_of(&e), e.to_string())
            }
            Error::NotFound(_) => Status::not_found(e.to_string()),
            Error::Identity(e) => Status::from(e),
            Error::NotAdmin => Status::permission_denied(e.to_string()),
            Error::ShuttingDown | Error::Unavailable => Status::unavailable(e.to_string()),
            Error::SpoolFull { retry_after, .. } => {
                let mut s = Status::resource_exhausted(e.to_string());
                // As ingest does when shedding load: the delay in whole seconds.
                s.metadata_mut().insert(
                    "retry-after",
                    MetadataValue::from(retry_after.as_secs().max(1)),
                );
                s
            }
            // The database is down or a connection dropped: the caller may try again.
            Error::Store(ref cause) if cause.is_transient() => {
                tracing::warn!(error = ?cause, "analytics store unavailable");
                Status::unavailable("the analytics store is unavailable; try again")
            }
            Error::Store(ref cause) => {
                tracing::error!(error = ?cause, "analytics store failed");
                Status::internal(e.to_string())
            }
            Error::Internal(ref cause) => {
                tracing::error!(error = ?cause, "analytics store failed");
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
            Status::from(Error::EmptyCallId).code(),
            Code::InvalidArgument
        );
        assert_eq!(
            Status::from(Error::InvalidWindow).code(),
            Code::InvalidArgument
        );
        let item = Status::from(Error::InvalidStreamItem {
            index: 3,
            source: Box::new(Error::EmptyModel),
        });
        assert_eq!(item.code(), Code::InvalidArgument);
        assert!(item.message().contains("#3") && item.message().contains("model is empty"));
        assert_eq!(
            Status::from(Error::NotFound("x".into())).code(),
            Code::NotFound
        );
        assert_eq!(Status::from(Error::ShuttingDown).code(), Code::Unavailable);
        assert_eq!(Status::from(Error::Unavailable).code(), Code::Unavailable);
        let full = Status::from(Error::SpoolFull {
            used: 10,
            max: 12,
            retry_after: Duration::from_secs(7),
        });
        assert_eq!(full.code(), Code::ResourceExhausted);
        assert_eq!(full.metadata().get("retry-after").unwrap(), "7");
        assert!(
            full.message().contains("spool is full")
                && full.message().contains("retry them in 7 s"),
            "{}",
            full.message()
        );
        let internal = Status::from(Error::Internal(anyhow::anyhow!("/secret/path")));
        assert_eq!(internal.code(), Code::Internal);
        assert!(!internal.message().contains("secret"));
    }
}
