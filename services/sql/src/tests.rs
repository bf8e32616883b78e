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
async fn sqlite_pools_skip_the_ping_before_each_statement_and_postgres_pools_keep_it() {
    // A SQLite connection is a file in this process: the ping (a round trip through its worker
    // thread) can never find it hung up. A PostgreSQL pool relies on it to replace connections
    // the server cut without failing a statement.
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
    let schema = testing::PgSchema::create().await;
    let m = crate::migrator!("_sql_ping_migrations");
    let pg = connect_postgres(&schema.url, 2, &m).await.unwrap();
    assert!(pg.options().get_test_before_acquire());
    pg.close().await;
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
