//! Process signals, and the drain that follows them.
//!
//! On SIGTERM (or SIGINT) a process first *drains*: every server reports NOT_SERVING
//! (`grpc.health.v1`) and fails `GET /readyz` at once, while it keeps accepting and answering
//! calls for `SHUTDOWN_DRAIN_GRACE` (default 5 s), the time callers and the orchestrator need to
//! stop sending new work. Then the shutdown token is cancelled: listeners close, in-flight
//! unary calls finish, streams end with `UNAVAILABLE` (clients reconnect to another replica),
//! and the process exits. A second signal skips what is left of the grace.

use std::{sync::OnceLock, time::Duration};

use tokio_util::sync::CancellationToken;

/// How long a process keeps serving after a signal, while reporting not ready.
pub const DRAIN_GRACE_VAR: &str = "SHUTDOWN_DRAIN_GRACE";
/// The default of [`DRAIN_GRACE_VAR`].
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(5);

/// Cancelled when this process starts draining (a signal arrived); the servers of the process
/// report not ready from then on. Process-wide, because signals are: tests that stop a server
/// by cancelling its shutdown token skip the drain.
pub fn draining() -> &'static CancellationToken {
    static DRAINING: OnceLock<CancellationToken> = OnceLock::new();
    DRAINING.get_or_init(CancellationToken::new)
}

/// The drain grace from [`DRAIN_GRACE_VAR`].
pub fn drain_grace() -> anyhow::Result<Duration> {
    crate::config::env_duration(DRAIN_GRACE_VAR, DEFAULT_DRAIN_GRACE)
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "failed to listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "failed to listen for sigterm");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("received sigint, shutting down"),
        () = term => tracing::info!("received sigterm, shutting down"),
    }
}
