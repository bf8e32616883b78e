//! `ecoscan-gateway`: the HTTP edge as its own process.

use ecoscan_common::binary;
use ecoscan_gateway::{Config, DEFAULT_ADDR, serve};

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
    serve(config, listener, binary::shutdown_on_signal()).await
}
