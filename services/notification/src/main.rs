//! The notification service as its own process. `ecoscan-notification migrate` applies the database
//! migrations and exits.

ecoscan_common::service_main!(
    ecoscan_notification,
    "notification",
    "The notification service: schedules and delivers notifications",
    "NOTIFICATION_ADDR",
    "127.0.0.1:50057",
    migrations
);
