//! The notification service as its own process. `ecoscan-notification migrate` applies the database
//! migrations and exits.

use anyhow::Context;
use ecoscan_common::{CancellationToken, config::env_addr};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _guard = ecoscan_common::telemetry::init("notification")?;
    let config = ecoscan_notification::Config::from_env()?;
    match std::env::args().nth(1).as_deref() {
        None | Some("serve") => {}
        Some("migrate") => {
            ecoscan_notification::migrate(&config).await?;
            tracing::info!("notification database is up to date");
            return Ok(());
        }
        Some(other) => {
            anyhow::bail!("unknown command {other:?}; use `serve` (default) or `migrate`")
        }
    }
    let addr = env_addr("NOTIFICATION_ADDR", "127.0.0.1:50057")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to bind grpc listener on {addr}"))?;
    tracing::info!(%addr, "notification listening");
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            ecoscan_common::shutdown::signal().await;
            shutdown.cancel();
        }
    });
    ecoscan_notification::serve(config, listener, shutdown).await
}
