use super::*;

#[test]
fn every_error_maps_to_the_documented_code() {
    let cases = [
        (Error::EmptyImage, Code::InvalidArgument),
        (
            Error::UnsupportedContentType("text/plain".into()),
            Code::InvalidArgument,
        ),
        (Error::NotAnImage, Code::InvalidArgument),
        (
            Error::RuleUnavailable {
                url: "http://x".into(),
                reason: "refused".into(),
            },
            Code::Unavailable,
        ),
        (
            Error::EmptyTaxonomy("http://x".into()),
            Code::FailedPrecondition,
        ),
        (Error::OutsideTaxonomy("a/b/c".into()), Code::Internal),
        (
            Error::Llm(LlmError::RateLimited { retry_after: None }),
            Code::Unavailable,
        ),
        (Error::Llm(LlmError::Malformed("x".into())), Code::Internal),
        (
            Error::Llm(LlmError::Upstream {
                status: 401,
                body: "bad key".into(),
            }),
            Code::Internal,
        ),
    ];
    for (error, code) in cases {
        let text = error.to_string();
        assert_eq!(Status::from(error).code(), code, "{text}");
    }
}

#[test]
fn a_provider_failure_the_client_already_retried_is_unavailable_and_marked_as_retried() {
    let exhausted = Status::from(Error::Llm(LlmError::RetriesExhausted {
        attempts: 4,
        last: Box::new(LlmError::RateLimited {
            retry_after: Some(std::time::Duration::from_secs(1)),
        }),
    }));
    assert_eq!(exhausted.code(), Code::Unavailable);
    assert!(codes::already_retried(&exhausted));
    assert!(!codes::worth_retrying(&exhausted));
    assert!(
        exhausted.message().contains("gave up after 4 attempts"),
        "{}",
        exhausted.message()
    );

    // Not retried by the client (a timeout): the caller may retry.
    let timeout = Status::from(Error::Llm(LlmError::Timeout(
        std::time::Duration::from_secs(1),
    )));
    assert_eq!(timeout.code(), Code::Unavailable);
    assert!(codes::worth_retrying(&timeout));
    // Other transient trouble (the rule service unreachable) stays retryable too.
    let rule = Status::from(Error::RuleUnavailable {
        url: "http://x".into(),
        reason: "refused".into(),
    });
    assert!(codes::worth_retrying(&rule));
}

#[test]
fn internal_messages_do_not_leak_provider_bodies() {
    let status = Status::from(Error::Llm(LlmError::Upstream {
        status: 400,
        body: "secret detail".into(),
    }));
    assert!(!status.message().contains("secret"));
}

#[test]
fn retryable_failures_do_not_leak_provider_bodies_either() {
    for llm in [
        LlmError::Upstream {
            status: 503,
            body: "secret upstream detail".into(),
        },
        LlmError::RetriesExhausted {
            attempts: 2,
            last: Box::new(LlmError::Transport("dns error: secret.internal".into())),
        },
        LlmError::Interrupted("reset by secret peer".into()),
    ] {
        let status = Status::from(Error::Llm(llm));
        assert_eq!(status.code(), Code::Unavailable);
        assert!(!status.message().contains("secret"), "{}", status.message());
    }
}
