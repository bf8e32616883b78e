//! The ingest service as its own process. `ecoscan-ingest migrate` applies the job store's
//! migrations and exits.

use ecoscan_common::binary::{self, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _guard = ecoscan_common::telemetry::init("ingest")?;
    let config = ecoscan_ingest::Config::from_env()?;
    if binary::command()? == Command::Migrate {
        ecoscan_ingest::migrate(&config).await?;
        tracing::info!("ingest database is up to date");
        return Ok(());
    }
    let listener = binary::bind("ingest", "INGEST_ADDR", "127.0.0.1:50051").await?;
    ecoscan_ingest::serve(config, listener, binary::shutdown_on_signal()).await
}
