//! The embedded notification store: [`SqlNotificationStore`] on a SQLite file (or in-memory
//! database).

use sqlx::Sqlite;

use super::{SqlNotificationStore, StoreError};

/// [`super::NotificationStore`] on SQLite.
pub type SqliteNotificationStore = SqlNotificationStore<Sqlite>;

impl SqlNotificationStore<Sqlite> {
    /// Opens (creating if needed) the database at `url` and applies the schema. File databases
    /// get their parent directory created, WAL journaling and a busy timeout.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool =
            ecoscan_sql::open_sqlite(url, include_str!("../../migrations/0001_init.sql")).await?;
        // A database made by an earlier release lacks the columns added since (`CREATE TABLE IF
        // NOT EXISTS` leaves it as it is): add them.
        let columns: Vec<String> =
            sqlx::query_scalar("SELECT name FROM pragma_table_info('notifications')")
                .fetch_all(&pool)
                .await?;
        if !columns.iter().any(|c| c == "trace_parent") {
            sqlx::query("ALTER TABLE notifications ADD COLUMN trace_parent TEXT")
                .execute(&pool)
                .await?;
        }
        Ok(Self::new(pool))
    }
}
