//! How every ecoscan service opens its SQL store: a SQLite file for the embedded suite, or
//! PostgreSQL with versioned migrations in production; and what differs between the two
//! ([`Dialect`]), so that a store's queries are written once, generic over the database. The
//! stores themselves (their traits and queries) live beside the service that owns the data,
//! written with [`sql_store!`] for a store's type and [`db_span`] for the span of each of its
//! operations (Redis stores use the latter too).

mod db;
mod macros;
pub mod testing;

pub use db::{Db, Pooler, Tx};

pub use ecoscan_sql_macros::db_span;

/// What the macros name in the crates that use them.
#[doc(hidden)]
pub mod __private {
    pub use sqlx::Pool;
}

use std::{
    collections::HashMap,
    str::FromStr,
    sync::{LazyLock, Mutex, OnceLock},
    time::Duration,
};

use ecoscan_common::store_health::{FaultKind, StoreHealth};
use sqlx::{
    Postgres, Sqlite,
    migrate::Migrator,
    postgres::{PgConnectOptions, PgPoolOptions},
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

/// Whether `e` means the database did not answer (and how), or `None` when it answered, with
/// an error or not: a constraint violation, a row that does not decode, a closed pool (this
/// process is shutting down). PostgreSQL's connection exceptions (`08…`) and its shutting down
/// or starting up (`57P01`–`57P03`) count as faults: the server is going or not there yet.
pub fn fault_kind(e: &sqlx::Error) -> Option<FaultKind> {
    match e {
        sqlx::Error::Io(io) => Some(FaultKind::of_io(io)),
        sqlx::Error::PoolTimedOut => Some(FaultKind::TimedOut),
        sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => Some(FaultKind::Other),
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("57P03") => Some(FaultKind::Refused),
            Some(code) if code.starts_with("08") || code == "57P01" || code == "57P02" => {
                Some(FaultKind::Reset)
            }
            _ => None,
        },
        _ => None,
    }
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

/// How long a PostgreSQL connection may sit idle in its pool before it is closed: after a
/// burst, or an outage during which every caller opened one (each waiting for a path that was
/// dead), the pool shrinks back to what the load uses within this, instead of keeping them all
/// for sqlx's default ten minutes.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The options of every PostgreSQL pool: `max_connections`, idle connections closed after
/// [`POOL_IDLE_TIMEOUT`], and a liveness ping before a connection is handed out only when it
/// has been idle for `idle_before_ping` or longer.
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
        .idle_timeout(POOL_IDLE_TIMEOUT)
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

/// Where one service's PostgreSQL store stands among the settings: its name, its weight in the
/// process's connection budget, and its own direct URL for migrations when it has one.
#[derive(Debug, Clone)]
pub struct PgStore {
    /// The service (`ingest`), as [`share_connections`] names it.
    pub service: &'static str,
    /// Its connections when `DATABASE_MAX_CONNECTIONS` is unset, and its weight when the
    /// budget is split among the services of one process.
    pub weight: u32,
    /// `<SERVICE>_DATABASE_DIRECT_URL`, read by the service (it wins over
    /// `DATABASE_DIRECT_URL`).
    pub direct_url: Option<String>,
}

/// The settings of every PostgreSQL store of a process (each names itself in its errors):
///
/// - `DATABASE_POOLER`: `none` (default: PostgreSQL itself), `session` (PgBouncer
///   `pool_mode = session`: idle connections closed after 5 s, so that none holds a server
///   connection another service needs) or `transaction` (PgBouncer `pool_mode = transaction`:
///   every statement unnamed and in a transaction, migrations only through a direct URL);
/// - `DATABASE_DIRECT_URL` (or `<SERVICE>_DATABASE_DIRECT_URL`): the database itself, not the
///   pooler, used only to apply migrations (they hold an advisory lock, which needs a session);
///   required with `DATABASE_POOLER=transaction`;
/// - `DATABASE_MAX_CONNECTIONS`: the process's total connections to the database (or pooler),
///   split among its services by their weights (ingest 16, reward, analytics and notification
///   10 each); unset, each service gets its weight;
/// - `DATABASE_ACQUIRE_TIMEOUT`: the bound on waiting for a connection (`10s`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgSettings {
    pub pooler: Pooler,
    pub direct_url: Option<String>,
    pub max_connections: Option<u32>,
    pub acquire_timeout: Duration,
}

