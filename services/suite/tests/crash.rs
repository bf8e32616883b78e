//! Crash safety: every service runs as its own process on the production stores (Redis,
//! PostgreSQL, S3; a prefix, schema and bucket per test), 200 scans go in through the gateway,
//! and mid-run something dies:
//!
//! - the ingest process (the pipeline workers) gets SIGKILL and is started again: every job
//!   completes exactly once — one `done` event in its log, its result stored, one reward grant
//!   per (user, character) and one consistent decision per job, and one analytics row per model
//!   call (see [`assert_one_model_call_per_stage_run`] for what "no duplicate rows" means);
//! - Redis is killed and started again empty (a private `redis-server`, never the shared one):
//!   the job rows are the truth, and the sweeper puts every unfinished job back on the queue, so
//!   every job still ends succeeded with its result stored and its reward granted once.

mod common;
mod support;

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use common::image_form;
use ecoscan_common::client::request_as;
use ecoscan_proto::v1::{
    EventStatus, GetResultRequest, JobStatus, ListOwnedRequest, ScanEvent, ScanResult, Stage,
    reward_service_client::RewardServiceClient, scan_service_client::ScanServiceClient,
};
use futures::{StreamExt, TryStreamExt, stream};
use sqlx::{PgPool, Row};
use support::{
    processes::{Cluster, Service},
    stores::{PrivateCluster, PrivateRedis, TestStores, client_names},
};
use tokio::time::Instant;

const SCANS: usize = 200;
const USERS: [&str; 4] = ["crash-ann", "crash-bo", "crash-cy", "crash-di"];
/// Few categories for many scans: each user scans each category several times, so the first
/// scan of a category earns its character and the others contend for it.
const HINTS: [&str; 4] = [
    "투명 페트병 pet bottle",
    "milk carton 우유팩",
    "can 캔",
    "glass bottle 유리병",
];
/// Every tenth scan carries an idempotency key.
const KEYED_EVERY: usize = 10;
/// How long everything may take to finish after the crash (the whole run takes ~10 s).
const FINISH_DEADLINE: Duration = Duration::from_secs(90);
const RPC_DEADLINE: Duration = Duration::from_secs(10);

/// One submitted scan.
#[derive(Clone, Debug)]
struct Scan {
    user: &'static str,
    key: Option<String>,
    job_id: String,
}

/// The production stores and the settings that make a crash show quickly: 300 ms of model
/// latency per call, a 2 s lease (a dead worker's jobs come back 2 s later), a sweeper pass
/// every second.
fn cluster(stores: &TestStores) -> support::processes::ClusterBuilder {
    stores
        .configure(Cluster::builder())
        .env("LLM_MOCK_LATENCY", "300ms")
        .env("INGEST_LEASE", "2s")
        .env("INGEST_MAX_IN_FLIGHT", "16")
        .env("INGEST_SWEEP_INTERVAL", "1s")
        .env("INGEST_SWEEP_GRACE", "2s")
}

/// Submits `SCANS` scans through the gateway, a few at a time; keyed scans are sent twice and
/// must come back as the same job.
async fn submit_all(cluster: &Cluster) -> Vec<Scan> {
    let http = reqwest::Client::new();
    let url = cluster.gateway_url("/api/v1/scan");
    stream::iter(0..SCANS)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let user = USERS[i % USERS.len()];
                let hint = HINTS[(i / USERS.len()) % HINTS.len()];
                let key = (i % KEYED_EVERY == 0).then(|| format!("crash-key-{i}"));
                let first = submit(&http, &url, user, hint, key.as_deref()).await;
                assert_eq!(first["duplicate"], false, "a new scan: {first}");
                let job_id = first["job_id"].as_str().expect("job_id").to_owned();
                if let Some(key) = &key {
                    let again = submit(&http, &url, user, hint, Some(key)).await;
                    assert_eq!(again["job_id"], job_id.as_str(), "same key, same job");
                    assert_eq!(again["duplicate"], true, "{again}");
                }
                Scan { user, key, job_id }
            }
        })
        .buffered(16)
        .collect()
        .await
}

