//! The production job store: [`SqlJobStore`] on PostgreSQL. The schema comes from versioned
//! migrations in `migrations/postgres/`, applied at start and by `ecoscan-ingest migrate`.

use std::str::FromStr;

use sqlx::{
    AssertSqlSafe, Connection, Postgres,
    migrate::Migrator,
    postgres::{PgConnectOptions, PgConnection},
};

use super::sql::SqlJobStore;
use crate::error::StoreError;

/// Connections per process when `DATABASE_MAX_CONNECTIONS` is unset, and this store's weight
/// when the budget is split among the services of one process (`ecoscan up`): workers and RPCs
/// share them; a statement holds one for milliseconds.
pub const MAX_CONNECTIONS: u32 = 16;

/// Ingest's migrations, tracked in their own table so services sharing one database never
/// mistake each other's versions for theirs.
pub fn migrator() -> Migrator {
    ecoscan_sql::migrator!("_ingest_migrations")
}

/// True for the URLs that select PostgreSQL.
pub use ecoscan_sql::is_postgres as is_postgres_url;

/// [`super::JobStore`] on PostgreSQL.
pub type PgJobStore = SqlJobStore<Postgres>;

impl SqlJobStore<Postgres> {
    /// Connects to `url` with the `DATABASE_*` settings ([`ecoscan_sql::PgSettings`]) and
    /// applies pending migrations (concurrent starts wait on the migrator's advisory lock).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_in_schema(url, None).await
    }

    /// Like [`connect`](Self::connect), with every table in `schema` (created when missing):
    /// the tests give each run its own schema.
    pub async fn connect_in_schema(url: &str, schema: Option<&str>) -> Result<Self, StoreError> {
        if let Some(schema) = schema {
            if !schema
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
            {
                return Err(StoreError::Corrupt(format!(
                    "schema name {schema:?} must be letters, digits and '_'"
                )));
            }
            let mut conn = PgConnection::connect_with(&PgConnectOptions::from_str(url)?).await?;
            // The name was checked above: letters, digits and '_' only.
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE SCHEMA IF NOT EXISTS {schema}"
            )))
            .execute(&mut conn)
            .await?;
            conn.close().await?;
        }
        let store = ecoscan_sql::PgStore {
            service: "ingest",
            weight: MAX_CONNECTIONS,
            direct_url: std::env::var("INGEST_DATABASE_DIRECT_URL")
                .ok()
                .filter(|v| !v.trim().is_empty()),
        };
        let pool = ecoscan_sql::connect_postgres(url, &store, schema, &migrator())
            .await
            .map_err(|e| match e {
                e @ sqlx::Error::Migrate(_) => {
                    StoreError::Unavailable(format!("applying the ingest migrations: {e}"))
                }
                e => e.into(),
            })?;
        Ok(Self::new(pool))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use ecoscan_sql::testing::PgSchema;

    use super::*;
    use crate::store::JobStore;

    #[tokio::test]
    async fn rows_of_the_millisecond_layout_keep_their_times_after_the_migration() {
        let schema = PgSchema::create().await;
        // The database as the release before the time migration left it.
        let time_migration = migrator()
            .iter()
            .find(|m| m.description.contains("microseconds"))
            .expect("the time migration")
            .version;
        let old = sqlx::PgPool::connect(&schema.url).await.unwrap();
        migrator().run_to(time_migration - 1, &old).await.unwrap();
        sqlx::query(
            "INSERT INTO scan_jobs (id, user_id, status, stage, image_key, content_type, hint, \
             locale, trace_carrier, attempts, lease_epoch, created_at_ms, updated_at_ms, \
             finished_at_ms, dead_at_ms) \
             VALUES ('j', 'u', 4, 3, 'k', 'image/png', '', 'ko-KR', '{}', 3, 3, \
             1764640800123, 1764640801000, 1764640809456, 1764640809456)",
        )
        .execute(&old)
        .await
        .unwrap();
        old.close().await;

        let store = PgJobStore::connect(&schema.url).await.unwrap();
        let job = store.get("j").await.unwrap().unwrap();
        let at_ms = |ms| UNIX_EPOCH + Duration::from_millis(ms);
        assert_eq!(job.created_at, at_ms(1_764_640_800_123));
        assert_eq!(job.finished_at, Some(at_ms(1_764_640_809_456)));
        assert_eq!(job.dead_at, Some(at_ms(1_764_640_809_456)));
        let dead = store
            .dead_letters(Some(at_ms(1_764_640_809_457)), 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1, "the dead-letter index still answers");
        store.close().await;
    }
}