/// The default of `DATABASE_ACQUIRE_TIMEOUT`.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

fn env(name: &str, value: Result<String, std::env::VarError>) -> Option<(String, String)> {
    value
        .ok()
        .filter(|v| !v.trim().is_empty())
        .map(|v| (name.to_owned(), v.trim().to_owned()))
}

impl PgSettings {
    /// Reads the settings from the environment.
    pub fn from_env() -> Result<Self, String> {
        let pooler = match env("DATABASE_POOLER", std::env::var("DATABASE_POOLER")) {
            Some((_, v)) => v.parse()?,
            None => Pooler::None,
        };
        let direct_url =
            env("DATABASE_DIRECT_URL", std::env::var("DATABASE_DIRECT_URL")).map(|(_, v)| v);
        let max_connections = match env(
            "DATABASE_MAX_CONNECTIONS",
            std::env::var("DATABASE_MAX_CONNECTIONS"),
        ) {
            Some((name, v)) => Some(v.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| {
                format!("{name} must be a positive number of connections, not {v:?}")
            })?),
            None => None,
        };
        let acquire_timeout = match env(
            "DATABASE_ACQUIRE_TIMEOUT",
            std::env::var("DATABASE_ACQUIRE_TIMEOUT"),
        ) {
            Some((name, v)) => parse_duration(&v).filter(|d| !d.is_zero()).ok_or_else(|| {
                format!(
                    "{name} must be a positive duration (250ms, 10s, 1m; a bare number is \
                         milliseconds), not {v:?}"
                )
            })?,
            None => DEFAULT_ACQUIRE_TIMEOUT,
        };
        Ok(Self {
            pooler,
            direct_url,
            max_connections,
            acquire_timeout,
        })
    }
}

/// `250` (milliseconds), `250ms`, `2s`, `1m`: the format of every duration setting.
fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    let (num, unit) = v
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((v, "ms"), |i| v.split_at(i));
    let n: f64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "ms" => n,
        "s" => n * 1_000.0,
        "m" => n * 60_000.0,
        "h" => n * 3_600_000.0,
        _ => return None,
    };
    (ms.is_finite() && ms >= 0.0).then(|| Duration::from_secs_f64(ms / 1_000.0))
}

