//! Fencing under a real Redis stall: every service runs as its own process on a private
//! `redis-server` (never the shared one), PostgreSQL (a schema of the test's own) and S3, with a
//! 1 s `INGEST_LEASE` and a slow answer stage. While every job is writing its answer, the test
//! sends `CLIENT PAUSE <2.5 leases> ALL` on a connection of its own: every client of the server
//! stalls past the lease, so the leases of the jobs in flight run out and the job may be claimed
//! again while its first worker still streams its answer. Whoever ends up finishing each job:
//! each stage has exactly one `completed` event, nothing follows `done`, what the SSE clients
//! were sent is the stored result, and each stage that ran once made one recorded model call.

mod common;
mod support;

use std::{collections::HashMap, time::Duration};

use common::{FollowedSse, image_form};
use ecoscan_proto::v1::{EventStatus, JobStatus, ScanEvent, Stage, scan_event::Payload};
use futures::{StreamExt, stream};
use sqlx::{PgPool, Row};
use support::{
    processes::{Cluster, Service},
    stores::{PrivateRedis, TestStores},
};
use tokio::time::Instant;

const JOBS: usize = 6;
const USER: &str = "fencing-user";
const LEASE: Duration = Duration::from_secs(1);
/// The stall: 2.5 leases.
const PAUSE: Duration = Duration::from_millis(2500);
/// The slow stage's model latency: the pause falls well inside it.
const SLOW: Duration = Duration::from_secs(5);
const FAST: Duration = Duration::from_millis(200);
const DEADLINE: Duration = Duration::from_secs(90);

/// `value` with every fractional number rounded to `f32`, as the proto fields are: the gateway
/// writes `0.9` in an SSE event and `0.8999999761581421` in a result for the same `f32`.
fn as_f32(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Number(n) if !(n.is_i64() || n.is_u64()) => n
            .as_f64()
            .map_or(Value::Null, |f| serde_json::json!(f64::from(f as f32))),
        Value::Array(items) => items.iter().map(as_f32).collect(),
        Value::Object(fields) => fields.iter().map(|(k, v)| (k.clone(), as_f32(v))).collect(),
        other => other.clone(),
    }
}

fn count(log: &[ScanEvent], stage: Stage, status: EventStatus) -> usize {
    log.iter()
        .filter(|e| e.stage == stage as i32 && e.status == status as i32)
        .count()
}

/// Model calls recorded per (job, operation), each call id once.
async fn model_calls(pg: &PgPool) -> HashMap<(String, String), (i64, i64)> {
    sqlx::query(
        "SELECT job_id, operation, count(*) AS n, count(DISTINCT call_id) AS d \
         FROM llm_calls GROUP BY job_id, operation",
    )
    .fetch_all(pg)
    .await
    .expect("read llm_calls")
    .iter()
    .map(|r| {
        (
            (r.get("job_id"), r.get("operation")),
            (r.get("n"), r.get("d")),
        )
    })
    .collect()
}

