//! The ingest service as its own process. `ecoscan-ingest migrate` applies the job store's
//! migrations and exits.

use ecoscan_common::binary::{self, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before anything else, so that `--help` works whatever the environment holds.
    let command = binary::command(
        "ecoscan-ingest",
        "The ingest service: takes scans and runs their pipeline",
        "INGEST_ADDR",
        true,
    );
    let _guard = ecoscan_common::telemetry::init("ingest")?;
    let config = ecoscan_ingest::Config::from_env()?;
    if command == Command::Migrate {
        ecoscan_ingest::migrate(&config).await?;
        tracing::info!("ingest database is up to date");
        return Ok(());
    }
    let listener = binary::bind("ingest", "INGEST_ADDR", "127.0.0.1:50051").await?;
    ecoscan_ingest::serve(config, listener, binary::shutdown_on_signal()).await
}
