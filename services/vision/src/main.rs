//! `ecoscan-vision`: the vision service as its own process.

use anyhow::Context;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _guard = ecoscan_common::telemetry::init("vision")?;
    let config = ecoscan_vision::Config::from_env()?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .with_context(|| format!("failed to bind grpc listener on {}", config.addr))?;
    tracing::info!(addr = %listener.local_addr()?, "listening");
    let shutdown = ecoscan_common::CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            ecoscan_common::shutdown::signal().await;
            shutdown.cancel();
        }
    });
    ecoscan_vision::serve(config, listener, shutdown).await
}
