//! The analytics service as its own process. `ecoscan-analytics migrate` applies the database
//! migrations and exits.

use anyhow::Context;
use ecoscan_common::{CancellationToken, config::env_addr};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _guard = ecoscan_common::telemetry::init("analytics")?;
    let config = ecoscan_analytics::Config::from_env()?;
    match std::env::args().nth(1).as_deref() {
        None | Some("serve") => {}
        Some("migrate") => {
            ecoscan_analytics::migrate(&config).await?;
            tracing::info!("analytics database is up to date");
            return Ok(());
        }
        Some(other) => {
            anyhow::bail!("unknown command {other:?}; use `serve` (default) or `migrate`")
        }
    }
    let addr = env_addr("ANALYTICS_ADDR", "127.0.0.1:50056")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to bind grpc listener on {addr}"))?;
    tracing::info!(%addr, "analytics listening");
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            ecoscan_common::shutdown::signal().await;
            shutdown.cancel();
        }
    });
    ecoscan_analytics::serve(config, listener, shutdown).await
}
