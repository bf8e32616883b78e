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
fn sqlite_gets_numbered_placeholders_and_literals_stay() {
    assert_eq!(
        Sqlite::sql("SELECT $1, '$2', \"$3\" FROM t WHERE a = $10 AND b = $2"),
        "SELECT ?1, '$2', \"$3\" FROM t WHERE a = ?10 AND b = ?2"
    );
    let q = "UPDATE t SET v = $2 WHERE id = $1";
    assert!(
        std::ptr::eq(Sqlite::sql(q), Sqlite::sql(q)),
        "rewritten once"
    );
    assert_eq!(Postgres::sql(q), q);
}

#[tokio::test]
async fn numbered_placeholders_bind_by_number_on_sqlite() {
    let pool = open_sqlite("sqlite::memory:", SCHEMA).await.unwrap();
    // The second placeholder is used first: bound by number, not by order of use.
    sqlx::query(Sqlite::sql("INSERT INTO t (id, v) VALUES ($2, $1)"))
        .bind("second")
        .bind(7_i64)
        .execute(&pool)
        .await
        .unwrap();
    let v: String = sqlx::query(Sqlite::sql("SELECT v FROM t WHERE id = $1"))
        .bind(7_i64)
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, "second");
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
async fn sqlite_pools_skip_the_ping_before_each_statement() {
    // A SQLite connection is a file in this process: the ping (a round trip through its worker
    // thread) can never find it hung up.
    let dir = tempfile::tempdir().unwrap();
    let file = open_sqlite(
        &format!("sqlite://{}?mode=rwc", dir.path().join("x.db").display()),
        SCHEMA,
    )
    .await
    .unwrap();
    let memory = open_sqlite("sqlite::memory:", SCHEMA).await.unwrap();
    for pool in [&file, &memory] {
        assert!(!pool.options().get_test_before_acquire());
        // Statements still run, one after another on the pool's connections.
        for _ in 0..3 {
            sqlx::query("INSERT INTO t (v) VALUES ('x')")
                .execute(pool)
                .await
                .unwrap();
        }
    }
}

/// A PostgreSQL pool of one connection named `application_name`, pinging connections idle for
/// `idle_before_ping` or longer, and a second pool (unnamed) to cut the first one's connection.
async fn named_pool(
    schema: &testing::PgSchema,
    idle_before_ping: Duration,
) -> (sqlx::PgPool, sqlx::PgPool, String) {
    let name = format!("ecoscan-sql-ping-{}", uuid::Uuid::new_v4().simple());
    let url = format!("{}&application_name={name}", schema.url);
    let pool = postgres_pool_options(1, idle_before_ping)
        .connect(&url)
        .await
        .unwrap();
    let admin = postgres_pool_options(1, IDLE_BEFORE_PING)
        .connect(&schema.url)
        .await
        .unwrap();
    (pool, admin, name)
}

