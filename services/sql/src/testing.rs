//! For tests: a private PostgreSQL schema per test on the server `TEST_DATABASE_URL` names.

use sqlx::{AssertSqlSafe, Connection, postgres::PgConnection};

/// Where the tests find PostgreSQL unless `TEST_DATABASE_URL` says otherwise.
pub const DEFAULT_TEST_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// A schema `t_<uuid>` that exists for one test, and a database URL whose connections use it
/// (`search_path`). Dropped with everything in it when the value is dropped, even after a panic.
pub struct PgSchema {
    /// Connect here: the server's URL with the schema as `search_path`.
    pub url: String,
    base: String,
    name: String,
}

impl PgSchema {
    /// Creates the schema; panics with the way out when PostgreSQL cannot be reached, because a
    /// skipped test would pass without testing anything.
    pub async fn create() -> Self {
        let base = std::env::var("TEST_DATABASE_URL")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_TEST_DATABASE_URL.to_owned());
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&base).await.unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {base} ({e}); start it with infra/services.sh \
                 or point TEST_DATABASE_URL at a server"
            )
        });
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&mut conn)
            .await
            .expect("create the test schema");
        conn.close().await.ok();
        let sep = if base.contains('?') { '&' } else { '?' };
        Self {
            url: format!("{base}{sep}options[search_path]={name}"),
            base,
            name,
        }
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let statement = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name);
        execute_detached(
            &self.base,
            statement,
            &format!("drop test schema {}", self.name),
        );
    }
}

/// Runs `statement` on a connection of its own to `url`, from a thread of its own, and says on
/// stderr when it failed (`what`): for a `Drop` (a test's schema or database), which runs inside
/// the test's runtime and cannot block on it.
pub fn execute_detached(url: &str, statement: String, what: &str) {
    let url = url.to_owned();
    let done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut conn = PgConnection::connect(&url).await?;
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut conn)
                .await?;
            conn.close().await
        })
        .map_err(std::io::Error::other)
    })
    .join();
    if !matches!(done, Ok(Ok(()))) {
        eprintln!("failed to {what}: {done:?}");
    }
}

/// One store-conformance suite run against both of a SQL store's databases: for each case
/// `async fn case(store: S)`, written once for any store `S`, a test `sqlite::case` on a file in
/// a temporary directory and a test `postgres::case` on a [`PgSchema`] of its own. The store
/// types are opened with `connect(url)` and ended with `close()`, as every SQL store of the
/// workspace is ([`sql_store!`](crate::sql_store)); the suite's crate needs `tokio` and
/// `tempfile` (dev-dependencies of every crate with such a suite). One macro, so that the
/// stores of every service are held to their contract the same way.
///
/// ```ignore
/// ecoscan_sql::store_conformance! {
///     sqlite: ecoscan_reward::store::SqliteRewardStore, "reward.db";
///     postgres: ecoscan_reward::store::PgRewardStore;
///     cases: first_grant_is_granted, list_owned_is_oldest_first,
/// }
/// ```
#[macro_export]
macro_rules! store_conformance {
    (
        sqlite: $sqlite:ty, $file:literal;
        postgres: $postgres:ty;
        cases: $($case:ident),* $(,)?
    ) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let dir = tempfile::TempDir::new().unwrap();
                    let url = format!(concat!("sqlite://{}/", $file, "?mode=rwc"), dir.path().display());
                    let store = <$sqlite>::connect(&url).await.unwrap();
                    super::$case(store.clone()).await;
                    store.close().await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let schema = $crate::testing::PgSchema::create().await;
                    let store = <$postgres>::connect(&schema.url).await.unwrap();
                    super::$case(store.clone()).await;
                    store.close().await;
                }
            )*
        }
    };
}
