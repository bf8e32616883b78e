//! `ecoscan-rule`: serves the disposal-rule dataset over gRPC.

use ecoscan_common::binary;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    binary::command(
        "ecoscan-rule",
        "The rule service: the disposal rules of a waste category",
        "RULE_ADDR",
        false,
    );
    let _guard = ecoscan_common::telemetry::init("rule")?;
    let config = ecoscan_rule::Config::from_env()?;
    let listener = binary::bind("rule", "RULE_ADDR", "127.0.0.1:50053").await?;
    ecoscan_rule::serve(config, listener, binary::shutdown_on_signal()).await
}
