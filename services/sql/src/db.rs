//! [`Db`]: what every SQL store runs its statements on, a connection pool that also works
//! behind a PgBouncer in transaction mode ([`Pooler::Transaction`]), and [`Tx`], a transaction
//! on it. One place for what a pooler asks of every statement, so the stores' statements stay as
//! they are written.
//!
//! Behind PgBouncer in transaction mode a server connection is this client's only from `BEGIN`
//! to `COMMIT` (outside a transaction, only until the next `ReadyForQuery`). sqlx runs a
//! statement with arguments in two round trips, each ended by its own `Sync` (Parse/Describe,
//! then Bind/Execute), and names the statements it prepares (`sqlx_s_1`, …) to keep them on the
//! connection; between the two round trips PgBouncer may hand the server connection to another
//! client, and a named statement stays on a server connection other clients get later
//! (`prepared statement "sqlx_s_1" already exists`). Turning sqlx's statement cache off does not
//! help: sqlx still names the statements of a persistent query. So in transaction mode every
//! statement is unnamed (`persistent(false)`) and runs inside `BEGIN … COMMIT`: both of its
//! round trips stay on the one server connection the transaction holds.
//!
//! Every statement run through a [`Db`] (and every `BEGIN`) reports its outcome into the
//! database's [`StoreHealth`] when it has one ([`Db::health`]; PostgreSQL pools do): an answer,
//! or a transport fault ([`crate::fault_kind`]).
//!
//! Waiting for a connection is bounded by `DATABASE_ACQUIRE_TIMEOUT`, in every mode: sqlx's pool
//! bounds taking a connection from it (opening one included, and its first statement, in
//! [`crate::connect_postgres`], where a session-mode PgBouncer makes a new client wait for a
//! server connection); in transaction mode the `BEGIN` that waits in PgBouncer's queue
//! (`cl_waiting`) for a server connection has the same bound. Either way the statement fails with
//! an error naming the setting, which the stores report as retryable (`UNAVAILABLE`).

use std::{fmt, io, time::Duration};

use ecoscan_common::store_health::{FaultKind, StoreHealth};

use futures::{StreamExt as _, TryStreamExt as _, future::BoxFuture, stream::BoxStream};
use sqlx::{
    Database, Either, Error, Execute, Executor, Pool, SqlStr, Transaction, pool::PoolConnection,
};

/// How long a connection may sit idle in its pool behind a session-mode pooler
/// ([`Pooler::Session`]).
pub const SESSION_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// What sits between the services and PostgreSQL (`DATABASE_POOLER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooler {
    /// PostgreSQL itself: statements run as sqlx runs them.
    #[default]
    None,
    /// A pooler that keeps a server connection for a client's whole session (PgBouncer
    /// `pool_mode = session`): statements run as sqlx runs them, and a connection idle for
    /// [`SESSION_IDLE_TIMEOUT`] is closed. An idle client connection holds its server
    /// connection; kept for sqlx's default 10 minutes, the connections one service opened in a
    /// burst would starve the other services of the process (and every other process) of the
    /// pooler's few server connections long after the burst.
    Session,
    /// A pooler that lends a server connection for one transaction (PgBouncer
    /// `pool_mode = transaction`): every statement unnamed and inside a transaction.
    Transaction,
}

impl std::str::FromStr for Pooler {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "none" => Ok(Self::None),
            "session" => Ok(Self::Session),
            "transaction" => Ok(Self::Transaction),
            other => Err(format!(
                "DATABASE_POOLER must be none (PostgreSQL itself), session or transaction (the \
                 pool_mode of the PgBouncer in front), not {other:?}"
            )),
        }
    }
}

/// A connection pool and what the pooler in front of the database asks of it: what every SQL
/// store holds. `&Db` is an [`Executor`] (each statement on a connection of the pool, in its own
/// transaction in transaction mode); [`Db::begin`] starts a transaction.
pub struct Db<DB: Database> {
    pool: Pool<DB>,
    pooler: Pooler,
    acquire_timeout: Duration,
    /// Told the outcome of every statement; `None` for a database in this process (SQLite).
    health: Option<StoreHealth>,
}

impl<DB: Database> Clone for Db<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            pooler: self.pooler,
            acquire_timeout: self.acquire_timeout,
            health: self.health.clone(),
        }
    }
}

impl<DB: Database> fmt::Debug for Db<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Db")
            .field("pool", &self.pool)
            .field("pooler", &self.pooler)
            .finish()
    }
}

impl<DB: Database> From<Pool<DB>> for Db<DB> {
    /// A pool with nothing between it and the database (SQLite, PostgreSQL without a pooler).
    fn from(pool: Pool<DB>) -> Self {
        let acquire_timeout = pool.options().get_acquire_timeout();
        Self {
            pool,
            pooler: Pooler::None,
            acquire_timeout,
            health: None,
        }
    }
}

