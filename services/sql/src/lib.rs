//! How every ecoscan service opens its SQL store: a SQLite file for the embedded suite, or
//! PostgreSQL with versioned migrations in production. The stores themselves (their traits and
//! queries) live beside the service that owns the data.

pub mod testing;

use std::{str::FromStr, time::Duration};

use sqlx::{
    migrate::Migrator,
    postgres::{PgPool, PgPoolOptions},
    sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
    },
};

/// True for the database URLs that select PostgreSQL.
pub fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// Whether trying the same statement again later may succeed: the database restarted or is
/// unreachable, a connection dropped, the pool was exhausted. A row that does not decode stays
/// so however often it is read.
pub fn is_transient(e: &sqlx::Error) -> bool {
    !matches!(
        e,
        sqlx::Error::Decode(_)
            | sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::ColumnNotFound(_)
            | sqlx::Error::TypeNotFound { .. }
    )
}

/// Opens (creating when needed) the SQLite database at `url` and applies `schema` (idempotent
/// `CREATE … IF NOT EXISTS` statements). A file database gets its parent directory, WAL
/// journaling and a busy timeout so concurrent writers wait instead of failing.
pub async fn open_sqlite(url: &str, schema: &'static str) -> Result<SqlitePool, sqlx::Error> {
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    let mut options = SqliteConnectOptions::from_str(url)?;
    let mut pool = SqlitePoolOptions::new();
    if in_memory {
        // Every connection to an in-memory database sees its own empty database, and the
        // database vanishes with its last connection: keep exactly one, forever.
        pool = pool
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None);
    } else {
        if let Some(parent) = options.get_filename().parent()
            && !parent.as_os_str().is_empty()
        {
            tokio::fs::create_dir_all(parent).await?;
        }
        options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10));
        pool = pool.max_connections(8);
    }
    let pool = pool.connect_with(options).await?;
    sqlx::raw_sql(schema).execute(&pool).await?;
    Ok(pool)
}

/// `migrator` (a service's `sqlx::migrate!` of its `migrations/postgres/` directory: files
/// `<version>_<description>.sql`, embedded at build time) recording what it applied in
/// `table`: each service has its own table, so services sharing one database (through
/// `DATABASE_URL`) never mistake each other's versions for theirs.
pub fn tracked_in(table: &'static str, mut migrator: Migrator) -> Migrator {
    migrator.dangerous_set_table_name(table);
    migrator
}

/// Connects to PostgreSQL and applies pending migrations. Replicas starting together wait on the
/// migrator's advisory lock, so one applies them and the others find them done.
pub async fn connect_postgres(
    url: &str,
    max_connections: u32,
    migrator: &Migrator,
) -> Result<PgPool, sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(url)
        .await?;
    migrator.run(&pool).await?;
    Ok(pool)
}

#[cfg(test)]
mod tests {
    use sqlx::Row;

    use super::*;

    const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT NOT NULL);";

    #[test]
    fn a_dropped_connection_is_transient_and_an_undecodable_row_is_not() {
        assert!(is_transient(&sqlx::Error::PoolTimedOut));
        assert!(is_transient(&sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset
        ))));
        assert!(!is_transient(&sqlx::Error::ColumnNotFound("x".into())));
    }

    #[test]
    fn postgres_urls_are_recognised() {
        assert!(is_postgres("postgres://u@h/db"));
        assert!(is_postgres("postgresql://u@h/db"));
        assert!(!is_postgres("sqlite://./data/x.db"));
    }

    #[tokio::test]
    async fn a_sqlite_file_is_created_with_its_directory_and_schema_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("a/b/x.db").display()
        );
        let pool = open_sqlite(&url, SCHEMA).await.unwrap();
        sqlx::query("INSERT INTO t (v) VALUES ('kept')")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
        let again = open_sqlite(&url, SCHEMA).await.unwrap();
        let v: String = sqlx::query("SELECT v FROM t")
            .fetch_one(&again)
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            v, "kept",
            "reopening applies the schema again without losing rows"
        );
    }

    #[tokio::test]
    async fn an_in_memory_database_keeps_its_data_across_queries() {
        let pool = open_sqlite("sqlite::memory:", SCHEMA).await.unwrap();
        sqlx::query("INSERT INTO t (v) VALUES ('x')")
            .execute(&pool)
            .await
            .unwrap();
        let n: i64 = sqlx::query("SELECT COUNT(*) FROM t")
            .fetch_one(&pool)
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1);
    }

    #[tokio::test]
    async fn migrations_apply_once_into_their_own_table() {
        let schema = testing::PgSchema::create().await;
        let m = tracked_in("_sql_test_migrations", sqlx::migrate!("./test-migrations"));
        let pool = connect_postgres(&schema.url, 2, &m).await.unwrap();
        let again = connect_postgres(&schema.url, 2, &m).await.unwrap();
        let n: i64 = sqlx::query("SELECT COUNT(*) FROM _sql_test_migrations")
            .fetch_one(&again)
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1);
        pool.close().await;
        again.close().await;
    }
}
