//! The analytics service as its own process. `ecoscan-analytics migrate` applies the database
//! migrations and exits.

use ecoscan_common::binary::{self, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before anything else, so that `--help` works whatever the environment holds.
    let command = binary::command(
        "ecoscan-analytics",
        "The analytics service: records every model call",
        "ANALYTICS_ADDR",
        true,
    );
    let _guard = ecoscan_common::telemetry::init("analytics")?;
    let config = ecoscan_analytics::Config::from_env()?;
    if command == Command::Migrate {
        ecoscan_analytics::migrate(&config).await?;
        tracing::info!("analytics database is up to date");
        return Ok(());
    }
    let listener = binary::bind("analytics", "ANALYTICS_ADDR", "127.0.0.1:50056").await?;
    ecoscan_analytics::serve(config, listener, binary::shutdown_on_signal()).await
}