/// The error of a wait for a connection that took `timeout`: it names the setting.
pub(crate) fn acquire_timed_out(timeout: Duration) -> Error {
    Error::Io(io::Error::new(
        io::ErrorKind::TimedOut,
        format!(
            "no database connection within DATABASE_ACQUIRE_TIMEOUT ({} ms): every connection \
             of this service's share of DATABASE_MAX_CONNECTIONS is busy, or the pooler in \
             front of the database has no server connection free (its pool is smaller than \
             the replicas' budgets; see docs/postgres-poolers.md)",
            timeout.as_millis()
        ),
    ))
}

impl<DB: Database> Db<DB> {
    /// `pool` behind `pooler`; waits for a connection are bounded by the pool's acquire timeout.
    pub fn new(pool: Pool<DB>, pooler: Pooler) -> Self {
        Self {
            pooler,
            ..Self::from(pool)
        }
    }

    /// This database with `health` told the outcome of every statement.
    #[must_use]
    pub fn with_health(mut self, health: StoreHealth) -> Self {
        self.health = Some(health);
        self
    }

    /// Whether the database answers (PostgreSQL; `None` for SQLite).
    pub fn health(&self) -> Option<&StoreHealth> {
        self.health.as_ref()
    }

    /// The pool's connections now: open, and idle among them.
    pub fn pool_stats(&self) -> ecoscan_common::store_health::PoolStats {
        ecoscan_common::store_health::PoolStats {
            open: self.pool.size(),
            idle: u32::try_from(self.pool.num_idle()).unwrap_or(u32::MAX),
        }
    }

    /// Tells the health the outcome of a statement (or a `BEGIN`).
    fn report(&self, result: Result<(), &Error>) {
        let Some(health) = &self.health else { return };
        health.mark_span();
        match result {
            Ok(()) => health.ok(),
            Err(e) => {
                let fault = crate::fault_kind(e);
                health.report(fault);
                mark_span_failed(e, fault);
            }
        }
    }

    /// The pool itself: statements run on it directly bypass what the pooler asks for.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// What is in front of the database.
    pub fn pooler(&self) -> Pooler {
        self.pooler
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    fn named(&self, e: Error) -> Error {
        match e {
            Error::PoolTimedOut => acquire_timed_out(self.acquire_timeout),
            e => e,
        }
    }

    /// Starts a transaction on a connection of the pool.
    pub async fn begin(&self) -> Result<Tx<DB>, Error>
    where
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    {
        let began = self.begin_unreported().await;
        self.report(began.as_ref().map(drop));
        began
    }

    async fn begin_unreported(&self) -> Result<Tx<DB>, Error>
    where
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    {
        match self.pooler {
            Pooler::None | Pooler::Session => Ok(Tx {
                inner: TxInner::Sqlx(self.pool.begin().await.map_err(|e| self.named(e))?),
            }),
            Pooler::Transaction => {
                let conn = self.pool.acquire().await.map_err(|e| self.named(e))?;
                let mut held = Held {
                    conn: Some(conn),
                    clean: false,
                };
                // BEGIN is what waits in the pooler's queue for a server connection. Given up
                // on, the connection is closed (`held` is not clean): it would carry the
                // unanswered BEGIN to whoever took it next.
                match tokio::time::timeout(
                    self.acquire_timeout,
                    sqlx::raw_sql("BEGIN").execute(held.conn()),
                )
                .await
                {
                    Ok(began) => {
                        began?;
                    }
                    Err(_) => return Err(acquire_timed_out(self.acquire_timeout)),
                }
                Ok(Tx {
                    inner: TxInner::Pooled(held),
                })
            }
        }
    }
}

/// Marks the store operation's span (`#[db_span]`, named `db`) the statement ran in as failed
/// with the error (`error.type`: the fault's kind, or `database_error` for an error the
/// database answered): the span's record of it, without a log line per failed statement.
fn mark_span_failed(e: &Error, fault: Option<FaultKind>) {
    let span = tracing::Span::current();
    if span.metadata().is_some_and(|m| m.name() == "db") {
        let kind = fault.map_or("database_error", FaultKind::as_str);
        ecoscan_common::telemetry::record_error(&span, kind, &e.to_string());
    }
}

/// A connection of the pool with a transaction this module began by hand: closed when dropped
/// before the transaction ended (a cancelled caller, a timeout), rather than handed to the next
/// caller inside it.
struct Held<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    clean: bool,
}

impl<DB: Database> Held<DB> {
    fn conn(&mut self) -> &mut DB::Connection {
        self.conn.as_mut().expect("held until dropped")
    }

    /// Ends the transaction with `statement` (`COMMIT` or `ROLLBACK`).
    async fn end(mut self, statement: &'static str) -> Result<(), Error>
    where
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(self.conn())
            .await?;
        self.clean = true;
        Ok(())
    }
}

impl<DB: Database> Drop for Held<DB> {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take()
            && !self.clean
        {
            conn.close_on_drop();
        }
    }
}

/// A transaction of a [`Db`]: `&mut Tx` is an [`Executor`]; [`commit`](Self::commit) ends it,
/// dropping it rolls it back.
pub struct Tx<DB: Database> {
    inner: TxInner<DB>,
}