/// The stall hits while every job streams its answer: the workers' appends wait on Redis, time
/// out (`REDIS_RESPONSE_TIMEOUT` is shorter than the stall) and the workers stop; the leases run
/// out during the stall and every job is claimed again and finished by its new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_stall_past_the_lease_mid_answer_leaves_one_completion_per_stage() {
    let started = std::time::Instant::now();
    let redis = PrivateRedis::start().await;
    let stores = TestStores::create(Some(redis.url())).await;
    let cluster = stores
        .configure(Cluster::builder())
        .env("INGEST_LEASE", format!("{}ms", LEASE.as_millis()))
        .env("LLM_MOCK_JITTER", "0")
        // Shorter than the stall, as in production (10 s against a stall of minutes): the
        // stalled commands fail and their connections are replaced instead of waiting it out.
        .env("REDIS_RESPONSE_TIMEOUT", "1s")
        .service_env(
            Service::Vision,
            "LLM_MOCK_LATENCY",
            format!("{}ms", FAST.as_millis()),
        )
        .service_env(
            Service::Answer,
            "LLM_MOCK_LATENCY",
            format!("{}ms", SLOW.as_millis()),
        )
        .start()
        .await;
    let pg = stores.pg().await;
    let mut log_reader = stores.redis().await;

    // Arrange: the jobs, each followed by an SSE client from its start.
    let http = reqwest::Client::new();
    let submit_url = cluster.gateway_url("/api/v1/scan");
    let jobs: Vec<String> = stream::iter(0..JOBS)
        .map(|i| {
            let (http, url) = (http.clone(), submit_url.clone());
            async move {
                let res = http
                    .post(url)
                    .header("x-user-id", USER)
                    .multipart(image_form(if i % 2 == 0 { "can" } else { "pet bottle" }))
                    .send()
                    .await
                    .expect("submit");
                assert_eq!(res.status(), 202);
                let body: serde_json::Value = res.json().await.expect("submit JSON");
                body["job_id"].as_str().expect("job id").to_owned()
            }
        })
        .buffered(JOBS)
        .collect()
        .await;
    let mut clients = tokio::task::JoinSet::new();
    for job in &jobs {
        let (http, job) = (http.clone(), job.clone());
        let url = cluster.gateway_url(&format!("/api/v1/scan/{job}/events"));
        clients.spawn(async move {
            let seen = common::follow_sse(&http, &url, USER, DEADLINE).await;
            (job, seen)
        });
    }

    // Act: once every job streams its answer, stall Redis.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let mut in_stage = 0;
        for job in &jobs {
            let log = stores.event_log(&mut log_reader, job).await;
            let ready = count(&log, Stage::Answer, EventStatus::Delta) > 0;
            if ready {
                in_stage += 1;
            }
        }
        if in_stage == JOBS {
            break;
        }
        assert!(
            Instant::now() < until,
            "every job was streaming its answer within 30 s ({in_stage} of {JOBS})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut raw = stores.redis_node().await;
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(PAUSE.as_millis() as u64)
        .arg("ALL")
        .query_async::<()>(&mut raw)
        .await
        .expect("CLIENT PAUSE");
    let paused_at = Instant::now();

    // Every SSE client reaches the job's end.
    let mut seen: HashMap<String, FollowedSse> = HashMap::new();
    while let Some(joined) = clients.join_next().await {
        let (job, followed) = joined.expect("SSE client");
        seen.insert(job, followed);
    }
    assert!(
        paused_at.elapsed() >= PAUSE,
        "the jobs outlasted the pause (a job cannot end while Redis is paused)"
    );

    // Assert, per job, on its log, its row and what its SSE client was sent.
    let calls = {
        // Reports reach analytics asynchronously.
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let calls = model_calls(&pg).await;
            if calls.len() >= JOBS * 2 || Instant::now() > until {
                break calls;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let mut taken_over = 0;
    for job in &jobs {
        let log = stores.event_log(&mut log_reader, job).await;
        for stage in [Stage::Vision, Stage::Rule, Stage::Answer, Stage::Reward] {
            assert_eq!(
                count(&log, stage, EventStatus::Completed),
                1,
                "job {job}: {stage:?} completed once: {log:#?}"
            );
        }
        assert_eq!(
            count(&log, Stage::Done, EventStatus::Completed),
            1,
            "job {job}: one done: {log:#?}"
        );
        assert_eq!(
            log.last().map(|e| e.stage),
            Some(Stage::Done as i32),
            "job {job}: nothing after done: {log:#?}"
        );
        assert!(
            log.windows(2).all(|w| w[0].seq + 1 == w[1].seq),
            "job {job}: a log without gaps: {log:#?}"
        );

        // The stored result, and the outputs the log carries, are the same.
        let row = sqlx::query("SELECT status, attempts FROM scan_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(&pg)
            .await
            .expect("the job's row");
        assert_eq!(row.get::<i32, _>("status"), JobStatus::Succeeded as i32);
        let attempts: i32 = row.get("attempts");
        if attempts > 1 {
            taken_over += 1;
        }
        let result: serde_json::Value = http
            .get(cluster.gateway_url(&format!("/api/v1/scan/{job}")))
            .header("x-user-id", USER)
            .send()
            .await
            .expect("result")
            .json()
            .await
            .expect("result JSON");
        assert_eq!(result["status"], "succeeded", "{result}");
        for e in log
            .iter()
            .filter(|e| e.status == EventStatus::Completed as i32)
        {
            let (field, output) = match &e.payload {
                Some(Payload::Classification(c)) => ("classification", serde_json::to_value(c)),
                Some(Payload::Rules(r)) => ("rules", serde_json::to_value(r)),
                Some(Payload::Answer(a)) => ("answer", serde_json::to_value(a)),
                Some(Payload::Reward(r)) => ("reward", serde_json::to_value(r)),
                _ => continue,
            };
            assert_eq!(
                as_f32(&output.expect("an output as JSON")),
                as_f32(&result[field]),
                "job {job}: the logged {field} is the stored one"
            );
        }

        // What the SSE client was sent: the log, each event once and in order, ending with
        // `ready`, its outputs the stored ones.
        let followed = &seen[job];
        let sent: Vec<&str> = followed
            .events
            .iter()
            .map(|e| e.id.as_deref().expect("an id"))
            .collect();
        let logged: Vec<&str> = log.iter().map(|e| e.event_id.as_str()).collect();
        assert_eq!(
            sent, logged,
            "job {job}: the SSE client got the log: {followed:#?}"
        );
        assert_eq!(followed.last().map(|e| e.event.as_str()), Some("ready"));
        for output in ["classification", "rules", "answer", "reward"] {
            let outputs: Vec<serde_json::Value> = followed
                .events
                .iter()
                .filter_map(|e| e.data.get(output).map(as_f32))
                .collect();
            assert_eq!(
                outputs,
                vec![as_f32(&result[output])],
                "job {job}: the SSE client was sent {output} once, the stored one"
            );
        }
        let answer_runs = count(&log, Stage::Answer, EventStatus::Started);
        if answer_runs == 1 {
            let text: String = followed
                .events
                .iter()
                .filter_map(|e| e.data.get("delta").and_then(|d| d.as_str()))
                .collect();
            assert_eq!(
                result["answer"]["text"], text,
                "job {job}: the streamed deltas are the stored answer"
            );
        }

        // One recorded model call per stage run (exactly one when it ran once).
        for (operation, stage) in [("classify", Stage::Vision), ("answer", Stage::Answer)] {
            let runs = count(&log, stage, EventStatus::Started) as i64;
            let (n, distinct) = calls
                .get(&(job.clone(), operation.to_owned()))
                .copied()
                .unwrap_or((0, 0));
            assert_eq!(n, distinct, "job {job}: one row per {operation} call id");
            if runs == 1 {
                assert_eq!(n, 1, "job {job}: {operation} ran once, one call recorded");
            } else {
                assert!(
                    (1..=runs).contains(&n),
                    "job {job}: {n} {operation} calls recorded for {runs} runs"
                );
            }
        }
    }
    let ingest_log = cluster.logs(Service::Ingest);
    // A worker that outlived the stall learns it lost the job from its lease keeper, or from
    // its next write being refused (the fence); either way it stops.
    let fenced = ingest_log
        .matches("this worker stops and leaves it to its new owner")
        .count();
    let lost = ingest_log
        .matches("lease lost; leaving the job to its new owner")
        .count();
    assert!(
        taken_over > 0,
        "the stall outlasted the lease: some jobs were claimed again"
    );
    eprintln!(
        "fencing test: {JOBS} jobs, {taken_over} claimed again after the pause, {fenced} \
         stale workers fenced, {lost} stopped by their lease keeper, took {:?}",
        started.elapsed()
    );

    drop(cluster);
    pg.close().await;
    drop(stores);
    drop(redis);
}