/// The services of this process that keep their stores in PostgreSQL, with their weights: set
/// once by a process that runs several (`ecoscan up`), before any opens its store, so that they
/// split `DATABASE_MAX_CONNECTIONS` among them. A process that never sets it runs one service,
/// which gets the whole budget.
static PROCESS_SERVICES: OnceLock<Vec<(&'static str, u32)>> = OnceLock::new();

/// Declares the services of this process that share its connection budget (see
/// [`PROCESS_SERVICES`]); the first declaration stands.
pub fn share_connections(services: Vec<(&'static str, u32)>) {
    let _ = PROCESS_SERVICES.set(services);
}

/// `service`'s connections: `budget` split among `services` by weight (each at least one, what
/// rounding leaves over to the heaviest), or its weight when there is no budget.
pub fn connection_share(
    budget: Option<u32>,
    services: &[(&'static str, u32)],
    service: &str,
    weight: u32,
) -> Result<u32, String> {
    let Some(budget) = budget else {
        return Ok(weight);
    };
    let services: Vec<(&str, u32)> = if services.iter().any(|(s, _)| *s == service) {
        services.to_vec()
    } else {
        vec![(service, weight)]
    };
    let n = u32::try_from(services.len()).unwrap_or(u32::MAX);
    if budget < n {
        return Err(format!(
            "DATABASE_MAX_CONNECTIONS={budget} is fewer than the {n} services of this process \
             that use PostgreSQL ({}): each needs at least one connection",
            services
                .iter()
                .map(|(s, _)| *s)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let total: u64 = services.iter().map(|(_, w)| u64::from(*w)).sum();
    let share = |w: u32| (u64::from(budget) * u64::from(w) / total.max(1)).max(1) as u32;
    let given: u32 = services.iter().map(|(_, w)| share(*w)).sum();
    let mine = share(
        services
            .iter()
            .find(|(s, _)| *s == service)
            .map_or(weight, |(_, w)| *w),
    );
    let heaviest = services
        .iter()
        .max_by_key(|(_, w)| *w)
        .map_or(service, |(s, _)| *s);
    Ok(if heaviest == service {
        mine + budget.saturating_sub(given)
    } else {
        mine
    })
}

fn config_error(message: String) -> sqlx::Error {
    sqlx::Error::Configuration(message.into())
}

/// Connects `store` to PostgreSQL at `url` (with `search_path` when given) with the process's
/// [`PgSettings`], and applies pending migrations: through the direct URL when one is set (the
/// only way behind a transaction-mode pooler), else through the pool. Replicas starting
/// together wait on the migrator's advisory lock, so one applies them and the others find them
/// done.
pub async fn connect_postgres(
    url: &str,
    store: &PgStore,
    search_path: Option<&str>,
    migrator: &Migrator,
) -> Result<Db<Postgres>, sqlx::Error> {
    let settings = PgSettings::from_env().map_err(config_error)?;
    connect_postgres_with(url, store, search_path, migrator, &settings).await
}

/// [`connect_postgres`] with the settings given.
pub async fn connect_postgres_with(
    url: &str,
    store: &PgStore,
    search_path: Option<&str>,
    migrator: &Migrator,
    settings: &PgSettings,
) -> Result<Db<Postgres>, sqlx::Error> {
    let options = |url: &str| -> Result<PgConnectOptions, sqlx::Error> {
        // Not sent: PgBouncer refuses a startup parameter it does not know (unless listed in its
        // ignore_startup_parameters), and PostgreSQL 12 and later print floats exactly by
        // default (sqlx reads them in binary anyway).
        let opts = PgConnectOptions::from_str(url)?.extra_float_digits(None);
        Ok(match search_path {
            Some(path) => opts.options([("search_path", path)]),
            None => opts,
        })
    };
    let direct = store
        .direct_url
        .as_deref()
        .or(settings.direct_url.as_deref());
    let max_connections = connection_share(
        settings.max_connections,
        PROCESS_SERVICES.get().map_or(&[], Vec::as_slice),
        store.service,
        store.weight,
    )
    .map_err(config_error)?;
    match (direct, settings.pooler) {
        (Some(direct), _) => {
            // A pool of one: the migrator's advisory lock and its statements on one session.
            let direct = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(settings.acquire_timeout)
                .connect_with(options(direct)?)
                .await?;
            let migrated = migrator.run(&direct).await;
            direct.close().await;
            migrated?;
        }
        (None, Pooler::Transaction) => {
            return Err(config_error(format!(
                "DATABASE_POOLER=transaction: {}'s migrations need a session of their own \
                 (an advisory lock, prepared statements), which a transaction-mode pooler does \
                 not keep; set DATABASE_DIRECT_URL (or {}_DATABASE_DIRECT_URL) to the database \
                 itself, not the pooler",
                store.service,
                store.service.to_ascii_uppercase()
            )));
        }
        (None, Pooler::None | Pooler::Session) => {}
    }
    let mut pool = postgres_pool_options(max_connections, IDLE_BEFORE_PING)
        .acquire_timeout(settings.acquire_timeout);
    if settings.pooler == Pooler::Session {
        pool = pool.idle_timeout(db::SESSION_IDLE_TIMEOUT);
    }
    let pool = pool
        // A session-mode pooler admits a new client at once and makes its first statement wait
        // for a server connection: that wait happens here, inside the pool's bound on taking a
        // connection (`DATABASE_ACQUIRE_TIMEOUT`), not in a statement that nothing bounds.
        .after_connect(|conn, _| {
            Box::pin(async move { sqlx::raw_sql("SELECT 1").execute(conn).await.map(drop) })
        })
        .connect_with(options(url)?)
        .await
        .map_err(|e| match e {
            sqlx::Error::PoolTimedOut => db::acquire_timed_out(settings.acquire_timeout),
            e => e,
        })?;
    if direct.is_none() {
        migrator.run(&pool).await?;
    }
    Ok(Db::new(pool, settings.pooler).with_health(StoreHealth::new("postgres", url)))
}

#[cfg(test)]
mod tests;
