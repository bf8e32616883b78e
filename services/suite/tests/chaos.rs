//! Chaos: every service runs as its own process on the production stores — a private
//! `redis-server`, a PostgreSQL schema of the test's own, and a private moto (S3) behind a
//! loopback proxy the test takes down — while 300 scans go in through the gateway, each
//! followed by an SSE client that reconnects with `Last-Event-ID` like a browser's
//! `EventSource`. Meanwhile, in an order and at moments drawn from a seed (`CHAOS_SEED`, printed),
//! one fault at a time:
//!
//! - each service process (gateway, ingest, vision, rule, answer, reward, analytics,
//!   notification) is SIGKILLed and started again, once;
//! - Redis is stopped (SIGSTOP) for 2.5 leases, once;
//! - every PostgreSQL connection of this test's services is terminated (`pg_terminate_backend`
//!   of the connections carrying this test's `application_name`, never anyone else's), once;
//! - the S3 endpoint refuses every connection for 20 s, once.
//!
//! Afterwards: every job ended exactly once (terminal row, one `done` event, last in its log),
//! every SSE client ended with `ready` or `error` having received its job's log once, in order,
//! every model call of a stage is recorded in analytics (once per call id), and no reward was
//! granted twice.

mod common;
mod support;

use std::{
    collections::{BTreeMap, HashMap},
    net::{SocketAddr, TcpListener as StdListener},
    process::{Child, Command, Stdio},
    time::Duration,
};

use common::{FollowedSse, image_form};
use ecoscan_proto::v1::{EventStatus, JobStatus, ScanEvent, Stage};
use sqlx::{PgPool, Row};
use support::{
    processes::{Cluster, Service},
    stores::{PrivateRedis, TestStores},
};
use tokio::{net::TcpStream, time::Instant};

const SCANS: usize = 300;
/// Scans are submitted at an even pace over this long, so that every fault hits scans in flight.
const SUBMIT_OVER: Duration = Duration::from_secs(45);
const USERS: [&str; 4] = ["chaos-ann", "chaos-bo", "chaos-cy", "chaos-di"];
/// Few categories for many scans, so scans of one user contend for the same characters.
const HINTS: [&str; 4] = [
    "투명 페트병 pet bottle",
    "milk carton 우유팩",
    "can 캔",
    "glass bottle 유리병",
];
const LEASE: Duration = Duration::from_secs(2);
const S3_OUTAGE: Duration = Duration::from_secs(20);
/// How long one scan may take from its first submit to its end, faults included.
const SCAN_DEADLINE: Duration = Duration::from_secs(150);
const DEFAULT_SEED: u64 = 0x00c4_a05e_eded;

/// splitmix64: a small reproducible generator (the test must not depend on `rand`'s streams).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi`.
    fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = (hi - lo).as_millis() as u64;
        lo + Duration::from_millis(self.next() % span.max(1))
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Kill(Service),
    PauseRedis,
    TerminatePostgres,
    StopS3,
}

/// A private moto server (S3) on a free loopback port, killed when dropped.
struct Moto {
    child: Child,
    addr: SocketAddr,
}

