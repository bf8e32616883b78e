//! `ecoscan-gateway`: the HTTP edge as its own process.

use ecoscan_common::binary;
use ecoscan_gateway::{Config, DEFAULT_ADDR, DEFAULT_ADMIN_ADDR, serve_with_admin};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    binary::command(
        "ecoscan-gateway",
        "The HTTP gateway: REST and SSE over the gRPC services",
        "GATEWAY_ADDR",
        false,
    );
    let _guard = ecoscan_common::telemetry::init("gateway")?;
    let config = Config::from_env()?;
    let listener = binary::bind("gateway", "GATEWAY_ADDR", DEFAULT_ADDR).await?;
    // `/metrics` and `/readyz`, for the cluster only.
    let admin = binary::bind("gateway admin", "GATEWAY_ADMIN_ADDR", DEFAULT_ADMIN_ADDR).await?;
    serve_with_admin(config, listener, Some(admin), binary::shutdown_on_signal()).await
}
