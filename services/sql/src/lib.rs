//! How every ecoscan service opens its SQL store: a SQLite file for the embedded suite, or
//! PostgreSQL with versioned migrations in production; and what differs between the two
//! ([`Dialect`]), so that a store's queries are written once, generic over the database. The
//! stores themselves (their traits and queries) live beside the service that owns the data,
//! written with [`sql_store!`] for a store's type and [`db_span`] for the span of each of its
//! operations (Redis stores use the latter too).

mod macros;
pub mod testing;

pub use ecoscan_sql_macros::db_span;

/// What the macros name in the crates that use them.
#[doc(hidden)]
pub mod __private {
    pub use sqlx::Pool;
}

use std::{
    collections::HashMap,
    str::FromStr,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use sqlx::{
    Postgres, Sqlite,
    migrate::Migrator,
    postgres::{PgPool, PgPoolOptions},
    sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
    },
};

/// What an operation of a SQL store fails with, in every service that has one: whether trying
/// again may help decides between `UNAVAILABLE` and `INTERNAL` in the service's error map.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database is down, a connection dropped, the pool is exhausted: the same call may
    /// succeed later.
    #[error("the database is unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// Anything else (a failed migration, a row that does not decode): trying again is no use.
    #[error("the database failed: {0}")]
    Failed(#[source] sqlx::Error),
    /// A stored row holds what no version of the service writes.
    #[error("a stored row is corrupt: {0}")]
    Corrupt(String),
}

impl StoreError {
    /// Whether the same call may succeed when tried again.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if is_transient(&e) {
            Self::Unavailable(e)
        } else {
            Self::Failed(e)
        }
    }
}

/// What a store's code, written once, needs to know about the database it runs on. Statements
/// are written in PostgreSQL's syntax with numbered placeholders (`$1`), in the common subset
/// of both databases (`ON CONFLICT … DO NOTHING`, `RETURNING`, `TRUE`/`FALSE`); what is not in
/// it (column types, the schema itself) lives in each database's migrations.
pub trait Dialect: sqlx::Database {
    /// `db.system` of a span around a statement (OpenTelemetry's name for the database).
    const SYSTEM: &'static str;

    /// `statement` in this database's syntax: unchanged for PostgreSQL; for SQLite each `$n`
    /// becomes `?n` (SQLite's numbered placeholder, bound by number as on PostgreSQL, where a
    /// bare `$n` would be a named one, bound in order of first use).
    fn sql(statement: &'static str) -> &'static str;

    /// Rows a statement inserted, changed or deleted.
    fn rows_affected(result: &Self::QueryResult) -> u64;

    /// What a `SELECT` appends to lock the rows it reads until the transaction ends:
    /// `FOR UPDATE` on PostgreSQL, nothing on SQLite (one writer at a time holds the whole
    /// database).
    const LOCK_ROWS: &'static str;
}

impl Dialect for Postgres {
    const SYSTEM: &'static str = "postgresql";
    const LOCK_ROWS: &'static str = " FOR UPDATE";

    fn sql(statement: &'static str) -> &'static str {
        statement
    }

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}

impl Dialect for Sqlite {
    const SYSTEM: &'static str = "sqlite";
    const LOCK_ROWS: &'static str = "";

    fn sql(statement: &'static str) -> &'static str {
        // Each statement is a literal in the code, so the rewritten ones are few and are kept
        // for the life of the process (sqlx caches prepared statements by their text too).
        static REWRITTEN: LazyLock<Mutex<HashMap<&'static str, &'static str>>> =
            LazyLock::new(Mutex::default);
        let mut rewritten = REWRITTEN.lock().unwrap_or_else(|e| e.into_inner());
        rewritten
            .entry(statement)
            .or_insert_with(|| Box::leak(numbered_placeholders(statement).into_boxed_str()))
    }

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}

/// `$n` → `?n` outside quoted literals and identifiers.
fn numbered_placeholders(statement: &str) -> String {
    let mut out = String::with_capacity(statement.len());
    let mut quote = None;
    let mut chars = statement.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            (None, '$') if chars.peek().is_some_and(char::is_ascii_digit) => {
                out.push('?');
                continue;
            }
            _ => {}
        }
        out.push(c);
    }
    out
}

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
    // sqlx pings every connection it hands out (and again as it takes each back), on SQLite a
    // round trip through the connection's worker thread each time, for a file in this process
    // that nothing can hang up: the ping before each statement goes.
    pool = pool.test_before_acquire(false);
    let pool = pool.connect_with(options).await?;
    sqlx::raw_sql(schema).execute(&pool).await?;
    Ok(pool)
}

