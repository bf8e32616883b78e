//! `ecoscan migrate [SERVICE…]` (the init container of every Kubernetes Deployment with a
//! database) against a real PostgreSQL: every service's schema in one run, tracked per service,
//! a second run changes nothing, one service alone touches nothing else, and a schema newer
//! than the binary is refused. Each test works in a schema of its own (`search_path`), dropped
//! at the end.

use std::process::Output;

use sqlx::{AssertSqlSafe, Connection, PgConnection};

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

fn migrate(database_url: &str) -> Output {
    migrate_only(database_url, &[])
}

/// `ecoscan migrate SERVICE…` (all services when `services` is empty).
fn migrate_only(database_url: &str, services: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"))
        .arg("migrate")
        .args(services)
        .env("DATABASE_URL", database_url)
        // Each service would prefer its own variable: make sure none leaks in from outside.
        .env_remove("INGEST_DATABASE_URL")
        .env_remove("REWARD_DATABASE_URL")
        .env_remove("ANALYTICS_DATABASE_URL")
        .env_remove("NOTIFICATION_DATABASE_URL")
        .env("RUST_LOG", "warn")
        .output()
        .expect("ecoscan migrate runs")
}

async fn applied(conn: &mut PgConnection, schema: &str) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for table in [
        "_ingest_migrations",
        "_reward_migrations",
        "_analytics_migrations",
        "_notification_migrations",
    ] {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {schema}.{table} WHERE success"
        )))
        .fetch_one(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{table} in {schema}: {e}"));
        out.push((table.to_owned(), n));
    }
    out
}

#[tokio::test]
async fn migrate_brings_every_service_schema_up_to_date_once() {
    let (mut conn, schema, url) = own_schema().await;

    let run = |url: String| tokio::task::spawn_blocking(move || migrate(&url));
    let first = run(url.clone()).await.unwrap();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&first.stdout),
        "migrated: ingest, reward, analytics, notification\n"
    );
    let after_first = applied(&mut conn, &schema).await;
    assert!(
        after_first.iter().all(|(_, n)| *n >= 1),
        "every service applied its migrations: {after_first:?}"
    );
    let jobs: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM information_schema.columns \
         WHERE table_schema = '{schema}' AND table_name = 'scan_jobs' AND column_name = 'lease_epoch'"
    )))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(jobs, 1, "ingest's latest migration is there");

    let second = run(url).await.unwrap();
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    assert_eq!(
        applied(&mut conn, &schema).await,
        after_first,
        "a second run applies nothing"
    );

    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.ok();
}

#[tokio::test]
async fn migrate_fails_with_the_service_it_could_not_migrate() {
    // A port nobody listens on (bound, then let go): nothing is sent anywhere else.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/test?connect_timeout=2");
    let out = tokio::task::spawn_blocking(move || migrate(&url))
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("failed to migrate"), "{err}");
}

/// A schema of its own for one test: `(connection, schema, database URL inside it)`.
async fn own_schema() -> (PgConnection, String, String) {
    let base = std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let schema = format!("m_{}", uuid::Uuid::new_v4().simple());
    let mut conn = PgConnection::connect(&base).await.unwrap_or_else(|e| {
        panic!("PostgreSQL is not reachable at {base} ({e}); start it with infra/services.sh")
    });
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut conn)
        .await
        .unwrap();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options[search_path]={schema}");
    (conn, schema, url)
}

#[tokio::test]
async fn migrate_one_service_touches_no_other_and_refuses_a_schema_newer_than_it_knows() {
    let (mut conn, schema, url) = own_schema().await;
    let run = |services: &'static [&'static str]| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || migrate_only(&url, services))
    };

    let out = run(&["reward"]).await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "migrated: reward\n");
    let tables: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = '{schema}' AND table_name LIKE '\\_%migrations' ORDER BY 1"
    )))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(tables, ["_reward_migrations"], "only reward's schema");

    // A later release applied a migration this binary does not have (a rollback to it, or an
    // old pod restarting mid-rollout): the binary refuses rather than serve a schema it does
    // not know.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {schema}._reward_migrations \
         (version, description, success, checksum, execution_time) \
         VALUES (99999999999999, 'from a later release', true, '\\x00', 0)"
    )))
    .execute(&mut conn)
    .await
    .unwrap();
    let out = run(&["reward"]).await.unwrap();
    assert!(!out.status.success(), "a newer schema must be refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("failed to migrate the reward database"),
        "{err}"
    );
    assert!(err.contains("99999999999999"), "{err}");

    // A service without a database is a usage error.
    let out = run(&["rule"]).await.unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rule has no database to migrate"), "{err}");

    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.ok();
}
