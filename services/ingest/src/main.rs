//! The ingest service as its own process. `ecoscan-ingest migrate` applies the job store's
//! migrations and exits.

ecoscan_common::service_main!(
    ecoscan_ingest,
    "ingest",
    "The ingest service: takes scans and runs their pipeline",
    "INGEST_ADDR",
    "127.0.0.1:50051",
    migrations
);