enum TxInner<DB: Database> {
    /// sqlx's own, when nothing is in front of the database.
    Sqlx(Transaction<'static, DB>),
    /// Begun by hand, its statements unnamed ([`Pooler::Transaction`]).
    Pooled(Held<DB>),
}

impl<DB: Database> fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.inner {
            TxInner::Sqlx(_) => "Tx",
            TxInner::Pooled(_) => "Tx(pooled)",
        })
    }
}

impl<DB: Database> Tx<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    /// Commits the transaction.
    pub async fn commit(self) -> Result<(), Error> {
        match self.inner {
            TxInner::Sqlx(tx) => tx.commit().await,
            TxInner::Pooled(held) => held.end("COMMIT").await,
        }
    }

    /// Rolls the transaction back.
    pub async fn rollback(self) -> Result<(), Error> {
        match self.inner {
            TxInner::Sqlx(tx) => tx.rollback().await,
            TxInner::Pooled(held) => held.end("ROLLBACK").await,
        }
    }
}

/// A statement run unnamed: prepared for this execution only, never kept on the connection.
struct Unnamed<E>(E);

impl<'q, DB: Database, E: Execute<'q, DB>> Execute<'q, DB> for Unnamed<E> {
    fn sql(self) -> SqlStr {
        self.0.sql()
    }

    fn statement(&self) -> Option<&DB::Statement> {
        self.0.statement()
    }

    fn take_arguments(
        &mut self,
    ) -> Result<Option<<DB as Database>::Arguments>, sqlx::error::BoxDynError> {
        self.0.take_arguments()
    }

    fn persistent(&self) -> bool {
        false
    }
}

type Step<DB> = Either<<DB as Database>::QueryResult, <DB as Database>::Row>;

impl<'t, DB: Database> Executor<'t> for &'t mut Tx<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    type Database = DB;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<Step<DB>, Error>>
    where
        't: 'e,
        E: 'q + Execute<'q, DB>,
    {
        match &mut self.inner {
            TxInner::Sqlx(tx) => (&mut **tx).fetch_many(query),
            TxInner::Pooled(held) => held.conn().fetch_many(Unnamed(query)),
        }
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<DB::Row>, Error>>
    where
        't: 'e,
        E: 'q + Execute<'q, DB>,
    {
        match &mut self.inner {
            TxInner::Sqlx(tx) => (&mut **tx).fetch_optional(query),
            TxInner::Pooled(held) => held.conn().fetch_optional(Unnamed(query)),
        }
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [DB::TypeInfo],
    ) -> BoxFuture<'e, Result<DB::Statement, Error>>
    where
        't: 'e,
    {
        match &mut self.inner {
            TxInner::Sqlx(tx) => (&mut **tx).prepare_with(sql, parameters),
            TxInner::Pooled(held) => held.conn().prepare_with(sql, parameters),
        }
    }
}

impl<DB: Database> Db<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    /// `query` in a transaction of its own, its steps collected ([`Pooler::Transaction`]).
    async fn in_transaction<'q, E: 'q + Execute<'q, DB>>(
        &self,
        query: E,
    ) -> Result<Vec<Step<DB>>, Error> {
        // Unreported: the statement's outcome, reported by the caller, is this call's.
        let mut tx = self.begin_unreported().await?;
        let steps = (&mut tx).fetch_many(query).try_collect::<Vec<_>>().await;
        match steps {
            Ok(steps) => {
                tx.commit().await?;
                Ok(steps)
            }
            Err(e) => {
                // A failed rollback closes the connection (it is not clean); the statement's
                // error is the one to report.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }
}

impl<'p, DB: Database> Executor<'p> for &'p Db<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    type Database = DB;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<Step<DB>, Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, DB>,
    {
        let steps = match self.pooler {
            Pooler::None | Pooler::Session => self
                .pool
                .fetch_many(query)
                .map_err(|e| self.named(e))
                .boxed(),
            Pooler::Transaction => futures::stream::once(self.in_transaction(query))
                .map_ok(|steps| futures::stream::iter(steps.into_iter().map(Ok)))
                .try_flatten()
                .boxed(),
        };
        // A statement's result (not each row) or its error is its outcome.
        steps
            .inspect(|step| match step {
                Ok(Either::Left(_)) => self.report(Ok(())),
                Ok(Either::Right(_)) => {}
                Err(e) => self.report(Err(e)),
            })
            .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<DB::Row>, Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, DB>,
    {
        Box::pin(async move {
            let row = match self.pooler {
                Pooler::None | Pooler::Session => self
                    .pool
                    .fetch_optional(query)
                    .await
                    .map_err(|e| self.named(e)),
                Pooler::Transaction => self.in_transaction(query).await.map(|steps| {
                    steps.into_iter().find_map(|step| match step {
                        Either::Right(row) => Some(row),
                        Either::Left(_) => None,
                    })
                }),
            };
            self.report(row.as_ref().map(drop));
            row
        })
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [DB::TypeInfo],
    ) -> BoxFuture<'e, Result<DB::Statement, Error>>
    where
        'p: 'e,
    {
        self.pool.prepare_with(sql, parameters)
    }
}
