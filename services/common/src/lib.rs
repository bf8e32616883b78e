//! What every ecoscan service shares, and nothing more: configuration from the environment,
//! telemetry setup, the gRPC serving helper (health, reflection, trace context, graceful
//! shutdown), shared client channels, internal TLS/mTLS for both, and the one table that maps
//! gRPC codes to HTTP statuses.

pub mod balance;
pub mod binary;
pub mod client;
pub mod codes;
pub mod config;
pub mod identity;
pub mod image;
pub mod metrics;
pub mod server;
pub mod shutdown;
pub mod telemetry;
pub mod testing;
pub mod tls;

pub use identity::USER_ID_HEADER;

pub use tokio_util::sync::CancellationToken;
