//! The analytics service as its own process. `ecoscan-analytics migrate` applies the database
//! migrations and exits.

ecoscan_common::service_main!(
    ecoscan_analytics,
    "analytics",
    "The analytics service: records every model call",
    "ANALYTICS_ADDR",
    "127.0.0.1:50056",
    migrations
);
