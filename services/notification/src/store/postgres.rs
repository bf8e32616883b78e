//! The production notification store: [`SqlNotificationStore`] on PostgreSQL, its schema
//! managed by versioned migrations (`migrations/postgres/`).

use sqlx::{Postgres, migrate::Migrator};

use super::{SqlNotificationStore, StoreError};

/// Connections per process when `DATABASE_MAX_CONNECTIONS` is unset, and this store's weight
/// when the budget is split among the services of one process (`ecoscan up`).
pub const MAX_CONNECTIONS: u32 = 10;

/// The notification schema's migrations, tracked in their own table so services sharing one
/// database (through `DATABASE_URL`) never mistake each other's versions for theirs.
pub fn migrator() -> Migrator {
    ecoscan_sql::migrator!("_notification_migrations")
}

/// [`super::NotificationStore`] on PostgreSQL.
pub type PgNotificationStore = SqlNotificationStore<Postgres>;

impl SqlNotificationStore<Postgres> {
    /// Connects to `url` with the `DATABASE_*` settings ([`ecoscan_sql::PgSettings`]) and applies any pending migration (concurrent starts wait on the
    /// migrator's advisory lock).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let store = ecoscan_sql::PgStore {
            service: "notification",
            weight: MAX_CONNECTIONS,
            direct_url: std::env::var("NOTIFICATION_DATABASE_DIRECT_URL")
                .ok()
                .filter(|v| !v.trim().is_empty()),
        };
        let pool = ecoscan_sql::connect_postgres(url, &store, None, &migrator()).await?;
        Ok(Self::new(pool))
    }
}
