//! The one error type of the rule service and its single mapping to `tonic::Status`.

use std::path::PathBuf;

use tonic::Status;

/// Everything that can go wrong in the rule service: bad requests, and a dataset that fails to
/// load at startup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("classification is missing; send the vision result in `classification`")]
    MissingClassification,
    #[error("classification.major_category is empty; send one of: {valid}")]
    EmptyMajor { valid: String },
    #[error("unsupported locale {0:?}; use \"ko\" (the default) or \"en\"")]
    UnsupportedLocale(String),
    #[error("unknown major_category {major:?}; expected one of: {valid}")]
    UnknownMajor { major: String, valid: String },
    #[error("unknown middle_category {middle:?} under {major}; expected one of: {valid}")]
    UnknownMiddle {
        major: String,
        middle: String,
        valid: String,
    },
    #[error("classification.middle_category is required under {major}; send one of: {valid}")]
    MissingMiddle { major: String, valid: String },
    #[error("failed to read the rule dataset at {}", path.display())]
    ReadDataset {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the rule dataset is not valid json for the expected schema")]
    ParseDataset(#[source] serde_json::Error),
    #[error("the rule dataset failed validation with {} problem(s): {}", problems.len(), problems.join("; "))]
    InvalidDataset { problems: Vec<String> },
}

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        match err {
            // Each names its field (INVALID_FIELD with a BadRequest).
            Error::MissingClassification => {
                ecoscan_common::reasons::invalid_field("classification", err.to_string())
            }
            Error::EmptyMajor { .. } => ecoscan_common::reasons::invalid_field(
                "classification.major_category",
                err.to_string(),
            ),
            Error::UnsupportedLocale(_) => {
                ecoscan_common::reasons::invalid_field("locale", err.to_string())
            }
            Error::MissingMiddle { .. } => ecoscan_common::reasons::invalid_field(
                "classification.middle_category",
                err.to_string(),
            ),
            Error::UnknownMajor { .. } | Error::UnknownMiddle { .. } => {
                Status::not_found(err.to_string())
            }
            Error::ReadDataset { .. } | Error::ParseDataset(_) | Error::InvalidDataset { .. } => {
                // The dataset is validated at startup, so this means a bug: log the whole chain,
                // tell the caller little.
                tracing::error!(error = %DisplayChain(&err), "rule dataset error reached a request");
                Status::internal("the rule dataset is unavailable")
            }
        }
    }
}

/// Formats an error with its `source()` chain, `a: b: c`.
struct DisplayChain<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn errors_map_to_the_right_grpc_codes() {
        let cases = [
            (Error::MissingClassification, Code::InvalidArgument),
            (
                Error::EmptyMajor { valid: "a".into() },
                Code::InvalidArgument,
            ),
            (Error::UnsupportedLocale("fr".into()), Code::InvalidArgument),
            (
                Error::MissingMiddle {
                    major: "a".into(),
                    valid: "b".into(),
                },
                Code::InvalidArgument,
            ),
            (
                Error::UnknownMajor {
                    major: "x".into(),
                    valid: "a".into(),
                },
                Code::NotFound,
            ),
            (
                Error::UnknownMiddle {
                    major: "a".into(),
                    middle: "x".into(),
                    valid: "b".into(),
                },
                Code::NotFound,
            ),
            (
                Error::InvalidDataset {
                    problems: vec!["p".into()],
                },
                Code::Internal,
            ),
        ];
        for (err, code) in cases {
            let text = err.to_string();
            let status = Status::from(err);
            assert_eq!(status.code(), code, "{text}");
        }
    }

    #[test]
    fn internal_errors_do_not_leak_details() {
        let status = Status::from(Error::InvalidDataset {
            problems: vec!["secret detail".into()],
        });
        assert!(!status.message().contains("secret"));
    }

    #[test]
    fn request_errors_keep_their_actionable_message() {
        let status = Status::from(Error::UnsupportedLocale("fr".into()));
        assert!(status.message().contains("\"fr\""));
        assert!(status.message().contains("\"en\""));
    }
}