/// Terminates the backends named `name`: how many. First waits for every connection of `pool`
/// to be back in it: sqlx pings each on its way back, and a ping that met the cut would close
/// the connection before any statement could.
async fn cut(pool: &sqlx::PgPool, admin: &sqlx::PgPool, name: &str) -> i64 {
    while pool.num_idle() < pool.size() as usize {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sqlx::query(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(name)
    .fetch_one(admin)
    .await
    .unwrap()
    .get(0)
}

async fn select_one(pool: &sqlx::PgPool) -> Result<i32, sqlx::Error> {
    sqlx::query("SELECT 1")
        .fetch_one(pool)
        .await
        .map(|r| r.get(0))
}

#[tokio::test]
async fn a_postgres_connection_idle_long_enough_is_pinged_and_replaced_when_cut() {
    let schema = testing::PgSchema::create().await;
    let idle = Duration::from_millis(100);
    let (pool, admin, name) = named_pool(&schema, idle).await;
    assert!(!pool.options().get_test_before_acquire());
    assert_eq!(select_one(&pool).await.unwrap(), 1);
    assert_eq!(
        cut(&pool, &admin, &name).await,
        1,
        "the pool's one connection is cut"
    );
    // Idle past the threshold: the ping finds the connection dead, the pool opens another,
    // and the statement never sees the cut.
    tokio::time::sleep(idle * 3).await;
    for _ in 0..3 {
        assert_eq!(select_one(&pool).await.unwrap(), 1);
    }
    pool.close().await;
    admin.close().await;
}

#[tokio::test]
async fn a_postgres_connection_used_moments_ago_is_not_pinged_and_a_cut_fails_one_statement() {
    // What the ping no longer does for a busy connection (the price of skipping it): a cut
    // within the threshold meets the next statement, as a transient error, and the pool has a
    // new connection for the one after.
    let schema = testing::PgSchema::create().await;
    let (pool, admin, name) = named_pool(&schema, Duration::from_secs(3600)).await;
    assert_eq!(select_one(&pool).await.unwrap(), 1);
    assert_eq!(cut(&pool, &admin, &name).await, 1);
    let e = select_one(&pool)
        .await
        .expect_err("a statement on a connection cut since its last use, not pinged, fails");
    assert!(
        StoreError::from(e).is_transient(),
        "a cut connection is a transient error (UNAVAILABLE)"
    );
    assert_eq!(select_one(&pool).await.unwrap(), 1);
    pool.close().await;
    admin.close().await;
}

#[tokio::test]
async fn embedded_migrations_are_the_ones_sqlx_reads_from_the_directory() {
    // What sqlx's `migrate!` (and its run-time reader) makes of the same files: equal
    // versions, descriptions and checksums, so databases migrated either way agree.
    let embedded = embedded("_t", include!(concat!(env!("OUT_DIR"), "/migrations.rs")));
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("test-migrations");
    let read = Migrator::new(dir).await.unwrap();
    let summary = |m: &Migrator| -> Vec<(i64, String, Vec<u8>, bool)> {
        m.iter()
            .map(|x| {
                (
                    x.version,
                    x.description.to_string(),
                    x.checksum.to_vec(),
                    x.no_tx,
                )
            })
            .collect()
    };
    assert!(!summary(&read).is_empty());
    assert_eq!(summary(&embedded), summary(&read));
}

#[tokio::test]
async fn migrations_apply_once_into_their_own_table() {
    let schema = testing::PgSchema::create().await;
    let m = crate::migrator!("_sql_test_migrations");
    let store = PgStore {
        service: "sql-test",
        weight: 2,
        direct_url: None,
    };
    let pool = connect_postgres_with(&schema.url, &store, None, &m, &settings(Pooler::None))
        .await
        .unwrap();
    let again = connect_postgres_with(&schema.url, &store, None, &m, &settings(Pooler::None))
        .await
        .unwrap();
    let n: i64 = sqlx::query("SELECT COUNT(*) FROM _sql_test_migrations")
        .fetch_one(&again)
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    pool.close().await;
    again.close().await;
}

fn settings(pooler: Pooler) -> PgSettings {
    PgSettings {
        pooler,
        direct_url: None,
        max_connections: None,
        acquire_timeout: Duration::from_secs(5),
    }
}

#[test]
fn the_budget_splits_by_weight_and_names_its_setting_when_too_small() {
    let suite = [
        ("ingest", 16),
        ("reward", 10),
        ("analytics", 10),
        ("notification", 10),
    ];
    let share = |budget, s| connection_share(budget, &suite, s, 0).unwrap();
    // Unset: each its weight, as before the setting existed.
    assert_eq!(connection_share(None, &suite, "ingest", 16), Ok(16));
    assert_eq!(share(Some(46), "ingest"), 16);
    assert_eq!(share(Some(46), "reward"), 10);
    // 20: 6 + 4 + 4 + 4 = 18, the 2 left over to ingest; never more than the budget.
    assert_eq!(share(Some(20), "ingest"), 8);
    assert_eq!(share(Some(20), "notification"), 4);
    let total: u32 = suite.iter().map(|(s, _)| share(Some(20), s)).sum();
    assert_eq!(total, 20);
    // Alone (not among the process's services), a service has the whole budget.
    assert_eq!(connection_share(Some(7), &[], "reward", 10), Ok(7));
    let err = connection_share(Some(3), &suite, "reward", 10).unwrap_err();
    assert!(err.contains("DATABASE_MAX_CONNECTIONS=3"), "{err}");
}

#[test]
fn the_pooler_setting_names_itself_when_wrong() {
    assert_eq!("transaction".parse(), Ok(Pooler::Transaction));
    assert_eq!("session".parse(), Ok(Pooler::Session));
    assert_eq!("".parse(), Ok(Pooler::None));
    let err = "statement".parse::<Pooler>().unwrap_err();
    assert!(err.contains("DATABASE_POOLER"), "{err}");
    assert_eq!(parse_duration("250"), Some(Duration::from_millis(250)));
    assert_eq!(parse_duration("2s"), Some(Duration::from_secs(2)));
    assert_eq!(parse_duration("2 weeks"), None);
}

#[tokio::test]
async fn in_transaction_mode_statements_are_unnamed_and_each_in_a_transaction() {
    let schema = testing::PgSchema::create().await;
    let m = crate::migrator!("_sql_test_migrations");
    let store = PgStore {
        service: "sql-test",
        weight: 1,
        direct_url: Some(schema.url.clone()),
    };
    let db = connect_postgres_with(
        &schema.url,
        &store,
        None,
        &m,
        &settings(Pooler::Transaction),
    )
    .await
    .unwrap();
    for i in 0..3_i64 {
        let row = sqlx::query("SELECT $1::bigint + 1, txid_current_if_assigned() IS NULL, now() = statement_timestamp()")
            .bind(i)
            .fetch_one(&db)
            .await
            .unwrap();
        assert_eq!(row.get::<i64, _>(0), i + 1);
    }
    // In a transaction: now() is the transaction's start, which an explicit BEGIN fixes before
    // the statement starts.
    let in_tx: bool = sqlx::query("SELECT now() <> statement_timestamp() WHERE $1")
        .bind(true)
        .fetch_one(&db)
        .await
        .unwrap()
        .get(0);
    assert!(in_tx, "the statement ran inside BEGIN … COMMIT");
    let named: i64 = sqlx::query("SELECT COUNT(*) FROM pg_prepared_statements WHERE $1")
        .bind(true)
        .fetch_one(&db)
        .await
        .unwrap()
        .get(0);
    assert_eq!(named, 0, "no statement was kept on the (one) connection");
    // A transaction of the store's own, and one dropped unfinished (its connection is closed,
    // not handed on inside the transaction).
    let mut tx = db.begin().await.unwrap();
    sqlx::query("SELECT $1::int")
        .bind(1)
        .execute(&mut tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let tx = db.begin().await.unwrap();
    drop(tx);
    let v: i32 = sqlx::query("SELECT $1::int")
        .bind(2)
        .fetch_one(&db)
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 2);
    db.close().await;
}

#[tokio::test]
async fn a_transaction_mode_store_without_a_direct_url_names_the_setting() {
    let schema = testing::PgSchema::create().await;
    let m = crate::migrator!("_sql_test_migrations");
    let store = PgStore {
        service: "reward",
        weight: 1,
        direct_url: None,
    };
    let err = connect_postgres_with(
        &schema.url,
        &store,
        None,
        &m,
        &settings(Pooler::Transaction),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("REWARD_DATABASE_DIRECT_URL"), "{err}");
}

#[test]
fn postgres_pools_close_idle_connections_within_half_a_minute() {
    let options = postgres_pool_options(16, IDLE_BEFORE_PING);
    assert_eq!(options.get_idle_timeout(), Some(POOL_IDLE_TIMEOUT));
    assert!(POOL_IDLE_TIMEOUT <= Duration::from_secs(30));
}

#[tokio::test]
async fn a_database_that_answers_errors_is_up_and_one_that_refuses_trips_its_health() {
    use ecoscan_common::store_health::{FaultKind, StoreHealth};

    // Up: statements that succeed, and one the database refuses (a constraint), are answers.
    let schema = testing::PgSchema::create().await;
    let pool = postgres_pool_options(4, IDLE_BEFORE_PING)
        .connect(&schema.url)
        .await
        .unwrap();
    let health = StoreHealth::new("postgres", &schema.url);
    let db = Db::from(pool).with_health(health.clone());
    sqlx::raw_sql("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        .execute(&db)
        .await
        .unwrap();
    for _ in 0..5 {
        let dup = sqlx::query("INSERT INTO t (id) VALUES (1) ON CONFLICT DO NOTHING")
            .execute(&db)
            .await;
        dup.unwrap();
        let violation = sqlx::query("INSERT INTO t (id) VALUES (NULL)")
            .execute(&db)
            .await
            .unwrap_err();
        assert_eq!(fault_kind(&violation), None, "{violation}");
    }
    assert!(health.is_up());
    assert!(FaultKind::ALL.iter().all(|k| health.faults(*k) == 0));
    // Several statements at once open connections; the pool counts them.
    let burst: Vec<_> = (0..4)
        .map(|_| sqlx::query("SELECT pg_sleep(0.2)").execute(&db))
        .collect();
    futures::future::try_join_all(burst).await.unwrap();
    let stats = db.pool_stats();
    assert!(stats.open >= 2 && stats.idle <= stats.open, "{stats:?}");

    // Down: nothing listens at the address.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let url = format!("postgres://postgres:secret@127.0.0.1:{port}/test");
    let pool = postgres_pool_options(1, IDLE_BEFORE_PING)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&url)
        .unwrap();
    let health = StoreHealth::new("postgres", &url);
    let db = Db::from(pool).with_health(health.clone());
    for _ in 0..3 {
        let e = sqlx::query("SELECT 1").execute(&db).await.unwrap_err();
        assert!(fault_kind(&e).is_some(), "a transport fault: {e:?}");
    }
    assert!(health.is_open(), "three faults in a row trip it");
    assert!(!health.address().contains("secret"));
    let down = health.check().unwrap_err();
    assert_eq!(down.store, "postgres");
}
