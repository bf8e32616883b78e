//! [`FaultKind`]: how a call to a store failed to get an answer.

use std::fmt;

/// A transport fault: the store did not answer. Its name is the `kind` label of
/// `store_faults_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// No answer within the call's timeout (a stalled server, a blackholed path).
    TimedOut,
    /// Nothing listens at the address (the server is stopped).
    Refused,
    /// The connection was reset or closed under the call.
    Reset,
    /// The store's host name did not resolve.
    NameNotResolved,
    /// Any other failure to reach the store (no route, a TLS failure, …).
    Other,
}

impl FaultKind {
    /// Every kind, in the order of the metric's series.
    pub const ALL: [FaultKind; 5] = [
        FaultKind::TimedOut,
        FaultKind::Refused,
        FaultKind::Reset,
        FaultKind::NameNotResolved,
        FaultKind::Other,
    ];

    /// The kind as a label value and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::TimedOut => "timed_out",
            FaultKind::Refused => "refused",
            FaultKind::Reset => "reset",
            FaultKind::NameNotResolved => "name_not_resolved",
            FaultKind::Other => "other",
        }
    }

    /// The kind of a socket error. A failed host name lookup has no kind of its own in
    /// `std::io` and is told by its message (getaddrinfo's, as tokio reports it).
    pub fn of_io(e: &std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        match e.kind() {
            K::TimedOut | K::WouldBlock => Self::TimedOut,
            K::ConnectionRefused => Self::Refused,
            K::ConnectionReset
            | K::ConnectionAborted
            | K::BrokenPipe
            | K::UnexpectedEof
            | K::NotConnected => Self::Reset,
            _ => Self::of_message(&e.to_string()),
        }
    }

    /// The kind of a failure to reach a store known only by its message: a failed host name
    /// lookup (getaddrinfo's words, as tokio reports them) or [`Self::Other`].
    pub fn of_message(message: &str) -> Self {
        let message = message.to_ascii_lowercase();
        let unresolved = [
            "failed to lookup address",
            "name or service not known",
            "nodename nor servname",
            "no address associated",
            "temporary failure in name resolution",
        ];
        if unresolved.iter().any(|m| message.contains(m)) {
            Self::NameNotResolved
        } else {
            Self::Other
        }
    }

    pub(super) fn index(self) -> usize {
        match self {
            FaultKind::TimedOut => 0,
            FaultKind::Refused => 1,
            FaultKind::Reset => 2,
            FaultKind::NameNotResolved => 3,
            FaultKind::Other => 4,
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FaultKind::TimedOut => "timed out",
            FaultKind::Refused => "connection refused",
            FaultKind::Reset => "connection reset",
            FaultKind::NameNotResolved => "name not resolved",
            FaultKind::Other => "unreachable",
        })
    }
}
