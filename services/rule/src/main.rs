//! `ecoscan-rule`: serves the disposal-rule dataset over gRPC.

use anyhow::Context;
use ecoscan_common::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _guard = ecoscan_common::telemetry::init("rule")?;
    let config = ecoscan_rule::Config::from_env()?;
    let addr = ecoscan_common::config::env_addr("RULE_ADDR", "127.0.0.1:50053")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to bind grpc listener on {addr}"))?;
    let bound = listener
        .local_addr()
        .context("bound listener has no address")?;
    tracing::info!(addr = %bound, "rule service listening");

    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            ecoscan_common::shutdown::signal().await;
            shutdown.cancel();
        }
    });
    ecoscan_rule::serve(config, listener, shutdown).await
}
