//! `ecoscan-vision`: the vision service as its own process.

use ecoscan_common::binary;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    binary::command(
        "ecoscan-vision",
        "The vision service: classifies a photo of waste with the model",
        "VISION_ADDR",
        false,
    );
    let _guard = ecoscan_common::telemetry::init("vision")?;
    let config = ecoscan_vision::Config::from_env()?;
    let listener = binary::bind("vision", "VISION_ADDR", "127.0.0.1:50052").await?;
    ecoscan_vision::serve(config, listener, binary::shutdown_on_signal()).await
}
