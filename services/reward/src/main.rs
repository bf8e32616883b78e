//! The reward service as its own process. `ecoscan-reward migrate` applies the database
//! migrations and exits.

use ecoscan_common::binary::{self, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before anything else, so that `--help` works whatever the environment holds.
    let command = binary::command(
        "ecoscan-reward",
        "The reward service: grants collectible characters",
        "REWARD_ADDR",
        true,
    );
    let _guard = ecoscan_common::telemetry::init("reward")?;
    let config = ecoscan_reward::Config::from_env()?;
    if command == Command::Migrate {
        ecoscan_reward::migrate(&config).await?;
        tracing::info!("reward database is up to date");
        return Ok(());
    }
    let listener = binary::bind("reward", "REWARD_ADDR", "127.0.0.1:50055").await?;
    ecoscan_reward::serve(config, listener, binary::shutdown_on_signal()).await
}