/// The migrator of the crate's own migration files, embedded by its `build.rs`
/// (`ecoscan_sql_build::embed_migrations`), tracked in `table` ([`embedded`]).
#[macro_export]
macro_rules! migrator {
    ($table:literal) => {
        $crate::embedded($table, include!(concat!(env!("OUT_DIR"), "/migrations.rs")))
    };
}

/// The migrator of a service's migration files (`<version>_<description>.sql`, embedded at
/// build time by `ecoscan_sql_build::embed_migrations` as (file name, contents) pairs),
/// recording what it applied in `table`: each service has its own table, so services sharing
/// one database (through `DATABASE_URL`) never mistake each other's versions for theirs.
/// Versions, descriptions and checksums are the ones sqlx's `migrate!` gives the same files, so
/// a database migrated by either is current for the other.
///
/// # Panics
///
/// On a file name without a numeric version prefix: the build embedded something that is not a
/// migration.
pub fn embedded(table: &'static str, files: &'static [(&'static str, &'static str)]) -> Migrator {
    use sqlx::{
        SqlSafeStr as _,
        migrate::{Migration, MigrationType},
    };
    let migrations = files
        .iter()
        .map(|(name, sql)| {
            let (version, rest) = name
                .split_once('_')
                .and_then(|(v, rest)| Some((v.parse::<i64>().ok()?, rest)))
                .unwrap_or_else(|| {
                    panic!("migration {name:?} is not named <version>_<description>.sql")
                });
            let description = rest.trim_end_matches(".sql").replace('_', " ");
            Migration::new(
                version,
                description.into(),
                MigrationType::Simple,
                sql.into_sql_str(),
                sql.starts_with("-- no-transaction"),
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(table);
    migrator
}

/// How long a PostgreSQL connection may sit idle in its pool before it is pinged on its way
/// out (see [`postgres_pool_options`]).
pub const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// The options of every PostgreSQL pool: `max_connections`, and a liveness ping before a
/// connection is handed out only when it has been idle for `idle_before_ping` or longer.
///
/// sqlx pings every connection it hands out by default, and again as it takes each back: three
/// round trips for every statement. The ping before was 0.6 ms of a scan's 7.1 ms of CPU
/// (suite, Redis and PostgreSQL; bench/notes/capacity.md). The ping on the way back
/// stays (sqlx's own, not optional; it also flushes a transaction a cancelled caller dropped):
/// every connection that enters the pool answered just before. What it cannot see is
/// a connection cut while idle (a restart, a failover, an operator's `pg_terminate_backend`):
/// one idle for `idle_before_ping` is pinged first and replaced when it does not answer, so
/// after a quiet `idle_before_ping` no statement meets a dead connection. One cut sooner after
/// its last use fails the statement that next takes it, with `UNAVAILABLE` (a retryable error;
/// the job's lease and the caller's retry carry on from there, as after any outage).
pub fn postgres_pool_options(max_connections: u32, idle_before_ping: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= idle_before_ping {
                    // An error closes this connection and the pool hands out another.
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Connects to PostgreSQL and applies pending migrations. Replicas starting together wait on the
/// migrator's advisory lock, so one applies them and the others find them done.
pub async fn connect_postgres(
    url: &str,
    max_connections: u32,
    migrator: &Migrator,
) -> Result<PgPool, sqlx::Error> {
    let pool = postgres_pool_options(max_connections, IDLE_BEFORE_PING)
        .connect(url)
        .await?;
    migrator.run(&pool).await?;
    Ok(pool)
}

#[cfg(test)]
mod tests;
