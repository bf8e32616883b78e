use anyhow::Context;
use ecoscan_common::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = ecoscan_common::telemetry::init("ingest")?;
    let config = ecoscan_ingest::Config::from_env()?;
    // `ecoscan-ingest migrate`: apply the job store's migrations and exit.
    if std::env::args().nth(1).as_deref() == Some("migrate") {
        ecoscan_ingest::migrate(&config).await?;
        tracing::info!("migrations applied");
        return Ok(());
    }
    let addr = ecoscan_common::config::env_addr("INGEST_ADDR", "127.0.0.1:50051")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to bind {addr}"))?;
    tracing::info!(%addr, "ingest listening");
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            ecoscan_common::shutdown::signal().await;
            shutdown.cancel();
        }
    });
    ecoscan_ingest::serve(config, listener, shutdown).await
}
