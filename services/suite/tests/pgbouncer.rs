//! `ecoscan up` behind a real PgBouncer (issue 44): a pgbouncer of the test's own on a free
//! loopback port, in front of a fresh database of the test's own, in both pool modes.
//!
//! - Transaction mode (`DATABASE_POOLER=transaction`, migrations through `DATABASE_DIRECT_URL`),
//!   a server pool smaller than the clients: scans run end to end and end `ready`.
//! - Session mode with a server pool far smaller than the suite's connections (46): concurrent
//!   scans all end (`ready`, or failed with an error), none stuck; waiting for a connection is
//!   bounded by `DATABASE_ACQUIRE_TIMEOUT`, and a stage that cannot get one is retried.
//!
//! The test fails (never skips) when pgbouncer is not installed: `infra/test.sh` installs it.

mod common;
mod support;

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{image_form, read_sse};
use sqlx::{AssertSqlSafe, Connection, PgConnection, postgres::PgConnectOptions};
use support::up::Up;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The pgbouncer binary: on the PATH or where Debian's package puts it.
fn pgbouncer_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("pgbouncer"))
            .find(|p| p.is_file())
    });
    on_path
        .or_else(|| Some(PathBuf::from("/usr/sbin/pgbouncer")).filter(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "pgbouncer is not installed: this test runs the suite behind a real PgBouncer \
                 and does not skip. Install it (infra/test.sh does: \
                 `apt-get install -y pgbouncer`) and run again"
            )
        })
}

/// A database of the test's own on the server `TEST_DATABASE_URL` names, dropped at the end.
struct FreshDatabase {
    admin_url: String,
    name: String,
    /// Its URL on the server itself (the direct URL).
    url: String,
    host: String,
    port: u16,
}

impl FreshDatabase {
    async fn create() -> Self {
        let admin_url = std::env::var("TEST_DATABASE_URL")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
        let name = format!("pgb_{}", uuid::Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&admin_url).await.unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {admin_url} ({e}); start it with \
                 infra/services.sh or point TEST_DATABASE_URL at a server"
            )
        });
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        conn.close().await.ok();
        let parsed = reqwest::Url::parse(&admin_url).expect("TEST_DATABASE_URL is a URL");
        let mut url = parsed.clone();
        url.set_path(&name);
        Self {
            host: parsed.host_str().unwrap_or("127.0.0.1").to_owned(),
            port: parsed.port().unwrap_or(5432),
            url: url.to_string(),
            admin_url,
            name,
        }
    }

    /// `(status, count)` of the scan jobs, read on the server itself.
    async fn job_statuses(&self) -> Vec<(i32, i64)> {
        let mut conn = PgConnection::connect(&self.url).await.unwrap();
        sqlx::query_as("SELECT status, COUNT(*) FROM scan_jobs GROUP BY status ORDER BY status")
            .fetch_all(&mut conn)
            .await
            .unwrap()
    }
}

impl Drop for FreshDatabase {
    fn drop(&mut self) {
        let statement = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        let what = format!("drop test database {}", self.name);
        ecoscan_sql::testing::execute_detached(&self.admin_url, statement, &what);
    }
}

/// A pgbouncer of the test's own, killed when dropped.
struct PgBouncer {
    dir: tempfile::TempDir,
    child: Child,
    port: u16,
    dbname: String,
}

