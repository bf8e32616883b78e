//! `ecoscan-gateway`: the HTTP edge as its own process.

use anyhow::Context as _;
use ecoscan_common::{CancellationToken, config::env_addr};
use ecoscan_gateway::{Config, DEFAULT_ADDR, serve};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = ecoscan_common::telemetry::init("gateway")?;
    let config = Config::from_env()?;
    let addr = env_addr("GATEWAY_ADDR", DEFAULT_ADDR)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to bind http listener on {addr}"))?;
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            ecoscan_common::shutdown::signal().await;
            shutdown.cancel();
        }
    });
    serve(config, listener, shutdown).await
}
