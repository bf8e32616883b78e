//! The notification service as its own process. `ecoscan-notification migrate` applies the database
//! migrations and exits.

use ecoscan_common::binary::{self, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before anything else, so that `--help` works whatever the environment holds.
    let command = binary::command(
        "ecoscan-notification",
        "The notification service: schedules and delivers notifications",
        "NOTIFICATION_ADDR",
        true,
    );
    let _guard = ecoscan_common::telemetry::init("notification")?;
    let config = ecoscan_notification::Config::from_env()?;
    if command == Command::Migrate {
        ecoscan_notification::migrate(&config).await?;
        tracing::info!("notification database is up to date");
        return Ok(());
    }
    let listener = binary::bind("notification", "NOTIFICATION_ADDR", "127.0.0.1:50057").await?;
    ecoscan_notification::serve(config, listener, binary::shutdown_on_signal()).await
}