impl Moto {
    async fn start() -> Self {
        let port = StdListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "moto_server could not start ({e}); this test runs an S3 endpoint of its \
                     own: install it with `python3 -m pip install 'moto[server]'` (see \
                     infra/services.sh)"
                )
            });
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut moto = Self { child, addr };
        let until = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(addr).await.is_err() {
            assert!(
                matches!(moto.child.try_wait(), Ok(None)),
                "moto_server exited before listening on {addr}"
            );
            assert!(
                Instant::now() < until,
                "moto_server did not listen within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        moto
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One scan as its user saw it.
#[derive(Debug)]
struct Scan {
    user: &'static str,
    job_id: String,
    /// Submits answered with a server error (a service down) before one was accepted.
    refused: usize,
    sse: FollowedSse,
}

/// Submits a scan with an idempotency key, again after each failure (a service restarting, S3
/// or Redis away) as a client would, until it is accepted; then follows its events to the end.
async fn scan(http: reqwest::Client, gateway: String, i: usize) -> Scan {
    let user = USERS[i % USERS.len()];
    let hint = HINTS[(i / USERS.len()) % HINTS.len()];
    let key = format!("chaos-{i}");
    let until = Instant::now() + SCAN_DEADLINE;
    let mut refused = 0;
    let job_id = loop {
        assert!(
            Instant::now() < until,
            "scan {i} was not accepted within {SCAN_DEADLINE:?}"
        );
        let sent = http
            .post(format!("{gateway}/api/v1/scan"))
            .header("x-user-id", user)
            .header("idempotency-key", &key)
            .multipart(image_form(hint))
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        match sent {
            Ok(res) if res.status() == 202 => {
                let body: serde_json::Value = res.json().await.expect("submit JSON");
                break body["job_id"].as_str().expect("job_id").to_owned();
            }
            Ok(res) => {
                let status = res.status();
                let body = res.text().await.unwrap_or_default();
                assert!(
                    status.is_server_error(),
                    "scan {i}: submit answered {status}: {body}"
                );
                refused += 1;
            }
            Err(_) => refused += 1,
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let url = format!("{gateway}/api/v1/scan/{job_id}/events");
    let sse = common::follow_sse(&http, &url, user, until - Instant::now()).await;
    Scan {
        user,
        job_id,
        refused,
        sse,
    }
}

fn count(log: &[ScanEvent], stage: Stage, status: EventStatus) -> usize {
    log.iter()
        .filter(|e| e.stage == stage as i32 && e.status == status as i32)
        .count()
}

/// Terminates every PostgreSQL connection named `application_name` (this test's services'
/// only): returns how many.
async fn terminate_connections(pg: &PgPool, application_name: &str) -> i64 {
    sqlx::query(
        "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(application_name)
    .fetch_one(pg)
    .await
    .expect("terminate the services' connections")
    .get("n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scans_survive_every_process_killed_redis_paused_postgres_cut_and_s3_stopped() {
    let started = std::time::Instant::now();
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    eprintln!("chaos test: seed {seed} (set CHAOS_SEED to replay another)");
    let mut rng = Rng(seed);

    let redis = PrivateRedis::start().await;
    let moto = Moto::start().await;
    let s3 = ecoscan_common::testing::CuttingProxy::start(moto.addr).await;
    let mut stores = TestStores::create(Some(redis.url())).await;
    stores.s3_endpoint = format!("http://{}", s3.addr());
    // The test's own connections (this pool) are not named, so terminating the services'
    // connections never touches them, nor any other test's.
    let pg = stores.pg().await;
    let application_name = format!("ecoscan-chaos-{}", stores.schema);
    stores.database_url = format!(
        "{}&application_name={application_name}",
        stores.database_url
    );

    let mut cluster = stores
        .configure(Cluster::builder())
        .env("LLM_MOCK_LATENCY", "300ms")
        .env("INGEST_LEASE", format!("{}ms", LEASE.as_millis()))
        .env("INGEST_MAX_IN_FLIGHT", "16")
        .env("INGEST_SWEEP_INTERVAL", "1s")
        .env("INGEST_SWEEP_GRACE", "2s")
        .env("GATEWAY_SCANS_PER_MINUTE", "100000")
        .env("GATEWAY_MAX_SSE_PER_USER", "1000")
        .start()
        .await;
    let gateway = cluster.uri(Service::Gateway);

    // The scans, at an even pace.
    let http = reqwest::Client::new();
    let mut scans = tokio::task::JoinSet::new();
    {
        let (http, gateway) = (http.clone(), gateway.clone());
        scans.spawn(async move {
            let mut each = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(SUBMIT_OVER / SCANS as u32);
            for i in 0..SCANS {
                tick.tick().await;
                each.spawn(scan(http.clone(), gateway.clone(), i));
            }
            each.join_all().await
        });
    }

    // The faults, one at a time, in a drawn order with drawn pauses between them.
    let mut faults: Vec<Fault> = Service::ALL.into_iter().map(Fault::Kill).collect();
    faults.extend([Fault::PauseRedis, Fault::TerminatePostgres, Fault::StopS3]);
    rng.shuffle(&mut faults);
    let mut timeline = Vec::new();
    tokio::time::sleep(rng.between(Duration::from_secs(2), Duration::from_secs(4))).await;
    for fault in &faults {
        let at = started.elapsed();
        eprintln!("chaos test: {at:.1?} {fault:?}");
        match *fault {
            Fault::Kill(service) => {
                cluster.kill(service);
                // Down for a moment, as a supervisor would restart it.
                tokio::time::sleep(rng.between(Duration::ZERO, Duration::from_secs(1))).await;
                cluster.restart(service).await;
            }
            Fault::PauseRedis => {
                redis.pause();
                tokio::time::sleep(LEASE * 5 / 2).await;
                redis.resume();
            }
            Fault::TerminatePostgres => {
                let terminated = terminate_connections(&pg, &application_name).await;
                assert!(
                    terminated > 0,
                    "the services hold PostgreSQL connections named {application_name}"
                );
                timeline.push(format!("{at:.1?} {fault:?}: {terminated} connections"));
            }
            Fault::StopS3 => {
                s3.set_up(false);
                tokio::time::sleep(S3_OUTAGE).await;
                s3.set_up(true);
            }
        }
        if !matches!(fault, Fault::TerminatePostgres) {
            timeline.push(format!(
                "{at:.1?} {fault:?} (until {:.1?})",
                started.elapsed()
            ));
        }
        tokio::time::sleep(rng.between(Duration::from_millis(500), Duration::from_secs(3))).await;
    }
    let faults_done = started.elapsed();

    let scans: Vec<Scan> = scans
        .join_next()
        .await
        .expect("the scans")
        .expect("every scan ended");
    let scans_done = started.elapsed();

    // Every job ended exactly once: a terminal row, one `done`, last in its log; its SSE client
    // got its log, each event once and in order, and ended with `ready` or `error` as the row
    // says.
    let rows: HashMap<String, i32> = sqlx::query("SELECT id, status FROM scan_jobs")
        .fetch_all(&pg)
        .await
        .expect("job rows")
        .iter()
        .map(|r| (r.get("id"), r.get("status")))
        .collect();
    assert_eq!(
        rows.len(),
        SCANS,
        "one row per scan (idempotent resubmits created none)"
    );
    let mut redis_conn = stores.redis().await;
    let mut logs = HashMap::new();
    let mut by_status: BTreeMap<&str, usize> = BTreeMap::new();
    for scan in &scans {
        let job = &scan.job_id;
        let status = rows[job];
        let log = stores.event_log(&mut redis_conn, job).await;
        assert_eq!(
            count(&log, Stage::Done, EventStatus::Completed)
                + count(&log, Stage::Done, EventStatus::Failed),
            1,
            "job {job}: one done: {log:#?}"
        );
        assert_eq!(
            log.last().map(|e| e.stage),
            Some(Stage::Done as i32),
            "job {job}: nothing after done"
        );
        let ended = scan.sse.last().map(|e| e.event.as_str());
        if status == JobStatus::Succeeded as i32 {
            *by_status.entry("succeeded").or_default() += 1;
            assert_eq!(ended, Some("ready"), "job {job}: {:#?}", scan.sse);
            for stage in [Stage::Vision, Stage::Rule, Stage::Answer, Stage::Reward] {
                assert_eq!(
                    count(&log, stage, EventStatus::Completed),
                    1,
                    "job {job}: {stage:?} completed once: {log:#?}"
                );
            }
        } else {
            assert_eq!(status, JobStatus::Failed as i32, "job {job} is terminal");
            *by_status.entry("failed").or_default() += 1;
            assert_eq!(ended, Some("error"), "job {job}: {:#?}", scan.sse);
            // A fault is transient: the user is told a new try may work.
            let error = &scan.sse.last().expect("the end").data["error"];
            assert_eq!(
                error["retryable"], true,
                "job {job} failed for good because of a transient fault: {error}"
            );
        }
        let sent: Vec<&str> = scan
            .sse
            .events
            .iter()
            .map(|e| e.id.as_deref().unwrap_or_default())
            .collect();
        let logged: Vec<&str> = log.iter().map(|e| e.event_id.as_str()).collect();
        assert_eq!(
            sent, logged,
            "job {job}: the SSE client got its log once, in order: {:#?}",
            scan.sse
        );
        logs.insert(job.clone(), log);
    }

    // No model call lost: every stage that completed has its call recorded, each call once
    // (a stage that ran again may have made, and recorded, a call per run). Reports reach
    // analytics asynchronously, and through its spool after the S3 outage.
    let until = Instant::now() + Duration::from_secs(60);
    let (calls, missing) = loop {
        let calls: HashMap<(String, String), (i64, i64)> = sqlx::query(
            "SELECT job_id, operation, count(*) AS n, count(DISTINCT call_id) AS d \
             FROM llm_calls GROUP BY job_id, operation",
        )
        .fetch_all(&pg)
        .await
        .expect("read llm_calls")
        .iter()
        .map(|r| {
            (
                (r.get("job_id"), r.get("operation")),
                (r.get("n"), r.get("d")),
            )
        })
        .collect();
        let missing: Vec<(String, &str)> = logs
            .iter()
            .flat_map(|(job, log)| {
                [("classify", Stage::Vision), ("answer", Stage::Answer)]
                    .into_iter()
                    .filter(|(_, stage)| count(log, *stage, EventStatus::Completed) > 0)
                    .filter(|(op, _)| !calls.contains_key(&(job.clone(), (*op).to_owned())))
                    .map(|(op, _)| (job.clone(), op))
            })
            .collect();
        if missing.is_empty() || Instant::now() > until {
            break (calls, missing);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        missing.is_empty(),
        "{} model calls of completed stages were never recorded: {missing:?}",
        missing.len()
    );
    for ((job, operation), (n, distinct)) in &calls {
        assert_eq!(n, distinct, "job {job}: one row per {operation} call id");
    }

    // No reward granted twice: one owner row per (user, character), from the one job whose
    // decision says it was newly granted; every eligible decision is the one reward stored.
    let decisions = support::stores::reward_decisions(&pg).await;
    let owned: HashMap<(String, String), String> =
        sqlx::query("SELECT user_id, character_code, job_id FROM owned_characters")
            .fetch_all(&pg)
            .await
            .expect("owned characters")
            .iter()
            .map(|r| ((r.get("user_id"), r.get("character_code")), r.get("job_id")))
            .collect();
    let mut granted: HashMap<(String, String), Vec<String>> = HashMap::new();
    for scan in scans
        .iter()
        .filter(|s| rows[&s.job_id] == JobStatus::Succeeded as i32)
    {
        let result: serde_json::Value = http
            .get(format!("{gateway}/api/v1/scan/{}", scan.job_id))
            .header("x-user-id", scan.user)
            .send()
            .await
            .expect("result")
            .json()
            .await
            .expect("result JSON");
        let reward = &result["reward"];
        if reward["eligible"] != true {
            continue;
        }
        let code = reward["character"]["code"]
            .as_str()
            .expect("a character")
            .to_owned();
        let stored = decisions
            .get(&scan.job_id)
            .unwrap_or_else(|| panic!("job {}: no stored decision", scan.job_id));
        let newly = reward["newly_granted"] == true;
        assert_eq!(
            (stored.0.as_str(), stored.2, stored.3.as_deref()),
            (scan.user, newly, Some(code.as_str())),
            "job {}: its decision is the one reward stored",
            scan.job_id
        );
        if newly {
            granted
                .entry((scan.user.to_owned(), code))
                .or_default()
                .push(scan.job_id.clone());
        }
    }
    assert!(!granted.is_empty(), "some scans earned characters");
    for (key, jobs) in &granted {
        assert_eq!(jobs.len(), 1, "{key:?} was granted once: by {jobs:?}");
        assert_eq!(
            owned.get(key),
            Some(&jobs[0]),
            "{key:?} is owned from its grant"
        );
    }
    assert_eq!(
        owned.len(),
        granted.len(),
        "every owned character was granted by a job"
    );

    // Why the failed ones failed, as their users were told.
    let failures: Vec<String> = scans
        .iter()
        .filter_map(|s| s.sse.last().filter(|e| e.event == "error"))
        .map(|e| {
            e.data["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    let reconnects: usize = scans.iter().map(|s| s.sse.reconnects).sum();
    let refused: usize = scans.iter().map(|s| s.refused).sum();
    let retaken = sqlx::query("SELECT count(*) AS n FROM scan_jobs WHERE attempts > 1")
        .fetch_one(&pg)
        .await
        .expect("attempts")
        .get::<i64, _>("n");
    eprintln!(
        "chaos test (seed {seed}): {SCANS} scans {by_status:?} (failures: {failures:?}); faults:\n  {}\nfaults over at \
         {faults_done:.1?}, scans over at {scans_done:.1?}, checked at {:.1?}; {refused} \
         submits refused and retried, {reconnects} SSE reconnects, {retaken} jobs run more \
         than once, {} characters granted",
        timeline.join("\n  "),
        started.elapsed(),
        granted.len(),
    );

    drop(cluster);
    pg.close().await;
    // The bucket is removed through the proxy, so before it and moto go.
    drop(stores);
    drop(s3);
    drop(moto);
    drop(redis);
}