async fn submit(
    http: &reqwest::Client,
    url: &str,
    user: &str,
    hint: &str,
    key: Option<&str>,
) -> serde_json::Value {
    let mut req = http
        .post(url)
        .header("x-user-id", user)
        .multipart(image_form(hint));
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let res = req.send().await.expect("submit request");
    let status = res.status();
    let body = res.text().await.unwrap_or_default();
    assert_eq!(status, 202, "submit answers 202: {body}");
    serde_json::from_str(&body).expect("submit JSON")
}

/// Jobs by status, from the rows (the truth).
async fn status_counts(pg: &PgPool) -> BTreeMap<i32, i64> {
    sqlx::query("SELECT status, count(*) AS n FROM scan_jobs GROUP BY status")
        .fetch_all(pg)
        .await
        .expect("count jobs by status")
        .iter()
        .map(|r| (r.get::<i32, _>("status"), r.get::<i64, _>("n")))
        .collect()
}

fn count(counts: &BTreeMap<i32, i64>, status: JobStatus) -> i64 {
    counts.get(&(status as i32)).copied().unwrap_or(0)
}

/// Polls until `ready(counts)`, failing with the counts at the deadline.
async fn wait_for(
    pg: &PgPool,
    deadline: Duration,
    what: &str,
    ready: impl Fn(&BTreeMap<i32, i64>) -> bool,
) -> BTreeMap<i32, i64> {
    let until = Instant::now() + deadline;
    loop {
        let counts = status_counts(pg).await;
        if ready(&counts) {
            return counts;
        }
        assert!(
            Instant::now() < until,
            "{what} within {deadline:?}; jobs by status (1 queued, 2 running, 3 succeeded, \
             4 failed): {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until some jobs are done and many are queued or running: the moment to crash.
async fn wait_mid_run(pg: &PgPool) -> BTreeMap<i32, i64> {
    wait_for(
        pg,
        Duration::from_secs(60),
        "the run reached its middle",
        |c| {
            count(c, JobStatus::Succeeded) >= 30
                && count(c, JobStatus::Running) >= 4
                && count(c, JobStatus::Queued) + count(c, JobStatus::Running) >= 60
        },
    )
    .await
}

async fn wait_all_finished(pg: &PgPool) {
    let counts = wait_for(pg, FINISH_DEADLINE, "every job finished", |c| {
        count(c, JobStatus::Succeeded) + count(c, JobStatus::Failed) >= SCANS as i64
    })
    .await;
    assert_eq!(
        counts.values().sum::<i64>(),
        SCANS as i64,
        "exactly one row per scan (idempotent repeats created none): {counts:?}"
    );
    assert_eq!(
        count(&counts, JobStatus::Succeeded),
        SCANS as i64,
        "every job succeeded: {counts:?}"
    );
}

/// Every job's stored result, read back through `GetResult` as its owner: succeeded, with
/// every stage's output.
async fn results(cluster: &Cluster, scans: &[Scan]) -> HashMap<String, ScanResult> {
    let client = ScanServiceClient::new(
        ecoscan_common::client::channel(&cluster.uri(Service::Ingest)).expect("ingest channel"),
    );
    stream::iter(scans)
        .map(|scan| {
            let mut client = client.clone();
            async move {
                let res = client
                    .get_result(request_as(
                        GetResultRequest {
                            job_id: scan.job_id.clone(),
                        },
                        RPC_DEADLINE,
                        scan.user,
                    ))
                    .await
                    .unwrap_or_else(|s| panic!("GetResult {}: {s:?}", scan.job_id))
                    .into_inner()
                    .result
                    .unwrap_or_else(|| {
                        panic!("GetResult {} answered without a result", scan.job_id)
                    });
                assert_eq!(
                    res.status,
                    JobStatus::Succeeded as i32,
                    "job {} succeeded: {res:?}",
                    scan.job_id
                );
                assert_eq!(res.stage, Stage::Done as i32, "{res:?}");
                assert!(
                    res.classification.is_some()
                        && res.rules.is_some()
                        && res.answer.as_ref().is_some_and(|a| !a.text.is_empty())
                        && res.reward.is_some()
                        && res.error.is_none(),
                    "job {} has every stage's output: {res:?}",
                    scan.job_id
                );
                Ok::<_, ()>((scan.job_id.clone(), res))
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await
        .expect("results")
}

/// One grant per (user, character), and each job's decision consistent with the reward
/// service's record: the checkpointed decision is the one stored, exactly one job per (user,
/// character) says `newly_granted`, and `ListOwned` shows exactly those grants with their jobs.
/// Returns how many (user, character) pairs were contended (earned by more than one scan).
async fn assert_rewards_granted_once(
    cluster: &Cluster,
    pg: &PgPool,
    scans: &[Scan],
    results: &HashMap<String, ScanResult>,
) -> usize {
    let stored = support::stores::reward_decisions(pg).await;

    // (user, character) -> (jobs that earned it, jobs that were granted it)
    let mut earned: HashMap<(&str, String), (usize, Vec<&str>)> = HashMap::new();
    for scan in scans {
        let decision = results[&scan.job_id].reward.clone().expect("reward");
        if !decision.eligible {
            assert!(
                stored
                    .get(&scan.job_id)
                    .is_none_or(|(_, eligible, _, _)| !eligible),
                "job {} was not eligible, and the reward service agrees",
                scan.job_id
            );
            continue;
        }
        let code = decision.character.as_ref().expect("character").code.clone();
        let row = stored
            .get(&scan.job_id)
            .unwrap_or_else(|| panic!("no stored decision for eligible job {}", scan.job_id));
        assert_eq!(
            (
                row.0.as_str(),
                row.1,
                row.2,
                row.3.as_deref().unwrap_or_default()
            ),
            (scan.user, true, decision.newly_granted, code.as_str()),
            "job {}'s checkpointed decision is the one the reward service stored",
            scan.job_id
        );
        let entry = earned.entry((scan.user, code)).or_default();
        entry.0 += 1;
        if decision.newly_granted {
            entry.1.push(&scan.job_id);
        }
    }
    assert!(!earned.is_empty(), "some scans earned characters");
    for ((user, code), (_, granted)) in &earned {
        assert_eq!(
            granted.len(),
            1,
            "{user} was granted {code} exactly once: by jobs {granted:?}"
        );
    }

    let mut reward = RewardServiceClient::new(
        ecoscan_common::client::channel(&cluster.uri(Service::Reward)).expect("reward channel"),
    );
    for user in USERS {
        let owned = reward
            .list_owned(request_as(ListOwnedRequest {}, RPC_DEADLINE, user))
            .await
            .expect("ListOwned")
            .into_inner()
            .characters;
        let listed: Vec<(String, String)> = owned
            .iter()
            .map(|o| {
                (
                    o.character.as_ref().expect("character").code.clone(),
                    o.job_id.clone(),
                )
            })
            .collect();
        let mut expected: Vec<(String, String)> = earned
            .iter()
            .filter(|((u, _), _)| *u == user)
            .map(|((_, code), (_, granted))| (code.clone(), granted[0].to_owned()))
            .collect();
        let mut got = listed.clone();
        got.sort();
        expected.sort();
        assert_eq!(
            got, expected,
            "{user} owns each earned character once, from the job that was granted it"
        );
    }
    earned.values().filter(|(n, _)| *n > 1).count()
}

/// Reads each job's events through the gateway (SSE from the start, as its owner): the stream
/// ends with `ready`.
async fn assert_sse_ends_ready(cluster: &Cluster, scans: &[Scan]) {
    let http = reqwest::Client::new();
    stream::iter(scans)
        .for_each_concurrent(16, |scan| {
            let http = http.clone();
            async move {
                let res = http
                    .get(cluster.gateway_url(&format!("/api/v1/scan/{}/events", scan.job_id)))
                    .header("x-user-id", scan.user)
                    .send()
                    .await
                    .expect("events request");
                let events = common::read_sse(res).await;
                assert_eq!(
                    events.last().map(|e| e.event.as_str()),
                    Some("ready"),
                    "job {}'s SSE stream ends with ready: {events:#?}",
                    scan.job_id
                );
            }
        })
        .await;
}

/// "No duplicate analytics rows for the same call": every model call is recorded once (its
/// `call_id` is unique), and a job has exactly as many calls per operation as its stage ran.
/// A stage that ran again after the crash may legitimately call the model again (the first
/// call's result was never checkpointed), and a call cut short by the crash may never be
/// reported, so a job has between 1 and (times its stage started) rows per operation — and
/// exactly 1 when the stage ran once. More rows than runs would be a duplicate.
async fn assert_one_model_call_per_stage_run(
    pg: &PgPool,
    logs: &HashMap<String, Vec<ScanEvent>>,
) -> usize {
    let expected_rows = logs.len() * 2;
    // Reports reach analytics asynchronously; wait until every job's calls are in.
    let until = Instant::now() + Duration::from_secs(30);
    let rows = loop {
        let rows: Vec<(String, String, i64, i64)> = sqlx::query(
            "SELECT job_id, operation, count(*) AS n, count(DISTINCT call_id) AS d \
             FROM llm_calls GROUP BY job_id, operation",
        )
        .fetch_all(pg)
        .await
        .expect("read llm_calls")
        .iter()
        .map(|r| (r.get("job_id"), r.get("operation"), r.get("n"), r.get("d")))
        .collect();
        let complete = rows
            .iter()
            .filter(|(job, _, _, _)| logs.contains_key(job))
            .count();
        if complete >= expected_rows || Instant::now() > until {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let by_key: HashMap<(&str, &str), (i64, i64)> = rows
        .iter()
        .map(|(j, o, n, d)| ((j.as_str(), o.as_str()), (*n, *d)))
        .collect();
    let mut rerun = 0;
    for (job, log) in logs {
        for (operation, stage) in [("classify", Stage::Vision), ("answer", Stage::Answer)] {
            let runs = log
                .iter()
                .filter(|e| e.stage == stage as i32 && e.status == EventStatus::Started as i32)
                .count() as i64;
            let (n, distinct) = by_key
                .get(&(job.as_str(), operation))
                .copied()
                .unwrap_or((0, 0));
            assert_eq!(n, distinct, "job {job}: one row per {operation} call id");
            assert!(
                n >= 1 && n <= runs,
                "job {job}: {n} {operation} rows for {runs} runs of its stage"
            );
            if runs > 1 {
                rerun += 1;
            }
        }
    }
    rerun
}

/// ingest's connections to the test's Redis, by the name it gives them.
async fn ingest_connections<C: redis::aio::ConnectionLike>(redis: &mut C) -> usize {
    client_names(redis)
        .await
        .iter()
        .filter(|n| n.starts_with("ecoscan-ingest:"))
        .count()
}

/// SIGKILL of ingest mid-run, then a restart: every job completes exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_job_completes_exactly_once_when_ingest_is_killed_mid_run() {
    ingest_killed_mid_run(TestStores::create(None).await).await;
}

/// The same on a private three-master Redis Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_job_completes_exactly_once_when_ingest_is_killed_mid_run_on_a_redis_cluster() {
    let redis = PrivateCluster::start().await;
    ingest_killed_mid_run(TestStores::create_on(redis.settings()).await).await;
    drop(redis);
}

async fn ingest_killed_mid_run(stores: TestStores) {
    let started = std::time::Instant::now();
    let mut cluster = cluster(&stores).start().await;
    let pg = stores.pg().await;

    let scans = submit_all(&cluster).await;
    let at_kill = wait_mid_run(&pg).await;
    cluster.kill(Service::Ingest);
    // The jobs the dead process was running: they must be resumed, not lost or run twice.
    let interrupted: Vec<String> =
        sqlx::query("SELECT id FROM scan_jobs WHERE status = $1 ORDER BY id")
            .bind(JobStatus::Running as i32)
            .fetch_all(&pg)
            .await
            .expect("running jobs")
            .iter()
            .map(|r| r.get("id"))
            .collect();
    assert!(!interrupted.is_empty(), "the kill hit jobs in flight");
    cluster.restart(Service::Ingest).await;

    wait_all_finished(&pg).await;

    // Idempotency keys still map to their first job after the crash.
    let http = reqwest::Client::new();
    let url = cluster.gateway_url("/api/v1/scan");
    for (i, scan) in scans.iter().enumerate().filter(|(_, s)| s.key.is_some()) {
        let hint = HINTS[(i / USERS.len()) % HINTS.len()];
        let again = submit(&http, &url, scan.user, hint, scan.key.as_deref()).await;
        assert_eq!(again["job_id"], scan.job_id.as_str(), "{again}");
        assert_eq!(again["duplicate"], true, "{again}");
    }

    let results = results(&cluster, &scans).await;
    let contended = assert_rewards_granted_once(&cluster, &pg, &scans, &results).await;
    assert!(contended > 0, "several scans contended for a character");

    // Exactly one terminal event per job, and it is the last one.
    let mut logs = HashMap::new();
    let mut redis = stores.redis().await;
    for scan in &scans {
        let log = stores.event_log(&mut redis, &scan.job_id).await;
        let done: Vec<&ScanEvent> = log
            .iter()
            .filter(|e| e.stage == Stage::Done as i32)
            .collect();
        assert_eq!(
            done.len(),
            1,
            "job {} has exactly one done event: {done:#?}",
            scan.job_id
        );
        assert_eq!(done[0].status, EventStatus::Completed as i32);
        assert_eq!(
            log.last().map(|e| e.stage),
            Some(Stage::Done as i32),
            "job {}: nothing after done",
            scan.job_id
        );
        logs.insert(scan.job_id.clone(), log);
    }
    assert_sse_ends_ready(&cluster, &scans).await;

    let rerun = assert_one_model_call_per_stage_run(&pg, &logs).await;
    let attempts: HashMap<String, i32> = sqlx::query("SELECT id, attempts FROM scan_jobs")
        .fetch_all(&pg)
        .await
        .expect("attempts")
        .iter()
        .map(|r| (r.get("id"), r.get("attempts")))
        .collect();
    for id in &interrupted {
        assert!(
            attempts[id] >= 2,
            "interrupted job {id} was resumed by the new process (attempts {})",
            attempts[id]
        );
    }
    eprintln!(
        "crash test: killed at {at_kill:?} (status: count), {} jobs interrupted, {rerun} \
         stages re-run, {} scans took {:?}",
        interrupted.len(),
        scans.len(),
        started.elapsed()
    );

    drop(cluster);
    pg.close().await;
    drop(stores);
}

/// Redis dies mid-run and comes back empty: the queue, the leases and the event logs are gone,
/// but the rows are not, and the sweeper finishes every job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sweeper_finishes_every_job_when_redis_restarts_empty() {
    let started = std::time::Instant::now();
    let mut redis = PrivateRedis::start().await;
    let stores = TestStores::create(Some(redis.url())).await;
    let cluster = cluster(&stores)
        .env("INGEST_SWEEP_GRACE", "1s")
        .start()
        .await;
    let pg = stores.pg().await;

    let mut observer = stores.redis_node().await;
    let connections_before = ingest_connections(&mut observer).await;
    assert!(
        (1..=4).contains(&connections_before),
        "ingest holds a few named Redis connections: {:?}",
        client_names(&mut observer).await
    );

    let scans = submit_all(&cluster).await;
    let at_restart = wait_mid_run(&pg).await;
    redis.kill();
    redis.start_again().await;
    wait_all_finished(&pg).await;
    let results = results(&cluster, &scans).await;
    let contended = assert_rewards_granted_once(&cluster, &pg, &scans, &results).await;
    assert!(contended > 0, "several scans contended for a character");
    // Watchers still get an end for every job: from the log, or from the row when the log was
    // lost with Redis.
    assert_sse_ends_ready(&cluster, &scans).await;
    assert!(
        cluster
            .logs(Service::Ingest)
            .contains("re-enqueued an unfinished job"),
        "the sweeper re-enqueued the jobs Redis lost"
    );
    // ingest reconnected, with as many connections as before, every one named again (names
    // are set again every few seconds).
    let mut observer = stores.redis_node().await;
    let until = Instant::now() + Duration::from_secs(15);
    while ingest_connections(&mut observer).await != connections_before && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        ingest_connections(&mut observer).await,
        connections_before,
        "ingest holds its named Redis connections again: {:?}",
        client_names(&mut observer).await
    );

    // What the log kept after the restart never says a job ended twice.
    let mut logs = stores.redis().await;
    for scan in &scans {
        let log = stores.event_log(&mut logs, &scan.job_id).await;
        let done = log.iter().filter(|e| e.stage == Stage::Done as i32).count();
        assert!(
            done <= 1,
            "job {} has {done} done events: {log:#?}",
            scan.job_id
        );
    }
    eprintln!(
        "redis restart test: restarted at {at_restart:?} (status: count), {} scans took {:?}",
        scans.len(),
        started.elapsed()
    );

    drop(cluster);
    pg.close().await;
    drop(stores);
    drop(redis);
}