impl PgBouncer {
    /// Starts pgbouncer in `pool_mode` with `pool_size` server connections in front of `db`:
    /// the configuration docs/postgres-poolers.md documents, on a free loopback port.
    async fn start(db: &FreshDatabase, pool_mode: &str, pool_size: u32) -> Self {
        let binary = pgbouncer_binary();
        let dir = tempfile::tempdir().expect("temp dir");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let path = |name: &str| dir.path().join(name).display().to_string();
        let ini = format!(
            "[databases]\n\
             {name} = host={host} port={pgport} dbname={name}\n\
             \n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {auth}\n\
             pool_mode = {pool_mode}\n\
             default_pool_size = {pool_size}\n\
             max_client_conn = 500\n\
             query_wait_timeout = 30\n\
             logfile = {log}\n\
             pidfile = {pid}\n",
            name = db.name,
            host = db.host,
            pgport = db.port,
            auth = path("userlist.txt"),
            log = path("pgbouncer.log"),
            pid = path("pgbouncer.pid"),
        );
        std::fs::write(dir.path().join("pgbouncer.ini"), ini).unwrap();
        std::fs::write(dir.path().join("userlist.txt"), "\"postgres\" \"\"\n").unwrap();
        let mut cmd = Command::new(&binary);
        // pgbouncer refuses to run as root: as root, it runs as the postgres user, which must
        // read its files and write its log.
        if is_root() {
            make_readable_by_all(dir.path());
            cmd.arg("-u").arg("postgres");
        }
        let child = cmd
            .arg(dir.path().join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        let mut bouncer = Self {
            dir,
            child,
            port,
            dbname: db.name.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Without extra_float_digits, which pgbouncer refuses as an unknown startup
            // parameter (the services do not send it either).
            let options = bouncer
                .url()
                .parse::<PgConnectOptions>()
                .unwrap()
                .extra_float_digits(None);
            if PgConnection::connect_with(&options).await.is_ok() {
                return bouncer;
            }
            if let Ok(Some(status)) = bouncer.child.try_wait() {
                panic!("pgbouncer exited ({status}):\n{}", bouncer.log());
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not accept connections on port {port} within 10 s:\n{}",
                bouncer.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            self.port, self.dbname
        )
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn make_readable_by_all(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
}

/// Submits `n` scans at once and waits for each one's SSE stream to end (`read_sse` fails a
/// stream still open after 60 s); returns each scan's last event.
async fn scans(up: &Up, n: usize) -> Vec<(String, serde_json::Value)> {
    let url = up.gateway_url("/api/v1/scan/completion");
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let res = reqwest::Client::new()
                    .post(&url)
                    .header("x-user-id", format!("pgbouncer-{i}"))
                    .multipart(image_form("투명 페트병 pet bottle"))
                    .send()
                    .await
                    .expect("scan request");
                if res.status() != 200 {
                    // Refused at submission (the job's row could not be written): an answer
                    // too, as long as it says why.
                    let status = res.status().as_u16();
                    let body = res.text().await.unwrap_or_default();
                    return (format!("http {status}"), serde_json::Value::String(body));
                }
                let events = read_sse(res).await;
                let last = events.last().expect("at least one event");
                (last.event.clone(), last.data.clone())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("scan task"));
    }
    out
}

#[tokio::test]
async fn scans_run_behind_pgbouncer_in_transaction_mode() {
    let db = FreshDatabase::create().await;
    // Fewer server connections than the suite's clients: server connections pass from client
    // to client between transactions, which is what breaks named statements and split Syncs.
    let bouncer = PgBouncer::start(&db, "transaction", 4).await;
    let pooled = bouncer.url();
    let up = Up::start(&[
        ("GATEWAY_TRUST_USER_HEADER", "loopback"),
        ("DATABASE_URL", &pooled),
        ("DATABASE_POOLER", "transaction"),
        ("DATABASE_DIRECT_URL", &db.url),
        ("DATABASE_MAX_CONNECTIONS", "12"),
        ("DATABASE_ACQUIRE_TIMEOUT", "10s"),
    ])
    .await;

    let started = Instant::now();
    for round in 0..2 {
        let ends = scans(&up, 6).await;
        assert!(
            ends.iter().all(|(event, _)| event == "ready"),
            "round {round}: every scan behind the transaction-mode pooler ends ready: {ends:#?}\n\
             --- ecoscan up ---\n{}\n--- pgbouncer ---\n{}",
            up.logs(),
            bouncer.log()
        );
    }
    eprintln!("12 scans ready in {:?}", started.elapsed());
    let statuses = db.job_statuses().await;
    let total: i64 = statuses.iter().map(|(_, n)| n).sum();
    assert_eq!(total, 12, "every scan's job row went through: {statuses:?}");
    let logs = up.logs();
    for broken in ["already exists", "does not exist", "extra_float_digits"] {
        assert!(
            !logs.contains(broken),
            "no statement met another client's server connection ({broken:?}):\n{logs}"
        );
    }
}

/// `ecoscan up` behind a session-mode pgbouncer of 6 server connections in front of a fresh
/// database, with `extra` settings on top of the pooler's.
async fn behind_a_session_pooler(extra: &[(&str, &str)]) -> (FreshDatabase, PgBouncer, Up) {
    let db = FreshDatabase::create().await;
    let bouncer = PgBouncer::start(&db, "session", 6).await;
    let pooled = bouncer.url();
    let mut env = vec![
        ("GATEWAY_TRUST_USER_HEADER", "loopback"),
        ("DATABASE_URL", pooled.as_str()),
        ("DATABASE_POOLER", "session"),
        ("DATABASE_ACQUIRE_TIMEOUT", "2s"),
    ];
    env.extend_from_slice(extra);
    let up = Up::start(&env).await;
    (db, bouncer, up)
}

/// Statuses of finished jobs (ecoscan.v1.JobStatus SUCCEEDED and FAILED).
const FINISHED: [i32; 2] = [3, 4];

/// Behind a 6-connection session-mode pooler with the suite's budget unset (46 connections),
/// every job ends within a bound. What this found: a service whose reload at start met the
/// starved pooler exited, and `ecoscan up` with it, leaving jobs pending; such reads are now
/// tried again until the store answers.
#[tokio::test]
async fn in_session_mode_with_a_small_pool_every_scan_ends() {
    // 6 server connections for a suite that opens up to 46 (16 + 10 + 10 + 10): clients beyond
    // the sixth wait in pgbouncer's queue (cl_waiting) until one disconnects, and in session
    // mode none disconnects while the suite runs.
    let (db, _bouncer, up) = behind_a_session_pooler(&[
        // A job whose store writes fail is run again once its lease lapses, up to its
        // attempts, then failed: short leases and few attempts keep that within the test's
        // bound (defaults 30 s and 5, i.e. minutes).
        ("INGEST_LEASE", "5s"),
        ("INGEST_MAX_ATTEMPTS", "3"),
    ])
    .await;

    let started = Instant::now();
    let ends = scans(&up, 12).await;
    let ready = ends.iter().filter(|(e, _)| e == "ready").count();
    eprintln!(
        "undersized: {ready} of {} streams ended ready after {:?}",
        ends.len(),
        started.elapsed()
    );
    // A client's stream may end early (the gateway's watch of the job failed on the same
    // starved store; a client reconnects with the last event id), so whether every scan ended
    // is read from the jobs: every one finished (succeeded, or failed once its stage's retries
    // were spent), none left pending, within the bound.
    for (event, data) in &ends {
        assert!(
            ["ready", "error", "stage", "http 503"].contains(&event.as_str()),
            "a scan's stream ends with its result, an error or a stage event: {event} {data}"
        );
    }
    let deadline = started + Duration::from_secs(120);
    let statuses = loop {
        let statuses = db.job_statuses().await;
        if statuses.iter().all(|(s, _)| FINISHED.contains(s)) {
            break statuses;
        }
        assert!(
            Instant::now() < deadline,
            "jobs still pending 120 s after submission: {statuses:?}\n--- ecoscan up ---\n{}",
            up.logs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let took = started.elapsed();
    let succeeded: i64 = statuses
        .iter()
        .filter(|(s, _)| *s == FINISHED[0])
        .map(|(_, n)| n)
        .sum();
    let total: i64 = statuses.iter().map(|(_, n)| n).sum();
    eprintln!("undersized: every job finished in {took:?}: {succeeded} of {total} succeeded");
    let refused = ends.iter().filter(|(e, _)| e == "http 503").count();
    assert_eq!(
        total as usize + refused,
        ends.len(),
        "every scan was accepted (and finished) or refused with 503: {statuses:?} {ends:#?}"
    );
    if succeeded < total || refused > 0 {
        // Why, in the log: the wait that ran out names its setting.
        let logs = up.logs();
        assert!(
            logs.contains("DATABASE_ACQUIRE_TIMEOUT"),
            "the store error names the setting that bounds the wait:\n{logs}"
        );
    }
}

/// The same pooler with the process's budget sized to it (DATABASE_MAX_CONNECTIONS = the
/// pool): every scan succeeds.
#[tokio::test]
async fn in_session_mode_with_the_budget_sized_to_the_pool_every_scan_is_ready() {
    let (_db, bouncer, up) = behind_a_session_pooler(&[("DATABASE_MAX_CONNECTIONS", "6")]).await;
    let started = Instant::now();
    let ends = scans(&up, 12).await;
    eprintln!(
        "sized to the pool: {} of 12 scans ready in {:?}",
        ends.iter().filter(|(e, _)| e == "ready").count(),
        started.elapsed()
    );
    assert!(
        ends.iter().all(|(event, _)| event == "ready"),
        "with DATABASE_MAX_CONNECTIONS within the pooler's pool every scan is ready: {ends:#?}\n\
         --- ecoscan up ---\n{}\n--- pgbouncer ---\n{}",
        up.logs(),
        bouncer.log()
    );
}
